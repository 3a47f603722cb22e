"""`perpetuity try`: what the model would have seen, with no key and no network.

A stand-in provider on 127.0.0.1 answers every request with a scripted line; the real proxy
(mitmdump with the addon) runs in front of it with a throwaway memory. A short conversation is
told, a question is asked in a new one, and the request the stand-in received for it is
printed: the frame the question got, then the question."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from perpetuity_core.cli.proxy import ADDON_SCRIPT, mitmdump_path
from perpetuity_core.errors import PerpetuityError

TOLD = [
    ("I'm planning a trip to Lisbon in May with my sister Ada.",
     "Lisbon in May is lovely: warm days, and the summer crowds have not arrived yet."),
    ("Ada is allergic to shellfish, so we need restaurants with other good options.",
     "Noted: I'll leave out the seafood-only places and look for grills and vegetarian menus."),
    ("We booked a flat in Alfama, on Rua dos Remedios, for five nights.",
     "Good choice: Alfama is a short walk from the castle and the river."),
]
ASKED = "Which restaurants near where we're staying would suit Ada?"
SYSTEM = "You are a helpful travel assistant."


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("try", help="see the frame a question gets, with no key and no network",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=run_try)


class StandIn(ThreadingHTTPServer):
    """The provider's place: Anthropic Messages, not streamed, one scripted reply a request."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.replies: deque[str] = deque()
        self.received: list[dict[str, Any]] = []


class _Answer(BaseHTTPRequestHandler):
    server: StandIn

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        self.server.received.append(body)
        text = self.server.replies.popleft() if self.server.replies else "(the stand-in's reply)"
        reply = json.dumps({
            "id": f"msg_try_{len(self.server.received)}", "type": "message", "role": "assistant",
            "model": body.get("model", ""), "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        pass


def run_try(args: argparse.Namespace) -> int:
    print("perpetuity: a stand-in provider and the proxy, with a throwaway memory (no key, no"
          " network); a few seconds", file=sys.stderr)
    stand_in = StandIn()
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="perpetuity-try-") as tmp:
        proxy = _start_proxy(Path(tmp), f"http://127.0.0.1:{stand_in.server_port}")
        try:
            with httpx.Client(base_url=proxy[1], trust_env=False, timeout=30) as client:
                _converse(client, stand_in, Path(tmp) / "memory.db")
            print(_report(stand_in.received[-1]))
        finally:
            proxy[0].terminate()
            proxy[0].wait(10)
            stand_in.shutdown()
    return 0


def _start_proxy(tmp: Path, upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [mitmdump_path(), "-q", "-s", str(ADDON_SCRIPT), "--listen-host", "127.0.0.1",
           "--listen-port", str(port), "--set", f"confdir={tmp / 'mitmproxy'}",
           "--set", f"perpetuity_db={tmp / 'memory.db'}",
           "--set", f"perpetuity_notes_dir={tmp / 'notes'}",
           "--set", f"perpetuity_anthropic_upstream={upstream}"]
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    log = tmp / "mitmdump.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if b"perpetuity: listening" in log.read_bytes():
            return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    lines = log.read_text(errors="replace").strip().splitlines() or ["no output"]
    raise PerpetuityError(f"the proxy did not start: {lines[-1]}")


def _converse(client: httpx.Client, stand_in: StandIn, db: Path) -> None:
    """The told conversation (dated yesterday, each request re-sending its history as a
    harness does), then the question in a new conversation once every turn is stored."""
    yesterday = (datetime.now(UTC) - timedelta(days=1)).isoformat(timespec="seconds")
    history: list[dict[str, str]] = []
    for said, answer in TOLD:
        history.append({"role": "user", "content": said})
        stand_in.replies.append(answer)
        _send(client, history, {"x-perpetuity-conversation": "try-told",
                                "x-perpetuity-time": yesterday})
        history.append({"role": "assistant", "content": answer})
    _wait_stored(db, 2 * len(TOLD))
    _send(client, [{"role": "user", "content": ASKED}], {"x-perpetuity-conversation": "try-asked"})


def _send(client: httpx.Client, messages: list[dict[str, str]], headers: dict[str, str]) -> None:
    r = client.post("/v1/messages", headers={"x-api-key": "no-key-needed",
                                             "anthropic-version": "2023-06-01", **headers},
                    json={"model": "claude-sonnet-4-5", "max_tokens": 256, "system": SYSTEM,
                          "messages": messages})
    if r.status_code != 200:
        raise PerpetuityError(f"the proxy answered {r.status_code}: {r.text[:200]}")


def _wait_stored(db: Path, messages: int) -> None:
    """A reply is stored a moment after the client has it: wait for the last one."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
                if conn.execute("SELECT count(*) FROM message").fetchone()[0] >= messages:
                    return
        except sqlite3.OperationalError:
            pass  # not created yet, or being written: read again
        time.sleep(0.05)
    raise PerpetuityError(f"the told conversation was not stored in {db} within 30 s")


def _report(body: dict[str, Any]) -> str:
    out = ["Told yesterday, in one conversation:"]
    for said, answer in TOLD:
        out += [f"  user: {said}", f"  assistant: {answer}"]
    out += ["", "Asked now, in a new conversation (the harness sends only this):",
            f"  user: {ASKED}", "",
            f"What the model received ({len(body.get('messages', []))} messages, the frame first):"]
    for m in body.get("messages", []):
        out.append(f"--- {m.get('role')} ---")
        out.append(_text(m.get("content")))
    tools = [t.get("name", "") for t in body.get("tools", [])]
    if tools:
        out += ["", f"Recall tools the proxy added: {', '.join(tools)}"]
    return "\n".join(out)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(str(b.get("text", f"[{b.get('type')}]")) for b in content or [])

