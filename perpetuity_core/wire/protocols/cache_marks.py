"""Anthropic's cache marks (`cache_control`): how many a request may carry, how long each
lasts, and the order the API requires of their lifetimes (the longer first, in the prompt's
order: tools, system, messages)."""

from __future__ import annotations

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
    minutes' (which the API refuses: `check`)."""
    def marked(blocks: Any) -> Any:
        if not isinstance(blocks, list):
            return blocks
        return [{**b, "cache_control": HOUR_MARK} if isinstance(b, dict) and isinstance(
            b.get("cache_control"), dict) else b for b in blocks]
    return {**body, **{k: marked(body[k]) for k in ("tools", "system") if k in body}}
