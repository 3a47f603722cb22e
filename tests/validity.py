"""What each provider accepts, as far as the frame can break it: role order and tool pairing."""

from __future__ import annotations

from typing import Any


def anthropic_errors(body: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    msgs = [m for m in body.get("messages", []) if m.get("role") != "system"]
    if not msgs or msgs[0].get("role") != "user":
        errors.append("the first message must be the user's")
    for a, b in zip(msgs, msgs[1:]):
        if a.get("role") == b.get("role"):
            errors.append(f"two {a.get('role')} messages in a row")
    for i, m in enumerate(msgs):
        blocks = m["content"] if isinstance(m.get("content"), list) else []
        calls = {b["id"] for b in blocks if b.get("type") == "tool_use"}
        if calls:
            nxt = msgs[i + 1]["content"] if i + 1 < len(msgs) else []
            answered = {b.get("tool_use_id") for b in nxt if isinstance(nxt, list)
                        and b.get("type") == "tool_result"}
            if calls - answered and i + 1 < len(msgs):
                errors.append(f"tool_use without its result: {calls - answered}")
        results = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        if results:
            prev = msgs[i - 1]["content"] if i > 0 else []
            called = {b.get("id") for b in prev if isinstance(prev, list)
                      and b.get("type") == "tool_use"}
            if results - called:
                errors.append(f"tool_result without its call: {results - called}")
    markers = str(body).count("'cache_control'")
    if markers > 4:
        errors.append(f"{markers} cache_control markers (at most 4)")
    return errors


def chat_errors(body: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    msgs = body.get("messages", [])
    if not msgs:
        errors.append("no messages")
    open_calls: set[str] = set()
    for m in msgs:
        if m.get("role") == "tool":
            if m.get("tool_call_id") not in open_calls:
                errors.append(f"tool message without its call: {m.get('tool_call_id')}")
            open_calls.discard(m.get("tool_call_id"))
        else:
            if open_calls and m.get("role") != "tool":
                errors.append(f"tool calls without results: {open_calls}")
                open_calls = set()
            open_calls |= {c["id"] for c in m.get("tool_calls") or []}
    return errors


def responses_errors(body: dict[str, Any]) -> list[str]:
    items = body.get("input")
    if isinstance(items, str) or body.get("previous_response_id"):
        return []
    errors: list[str] = []
    called: set[str] = set()
    answered: set[str] = set()
    for it in items or []:
        if it.get("type") in ("function_call", "custom_tool_call"):
            called.add(it.get("call_id"))
        elif it.get("type") in ("function_call_output", "custom_tool_call_output"):
            if it.get("call_id") not in called:
                errors.append(f"output without its call: {it.get('call_id')}")
            answered.add(it.get("call_id"))
    if called - answered:
        errors.append(f"calls without output: {called - answered}")
    return errors


CHECKS = {"/v1/messages": anthropic_errors, "/v1/chat/completions": chat_errors,
          "/v1/responses": responses_errors}
