"""The exact scan: a BM25-family score for every visible retrieval row, for every query.

There is no approximate index between a question and the memory: every stored row gets its
exact score (rows holding none of the query's terms score exactly zero and are not hits).

Write side. `derive_retrieval` runs inside each message's transaction (the store registers it
on every Store): one retrieval row per item that is memory, not harness context (term ids and
counts as little-endian blobs, length, dictionary version), which is also its own increment of
the pooled counts BM25 needs (rows, total length, and document frequency per term): these are
folded into retrieval_total and retrieval_term every FOLD_EVERY rows, and readers add the rows
stored since (`totals`, `unfolded_df`). Deleted retrieval rows are logged by a trigger; the
writer settles them (takes their counts back out: `purge` deletes and settles in one
transaction, `Store.flush` settles what was deleted behind its back) and readers take out the
unsettled ones themselves, so no reader ever writes. A new dictionary is re-derived and
flipped in by maintenance.py.

Read side. A `Scanner` answers `search`. A small memory is scored straight from the store; a
larger one is held in the serving process as an `Arena`: numpy arrays in segments of at most
65,536 rows, so a row's index inside its segment fits 16 bits. Before every scan the arena
catches up on the rows (and deletions) stored since its last catch-up, appending a new segment
and merging only small tail segments, never rebuilding the whole. Segments are scored on worker
threads into one vector, deterministically: every row's score is summed over the query's terms
in ascending term id, in float64, whatever the layout, segmentation or thread count, the
context terms are added in a fixed order, and ties are broken by store order (seq), so a query
always gets the same ranking.

Two layouts give the same scores. Term-major (postings per term: local row uint16, tf uint8,
3 bytes a posting) reads only the postings of the query's terms; row-major (term ids per row:
int32 + uint8) reads every posting. scripts/bench_retrieval.py measures both; term-major is
the default, faster at every size: p50 per query (200 LoCoMo and BEAM questions, one thread,
2-core machine) 0.39 ms against 1.6 ms at 1M tokens, 1.1 against 21 ms at 10M, 1.2 against
42 ms at 20M, and 3.5 against 173 ms (91 ms on two threads) at 80M tokens pooled across 500
users; it also takes 0.74 bytes of RAM a stored token against 1.15.

The score. BM25 (Robertson et al., Okapi at TREC-3, 1994, with Lucene's non-negative idf):
    bm25(q, d) = sum over distinct terms t of q, ascending id:
                 qtf(t) * idf(t) * (k1 + 1) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
plus conversational context, the BM25 of the rows around d in its conversation:
    score(q, d) = bm25(q, d) + sum_i before[i] * bm25(q, prev_i(d))
                             + sum_i after[i] * bm25(q, next_i(d))
(see Params). N, df and avgdl are pooled over every live row of the database, whichever user
asks: one shared statistic, so a row's score does not depend on who else is visible. Heat,
recency and anything else that is not relevance stay out of it.

Measured on LoCoMo and left out (scripts/eval_retrieval.py): rare-term weighting (idf ** 1.5 or
** 2) and a phrase bonus over adjacent word pairs each move recall by about a point at most,
against an index twice the size for the phrase bonus; the speaker's name in the row text
(the LoCoMo importer's choice, as a transcript shows it) is worth 3 to 7 points.

No shortlist. The term-major pass already reads only what can make a score non-zero (the
postings of the query's terms, then the rows within context reach of a hit), so a cheaper
first pass would read the same postings again; the benchmark's 82M-token pool stays well
inside its latency budget without one.

Visibility is a rule: a user sees only their own rows; with `share_pool` every row is visible
and the asking user's own rows rank before everyone else's. Exclusions (item ids) drop rows
without changing anyone's score.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import dictionary
from .conversation import Kind, without_scaffold
from .store import Item, Store, StoredMessage, db, failing_as, live_dictionary, snapshot, writing

SEGMENT_ROWS = 1 << 16  # local row ids are uint16
TERMS = "terms"  # term-major layout (shipped)
ROWS = "rows"  # row-major layout (measured for comparison)


@dataclass(frozen=True, slots=True)
class Params:
    """The score's parameters.

    k1 and b are BM25's (Robertson & Zaragoza 2009 suggest k1 in 1.2-2.0, b = 0.75); on LoCoMo
    a lower k1 = 0.9 and b = 0.4 rank evidence higher (recall@5 0.61 against 0.58 with the
    context below, the same within token budgets), conversation turns being short and their
    lengths telling little about relevance. `before` and `after` weigh the
    conversational context: a row also earns these fractions of the BM25 score of the 1st,
    2nd, 3rd row before (after) it in its conversation. In a dialogue the evidence is often the
    answer to the turn that shares the question's words, or the turn that announced the topic;
    on LoCoMo this context lifts recall_all within 2k tokens from 0.68 to about 0.78 (see the
    evaluation). It is still relevance to the query only: it mixes scores, never recency.
    """

    k1: float = 0.9
    b: float = 0.4
    before: tuple[float, ...] = (0.5, 0.3, 0.2)
    after: tuple[float, ...] = (0.3, 0.2, 0.1)
    # Rare-term weighting, idf ** idf_power: 1.5 or 2 moved LoCoMo recall by half a point at
    # most, inside what tuning on one dataset can fake, so it stays off.
    idf_power: float = 1.0


@dataclass(frozen=True, slots=True)
class Hit:
    item_id: int
    message_id: int
    user_id: int
    conversation_id: int
    role: str
    at: float
    score: float
    text: str
    seq: int = 0  # the retrieval row's store order, the tie-break
    tokens: int = 0


# --------------------------------------------------------------------------- write side


def token_estimate(text: str) -> int:
    """Model tokens of a text, by the usual rule of four characters a token."""
    return (len(text) + 3) // 4


def item_text(kind: str, name: str, text: str) -> str:
    """What a row is retrieved by: a tool call is found by its tool's name as well; the
    reminders a harness appends to a tool result are not."""
    text = without_scaffold(text)
    return f"{name} {text}" if name else text


# The pooled counts are folded in every FOLD_EVERY rows, inside the transaction of the message
# that crosses the mark: each row is its own count increment, and upserting a batch's distinct
# terms once costs a fraction of upserting every row's terms (a 600-word turn holds ~150
# distinct terms; a batch shares most of them). Measured on LoCoMo's 5,882 messages through the
# write path: updating the totals with every message cost 25 us of its ~290, folding every 256
# rows 15 us, every 4,096 rows 3 us. Only the small-memory path (store_rows) reads the
# unfolded rows, and it reads every row anyway.
FOLD_EVERY = 4096


_CONTEXT = Kind.CONTEXT.value


def derive_retrieval(items: list[Item]) -> None:
    """Write the retrieval rows and counts of a message's items (inside its transaction)."""
    if not items:
        return
    conn = db.connection()
    d = live_dictionary(conn)  # inside the write lock: a flip elsewhere is seen here
    m = items[0].message
    seq = 0
    for it in items:
        if it.kind == _CONTEXT:  # harness text is stored with its message, never retrieved
            continue
        text = item_text(it.kind, it.name, it.text)
        bag = d.bag(text)
        n_tokens = token_estimate(text)
        seq = conn.execute(
            "INSERT INTO retrieval (item_id, message_id, user_id, conversation_id, at, length,"
            " tokens, version, terms, counts) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (it.id, m.id, m.user_id, m.conversation_id, int(m.at), bag.length, n_tokens, d.version,
             bag.terms.astype("<i4", copy=False).tobytes(), bag.counts.tobytes())).lastrowid
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    if seq - folded >= FOLD_EVERY:
        fold(conn)


