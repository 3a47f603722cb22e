"""OpenAI Chat Completions: request bodies and replies (streamed or whole) to the neutral model."""

from __future__ import annotations

import json
import time
from typing import Any

from ..conversation import Kind, Message, ParsedRequest, Part, Protocol, Reply, Usage, text_part
from ..errors import ProtocolError
from ..sse import Event

HINT_FIELDS = ("user", "safety_identifier", "prompt_cache_key")


def parse_request(body: dict[str, Any]) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ProtocolError("Chat Completions request without a messages list")
    indexed = [(i, _message(m)) for i, m in enumerate(messages) if isinstance(m, dict)]
    system = "\n".join(m.text for _, m in indexed if m.role == "system")
    return ParsedRequest(
        protocol=Protocol.CHAT,
        model=str(body.get("model", "")),
        stream=bool(body.get("stream", False)),
        messages=[m for _, m in indexed if m.role != "system"],
        system=system,
        tool_names=[
            str((t.get("function") or {}).get("name", "")) for t in body.get("tools") or []
            if isinstance(t, dict)
        ],
        hints={f: body[f] for f in HINT_FIELDS if isinstance(body.get(f), str)},
        raw_index=[i for i, m in indexed if m.role != "system"],
    )


def replace_history(body: dict[str, Any], frame: list[Message], keep_from: int) -> dict[str, Any]:
    """The body with messages before raw index `keep_from` replaced by the frame; system and
    developer messages stay first, untouched."""
    raw = body["messages"]
    kept_system = [m for m in raw[:keep_from]
                   if isinstance(m, dict) and m.get("role") in ("system", "developer")]
    rendered = [{"role": m.role, "content": "\n\n".join(p.text for p in m.parts)} for m in frame]
    return {**body, "messages": kept_system + rendered + raw[keep_from:]}


def _message(m: dict[str, Any]) -> Message:
    role = str(m.get("role", "user"))
    if role == "developer":
        role = "system"
    if role == "tool":
        return Message("tool", (Part(Kind.TOOL_RESULT, _text_of(m.get("content")), call_id=str(m.get("tool_call_id", ""))),))
    parts: list[Part] = []
    content = m.get("content")
    if isinstance(content, str):
        parts.append(text_part(content))
    elif isinstance(content, list):
        for c in content:
            if not isinstance(c, dict):
                continue
            if c.get("type") in ("text", "input_text"):
                parts.append(text_part(str(c.get("text", ""))))
            elif c.get("type") in ("image_url", "input_audio", "file"):
                parts.append(Part(Kind.MEDIA, f"[{c.get('type')}]"))
    if isinstance(m.get("reasoning_content"), str):
        parts.insert(0, Part(Kind.THINKING, m["reasoning_content"]))
    for call in m.get("tool_calls") or []:
        if isinstance(call, dict):
            fn = call.get("function") or {}
            parts.append(Part(Kind.TOOL_CALL, _args(fn.get("arguments")), name=str(fn.get("name", "")), call_id=str(call.get("id", ""))))
    return Message(role, tuple(parts))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return ""


def _args(raw: Any) -> str:
    """Arguments as canonical JSON when they parse, else as sent."""
    if isinstance(raw, str):
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False, sort_keys=True)
        except ValueError:
            return raw
    return json.dumps(raw, ensure_ascii=False, sort_keys=True)


def _usage(u: dict[str, Any] | None) -> Usage:
    u = u or {}
    details = u.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=int(u.get("prompt_tokens") or 0),
        output_tokens=int(u.get("completion_tokens") or 0),
        cache_read_tokens=int(details.get("cached_tokens") or 0),
    )


def reply_from_body(body: dict[str, Any]) -> Reply:
    choice = (body.get("choices") or [{}])[0]
    msg = _message(choice.get("message") or {"role": "assistant"})
    return Reply(Message("assistant", msg.parts), _usage(body.get("usage")), str(choice.get("finish_reason") or ""))


class ReplyAssembler:
    """Rebuilds the assistant message from chat.completion.chunk events (first choice only)."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._calls: dict[int, dict[str, str]] = {}
        self._usage = Usage()
        self._stop = ""
        self._done = False

    def feed(self, ev: Event) -> None:
        if ev.data.strip() == "[DONE]":
            self._done = True
            return
        try:
            data = json.loads(ev.data)
        except ValueError:
            return
        if data.get("usage"):
            self._usage = _usage(data["usage"])
        for choice in data.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                self._text.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                slot = self._calls.setdefault(int(call.get("index", 0)), {"id": "", "name": "", "args": ""})
                fn = call.get("function") or {}
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] = fn.get("name") or slot["name"]
                slot["args"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self._stop = str(choice["finish_reason"])

    def reply(self) -> Reply:
        parts: list[Part] = []
        if self._text:
            parts.append(text_part("".join(self._text)))
        for _, c in sorted(self._calls.items()):
            parts.append(Part(Kind.TOOL_CALL, _args(c["args"]), name=c["name"], call_id=c["id"]))
        return Reply(Message("assistant", tuple(parts)), self._usage, self._stop, self._done)


def render_text(text: str, model: str, stream: bool, reply_id: str) -> bytes:
    """A whole assistant reply the proxy answers itself, as the provider would have sent it."""
    created = int(time.time())
    if not stream:
        return json.dumps({
            "id": reply_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }).encode()

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        data = {"id": reply_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                             "logprobs": None}]}
        return f"data: {json.dumps(data)}\n\n".encode()

    return (chunk({"role": "assistant", "content": text}, None) + chunk({}, "stop")
            + b"data: [DONE]\n\n")
