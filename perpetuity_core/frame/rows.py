"""How a stored row reads to the model, in a frame or a recall tool's answer (the rows
themselves are read by memory.storage.reads)."""

from __future__ import annotations

from datetime import UTC, datetime

from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Kind


def quoted(r: Row) -> str:
    """A row's text as the model reads it in a frame or an answer: a tool call or result says
    so."""
    if r.kind == _TOOL_CALL:
        return f"called {r.name}: {r.text}"
    if r.kind == _TOOL_RESULT:
        return f"tool result: {r.text}"
    return r.text


_TOOL_CALL, _TOOL_RESULT = Kind.TOOL_CALL.value, Kind.TOOL_RESULT.value  # hot: once, not per row


def time_label(at: float) -> str:
    """When a row was said, as frames and answers label it (UTC, to the minute)."""
    return f"{datetime.fromtimestamp(at, UTC):%Y-%m-%d %H:%M} UTC"
