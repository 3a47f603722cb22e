"""A real mitmweb running the addon, the official SDKs sending through it, driven by its REST
API: every flow listed with its comment, the hidden tool rounds as linked flows, a flow's
content through the `perpetuity` view; the flow file it saved reopened with `mitmdump -nr`;
and, where Chromium is installed, a screenshot of mitmweb showing a Perpetuity flow."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ROOT, free_port, owned
from tests.fake_provider import FakeProvider, Text, ToolCall
from tests.test_websocket import exchanged

BIN = Path(sys.executable).parent
TOKEN = "perpetuity-test"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Where the README's screenshot comes from: set to refresh docs/ from a run.
SCREENSHOT_OUT = os.environ.get("PERPETUITY_SCREENSHOT")


@dataclass
class Web:
    proxy: str
    web: str
    flows_file: Path
    db: Path
    process: subprocess.Popen

    def get(self, path: str) -> httpx.Response:
        r = httpx.get(self.web + path, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
        r.raise_for_status()
        return r


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Web, FakeProvider]]:
    tmp = tmp_path_factory.mktemp("mitmweb")
    port, web_port = free_port(), free_port()
    log = tmp / "mitmweb.log"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    with FakeProvider() as fake:
        with open(log, "wb") as out:  # the child keeps its own handle
            proc = subprocess.Popen(
                [str(BIN / "mitmweb"), "-s", str(ROOT / "addon" / "perpetuity.py"),
                 "--listen-host", "127.0.0.1", "--listen-port", str(port),
                 "--set", f"web_port={web_port}", "--set", "web_open_browser=false",
                 "--set", f"web_password={TOKEN}", "--set", f"confdir={tmp / 'mitm'}",
                 "--set", f"perpetuity_db={tmp / 'memory.db'}",
                 "--set", f"perpetuity_anthropic_upstream={fake.url}",
                 "--set", f"perpetuity_openai_upstream={fake.url}",
                 "-w", str(tmp / "flows.mitm")],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 30
            while b"perpetuity: listening" not in log.read_bytes():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            w = Web(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}",
                    tmp / "flows.mitm", tmp / "memory.db", proc)
            send(w, fake)
            yield w, fake
        finally:
            proc.terminate()
            proc.wait(10)
    assert b"perpetuity_core" not in log.read_bytes(), log.read_text()


def send(w: Web, fake: FakeProvider) -> None:
    """Three turns remembered, a question the model answers with a memory_search round, and
    an OpenAI chat request: five client requests."""
    a = owned(anthropic.Anthropic(base_url=w.proxy, api_key="sk-ant-web", max_retries=0))
    history: list[dict] = []
    for said in ["The vault code is 4471.", "My sister Ada lives in Oslo.",
                 "We planted tomatoes in April."]:
        history.append({"role": "user", "content": said})
        fake.script(Text("Noted."))
        a.messages.create(model="claude-opus-4-8", max_tokens=20, messages=history,
                          extra_headers={"x-perpetuity-conversation": "earlier"})
        history.append({"role": "assistant", "content": "Noted."})
    deadline = time.monotonic() + 5  # the replies are stored a moment after the client has them
    while stored(w.db) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    fake.script(ToolCall("memory_search", {"query": "sister Oslo"}, call_id="toolu_web_1",
                         text="Let me look."), Text("Ada lives in Oslo."))
    r = a.messages.create(model="claude-opus-4-8", max_tokens=50,
                          messages=[{"role": "user", "content": "Where does my sister live?"}],
                          extra_headers={"x-perpetuity-conversation": "now"})
    assert "Oslo" in r.content[-1].text
    fake.script(Text("Hello from chat."))
    o = owned(openai.OpenAI(base_url=w.proxy + "/v1", api_key="sk-web", max_retries=0))
    o.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])


def stored(db: Path) -> int:
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        return con.execute("select count(*) from message").fetchone()[0]


def flows(w: Web, n: int) -> list[dict]:
    deadline = time.monotonic() + 10
    while len(got := w.get("/flows").json()) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_every_flow_is_listed_with_its_comment_and_rounds_linked(web) -> None:
    w, _ = web
    listed = flows(w, 7)  # five client requests, two hidden rounds
    assert len(listed) == 7
    assert all(f["comment"].startswith("perpetuity: ") for f in listed), listed
    parent = next(f for f in listed if "1 tool round" in f["comment"])
    rounds = [f for f in listed if f["comment"].startswith("perpetuity: tool round")]
    assert [r["comment"] for r in rounds] == [
        f"perpetuity: tool round 1/2 of {parent['id'][:8]}: memory_search",
        f"perpetuity: tool round 2/2 of {parent['id'][:8]}: the answer"]
    view = w.get(f"/flows/{parent['id']}/request/content/auto.json").json()
    assert view["view_name"] == "perpetuity"
    assert "== The frame as the model read it ==" in view["text"]
    assert "My sister Ada lives in Oslo." in view["text"]
    assert f"== Tool round 1 of 2 (flow {rounds[0]['id']})" in view["text"]
    assert 'call memory_search {"query": "sister Oslo"}' in view["text"]
    child = w.get(f"/flows/{rounds[0]['id']}/request/content/perpetuity.json").json()
    assert f"hidden from the client of flow {parent['id']}" in child["text"]
    # The round's own exchange, as it went upstream: our tools added, the provider's reply.
    body = w.get(f"/flows/{rounds[0]['id']}/request/content.data").text
    assert '"memory_search"' in body and "Ada lives in Oslo" in body
    reply = w.get(f"/flows/{rounds[0]['id']}/response/content.data").text
    assert "toolu_web_1" in reply
    # The client's own flow keeps the reply it received, our tool's call hidden from it.
    seen = w.get(f"/flows/{parent['id']}/response/content.data").text
    assert "Ada lives in Oslo." in seen and "memory_search" not in seen


def test_the_saved_file_holds_every_flow_and_reopens_with_the_view(web) -> None:
    w, _ = web
    flows(w, 7)
    reopened = subprocess.run(
        [str(BIN / "mitmdump"), "-nr", str(w.flows_file), "-s",
         str(ROOT / "addon" / "perpetuity_view.py"), "--flow-detail", "3"],
        capture_output=True, text=True, timeout=60)
    assert reopened.returncode == 0, reopened.stderr
    assert reopened.stdout.count("POST http") == 7
    assert "== The frame as the model read it ==" in reopened.stdout
    assert "perpetuity: tool round 1 of 2, hidden from the client" in reopened.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_a_screenshot_of_mitmweb_showing_a_perpetuity_flow(web, tmp_path: Path) -> None:
    w, _ = web
    parent = next(f for f in flows(w, 7) if "1 tool round" in f["comment"])
    url = f"{w.web}/?token={TOKEN}#/flows/{parent['id']}/request"
    base = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
            "--hide-scrollbars", "--window-size=1600,2000", "--virtual-time-budget=8000",
            f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert "The frame as the model read it" in dom.stdout  # mitmweb rendered our view
    shot = tmp_path / "mitmweb.png"
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=90)
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 50_000
    if SCREENSHOT_OUT:
        Path(SCREENSHOT_OUT).write_bytes(png)


def test_a_websocket_message_shows_what_the_model_saw(web) -> None:
    """Codex's own provider through mitmweb (a WebSocket to the proxy as its base URL, the
    Anthropic turns' credential): the client message Perpetuity framed opens in the
    `perpetuity` view with its frame and the tool round the proxy ran inside the socket, and
    the flow's comment says so. (Last in this module: the tests above count its flows.)"""
    w, fake = web
    fake.script(ToolCall("memory_search", {"query": "sister Oslo"}), Text("Ada lives in Oslo."))
    create = {"type": "response.create", "model": "gpt-5", "stream": True, "store": False,
              "input": [{"type": "message", "role": "user", "content": [
                  {"type": "input_text", "text": "Which city does my sister live in?"}]}]}
    port = int(w.proxy.rsplit(":", 1)[1])
    got, = exchanged(socket.create_connection(("127.0.0.1", port), timeout=10),
                     f"127.0.0.1:{port}", "/v1/responses",
                     [("authorization", "Bearer sk-ant-web"), ("session-id", "ws-web")], [create])
    assert got[-1]["type"] == "response.completed"
    assert "memory_search" not in json.dumps(got) and "Ada lives in Oslo." in json.dumps(got)
    deadline = time.monotonic() + 10
    while not (ws := [f for f in w.get("/flows").json() if f.get("websocket")
                      and f["comment"].startswith("perpetuity: 1 message")]):
        assert time.monotonic() < deadline, w.get("/flows").json()
        time.sleep(0.1)
    assert "1 tool round" in ws[0]["comment"], ws[0]["comment"]
    shown = w.get(f"/flows/{ws[0]['id']}/messages/content/auto.json").json()
    asked = shown[0]
    assert asked["from_client"] and asked["view_name"] == "perpetuity", asked
    assert "== The frame as the model read it ==" in asked["text"]
    assert "My sister Ada lives in Oslo." in asked["text"]
    assert "== Tool round 1 of 2" in asked["text"]
    assert 'call memory_search {"query": "sister Oslo"}' in asked["text"]
    assert all(m["view_name"] != "perpetuity" for m in shown[1:])  # the provider's events
    # The handshake's view lists the socket's framed messages; saved once the socket closed,
    # `perpetuity show` prints them from the flow file.
    handshake = w.get(f"/flows/{ws[0]['id']}/request/content/perpetuity.json").json()
    assert "== WebSocket message 0 ==" in handshake["text"]
    deadline = time.monotonic() + 10
    while True:
        show = subprocess.run([str(BIN / "perpetuity"), "show", str(w.flows_file)],
                              capture_output=True, text=True, timeout=60)
        if "== WebSocket message 0 ==" in show.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 'call memory_search {"query": "sister Oslo"}' in show.stdout.split(
        "== WebSocket message 0 ==")[-1], show.stdout[-3000:]
