"""Stored rows kept in the serving process after a read, per database and per kind of read.

A stored row never changes once written (only migrations, before serving, update items) and
its id is never handed out again, even after a purge (store.m010): a row read once is the same
row whenever it is read again, for as long as it is there. So a reader keeps what it read and
asks the database only which rows are there now (ids, no text), reading whole only the ones it
has not kept. What can change (a conversation's name) is never kept; a purged row is simply
no longer among the rows there, and what was kept of it is never shown again. Which rows are
there is itself kept while no row was deleted since (`There`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable

from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.memory.storage.store import Database


class Kept[V]:
    """Rows by id, the first read going first once their text passes `chars` characters (one
    read again is kept again: no reordering on every read, which cost as much as the read it
    saved). Frames and the recall tools read on several threads: one lock."""

    def __init__(self, chars: int, size: Callable[[V], int]) -> None:
        self._rows: dict[int, V] = {}
        self._chars = 0
        self._most = chars
        self._size = size
        self._lock = threading.Lock()

    def get(self, ids: Iterable[int]) -> dict[int, V]:
        """The rows kept among `ids`."""
        with self._lock:
            rows = self._rows
            return {i: rows[i] for i in ids if i in rows}

    def put(self, read: dict[int, V]) -> None:
        with self._lock:
            for i, row in read.items():
                if i not in self._rows:
                    self._rows[i] = row
                    self._chars += self._size(row)
            while self._chars > self._most and self._rows:
                old = self._rows.pop(next(iter(self._rows)))
                self._chars -= self._size(old)


_GUARD = threading.Lock()
# By the Database object, never its file or URL: a new file at an old path numbers from 1 again.
_KEPT: weakref.WeakKeyDictionary[Database, dict[str, object]] = weakref.WeakKeyDictionary()


def kept[T](db: Database, name: str, make: Callable[[], T]) -> T:
    """This database's `name` rows (a `Kept`, or what else `make` makes on first use)."""
    with _GUARD:
        caches = _KEPT.setdefault(db, {})
        if (cache := caches.get(name)) is None:
            cache = caches[name] = make()
        return cache  # type: ignore[return-value]  # made by the `make` of this name


# Ids whose answer is kept per database (`There`): a few users' warm sets.
THERE_KEPT = 1 << 18
# The rows deleted (m017: messages and items, counted by trigger), None before it.
_DELETIONS = "SELECT id FROM high_water WHERE name = 'deletions'"


def deletions(conn: Sql) -> int | None:
    """How many messages and items were ever deleted from this database (m017); None where it
    does not count them."""
    row = conn.execute(_DELETIONS).fetchone()
    return None if row is None else int(row[0])


class There:
    """Which of the ids asked about are rows there, kept while nothing was deleted since.

    A row is there until it is deleted, and an id is never handed out again (store.m010), so
    what was found there still is while the deletions counted (`deletions`) stand, and an id
    not found (deleted, or of a kind the question leaves out, which never changes) never will
    be. Only the ids not asked about before are asked (a first prompt's frame asked for its
    ~350 rows every call, 2.2M of its 28.6M instructions on LoCoMo's memory)."""

    def __init__(self, most: int = THERE_KEPT) -> None:
        self._count: Hashable | None = None
        self._there: set[int] = set()
        self._never: set[int] = set()
        self._most = most
        self._lock = threading.Lock()

    def among(self, count: Hashable | None, ids: list[int],
              ask: Callable[[list[int]], Iterable[int]]) -> list[int]:
        """Those of `ids` there, ascending, as `ask` (those of the ids it is given that are
        there) would find them all; `count`: the deletions counted before any of it was read
        (None: nothing is known, all are asked; anything that changes whenever a row goes will
        do)."""
        with self._lock:
            if count is None or count != self._count or (
                    len(self._there) + len(self._never) > self._most):
                self._there, self._never, self._count = set(), set(), count
            there, never = self._there, self._never
            unknown = [i for i in ids if i not in there and i not in never]
        found = set(ask(unknown)) if unknown else set()
        with self._lock:
            if count is not None and self._there is there:  # not emptied meanwhile
                there |= found
                never.update(i for i in unknown if i not in found)
            return sorted([i for i in ids if i in there or i in found])


class Counted[V]:
    """Rows by id that never change while they are there (what was stored with them: a row's
    birth), kept while the deletions counted (`deletions`) stand: a deleted row's are dropped
    with all the rest when the count moves. One lock (frames read on several threads)."""

    def __init__(self, most: int = THERE_KEPT) -> None:
        self._count: int | None = None
        self._rows: dict[int, V] = {}
        self._most = most
        self._lock = threading.Lock()

    def get(self, count: int | None, ids: Iterable[int]) -> dict[int, V]:
        """Those of `ids` kept at `count` (None: nothing is known)."""
        with self._lock:
            if count is None or count != self._count or len(self._rows) > self._most:
                self._rows, self._count = {}, count
            rows = self._rows
            return {i: rows[i] for i in ids if i in rows}

    def put(self, count: int | None, read: dict[int, V]) -> None:
        """Keep `read`, read after `count` was."""
        with self._lock:
            if count is not None and count == self._count:
                self._rows.update(read)
