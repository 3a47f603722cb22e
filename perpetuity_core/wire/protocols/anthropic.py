"""Anthropic Messages: request bodies and replies (streamed or whole) to the neutral model."""

from __future__ import annotations

import json
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
    as_context,
    read_before,
    text_part,
)
from perpetuity_core.wire.protocols.anthropic_check import check as check
from perpetuity_core.wire.protocols.base import BodyMergerBase, StreamMergerBase, spliced
from perpetuity_core.wire.protocols.cache_marks import (
    HOUR_MARK,
    MAX_CACHE_MARKERS,
    LastMade,
    content_blocks,
    lasting,
    markers,
    markers_outside,
)
from perpetuity_core.wire.sse import Event


def parse_request(body: dict[str, Any], known: ParsedRequest | None = None,
                  reused: int = 0) -> ParsedRequest:
    """`known`: an earlier request whose first `reused` raw messages are this body's, the same
    objects (wire.seen). Each message reads alone, so those are taken as it read them and only
    the rest is read: a late call of a long session reads what is new, not its history."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ProtocolError("Anthropic request without a messages list")
    start = reused if known is not None and 0 < reused <= len(messages) else 0
    raw_index, parsed, standing = read_before(known, start)
    fresh = [i for i in range(start, len(messages)) if isinstance(messages[i], dict)]
    raw_index += fresh
    parsed += [message_from(messages[i]) for i in fresh]
    standing += [i for i in fresh if messages[i].get("role") == "system"]
    hints: dict[str, str] = {}
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        hints["metadata.user_id"] = meta["user_id"]
    output_config = body.get("output_config")
    system = _text_of(body.get("system"))
    return ParsedRequest(
        protocol=Protocol.ANTHROPIC,
        model=str(body.get("model", "")),
        stream=bool(body.get("stream", False)),
        messages=parsed,
        system=system,
        tool_names=[t.get("name", "") for t in body.get("tools") or [] if isinstance(t, dict)],
        hints=hints,
        structured_output=isinstance(output_config, dict) and "format" in output_config,
        raw_index=raw_index,
        raw_standing=standing,
        fixed_chars=len(system) + _tools_chars(body.get("tools")),
    )


# The harness's tools' length as JSON, measured once while they are the same objects
# (wire.seen): json.dumps of Claude Code's 64 KB of schemas on every call.
_tools_chars = LastMade(lambda tools: len(json.dumps(tools or [], ensure_ascii=False)))


def replace_history(body: dict[str, Any], frame: list[Message], keep_from: int,
                    inserts: Mapping[int, list[Message]] | None = None,
                    standing: Sequence[int] | None = None) -> dict[str, Any]:
    """The body with messages before raw index `keep_from` replaced by the frame, and each of
    `inserts` (raw index -> messages) put just before the message at that index.

    System-role messages among the replaced ones stay, before the frame (`standing`: their raw
    indexes, as parse_request found them; None: looked for); the rest of the body is
    untouched. A cache marker goes, while the request has one to spare (those in the stripped
    history go with it), on the last block that stays the same from call to call after the
    harness's own system prompt: the standing messages' end where there are any, else the
    frame's. They go right after the frame's first message (its header, when the frame opens
    with it alone): a new frame is then written after a cached prefix that holds them (Claude
    Code's 1.5k-token agent list, written again with every new frame when it came after it).
    """
    raw = body["messages"]
    kept_system = [raw[i] for i in standing if i < keep_from] if standing is not None else [
        m for m in raw[:keep_from] if isinstance(m, dict) and m.get("role") == "system"]
    kept = spliced(raw, keep_from, inserts, _render)
    rendered = _render(frame)
    after = markers(kept_system) + markers(kept)
    spare = MAX_CACHE_MARKERS - len(after) - len(markers_outside(body))
    # After the frame's first message, as Claude Code puts them after its first prompt (the
    # API wants a user message first): where the frame opens with its header alone, they follow
    # a message that is the same in every frame.
    opens = 1 if kept_system and rendered and len(rendered) > 1 else len(rendered)
    front = [*rendered[:opens], *kept_system, *rendered[opens:]]
    if rendered and spare > 0:
        # The API refuses an hour's mark after a five minutes' one: where the harness keeps
        # what follows the frame an hour (Claude Code for some accounts), this one lasts too.
        hour = any(isinstance(m, dict) and m.get("ttl") == "1h" for m in after)
        last = opens + len(kept_system) - 1
        at = last if opens == 1 and _markable(front[last]) else -1
        front[at] = _marked_last(front[at], dict(HOUR_MARK) if hour else {"type": "ephemeral"})
    return {**body, "messages": front + kept}


def _markable(m: dict[str, Any]) -> bool:
    content = m.get("content")
    return isinstance(content, str) and bool(content) or (
        isinstance(content, list) and bool(content) and isinstance(content[-1], dict))


def _marked_last(m: dict[str, Any], mark: dict[str, Any]) -> dict[str, Any]:
    """A copy of `m` with `mark` on its last block (the message itself may be shared: the
    frame's rendered ones are, `_rendered`)."""
    content = m["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    return {**m, "content": [*blocks[:-1], {**blocks[-1], "cache_control": mark}]}


def stub_results(body: dict[str, Any], stubs: Mapping[str, str], keep_from: int) -> dict[str, Any]:
    """The body with the tool results of these calls (by id) from raw index `keep_from` on sent
    as the stubs' text; the messages holding none are the same objects."""
    raw = body["messages"]
    return {**body, "messages": raw[:keep_from] + [
        {**m, "content": [{**b, "content": stubs[str(b.get("tool_use_id"))]}
                          if b.get("type") == "tool_result" and b.get("tool_use_id") in stubs
                          else b for b in content_blocks(m)]}
        if any(b.get("type") == "tool_result" and b.get("tool_use_id") in stubs
               for b in content_blocks(m)) else m for m in raw[keep_from:]]}


def _render(messages: list[Message]) -> list[dict[str, Any]]:
    """One text block a message: Anthropic finds a cached prefix only within 20 blocks before
    a marker, so what we insert must not push the harness's last read point out of reach."""
    return [_rendered(m) for m in messages]


def _rendered(m: Message) -> dict[str, Any]:
    """One message rendered, the same object while a plan keeps its frame: each tool round of
    a task sends the frame again, and what is the same object is written once (wire.written).
    Kept on the message itself (`Message.wire_form`), so it lasts exactly as long as the
    message. Never changed after (a mark goes on a copy)."""
    return m.wire_form(_one_block)


def _one_block(m: Message) -> dict[str, Any]:
    return {"role": m.role, "content": [{"type": "text", "text": "\n\n".join(
        p.text for p in m.parts)}]}


def message_from(m: dict[str, Any]) -> Message:
    role = str(m.get("role", "user"))
    content = m.get("content")
    if isinstance(content, str):
        parts: tuple[Part, ...] = (text_part(content),)
    else:
        parts = tuple(p for b in content or [] if isinstance(b, dict) and (p := _block(b)))
    # A system message among the turns is the harness's (Claude Code sends its list of agent
    # types, 6,600 characters, in every session): context for this request, not memory.
    return Message(role, as_context(parts) if role == "system" else parts)


def _block(b: dict[str, Any]) -> Part | None:
    t = b.get("type")
    if t == "text":
        return text_part(str(b.get("text", "")))
    if t == "thinking":
        return Part(Kind.THINKING, str(b.get("thinking", "")))
    if t == "redacted_thinking":
        return Part(Kind.THINKING, "")
    if t in ("tool_use", "server_tool_use"):
        return Part(
            Kind.TOOL_CALL, _dump(b.get("input", {})), name=str(b.get("name", "")),
            call_id=str(b.get("id", "")),
        )
    if t == "tool_result":
        return Part(Kind.TOOL_RESULT, _text_of(b.get("content")), call_id=str(b.get("tool_use_id", "")))
    if t in ("image", "document"):
        source = b.get("source") or {}
        return Part(Kind.MEDIA, f"[{t} {source.get('media_type', source.get('type', ''))}]")
    return None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _usage(u: dict[str, Any] | None) -> Usage:
    u = u or {}
    return Usage(
        input_tokens=int(u.get("input_tokens") or 0),
        output_tokens=int(u.get("output_tokens") or 0),
        cache_read_tokens=int(u.get("cache_read_input_tokens") or 0),
        cache_write_tokens=int(u.get("cache_creation_input_tokens") or 0),
    )


def _grow(block: dict[str, Any], delta: dict[str, Any]) -> None:
    """Add one content_block_delta to the block being rebuilt (tool input JSON in `_json`)."""
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + str(delta.get("text", ""))
    elif kind == "input_json_delta":
        block["_json"] += str(delta.get("partial_json", ""))
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
    elif kind == "signature_delta":
        block["signature"] = block.get("signature", "") + str(delta.get("signature", ""))
    elif kind == "citations_delta":
        block.setdefault("citations", []).append(delta.get("citation"))


def reply_from_body(body: dict[str, Any]) -> Reply:
    parts = tuple(p for b in body.get("content") or [] if isinstance(b, dict) and (p := _block(b)))
    return Reply(Message("assistant", parts), _usage(body.get("usage")), str(body.get("stop_reason") or ""))


class ReplyAssembler:
    """Rebuilds the assistant message from a Messages event stream, event by event."""

    def __init__(self) -> None:
        self._blocks: dict[int, dict[str, Any]] = {}
        self._usage = Usage()
        self._stop = ""
        self._done = False

    def feed(self, ev: Event) -> None:
        data = ev.json()
        if data is None:
            return
        t = data.get("type")
        if t == "message_start":
            self._usage = _usage((data.get("message") or {}).get("usage"))
        elif t == "content_block_start":
            block = dict(data.get("content_block") or {})
            block["_json"] = ""
            self._blocks[int(data.get("index", len(self._blocks)))] = block
        elif t == "content_block_delta":
            block = self._blocks.setdefault(int(data.get("index", 0)), {"type": "text", "_json": ""})
            _grow(block, data.get("delta") or {})
        elif t == "message_delta":
            self._stop = str((data.get("delta") or {}).get("stop_reason") or self._stop)
            u = data.get("usage") or {}
            # message_delta carries cumulative output tokens and, on newer APIs, the input figures.
            final = _usage(u)
            self._usage.output_tokens = final.output_tokens or self._usage.output_tokens
            self._usage.input_tokens = final.input_tokens or self._usage.input_tokens
        elif t == "message_stop":
            self._done = True

    def reply(self) -> Reply:
        parts: list[Part] = []
        for _, block in sorted(self._blocks.items()):
            if block.get("type") in ("tool_use", "server_tool_use") and block["_json"]:
                try:
                    block["input"] = json.loads(block["_json"])
                except ValueError:
                    block["input"] = block["_json"]
            if p := _block(block):
                parts.append(p)
        return Reply(Message("assistant", tuple(parts)), self._usage, self._stop, self._done)


def render_text(text: str, model: str, stream: bool, reply_id: str) -> bytes:
    """A whole assistant reply the proxy answers itself, as the provider would have sent it."""
    message: dict[str, Any] = {"id": reply_id, "type": "message", "role": "assistant", "model": model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 0, "output_tokens": 0}}
    if not stream:
        message.update(content=[{"type": "text", "text": text}], stop_reason="end_turn")
        return json.dumps(message).encode()
    events = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 0}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


# --------------------------------------------------------------------------- the tool loop


_DEFINITION = {"name", "description", "input_schema"}


def add_tools(body: dict[str, Any], tools: list[dict[str, Any]], last_round: bool) -> dict[str, Any]:
    """Our tools beside the harness's own, the harness's marks on its tools and system prompt
    kept an hour (`lasting`); on the last round the model must answer."""
    # A definition of just these members goes as it is, the same object every call (written
    # once by wire.written); any other is copied down to them.
    defs = [t if t.keys() == _DEFINITION else
            {"name": t["name"], "description": t["description"], "input_schema": t["input_schema"]}
            for t in tools]
    out = lasting(body)
    out["tools"] = list(out.get("tools") or []) + defs
    if last_round:
        out["tool_choice"] = {"type": "none"}
    return out


def continue_body(body: dict[str, Any], assistant: list[dict[str, Any]],
                  results: list[tuple[str, str]]) -> dict[str, Any]:
    """The next round's request: this round's assistant blocks and our tools' results."""
    user = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                         "content": text} for call_id, text in results]}
    return {**body, "messages": list(body["messages"]) + [
        {"role": "assistant", "content": assistant}, user]}