_UPSERT_DF = ("INSERT INTO retrieval_term (term, df) VALUES (?, ?)"
              " ON CONFLICT(term) DO UPDATE SET df = df + excluded.df")


def _count(conn, terms: np.ndarray, sign: int) -> None:  # noqa: ANN001 - a sqlite3 connection
    """Add (or take back) one to the document frequency of each occurrence in `terms`."""
    if terms.size == 0:
        return
    t, n = np.unique(terms, return_counts=True)
    conn.executemany(_UPSERT_DF, zip(t.tolist(), (n * sign).tolist(), strict=True))


def fold(conn) -> None:  # noqa: ANN001 - a sqlite3 connection, inside a transaction
    """Add the rows stored since the last fold to the pooled counts."""
    # Deletions first: a row deleted before this fold was never counted, and settling it
    # after the cursor passed its seq would take it out all the same.
    settle_in(conn)
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    rows = conn.execute("SELECT seq, length, tokens, terms FROM retrieval WHERE seq > ?"
                        " ORDER BY seq", (folded,)).fetchall()
    if not rows:
        return
    _count(conn, np.frombuffer(b"".join(r[3] for r in rows), "<i4"), +1)
    conn.execute("UPDATE retrieval_total SET rows = rows + ?, length = length + ?,"
                 " tokens = tokens + ?, folded_seq = ? WHERE id = 1",
                 (len(rows), sum(r[1] for r in rows), sum(r[2] for r in rows), rows[-1][0]))


# Deletions the writer has not settled yet, of rows already in the folded counts: every reader
# takes them back out itself (only the writer settles, see Store.flush and fold).
_UNSETTLED = ("FROM retrieval_gone g, retrieval_total t WHERE g.settled = 0"
              " AND g.row_seq <= t.folded_seq")


