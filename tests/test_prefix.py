"""The cached prefix within one conversation: a real mitmdump between a Claude Code-shaped
client and the fake provider. Tools come first in the provider's prefix, then the system prompt:
whatever changes there rewrites everything after it, so within one conversation the harness's
system prompt and tools and ours go upstream byte-identical on every call."""

from __future__ import annotations

import json
from typing import Any

import httpx

from perpetuity_core.wire.protocols import anthropic, cache_marks
from tests.conftest import Proxy, owned
from tests.fake_provider import FakeProvider, Text

MARK = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
          {"type": "text", "text": "Help with software engineering tasks. " * 40,
           "cache_control": MARK}]
TOOLS = [{"name": "Bash", "description": "Run a shell command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
         {"name": "Read", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
# A long tool output, so that the conversation outgrows a frame and the plan rebuilds.
OUTPUT = "\n".join(f"src/module_{i}.py:{i}: def handler_{i}(request): return respond_{i}()"
                   for i in range(400))


def marked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as Claude Code sends them: a cache mark on the last block."""
    *head, last = messages
    content = last["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    blocks[-1] = {**blocks[-1], "cache_control": MARK}
    return [*head, {**last, "content": blocks}]


def session(prompts: int) -> list[list[dict[str, Any]]]:
    """Each call's messages of a coding session: every prompt runs a tool, then answers."""
    calls: list[list[dict[str, Any]]] = []
    history: list[dict[str, Any]] = []
    for n in range(prompts):
        history.append({"role": "user", "content": f"Task {n}: fix handler_{n} in src/module_{n}.py"})
        calls.append(list(history))
        history += [{"role": "assistant", "content": [
                        {"type": "tool_use", "id": f"toolu_{n}", "name": "Bash",
                         "input": {"command": f"grep -rn handler_{n} src"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": OUTPUT}]}]
        calls.append(list(history))
        history.append({"role": "assistant", "content": f"Fixed handler_{n}."})
    return calls


def send(proxy: Proxy, user: str, conversation: str, messages: list[dict[str, Any]],
         tools: list[dict[str, Any]] = TOOLS) -> None:
    body = {"model": "claude-sonnet-4-6", "max_tokens": 100, "system": SYSTEM,
            "messages": marked(messages), **({"tools": tools} if tools else {})}
    r = owned(httpx.Client(timeout=30)).post(
        f"{proxy.url}/v1/messages", content=json.dumps(body),
        headers={"x-api-key": "sk-ant-prefix", "anthropic-version": "2023-06-01",
                 "content-type": "application/json", "x-perpetuity-user": user,
                 "x-perpetuity-conversation": conversation})
    assert r.status_code == 200, r.text


def test_system_and_tools_are_byte_stable_within_a_conversation(proxy: Proxy,
                                                                   fake: FakeProvider) -> None:
    # A new user's first conversation (no memory at its first call), then a second one (a
    # frame from its first call): each grows past a frame, so its plan rebuilds on the way.
    for conversation in ("first", "second"):
        calls = session(4)
        for messages in calls:
            fake.script(Text("ok"))
            send(proxy, "prefix-user", conversation, messages)
        sent = fake.wait_requests(len(calls))
        fake.clear()
        prefixes = {json.dumps([r.json["tools"], r.json["system"]]) for r in sent}
        assert len(prefixes) == 1, f"{conversation}: {len(prefixes)} different prefixes"
        tools = [t["name"] for t in sent[0].json["tools"]]
        assert tools[:2] == ["Bash", "Read"] and "memory_search" in tools
        # The harness's own, as it sent it, its mark kept an hour: a pause of more than five
        # minutes reads the prefix every call shares instead of writing it again.
        assert sent[0].json["system"] == cache_marks.lasting({"system": SYSTEM})["system"]
        assert sent[0].json["system"][1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
        assert all(not anthropic.check(r.json) for r in sent)
    # The second conversation was framed: the stable prefix is not an unframed one.
    assert any("[Memory" in json.dumps(r.json["messages"]) for r in sent)


def test_a_chats_recall_tools_once_they_ride_stay(proxy: Proxy, fake: FakeProvider) -> None:
    # A chat client sends no tools of its own: ours wait for its first frame (with nothing to
    # recall they are only cost), then ride on every call.
    calls = [m for m in session(4) if isinstance(m[-1]["content"], str)]  # its prompts alone
    for messages in calls:
        fake.script(Text("ok"))
        send(proxy, "prefix-chat", "chat", messages, tools=[])
    sent = fake.wait_requests(len(calls))
    names = [[t["name"] for t in r.json.get("tools", [])] for r in sent]
    assert names[0] == []  # a new user's first call: nothing to recall
    first = next(i for i, n in enumerate(names) if n)
    assert all(n == names[first] for n in names[first:]) and "memory_search" in names[first]
