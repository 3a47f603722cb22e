"""Every failure stays open: a tool that raises or hangs, a provider refusing what we changed,
a turn that cannot be written, an option changed under a running proxy."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import anthropic
import httpx
import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from perpetuity_core.frame import tenants
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.wire.identity import tenant_of
from tests.addons import Perpetuity
from tests.conftest import Proxy, opened, start_proxy, stop_proxy
from tests.fake_provider import Error, FakeProvider, Text, ToolCall

KEY = "sk-ant-failopen-key-000000000000"
LESSON = {"name": "slow-disk", "description": "A lesson.", "tags": ["disk"], "when": "Always.",
          "procedure": "1. Wait.", "pitfalls": "None.", "verification": "It worked."}


def salted(tmp: Path) -> str:
    store = open_memory(tmp / "memory.db")
    salt = store.salt
    store.close()
    return salt


def post(p: Proxy, text: str, stream: bool = False, **extra: object) -> httpx.Response:
    return httpx.post(p.url + "/v1/messages", timeout=30, headers={
        "x-api-key": KEY, **extra.pop("headers", {})}, json={
        "model": "claude-opus-4-8", "max_tokens": 20, "stream": stream,
        "messages": [{"role": "user", "content": text}], **extra})


def remember(p: Proxy, fake: FakeProvider) -> None:
    """Some memory, so the next request gets a frame (and so is changed by us)."""
    fake.script(Text("Noted."))
    post(p, "The release train leaves on Wednesdays.").raise_for_status()
    deadline = time.monotonic() + 5
    while len(p.rows("select 1 from message")) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    fake.clear()


def test_a_tool_raising_falls_back_to_the_clients_request(fake: FakeProvider,
                                                          tmp_path: Path) -> None:
    """note_capture with a notes library that is a file raises OSError: the client gets its own
    request's answer, not a cut stream."""
    salt = salted(tmp_path)
    notes = tmp_path / "notes"
    library = tenants.library(notes, tenant_of(KEY, salt))
    library.parent.mkdir(parents=True)
    library.write_text("a file where the library should be")
    p = start_proxy(tmp_path, fake.url, "--set", f"perpetuity_notes_dir={notes}")
    try:
        remember(p, fake)
        fake.script(ToolCall("note_capture", LESSON, call_id="toolu_cap"), Text("Plain answer."))
        r = post(p, "When does the release train leave? Remember the lesson.")
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "Plain answer."
        # The fallback is the request exactly as the client sent it.
        assert fake.requests[-1].json["messages"] == [
            {"role": "user", "content": "When does the release train leave? Remember the lesson."}]
        assert "tools" not in fake.requests[-1].json
        # Streamed, the head is out before the tool runs: the protocol's error event ends it.
        fake.script(ToolCall("note_capture", LESSON, call_id="toolu_cap2"))
        with anthropic.Anthropic(base_url=p.url, api_key=KEY, max_retries=0) as c, \
                pytest.raises(anthropic.APIStatusError, match="a recall tool failed"):
            with c.messages.stream(model="claude-opus-4-8", max_tokens=20, messages=[
                    {"role": "user", "content": "Release train day? Remember it."}]) as s:
                "".join(s.text_stream)
    finally:
        stop_proxy(p)


def test_a_hung_tool_is_answered_timed_out(fake: FakeProvider, tmp_path: Path) -> None:
    salt = salted(tmp_path)
    notes = tmp_path / "notes"
    library = tenants.library(notes, tenant_of(KEY, salt))
    (library / "notes").mkdir(parents=True)
    fifo = library / "notes" / ".slow-disk.md.tmp"  # writing the note blocks until it is read
    os.mkfifo(fifo)
    p = start_proxy(tmp_path, fake.url, "--set", f"perpetuity_notes_dir={notes}",
                    "--set", "perpetuity_tool_timeout=1")
    try:
        remember(p, fake)
        fake.script(ToolCall("note_capture", LESSON, call_id="toolu_slow"), Text("Moving on.", chunks=1))
        r = post(p, "When does the release train leave? Remember the lesson.", stream=True)
        assert r.status_code == 200 and "Moving on." in r.text
        result = fake.requests[-1].json["messages"][-1]["content"][0]
        assert result["tool_use_id"] == "toolu_slow"
        assert "note_capture: timed out after 1 s" in json.dumps(result)
        # Requests are not held up by the stuck thread.
        fake.script(Text("Still here."))
        assert post(p, "another question").json()["content"][0]["text"] == "Still here."
    finally:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # release a writer, never wait
        stop_proxy(p)


@pytest.mark.parametrize("tools", ["on", "off"])  # the relay's loop, mitmproxy's own stream
def test_a_400_to_a_request_we_changed_is_retried_as_sent(fake: FakeProvider, tmp_path: Path,
                                                           tools: str) -> None:
    p = start_proxy(tmp_path, fake.url)
    try:
        remember(p, fake)
        fake.script(Error(400), Text("Wednesdays."))
        r = post(p, "When does the release train leave?", headers={"x-perpetuity-tools": tools})
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "Wednesdays."
        first, retry = fake.wait_requests(2)
        assert len(json.dumps(first.json["messages"])) > len(json.dumps(retry.json["messages"]))
        assert retry.json["messages"] == [
            {"role": "user", "content": "When does the release train leave?"}]
        assert "tools" not in retry.json
        # The retry's answer is stored like any reply.
        deadline = time.monotonic() + 5
        while not p.rows("select 1 from item where text = 'Wednesdays.'"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # A 400 to a request we did not change is the client's: once, as it came.
        fake.clear()
        fake.script(Error(400))
        r = post(p, "x", headers={"x-perpetuity": "off"})
        assert r.status_code == 400 and len(fake.requests) == 1
    finally:
        stop_proxy(p)


def test_no_tool_is_added_under_a_name_the_harness_uses(proxy: Proxy, fake: FakeProvider) -> None:
    theirs = {"name": "memory_search", "description": "The harness's own memory.",
              "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
    remember(proxy, fake)
    fake.script(Text("ok"))
    post(proxy, "When does the release train leave?", tools=[theirs]).raise_for_status()
    names = [t["name"] for t in fake.requests[-1].json["tools"]]
    assert names.count("memory_search") == 1 and "memory_more" in names
    assert fake.requests[-1].json["tools"][names.index("memory_search")] == theirs


def test_a_failed_turn_write_is_logged_without_a_reply(fake: FakeProvider, tmp_path: Path) -> None:
    p = start_proxy(tmp_path, fake.url)
    try:
        lock = opened(p.db, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the store's writer waits out its busy timeout, then fails
        fake.script(Error(500))
        assert post(p, "this turn cannot be written").status_code == 500
        deadline = time.monotonic() + 15
        while b"a turn was not stored" not in p.log.read_bytes():
            assert time.monotonic() < deadline, p.log.read_text()
            time.sleep(0.1)
        lock.execute("ROLLBACK")
        lock.close()
        assert p.alive()
    finally:
        stop_proxy(p)


def test_changing_the_database_while_running_is_refused(tmp_path: Path) -> None:
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "a.db"))
        done = threading.Event()

        async def serve() -> None:
            await addon.running()
            await addon.relay.stop()
            done.set()

        asyncio.run(serve())
        assert done.is_set()
        with pytest.raises(exceptions.OptionsError, match="cannot change while running"):
            tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "b.db"))
        assert addon.store is not None and addon.store.path == tmp_path / "a.db"
        assert not (tmp_path / "b.db").exists()
        addon.executor.submit(addon.store.close).result()  # on the store's thread, after its work