def totals(conn) -> tuple[int, int, int]:  # noqa: ANN001 - a sqlite3 connection
    """Live rows, their total length and tokens: the folded counts plus the rows stored since,
    less the deletions not settled yet."""
    rows, length, tokens = conn.execute(
        "SELECT t.rows + count(r.seq), t.length + coalesce(sum(r.length), 0),"
        " t.tokens + coalesce(sum(r.tokens), 0) FROM retrieval_total t"
        " LEFT JOIN retrieval r ON r.seq > t.folded_seq WHERE t.id = 1").fetchone()
    gone = conn.execute("SELECT count(*), coalesce(sum(g.length), 0), coalesce(sum(g.tokens), 0) "
                        + _UNSETTLED).fetchone()
    return rows - gone[0], length - gone[1], tokens - gone[2]


def unfolded_df(conn, terms: np.ndarray) -> np.ndarray:  # noqa: ANN001
    """Document frequency of `terms` (ascending): folded counts plus rows not folded yet, less
    unsettled deletions of folded rows."""
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    got = dict(conn.execute(
        f"SELECT term, df FROM retrieval_term WHERE term IN ({','.join('?' * terms.size)})",
        terms.tolist()).fetchall())
    df = np.asarray([got.get(t, 0) for t in terms.tolist()], np.int64)
    recent = conn.execute("SELECT terms FROM retrieval WHERE seq > ?", (folded,)).fetchall()
    gone = conn.execute("SELECT g.terms " + _UNSETTLED).fetchall()
    for blobs, sign in ((recent, 1), (gone, -1)):
        if blobs:
            t = np.frombuffer(b"".join(r[0] for r in blobs), "<i4")
            u, c = np.unique(t[np.isin(t, terms)], return_counts=True)
            df[np.searchsorted(terms, u)] += sign * c
    return df


def settle(store: Store) -> int:
    """Take the counts of deleted retrieval rows back out; returns how many were settled.
    The store's writer calls this (or settle_in inside its own write)."""
    with writing("settle deletions") as conn:
        return settle_in(conn)


def settle_in(conn) -> int:  # noqa: ANN001 - a sqlite3 connection, inside a transaction
    gone = conn.execute(
        "SELECT seq, length, tokens, terms, row_seq FROM retrieval_gone WHERE settled = 0"
    ).fetchall()
    if not gone:
        return 0
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    # Only rows already folded are in the counts; a later fold will not see the others.
    counted = [g for g in gone if g[4] <= folded]
    if counted:
        terms = np.frombuffer(b"".join(g[3] for g in counted), "<i4")
        _count(conn, terms, -1)
        conn.executemany("DELETE FROM retrieval_term WHERE term = ? AND df <= 0",
                         [(t,) for t in np.unique(terms).tolist()])
        conn.execute("UPDATE retrieval_total SET rows = rows - ?, length = length - ?,"
                     " tokens = tokens - ? WHERE id = 1",
                     (len(counted), sum(g[1] for g in counted), sum(g[2] for g in counted)))
    conn.executemany("UPDATE retrieval_gone SET settled = 1 WHERE seq = ?",
                     [(g[0],) for g in gone])
    return len(gone)


def purge(store: Store, item_ids: Iterable[int]) -> int:
    """Delete items (and their retrieval rows, counts and activations) in one transaction."""
    ids = [(int(i),) for i in item_ids]
    with writing("purge rows") as conn:
        conn.executemany("DELETE FROM item WHERE id = ?", ids)  # cascades
        conn.executemany("DELETE FROM activation WHERE item_id = ?", ids)  # keyed, not linked
        settle_in(conn)
    return len(ids)


def items_by_message(item_ids: list[int]) -> list[list[Item]]:
    """The items with these ids (their messages joined, as derive_retrieval reads them),
    grouped by message."""
    by_message: dict[int, list[Item]] = {}
    for i in range(0, len(item_ids), 500):
        for it in (Item.select(Item, StoredMessage).join(StoredMessage)
                   .where(Item.id.in_(item_ids[i:i + 500])).order_by(Item.id)):
            by_message.setdefault(it.message_id, []).append(it)
    return list(by_message.values())


# --------------------------------------------------------------------------- the score


def idf(n_rows: int, df: np.ndarray) -> np.ndarray:
    """Okapi idf with Lucene's +1 inside the log, so no term ever weighs below zero."""
    df = df.astype(np.float64)
    return np.log1p((n_rows - df + 0.5) / (df + 0.5))


@dataclass(slots=True)
class Query:
    """A query resolved against the pooled statistic: distinct terms ascending, their weights."""

    terms: np.ndarray  # int32, ascending
    weights: np.ndarray  # float64: qtf * idf * (k1 + 1)
    a: float  # k1 * (1 - b)
    c: float  # k1 * b / avgdl
    before: tuple[float, ...] = ()
    after: tuple[float, ...] = ()

    @property
    def empty(self) -> bool:
        return self.terms.size == 0


