"""Bodies a harness really sends that the memory lost (issue 41), through a real mitmdump to the
fake provider: a tool result cut mid-emoji (Node's JSON.stringify writes the lone half as
`\\ud83d`), a compressed body, a body the memory cannot read, a claimed time in the future.
Each is forwarded so the provider reads it, and stored, or said in the log why not."""

from __future__ import annotations

import gzip
import json
import time
import zlib
from collections.abc import Iterator

import brotli
import httpx
import pytest

from perpetuity_core.frame.build import HEADER
from tests.conftest import Proxy, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall
from tests.test_websocket import through_proxy

CUT = "README.md zebracorn-\ud83d"  # the lone high half of 🦄, as a harness cut it
MENDED = "README.md zebracorn-\ufffd"
GEMINI = "/v1beta/models/gemini-2.5-flash:generateContent"


@pytest.fixture(scope="module", params=["relay", "mitmproxy-stream"])
def proxy(request: pytest.FixtureRequest, fake: FakeProvider,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """With the recall tools (the relay forwards) and without (mitmproxy's own path); the log
    at warnings, as `perpetuity proxy` shows it (the suite's mitmdump -q shows errors only)."""
    extra = ("--set", "perpetuity_tools=false") if request.param == "mitmproxy-stream" else ()
    p = start_proxy(tmp_path_factory.mktemp(request.param), fake.url, *extra, quiet=False)
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


def test_a_lone_surrogate_over_codex_websocket_is_stored_mended(
        proxy: Proxy, fake: FakeProvider) -> None:
    """Codex's own provider speaks Responses over a WebSocket: each message is read, framed and
    stored as the HTTP request it stands for, so the cut emoji is mended there too (before: the
    message went unread, "could not read a WebSocket message", and nothing was stored)."""
    first = {"type": "response.create", "model": "gpt-5", "stream": True, "store": False,
             "input": [{"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": CUT}]}]}
    second = {**first, "previous_response_id": "<last>", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "why?"}]}]}
    fake.script(Text("A cut emoji."), Text("Node cut it."))
    headers = [("authorization", "Bearer eyJhbGciOi.chatgpt-oauth.sig"),
               ("chatgpt-account-id", "acct-hostile"), ("x-perpetuity-user", "cut-ws")]
    got = through_proxy(proxy, "chatgpt.com", "/backend-api/codex/responses", headers,
                        [first, second])
    assert [e[-1]["type"] for e in got] == ["response.completed"] * 2
    assert fake.refused == []
    assert _texts(proxy, "cut-ws", 4) == [MENDED, "A cut emoji.", "why?", "Node cut it."]


def _zstd(data: bytes) -> bytes:
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14
    except ImportError:
        from backports import zstd  # mitmproxy's own dependency before 3.14
    return zstd.compress(data)


ENCODINGS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
             "zstd": _zstd}


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("protocol", ["anthropic", "chat"])
def test_a_compressed_body_is_stored_and_forwarded_decoded(
        proxy: Proxy, fake: FakeProvider, protocol: str, encoding: str) -> None:
    """Before: forwarded still compressed (the provider, reading JSON, answered 400) and never
    stored. Now the provider gets the JSON, content-encoding dropped, and the turn is stored."""
    user = f"zip-{protocol}-{encoding}"
    fake.script(Text("Compressed, read."))
    path, body = _turns(protocol, "")[0]
    body = json.loads(json.dumps(body).replace("list the files", f"{encoding} please"))
    r = httpx.post(proxy.url + path, content=ENCODINGS[encoding](json.dumps(body).encode()),
                   headers={**_headers(path, user, "c"), "content-encoding": encoding},
                   timeout=30)
    assert r.status_code == 200, r.text
    sent = fake.requests[-1]
    assert "content-encoding" not in sent.headers and sent.json is not None
    assert _texts(proxy, user, 2) == [f"{encoding} please", "Compressed, read."]


