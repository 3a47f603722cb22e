"""OpenAI Chat Completions: request bodies and replies (streamed or whole) to the neutral model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from perpetuity_core.errors import ProtocolError
from perpetuity_core.wire.conversation import (
    Kind,
    Message,
    ParsedRequest,
    Part,
    Protocol,
    Reply,
    Usage,
    read_before,
    text_part,
)
from perpetuity_core.wire.protocols.base import BodyMergerBase, StreamMergerBase, spliced
from perpetuity_core.wire.sse import Event

HINT_FIELDS = ("user", "safety_identifier", "prompt_cache_key")


def parse_request(body: dict[str, Any], known: ParsedRequest | None = None,
                  reused: int = 0) -> ParsedRequest:
    """`known`: an earlier request whose first `reused` raw messages are this body's, the same
    objects (wire.seen). Each message reads alone, so those are taken as it read them and only
    the rest is read; the system prompt is read again from the system messages alone."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ProtocolError("Chat Completions request without a messages list")
    start = reused if known is not None and 0 < reused <= len(messages) else 0
    raw_index, parsed, standing = read_before(known, start)
    for i in range(start, len(messages)):
        if isinstance(messages[i], dict):
            m = _message(messages[i])
            if m.role == "system":
                standing.append(i)
            else:
                raw_index.append(i)
                parsed.append(m)
    return ParsedRequest(
        protocol=Protocol.CHAT,
        model=str(body.get("model", "")),
        stream=bool(body.get("stream", False)),
        messages=parsed,
        system="\n".join(_message(messages[i]).text for i in standing),
        tool_names=[
            str((t.get("function") or {}).get("name", "")) for t in body.get("tools") or []
            if isinstance(t, dict)
        ],
        hints={f: body[f] for f in HINT_FIELDS if isinstance(body.get(f), str)},
        raw_index=raw_index,
        raw_standing=standing,
    )


def replace_history(body: dict[str, Any], frame: list[Message], keep_from: int,
                    inserts: Mapping[int, list[Message]] | None = None,
                    standing: Sequence[int] | None = None) -> dict[str, Any]:
    """The body with messages before raw index `keep_from` replaced by the frame, and each of
    `inserts` (raw index -> messages) put just before the message at that index; system and
    developer messages (`standing`: their raw indexes; None: looked for) stay first, untouched."""
    raw = body["messages"]
    kept_system = [raw[i] for i in standing if i < keep_from] if standing is not None else [
        m for m in raw[:keep_from]
        if isinstance(m, dict) and m.get("role") in ("system", "developer")]
    kept = spliced(raw, keep_from, inserts, _render)
    return {**body, "messages": kept_system + _render(frame) + kept}


def _render(messages: list[Message]) -> list[dict[str, Any]]:
    """Each message as one text message, made once and kept on it (`Message.wire_form`): a
    frame's messages made before (frame.render.Said) hand on the same objects, which
    wire.written writes once. Never changed after."""
    return [m.wire_form(_one_message) for m in messages]


def _one_message(m: Message) -> dict[str, Any]:
    return {"role": m.role, "content": "\n\n".join(p.text for p in m.parts)}


def check(body: dict[str, Any]) -> list[str]:
    """Why Chat Completions would refuse this body ([] when it would not), as far as replacing
    history can break it: every `tool` message answers a call of the assistant message before
    it, and every call is answered before any other message (or the request's end)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        return ["no messages"]
    errors: list[str] = []
    open_calls: set[str] = set()
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            errors.append(f"message {i} is not an object")
            continue
        if m.get("role") == "tool":
            call = str(m.get("tool_call_id"))
            if call not in open_calls:
                errors.append(f"message {i}: tool message without its call: {call}")
            open_calls.discard(call)
            continue
        if open_calls:
            errors.append(f"message {i}: tool calls without results: {sorted(open_calls)}")
        open_calls = {str(c.get("id")) for c in m.get("tool_calls") or [] if isinstance(c, dict)}
    if open_calls:
        errors.append(f"tool calls without results at the end: {sorted(open_calls)}")
    return errors


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
            parts.append(Part(Kind.TOOL_CALL, canonical_arguments(fn.get("arguments")), name=str(fn.get("name", "")), call_id=str(call.get("id", ""))))
    return Message(role, tuple(parts))


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
    return ""


def canonical_arguments(raw: Any) -> str:
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
        data = ev.json()
        if data is None:
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
            parts.append(Part(Kind.TOOL_CALL, canonical_arguments(c["args"]), name=c["name"], call_id=c["id"]))
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


# --------------------------------------------------------------------------- the tool loop


def add_tools(body: dict[str, Any], tools: list[dict[str, Any]], last_round: bool) -> dict[str, Any]:
    """Our tools beside the harness's own; on the last round the model must answer."""
    defs = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                              "parameters": t["input_schema"]}} for t in tools]
    out = {**body, "tools": list(body.get("tools") or []) + defs}
    if last_round:
        out["tool_choice"] = "none"
    return out


def continue_body(body: dict[str, Any], assistant: dict[str, Any],
                  results: list[tuple[str, str]]) -> dict[str, Any]:
    """The next round's request: this round's assistant message and our tools' results."""
    return {**body, "messages": list(body["messages"]) + [assistant] + [
        {"role": "tool", "tool_call_id": call_id, "content": text} for call_id, text in results]}


def ping() -> bytes:
    return b": ping\n\n"


def error_event(message: str) -> bytes:
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n".encode()


