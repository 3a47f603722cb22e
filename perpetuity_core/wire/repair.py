"""Never an invalid request: where the harness's own messages may start after the frame, and the
replaced body checked, and repaired by keeping more of them, before it goes upstream.

The frame ends with the assistant's turn, so the part kept as the harness sent it must start
with a user message; and a tool result whose call was replaced by the frame is refused by every
provider (a real 215-call Claude Code session had one in its first 60: the user message after
an interrupted tool call carries that call's result beside the new prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from perpetuity_core.wire.conversation import Kind, Message, ParsedRequest
from perpetuity_core.wire.protocols.base import Adapter


def kept_start(messages: list[Message], start: int) -> int:
    """The latest index at or before `start` where the kept part may begin: a user message none
    of whose tool results answer a call made before it (0 when none does)."""
    for k in range(min(start, len(messages) - 1), 0, -1):
        if messages[k].role == "user" and not answers_earlier(messages, k):
            return k
    return 0


def answers_earlier(messages: list[Message], i: int) -> bool:
    """Message `i` holds results of calls made before it: nothing may go between them. Looked
    for from just before it back: a result answers the message before it, so this stops there
    rather than walking a long session's whole history on every call."""
    results = {p.call_id for p in messages[i].parts if p.kind == Kind.TOOL_RESULT}
    return bool(results) and any(p.kind == Kind.TOOL_CALL and p.call_id in results
                                 for m in reversed(messages[:i]) for p in m.parts)


@dataclass(frozen=True, slots=True)
class Replaced:
    """The body to send (None: send the request as the harness sent it), the first message kept
    as sent, and why the plan changed ("" when it did not)."""

    body: dict[str, Any] | None
    keep: int
    why: str = ""


def replace_history(adapter: Adapter, body: dict[str, Any], parsed: ParsedRequest,
                    rendered: list[Message], keep: int,
                    inserts: Mapping[int, list[Message]] | None = None) -> Replaced:
    """The body with the messages before `keep` replaced by `rendered`, as the provider accepts
    it: when its check refuses the result, the boundary moves back to earlier user messages
    (more of the harness's own history kept verbatim) until it accepts; when none is accepted
    before the first message, the original goes, with the reason. `inserts` (raw index ->
    messages) go just before the messages at those indexes.

    A boundary that was 0 to begin with (a first contact: everything is new) stays there.
    """
    messages = parsed.messages
    k = kept_start(messages, keep) if keep else 0
    errors: list[str] = []
    while not keep or k:
        out = adapter.replace_history(body, rendered, parsed.raw_index[k], inserts,
                                      parsed.raw_standing)
        if not (found := adapter.check(out)):
            return Replaced(out, k, f"kept from message {k}, not {keep}: {errors[0]}" if errors else "")
        errors = errors or found
        if not keep:
            break
        k = kept_start(messages, k - 1)
    return Replaced(None, 0, "history left as sent: "
                    + ("; ".join(errors) or "no user message to keep after the frame"))
