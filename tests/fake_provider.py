"""A faithful fake model provider for the test suite.

An HTTP/1.1 server (asyncio + h11) on 127.0.0.1, on its own event loop in a background
thread, that speaks four provider wire protocols, streamed and not streamed, closely
enough that the official ``anthropic``, ``openai`` and ``google-genai`` SDKs (and gemini-cli)
work against it unchanged:

* Anthropic Messages: ``POST /v1/messages`` (also ``?beta=true``) and
  ``POST /v1/messages/count_tokens``.
* OpenAI Chat Completions: ``POST /v1/chat/completions``.
* OpenAI Responses: ``POST /v1/responses``, and over a WebSocket (``GET /v1/responses`` or
  ChatGPT's ``/backend-api/codex/responses`` upgraded, one ``response.create`` a message, one
  event a message) as Codex's built-in provider speaks it: a ``previous_response_id`` must be
  the connection's last response (or one stored with ``store: true``), else the message is
  refused with ``previous_response_not_found``; ``generate: false`` answers an empty
  response; a ``compaction_trigger`` item a single ``compaction`` item. ``websockets=False``
  answers the upgrade ``426``, as a provider without them does.
* Gemini: ``POST /v1beta/models/{model}:generateContent``, ``:streamGenerateContent`` (SSE with
  ``?alt=sse``, else one JSON array) and ``:countTokens``; the same under Code Assist's
  ``/v1internal:{method}``, its request in ``{model, project, request}`` and each reply or
  chunk in ``{response, traceId}``.

The event and field shapes copy the captures in ``/work/shared/fixtures/harness``.

Usage::

    from tests.fake_provider import FakeProvider, Text, ToolCall, Error, Cut

    with FakeProvider() as fake:
        fake.script(Text("Hello there", chunks=3), ToolCall("get_weather", {"city": "Paris"}))
        client = anthropic.Anthropic(base_url=fake.url, api_key="x", max_retries=0)
        ...
        fake.wait_requests(2)
        fake.requests[0].json["model"]

Every reply is deterministic: ids, ``created`` timestamps, signatures and request ids are
derived from a hash of (protocol, stream flag, the script item's fields, the request's
model); usage figures from the request body length and the reply's text length. The same
script against the same request therefore yields byte-identical responses (status line,
headers, chunk framing and body).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import http
import json
import re
import threading
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import h11
from wsproto.connection import Connection, ConnectionType
from wsproto.events import CloseConnection, Ping, TextMessage

__all__ = ["DEFAULT_REPLY", "Cut", "Error", "FakeProvider", "Recorded", "Text", "ToolCall"]


# --------------------------------------------------------------------------- script items


@dataclass(frozen=True)
class Text:
    """A text reply split into ``chunks`` deltas.

    ``thinking`` adds a thinking block with a signature before the text (Anthropic), a
    reasoning item with a summary (Responses); Chat Completions ignores it.
    ``delay`` sleeps between streamed events (a non-streamed reply ignores it); a streamed
    reply with ``hold`` stops after its first event until the test sets it (so a test sees an
    event arrive while the rest is held back: an ordering, not a clock).
    """

    text: str
    chunks: int = 3
    thinking: str | None = None
    delay: float = 0.0
    hold: threading.Event | None = None


@dataclass(frozen=True)
class ToolCall:
    """The model calls a tool, optionally after some leading ``text``."""

    name: str
    arguments: dict
    call_id: str | None = None
    text: str | None = None
    also: tuple[ToolCall, ...] = ()  # more calls in the same reply
    thinking: str | None = None  # a thinking block before the call (Anthropic Messages)
    delay: float = 0.0  # sleep between streamed events


@dataclass(frozen=True)
class Error:
    """An HTTP error reply as the provider sends it (JSON body in the protocol's error shape)."""

    status: int
    body: dict | None = None
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class Cut:
    """Start a 200 streamed reply, send ``after_events`` events, then drop the connection
    without the terminating chunk. (For a non-streamed request: send the headers and half
    the JSON body, then drop the connection.)"""

    after_events: int = 2


DEFAULT_REPLY = Text("Hello from the fake provider.")


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it.

    ``path`` is without the query string; ``query`` is the raw query string (``""`` when
    absent, e.g. ``"beta=true"``); ``headers`` has lower-cased names (repeated headers are
    joined with ``", "``); ``json`` is the parsed body or ``None``.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    json: Any


# --------------------------------------------------------------------------- helpers


def _dumps(obj: Any) -> str:
    # Same separators as the recording fake whose captures the fixtures hold.
    return json.dumps(obj)


def _split(s: str, n: int) -> list[str]:
    """Split ``s`` into ``n`` (at most ``len(s)``, at least 1) contiguous pieces."""
    if not s:
        return [s]
    n = max(1, min(int(n), len(s)))
    size, rem = divmod(len(s), n)
    out, i = [], 0
    for k in range(n):
        step = size + (1 if k < rem else 0)
        out.append(s[i : i + step])
        i += step
    return out


def _tokens(s: str | None) -> int:
    return (len(s) + 3) // 4 if s else 0


def _item_key(item: Any) -> dict:
    if isinstance(item, Text):
        item = replace(item, hold=None)  # when the reply flows, not what it says
    return {"kind": type(item).__name__, **asdict(item)}


class _Ids:
    """Deterministic ids from a seed."""

    def __init__(self, *parts: Any) -> None:
        self.seed = hashlib.sha256(
            json.dumps(list(parts), sort_keys=True, default=repr).encode()
        ).hexdigest()

    def hex(self, label: str, n: int) -> str:
        return hashlib.sha256(f"{self.seed}:{label}".encode()).hexdigest()[:n]

    def created(self) -> int:
        # A plausible epoch second, fixed per seed.
        return 1_760_000_000 + int(self.seed[:8], 16) % 40_000_000

    def signature(self) -> str:
        raw = hashlib.sha512(f"{self.seed}:signature".encode()).digest()
        return base64.b64encode(raw + raw[:32]).decode()


@dataclass
class _Turn:
    """What the model 'says', independent of the protocol."""

    text: str | None = None
    thinking: str | None = None
    tool_name: str | None = None
    tool_args: str | None = None  # JSON text
    tool_call_id: str | None = None
    chunks: int = 3
    more_tools: tuple[tuple[str, str, str | None], ...] = ()  # (name, JSON args, id)


def _turn_of(item: Any) -> _Turn:
    if isinstance(item, Text):
        return _Turn(text=item.text, thinking=item.thinking, chunks=item.chunks)
    if isinstance(item, ToolCall):
        return _Turn(
            text=item.text,
            tool_name=item.name,
            tool_args=_dumps(item.arguments),
            tool_call_id=item.call_id,
            more_tools=tuple((c.name, _dumps(c.arguments), c.call_id) for c in item.also),
            thinking=item.thinking,
        )
    return _Turn(text=DEFAULT_REPLY.text, chunks=DEFAULT_REPLY.chunks)


@dataclass
class _Ctx:
    model: str
    input_tokens: int
    ids: _Ids
    include_usage: bool = False
    wrapped: bool = False  # Gemini under Code Assist: replies inside {response, traceId}


@dataclass
class _Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None = None  # a whole (non-streamed) body
    events: list[bytes] | None = None  # streamed: one chunk per event
    cut: int | None = None  # stop after this many events (or half the body) and drop
    delay: float = 0.0
    hold: threading.Event | None = None  # streamed: wait for it after the first event


SSE = "text/event-stream; charset=utf-8"
GEMINI_SSE = "text/event-stream"  # as the captures have it
JSON_CT = "application/json"
ORG_ID = "00000000-0000-0000-0000-000000000000"


def _sse(event: str | None, data: Any) -> bytes:
    payload = data if isinstance(data, str) else _dumps(data)
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()


# --------------------------------------------------------------------------- Anthropic


def _anthropic_usage(ctx: _Ctx, output_tokens: int, start: bool) -> dict:
    usage = {
        "input_tokens": ctx.input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
    }
    if start:
        usage["service_tier"] = "standard"
    return usage


def _anthropic(turn: _Turn, ctx: _Ctx, stream: bool) -> tuple[list[bytes], dict]:
    ids = ctx.ids
    msg_id = "msg_fake_" + ids.hex("msg", 20)
    out_tokens = max(1, _tokens(turn.text) + _tokens(turn.thinking) + _tokens(turn.tool_args))
    stop_reason = "tool_use" if turn.tool_name else "end_turn"
    blocks: list[dict] = []
    events: list[bytes] = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": ctx.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": _anthropic_usage(ctx, 1, start=True),
                },
            },
        )
    ]

    def start(index: int, block: dict, ping: bool) -> None:
        events.append(
            _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})
        )
        if ping:
            events.append(_sse("ping", {"type": "ping"}))

    def delta(index: int, d: dict) -> None:
        events.append(
            _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
        )

    def stop(index: int) -> None:
        events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))

    index = 0
    if turn.thinking is not None:
        sig = ids.signature()
        start(index, {"type": "thinking", "thinking": "", "signature": ""}, ping=index == 0)
        for piece in _split(turn.thinking, turn.chunks):
            delta(index, {"type": "thinking_delta", "thinking": piece})
        delta(index, {"type": "signature_delta", "signature": sig})
        stop(index)
        blocks.append({"type": "thinking", "thinking": turn.thinking, "signature": sig})
        index += 1
    if turn.text is not None:
        start(index, {"type": "text", "text": ""}, ping=index == 0)
        for piece in _split(turn.text, turn.chunks):
            delta(index, {"type": "text_delta", "text": piece})
        stop(index)
        blocks.append({"type": "text", "text": turn.text})
        index += 1
    calls = [(turn.tool_name, turn.tool_args, turn.tool_call_id)] if turn.tool_name else []
    for n, (name, args, call_id) in enumerate(calls + list(turn.more_tools)):
        tool_id = call_id or "toolu_fake_" + ids.hex(f"toolu{n}", 18)
        start(index, {"type": "tool_use", "id": tool_id, "name": name, "input": {}}, ping=False)
        for piece in ["", *_split(args or "", 2)]:
            delta(index, {"type": "input_json_delta", "partial_json": piece})
        stop(index)
        blocks.append({"type": "tool_use", "id": tool_id, "name": name, "input": json.loads(args or "{}")})
        index += 1

    events.append(
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": _anthropic_usage(ctx, out_tokens, start=False),
            },
        )
    )
    events.append(_sse("message_stop", {"type": "message_stop"}))
    full = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": _anthropic_usage(ctx, out_tokens, start=True),
    }
    return events, full