def ping() -> bytes:
    return b'event: ping\ndata: {"type": "ping"}\n\n'


def error_event(message: str) -> bytes:
    data = {"type": "error", "error": {"type": "api_error", "message": message}}
    return f"event: error\ndata: {json.dumps(data)}\n\n".encode()


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


class StreamMerger(StreamMergerBase):
    """Rounds of a Messages event stream merged into the one reply the client sees.

    Our tools' calls are hidden; every other block is forwarded as it streams, its index
    renumbered consecutively across rounds (the SDK indexes blocks by it). One message_start
    (the first round's) and one message_delta + message_stop (the last round's, with usage
    summed over rounds) reach the client.
    """

    def __init__(self, ours: frozenset[str]) -> None:
        self.started = False
        self.usage = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0}
        self._round_output = 0
        super().__init__(ours)

    def _new_round(self) -> None:
        super()._new_round()
        self.blocks: dict[int, dict[str, Any]] = {}  # upstream index -> block being built
        self.delta: dict[str, Any] | None = None
        self.done = False

    def feed(self, name: str, data: dict[str, Any]) -> bytes:
        """What to send the client for one upstream event ("" to hold it back)."""
        t = data.get("type", name)
        if t == "message_start":
            self._add_usage((data.get("message") or {}).get("usage") or {})
            if self.started:
                return b""
            self.started = True
            return _event(name, data)
        if t == "content_block_start":
            index, block = int(data.get("index", 0)), dict(data.get("content_block") or {})
            self.blocks[index] = {**block, "_json": ""}
            if block.get("type") == "tool_use" and block.get("name") in self.ours:
                self.hidden.add(index)
                return b""
            return _event(name, {**data, "index": self._renumbered(index)})
        if t in ("content_block_delta", "content_block_stop"):
            index = int(data.get("index", 0))
            _grow(self.blocks.setdefault(index, {"type": "text", "_json": ""}),
                  data.get("delta") or {})
            if index in self.hidden:
                return b""
            return _event(name, {**data, "index": self.remap.get(index, index)})
        if t == "message_delta":
            self.delta = data
            self._add_usage(data.get("usage") or {}, final=True)
            return b""
        if t == "message_stop":
            self.done = True
            return b""
        return _event(name, data)  # ping and anything newer pass through

    def _add_usage(self, usage: dict[str, Any], final: bool = False) -> None:
        """Input figures come once per round, from message_start; output tokens are cumulative
        within a round, so the round's last figure counts."""
        if "output_tokens" in usage:
            self._round_output = int(usage.get("output_tokens") or 0)
        if not final:
            for key in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"):
                self.usage[key] += int(usage.get(key) or 0)

    def our_calls(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(id, name, arguments) of the calls to our tools in this round."""
        out = []
        for index in sorted(self.hidden):
            b = self.blocks[index]
            try:
                args = json.loads(b["_json"]) if b["_json"] else b.get("input") or {}
            except ValueError:
                args = {}
            out.append((str(b.get("id", "")), str(b.get("name", "")), args))
        return out

    def others_called(self) -> bool:
        return any(b.get("type") == "tool_use" and i not in self.hidden
                   for i, b in self.blocks.items())

    def assistant_blocks(self) -> list[dict[str, Any]]:
        """This round's assistant content as the next request must carry it (thinking with its
        signature, our calls with their input)."""
        out = []
        for _, b in sorted(self.blocks.items()):
            block = {k: v for k, v in b.items() if k != "_json"}
            if block.get("type") == "tool_use":
                try:
                    block["input"] = json.loads(b["_json"]) if b["_json"] else b.get("input", {})
                except ValueError:
                    block["input"] = {}
            out.append(block)
        return out

    def next_round(self) -> None:
        self.usage["output_tokens"] += self._round_output
        self._round_output = 0
        super().next_round()

    def finish(self) -> bytes:
        """The closing events: the last round's message_delta with usage summed, message_stop."""
        delta = dict(self.delta or {"type": "message_delta",
                                    "delta": {"stop_reason": "end_turn", "stop_sequence": None}})
        usage = {**self.usage, "output_tokens": self.usage["output_tokens"] + self._round_output}
        delta["usage"] = {**(delta.get("usage") or {}), **usage}
        return _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"})