def test_a_body_that_cannot_be_decoded_is_forwarded_as_sent_and_logged(
        proxy: Proxy, fake: FakeProvider) -> None:
    path, body = _turns("anthropic", "")[0]
    raw = b"\x1f\x8b not gzip at all"
    r = httpx.post(proxy.url + path, content=raw, timeout=30,
                   headers={**_headers(path, "zip-bad", "c"), "content-encoding": "gzip"})
    assert r.status_code == 400  # the fake cannot read it either
    assert fake.requests[-1].body == raw and fake.requests[-1].headers["content-encoding"] == "gzip"
    _logged(proxy, "POST /v1/messages: not stored, forwarded as sent: its content-encoding "
                   "'gzip' could not be decoded")
    assert proxy.messages("zip-bad") == []


def _logged(proxy: Proxy, line: str) -> None:
    deadline = time.monotonic() + 5
    while line.encode() not in proxy.log.read_bytes():
        assert time.monotonic() < deadline, proxy.log.read_text()
        time.sleep(0.05)


@pytest.mark.parametrize("raw,why", [
    (b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "\xff"}]}',
     "it is not UTF-8 (invalid start byte at byte 71)"),
    (b"hello, not JSON", "it is not JSON (Expecting value: line 1 column 1 (char 0))"),
    (b'[{"role": "user", "content": "an array"}]', "it is JSON but not an object"),
    (b'{"model": "claude-opus-4-8", "max_tokens": 5, "messages": [{"role": "user", '
     b'"content": "' + b"x" * (32 * 1024 * 1024) + b'"}]}', "it is over 32 MB (33554524 bytes)"),
], ids=["not-utf8", "not-json", "not-an-object", "over-32MB"])
def test_a_body_the_memory_cannot_read_is_forwarded_untouched_and_logged(
        proxy: Proxy, fake: FakeProvider, raw: bytes, why: str) -> None:
    """Before: forwarded untouched and silently not stored. Now one log line says so, and why."""
    r = httpx.post(proxy.url + "/v1/messages", content=raw, timeout=60,
                   headers=_headers("/v1/messages", "unread", "c"))
    assert r.status_code in (200, 400)
    assert fake.requests[-1].body == raw
    _logged(proxy, f"POST /v1/messages: not stored, forwarded as sent: {why}")


@pytest.mark.parametrize("claimed,kept", [("9999-12-31", False), ("+1h", False),
                                          ("+60s", True)])
def test_a_claimed_time_in_the_future_is_refused_and_logged(
        proxy: Proxy, fake: FakeProvider, claimed: str, kept: bool) -> None:
    """Before: `x-perpetuity-time: 9999-12-31` was taken, and `memory users` showed it as last
    seen. Now a time past now (beyond a 5-minute skew) is refused in the log, and the turn and
    its reply stand at their arrival; a clock a minute ahead is still believed."""
    now = time.time()
    offsets = {"+1h": 3600, "+60s": 60}
    header = (claimed if claimed not in offsets else
              time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + offsets[claimed])))
    user = f"clock-{claimed}"
    fake.script(Text("Noted."))
    path, body = _turns("anthropic", "")[0]
    r = httpx.post(proxy.url + path, json=body, timeout=30,
                   headers={**_headers(path, user, "c"), "x-perpetuity-time": header})
    assert r.status_code == 200
    _texts(proxy, user, 2)
    ats = [at for (at,) in proxy.rows(
        "select m.at from message m join user u on u.id = m.user_id where u.key like ?",
        f"%/{user}")]
    assert len(ats) == 2
    if kept:
        assert all(abs(at - (now + 60)) < 2 for at in ats), ats
    else:
        assert all(now - 1 <= at <= time.time() + 1 for at in ats), ats
        _logged(proxy, f"perpetuity: x-perpetuity-time {header} is in the future; the turn is "
                       "stored at its arrival time")