def make_query(text: str, df_of: Callable[[np.ndarray], np.ndarray], n_rows: int,
               total_length: int, params: Params) -> Query:
    """`df_of(terms) -> df array` reads the pooled document frequencies."""
    ids = dictionary.load().ids(text)
    terms, qtf = np.unique(ids, return_counts=True)
    if n_rows == 0 or terms.size == 0:
        return Query(np.zeros(0, np.int32), np.zeros(0), 0.0, 0.0)
    k1, b = params.k1, params.b
    df = np.asarray(df_of(terms), dtype=np.int64)
    keep = df > 0  # a term no row holds scores every row zero
    terms, qtf, df = terms[keep].astype(np.int32), qtf[keep], df[keep]
    avgdl = max(total_length / n_rows, 1e-9)
    w = idf(n_rows, df)
    if params.idf_power != 1.0:
        w = w ** params.idf_power
    return Query(terms, qtf * w * (k1 + 1), k1 * (1 - b), k1 * b / avgdl,
                 params.before, params.after)


def contributions(q: Query, slot: np.ndarray, tf: np.ndarray, length: np.ndarray) -> np.ndarray:
    """w * tf / (tf + a + c * |d|) per posting, in float64 (the reference uses the same order)."""
    tf = tf.astype(np.float64)
    return q.weights[slot] * tf / (tf + (q.a + q.c * length))


# --------------------------------------------------------------------------- the arena


class Frequencies:
    """Document frequency per term id: a dense int32 array over the vocabulary's ids, a dict
    over the hashed ids above it (a dense table of all 2**22 hash buckets would cost 16 MB
    however small the memory; only the buckets in use cost here)."""

    def __init__(self, hash_base: int) -> None:
        self.hash_base = hash_base
        self.dense = np.zeros(hash_base, np.int32)
        self.hashed: dict[int, int] = {}

    def add(self, terms: np.ndarray, sign: int = 1) -> None:
        """Count (sign 1) or uncount (sign -1) one row for each occurrence in `terms`."""
        u, c = np.unique(terms, return_counts=True)
        self.add_counts(u, sign * c)

    def add_counts(self, terms: np.ndarray, counts: np.ndarray) -> None:
        """Add `counts` rows to the frequency of each of `terms` (distinct)."""
        v = terms < self.hash_base
        self.dense[terms[v]] += counts[v].astype(np.int32)
        h = self.hashed
        for t, n in zip(terms[~v].tolist(), counts[~v].tolist(), strict=True):
            left = h.get(t, 0) + n
            if left:
                h[t] = left
            else:
                h.pop(t, None)

    def get(self, terms: np.ndarray) -> np.ndarray:
        v = terms < self.hash_base
        out = np.zeros(terms.size, np.int64)
        out[v] = self.dense[terms[v]]
        out[~v] = [self.hashed.get(t, 0) for t in terms[~v].tolist()]
        return out

    def nbytes(self) -> int:
        # A dict entry with its two small ints costs about 100 bytes in CPython.
        return self.dense.nbytes + 100 * len(self.hashed)



@dataclass(slots=True)
class Segment:
    """Rows [start, start + n) of the arena, in one of the two layouts."""

    start: int
    n: int
    # term-major: distinct terms ascending, their postings' extent, postings (local row, tf)
    terms: np.ndarray | None = None
    ptr: np.ndarray | None = None
    rows: np.ndarray | None = None
    # row-major: each row's extent, its terms (int32) in ascending id
    row_ptr: np.ndarray | None = None
    row_terms: np.ndarray | None = None
    tf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.terms, self.ptr, self.rows, self.row_ptr,
                                      self.row_terms, self.tf) if a is not None)


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
        return Segment(older.start, n,
                       row_ptr=np.concatenate((older.row_ptr,
                                               newer.row_ptr[1:] + older.row_ptr[-1])),
                       row_terms=np.concatenate((older.row_terms, newer.row_terms)),
                       tf=np.concatenate((older.tf, newer.tf)))
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


# The rows past a cursor as one result row: SQLite concatenates the blobs and lists the integers
# in one pass, where a Python tuple per row cost twice as long (10k rows: ~9 ms against ~19).
# The aggregates read the subquery's rows in its order; read_rows checks that seq ascends.
_NEW_ROWS = (
    "SELECT count(*), group_concat(seq), group_concat(user_id), group_concat(conversation_id),"
    " group_concat(length), group_concat(at), group_concat(length(counts)),"
    " CAST(group_concat(terms, '') AS BLOB), CAST(group_concat(counts, '') AS BLOB)"
    " FROM (SELECT * FROM retrieval WHERE seq > ? ORDER BY seq LIMIT ?)")


