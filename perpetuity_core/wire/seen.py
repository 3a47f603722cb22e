"""Request bodies read as far as they were read before: a harness re-sends its whole history on
every call and only appends to it, so only what follows the part already read is parsed.

A Claude Code session that never compacts sends 22 MB of JSON a call by 1.4M tokens of history
(the six shared sessions chained three times over): `json.loads`, the lone-surrogate scan and
the adapter's reading of every message took most of a late call's time, all of it proportional
to the history.

`Seen.read(raw)` returns the body as `json.loads(raw)` reads it. For the last bodies it read
(`ENTRIES` of them, at most `BUDGET` bytes in all) it keeps the bytes themselves, where each of
the last `ENDS` elements of the body's history array ends (`messages`; Gemini's `contents`,
Responses' `input`), and the objects parsed from the body. A body whose bytes up to one of
those ends are the same bytes (compared, not hashed: a `memcmp`) reads as that body did up to
there: its members before the history, the history's elements up to there, and what the
adapter made of that body (`Read.known`, kept by `Seen.keep`; `Read.reused` says how many of
the history's first elements it holds for this one). Only the rest is parsed. A body that
differs anywhere before is parsed whole, so a lookup saves work and never changes what is read.
The harness moves its cache marker to its last message on every call, so the last elements
change; the earlier ones do not. The bytes before an end are compared once: each end's last
`WINDOW` bytes first, so an end past the change (the moved marker) costs a short comparison,
not one over the whole history.

What it holds is bounded by `BUDGET`, not by any history: the bodies themselves and what they
parse to (about 1.5 times their size: the 21 MB body of a 1.4M-token history is 28 MB of
objects, its messages 3 MB more). A body past the budget is read whole every time, as before.

The objects handed out are shared with later calls: the request path must not change them in
place (it builds what it sends anew). One thread reads (the one that prepares requests); the
body a longer one replaced waits for `release` (at most `RETIRED` of them) to be freed off the
request path.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

ENTRIES = 16  # bodies kept (least recently read go first)
BUDGET = 32 * 1024 * 1024  # bytes of them kept in all (a body parses to about 1.5 times its size)
ENDS = 8  # the last elements of a history whose ends are kept
HISTORY_KEYS = ("messages", "contents", "input")
WINDOW = 4096  # bytes before an end compared first
RETIRED = 2  # bodies a longer one replaced, waiting for `Seen.release` (past it: freed at once)

_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as the json module skips it
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class Read:
    """A body as `json.loads` reads it, and what of it an earlier body had read already."""

    data: Any
    known: Any = None  # what the adapter made of the earlier body (`Seen.keep`), or None
    reused: int = 0  # the history's first elements that are the earlier body's, the same objects
    fresh_from: int = 0  # the first byte not read before (0: the whole body is new)
    _entry: _Entry | None = None  # what `Seen.keep` remembers (None: nothing to remember)


@dataclass(frozen=True, slots=True)
class Look:
    """Where a body starts as a kept one did (`Seen.look`): that body, the byte just past the
    end where they part, and the history element ending there; None for none."""

    raw: bytes
    found: tuple[_Entry, int, int] | None

    def continues(self, most: int) -> bool:
        """Does the body continue a kept one, with at most `most` bytes after where it does
        (what `read` parses)? Known without parsing: a body mostly not read before is refused
        before it is read, not after, however long the part read before."""
        return self.found is not None and len(self.raw) - self.found[1] <= most


@dataclass(slots=True)
class _Entry:
    raw: bytes  # the body, as sent
    head: list[tuple[str, Any]]  # the top-level members before the history array
    key: str  # the history array's member name
    elements: list[Any]  # the history's elements
    ends: list[tuple[int, int]]  # (byte offset just past element i, i) for the last ENDS
    known: Any = None  # what the adapter made of the body
    # The body's text after its history array, and the top-level members it holds: a body
    # whose text there is the same holds these same objects (a harness's system prompt and
    # tools follow its messages: Claude Code's 64 KB of tool schemas, parsed, then walked and
    # written anew on every call, were ~1 ms of a tool round's prepare).
    after: str = ""
    tail: list[tuple[str, Any]] = field(default_factory=list)


class Seen:
    """The last bodies read, by what they start with."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._bytes = 0
        # The body a longer one replaced is freed by `release`, after the request went on its
        # way: dropping a 22 MB body and what only it held (its buffer's munmap) was 1.5 ms of
        # a late call of a 1.37M-token session, on the request path.
        self._retired: deque[_Entry] = deque(maxlen=RETIRED)

    def release(self) -> None:
        """Free the bodies replaced since the last call: from any thread (the store's writer,
        once the request is on its way); a deque's append and popleft are atomic."""
        while self._retired:
            try:
                self._retired.popleft()
            except IndexError:  # another thread's release took the last
                return

    def read(self, raw: bytes, look: Look | None = None) -> Read:
        """`raw` as `json.loads` reads it (its errors raised as it raises them); `look`: where
        it starts as a kept body did, as `look` found it (not compared again)."""
        found = self._longest(raw, look)
        if found is not None:
            try:
                read = _continued(raw, *found)
            except (ValueError, RecursionError):
                read = None  # json.loads says why, reading it whole
            if read is not None:
                return read
        return _whole(raw)

    def keep(self, read: Read, known: Any) -> None:
        """Remember `read`'s body for the bodies that start with it, `known` what the adapter
        made of it (handed back as `Read.known` with a body that starts the same)."""
        entry = read._entry
        if entry is None or len(entry.raw) > BUDGET:
            return
        entry.known = known
        self._entries[id(entry)] = entry
        self._bytes += len(entry.raw)
        while self._bytes > BUDGET or len(self._entries) > ENTRIES:
            _, old = self._entries.popitem(last=False)
            self._bytes -= len(old.raw)
        read._entry = None

    def look(self, raw: bytes) -> Look:
        """Where `raw` starts as a kept body did, up to one of its ends (`read` then reads only
        what follows); nothing is taken out. Handed to `read`, its bytes are not compared
        again (a late body's 21 MB were compared twice a call: on the loop, then to read)."""
        return Look(raw, self._found(raw))

    def _longest(self, raw: bytes, look: Look | None = None) -> tuple[_Entry, int, int] | None:
        """The kept body that `raw` starts like over the most bytes, up to one of its ends
        (that end, and the element it ends): taken out, since the newer body replaces it."""
        kept = look is not None and look.raw is raw and (
            look.found is None or self._entries.get(id(look.found[0])) is look.found[0])
        best = look.found if kept and look is not None else self._found(raw)
        if best is not None:
            del self._entries[id(best[0])]
            self._bytes -= len(best[0].raw)
            self._retired.append(best[0])
        return best

    def _found(self, raw: bytes) -> tuple[_Entry, int, int] | None:
        """The kept body that `raw` starts like over the most bytes, up to one of its ends."""
        best: tuple[_Entry, int, int] | None = None
        for entry in reversed(self._entries.values()):
            old = memoryview(entry.raw)
            for end, last in reversed(entry.ends):
                if best is not None and end <= best[1]:
                    break
                if end < len(raw) and _same_up_to(raw, old, end):
                    best = (entry, end, last)
                    break
        return best