class BodyMerger(BodyMergerBase):
    """Rounds of whole (not streamed) Messages replies merged into the one the client sees."""

    USAGE = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
             "cache_read_input_tokens")

    def __init__(self, ours: frozenset[str]) -> None:
        super().__init__(ours)
        self.round: list[dict[str, Any]] = []

    def _take(self, body: dict[str, Any]) -> None:
        self.round = [b for b in body.get("content") or [] if isinstance(b, dict)]
        self.visible += [b for b in self.round if not self._ours(b)]

    def _ours(self, block: dict[str, Any]) -> bool:
        return block.get("type") == "tool_use" and block.get("name") in self.ours

    def our_calls(self) -> list[tuple[str, str, dict[str, Any]]]:
        return [(str(b.get("id", "")), str(b.get("name", "")), b.get("input") or {})
                for b in self.round if self._ours(b)]

    def others_called(self) -> bool:
        return any(b.get("type") == "tool_use" and not self._ours(b) for b in self.round)

    def assistant_blocks(self) -> list[dict[str, Any]]:
        return self.round

    def next_round(self) -> None:
        self.round = []

    def finish(self) -> bytes:
        out = {**(self.first or {}), "content": self.visible,
               "stop_reason": self.last.get("stop_reason"),
               "stop_sequence": self.last.get("stop_sequence"),
               "usage": {**(self.last.get("usage") or {}), **self.usage}}
        return json.dumps(out).encode()
