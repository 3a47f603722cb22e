"""Stored rows kept in the serving process after a read, per database and per kind of read.

A stored row never changes once written (only migrations, before serving, update items) and
its id is never handed out again, even after a purge (store.m010): a row read once is the same
row whenever it is read again, for as long as it is there. So a reader keeps what it read and
asks the database only which rows are there now (ids, no text), reading whole only the ones it
has not kept. What can change (a conversation's name) is never kept; a purged row is simply
no longer among the rows there, and what was kept of it is never shown again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

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
_KEPT: weakref.WeakKeyDictionary[Database, dict[str, Kept]] = weakref.WeakKeyDictionary()  # type: ignore[type-arg]


def kept[V](db: Database, name: str, make: Callable[[], Kept[V]]) -> Kept[V]:
    """This database's `name` rows (made by `make` on first use)."""
    with _GUARD:
        caches = _KEPT.setdefault(db, {})
        if (cache := caches.get(name)) is None:
            cache = caches[name] = make()
        return cache