def _same_up_to(raw: bytes, old: memoryview, end: int) -> bool:
    """Are `raw`'s first `end` bytes `old`'s? Their last WINDOW compared first: a change near
    the end (the marker the harness moved) is found without comparing the whole history."""
    near = max(0, end - WINDOW)
    return raw.startswith(old[near:end], near) and raw.startswith(old[:near])


def _whole(raw: bytes) -> Read:
    """Every byte of the body read, with where its history's last elements end."""
    if json.detect_encoding(raw) != "utf-8":
        return Read(json.loads(raw))
    text = raw.decode("utf-8", "surrogatepass")  # as json.loads reads bytes
    try:
        walked = _walk(text, raw)
    except (ValueError, RecursionError):
        walked = None
    return Read(json.loads(text)) if walked is None else walked


def _walk(text: str, raw: bytes) -> Read | None:
    """The body read member by member, its history element by element (None: not an object
    whose history this can read; json.loads then says why, or reads it)."""
    i = _SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if text[i:i + 1] != "{":
        return None
    head: list[tuple[str, Any]] = []
    i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
    comma = False  # the last member was followed by one
    while i < len(text) and text[i] == '"':
        key, i = _DECODER.raw_decode(text, i)
        i = _SPACE.match(text, i).end()  # type: ignore[union-attr]
        if text[i:i + 1] != ":":
            return None
        i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
        if key in HISTORY_KEYS and text[i:i + 1] == "[" and all(k != key for k, _ in head):
            entry = _Entry(raw, head, key, [], [])
            return _rest(text, i + 1, entry, 0)
        value, i = _DECODER.raw_decode(text, i)
        head.append((key, value))
        i = _SPACE.match(text, i).end()  # type: ignore[union-attr]
        comma = text[i:i + 1] == ","
        if not comma:
            break
        i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
    if not comma and text[i:i + 1] == "}" and _SPACE.match(text, i + 1).end() == len(text):  # type: ignore[union-attr]
        return Read(dict(head))  # no history array (an envelope, a count): read once all the same
    return None  # not an object: json.loads reads it, or says why