def _calls(calls: dict[int, dict[str, str]], indexes: Iterable[int]) -> list[dict[str, Any]]:
    return [{"id": calls[i]["id"], "type": "function",
             "function": {"name": calls[i]["name"], "arguments": calls[i]["args"]}}
            for i in sorted(indexes)]


class StreamMerger(StreamMergerBase):
    """Rounds of chat.completion.chunk events merged into the one stream the client sees.

    Our tools' calls are hidden, the client's tool-call indexes renumbered consecutively, the
    first round's id kept on every chunk; one finish_reason, one usage chunk (summed) and one
    [DONE] end it.
    """

    def __init__(self, ours: frozenset[str]) -> None:
        self.id = ""
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        self.wants_usage = False
        self.template: dict[str, Any] = {}
        super().__init__(ours)

    def _new_round(self) -> None:
        super()._new_round()
        self.text: list[str] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.finish_reason = ""

    def feed(self, name: str, data: dict[str, Any]) -> bytes:
        if "error" in data:  # the provider's own error event, as it sent it
            return f"data: {json.dumps(data)}\n\n".encode()
        self.id = self.id or str(data.get("id", ""))
        self.template = self.template or {k: data[k] for k in ("object", "created", "model") if k in data}
        if data.get("usage"):
            self.wants_usage = True
            for key in self.usage:
                self.usage[key] += int(data["usage"].get(key) or 0)
        choices = []
        for choice in data.get("choices") or []:
            delta = dict(choice.get("delta") or {})
            if isinstance(delta.get("content"), str):
                self.text.append(delta["content"])
            visible = []
            for call in delta.get("tool_calls") or []:
                i = int(call.get("index", 0))
                slot = self.calls.setdefault(i, {"id": "", "name": "", "args": ""})
                fn = call.get("function") or {}
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] = fn.get("name") or slot["name"]
                slot["args"] += fn.get("arguments") or ""
                if slot["name"] in self.ours:
                    self.hidden.add(i)
                if i in self.hidden:
                    continue
                visible.append({**call, "index": self._renumbered(i)})
            if "tool_calls" in delta:
                delta["tool_calls"] = visible
                if not visible:
                    del delta["tool_calls"]
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
                choice = {**choice, "finish_reason": None}
            if delta or choice.get("logprobs"):
                choices.append({**choice, "delta": delta})
        if not choices:
            return b""
        chunk = {**data, "id": self.id, "choices": choices}
        chunk.pop("usage", None)  # summed over rounds, sent once at the end
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def our_calls(self) -> list[tuple[str, str, Any]]:
        return [(self.calls[i]["id"], self.calls[i]["name"], self.calls[i]["args"])
                for i in sorted(self.hidden)]

    def others_called(self) -> bool:
        return any(i not in self.hidden for i in self.calls)

    def assistant_blocks(self) -> dict[str, Any]:
        return {"role": "assistant", "content": "".join(self.text) or None,
                "tool_calls": _calls(self.calls, self.hidden)}

    def finish(self) -> bytes:
        reason = self.finish_reason or "stop"
        if reason == "tool_calls" and not self.others_called():
            reason = "stop"
        end = {"id": self.id, **self.template,
               "choices": [{"index": 0, "delta": {}, "finish_reason": reason, "logprobs": None}]}
        out = f"data: {json.dumps(end)}\n\n"
        if self.wants_usage:
            out += f"data: {json.dumps({'id': self.id, **self.template, 'choices': [], 'usage': self.usage})}\n\n"
        return (out + "data: [DONE]\n\n").encode()


class BodyMerger(BodyMergerBase):
    """Rounds of whole chat.completion bodies merged into the one the client sees."""

    USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")

    def __init__(self, ours: frozenset[str]) -> None:
        super().__init__(ours)
        self.text: list[str] = []
        self.round: dict[str, Any] = {}

    def _take(self, body: dict[str, Any]) -> None:
        self.round = ((body.get("choices") or [{}])[0].get("message")) or {}
        if isinstance(self.round.get("content"), str):
            self.text.append(self.round["content"])
        self.visible += [c for c in self.round.get("tool_calls") or []
                         if (c.get("function") or {}).get("name") not in self.ours]

    def our_calls(self) -> list[tuple[str, str, Any]]:
        return [(str(c.get("id", "")), str(c["function"]["name"]), c["function"].get("arguments", ""))
                for c in self.round.get("tool_calls") or []
                if (c.get("function") or {}).get("name") in self.ours]

    def others_called(self) -> bool:
        return any((c.get("function") or {}).get("name") not in self.ours
                   for c in self.round.get("tool_calls") or [])

    def assistant_blocks(self) -> dict[str, Any]:
        ours = [c for c in self.round.get("tool_calls") or []
                if (c.get("function") or {}).get("name") in self.ours]
        return {"role": "assistant", "content": self.round.get("content"), "tool_calls": ours}

    def next_round(self) -> None:
        self.round = {}

    def finish(self) -> bytes:
        choice = dict((self.last.get("choices") or [{}])[0])
        message = {**(choice.get("message") or {}), "role": "assistant",
                   "content": "".join(self.text) or None}
        message.pop("tool_calls", None)
        if self.visible:
            message["tool_calls"] = self.visible
        choice.update(message=message, finish_reason="tool_calls" if self.visible else
                      (choice.get("finish_reason") if choice.get("finish_reason") != "tool_calls"
                       else "stop"))
        out = {**(self.first or {}), "choices": [choice], "usage": self.usage}
        return json.dumps(out).encode()