_ANTHROPIC_ERRORS = {
    400: ("invalid_request_error", "Invalid request."),
    401: ("authentication_error", "invalid x-api-key"),
    403: ("permission_error", "Your API key does not have permission to use the specified resource."),
    404: ("not_found_error", "The requested resource could not be found."),
    413: ("request_too_large", "Request exceeds the maximum allowed number of bytes."),
    429: ("rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit."),
    500: ("api_error", "Internal server error"),
    529: ("overloaded_error", "Overloaded"),
}

_OPENAI_ERRORS = {
    400: ("invalid_request_error", None, "Invalid request."),
    401: ("invalid_request_error", "invalid_api_key", "Incorrect API key provided."),
    403: ("invalid_request_error", "unsupported_country_region_territory", "Forbidden."),
    404: ("invalid_request_error", "not_found", "The requested resource could not be found."),
    429: ("requests", "rate_limit_exceeded", "Rate limit reached for requests. Please try again in 3s."),
    500: ("server_error", None, "The server had an error while processing your request."),
    503: ("server_error", None, "The server is overloaded or not ready yet."),
}


def _anthropic_error_body(status: int, request_id: str) -> dict:
    if status in _ANTHROPIC_ERRORS:
        etype, msg = _ANTHROPIC_ERRORS[status]
    elif status == 503:
        etype, msg = "overloaded_error", "Overloaded"
    elif status >= 500:
        etype, msg = "api_error", "Internal server error"
    else:
        etype, msg = "invalid_request_error", _reason(status).decode() or "Error"
    return {"type": "error", "error": {"type": etype, "message": msg}, "request_id": request_id}