def read_rows(conn, after: int, limit: int) -> NewRows | None:  # noqa: ANN001 - sqlite3
    """At most `limit` retrieval rows past seq `after`, or None if there are none."""
    count, *ints, at, row_len, terms, counts = conn.execute(_NEW_ROWS, (after, limit)).fetchone()
    if count == 0:
        return None
    seq, user, conv, length, at, row_len = (np.fromstring(x, np.int64, sep=",")
                                             for x in (*ints, at, row_len))
    rows = NewRows(seq, user.astype(np.int32), conv.astype(np.int32), at, length.astype(np.int32),
                   row_len, np.frombuffer(terms, "<i4"), np.frombuffer(counts, np.uint8))
    if (seq.size != count or rows.at.size != count or (np.diff(seq) <= 0).any()
            or rows.tf.size != rows.terms.size or rows.tf.size != int(row_len.sum())):
        raise AssertionError("retrieval rows read out of order or cut")
    return rows


# The arena's per-row columns and their types (see Arena).
_COLUMNS = {"seq": np.int64, "user": np.int32, "conv": np.int32, "at": np.int64,
            "length": np.int32, "prev": np.int32, "next": np.int32}


class Arena:
    """The in-memory copy of every retrieval row of the store, for many users at once.

    Per row: seq (int64), user and conversation (int32, user -1 once deleted), when it was said
    (int64 seconds), length and the previous and next row of its conversation (int32): 32 bytes.
    Per posting 3 bytes (term-major) or 5 bytes (row-major). Document frequencies in a
    `Frequencies`.
    """

    def __init__(self, layout: str = TERMS, threads: int | None = None) -> None:
        if layout not in (TERMS, ROWS):
            raise ValueError(f"unknown arena layout {layout!r}")
        self.layout = layout
        self.threads = threads or min(4, os.cpu_count() or 1)
        self.segments: list[Segment] = []
        # Per-row columns live in buffers that double when full, and the attributes below are
        # views of their first rows: a catch-up appends its few rows in place instead of
        # copying every column (measured before: 13.5 ms a catch-up at 1M rows, 37.5 at 5M).
        self._buffers: dict[str, np.ndarray] = {
            name: np.zeros(1, dtype) for name, dtype in _COLUMNS.items()}
        self.seq = self.user = self.conv = self.at = self.length = np.zeros(0, np.int64)
        # The previous and next live row of the same conversation in store order (-1: none).
        # One extra last entry, -1, makes "none" follow itself: links[-1] == -1.
        self.prev = self.next = np.full(1, -1, np.int32)
        self._grow(0)
        self._tail: dict[int, int] = {}  # conversation -> its last live row
        self.df: Frequencies | None = None
        self.n_rows = 0  # live rows
        self.total_length = 0
        self.row_cursor = 0  # last retrieval.seq read
        self.gone_cursor = 0  # last retrieval_gone.seq read
        self.version: str | None = None  # the dictionary version and flip count of the rows
        self._flipped = False  # rows of two dictionary versions were read
        self._pool: ThreadPoolExecutor | None = None

    def stale(self) -> bool:
        """Time to build a fresh arena: a flip re-derived the rows under another dictionary
        (its term ids mean other words), or dead rows (purged, re-derived; they stay in place,
        invisible) outnumber the live ones, so a rebuild costs less than the rows it frees."""
        dead = self.seq.size - self.n_rows
        return self._flipped or dead > max(self.n_rows, 1024)

    # -- catch-up ------------------------------------------------------------------------

    def catch_up(self) -> int:
        """Read what was stored or deleted since the last catch-up; returns rows read."""
        with snapshot("catch up on memory") as conn:  # one snapshot: rows and deletions agree
            # A flip (maintenance.flip) re-writes every row without logging their deletions,
            # and counts itself: a count read here that moved means rebuild.
            version = conn.execute("SELECT group_concat(value) FROM (SELECT value FROM setting"
                                   " WHERE key IN ('dictionary', 'flips') ORDER BY key)"
                                   ).fetchone()[0]
            self._flipped |= self.version is not None and version != self.version
            self.version = version
            new = []
            cursor = self.row_cursor
            while (rows := read_rows(conn, cursor, SEGMENT_ROWS)) is not None:
                new.append(rows)
                cursor = int(rows.seq[-1])
            gone = conn.execute(
                "SELECT seq, row_seq, length, terms FROM retrieval_gone WHERE seq > ?"
                " ORDER BY seq", (self.gone_cursor,)).fetchall()
        if self.df is None:
            self.df = Frequencies(dictionary.load().hash_base)
        for rows in new:
            self._append(rows)
        if gone:
            self._forget(gone)
        return sum(rows.seq.size for rows in new)

    def _grow(self, n: int) -> None:
        """Make the columns `n` rows long (capacity doubling: each row is copied O(1) times
        on average), their new rows still to be written."""
        cap = self._buffers["seq"].size - 1  # the links' extra "none" slot
        if n > cap:
            cap = max(n, 2 * cap, 1024)
            for name, old in self._buffers.items():
                buf = np.empty(cap + 1, old.dtype)
                buf[:old.size] = old
                self._buffers[name] = buf
        b = self._buffers
        self.seq, self.user, self.conv = b["seq"][:n], b["user"][:n], b["conv"][:n]
        self.at, self.length = b["at"][:n], b["length"][:n]
        self.prev, self.next = b["prev"][:n + 1], b["next"][:n + 1]
        self.prev[n] = self.next[n] = -1

    def put_rows(self, seq: np.ndarray, user: np.ndarray, conv: np.ndarray, at: np.ndarray,
                 length: np.ndarray) -> None:
        """Append rows' columns and chain them into their conversations."""
        start = self.seq.size
        self._grow(start + seq.size)
        self.seq[start:], self.user[start:], self.conv[start:] = seq, user, conv
        self.at[start:], self.length[start:] = at, length
        self._link(seq.size)

    def _append(self, new: NewRows) -> None:
        """Add at most SEGMENT_ROWS rows as one new segment."""
        start = self.seq.size
        self.put_rows(new.seq, new.user, new.conv, new.at, new.length)
        self.n_rows += new.seq.size
        self.total_length += int(new.length.sum(dtype=np.int64))
        self.row_cursor = int(new.seq[-1])
        seg = build_segment(start, new.row_len, new.terms, new.tf, self.layout)
        if seg.terms is not None:  # its postings per term are the rows holding it: no count
            self.df.add_counts(seg.terms, np.diff(seg.ptr))
        else:
            self.df.add(new.terms)
        # Then the two last segments merge while the older is at most twice the newer and both
        # fit in one. Sizes stay geometric, like the digits of a binary counter: a row is moved
        # O(log) times in all, a catch-up of a few rows moves a few rows, and at most ~16
        # segments are not full.
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
        self.df.add(np.frombuffer(b"".join(g[3] for g in dead), "<i4"), -1)
        self.n_rows -= len(dead)
        self.total_length -= sum(int(g[2]) for g in dead)
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
        """Chain the last `count` rows into their conversations, in store order."""
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
                + self.length.nbytes + self.prev.nbytes + self.next.nbytes)
        return rows + sum(s.nbytes() for s in self.segments) + (
            self.df.nbytes() if self.df is not None else 0)

    # -- scan ----------------------------------------------------------------------------

    def query(self, text: str, params: Params) -> Query:
        df = self.df
        if df is None:
            return make_query(text, lambda t: np.zeros(t.size), 0, 0, params)
        return make_query(text, df.get, self.n_rows, self.total_length, params)

    def top(self, q: Query, k: int, visible: Visibility) -> list[tuple[float, int, bool]]:
        """The k best visible rows as (score, seq, own), own first, then best, ties by seq."""
        if q.empty or k <= 0 or not self.segments:
            return []
        # BM25 of every row; the extra last slot is the zero that "no neighbour" (-1) reads.
        bm25 = np.zeros(self.seq.size + 1)

        def fill(seg: Segment) -> None:
            bm25[seg.start:seg.start + seg.n] = self._scores(seg, q)

        if self.threads > 1 and len(self.segments) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="scan")
            list(self._pool.map(fill, self.segments))
        else:
            for seg in self.segments:
                fill(seg)
        # Context never crosses a conversation, so rows the asker cannot see are dropped
        # before it is computed; a time span only picks among the scored rows, which score
        # as they would without it.
        seen = visible.masks(self.user, self.conv)
        cand, score = self.context(bm25, q, seen[0] if seen[1] is None else seen[0] | seen[1])
        own, other = visible.masks(self.user[cand], self.conv[cand], self.at[cand])
        parts = []
        for mask, flag in ((own, True), (other, False)):
            if mask is not None:
                c = cand[mask]
                best = top_k(score[mask], np.arange(c.size), self.seq[c], k)
                parts.append((score[mask][best], self.seq[c][best], np.full(best.size, flag)))
        return merge(parts, k) if parts else []

    def context(self, bm25: np.ndarray, q: Query,
                visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows with a positive score and their scores: BM25 plus the weighted BM25 of their
        neighbours (Params.before / after). Only rows holding a query term, and rows within
        reach of one, can score above zero, so only those are computed."""
        n = bm25.size - 1
        hit = np.flatnonzero((bm25[:n] > 0) & visible)
        # Rows within reach: marked in a bitmap (an O(n) pass that beats a sort of the hits).
        reach = np.zeros(n + 1, bool)
        reach[hit] = True
        for links, weights in ((self.next, q.before), (self.prev, q.after)):
            x = hit
            for _ in weights:  # a row d after a hit gets that hit as its d-th row before
                x = links[x]
                reach[x] = True
        reach[n] = False  # the "none" slot
        cand = np.flatnonzero(reach)
        score = bm25[cand]
        for links, weights in ((self.prev, q.before), (self.next, q.after)):
            x = cand
            for w in weights:  # fixed order: before 1, 2, 3, then after 1, 2, 3
                x = links[x]  # -1 reads bm25's last slot, a zero
                score += w * bm25[x]
        keep = score > 0
        return cand[keep], score[keep]

    def _scores(self, seg: Segment, q: Query) -> np.ndarray:
        """Exact scores of every row of a segment (float64; zero for rows without a term)."""
        length = self.length[seg.start:seg.start + seg.n]
        if seg.terms is not None:
            i = np.searchsorted(seg.terms, q.terms)
            i = np.minimum(i, seg.terms.size - 1)
            hit = np.flatnonzero(seg.terms[i] == q.terms) if seg.terms.size else []
            if len(hit) == 0:
                return np.zeros(seg.n)
            lo, hi = seg.ptr[i[hit]], seg.ptr[i[hit] + 1]
            spans = list(zip(lo.tolist(), hi.tolist()))  # one per query term held here
            rows = np.concatenate([seg.rows[a:b] for a, b in spans])
            tf = np.concatenate([seg.tf[a:b] for a, b in spans])
            contrib = contributions(q, np.repeat(hit, hi - lo), tf, length[rows])
            # bincount adds in input order: for every row, ascending query term id.
            return np.bincount(rows, weights=contrib, minlength=seg.n)
        pos = np.searchsorted(q.terms, seg.row_terms)
        pos = np.minimum(pos, q.terms.size - 1)
        hit = np.flatnonzero(q.terms[pos] == seg.row_terms)
        rows = np.searchsorted(seg.row_ptr, hit, side="right") - 1
        contrib = contributions(q, pos[hit], seg.tf[hit], length[rows])
        return np.bincount(rows, weights=contrib, minlength=seg.n)

def top_k(scores: np.ndarray, cand: np.ndarray, seq: np.ndarray, k: int) -> np.ndarray:
    """The k candidates with the best score, ties by lower seq; argpartition keeps it O(n).

    `scores` and `seq` are indexed by the candidates' values."""
    if cand.size > k:
        s = scores[cand]
        kth = s[np.argpartition(-s, k - 1)[k - 1]]
        cand = cand[s >= kth]  # everything tied with the k-th stays in for the tie-break
    order = np.lexsort((seq[cand], -scores[cand]))
    return cand[order[:k]]


def merge(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
          k: int) -> list[tuple[float, int, bool]]:
    """One ranking from per-segment tops: own rows first, then score, then seq."""
    scores = np.concatenate([p[0] for p in parts])
    seqs = np.concatenate([p[1] for p in parts])
    own = np.concatenate([p[2] for p in parts])
    order = np.lexsort((seqs, -scores, ~own))[:k]
    return list(zip(scores[order].tolist(), seqs[order].tolist(), own[order].tolist(),
                    strict=True))


@dataclass(frozen=True, slots=True)
class Visibility:
    """Which rows a query may see, and which of them are the asker's own."""

    user_id: int | None
    share_pool: bool = False
    conversation_id: int | None = None
    during: tuple[float, float] | None = None  # [start, end) of when the row was said
    pool: frozenset[int] | None = None  # with share_pool: the only others visible (None: all)

    def masks(self, user: np.ndarray, conv: np.ndarray,
              at: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """(own, others') rows, others' None unless the pool is shared; the time span applies
        only where `at` is given."""
        live = user >= 0
        if self.conversation_id is not None:
            live = live & (conv == self.conversation_id)
        if self.during is not None and at is not None:
            live = live & (at >= self.during[0]) & (at < self.during[1])
        if self.user_id is None:
            return live, None
        mine = live & (user == self.user_id)
        if not self.share_pool:
            return mine, None
        others = live & (user != self.user_id)
        if self.pool is not None:
            others &= np.isin(user, np.fromiter(self.pool, np.int32, len(self.pool)))
        return mine, others


# --------------------------------------------------------------------------- the scanner


class Scanner:
    """Search a store: exact BM25 over the visible rows, top `limit` hits, best first.

    Memories up to `store_rows` retrieval rows are scored straight from the store (no copy
    kept); past that the scanner keeps an Arena and catches it up before every search.
    """

    def __init__(self, store: Store, *, share_pool: bool = False, threads: int | None = None,
                 layout: str = TERMS, params: Params = Params(), store_rows: int = 2000,
                 pool_of: Callable[[int], frozenset[int]] | None = None) -> None:
        """`pool_of`: with `share_pool`, the users a user's pool holds (default: everyone)."""
        self.store = store
        self.share_pool = share_pool
        self.pool_of = pool_of
        self.params = params
        self.store_rows = store_rows
        self.arena = Arena(layout, threads)
        self._use_arena = store_rows <= 0
        # The frame's searches and the recall tools' run on different threads: a catch-up
        # and a ranking see the arena whole (each holds this a few milliseconds; reading the
        # hits' text from the store happens outside it).
        self._lock = threading.Lock()

    def catch_up(self) -> int:
        """Bring the arena (if in use) up to date; returns rows read. Reads only: deletions
        not settled yet are accounted for, not settled (the store's writer does that)."""
        with snapshot("read the dictionary version") as conn:
            live_dictionary(conn)  # a flip (maybe by another process) is followed here
            if not self._use_arena:
                rows, _, _ = totals(conn)
                self._use_arena = rows > self.store_rows
        if not self._use_arena:
            return 0
        read = self.arena.catch_up()
        if self.arena.stale():  # a flip re-derived every row, or most rows are dead
            self.arena = Arena(self.arena.layout, self.arena.threads)
            read = self.arena.catch_up()
        return read

    def search(self, query: str, user_id: int | None, limit: int = 10,
               exclude: Iterable[int] = frozenset(), conversation_id: int | None = None,
               during: tuple[float, float] | None = None) -> list[Hit]:
        """Rank the rows `user_id` may see (all rows for None) against `query`; with `during`,
        only the rows said in that [start, end) span of epoch seconds."""
        exclude = frozenset(exclude)
        if limit <= 0 or not query.strip():
            return []
        pool = self.pool_of(user_id) if self.pool_of and self.share_pool and user_id else None
        visible = Visibility(user_id, self.share_pool, conversation_id, during, pool)
        k = limit + len(exclude)  # excluded rows are dropped after ranking: fetch enough
        with failing_as("search memory"):
            with self._lock:
                self.catch_up()
                if self._use_arena:
                    ranked = self.arena.top(self.arena.query(query, self.params), k, visible)
                else:
                    ranked = self._store_top(query, k, visible)
            hits = fetch_hits(ranked)
        return [h for h in hits if h.item_id not in exclude][:limit]

    def _store_top(self, text: str, k: int, visible: Visibility) -> list[tuple[float, int, bool]]:
        """The small-memory path: score the visible rows read straight from the store."""
        with snapshot("search memory") as conn:
            n_rows, total, _ = totals(conn)
            q = make_query(text, lambda t: unfolded_df(conn, t), n_rows, total, self.params)
            if q.empty:
                return []
            where, args = "", []
            if visible.user_id is not None and not visible.share_pool:
                where, args = "WHERE user_id = ?", [visible.user_id]
            elif visible.user_id is not None and visible.pool is not None:
                args = [visible.user_id, *visible.pool]
                where = f"WHERE user_id IN ({','.join('?' * len(args))})"
            rows = conn.execute("SELECT seq, user_id, conversation_id, at, length, terms, counts"
                                f" FROM retrieval {where} ORDER BY seq", args).fetchall()
        if not rows:
            return []
        tmp = Arena(ROWS, threads=1)
        seq, user, conv, at, length, terms_b, counts_b = zip(*rows)
        tmp.put_rows(*(np.asarray(c, _COLUMNS[name]) for name, c in
                       zip(("seq", "user", "conv", "at", "length"), (seq, user, conv, at, length),
                           strict=True)))
        row_len = np.fromiter((len(c) for c in counts_b), np.int64, len(counts_b))
        tmp.segments = [build_segment(0, row_len, np.frombuffer(b"".join(terms_b), "<i4"),
                                      np.frombuffer(b"".join(counts_b), np.uint8), ROWS)]
        return tmp.top(q, k, visible)


def fetch_hits(ranked: list[tuple[float, int, bool]]) -> list[Hit]:
    """Hits for ranked (score, seq, own) triples, in that order; rows deleted meanwhile drop."""
    if not ranked:
        return []
    seqs = [s for _, s, _ in ranked]
    rows = db.connection().execute(
        "SELECT r.seq, r.item_id, r.message_id, r.user_id, r.conversation_id, m.role, m.at,"
        " i.name, i.text, r.tokens FROM retrieval r JOIN item i ON i.id = r.item_id"
        " JOIN message m ON m.id = r.message_id"
        f" WHERE r.seq IN ({','.join('?' * len(seqs))})", seqs).fetchall()
    by_seq = {r[0]: r for r in rows}
    hits = []
    for score, s, _ in ranked:
        r = by_seq.get(s)
        if r is not None:
            hits.append(Hit(r[1], r[2], r[3], r[4], r[5], r[6], score,
                            item_text("", r[7], r[8]), seq=s, tokens=r[9]))
    return hits
