"""Notes through the proxy: recall at a task's start, use counted, capture as a tool, and
`/perpetuity-curate` answered by the proxy itself with no model call."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path

import anthropic
import openai
import pytest

from perpetuity_core.wire.identity import tenant_of
from tests.conftest import Proxy, owned, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall

NOTE = """---
name: {name}
description: How to {name} when it fails.
tags: [{name}]
created: {created}
source_task: a task
confidence: medium
state: active
use_count: 0
last_used: {created}
supersedes: null
pinned: false
origin: agent-created
---

## When

When {name} fails.

## Procedure

1. Do the {name} thing.

## Pitfalls

None.

## Verification

It works.
"""


KEY = "sk-ant-x"


@pytest.fixture(scope="module")
def proxy(fake: FakeProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("curate"), fake.url,
                    "--set", f"perpetuity_notes_dir={tmp_path_factory.mktemp('notes')}")
    yield p
    stop_proxy(p)


def library(proxy: Proxy, key: str) -> Path:
    """The notes library of the tenant `key` names (see tenants.library)."""
    ((salt,),) = proxy.rows("select value from setting where key = 'identity_salt'")
    (root,) = [a.split("=", 1)[1] for a in proxy.process.args if a.startswith("perpetuity_notes_dir=")]
    return Path(root) / "tenants" / tenant_of(key, salt)


@pytest.fixture(scope="module")
def notes_dir(proxy: Proxy) -> Path:
    root = library(proxy, KEY)
    (root / "notes").mkdir(parents=True)
    old = (date.today() - timedelta(days=40)).isoformat()
    (root / "notes" / "rebuild-wheels.md").write_text(NOTE.format(name="rebuild-wheels", created=old))
    return root


def test_curate_command_answered_without_the_model(proxy: Proxy, fake: FakeProvider,
                                                   notes_dir: Path) -> None:
    c = owned(anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0))
    with c.messages.stream(model="claude-opus-4-8", max_tokens=50,
                           messages=[{"role": "user", "content": "/perpetuity-curate"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert "rebuild-wheels" in text and "stale" in text.lower()
    assert final.stop_reason == "end_turn"
    assert "state: stale" in (notes_dir / "notes" / "rebuild-wheels.md").read_text()

    o = owned(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0))
    r = o.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                             "content": "/perpetuity-curate"}])
    assert r.choices[0].message.content  # nothing left to change: still a summary
    events = list(o.responses.create(model="gpt-5", input="/perpetuity-curate", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text

    assert fake.requests == []  # no model call
    assert proxy.rows("select count(*) from message") == [(0,)]  # a command, not a turn


LESSON = NOTE.replace("tags: [{name}]", "tags: [{name}, pytest, ImportPathMismatchError]")


def test_recall_at_a_task_start_and_use_counted(proxy: Proxy, fake: FakeProvider,
                                                 notes_dir: Path) -> None:
    today = date.today().isoformat()
    (notes_dir / "notes" / "pytest-mismatch.md").write_text(
        LESSON.format(name="pytest-mismatch", created=today))
    c = owned(anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0))
    fake.script(Text("Following pytest-mismatch: add __init__.py files."))
    c.messages.create(model="claude-opus-4-8", max_tokens=50,
                      messages=[{"role": "user", "content":
                                 "pytest fails with ImportPathMismatchError, help"}],
                      extra_headers={"x-perpetuity-user": "noter"})
    sent = fake.requests[-1].json["messages"]
    quoted = "\n".join(b["text"] for m in sent[:-1] for b in m["content"])
    assert "=== note pytest-mismatch" in quoted and "Perpetuity notes index:" in quoted
    assert sent[-1]["content"] == "pytest fails with ImportPathMismatchError, help"
    deadline = time.monotonic() + 5
    while "use_count: 1" not in (note := (notes_dir / "notes" / "pytest-mismatch.md").read_text()):
        assert time.monotonic() < deadline, note  # the reply cited it by name: it was used
        time.sleep(0.05)

    # A round of tool results is not a new task: no recall.
    fake.script(Text("ok"))
    c.messages.create(model="claude-opus-4-8", max_tokens=50, tools=[{
        "name": "bash", "input_schema": {"type": "object"}}], messages=[
        {"role": "user", "content": "run the tests for ImportPathMismatchError"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "pytest ImportPathMismatchError"}]}],
        extra_headers={"x-perpetuity-user": "noter2"})
    assert "=== note" not in json.dumps(fake.requests[-1].json)


def test_note_capture_through_the_tool_loop(proxy: Proxy, fake: FakeProvider,
                                            notes_dir: Path) -> None:
    c = owned(anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0))
    fake.script(Text("Noted."))
    c.messages.create(model="claude-opus-4-8", max_tokens=50,
                      messages=[{"role": "user", "content": "The build needs NODE_OPTIONS set."}],
                      extra_headers={"x-perpetuity-user": "capturer"})
    proxy.wait_messages("capturer", 2)
    fields = {"name": "node-build-memory", "description": "Fix the build running out of memory.",
              "tags": ["node", "build"], "when": "The build dies with heap errors.",
              "procedure": "1. export NODE_OPTIONS=--max-old-space-size=4096", "pitfalls": "None.",
              "verification": "The build completes."}
    fake.script(ToolCall("note_capture", fields, call_id="toolu_cap"), Text("Saved the lesson."))
    r = c.messages.create(model="claude-opus-4-8", max_tokens=50,
                          messages=[{"role": "user", "content": "Fixed the build, remember how."}],
                          extra_headers={"x-perpetuity-user": "capturer"})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "Saved the lesson."
    saved = (notes_dir / "notes" / "node-build-memory.md").read_text()
    assert "origin: agent-created" in saved and "NODE_OPTIONS" in saved
    result = fake.requests[-1].json["messages"][-1]["content"][0]
    assert result["tool_use_id"] == "toolu_cap"
