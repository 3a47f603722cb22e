"""The arena: the retrieval rows held in the serving process as numpy segments, caught up
before every scan (memory.scan explains the two layouts and their measured costs).

Segments hold at most SEGMENT_ROWS rows, so a row's index inside its segment fits 16 bits.
Before every scan the arena catches up on the rows (and deletions) stored since its last
catch-up, appending a new segment and merging only small tail segments, never rebuilding the
whole. Segments are scored on worker threads into one vector, deterministically.

Each process holds its own arena; a catch-up reads, in one snapshot, the retrieval rows past its
cursor (`seq`) and the deletions past its other cursor (`retrieval_gone.seq`), whichever
process wrote them. That never misses a committed row because seqs are handed out in commit
order: on SQLite the file has one writer at a time; on PostgreSQL, where writers store in
parallel, a row gets its seq only when index.sequence moves it out of retrieval_pending, which
holds the write lock exclusive until it commits (database.py), and a catch-up runs it first, so
no row with a lower seq can commit after a higher one was read (tests/test_store.py runs 2 and 4 writer processes while
an arena catches up, and compares it with one built afresh).

One writer, many readers. A catch-up (one at a time) ends by publishing a `View`: the row
count n, views of the first n rows of each per-row column, the tuple of segments, the
document frequencies and the totals. Readers scan the view they picked up, without a lock,
while the next catch-up appends; each ranking is the exact scan of the memory as committed
when its view was published. A catch-up costs O(its new rows), whatever the arena's size:
- per-row columns live in buffers that double when full; rows are written only past every
  published view's end (in place, or in the new buffers a growth copies into, the old ones
  staying alive as long as a view holds them);
- the one write below an older view's end is a conversation's last row getting its next
  link, a row past that view's end: `View.step` reads any next link at or past n as none
  (links are versioned by the view's length rather than copied; a previous link always
  points below its row);
- segments are never changed: a merge builds a new one, and the view holds the old tuple;
- document frequencies are immutable: a shared base plus a small delta, copied per
  catch-up, folded into a fresh base every Frequencies.FOLD_AT new terms (amortised);
- deletions (a purge, a cascade) change existing rows (user -1, the neighbours' links), so
  a catch-up that brings any first copies those three columns (12 bytes a row), the only
  O(rows) step; appends never pay it.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from perpetuity_core.memory.derived import vectors
from perpetuity_core.memory.derived.index import order_pending, sequence
from perpetuity_core.memory.derived.view import Frequencies, Segment, View
from perpetuity_core.memory.storage.dialect import SQL, Sql
from perpetuity_core.memory.storage.store import Database, failing_as

SEGMENT_ROWS = 1 << 16  # local row ids are uint16
TERMS = "terms"  # term-major layout (shipped)
ROWS = "rows"  # row-major layout (measured for comparison)


# Where an int64's 16-bit words (low first) and its high 32 bits sit in memory.
_WORDS = (0, 1, 2, 3) if sys.byteorder == "little" else (3, 2, 1, 0)
_HIGH = 1 if sys.byteorder == "little" else 0


def build_segment(start: int, row_len: np.ndarray, terms: np.ndarray, tf: np.ndarray,
                  layout: str) -> Segment:
    """A segment from its rows' postings in row order (each row's terms ascending)."""
    n = int(row_len.size)
    if layout == ROWS:
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(row_len, out=ptr[1:])
        return Segment(start, n, row_ptr=ptr, row_terms=terms.astype(np.int32), tf=tf)
    # Postings packed as term | row | tf in the 32 | 16 | 16 bits of one int64 and sorted by
    # value: each term's postings end up in row order (sums run in a fixed order), and sorting
    # values is several times faster than a stable argsort plus three gathers. Built in place
    # and read back through views of its words, not shifts and masks: 10k rows in 6 ms, not 10.
    key = terms.astype(np.int64)
    key <<= 32
    key |= np.repeat(np.arange(n, dtype=np.int64) << 16, row_len)
    key |= tf
    key.sort()
    words = key.view(np.uint16)
    t = key.view(np.int32)[_HIGH::2].copy()
    if t.size:
        firsts = np.flatnonzero(np.concatenate(([True], t[1:] != t[:-1])))
    else:
        firsts = np.zeros(0, np.int64)
    ptr = np.append(firsts, t.size).astype(np.int64)
    return Segment(start, n, terms=t[firsts], ptr=ptr, rows=words[_WORDS[1]::4].copy(),
                   tf=words[_WORDS[0]::4].astype(np.uint8))


def merge_segments(older: Segment, newer: Segment) -> Segment:
    """One segment for two adjacent ones (the newer's rows follow the older's), without a sort:
    in term-major order each term's postings are the older's then the newer's, each already in
    row order, so every posting is moved once, straight to its place."""
    if newer.start != older.start + older.n:
        raise AssertionError("segments must tile the arena")
    n = older.n + newer.n
    if older.row_ptr is not None:
        assert newer.row_ptr is not None and older.row_terms is not None  # one layout per arena
        assert newer.row_terms is not None
        return Segment(older.start, n,
                       row_ptr=np.concatenate((older.row_ptr,
                                               newer.row_ptr[1:] + older.row_ptr[-1])),
                       row_terms=np.concatenate((older.row_terms, newer.row_terms)),
                       tf=np.concatenate((older.tf, newer.tf)))
    assert older.terms is not None and newer.terms is not None
    assert older.ptr is not None and newer.ptr is not None
    terms = np.union1d(older.terms, newer.terms)
    old_at = np.searchsorted(terms, older.terms)
    new_at = np.searchsorted(terms, newer.terms)
    old_len, new_len = np.diff(older.ptr), np.diff(newer.ptr)
    before = np.zeros(terms.size, np.int64)  # per merged term: the older's postings
    before[old_at] = old_len
    per_term = before.copy()
    per_term[new_at] += new_len
    ptr = np.zeros(terms.size + 1, np.int64)
    np.cumsum(per_term, out=ptr[1:])
    rows = np.empty(int(ptr[-1]), np.uint16)
    tf = np.empty(int(ptr[-1]), np.uint8)
    for seg, first, lens, offset in ((older, ptr[old_at], old_len, 0),
                                     (newer, ptr[new_at] + before[new_at], new_len, older.n)):
        assert seg.rows is not None and seg.ptr is not None
        # Posting i of the segment's j-th term lands at first[j] + (i - seg.ptr[j]).
        to = np.arange(seg.rows.size) + np.repeat(first - seg.ptr[:-1], lens)
        rows[to] = seg.rows + np.uint16(offset)  # n <= SEGMENT_ROWS: local rows fit 16 bits
        tf[to] = seg.tf
    return Segment(older.start, n, terms=terms.astype(np.int32), ptr=ptr, rows=rows, tf=tf)


@dataclass(frozen=True, slots=True)
class NewRows:
    """Retrieval rows read by a catch-up, in store order: per row, then their postings."""

    seq: np.ndarray  # int64
    user: np.ndarray  # int32
    conv: np.ndarray  # int32
    at: np.ndarray  # int64: when the row's message was said, in whole epoch seconds
    length: np.ndarray  # int32
    row_len: np.ndarray  # int64: postings per row
    terms: np.ndarray  # int32, each row's ascending
    tf: np.ndarray  # uint8
    vec: np.ndarray  # int8, a row of vectors.DIMS per row


# The rows past a cursor as one result row (half the time of a tuple a row); the aggregates read
# the subquery's rows in its order, and read_rows checks that seq ascends. PostgreSQL's come in
# binary (integers in their send form), a third of the text form's time: docs/tuning.md.
_NEW_ROWS = SQL(
    "SELECT count(*), group_concat(seq), group_concat(user_id), group_concat(conversation_id),"
    " group_concat(length), group_concat(at), group_concat(length(counts)),"
    " CAST(group_concat(terms, '') AS BLOB), CAST(group_concat(counts, '') AS BLOB),"
    " CAST(group_concat(vec, '') AS BLOB)"
    " FROM (SELECT * FROM retrieval WHERE seq > ? ORDER BY seq LIMIT ?)",
    "SELECT count(*), " + ", ".join(
        f"string_agg(int8send({c}), '')"
        for c in ("seq", "user_id", "conversation_id", "length", "at"))
    + ", string_agg(int4send(length(counts)), ''), string_agg(terms, ''), string_agg(counts, ''),"
    " string_agg(vec, '') FROM (SELECT * FROM retrieval WHERE seq > %s ORDER BY seq LIMIT %s) r")


def _fetch(db: Database, conn: Sql, after: int,
           limit: int) -> tuple[int, list[np.ndarray], bytes, bytes, bytes]:
    """The rows past `after` as (count, [seq, user, conv, length, at, row_len] as int64,
    terms, counts, vectors)."""
    if db.postgres:
        cursor = conn.raw.cursor(binary=True)  # type: ignore[attr-defined]  # PgConnection's
        cursor.execute(_NEW_ROWS.postgres, (after, limit))
        count, *ints, row_len, terms, counts, vecs = cursor.fetchone()
        if count == 0:
            return 0, [], b"", b"", b""
        return count, [*(np.frombuffer(x, ">i8").astype(np.int64) for x in ints),
                       np.frombuffer(row_len, ">i4").astype(np.int64)], terms, counts, vecs
    count, *ints, terms, counts, vecs = conn.execute(_NEW_ROWS.sqlite, (after, limit)).fetchone()
    if count == 0:
        return 0, [], b"", b"", b""
    return count, [np.fromstring(x, np.int64, sep=",") for x in ints], terms, counts, vecs


def read_rows(db: Database, conn: Sql, after: int, limit: int) -> NewRows | None:
    """At most `limit` retrieval rows past seq `after`, or None if there are none."""
    count, columns, terms, counts, vecs = _fetch(db, conn, after, limit)
    if count == 0:
        return None
    seq, user, conv, length, at, row_len = columns
    rows = NewRows(seq, user.astype(np.int32), conv.astype(np.int32), at, length.astype(np.int32),
                   row_len, np.frombuffer(terms, "<i4"), np.frombuffer(counts, np.uint8),
                   vectors.matrix(vecs or b"", count))
    if (seq.size != count or rows.at.size != count or (np.diff(seq) <= 0).any()
            or rows.tf.size != rows.terms.size or rows.tf.size != int(row_len.sum())):
        raise AssertionError("retrieval rows read out of order or cut")
    return rows


# The dictionary version and flip count the rows were derived under (a flip changes it).
_VERSION = SQL("SELECT group_concat(value) FROM (SELECT value FROM setting"
               " WHERE key IN ('dictionary', 'flips') ORDER BY key) v",
               "SELECT string_agg(value, ',') FROM (SELECT value FROM setting"
               " WHERE key IN ('dictionary', 'flips') ORDER BY key) v")
# Anything new since the last catch-up? One statement (see Arena.catch_up).
_NEWS = SQL(*(f"SELECT ({version}), (SELECT coalesce(max(seq), 0) FROM retrieval),"
              " (SELECT coalesce(max(seq), 0) FROM retrieval_gone),"
              " (SELECT EXISTS (SELECT 1 FROM retrieval_pending))" for version in _VERSION))
_GONE = SQL.both("SELECT seq, row_seq, length, terms FROM retrieval_gone WHERE seq > ?"
                 " ORDER BY seq")

# The arena's per-row columns and their types (see Arena).
COLUMNS = {"seq": np.int64, "user": np.int32, "conv": np.int32, "at": np.int64,
            "length": np.int32, "prev": np.int32, "next": np.int32, "inv": np.float64}


class Arena:
    """The in-memory copy of every retrieval row of the store, for many users at once: written
    by one catch-up at a time, read through the `View` each catch-up publishes.

    Per row: seq (int64), user and conversation (int32, user -1 once deleted), when it was said
    (int64 seconds), length and the previous and next row of its conversation (int32), its
    vector (vectors.DIMS int8) and that vector's inverse norm (float64): 296 bytes.
    Per posting 3 bytes (term-major) or 5 bytes (row-major). Document frequencies in a
    `Frequencies`. The attributes seq ... next are the writer's: views of every row so far.
    """

    def __init__(self, db: Database, layout: str = TERMS, threads: int | None = None) -> None:
        """`db`: the store's database, which each catch-up reads."""
        if layout not in (TERMS, ROWS):
            raise ValueError(f"unknown arena layout {layout!r}")
        self.db = db
        self.layout = layout
        self.threads = threads or min(4, os.cpu_count() or 1)
        self.segments: list[Segment] = []
        # Per-row columns live in buffers that double when full, and the attributes below are
        # views of their first rows: a catch-up appends its few rows in place instead of
        # copying every column (measured before: 13.5 ms a catch-up at 1M rows, 37.5 at 5M).
        self._buffers: dict[str, np.ndarray] = {
            name: np.full(1, -1, dtype) for name, dtype in COLUMNS.items()}
        self._buffers["vec"] = np.zeros((1, vectors.DIMS), np.int8)
        self.seq = self.user = self.conv = self.at = self.length = np.zeros(0, np.int64)
        self.inv = np.zeros(0)
        self.vec = np.zeros((0, vectors.DIMS), np.int8)
        # The previous and next live row of the same conversation in store order (-1: none).
        self.prev = self.next = np.zeros(0, np.int32)
        self._grow(0)
        self._tail: dict[int, int] = {}  # conversation -> its last live row
        self.df: Frequencies | None = None
        self.n_rows = 0  # live rows
        self.total_length = 0
        self.row_cursor = 0  # last retrieval.seq read
        self.gone_cursor = 0  # last retrieval_gone.seq read
        self.version: str | None = None  # the dictionary version and flip count of the rows
        self._flipped = False  # rows of two dictionary versions were read
        self._pool = (ThreadPoolExecutor(self.threads, thread_name_prefix="scan")
                      if self.threads > 1 else None)
        self.view = self.publish()

    def stale(self) -> bool:
        """Time to build a fresh arena: a flip re-derived the rows under another dictionary
        (its term ids mean other words), or dead rows (purged, re-derived; they stay in place,
        invisible) outnumber the live ones, so a rebuild costs less than the rows it frees."""
        dead = self.seq.size - self.n_rows
        return self._flipped or dead > max(self.n_rows, 1024)

    def publish(self) -> View:
        """The arena as it is now, for readers, and kept as `view` (one attribute store: a
        reader reads the old view or the new one, whole)."""
        self.view = View(self.seq.size, self.seq, self.user, self.conv, self.at, self.length,
                         self.vec, self.inv,
                         self._buffers["prev"], self._buffers["next"], tuple(self.segments),
                         self.df, self.n_rows,
                         self.total_length, self.row_cursor, self.gone_cursor, self._pool)
        return self.view

    # -- catch-up ------------------------------------------------------------------------

    def catch_up(self) -> int:
        """Read what was stored or deleted since the last catch-up and publish a new view;
        returns rows read. One caller at a time (the scanner's lock); readers need none."""
        db = self.db
        if self.version is not None:
            # Nothing new, the usual case before a search: one statement, not a snapshot's
            # five round trips (PostgreSQL over TCP: measured 1.2 ms a search against 0.75 on
            # SQLite at 10k rows, most of it here). A row not yet committed is not seen here,
            # and it is read by the next catch-up.
            with failing_as("catch up on memory"):
                now = db.connection().execute(db.pick(_NEWS)).fetchone()
            if not now[3] and now[:3] == (self.version, min(now[1], self.row_cursor),
                                          min(now[2], self.gone_cursor)):
                return 0
            # PostgreSQL: rows other processes stored are given their seqs first (a write,
            # index.sequence), so that what this catch-up reads is every committed row.
            if now[3]:
                order_pending(db)
        else:
            sequence(db)
        with db.snapshot("catch up on memory") as conn:  # one snapshot: rows and deletions agree
            # A flip (maintenance.flip) re-writes every row without logging their deletions,
            # and counts itself: a count read here that moved means rebuild.
            version = conn.execute(db.pick(_VERSION)).fetchone()[0]
            self._flipped |= self.version is not None and version != self.version
            self.version = version
            new = []
            cursor = self.row_cursor
            while (rows := read_rows(db, conn, cursor, SEGMENT_ROWS)) is not None:
                new.append(rows)
                cursor = int(rows.seq[-1])
                if rows.seq.size < SEGMENT_ROWS:  # the snapshot holds no more: not asked again
                    break
            gone = conn.execute(db.pick(_GONE), (self.gone_cursor,)).fetchall()
        if self.df is None:
            self.df = Frequencies(db.dictionary.hash_base)
        for rows in new:
            self._append(rows)
        if gone:
            self._forget(gone)
        if new or gone:
            self.publish()
        return sum(rows.seq.size for rows in new)

    def _grow(self, n: int) -> None:
        """Make the columns `n` rows long (capacity doubling: each row is copied O(1) times
        on average), their new rows still to be written. A view keeps the buffers it was
        published with: rows are written only past every view's end, in place or in the new
        buffers."""
        cap = self._buffers["seq"].size - 1  # the last slot is never a row's
        if n > cap:
            cap = max(n, 2 * cap, 1024)
            for name, old in self._buffers.items():
                buf = np.empty((cap + 1, *old.shape[1:]), old.dtype)
                buf[:old.shape[0] - 1] = old[:-1]
                buf[cap] = -1  # a link of -1 (none) reads this: none follows itself
                self._buffers[name] = buf
        self._views(n)

    def _views(self, n: int) -> None:
        b = self._buffers
        self.seq, self.user, self.conv = b["seq"][:n], b["user"][:n], b["conv"][:n]
        self.at, self.length = b["at"][:n], b["length"][:n]
        self.prev, self.next = b["prev"][:n], b["next"][:n]
        self.vec, self.inv = b["vec"][:n], b["inv"][:n]

    def put_rows(self, seq: np.ndarray, user: np.ndarray, conv: np.ndarray, at: np.ndarray,
                 length: np.ndarray, vec: np.ndarray) -> None:
        """Append rows' columns and vectors and chain them into their conversations."""
        start = self.seq.size
        self._grow(start + seq.size)
        self.seq[start:], self.user[start:], self.conv[start:] = seq, user, conv
        self.at[start:], self.length[start:] = at, length
        self.vec[start:], self.inv[start:] = vec, vectors.norms(vec)
        self._link(seq.size)

    def _append(self, new: NewRows) -> None:
        """Add at most SEGMENT_ROWS rows as one new segment."""
        start = self.seq.size
        self.put_rows(new.seq, new.user, new.conv, new.at, new.length, new.vec)
        self.n_rows += new.seq.size
        self.total_length += int(new.length.sum(dtype=np.int64))
        self.row_cursor = int(new.seq[-1])
        seg = build_segment(start, new.row_len, new.terms, new.tf, self.layout)
        assert self.df is not None  # catch_up made it
        if seg.terms is not None and seg.ptr is not None:  # its postings per term are the rows holding it: no count
            self.df = self.df.plus(seg.terms, np.diff(seg.ptr))
        else:
            self.df = self.df.rows(new.terms)
        # Then the two last segments merge while the older is at most twice the newer and both
        # fit in one. Sizes stay geometric, like the digits of a binary counter: a row is moved
        # O(log) times in all, a catch-up of a few rows moves a few rows, and at most ~16
        # segments are not full. A merge makes a new segment: a view keeps the ones it had.
        segs = self.segments
        segs.append(seg)
        while (len(segs) >= 2 and segs[-2].n <= 2 * segs[-1].n
               and segs[-2].n + segs[-1].n <= SEGMENT_ROWS):
            newer = segs.pop()
            older = segs.pop()
            segs.append(merge_segments(older, newer))

    def _forget(self, gone: list[tuple]) -> None:
        self.gone_cursor = int(gone[-1][0])
        row_seq = np.asarray([g[1] for g in gone], np.int64)
        idx = np.searchsorted(self.seq, row_seq)
        ok = idx < self.seq.size
        ok[ok] = self.seq[idx[ok]] == row_seq[ok]
        ok[ok] = self.user[idx[ok]] >= 0  # rows deleted before we read them were never counted
        if not ok.any():
            return
        dead = [g for g, k in zip(gone, ok.tolist(), strict=True) if k]
        assert self.df is not None  # catch_up made it
        self.df = self.df.rows(np.frombuffer(b"".join(g[3] for g in dead), "<i4"), -1)
        self.n_rows -= len(dead)
        self.total_length -= sum(int(g[2]) for g in dead)
        # Deleting changes rows that views read, so the three columns it changes are copied
        # first (O(rows), 12 bytes a row: only a catch-up that brings deletions, i.e. after a
        # purge or a cascade from an item deleted; appends never pay it).
        for name in ("user", "prev", "next"):
            self._buffers[name] = self._buffers[name].copy()
        self._views(self.seq.size)
        # The postings stay; a dead row is invisible to every query (user -1) and leaves its
        # conversation's chain, so it is nobody's context either.
        for r in idx[ok].tolist():
            p, n = int(self.prev[r]), int(self.next[r])
            if p >= 0:
                self.next[p] = n
            if n >= 0:
                self.prev[n] = p
            if self._tail.get(int(self.conv[r])) == r:
                self._tail[int(self.conv[r])] = p
            self.prev[r] = self.next[r] = -1
        self.user[idx[ok]] = -1

    def _link(self, count: int) -> None:
        """Chain the last `count` rows into their conversations, in store order. The one
        write below an older view's end: a conversation's last row gets its next, a row past
        that view's end, which the view reads as none (View.step)."""
        start = self.seq.size - count
        conv = self.conv[start:]
        order = np.argsort(conv, kind="stable")  # by conversation, store order inside
        rows = (start + order).astype(np.int32)
        c = conv[order]
        first = np.concatenate(([True], c[1:] != c[:-1])) if count else np.zeros(0, bool)
        prev = np.empty(count, np.int32)
        prev[1:] = rows[:-1]
        nxt = np.empty(count, np.int32)
        nxt[:-1] = rows[1:]
        last = np.concatenate((first[1:], [True])) if count else np.zeros(0, bool)
        nxt[last] = -1
        for j in np.flatnonzero(first).tolist():  # one per conversation in this batch
            tail = self._tail.get(int(c[j]), -1)
            prev[j] = tail
            if tail >= 0:
                self.next[tail] = rows[j]
        for j in np.flatnonzero(last).tolist():
            self._tail[int(c[j])] = int(rows[j])
        self.prev[rows] = prev
        self.next[rows] = nxt

    def nbytes(self) -> int:
        rows = (self.seq.nbytes + self.user.nbytes + self.conv.nbytes + self.at.nbytes
                + self.length.nbytes + self.prev.nbytes + self.next.nbytes + self.vec.nbytes
                + self.inv.nbytes)
        return rows + sum(s.nbytes() for s in self.segments) + (
            self.df.nbytes() if self.df is not None else 0)
