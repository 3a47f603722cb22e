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

The elements not written before are written together, by one encoding of them with a string no
body holds between them (`_apart`), and split there: one encoding a piece made a fresh body of
a hundred and more small messages (a tool round's frame, bench_latency's) cost more than
json.dumps of the whole (issue 24).

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
        # id of the object -> [the object, its JSON as bytes without ASCII escapes, with them]
        self._pieces: OrderedDict[int, list[Any]] = OrderedDict()
        self._bytes = 0

    def dumps(self, body: dict[str, Any], ascii: bool = False) -> bytes:
        """`json.dumps(body, ensure_ascii=ascii).encode()`, its errors raised as it raises them."""
        if not all(isinstance(k, str) for k in body):
            return json.dumps(body, ensure_ascii=ascii).encode()  # json.dumps converts the keys
        out: list[bytes] = []
        for key, value in body.items():
            out += (_COMMA if out else _OPEN, _dumped(key, ascii), _COLON)
            if isinstance(value, list):
                out += (b"[", self._elements(value, ascii), b"]")
            else:
                out.append(_dumped(value, ascii))
        out.append(_CLOSE if out else b"{}")
        self._trim()
        return b"".join(out)

    def _elements(self, values: list[Any], ascii: bool) -> bytes:
        """A top-level array's elements as JSON joined by ", ": those written before from the
        pieces kept, the others written together."""
        kept, at = self._pieces, 1 + ascii
        pieces: list[bytes | None] = []
        new: list[Any] = []  # the containers not kept, in their order
        for value in values:
            # Only containers are kept, each held: an object of a kept id is the one kept.
            entry = kept.get(id(value))
            if entry is not None and entry[at] is not None:
                kept.move_to_end(id(value))
                pieces.append(entry[at])
            elif isinstance(value, (dict, list)):
                new.append(value)
                pieces.append(None)
            else:
                pieces.append(_dumped(value, ascii))
        if new:
            fresh = iter(self._keep(new, _apart(new, ascii), at))
            pieces = [p if p is not None else next(fresh) for p in pieces]
        return _COMMA.join(pieces)  # type: ignore[arg-type]  # every None was replaced

    def _keep(self, values: list[Any], pieces: list[bytes], at: int) -> list[bytes]:
        for value, piece in zip(values, pieces, strict=True):
            entry = self._pieces.get(id(value))
            if entry is None:
                entry = self._pieces[id(value)] = [value, None, None]
            if entry[at] is None:  # an object twice in a body counts once
                self._bytes += len(piece)
            entry[at] = piece
            # Written without ASCII escapes and ASCII all through, but for DEL (escaped with
            # them): the same with them. The relay's first round writes a first prompt's frame
            # with them right after the body without (issue 24: half its 131 messages' cost).
            if at == 1 and entry[2] is None and piece.isascii() and b"\x7f" not in piece:
                entry[2] = piece
                self._bytes += len(piece)
        return pieces

    def _trim(self) -> None:
        while self._bytes > BUDGET:
            _, (_, *pieces) = self._pieces.popitem(last=False)
            self._bytes -= sum(len(p) for p in pieces if p is not None)


# json.dumps's own encoders, made once: json.dumps(..., ensure_ascii=False) makes a new one on
# every call, which for a body's ~80 small pieces cost more than writing them (0.3 ms a call).
_ENCODERS = {ascii: json.JSONEncoder(ensure_ascii=ascii) for ascii in (False, True)}


def _dumped(value: Any, ascii: bool) -> bytes:
    return _ENCODERS[ascii].encode(value).encode()


# A string no body holds, put between the containers written together: json.dumps writes it
# the same in either encoding (its control characters escaped), and `_SEPARATOR` (it, with
# the separators either side) can be found in what json.dumps writes of a container only as
# an array's element that is this string, between two others. Written apart, n containers
# are then n pieces exactly when it is found n - 1 times.
_SPLIT = "\x00perpetuity.written\x00"
_SEPARATOR = _COMMA + _dumped(_SPLIT, True) + _COMMA


def _apart(values: list[Any], ascii: bool) -> list[bytes]:
    """Each of `values` (containers) as JSON, written by one encoding, not one a value: an
    encoding's own cost (~13k instructions) was most of a small message's."""
    if len(values) == 1:
        return [_dumped(values[0], ascii)]
    spaced = [_SPLIT] * (2 * len(values) - 1)
    spaced[::2] = values
    pieces = _dumped(spaced, ascii).split(_SEPARATOR)
    if len(pieces) != len(values):  # the string inside a value: written one by one
        return [_dumped(v, ascii) for v in values]
    pieces[0], pieces[-1] = pieces[0][1:], pieces[-1][:-1]  # the brackets
    return pieces