def _openai_error_body(status: int) -> dict:
    if status in _OPENAI_ERRORS:
        etype, code, msg = _OPENAI_ERRORS[status]
    elif status >= 500:
        etype, code, msg = "server_error", None, "The server had an error while processing your request."
    else:
        etype, code, msg = "invalid_request_error", None, "Invalid request."
    return {"error": {"message": msg, "type": etype, "param": None, "code": code}}


# --------------------------------------------------------------------------- OpenAI Chat


def _chat(turn: _Turn, ctx: _Ctx, stream: bool) -> tuple[list[bytes], dict]:
    ids = ctx.ids
    cid = "chatcmpl-fake" + ids.hex("chatcmpl", 16)
    created = ids.created()
    out_tokens = max(1, _tokens(turn.text) + _tokens(turn.tool_args))
    usage = {
        "prompt_tokens": ctx.input_tokens,
        "completion_tokens": out_tokens,
        "total_tokens": ctx.input_tokens + out_tokens,
    }
    finish = "tool_calls" if turn.tool_name else "stop"
    calls = [(turn.tool_name, turn.tool_args, turn.tool_call_id)] if turn.tool_name else []
    calls = [(name, args, cid_ or "call_fake_" + ids.hex(f"call{n}" if n else "call", 12))
             for n, (name, args, cid_) in enumerate(calls + list(turn.more_tools))]
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": ctx.model}

    def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
        return _sse(
            None,
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]},
        )

    events = [chunk({"role": "assistant", "content": ""})]
    if turn.text is not None:
        for piece in _split(turn.text, turn.chunks):
            events.append(chunk({"content": piece}))
    for n, (name, args, call_id) in enumerate(calls):
        events.append(chunk({"tool_calls": [{"index": n, "id": call_id, "type": "function",
                                             "function": {"name": name, "arguments": ""}}]}))
        for piece in _split(args or "", 2):
            events.append(chunk({"tool_calls": [{"index": n, "function": {"arguments": piece}}]}))
    events.append(chunk({}, finish))
    if ctx.include_usage:
        events.append(_sse(None, {**base, "choices": [], "usage": usage}))
    events.append(_sse(None, "[DONE]"))

    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args or ""}}
            for name, args, call_id in calls
        ]
    full = {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": ctx.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
    }
    return events, full


