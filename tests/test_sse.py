"""The SSE decoder: events split anywhere decode the same, and a multi-megabyte chunk decodes
whole (decoding it used to be quadratic in the chunk's length; the timing is in the report of
issue 14, not asserted here)."""

from __future__ import annotations

import json

from perpetuity_core.wire.sse import Event, SSEDecoder


def _stream(n: int) -> bytes:
    return b"".join(
        b"event: content_block_delta\r\ndata: "
        + json.dumps({"type": "content_block_delta", "index": 0,
                      "delta": {"type": "text_delta", "text": f"word {i} \u00e9"}}).encode()
        + b"\r\n\r\n" for i in range(n))


def test_a_multi_megabyte_chunk_decodes_every_event() -> None:
    raw = b": keep-alive\n\n" + _stream(30_000) + b"data: [DONE]\n\n"
    assert len(raw) > 2_000_000
    events = SSEDecoder().feed(raw)
    assert len(events) == 30_001
    assert events[12_345].event == "content_block_delta"
    assert events[12_345].json()["delta"]["text"] == "word 12345 \u00e9"
    assert events[-1] == Event("message", "[DONE]")


def test_events_split_anywhere_decode_as_one_chunk() -> None:
    raw = _stream(40) + b"event: ping\ndata: {}\ndata: {\"more\": 1}\n\n"
    whole = SSEDecoder().feed(raw)
    for size in (1, 2, 7, 64, 1000):
        d = SSEDecoder()
        split = [e for i in range(0, len(raw), size) for e in d.feed(raw[i:i + size])]
        assert split == whole, size
    assert whole[-1] == Event("ping", "{}\n{\"more\": 1}")
    assert SSEDecoder().feed(raw[:-1]) == whole[:-1]  # the last event is not over yet
