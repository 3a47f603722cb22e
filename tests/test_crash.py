"""Crash safety, the short version of scripts/kill_loop.py: a real proxy ingesting two
conversations at full speed is killed with SIGKILL three times at random moments; every
restart leaves `memory check` clean, and every turn is stored exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_kill_9_while_ingesting_stores_every_turn_exactly_once() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kill_loop.py"), "--kills", "3",
                          "--seed", "7", "--max-gap", "1.0"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["user_turns"] > 6 and r["replies"] == r["user_turns"]
    assert r["check_violations"] == []
    for key in ("user_twice", "user_lost", "replies_twice", "replies_lost", "partial_messages",
                "out_of_order"):
        assert r[key] == 0, (key, r)


def test_a_locked_database_fails_open_and_the_turn_is_stored_when_re_sent(
        tmp_path: Path) -> None:
    """Another process holds the write lock past the busy timeout: the client still gets its
    reply, the failure is logged, and the next request (whole history re-sent) stores the
    turn exactly once."""
    import sqlite3

    import anthropic

    from tests.conftest import owned, start_proxy, stop_proxy
    from tests.fake_provider import FakeProvider, Text

    with FakeProvider() as fake:
        proxy = start_proxy(tmp_path, fake.url)
        try:
            client = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", max_retries=0))
            headers = {"x-perpetuity-user": "u", "x-perpetuity-conversation": "c"}
            history = [{"role": "user", "content": "first question about the harbour"}]
            fake.script(Text("first answer"))
            client.messages.create(model="claude-opus-4-8", max_tokens=20, messages=history,
                                   extra_headers=headers)
            proxy.wait_messages("u", 2)
            lock = sqlite3.connect(proxy.db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")  # held past the store's 5 s busy timeout
            history += [{"role": "assistant", "content": "first answer"},
                        {"role": "user", "content": "second question about the lantern"}]
            fake.script(Text("second answer"))
            r = client.messages.create(model="claude-opus-4-8", max_tokens=20,
                                       messages=history, extra_headers=headers)
            assert r.content[0].text == "second answer"  # fail open: the reply came
            deadline = time.monotonic() + 20
            while b"a turn was not stored" not in proxy.log.read_bytes():
                assert time.monotonic() < deadline, proxy.log.read_text()
                time.sleep(0.1)
            lock.execute("ROLLBACK")
            lock.close()
            history += [{"role": "assistant", "content": "second answer"},
                        {"role": "user", "content": "third question"}]
            fake.script(Text("third answer"))
            client.messages.create(model="claude-opus-4-8", max_tokens=20, messages=history,
                                   extra_headers=headers)
            got = proxy.wait_messages("u", 6)
            assert [text for _, _, text, _ in got] == [
                "first question about the harbour", "first answer",
                "second question about the lantern", "second answer", "third question",
                "third answer"]
        finally:
            stop_proxy(proxy)


@pytest.mark.parametrize("tools", [True, False], ids=["tool-loop", "plain-stream"])
def test_a_turn_sent_again_after_a_kill_is_stored_once(tmp_path: Path, tools: bool) -> None:
    """Issue 20, in seconds: the proxy is killed while a reply streams; the harness keeps the
    unanswered turn and sends its text again as the next message to the restarted proxy. The
    tool loop had not stored the turn yet (it does after its first round): the restarted proxy
    stored both copies in one request. The plain stream had (at its first byte): the restarted
    proxy stored the copy again."""
    import os
    import signal

    import httpx

    from tests.conftest import start_proxy, stop_proxy
    from tests.fake_provider import FakeProvider, Text

    headers = {"x-api-key": "sk-ant-x", "anthropic-version": "2023-06-01",
               "x-perpetuity-user": "u", "x-perpetuity-conversation": "c"}
    extra = () if tools else ("--set", "perpetuity_tools=false")

    def post(url: str, history: list[dict], stream: bool = False) -> httpx.Response:
        return httpx.post(url + "/v1/messages", headers=headers, timeout=30, json={
            "model": "claude-opus-4-8", "max_tokens": 20, "messages": history, "stream": stream})

    with FakeProvider() as fake:
        proxy = start_proxy(tmp_path, fake.url, *extra)
        held = threading.Event()  # the second reply stops after its first event, until the end
        try:
            history = [{"role": "user", "content": "Plan the garden"}]
            fake.script(Text("Beds first."))
            post(proxy.url, history)
            proxy.wait_messages("u", 2)
            history += [{"role": "assistant", "content": "Beds first."},
                        {"role": "user", "content": "And the lantern?"}]
            fake.script(Text("Never seen.", chunks=3, hold=held))
            with httpx.stream("POST", proxy.url + "/v1/messages", headers=headers, timeout=30,
                              json={"model": "claude-opus-4-8", "max_tokens": 20,
                                    "messages": history, "stream": True}) as r:
                next(r.iter_lines())  # the reply has begun
                if not tools:
                    proxy.wait_messages("u", 3)  # the plain stream stored the turn
                os.kill(proxy.process.pid, signal.SIGKILL)
                proxy.process.wait()
            proxy = start_proxy(tmp_path, fake.url, *extra, port=proxy.port)
            history.append({"role": "user", "content": "And the lantern?"})  # sent again
            fake.script(Text("By the door."))
            assert post(proxy.url, history).status_code == 200
            proxy.wait_messages("u", 4)
            time.sleep(0.3)  # nothing more is coming
            got = [text for _, _, text, _ in proxy.messages("u")]
            assert got == ["Plan the garden", "Beds first.", "And the lantern?", "By the door."]
        finally:
            held.set()
            stop_proxy(proxy)