# --------------------------------------------------------------------------- OpenAI Responses


def _responses(turn: _Turn, ctx: _Ctx, stream: bool) -> tuple[list[bytes], dict]:
    ids = ctx.ids
    resp_id = "resp_fake_" + ids.hex("resp", 20)
    created_at = ids.created()
    reasoning_tokens = _tokens(turn.thinking)
    out_tokens = max(1, _tokens(turn.text) + reasoning_tokens + _tokens(turn.tool_args))
    usage = {
        "input_tokens": ctx.input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": out_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": ctx.input_tokens + out_tokens,
    }

    def response(status: str, output: list, usage: dict | None) -> dict:
        return {
            "id": resp_id,
            "object": "response",
            "created_at": created_at,
            "status": status,
            "model": ctx.model,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage,
        }

    events: list[bytes] = []

    def emit(etype: str, **fields: Any) -> None:
        events.append(_sse(etype, {"type": etype, "sequence_number": len(events), **fields}))

    emit("response.created", response=response("in_progress", [], None))
    emit("response.in_progress", response=response("in_progress", [], None))
    output: list[dict] = []

    if turn.thinking is not None:
        oi = len(output)
        rs_id = "rs_fake_" + ids.hex("rs", 16)
        emit("response.output_item.added", output_index=oi, item={"id": rs_id, "type": "reasoning", "summary": []})
        emit(
            "response.reasoning_summary_part.added",
            item_id=rs_id,
            output_index=oi,
            summary_index=0,
            part={"type": "summary_text", "text": ""},
        )
        for piece in _split(turn.thinking, turn.chunks):
            emit(
                "response.reasoning_summary_text.delta",
                item_id=rs_id,
                output_index=oi,
                summary_index=0,
                delta=piece,
            )
        emit(
            "response.reasoning_summary_text.done",
            item_id=rs_id,
            output_index=oi,
            summary_index=0,
            text=turn.thinking,
        )
        emit(
            "response.reasoning_summary_part.done",
            item_id=rs_id,
            output_index=oi,
            summary_index=0,
            part={"type": "summary_text", "text": turn.thinking},
        )
        item = {"id": rs_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": turn.thinking}]}
        emit("response.output_item.done", output_index=oi, item=item)
        output.append(item)

    if turn.text is not None:
        oi = len(output)
        msg_id = "msg_fake_" + ids.hex("msg", 16)
        emit(
            "response.output_item.added",
            output_index=oi,
            item={"id": msg_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []},
        )
        emit(
            "response.content_part.added",
            item_id=msg_id,
            output_index=oi,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": []},
        )
        for piece in _split(turn.text, turn.chunks):
            emit(
                "response.output_text.delta",
                item_id=msg_id,
                output_index=oi,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        emit(
            "response.output_text.done",
            item_id=msg_id,
            output_index=oi,
            content_index=0,
            text=turn.text,
            logprobs=[],
        )
        part = {"type": "output_text", "text": turn.text, "annotations": []}
        emit("response.content_part.done", item_id=msg_id, output_index=oi, content_index=0, part=part)
        item = {"id": msg_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        emit("response.output_item.done", output_index=oi, item=item)
        output.append(item)

    calls = [(turn.tool_name, turn.tool_args, turn.tool_call_id)] if turn.tool_name else []
    for n, (name, args, call_id) in enumerate(calls + list(turn.more_tools)):
        oi = len(output)
        fc_id = "fc_fake_" + ids.hex(f"fc{n}" if n else "fc", 16)
        call_id = call_id or "call_fake_" + ids.hex(f"call{n}" if n else "call", 16)
        args = args or ""
        fc = {"id": fc_id, "type": "function_call", "status": "in_progress", "name": name, "call_id": call_id}
        emit("response.output_item.added", output_index=oi, item={**fc, "arguments": ""})
        for piece in _split(args, 2):
            emit("response.function_call_arguments.delta", item_id=fc_id, output_index=oi, delta=piece)
        emit("response.function_call_arguments.done", item_id=fc_id, output_index=oi, arguments=args)
        item = {**fc, "status": "completed", "arguments": args}
        emit("response.output_item.done", output_index=oi, item=item)
        output.append(item)

    full = response("completed", output, usage)
    emit("response.completed", response=full)
    return events, full


# --------------------------------------------------------------------------- Gemini


_GOOGLE_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                  404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL",
                  503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
_GEMINI_PATH = re.compile(r"^/v1[a-z0-9]*/models/(?P<model>[^/:]+):(?P<method>\w+)$"
                          r"|^/v1internal:(?P<internal>\w+)$")


def _gemini_error_body(status: int) -> dict:
    state = _GOOGLE_STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    return {"error": {"code": status, "message": _reason(status).decode() or "Error", "status": state}}


def _gemini(turn: _Turn, ctx: _Ctx, stream: bool) -> tuple[list[bytes], dict]:
    """Chunks as the Gemini API streams them: text in pieces (thoughts first, marked
    ``thought``), each call whole in one part with a ``thoughtSignature``, no ids; every chunk
    with the usage so far, the last with ``finishReason`` and the whole usage."""
    ids = ctx.ids
    resp_id = ids.hex("gemini", 22)
    thoughts = _tokens(turn.thinking)
    out_tokens = max(1, _tokens(turn.text) + _tokens(turn.tool_args))
    chunks: list[list[dict]] = []
    if turn.thinking is not None:
        chunks += [[{"text": piece, "thought": True}] for piece in _split(turn.thinking, turn.chunks)]
    if turn.text is not None:
        chunks += [[{"text": piece}] for piece in _split(turn.text, turn.chunks)]
    calls = [(turn.tool_name, turn.tool_args, None)] if turn.tool_name else []
    for n, (name, args, _) in enumerate(calls + list(turn.more_tools)):
        part: dict[str, Any] = {"functionCall": {"name": name, "args": json.loads(args or "{}")}}
        if n == 0:  # Gemini 3 signs the first call of a step
            part["thoughtSignature"] = ids.signature()[:64]
        chunks.append([part])
    chunks = chunks or [[{"text": ""}]]
    usage = {"promptTokenCount": ctx.input_tokens, "candidatesTokenCount": out_tokens,
             "totalTokenCount": ctx.input_tokens + out_tokens + thoughts}
    if thoughts:
        usage["thoughtsTokenCount"] = thoughts

    def body(parts: list[dict], last: bool) -> dict:
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
        if last:
            candidate["finishReason"] = "STOP"
        so_far = usage if last else {"promptTokenCount": ctx.input_tokens,
                                     "totalTokenCount": ctx.input_tokens}
        return {"candidates": [candidate], "usageMetadata": so_far,
                "modelVersion": ctx.model, "responseId": resp_id}

    def wrap(data: dict) -> dict:
        return {"response": data, "traceId": ids.hex("trace", 16)} if ctx.wrapped else data

    events = [f"data: {_dumps(wrap(body(parts, i == len(chunks) - 1)))}\r\n\r\n".encode()
              for i, parts in enumerate(chunks)]
    whole = [p for parts in chunks for p in parts if p != {"text": ""}]
    merged: list[dict] = []
    for p in whole:  # a whole reply joins the text a stream sends in pieces
        if merged and "text" in p and "text" in merged[-1] and p.get("thought") == merged[-1].get("thought"):
            merged[-1] = {**merged[-1], "text": merged[-1]["text"] + p["text"]}
        else:
            merged.append(p)
    return events, wrap(body(merged, True))


def _gemini_call(path: str, query: str) -> tuple[str, str, bool] | None:
    """(model, method, SSE) for a Gemini or Code Assist path."""
    m = _GEMINI_PATH.match(path)
    if not m:
        return None
    return m["model"] or "", m["method"] or m["internal"], "alt=sse" in query.split("&")


# --------------------------------------------------------------------------- the server


_PROTOCOLS = {"anthropic": _anthropic, "chat": _chat, "responses": _responses, "gemini": _gemini}


def _protocol_of(path: str) -> str | None:
    if _GEMINI_PATH.match(path):
        return "gemini"
    if path.endswith("/messages/count_tokens"):
        return "count_tokens"
    if path.endswith("/messages"):
        return "anthropic"
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/responses"):
        return "responses"
    return None


def _ws_error(status: int, code: str, message: str, param: str | None) -> dict:
    return {"type": "error", "status": status, "error": {
        "type": "invalid_request_error", "code": code, "message": message, "param": param}}


def _ws_bare(rid: str, model: str, output: list[dict]) -> list[dict]:
    """A response of these items and nothing streamed between (a prewarm, a compaction)."""
    response = {"id": rid, "object": "response", "status": "in_progress", "model": model,
                "output": [], "usage": None}
    done = {**response, "status": "completed", "output": output, "usage": {
        "input_tokens": 1, "output_tokens": len(output), "total_tokens": 1 + len(output)}}
    return [{"type": "response.created", "response": response},
            *({"type": "response.output_item.done", "output_index": i, "item": item}
              for i, item in enumerate(output)),
            {"type": "response.completed", "response": done}]


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return {529: b"Overloaded"}.get(status, b"")


class FakeProvider:
    """The fake provider server. ``start()`` returns self; also a context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.websockets = True  # False: an upgrade is answered 426
        self.refused: list[str] = []  # previous_response_ids refused (never issued here)
        self._stored: set[str] = set()  # responses kept for any connection (store: true)
        self._serial = 0  # WebSocket responses get ids of their own: every id issued once
        self.port: int | None = None
        self._bind_port = port
        self._cond = threading.Condition()
        self._requests: list[Recorded] = []
        self._queue: deque[Any] = deque()
        self.errors: list[BaseException] = []  # unexpected server-side exceptions, for debugging
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._live: set[int] = set()  # id() of each request whose connection is still open

    # ---------------------------------------------------------------- public API

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("FakeProvider is not started")
        return f"http://{self.host}:{self.port}"

    def start(self) -> FakeProvider:
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                try:
                    self._server = loop.run_until_complete(
                        asyncio.start_server(self._handle, self.host, self._bind_port)
                    )
                    self.port = self._server.sockets[0].getsockname()[1]
                except BaseException as exc:  # noqa: BLE001 - reported to start()
                    failure.append(exc)
                    return
                finally:
                    ready.set()
                loop.run_forever()
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

        self._thread = threading.Thread(target=run, name="fake-provider", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if not loop.is_closed():
            # Best effort: we are tearing down.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=10)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._thread = None
        self._loop = None
        self._server = None

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def script(self, *items: Any) -> FakeProvider:
        """Queue replies, consumed one per generation request (messages, chat
        completions, responses), in order. count_tokens and other paths don't consume."""
        for item in items:
            if not isinstance(item, (Text, ToolCall, Error, Cut)):
                raise TypeError(f"not a script item: {item!r}")
        with self._cond:
            self._queue.extend(items)
        return self

    @property
    def requests(self) -> list[Recorded]:
        """A snapshot of the requests recorded so far, in arrival order."""
        with self._cond:
            return list(self._requests)

    @property
    def pending(self) -> int:
        """How many script items are still queued."""
        with self._cond:
            return len(self._queue)

    def wait_requests(self, n: int, timeout: float = 5.0) -> list[Recorded]:
        """Block until at least ``n`` requests are recorded; returns the snapshot.
        Raises TimeoutError if they don't arrive in time."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._requests) >= n, timeout):
                raise TimeoutError(f"expected {n} requests, got {len(self._requests)} within {timeout}s")
            return list(self._requests)

    def wait_hung_up(self, request: Recorded | None = None, timeout: float = 5.0) -> None:
        """Block until the connection that carried `request` has ended (the server has seen its
        client hang up); without one, every connection. Raises TimeoutError if still open."""
        with self._cond:
            if not self._cond.wait_for(lambda: id(request) not in self._live if request
                                       else not self._tasks, timeout):
                raise TimeoutError(f"the connection is still open after {timeout}s")

    def clear(self) -> None:
        """Drop recorded requests and queued script items."""
        with self._cond:
            self._requests.clear()
            self._queue.clear()
            self.refused.clear()

    # ---------------------------------------------------------------- internals

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    def _record(self, req: h11.Request, body: bytes, carried: list[int]) -> Recorded:
        split = urlsplit(req.target.decode("latin-1"))
        headers: dict[str, str] = {}
        for name, value in req.headers:
            key = name.decode("latin-1").lower()
            val = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        try:
            parsed = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            parsed = None
        rec = Recorded(
            method=req.method.decode("latin-1"),
            path=split.path,
            query=split.query,
            headers=headers,
            body=body,
            json=parsed,
        )
        with self._cond:
            self._requests.append(rec)
            self._live.add(id(rec))
            carried.append(id(rec))
            self._cond.notify_all()
        return rec

    def _next_item(self) -> Any:
        with self._cond:
            return self._queue.popleft() if self._queue else DEFAULT_REPLY

    def _build(self, rec: Recorded) -> _Reply:
        proto = _protocol_of(rec.path)
        body = rec.json if isinstance(rec.json, dict) else None
        model = str(body.get("model", "")) if body else ""
        gemini = _gemini_call(rec.path, rec.query) if proto == "gemini" else None
        if gemini is not None:
            model = gemini[0] or model
            if body is not None and "contents" not in body and isinstance(body.get("request"), dict):
                body = {**body["request"], "wrapped": True}  # Code Assist's envelope
            if body is not None:  # the path says whether it streams, not the body
                body = {**body, "stream": gemini[1] == "streamGenerateContent"}
        ids = _Ids(proto, rec.method, rec.path, model, bool(body and body.get("stream")))
        anthropic_like = proto in ("anthropic", "count_tokens")
        req_id = "req_fake_" + ids.hex("request", 16)

        def base_headers(content_type: str) -> list[tuple[str, str]]:
            if anthropic_like:
                return [("Content-Type", content_type), ("request-id", req_id), ("anthropic-organization-id", ORG_ID)]
            return [("Content-Type", content_type), ("x-request-id", req_id)]

        def error(status: int, err_body: dict | None = None, extra: dict[str, str] | None = None, rid: str = req_id) -> _Reply:
            if err_body is None:
                err_body = (_anthropic_error_body(status, rid) if anthropic_like
                            else _gemini_error_body(status) if gemini else _openai_error_body(status))
            headers = base_headers(JSON_CT)
            headers = [(k, rid if k in ("request-id", "x-request-id") else v) for k, v in headers]
            for k, v in (extra or {}).items():
                headers = [(hk, hv) for hk, hv in headers if hk.lower() != k.lower()]
                headers.append((k, v))
            return _Reply(status, headers, body=_dumps(err_body).encode())

        if rec.method == "GET" and rec.headers.get("upgrade", "").lower() == "websocket":
            return error(426)  # websockets off: the client retries over HTTP
        if rec.method in ("HEAD", "GET") and rec.path in ("", "/"):
            # Claude Code probes ``HEAD /`` before its first request.
            return _Reply(200, [("Content-Type", JSON_CT)], body=b"{}")
        if proto is None:
            return error(404)
        if rec.method != "POST":
            return error(405 if anthropic_like else 404)
        if body is None:
            return error(400)
        input_tokens = max(1, len(rec.body) // 4)
        if proto == "count_tokens":
            return _Reply(200, base_headers(JSON_CT), body=_dumps({"input_tokens": input_tokens}).encode())
        if gemini is not None and gemini[1] == "countTokens":
            return _Reply(200, base_headers(JSON_CT), body=_dumps({"totalTokens": input_tokens}).encode())
        if gemini is not None and gemini[1] not in ("generateContent", "streamGenerateContent"):
            return error(404)

        item = self._next_item()
        stream = bool(body.get("stream"))
        ids = _Ids(proto, stream, _item_key(item), model)
        req_id = "req_fake_" + ids.hex("request", 16)
        if isinstance(item, Error):
            return error(item.status, item.body, item.headers, rid=req_id)

        stream_options = body.get("stream_options")
        ctx = _Ctx(
            model=model,
            input_tokens=input_tokens,
            ids=ids,
            include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
            wrapped=bool(body.get("wrapped")),
        )
        events, full = _PROTOCOLS[proto](_turn_of(item), ctx, stream)
        hold = item.hold if isinstance(item, Text) else None
        delay = item.delay if isinstance(item, Text | ToolCall) else 0.0
        cut = max(0, item.after_events) if isinstance(item, Cut) else None
        if stream and gemini is not None and not gemini[2]:
            # Without alt=sse the API streams one JSON array of the chunks.
            array = "[" + ",\r\n".join(e.decode()[6:].strip() for e in events) + "]"
            return _Reply(200, base_headers(JSON_CT), body=array.encode(), cut=cut)
        if stream:
            return _Reply(200, base_headers(GEMINI_SSE if gemini else SSE), events=events, cut=cut,
                          delay=delay, hold=hold)
        return _Reply(200, base_headers(JSON_CT), body=_dumps(full).encode(), cut=cut)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            with self._cond:
                self._tasks.add(task)
        conn = h11.Connection(h11.SERVER)
        carried: list[int] = []  # the requests this connection carried
        try:
            while True:
                got = await self._read_request(conn, reader, writer)
                if got is None:
                    break
                rec = self._record(*got, carried)
                if (self.websockets and rec.method == "GET"
                        and rec.headers.get("upgrade", "").lower() == "websocket"):
                    await self._websocket(rec, conn.trailing_data[0], reader, writer)
                    break
                if not await self._respond(conn, writer, rec):
                    break
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    break
        except asyncio.CancelledError:
            # Shutting down. Swallowed on purpose: CPython 3.12.1's start_server callback
            # calls task.exception() on a cancelled task and logs the CancelledError.
            pass
        except (ConnectionError, OSError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass  # client went away or spoke nonsense: not our problem
        except Exception as exc:  # noqa: BLE001 - keep the server alive, remember why
            self.errors.append(exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                await writer.wait_closed()
            with self._cond:
                if task is not None:
                    self._tasks.discard(task)
                self._live.difference_update(carried)
                self._cond.notify_all()

    async def _websocket(self, handshake: Recorded, data: bytes, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """The Responses WebSocket: the upgrade accepted (no extension), then each text
        message recorded and answered with its events, one event a message."""
        key = handshake.headers.get("sec-websocket-key", "")
        accept = base64.b64encode(hashlib.sha1(
            (key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        writer.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n").encode())
        ws = Connection(ConnectionType.SERVER)
        last = ""  # the connection's last response: what store: false keeps
        text: list[str] = []
        while True:
            if data:
                ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, Ping):
                    writer.write(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    writer.write(ws.send(event.response()))
                    await writer.drain()
                    return
                elif isinstance(event, TextMessage):
                    text.append(event.data)
                    if not event.message_finished:
                        continue
                    body, text = "".join(text), []
                    rec = self._record_message(handshake, body)
                    for reply in self._ws_reply(rec.json, last):
                        if reply.get("type") == "response.completed":
                            last = reply["response"]["id"]
                        writer.write(ws.send(TextMessage(data=json.dumps(reply))))
            await writer.drain()
            data = await reader.read(65536)
            if not data:
                return

    def _record_message(self, handshake: Recorded, body: str) -> Recorded:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        rec = replace(handshake, method="WS", body=body.encode(), json=parsed)
        with self._cond:
            self._requests.append(rec)
            self._cond.notify_all()
        return rec

    def _ws_reply(self, body: Any, last: str) -> list[dict]:
        """A `response.create` message's events."""
        if not isinstance(body, dict) or body.get("type") != "response.create":
            return [_ws_error(400, "invalid_request_error", "expected response.create", None)]
        prev = body.get("previous_response_id")
        if prev is not None and prev != last and prev not in self._stored:
            with self._cond:
                self.refused.append(str(prev))
            return [_ws_error(400, "previous_response_not_found",
                              f"Previous response with id '{prev}' not found.",
                              "previous_response_id")]
        items = body.get("input") if isinstance(body.get("input"), list) else []
        with self._cond:
            self._serial += 1
            rid = f"resp_ws_{self._serial:06d}_" + hashlib.sha256(
                f"{id(self)}:{self._serial}".encode()).hexdigest()[:12]
        if body.get("store") is not False:
            self._stored.add(rid)
        model = str(body.get("model", ""))
        if body.get("generate") is False:
            return _ws_bare(rid, model, [])
        if items and isinstance(items[-1], dict) and items[-1].get("type") == "compaction_trigger":
            return _ws_bare(rid, model, [{"id": "cmp_" + rid, "type": "compaction",
                                          "encrypted_content": "FAKE_COMPACTION_" + rid}])
        item = self._next_item()
        if isinstance(item, Error):
            return [_ws_error(item.status, "server_error", "scripted error", None)]
        ids = _Ids("responses", True, _item_key(item), model, rid)
        ctx = _Ctx(model=model, input_tokens=max(1, len(json.dumps(items)) // 4), ids=ids,
                   include_usage=False, wrapped=False)
        events, _ = _responses(_turn_of(item), ctx, True)
        out = []
        for raw in events:
            event = json.loads(raw.decode().split("data: ", 1)[1])
            if isinstance(event.get("response"), dict):
                event["response"]["id"] = rid
            out.append(event)
        return out

    async def _read_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[h11.Request, bytes] | None:
        req: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                    await writer.drain()
                conn.receive_data(await reader.read(65536))
                continue
            if isinstance(event, h11.Request):
                req = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert req is not None
                return req, bytes(body)
            else:  # ConnectionClosed, PAUSED
                return None

    async def _respond(self, conn: h11.Connection, writer: asyncio.StreamWriter, rec: Recorded) -> bool:
        """Send the reply; False when the connection must not be reused."""
        reply = self._build(rec)

        async def send(event: Any) -> None:
            data = conn.send(event)
            if data:
                writer.write(data)
                await writer.drain()

        headers = list(reply.headers)
        if reply.events is None:
            body = reply.body or b""
            headers.append(("Content-Length", str(len(body))))
            await send(h11.Response(status_code=reply.status, headers=headers, reason=_reason(reply.status)))
            if reply.cut is not None:
                if body and rec.method != "HEAD":
                    await send(h11.Data(data=body[: len(body) // 2]))
                return False
            if body and rec.method != "HEAD":
                await send(h11.Data(data=body))
            await send(h11.EndOfMessage())
            return True

        headers.append(("Transfer-Encoding", "chunked"))
        await send(h11.Response(status_code=reply.status, headers=headers, reason=_reason(reply.status)))
        for i, event in enumerate(reply.events):
            if reply.cut is not None and i >= reply.cut:
                return False
            if i == 1 and reply.hold is not None:
                await asyncio.to_thread(reply.hold.wait, 30)
            if i and reply.delay > 0:
                await asyncio.sleep(reply.delay)
            await send(h11.Data(data=event))
        if reply.cut is not None:
            return False
        await send(h11.EndOfMessage())
        return True
