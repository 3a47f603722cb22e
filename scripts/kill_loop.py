"""Crash safety: kill -9 a proxy that is ingesting at full speed, restart it, and check that
every turn is stored exactly once.

Clients (threads, one conversation each) stream Anthropic turns through a real mitmdump with
the addon, as fast as the fake provider answers, each re-sending its whole history, as a
harness does. The proxy is killed with SIGKILL at a random moment, `kills` times, and
restarted on the same port and database; after each restart `memory check` runs against the
live file. A request that failed with the kill is retried as sent (a harness's retry), then
the conversation goes on. At the end every conversation is continued once more and the
store is compared with what the clients sent and received:
  - each user turn stored exactly once, in order ("twice" and "lost" count the others);
  - each reply the client received stored exactly once (a reply stored by the proxy whose
    bytes never reached the client before the kill is an "orphan": its turn was retried);
  - no partial message: every stored message's text is one the clients sent or received
    whole, or a reply cut by the kill (stored as incomplete).

    .venv/bin/python scripts/kill_loop.py --kills 50 [--clients 2] [--seed 1] [--no-tools]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perpetuity_core.memory.schema import open_memory
from tests.conftest import Proxy, free_port, start_proxy  # noqa: E402
from tests.fake_provider import FakeProvider, Text  # noqa: E402

WORDS = ["garden", "violin", "harbour", "lantern", "copper", "meadow", "thunder", "pepper", "orbit", "canvas", "willow", "marble", "falcon", "ember", "quartz", "saddle"]


class Client(threading.Thread):
    """One conversation, turn after turn, retrying a failed request as it was sent."""

    def __init__(self, name: str, base: list[str], stop: threading.Event, seed: int) -> None:
        super().__init__(daemon=True)
        self.name_ = name
        self.base = base  # [url]: the current proxy (the port stays, the process changes)
        self.stop = stop
        self.rng = random.Random(seed)
        self.history: list[dict] = []
        self.failures = 0

    def run(self) -> None:
        turn = 0
        while not self.stop.is_set():
            words = " ".join(self.rng.choices(WORDS, k=8))
            self.history.append({"role": "user", "content": f"{self.name_} turn {turn}: {words}"})
            while not self.stop.is_set():
                reply = self.send()
                if reply is not None:
                    self.history.append({"role": "assistant", "content": reply})
                    break
                self.failures += 1
                time.sleep(0.05)
            turn += 1

    def send(self) -> str | None:
        """The whole history, streamed; the reply's text, or None when the stream failed."""
        body = {"model": "claude-opus-4-8", "max_tokens": 64, "stream": True,
                "messages": self.history}
        headers = {"x-api-key": "sk-ant-kill-loop", "anthropic-version": "2023-06-01",
                   "x-perpetuity-user": "kill-loop", "x-perpetuity-conversation": self.name_}
        text, done = [], False
        try:
            with httpx.stream("POST", self.base[0] + "/v1/messages", json=body,
                              headers=headers, timeout=30) as r:
                if r.status_code != 200:
                    return None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event.get("type") == "content_block_delta":
                        text.append(event["delta"].get("text", ""))
                    elif event.get("type") == "message_stop":
                        done = True
        except (httpx.HTTPError, json.JSONDecodeError):
            return None
        return "".join(text) if done else None


def check_memory(db: Path) -> list[str]:
    """`perpetuity memory check` against the live file (a second process: this one)."""
    from perpetuity_core.memory.integrity import check

    store = open_memory(db)
    try:
        return check(store)
    finally:
        store.close()


def stored(db: Path) -> dict[str, list[tuple[str, str, int]]]:
    """Per conversation: (role, text, complete) of each stored message, in store order."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    out: dict[str, list[tuple[str, str, int]]] = {}
    for key, role, text, complete in con.execute(
            "SELECT c.key, m.role, group_concat(i.text, ''), m.complete FROM message m"
            " JOIN conversation c ON c.id = m.conversation_id JOIN item i ON i.message_id = m.id"
            " GROUP BY m.id ORDER BY m.id"):
        out.setdefault(key, []).append((role, text, complete))
    con.close()
    return out


def tally(clients: list[Client], db: Path) -> dict[str, int]:
    """Compare the store with what the clients sent and received."""
    got = stored(db)
    t = {"user_turns": 0, "user_twice": 0, "user_lost": 0, "replies": 0, "replies_twice": 0,
         "replies_lost": 0, "orphan_replies": 0, "cut_replies": 0, "partial_messages": 0,
         "out_of_order": 0}
    for c in clients:
        rows = got.get(c.name_, [])
        for role, key in (("user", "user"), ("assistant", "replies")):
            sent = [m["content"] for m in c.history if m["role"] == role]
            have = [text for r, text, _ in rows if r == role]
            t["user_turns" if role == "user" else "replies"] += len(sent)
            for text in set(sent):
                n = have.count(text)
                t[f"{key}_twice"] += max(0, n - 1)
                t[f"{key}_lost"] += n == 0
            if role == "user" and [h for h in have if h in sent] != sent:
                t["out_of_order"] += 1
            for _text, complete in ((x, k) for r, x, k in rows if r == role and x not in sent):
                # A reply the client never got whole: stored complete, the orphan of a retried
                # turn; stored incomplete, a stream the kill cut. Anything else is partial.
                if role == "assistant":
                    t["orphan_replies" if complete else "cut_replies"] += 1
                else:
                    t["partial_messages"] += 1
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-gap", type=float, default=0.3, help="seconds of ingest before a kill")
    ap.add_argument("--max-gap", type=float, default=2.0)
    ap.add_argument("--no-tools", action="store_true",
                    help="recall tools off: replies on mitmproxy's own stream, not the relay")
    args = ap.parse_args()
    extra = ("--set", "perpetuity_tools=false") if args.no_tools else ()
    rng = random.Random(args.seed)
    checks_failed: list[str] = []
    with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
        fake.script(*(Text(f"reply {i}: " + " ".join(rng.choices(WORDS, k=6)), chunks=3)
                      for i in range(200_000)))
        port = free_port()
        proxy: Proxy = start_proxy(Path(tmp), fake.url, *extra, port=port)
        base = [proxy.url]
        stop = threading.Event()
        clients = [Client(f"conv-{i}", base, stop, args.seed * 100 + i)
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        restarts = []
        for _ in range(args.kills):
            time.sleep(rng.uniform(args.min_gap, args.max_gap))
            os.kill(proxy.process.pid, signal.SIGKILL)
            proxy.process.wait()
            t0 = time.perf_counter()
            proxy = start_proxy(Path(tmp), fake.url, *extra, port=port)
            restarts.append(time.perf_counter() - t0)
            checks_failed += check_memory(proxy.db)
        stop.set()
        for c in clients:
            c.join(60)
        # Each conversation continued once: the whole history re-sent with one more turn.
        for c in clients:
            c.stop = threading.Event()
            c.history.append({"role": "user", "content": f"{c.name_} continued after the kills"})
            while (reply := c.send()) is None:
                time.sleep(0.1)
            c.history.append({"role": "assistant", "content": reply})
        time.sleep(1.0)  # the last reply is written just after the client saw it
        checks_failed += check_memory(proxy.db)
        result = {"kills": args.kills, "clients": args.clients, "tools": not args.no_tools,
                  "failed_requests_retried": sum(c.failures for c in clients),
                  **tally(clients, proxy.db), "check_violations": checks_failed,
                  "restart_s_p50": round(sorted(restarts)[len(restarts) // 2], 2)
                  if restarts else None}
        proxy.process.terminate()
        proxy.process.wait(10)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
