"""OpenAI Responses: request bodies and replies (streamed or whole) to the neutral model.

Responses lists items, not messages: a reply is a run of reasoning, message and function_call
items. Consecutive items of one role are folded into one neutral message, so a reply captured
from the stream and the same reply re-sent as input items yield the same message.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..conversation import Kind, Message, ParsedRequest, Part, Protocol, Reply, Usage, text_part
from ..errors import ProtocolError
from ..sse import Event
from .chat import HINT_FIELDS, _args


def parse_request(body: dict[str, Any]) -> ParsedRequest:
    raw = body.get("input")
    if isinstance(raw, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list):
        items = raw
    else:
        raise ProtocolError("Responses request without input")
    starts = _fold_starts(items)
    messages = [m for _, m in starts]
    system = "\n".join(m.text for m in messages if m.role == "system")
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        system = instructions + ("\n" + system if system else "")
    hints = {f: body[f] for f in HINT_FIELDS if isinstance(body.get(f), str)}
    if isinstance(body.get("previous_response_id"), str):
        hints["previous_response_id"] = body["previous_response_id"]
    return ParsedRequest(
        protocol=Protocol.RESPONSES,
        model=str(body.get("model", "")),
        stream=bool(body.get("stream", False)),
        messages=[m for m in messages if m.role != "system"],
        system=system,
        tool_names=[str(t.get("name", t.get("type", ""))) for t in body.get("tools") or [] if isinstance(t, dict)],
        hints=hints,
        generate=body.get("generate") is not False,
        compaction=any(isinstance(i, dict) and i.get("type") == "compaction_trigger" for i in items),
        raw_index=[i for i, m in starts if m.role != "system"],
    )


def replace_history(body: dict[str, Any], frame: list[Message], keep_from: int) -> dict[str, Any]:
    """The body with input items before `keep_from` replaced by the frame; system and developer
    messages stay first, untouched."""
    raw = body["input"]
    if isinstance(raw, str):
        raw, keep_from = [{"type": "message", "role": "user", "content": raw}], 0
    kept_system = [m for m in raw[:keep_from] if isinstance(m, dict)
                   and m.get("type", "message") == "message" and m.get("role") in ("system", "developer")]
    rendered = [{"type": "message", "role": m.role, "content": [
        {"type": "input_text" if m.role == "user" else "output_text", "text": p.text}
        for p in m.parts]} for m in frame]
    return {**body, "input": kept_system + rendered + raw[keep_from:]}


def _item(item: dict[str, Any]) -> tuple[str, list[Part]] | None:
    t = item.get("type", "message")
    if t == "message":
        role = str(item.get("role", "user"))
        role = "system" if role == "developer" else role
        content = item.get("content")
        if isinstance(content, str):
            return role, [text_part(content)]
        parts: list[Part] = []
        for c in content or []:
            if not isinstance(c, dict):
                continue
            if c.get("type") in ("input_text", "output_text", "text"):
                parts.append(text_part(str(c.get("text", ""))))
            elif c.get("type") == "refusal":
                parts.append(Part(Kind.TEXT, str(c.get("refusal", ""))))
            elif c.get("type") in ("input_image", "input_file", "input_audio"):
                parts.append(Part(Kind.MEDIA, f"[{c.get('type')}]"))
        return role, parts
    if t == "reasoning":
        summary = "\n".join(str(s.get("text", "")) for s in item.get("summary") or [] if isinstance(s, dict))
        return "assistant", [Part(Kind.THINKING, summary)]
    if t in ("function_call", "custom_tool_call"):
        args = item.get("arguments", item.get("input", ""))
        return "assistant", [Part(Kind.TOOL_CALL, _args(args), name=str(item.get("name", "")), call_id=str(item.get("call_id", "")))]
    if t in ("function_call_output", "custom_tool_call_output"):
        out = item.get("output", "")
        if isinstance(out, list):
            out = "\n".join(str(o.get("text", "")) for o in out if isinstance(o, dict))
        return "tool", [Part(Kind.TOOL_RESULT, str(out), call_id=str(item.get("call_id", "")))]
    return None


def _fold_starts(items: list[Any]) -> list[tuple[int, Message]]:
    """Messages folded from items, each with the index of the item it starts at."""
    out: list[tuple[int, Message]] = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or not (got := _item(item)):
            continue
        role, parts = got
        # Assistant items of one reply fold into one message; user turns stay separate.
        if out and role in ("assistant", "tool") and out[-1][1].role == role:
            out[-1] = (out[-1][0], Message(role, out[-1][1].parts + tuple(parts)))
        else:
            out.append((index, Message(role, tuple(parts))))
    return out


def _fold(items: list[Any]) -> list[Message]:
    return [m for _, m in _fold_starts(items)]


def _usage(u: dict[str, Any] | None) -> Usage:
    u = u or {}
    return Usage(
        input_tokens=int(u.get("input_tokens") or 0),
        output_tokens=int(u.get("output_tokens") or 0),
        cache_read_tokens=int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0),
    )


def reply_from_body(body: dict[str, Any]) -> Reply:
    folded = _fold(list(body.get("output") or []))
    parts = tuple(p for m in folded for p in m.parts)
    return Reply(Message("assistant", parts), _usage(body.get("usage")), str(body.get("status") or ""))


class ReplyAssembler:
    """Rebuilds the reply from response.* events: finished output items, then the usage."""

    def __init__(self) -> None:
        self._items: dict[int, dict[str, Any]] = {}
        self._text: dict[int, list[str]] = {}
        self._usage = Usage()
        self._status = ""
        self._done = False

    def feed(self, ev: Event) -> None:
        try:
            data = json.loads(ev.data)
        except ValueError:
            return
        t = data.get("type", ev.event)
        idx = int(data.get("output_index", 0))
        if t == "response.output_text.delta":
            self._text.setdefault(idx, []).append(str(data.get("delta", "")))
        elif t == "response.output_item.done" and isinstance(data.get("item"), dict):
            self._items[idx] = data["item"]
        elif t in ("response.completed", "response.incomplete", "response.failed"):
            resp = data.get("response") or {}
            self._usage = _usage(resp.get("usage"))
            self._status = str(resp.get("status") or t.split(".")[-1])
            self._done = t == "response.completed"

    def reply(self) -> Reply:
        items = dict(self._items)
        # A cut stream leaves text deltas with no finished item: keep what the client saw.
        for idx, chunks in self._text.items():
            items.setdefault(idx, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "".join(chunks)}]})
        folded = _fold([items[i] for i in sorted(items)])
        parts = tuple(p for m in folded for p in m.parts)
        return Reply(Message("assistant", parts), self._usage, self._status, self._done)


def render_text(text: str, model: str, stream: bool, reply_id: str) -> bytes:
    """A whole assistant reply the proxy answers itself, as the provider would have sent it."""
    created = int(time.time())
    item_id = "msg_" + reply_id.removeprefix("resp_")
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant",
            "content": [part]}
    usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}

    def response(status: str, output: list[Any]) -> dict[str, Any]:
        return {"id": reply_id, "object": "response", "created_at": created, "status": status,
                "model": model, "output": output, "error": None, "incomplete_details": None,
                "usage": usage if status == "completed" else None}

    if not stream:
        return json.dumps(response("completed", [item])).encode()
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response("in_progress", [])},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {**item, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
         "content_index": 0, "part": {**part, "text": ""}},
        {"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
         "content_index": 0, "delta": text},
        {"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
         "content_index": 0, "text": text},
        {"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
         "content_index": 0, "part": part},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response("completed", [item])},
    ]
    return b"".join(
        f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n".encode()
        for n, e in enumerate(events)
    )
