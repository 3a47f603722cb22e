"""The handle on one memory's database, `Database`: SQLite (WAL, one writer at a time) or
PostgreSQL, through peewee, with the one write path and the one error boundary. Each Store owns
one (`store.db`) and hands it, or itself, to every module that reads or writes: no module holds
a process-wide connection, so two stores in one process (a migration, a test) each use their
own. Only the store imports this module (tests/test_database.py checks it).

Every write goes through `Database.writing` (BEGIN IMMEDIATE: a second process on the same file
waits for the lock instead of failing; on PostgreSQL, a transaction that first takes WRITE_LOCK,
an advisory lock every process's writers share), reads that must agree through
`Database.snapshot`, and the database's errors leave the store as StoreError (`failing_as`).
Statements are written per backend (dialect.SQL: `Database.pick` chooses); the few written once
in SQLite's dialect say so (`Database.legacy`, `Database.translated`). Ids are never handed out
twice (m010).

Several processes over one PostgreSQL database: every writer of every process takes WRITE_LOCK,
an advisory lock held until its transaction ends, in one of two modes.

- Shared (`writing(..., ordered=False)`): storing a message, a user, a conversation, a name, a
  clock move, a reheat, a binding. These run in parallel, and their commits share the WAL's
  flushes (group commit). With the lock exclusive for every write, four writer processes stored
  fewer messages than one, since every commit waited for the one before: 459 against 503 a
  second; shared, 1,107 against 540 (scripts/bench_writers.py, fsync on, 2 cores). What
  they write needs no order: message and item ids come from sequences; a message's retrieval
  rows go to `retrieval_pending` (index.py), not yet in the order readers follow; the clock is
  moved by an increment in the database; a reheat locks the rows it judges (heat.py); a user or
  conversation is inserted or found under its unique key.
- Exclusive (the default): whatever hands out the order readers catch up by, or needs no writer
  in flight. `index.sequence` moves the pending rows into `retrieval`, where `seq` is handed out
  only under this lock, so seqs are in commit order, and an arena's catch-up past its cursor
  never skips a row that commits later with a lower seq (arena.py); the batched derivations,
  deletions and their settling, the dictionary's flip (no message is being stored under the
  old dictionary while it flips), migrations and the copy of a memory. Taking it waits for the
  shared writers in flight and holds new ones back until it commits: a sequencing is one
  statement, done before each catch-up and each batch.
"""

from __future__ import annotations

import sqlite3
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal

import peewee as pw

from perpetuity_core.errors import StoreError
from perpetuity_core.memory.storage.dialect import (
    SQL,
    PgConnection,
    Postgres,
    Sql,
    Translated,
    driver_errors,
    translate_legacy,
)
from perpetuity_core.memory.storage.dictionary import Dictionary, Live


class _Tracked(pw.Database):
    """Peewee opens one connection per thread that reads (the store's writer, the scanner's,
    the tools', the preparing thread) and closes only the calling thread's: this one keeps
    every connection it opened, so that closing the store closes them all (`close_all`)."""

    _state: Any  # peewee's per-thread connection state (private: its stubs leave it out)

    def __init__(self, database: str | None, **kwargs: Any) -> None:
        super().__init__(database, **kwargs)
        self._opened: set[Any] = set()
        self._guard = threading.Lock()
        # A store dropped without closing (a test's, one the proxy replaced) closes its
        # connections when it goes, not the collector one by one, each with a warning.
        weakref.finalize(self, _close_every, self._opened, self._guard)

    def connect(self, reuse_if_open: bool = False) -> bool:
        opened = super().connect(reuse_if_open)
        if opened:
            with self._guard:
                self._opened.add(self._state.conn)
        return opened

    def close(self) -> bool:
        conn = self._state.conn
        closed = super().close()
        with self._guard:
            self._opened.discard(conn)
        return closed

    def is_closed(self) -> bool:
        # A thread whose connection close_all closed opens a new one when it reads next.
        if not self._state.closed and self._state.conn not in self._opened:
            self._state.reset()
        return bool(self._state.closed)

    def close_all(self) -> None:
        """Close every thread's connection; a thread still reading gets a StoreError."""
        if not self.is_closed():
            self.close()
        _close_every(self._opened, self._guard)


def _close_every(opened: set[Any], guard: threading.Lock) -> None:
    with guard:
        for conn in opened:
            conn.close()
        opened.clear()


class Sqlite(_Tracked, pw.SqliteDatabase):
    pass


class PostgresDatabase(_Tracked, Postgres):
    pass


# WAL lets readers scan while the single writer appends; NORMAL is durable across process crashes
# (only an OS crash can lose the last commits), which is the trade SQLite documents for WAL.
# The writer checkpoints every 4,000 frames, not SQLite's 1,000: each checkpoint syncs the
# WAL and the file (about 20 ms on a busy disk) in whichever message's commit crosses the mark,
# and at 10 pages a message that was a fifth of the write path's time (LoCoMo through it). 4,000
# frames still fit the WAL index's first hash table (4,062), so a reader's page lookup is one.
PRAGMAS = {"journal_mode": "wal", "synchronous": "normal", "foreign_keys": 1, "busy_timeout": 5000,
           "wal_autocheckpoint": 4000}


