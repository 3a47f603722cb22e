"""Never an invalid request: each adapter's `check`, against the independent rules in
tests/validity.py, on the shapes that break (interrupts, parallel calls, thinking, markers)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from perpetuity_core.protocols import anthropic, chat, responses
from tests.test_fixtures import FIXTURES, http_fixtures
from tests.validity import CHECKS

needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="../shared/fixtures/harness is absent")

PRODUCTION = {"/v1/messages": anthropic.check, "/v1/chat/completions": chat.check,
              "/v1/responses": responses.check}
INTERRUPT = "[Request interrupted by user for tool use]"


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def call(i: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": i, "name": "Bash", "input": {"command": "ls"}}


def result(i: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": i, "content": "ok"}


def thinking(signature: str = "sig") -> dict[str, Any]:
    return {"type": "thinking", "thinking": "hm", "signature": signature}


VALID_ANTHROPIC = [
    # The exact Claude Code interrupt: the interrupted call's result, the marker, the new prompt.
    [user(text("list files")), assistant(thinking(), call("t1")),
     user(result("t1"), text(INTERRUPT), text("no, list only the tests"))],
    # Parallel calls answered in one user message; a system message read past.
    [user(text("read both")), {"role": "system", "content": "agents: ..."},
     assistant(call("a"), call("b")), user(result("b"), result("a"))],
    # A tool_use in the last message is the model's own prefill, not yet answered.
    [user(text("go")), assistant(call("a"))],
    [user(text("what is this"), {"type": "image", "source": {"type": "base64",
          "media_type": "image/png", "data": "iVBO"}})],
]

INVALID_ANTHROPIC = {
    "result without its call (the frame replaced the tool_use)": [
        user(text("[memory]")), assistant(text("[end]")),
        user(result("t1"), text(INTERRUPT), text("no, list only the tests"))],
    "call not answered by the next message": [
        user(text("go")), assistant(call("a"), call("b")), user(result("a"))],
    "starts with the assistant": [assistant(text("hi")), user(text("go"))],
    "two users in a row": [user(text("a")), user(text("b"))],
    "thinking without its signature": [user(text("go")), assistant(thinking(""), text("x")),
                                       user(text("next"))],
}


@pytest.mark.parametrize("messages", VALID_ANTHROPIC)
def test_anthropic_accepts_what_the_api_accepts(messages: list[dict[str, Any]]) -> None:
    body = {"model": "claude", "messages": messages}
    assert anthropic.check(body) == []
    assert CHECKS["/v1/messages"](body) == []


@pytest.mark.parametrize("why", sorted(INVALID_ANTHROPIC))
def test_anthropic_refuses_what_the_api_refuses(why: str) -> None:
    assert anthropic.check({"model": "claude", "messages": INVALID_ANTHROPIC[why]}), why


def test_anthropic_counts_cache_markers_across_tools_system_and_messages() -> None:
    mark = {"cache_control": {"type": "ephemeral"}}
    body = {"tools": [{"name": "t", **mark}], "system": [{"type": "text", "text": "s", **mark}],
            "messages": [user({**text("a"), **mark}, {**result("x"), "content": [
                {**text("r"), **mark}]})]}
    assert [e for e in anthropic.check(body) if "cache_control" in e] == []
    body["system"].append({"type": "text", "text": "t", **mark})
    assert any("5 cache_control markers" in e for e in anthropic.check(body))


def test_anthropic_tool_results_come_before_text() -> None:
    body = {"messages": [user(text("go")), assistant(call("a")), user(text("and"), result("a"))]}
    assert anthropic.check(body)


def test_chat_pairs_tool_messages_with_the_calls_before_them() -> None:
    def calls(*ids: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]}

    def tool(i: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": i, "content": "ok"}

    go = {"role": "user", "content": "go"}
    assert chat.check({"messages": [go, calls("a", "b"), tool("b"), tool("a"), go]}) == []
    assert chat.check({"messages": [{"role": "user", "content": "[memory]"}, tool("a"), go]})
    assert chat.check({"messages": [go, calls("a", "b"), tool("a"), go]})
    assert chat.check({"messages": [go, calls("a")]})  # a call must be answered before sending


def test_responses_pairs_outputs_with_earlier_calls() -> None:
    def fc(i: str) -> dict[str, Any]:
        return {"type": "function_call", "call_id": i, "name": "f", "arguments": "{}"}

    def out(i: str) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": i, "output": "ok"}

    go = {"type": "message", "role": "user", "content": "go"}
    assert responses.check({"input": [go, fc("a"), out("a")]}) == []
    assert responses.check({"input": [go, out("a"), fc("a")]})
    assert responses.check({"input": [go, fc("a"), go]})
    assert responses.check({"input": "go"}) == []
    assert responses.check({"input": [out("a")], "previous_response_id": "resp_1"}) == []


@needs_fixtures
def test_every_capture_is_valid_to_production_and_reference_alike() -> None:
    checked = 0
    for harness in ("claude-code", "codex", "opencode", "anthropic-python", "openai-python"):
        for f in http_fixtures(harness):
            raw = json.loads(f.read_text())
            if (path := raw["path"]) in PRODUCTION:
                assert PRODUCTION[path](raw["body"]) == [] == CHECKS[path](raw["body"]), f
                checked += 1
    assert checked >= 30, checked