def _continued(raw: bytes, entry: _Entry, end: int, last: int) -> Read | None:
    """A body that starts as `entry`'s did up to byte `end`, just past history element
    `last`: read from there."""
    text = raw[end:].decode("utf-8", "surrogatepass")
    new = _Entry(raw, entry.head, entry.key, entry.elements[:last + 1],
                 [e for e in entry.ends if e[0] <= end], after=entry.after, tail=entry.tail)
    read = _rest(text, 0, new, end, after_element=True)
    if read is not None:
        read.known, read.reused, read.fresh_from = entry.known, last + 1, end
    return read


def _rest(text: str, i: int, entry: _Entry, base: int,
          after_element: bool = False) -> Read | None:
    """The body from inside its history array at `text[i]` on (`after_element`: just past an
    element, else just past the `[`), `base` the byte offset of `text[0]` in the body."""
    elements = entry.elements
    ends: list[int] = []  # character offsets in `text` just past each new element
    i = _SPACE.match(text, i).end()  # type: ignore[union-attr]
    if after_element or text[i:i + 1] != "]":
        while True:
            if after_element:
                if text[i:i + 1] != ",":
                    break
                i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
            value, i = _DECODER.raw_decode(text, i)
            elements.append(value)
            ends.append(i)
            after_element = True
            i = _SPACE.match(text, i).end()  # type: ignore[union-attr]
    if text[i:i + 1] != "]":
        return None
    i = _SPACE.match(text, i + 1).end()  # type: ignore[union-attr]
    tail: list[tuple[str, Any]] = []
    after = text[i:]
    if after and after == entry.after:  # ("" is no body's: it ends at its "}")
        tail = entry.tail  # read before, and taken as read: the same objects
    elif text[i:i + 1] == ",":
        if text[_SPACE.match(text, i + 1).end():][:1] != '"':  # type: ignore[union-attr]
            return None  # a trailing comma: json.loads refuses it
        rest, at = _DECODER.raw_decode("{" + text[i + 1:], 0)
        if _SPACE.match(text, i + at).end() != len(text):  # type: ignore[union-attr]
            return None
        tail = list(rest.items())
    elif text[i:i + 1] != "}" or _SPACE.match(text, i + 1).end() != len(text):  # type: ignore[union-attr]
        return None
    if any(k == entry.key for k, _ in tail):
        return None  # the history named twice: json.loads keeps the last
    entry.after, entry.tail = after, tail
    entry.ends = (entry.ends + _byte_ends(text, base, ends, len(elements) - len(ends)))[-ENDS:]
    members = [*entry.head, (entry.key, list(elements)), *tail]
    return Read(dict(members), _entry=entry)


def _byte_ends(text: str, base: int, ends: list[int], first: int) -> list[tuple[int, int]]:
    """The byte offsets (from `base`, that of `text[0]`) of the last ENDS of `ends`
    (character offsets in `text` just past elements `first`, `first` + 1, ...), each with its
    element's index."""
    out: list[tuple[int, int]] = []
    start = max(0, len(ends) - ENDS)
    at, upto = base, 0
    for k in range(start, len(ends)):
        at += len(text[upto:ends[k]].encode("utf-8", "surrogatepass"))
        upto = ends[k]
        out.append((at, first + k))
    return out