# Every writer of a PostgreSQL memory, in every process, takes this transaction-level lock
# first, shared or exclusive (module docstring). The key is arbitrary, fixed forever.
WRITE_LOCK = 0x7065727065747569

_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error, pw.PeeweeException, *driver_errors())


@contextmanager
def failing_as(what: str) -> Iterator[None]:
    """The boundary: the database's errors (raw `sqlite3` or psycopg ones from the per-request
    SQL as well as peewee's) leave the store as StoreError, which every caller knows how to
    fail open on."""
    try:
        yield
    except _ERRORS as e:
        raise _failed(what, e) from e


def _failed(what: str, e: BaseException) -> StoreError:
    """failing_as' error for `e`."""
    # SQLite rolls a transaction back itself on some errors (a full disk): the rollback
    # that follows fails, and that is not the error to report.
    cause: BaseException = e
    while "rollback" in str(cause) and isinstance(cause.__context__, _ERRORS):
        cause = cause.__context__
    # psycopg's messages span lines (a hint after the error): one line, as errors are.
    return StoreError(f"could not {what}: {' '.join(str(cause).split())}")


class Numbering:
    """SQLite: how long the ids the message writes hand out may be counted in memory.

    A message's rows were numbered past the newest row and past every id a deletion freed
    (m010), by subqueries in each insert, the retrieval row's an INSERT ... SELECT reading the
    table it wrote: 8.5 us of a LoCoMo message's statements, where the check below costs 2.6
    (interleaved medians, each statement alone). Their one writer (the store for messages and
    items, index.py for retrieval rows) counts them instead, which holds while nothing but its
    own message writes changed the database: not another connection (a second process, another
    thread's), seen by `PRAGMA data_version` once a write holds the lock; not another write on
    this connection, through `writing` (a purge, a flush, a flip) or around it, seen by its
    `total_changes`; not a write rolled back, or nested in one (it may be rolled back after).
    `counted` holds each writer's counts, by its name, and is emptied whenever one of those may
    have happened: a writer finding its count gone reads it again from the tables."""

    __slots__ = ("counted", "_last", "_version")

    def __init__(self) -> None:
        self.counted: dict[str, tuple[Any, ...]] = {}
        # (connection, data_version, total_changes) as the last numbered write committed.
        self._last: tuple[Any, int, int] | None = None
        self._version: int | None = None

    def begin(self, conn: sqlite3.Connection, nested: bool) -> None:
        """At the start of a numbered write, holding the write lock."""
        version = None if nested else conn.execute("PRAGMA data_version").fetchone()[0]
        if version is None or self._last != (conn, version, conn.total_changes):
            self.counted.clear()
        self._last, self._version = None, version  # a write that does not commit ends it

    def other(self) -> None:
        """At the start of any other write: what it writes is nobody's count."""
        self.counted.clear()
        self._last = None

    def committed(self, conn: sqlite3.Connection) -> None:
        """After a numbered write committed (not a nested one: its transaction goes on)."""
        if self._version is not None:
            self._last = (conn, self._version, conn.total_changes)


class _SqliteWrite:
    """Database.writing on SQLite, as a class: a generator context manager inside failing_as'
    cost 5 us a write over the BEGIN and COMMIT themselves (9 us), and every message is one
    write. Nested, a savepoint of the enclosing write. It tells `numbering` where it begins
    and, numbered (a message's), that it committed."""

    __slots__ = ("what", "peewee", "numbering", "numbered", "conn", "nested")

    def __init__(self, what: str, peewee: pw.Database, numbering: Numbering,
                 numbered: bool) -> None:
        self.what = what
        self.peewee = peewee
        self.numbering = numbering
        self.numbered = numbered

    def __enter__(self) -> Sql:
        try:
            conn = self.conn = self.peewee.connection()
            self.nested = conn.in_transaction
            conn.execute("SAVEPOINT perpetuity_write" if self.nested else "BEGIN IMMEDIATE")
        except _ERRORS as e:
            raise _failed(self.what, e) from e
        if not self.numbered:
            self.numbering.other()
            return conn  # type: ignore[no-any-return]
        try:
            self.numbering.begin(conn, self.nested)
        except BaseException as e:  # the write is begun: ended here, as a body's failure
            self.__exit__(type(e), e, None)
            raise
        return conn  # type: ignore[no-any-return]

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: object) -> Literal[False]:
        conn, nested = self.conn, self.nested
        try:
            if e is None:
                conn.execute("RELEASE perpetuity_write" if nested else "COMMIT")
                if self.numbered:
                    self.numbering.committed(conn)
                return False
            if conn.in_transaction:  # SQLite rolls some failures back itself
                conn.execute("ROLLBACK TO perpetuity_write" if nested else "ROLLBACK")
                if nested:
                    conn.execute("RELEASE perpetuity_write")
        except _ERRORS as failure:
            raise _failed(self.what, failure) from failure
        if isinstance(e, _ERRORS):
            raise _failed(self.what, e) from e
        return False


