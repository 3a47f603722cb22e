"""OpenAI Responses: request bodies and replies (streamed or whole) to the neutral model.

Responses lists items, not messages: a reply is a run of reasoning, message and function_call
items. Consecutive items of one role are folded into one neutral message, so a reply captured
from the stream and the same reply re-sent as input items yield the same message.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Mapping, Sequence
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
from perpetuity_core.wire.protocols.chat import HINT_FIELDS, canonical_arguments
from perpetuity_core.wire.sse import Event

CODEX_TURN = "x-codex-turn-metadata"
TOOLS_ITEM = "additional_tools"  # an input item of tool definitions (Codex's Responses Lite)


def parse_request(body: dict[str, Any], known: ParsedRequest | None = None,
                  reused: int = 0) -> ParsedRequest:
    """`known`: an earlier request whose first `reused` input items are this body's, the same
    objects (wire.seen). Items fold into the message before them, so the messages that start
    before the last one starting there are taken as it read them, and the items from that one
    on are read; the system prompt is read again from the system items alone."""
    raw = body.get("input")
    if isinstance(raw, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": raw}]
    elif isinstance(raw, list):
        items = raw
    else:
        raise ProtocolError("Responses request without input")
    start = 0
    if known is not None and isinstance(raw, list) and 0 < reused <= len(items) and (
            upto := bisect.bisect_left(known.raw_index, reused) - 1) >= 0:
        # The message starting last before `reused` may go on past it: read again from it.
        start = known.raw_index[upto]
    raw_index, messages, standing = read_before(known, start)
    for index, m in _fold_starts(items, start, standing):
        if m.role != "system":
            raw_index.append(index)
            messages.append(m)
    said = [got for i in standing if (got := _item(items[i])) and got[0] == "system"]
    system = "\n".join(Message("system", tuple(parts)).text for _, parts in said)
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        system = instructions + ("\n" + system if system else "")
    hints = {f: body[f] for f in HINT_FIELDS if isinstance(body.get(f), str)}
    if isinstance(body.get("previous_response_id"), str):
        hints["previous_response_id"] = body["previous_response_id"]
    # Codex over a WebSocket says per message what kind of request it is; the handshake's
    # headers describe only the first.
    client_metadata = body.get("client_metadata")
    if isinstance(client_metadata, dict) and isinstance(client_metadata.get(CODEX_TURN), str):
        hints[CODEX_TURN] = client_metadata[CODEX_TURN]
    return ParsedRequest(
        protocol=Protocol.RESPONSES,
        model=str(body.get("model", "")),
        stream=bool(body.get("stream", False)),
        messages=messages,
        system=system,
        tool_names=[str(t.get("name", t.get("type", ""))) for t in body.get("tools") or [] if isinstance(t, dict)],
        hints=hints,
        generate=body.get("generate") is not False,
        # A compaction trigger is an item the neutral model cannot read: a standing one.
        compaction=any(items[i].get("type") == "compaction_trigger" for i in standing),
        raw_index=raw_index,
        raw_standing=standing,
    )


def replace_history(body: dict[str, Any], frame: list[Message], keep_from: int,
                    inserts: Mapping[int, list[Message]] | None = None,
                    standing: Sequence[int] | None = None) -> dict[str, Any]:
    """The body with input items before `keep_from` replaced by the frame, and each of
    `inserts` (raw index -> messages) put just before the item at that index; system and
    developer items stay first, untouched, and so does every item the neutral model cannot
    read (Codex's `additional_tools`, a `compaction` summary): memory cannot stand in for it.
    `standing`: those items' indexes, as parse_request found them (None: looked for)."""
    raw = body["input"]
    if isinstance(raw, str):
        raw, keep_from = [{"type": "message", "role": "user", "content": raw}], 0
    kept_system = [raw[i] for i in standing if i < keep_from] if standing is not None else [
        m for m in raw[:keep_from] if _standing(m)]
    kept = spliced(raw, keep_from, inserts, _render)
    return {**body, "input": kept_system + _render(frame) + kept}


def _render(messages: list[Message]) -> list[dict[str, Any]]:
    return [{"type": "message", "role": m.role, "content": [
        {"type": "input_text" if m.role == "user" else "output_text", "text": p.text}
        for p in m.parts]} for m in messages]


_CALLS = ("function_call", "custom_tool_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def check(body: dict[str, Any]) -> list[str]:
    """Why the Responses API would refuse this body ([] when it would not), as far as replacing
    history can break it: every call output has its call earlier, every call has its output.
    A string input or a `previous_response_id` chain holds no pairs to break."""
    items = body.get("input")
    if isinstance(items, str) or body.get("previous_response_id"):
        return []
    if not isinstance(items, list):
        return ["no input"]
    errors: list[str] = []
    called: set[str] = set()
    answered: set[str] = set()
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            continue
        if it.get("type") in _CALLS:
            called.add(str(it.get("call_id")))
        elif it.get("type") in _OUTPUTS:
            call = str(it.get("call_id"))
            if call not in called:
                errors.append(f"item {i}: output without its call earlier: {call}")
            answered.add(call)
    if unanswered := sorted(called - answered):
        errors.append(f"calls without output: {unanswered}")
    return errors


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
    if t in _CALLS:
        args = item.get("arguments", item.get("input", ""))
        return "assistant", [Part(Kind.TOOL_CALL, canonical_arguments(args), name=str(item.get("name", "")), call_id=str(item.get("call_id", "")))]
    if t in _OUTPUTS:
        out = item.get("output", "")
        if isinstance(out, list):
            out = "\n".join(str(o.get("text", "")) for o in out if isinstance(o, dict))
        return "tool", [Part(Kind.TOOL_RESULT, str(out), call_id=str(item.get("call_id", "")))]
    return None


def _standing(item: Any) -> bool:
    """The item stays in front when the history is replaced: a system or developer one, or
    one the neutral model cannot read."""
    return isinstance(item, dict) and (item.get("role") in ("system", "developer")
                                       or _item(item) is None)


def _fold_starts(items: list[Any], start: int = 0,
                 standing: list[int] | None = None) -> list[tuple[int, Message]]:
    """Messages folded from items (from `start`, where one begins), each with the index of the
    item it starts at; the standing items' indexes appended to `standing`."""
    out: list[tuple[int, Message]] = []
    for index in range(start, len(items)):
        item = items[index]
        if standing is not None and _standing(item):
            standing.append(index)
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
        data = ev.json()
        if data is None:
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


# --------------------------------------------------------------------------- the tool loop


def add_tools(body: dict[str, Any], tools: list[dict[str, Any]], last_round: bool) -> dict[str, Any]:
    """Our tools beside the harness's own, where it sends them: its `tools`, or an item of our
    own just past its `additional_tools` input item (tools_item_at); on the last round the
    model must answer."""
    items = body.get("input")
    if (at := tools_item_at(body, items)) is not None:
        assert isinstance(items, list)
        out = {**body, "input": [*items[:at], tools_item(tools), *items[at:]]}
    else:
        out = {**body, "tools": list(body.get("tools") or []) + _definitions(tools)}
    if last_round:
        out["tool_choice"] = "none"
    return out


def tools_item_at(body: dict[str, Any], items: Any) -> int | None:
    """Where in `items` our tools' item goes: just past the harness's first `additional_tools`
    item when the body has no `tools` (Codex's Responses Lite, as codex-rs/core/src/client.rs
    sends a `use_responses_lite` model's request: its tools as that input item, no `tools`
    field); None when ours go in `tools`."""
    if "tools" in body or not isinstance(items, list):
        return None
    return next((i + 1 for i, it in enumerate(items)
                 if isinstance(it, dict) and it.get("type") == TOOLS_ITEM), None)


def tools_item(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Our tools as an input item, in the shape of the harness's own (developer role)."""
    return {"type": TOOLS_ITEM, "role": "developer", "tools": _definitions(tools)}


def _definitions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["name"], "description": t["description"],
             "parameters": t["input_schema"]} for t in tools]


def continue_body(body: dict[str, Any], items: list[dict[str, Any]],
                  results: list[tuple[str, str]]) -> dict[str, Any]:
    """The next round's request: this round's output items and our tools' results."""
    raw = body.get("input")
    before = [{"type": "message", "role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
    return {**body, "input": before + items + [
        {"type": "function_call_output", "call_id": call_id, "output": text}
        for call_id, text in results]}


def ping() -> bytes:
    return b": ping\n\n"


def error_event(message: str) -> bytes:
    data = {"type": "error", "code": "server_error", "message": message, "param": None}
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


def _ours(item: dict[str, Any], ours: frozenset[str]) -> bool:
    return item.get("type") == "function_call" and item.get("name") in ours


class StreamMerger(StreamMergerBase):
    """Rounds of response.* events merged into the one stream the client sees.

    Our function calls are hidden; output indexes and sequence numbers run on consecutively;
    response.created and response.in_progress come once, and one response.completed closes the
    stream with every visible item and the usage summed over rounds.
    """

    def __init__(self, ours: frozenset[str]) -> None:
        self.sequence = 0
        self.opened: set[str] = set()
        self.visible: list[dict[str, Any]] = []
        self.usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        self.final: dict[str, Any] = {}
        super().__init__(ours)

    def _new_round(self) -> None:
        super()._new_round()
        self.items: dict[int, dict[str, Any]] = {}

    def _emit(self, name: str, data: dict[str, Any]) -> bytes:
        data = {**data, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    def feed(self, name: str, data: dict[str, Any]) -> bytes:
        t = str(data.get("type", name))
        if t in ("response.created", "response.in_progress", "response.queued"):
            if t in self.opened:  # the first round's lifecycle events stand for all rounds
                return b""
            self.opened.add(t)
            return self._emit(t, data)
        if t in ("response.completed", "response.incomplete", "response.failed"):
            resp = data.get("response") or {}
            self.final = data
            for key in self.usage:
                self.usage[key] += int((resp.get("usage") or {}).get(key) or 0)
            return b""
        if "output_index" not in data:
            return self._emit(t, data)  # errors and anything newer pass through
        index = int(data["output_index"])
        item = data.get("item")
        if isinstance(item, dict):
            self.items[index] = item
            if _ours(item, self.ours):
                self.hidden.add(index)
            if t == "response.output_item.done" and index not in self.hidden:
                self.visible.append(item)
        if index in self.hidden:
            return b""
        return self._emit(t, {**data, "output_index": self._renumbered(index)})

    def our_calls(self) -> list[tuple[str, str, Any]]:
        return [(str(self.items[i].get("call_id", "")), str(self.items[i].get("name", "")),
                 self.items[i].get("arguments", "")) for i in sorted(self.hidden)]

    def others_called(self) -> bool:
        return any(item.get("type") in _CALLS and i not in self.hidden
                   for i, item in self.items.items())

    def assistant_blocks(self) -> list[dict[str, Any]]:
        return [self.items[i] for i in sorted(self.items)]

    def finish(self) -> bytes:
        final = dict(self.final or {"type": "response.completed", "response": {}})
        resp = {**(final.get("response") or {}), "output": self.visible, "usage": self.usage}
        return self._emit(str(final.get("type", "response.completed")), {**final, "response": resp})


class BodyMerger(BodyMergerBase):
    """Rounds of whole response bodies merged into the one the client sees."""

    USAGE = ("input_tokens", "output_tokens", "total_tokens")

    def __init__(self, ours: frozenset[str]) -> None:
        super().__init__(ours)
        self.round: list[dict[str, Any]] = []

    def _take(self, body: dict[str, Any]) -> None:
        self.round = [i for i in body.get("output") or [] if isinstance(i, dict)]
        self.visible += [i for i in self.round if not _ours(i, self.ours)]

    def our_calls(self) -> list[tuple[str, str, Any]]:
        return [(str(i.get("call_id", "")), str(i.get("name", "")), i.get("arguments", ""))
                for i in self.round if _ours(i, self.ours)]

    def others_called(self) -> bool:
        return any(i.get("type") in _CALLS and not _ours(i, self.ours)
                   for i in self.round)

    def assistant_blocks(self) -> list[dict[str, Any]]:
        return self.round

    def next_round(self) -> None:
        self.round = []

    def finish(self) -> bytes:
        out = {**(self.first or {}), "status": self.last.get("status"), "output": self.visible,
               "usage": self.usage}
        return json.dumps(out).encode()
