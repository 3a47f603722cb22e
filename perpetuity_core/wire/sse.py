"""An incremental Server-Sent Events decoder: bytes in, (event, data) pairs out.

Chunks arrive split anywhere (mid-line, mid-UTF-8 sequence), so it buffers bytes and only decodes
whole lines. Follows the WHATWG event-stream parsing rules for the fields providers use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Event:
    event: str
    data: str

    def json(self) -> dict[str, Any] | None:
        """The data as a JSON object, or None for anything else ("[DONE]", a keep-alive)."""
        try:
            data = json.loads(self.data)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None


class SSEDecoder:
    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        out: list[Event] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return out
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", "replace")
            self._buf = self._buf[nl + 1 :]
            if not line:
                if self._data:
                    out.append(Event(self._event or "message", "\n".join(self._data)))
                self._event, self._data = "", []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                self._event = value
            elif name == "data":
                self._data.append(value)