class Database:
    """One memory's database, owned by its Store (`store.db`) and handed to everything that
    reads or writes it: peewee's `Database` for that file or URL, bound when the store opens,
    never a process-wide one, so two stores in one process each keep their own connections.

    Peewee keeps one connection per thread (the store's writer, the scanner's, the recall
    tools', the preparing thread); closing the handle closes them all."""

    def __init__(self, location: Path | str) -> None:
        self.postgres = not isinstance(location, Path)
        self.peewee: Sqlite | PostgresDatabase = (
            PostgresDatabase(str(location)) if self.postgres
            else Sqlite(str(location), pragmas=PRAGMAS, check_same_thread=False))
        self.live = Live(self.postgres)  # the dictionary the rows are derived with
        self.numbering = Numbering()  # SQLite's: PostgreSQL numbers rows by its sequences

    @property
    def dictionary(self) -> Dictionary:
        """This memory's live dictionary (`live.follow` reads which one the database names)."""
        return self.live.dictionary

    def pick(self, sql: SQL) -> str:
        """The statement as this database's driver takes it."""
        return sql.postgres if self.postgres else sql.sqlite

    def legacy(self, sql: str) -> str:
        """A statement written once, in SQLite's dialect, as this database runs it: the
        migrations' DDL and the cold statements (dialect.translate_legacy); never per request."""
        return translate_legacy(sql) if self.postgres else sql

    def translated(self, conn: Sql | None = None) -> Sql:
        """`conn` (this thread's connection by default) running statements written once in
        SQLite's dialect: the cold paths' (maintenance commands, the integrity check, tests)."""
        conn = conn if conn is not None else self.connection()
        return Translated(conn) if self.postgres else conn

    def connection(self) -> Sql:
        """This thread's connection: sqlite3's, or a psycopg one (dialect.PgConnection)."""
        raw = self.peewee.connection()
        return PgConnection(raw) if self.postgres else raw

    def close(self) -> None:
        """Close every thread's connection; a thread still reading gets a StoreError."""
        self.peewee.close_all()

    def writing(self, what: str, *, ordered: bool = True,
                numbered: bool = False) -> AbstractContextManager[Sql]:
        """The one way to write: a transaction that takes the write lock when it begins.

        A deferred `BEGIN` that reads before it writes gets "database is locked" at once, busy
        timeout ignored, when another connection committed in between (SQLite cannot upgrade a
        stale read snapshot): two processes storing 1,500 messages each failed 36 and 40 writes
        in the review, 4 and 2 in scripts/bench_writers.py here (the batched flush reads
        first); with BEGIN IMMEDIATE the second writer waits its turn: 0 and 0 at 3,000 each.
        On PostgreSQL an unordered write takes the lock shared, an ordered one exclusive
        (module docstring); SQLite has one writer at a time either way. Nested, it is a
        savepoint of the enclosing write. A numbered write (a message's, on SQLite) keeps
        `numbering`, by which its writers count the ids it hands out.

        SQLite's statements are sqlite3's own, not peewee's atomic(): its bookkeeping cost
        about as much as the BEGIN and COMMIT themselves (8 against 16 to 23 us a write), and
        every message is one write (_SqliteWrite)."""
        if self.postgres:
            return self._pg_writing(what, ordered)
        return _SqliteWrite(what, self.peewee, self.numbering, numbered)

    @contextmanager
    def _pg_writing(self, what: str, ordered: bool) -> Iterator[Sql]:
        with failing_as(what), self.peewee.atomic():
            conn = self.connection()
            conn.execute(_LOCK_ORDERED if ordered else _LOCK_SHARED, (WRITE_LOCK,))
            yield conn

    @contextmanager
    def snapshot(self, what: str) -> Iterator[Sql]:
        """A read transaction: everything read inside it is of one commit (WAL: never blocked;
        on PostgreSQL, REPEATABLE READ: one snapshot for the whole transaction)."""
        if not self.postgres:
            with failing_as(what):
                conn = self.peewee.connection()
            if conn.in_transaction:  # inside a write (begun by sqlite3, not peewee): its reads
                with failing_as(what):
                    yield conn
                return
            with failing_as(what), self.peewee.atomic():
                yield conn
            return
        with failing_as(what), self.peewee.atomic(isolation_level="REPEATABLE READ"):
            yield self.connection()


_LOCK_ORDERED = "SELECT pg_advisory_xact_lock(%s)"
_LOCK_SHARED = "SELECT pg_advisory_xact_lock_shared(%s)"


# The most values one IN-list takes: SQLite's host parameters were limited to 999 before 3.32.
IN_CHUNK = 500


def in_chunks[T](values: Sequence[T]) -> Iterator[list[T]]:
    """`values` in chunks of at most IN_CHUNK, each small enough for one IN-list."""
    for start in range(0, len(values), IN_CHUNK):
        yield list(values[start:start + IN_CHUNK])
