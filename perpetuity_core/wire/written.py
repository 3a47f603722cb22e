"""Request bodies written as far as they were written before: what goes upstream is a call's
frame, then the harness's messages as it sent them, and the next call sends the same message
objects again (wire.seen hands them out), so only what is new is turned into JSON.

`Written.dumps(body, ascii)` returns exactly `json.dumps(body, ensure_ascii=ascii).encode()`.
The body's top-level members are written as json.dumps writes a dict (`{"key": value, ...}`,
separated by ", " and ": ") and each element of a top-level array (the messages, the tools, the
system blocks) as json.dumps writes it, joined by ", " in brackets: json.dumps of a container
is the same pieces joined the same way. A piece is kept by its object (`id`, the object held so
that the id is not handed to another) for the calls after, up to `BUDGET` bytes of pieces, the
least recently written going first. At 1.4M tokens of history a late call's upstream body is
about 90k tokens, written twice (the body and the relay's first round with the recall tools):
json.dumps of it, twice over, was 2 ms of a late call.

The objects written must not change after (wire.seen's rule already: the request path builds
what it sends anew): a changed object would be written as it was. One thread writes (the one
that prepares requests).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

BUDGET = 16 * 1024 * 1024  # bytes of pieces kept (two bodies of the bound, both encodings, and more)
_OPEN, _CLOSE, _COMMA, _COLON = b"{", b"}", b", ", b": "


class Written:
    """The pieces of the last bodies written, by object and encoding."""

    def __init__(self) -> None:
        # (id of the object, ascii) -> (the object, its JSON as bytes)
        self._pieces: OrderedDict[tuple[int, bool], tuple[Any, bytes]] = OrderedDict()
        self._bytes = 0

    def dumps(self, body: dict[str, Any], ascii: bool = False) -> bytes:
        """`json.dumps(body, ensure_ascii=ascii).encode()`, its errors raised as it raises them."""
        if not all(isinstance(k, str) for k in body):
            return json.dumps(body, ensure_ascii=ascii).encode()  # json.dumps converts the keys
        out: list[bytes] = []
        for key, value in body.items():
            out += (_COMMA if out else _OPEN, _dumped(key, ascii), _COLON)
            if isinstance(value, list):
                out += (b"[", _COMMA.join([self._piece(v, ascii) for v in value]), b"]")
            else:
                out.append(_dumped(value, ascii))
        out.append(_CLOSE if out else b"{}")
        self._trim()
        return b"".join(out)

    def _piece(self, value: Any, ascii: bool) -> bytes:
        """`value` as JSON, from the pieces kept when it is an object written before."""
        if not isinstance(value, (dict, list)):
            return _dumped(value, ascii)
        key = (id(value), ascii)  # the object is held while kept: no other has its id
        kept = self._pieces.get(key)
        if kept is not None:
            self._pieces.move_to_end(key)
            return kept[1]
        piece = _dumped(value, ascii)
        self._pieces[key] = (value, piece)
        self._bytes += len(piece)
        return piece

    def _trim(self) -> None:
        while self._bytes > BUDGET:
            _, (_, piece) = self._pieces.popitem(last=False)
            self._bytes -= len(piece)


# json.dumps's own encoders, made once: json.dumps(..., ensure_ascii=False) makes a new one on
# every call, which for a body's ~80 small pieces cost more than writing them (0.3 ms a call).
_ENCODERS = {ascii: json.JSONEncoder(ensure_ascii=ascii) for ascii in (False, True)}


def _dumped(value: Any, ascii: bool) -> bytes:
    return _ENCODERS[ascii].encode(value).encode()
