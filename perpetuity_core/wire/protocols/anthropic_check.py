"""What the Messages API would refuse in a body the proxy rebuilt (`check`): the adapter's
check (wire.protocols.anthropic), in its own module for size; the replay counts it too."""

from __future__ import annotations

from typing import Any

from perpetuity_core.wire.protocols.cache_marks import (
    MAX_CACHE_MARKERS,
    content_blocks,
    hour_after_minutes,
    markers,
    markers_outside,
)


def check(body: dict[str, Any]) -> list[str]:
    """Why the Messages API would refuse this body ([] when it would not), as far as replacing
    history can break it: role order, tool pairing, thinking signatures and cache markers.

    System-role messages (Claude Code puts one inside `messages`) are read past. A thinking
    block's position is kept by construction: kept messages are the harness's own, verbatim.
    """
    raw = body.get("messages")
    if not isinstance(raw, list):
        return ["no messages list"]
    msgs: list[dict[str, Any]] = []
    plain: list[bool] = []
    walked = []  # what may hold a mark: all but plain text
    for m in raw:
        read_past = _plain(m)
        if not read_past:
            walked.append(m)
        if isinstance(m, dict) and m.get("role") != "system":
            msgs.append(m)
            plain.append(read_past)
    errors: list[str] = []
    if not msgs or msgs[0].get("role") != "user":
        errors.append("the first message is not the user's")
    for i, m in enumerate(msgs):
        if i and m.get("role") == msgs[i - 1].get("role"):
            errors.append(f"message {i}: two {m.get('role')} messages in a row")
        if plain[i]:
            continue  # no call, no result, no thinking: nothing else to check
        blocks = content_blocks(m)
        results = [str(b.get("tool_use_id")) for b in blocks if b.get("type") == "tool_result"]
        if results:
            called = _calls(msgs[i - 1]) if i and msgs[i - 1].get("role") == "assistant" else set()
            if missing := [r for r in results if r not in called]:
                errors.append(f"message {i}: tool_result without its tool_use just before: {missing}")
            first_other = next((k for k, b in enumerate(blocks) if b.get("type") != "tool_result"),
                               len(blocks))
            if any(b.get("type") == "tool_result" for b in blocks[first_other:]):
                errors.append(f"message {i}: tool_result after other content")
        if (calls := _calls(m)) and i + 1 < len(msgs):
            answered = {str(b.get("tool_use_id")) for b in content_blocks(msgs[i + 1])
                        if b.get("type") == "tool_result"}
            if unanswered := sorted(calls - answered):
                errors.append(f"message {i}: tool_use not answered in the next message: {unanswered}")
        for b in blocks:
            if b.get("type") == "thinking" and not b.get("signature"):
                errors.append(f"message {i}: thinking block without its signature")
            elif b.get("type") == "redacted_thinking" and not b.get("data"):
                errors.append(f"message {i}: redacted_thinking block without its data")
    marks = markers_outside(body) + markers(walked)
    if len(marks) > MAX_CACHE_MARKERS:
        errors.append(f"{len(marks)} cache_control markers (at most {MAX_CACHE_MARKERS})")
    # The order of lifetimes walks every block: only where an hour's mark is there to misplace.
    if any(isinstance(m, dict) and m.get("ttl") == "1h" for m in marks) and hour_after_minutes(body):
        errors.append("a 1h cache_control marker after a 5-minute one")
    return errors


def _plain(m: Any) -> bool:
    """A message of text and nothing else, no mark in it (the frame's, as `anthropic._render`
    writes it; a prompt sent as a string): the walks of the rest read past it, a tool round's
    frame of a hundred and more messages at a glance rather than block by block."""
    if type(m) is not dict or len(m) != 2 or type(m.get("role")) is not str:
        return False
    content = m.get("content")
    if type(content) is str:
        return True
    if type(content) is not list or len(content) != 1:
        return False
    block = content[0]
    return (type(block) is dict and len(block) == 2 and block.get("type") == "text"
            and type(block.get("text")) is str)


def _calls(m: dict[str, Any]) -> set[str]:
    return {str(b.get("id")) for b in content_blocks(m) if b.get("type") == "tool_use"}
