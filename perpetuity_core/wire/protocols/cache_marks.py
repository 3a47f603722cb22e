"""Anthropic's cache marks (`cache_control`): how many a request may carry, how long each
lasts, and the order the API requires of their lifetimes (the longer first, in the prompt's
order: tools, system, messages)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_CACHE_MARKERS = 4  # the API refuses a request with more cache_control breakpoints
HOUR_MARK = {"type": "ephemeral", "ttl": "1h"}


def markers(value: Any) -> list[Any]:
    """The cache_control markers anywhere in the value: tools, system, messages, nested blocks."""
    # A walk with a list of what is left, not a call per value: it runs over the whole request
    # (a Claude Code one has 600 containers, most in its tools' schemas) twice a request.
    found = []
    left = [value]
    while left:
        v = left.pop()
        if isinstance(v, dict):
            if (mark := v.get("cache_control")) is not None:
                found.append(mark)
            left += [x for x in v.values() if isinstance(x, (dict, list))]
        elif isinstance(v, list):
            left += [x for x in v if isinstance(x, (dict, list))]
    return found


class LastMade[V]:
    """What `make` made of the last objects it was given, while those given are the same ones
    (held, so no other object takes their ids). A harness's system prompt and tools are the
    same objects from call to call (wire.seen hands them back), so what is made of them alone
    is made once, not once a call. One entry: bounded, and keyed by the objects themselves,
    never by their value, so nothing made of one request's objects answers another's. Two
    threads making at once each get their own, equal; the one kept is the last made."""

    __slots__ = ("_kept", "_make")

    def __init__(self, make: Callable[..., V]) -> None:
        self._make = make
        self._kept: tuple[tuple[Any, ...], V] | None = None

    def __call__(self, *values: Any) -> V:
        kept = self._kept
        if kept is not None and len(kept[0]) == len(values) and all(
                a is b for a, b in zip(kept[0], values, strict=True)):
            return kept[1]
        made = self._make(*values)
        self._kept = (values, made)
        return made


# (its arguments: the members' keys and values, in turn)
_MARKED_OUTSIDE = LastMade(lambda *members: markers(dict(zip(members[::2], members[1::2],
                                                             strict=True))))


def markers_outside(body: dict[str, Any]) -> list[Any]:
    """`markers` of the body without its messages (its tools, system, ...), walked once while
    they are the same objects (Claude Code's tools are ~600 containers, walked twice a call)."""
    return _MARKED_OUTSIDE(*(x for k, v in body.items() if k != "messages" for x in (k, v)))


def hour_after_minutes(body: dict[str, Any]) -> bool:
    """Does an hour's cache mark follow a five minutes' one in the prompt's order (tools,
    system, messages)? The API requires the longer lifetimes first."""
    system = body.get("system")
    blocks = [*(body.get("tools") or []), *(system if isinstance(system, list) else [])]
    for m in body.get("messages") or []:
        blocks += content_blocks(m) if isinstance(m, dict) else []
    short = False
    for b in blocks:
        mark = b.get("cache_control") if isinstance(b, dict) else None
        if isinstance(mark, dict):
            if mark.get("ttl") == "1h" and short:
                return True
            short = short or mark.get("ttl") != "1h"
    return False


def content_blocks(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's content blocks (none where its content is a string)."""
    content = m.get("content")
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def lasting(body: dict[str, Any]) -> dict[str, Any]:
    """The body with the harness's cache marks on its tools and system prompt kept an hour
    (Anthropic's 1-hour TTL: written at 2.0 the input price, read at 0.1). With the history
    framed, what every call of a conversation shares is its prefix up to the system prompt
    (Claude Code's 18k tokens, our tools with them), and a pause of five minutes to an hour
    wrote it all again at 1.25: kept an hour, it is read. A pause of over an hour, or a new
    conversation with no other in that hour, pays 0.75 of it more (the six shared Claude Code
    sessions replayed together, one cache: 0.687 of direct -> 0.650; each alone, 0.693 ->
    0.679, the 34-call 83a70023 1.08 -> 1.18). Only marks already there, so the request's
    marks are as many; they come before every message's, so no hour's mark follows a five
    minutes' (which the API refuses: `check`). The system-role messages right after an
    unmarked first message (the harness's standing context, after a frame's header) last an
    hour too: they are as stable as the system prompt, and a frame rebuilt after a pause then
    reads them."""
    out: dict[str, Any] = {**body, **{k: _LASTING[k](body[k]) for k in ("tools", "system")
                                      if k in body}}
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > 1 and _standing(messages[1]) \
            and not markers(messages[0]):
        n = next((i for i, m in enumerate(messages) if i and not _standing(m)), len(messages))
        out["messages"] = [messages[0], *({**m, "content": _marked(m["content"])}
                                          for m in messages[1:n]), *messages[n:]]
    return out


def _standing(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") == "system"


def _marked(blocks: Any) -> Any:
    if not isinstance(blocks, list):
        return blocks
    return [{**b, "cache_control": HOUR_MARK} if isinstance(b, dict) and isinstance(
        b.get("cache_control"), dict) else b for b in blocks]


# The blocks marked an hour, made once while the harness's tools and system are the same
# objects: the same copies every call, so wire.written writes them once (Claude Code's marked
# system block is most of its 20 KB prompt).
_LASTING = {"tools": LastMade(_marked), "system": LastMade(_marked)}
