"""Bodies a harness really sends that the memory lost (issue 41), through a real mitmdump to the
fake provider: a tool result cut mid-emoji (Node's JSON.stringify writes the lone half as
`\\ud83d`), a compressed body, a body the memory cannot read, a claimed time in the future.
Each is forwarded so the provider reads it, and stored, or said in the log why not."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from perpetuity_core.frame.build import HEADER
from tests.conftest import Proxy, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall

CUT = "README.md zebracorn-\ud83d"  # the lone high half of 🦄, as a harness cut it
MENDED = "README.md zebracorn-\ufffd"
GEMINI = "/v1beta/models/gemini-2.5-flash:generateContent"


@pytest.fixture(scope="module", params=["relay", "mitmproxy-stream"])
def proxy(request: pytest.FixtureRequest, fake: FakeProvider,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """With the recall tools (the relay forwards) and without (mitmproxy's own path)."""
    extra = ("--set", "perpetuity_tools=false") if request.param == "mitmproxy-stream" else ()
    p = start_proxy(tmp_path_factory.mktemp(request.param), fake.url, *extra)
    yield p
    stop_proxy(p)
    assert b"Traceback" not in p.log.read_bytes(), p.log.read_text()


def _turns(protocol: str, result: str) -> list[tuple[str, dict]]:
    """Three requests of one conversation in `protocol`: a prompt answered by a tool call, the
    tool's result (`result`), and a next prompt; each body the whole history so far."""
    if protocol == "anthropic":
        first = [{"role": "user", "content": "list the files"}]
        second = first + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ls",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": result}]}]
        third = second + [{"role": "assistant", "content": "One file."},
                          {"role": "user", "content": "and the next step?"}]
        return [("/v1/messages", {"model": "claude-opus-4-8", "max_tokens": 50, "messages": m})
                for m in (first, second, third)]
    if protocol == "chat":
        first = [{"role": "user", "content": "list the files"}]
        second = first + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "t1", "content": result}]
        third = second + [{"role": "assistant", "content": "One file."},
                          {"role": "user", "content": "and the next step?"}]
        return [("/v1/chat/completions", {"model": "gpt-4o", "messages": m})
                for m in (first, second, third)]
    if protocol == "responses":
        first = [{"role": "user", "content": "list the files"}]
        second = first + [
            {"type": "function_call", "call_id": "t1", "name": "ls", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "t1", "output": result}]
        third = second + [{"role": "assistant", "content": "One file."},
                          {"role": "user", "content": "and the next step?"}]
        return [("/v1/responses", {"model": "gpt-5", "input": m}) for m in (first, second, third)]
    first = [{"role": "user", "parts": [{"text": "list the files"}]}]
    second = first + [
        {"role": "model", "parts": [{"functionCall": {"name": "ls", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "ls",
                                                         "response": {"output": result}}}]}]
    third = second + [{"role": "model", "parts": [{"text": "One file."}]},
                      {"role": "user", "parts": [{"text": "and the next step?"}]}]
    return [(GEMINI, {"contents": m}) for m in (first, second, third)]


PROTOCOLS = ["anthropic", "chat", "responses", "gemini"]


def _headers(path: str, user: str, conversation: str) -> dict[str, str]:
    key = ({"x-goog-api-key": "AIza-hostile"} if path == GEMINI
           else {"x-api-key": "sk-ant-hostile"} if path == "/v1/messages"
           else {"authorization": "Bearer sk-hostile"})
    return {**key, "x-perpetuity-user": user, "x-perpetuity-conversation": conversation,
            "content-type": "application/json"}


def _texts(proxy: Proxy, user: str, n: int) -> list[str]:
    proxy.wait_messages(user, n)
    time.sleep(0.2)  # nothing more is coming
    return [text for _, _, text, _ in proxy.messages(user)]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_lone_surrogate_in_a_tool_result_is_stored_mended_and_forwarded_as_sent(
        proxy: Proxy, fake: FakeProvider, protocol: str) -> None:
    """Before: that turn and every later one of the conversation were never stored (nor
    framed), and nothing was logged. Now stored with U+FFFD in place of the lone half, while
    the provider gets the client's escape, and the memory frames it for a new conversation."""
    user = f"cut-{protocol}"
    fake.script(ToolCall("ls", {}), Text("One file."), Text("Next, the tests."))
    for path, body in _turns(protocol, CUT):
        raw = json.dumps(body).encode()  # ASCII escapes, as JSON.stringify writes the lone half
        assert b"zebracorn-\\ud83d" in raw or b"zebracorn" not in raw
        r = httpx.post(proxy.url + path, content=raw, headers=_headers(path, user, "c"), timeout=30)
        assert r.status_code == 200, r.text
        if b"zebracorn" in raw:  # the provider read what the client sent: the escape, unmended
            assert b"zebracorn-\\ud83d" in fake.requests[-1].body
    texts = _texts(proxy, user, 6)
    assert texts.count(MENDED) == 1, texts
    assert texts[0] == "list the files" and texts[-2:] == ["and the next step?",
                                                           "Next, the tests."], texts
    fake.script(Text("Yes."))
    path, body = _turns(protocol, CUT)[0]
    body = json.loads(json.dumps(body).replace("list the files", "what did ls print?"))
    assert httpx.post(proxy.url + path, json=body, timeout=30,
                      headers=_headers(path, user, "another")).status_code == 200
    framed = json.dumps(fake.requests[-1].json, ensure_ascii=False)
    assert HEADER in framed and MENDED in framed
