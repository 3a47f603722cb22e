"""A body's text made storable: a lone surrogate (half an emoji, as Node's JSON.stringify writes
a string cut mid-character: `"\\ud83d"`) becomes U+FFFD in what is read, stored and framed.

`json.loads` reads the escape into a str that no UTF-8 encoder takes ("surrogates not
allowed"), so the store could not keep the turn, nor any later turn of the conversation,
whose history carries it. Only what is read is mended: the body forwarded keeps the client's
escape (`dumps` writes it back as it came).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from perpetuity_core.wire.conversation import Message, ParsedRequest, Part

_LONE = re.compile("[\ud800-\udfff]")  # json.loads joins a pair into one character: any left is lone


def mended(value: Any) -> Any:
    """`value` with every lone surrogate in its strings (keys too) replaced by U+FFFD; the same
    object where there was none, so a clean part is never copied."""
    if isinstance(value, str):
        return _LONE.sub("\ufffd", value) if _LONE.search(value) else value
    if isinstance(value, list):
        items = [mended(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if isinstance(value, dict):
        pairs = [(mended(k), mended(v)) for k, v in value.items()]
        same = all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, value.items(), strict=True))
        return value if same else dict(pairs)
    return value


def mended_request(parsed: ParsedRequest, known: ParsedRequest | None) -> ParsedRequest:
    """`parsed` mended: its messages past those it shares with `known` (the earlier reading it
    took them from, mended then), its system prompt and the names and hints it carries."""
    messages, shared = parsed.messages, _shared(parsed.messages, known.messages if known else [])
    fresh = [_mended_message(m) for m in messages[shared:]]
    return replace(parsed, messages=messages[:shared] + fresh, system=mended(parsed.system),
                   model=mended(parsed.model), tool_names=mended(parsed.tool_names),
                   hints=mended(parsed.hints))


def _mended_message(m: Message) -> Message:
    parts = tuple(Part(p.kind, mended(p.text), mended(p.name), mended(p.call_id))
                  for p in m.parts)
    same = all(a.text is b.text and a.name is b.name and a.call_id is b.call_id
               for a, b in zip(parts, m.parts, strict=True))
    return m if same else Message(m.role, parts)


def _shared(messages: list[Message], known: list[Message]) -> int:
    """How many first messages are `known`'s own objects (an adapter takes a prefix of them),
    found by bisection: the prefix's length, not a walk of the history."""
    lo, hi = 0, min(len(messages), len(known))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if messages[mid - 1] is known[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def dumps(body: dict[str, Any]) -> bytes:
    """`json.dumps(body, ensure_ascii=False).encode()`, but a body holding a lone surrogate is
    written with ASCII escapes: the same text as the client sent, escape for escape."""
    try:
        return json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body).encode()
