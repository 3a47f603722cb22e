"""Gemini's parts, read as the neutral model's: the pieces both a request's contents and a
reply's candidates are made of, shared by the adapter (gemini.py) and nothing else.

A call carries no reliable id (see gemini.py), so `call_id` names it by its name, its
arguments and how many equal calls came before it in its turn.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from perpetuity_core.wire.conversation import Kind, Message, Part, text_part


def call_id(name: str, args: Any, nth: int = 0) -> str:
    """A call's identity: its name, its arguments and how many equal calls came before it in the
    same turn (an id the model's reply and every later request agree on)."""
    h = hashlib.blake2b(f"{name}\x00{args_json(args)}\x00{nth}".encode(), digest_size=8)
    return f"{name}-{h.hexdigest()}"


def args_json(args: Any) -> str:
    return json.dumps(args if args is not None else {}, ensure_ascii=False, sort_keys=True)


def listed(value: Any) -> list[Any]:
    """A field that should be a list, as one (anything else counts as empty)."""
    return value if isinstance(value, list) else []


def read_parts(raw: list[Any], before: Message | None) -> tuple[Part, ...]:
    """`before`: the message a function response answers (its calls pair the results)."""
    out: list[Part] = []
    seen: dict[str, int] = {}  # equal calls so far in this turn
    open_calls = [p for p in before.parts if p.kind == Kind.TOOL_CALL] if before else []
    for p in raw:
        if not isinstance(p, dict):
            continue
        if isinstance(p.get("text"), str):
            out.append(Part(Kind.THINKING, p["text"]) if p.get("thought") else text_part(p["text"]))
        elif isinstance(fc := p.get("functionCall"), dict):
            name, args = str(fc.get("name", "")), fc.get("args")
            key = f"{name}\x00{args_json(args)}"
            nth = seen[key] = seen.get(key, -1) + 1
            out.append(Part(Kind.TOOL_CALL, args_json(args), name=name, call_id=call_id(name, args, nth)))
        elif isinstance(fr := p.get("functionResponse"), dict):
            name = str(fr.get("name", ""))
            match = next((c for c in open_calls if c.name == name), None)
            if match is not None:
                open_calls.remove(match)
            out.append(Part(Kind.TOOL_RESULT, _result_text(fr.get("response")), name=name,
                            call_id=match.call_id if match else call_id(name, None)))
        elif isinstance(media := p.get("inlineData") or p.get("fileData"), dict):
            out.append(Part(Kind.MEDIA, f"[{media.get('mimeType', 'media')}]"))
    return tuple(out)


def _result_text(response: Any) -> str:
    """gemini-cli answers `{output: ...}` or `{error: ...}`; anything else is kept as JSON."""
    if isinstance(response, dict) and len(response) == 1:
        (value,) = response.values()
        if isinstance(value, str):
            return value
    return json.dumps(response, ensure_ascii=False, sort_keys=True)


def unwrapped(data: dict[str, Any]) -> dict[str, Any]:
    """A reply or chunk, out of Code Assist's `{response}` wrapper when it has one."""
    inner = data.get("response")
    return inner if isinstance(inner, dict) and "candidates" not in data else data


def first_candidate(data: dict[str, Any]) -> dict[str, Any]:
    for c in listed(data.get("candidates")):
        if isinstance(c, dict) and c.get("index") in (None, 0):
            return c
    return {}


def content_parts(candidate: dict[str, Any]) -> list[dict[str, Any]]:
    content = candidate.get("content")
    raw = content.get("parts") if isinstance(content, dict) else None
    return [p for p in listed(raw) if isinstance(p, dict)]


def joined(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A streamed turn's parts as one turn: consecutive text deltas of one kind (thought or
    not) joined, calls whole (Gemini streams a call in one piece)."""
    out: list[dict[str, Any]] = []
    for p in raw:
        last = out[-1] if out else None
        if (last is not None and isinstance(p.get("text"), str) and isinstance(last.get("text"), str)
                and bool(p.get("thought")) == bool(last.get("thought"))):
            out[-1] = {**last, **p, "text": last["text"] + p["text"]}
        else:
            out.append(p)
    return out


def sse_chunk(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\r\n\r\n".encode()


def calls_in(raw: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, name, arguments) of each call among `parts`, numbered as `read_parts` numbers them."""
    return [(p.call_id, p.name, json.loads(p.text)) for p in read_parts(raw, None)
            if p.kind == Kind.TOOL_CALL]
