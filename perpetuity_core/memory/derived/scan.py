"""The exact scan: a BM25-family score for every visible retrieval row, for every query.

There is no approximate index between a question and the memory: every stored row gets its
exact score (rows holding none of the query's terms score exactly zero and are not hits).

Write side: memory/derived/index.py (one retrieval row per stored item that is memory, and the pooled
counts BM25 needs, which readers complete with the rows stored since the last fold).

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

Then a second hop (Params.feedback, bm25.fed_back): the terms the best rows of that ranking
hold and the question does not are searched again, at a fifth of a question term's weight,
and the best row's conversation's rows take its places in the ranking in that new order
(Scanner._top). A multi-hop question's second evidence turn often shares words with its first
one only.

Measured on LoCoMo and left out (scripts/eval_retrieval.py): rare-term weighting (idf ** 1.5 or
** 2) and a phrase bonus over adjacent word pairs each move recall by about a point at most,
against an index twice the size for the phrase bonus; the speaker's name in the row text
(the LoCoMo importer's choice, as a transcript shows it) is worth 3 to 7 points.

No shortlist. The term-major pass already reads only what can make a score non-zero (the
postings of the query's terms, then the rows within context reach of a hit), so a cheaper
first pass would read the same postings again; the benchmark's 82M-token pool stays well
inside its latency budget without one. What a scan skips is the rows nobody asking can see:
when fewer than half the rows are visible (one user's of many), only the visible rows'
postings get a contribution, which is every row that can be a hit or a hit's context, with
the same sums in the same order; their rows come in runs (a conversation is written turn by
turn), so each term's postings in a run are one slice (view.postings). And then the scores
and their context are computed in arrays as long as the rows shown, not the arena
(View.visible_scores): at 20.96M tokens (105k rows, 120 users, a user's ~900 rows), the
arena-long passes (a score vector, the hits' bitmap, their reach) were most of a search.
Measured there (200 LoCoMo and BEAM questions, one thread, a loaded 2-core machine):
6.03M instructions a search before, 3.00M after (callgrind; with make_query's Counter);
p50 1.47 ms before, 0.68-0.84 after, against bm25s's numba backend's 0.40-0.46 on the same
rows and questions. The pooled case (share_pool, every row visible) still scores every row:
43M instructions a search, unchanged.

Visibility is a rule: a user sees only their own rows; with `share_pool` every row is visible
and the asking user's own rows rank before everyone else's. Exclusions (item ids) drop rows
without changing anyone's score.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from perpetuity_core.memory.derived import vectors
from perpetuity_core.memory.derived.arena import COLUMNS, ROWS, TERMS, Arena, build_segment
from perpetuity_core.memory.derived.bm25 import (
    FEEDBACK_ROWS,
    Bag,
    Params,
    Query,
    fed_back,
    make_query,
)
from perpetuity_core.memory.derived.index import item_text, sequence, totals, unfolded_df
from perpetuity_core.memory.derived.view import View, Visibility
from perpetuity_core.memory.storage.dialect import Sql, marks, one_of
from perpetuity_core.memory.storage.kept import Kept, There, kept
from perpetuity_core.memory.storage.store import Database, Store, failing_as

# A conversation with fewer rows than this share of the memory's is ranked again by its own
# counts (Scanner._top); past it the memory's are mostly its own. One memory per conversation,
# LoCoMo's chat of questions beside it: its own counts cost the frame 2 questions of 1,535,
# by ranks moved one or two places (docs/tuning.md).
OWN_BELOW = 0.5


# Not frozen: a frozen dataclass sets each field through object.__setattr__, six times the
# cost of making one (3.8 against 0.6 us), and a search makes 200 (fetch_hits). Never changed
# once made: the kept ones are shared by every search.
@dataclass(slots=True)
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


class Scanner:
    """Search a store: exact BM25 over the visible rows, top `limit` hits, best first.

    Memories up to `store_rows` retrieval rows are scored straight from the store (no copy
    kept); past that the scanner keeps an Arena and catches it up before every search.
    """

    def __init__(self, store: Store, *, share_pool: bool = False, threads: int | None = None,
                 layout: str = TERMS, params: Params = Params(), store_rows: int = 2000,
                 pool_of: Callable[[int], frozenset[int]] | None = None,
                 one_person: bool = False) -> None:
        """`pool_of`: with `share_pool`, the users a user's pool holds (default: everyone);
        `one_person`: every row is the asker's own (a personal proxy's file is one person's,
        whichever user key a row was stored under), so none ranks behind another as a
        stranger's."""
        self.store = store
        self.share_pool = share_pool
        self.one_person = one_person
        self.pool_of = pool_of
        self.params = params
        self.store_rows = store_rows
        self.db = store.db
        self.arena = Arena(self.db, layout, threads)
        self._use_arena = store_rows <= 0
        # The frame's searches and the recall tools' run on different threads. One catch-up
        # at a time (each holds this a few milliseconds); the scans read the view the last
        # catch-up published, without it (memory.view.View).
        self._lock = threading.Lock()

    def catch_up(self) -> int:
        """Bring the arena (if in use) up to date; returns rows read. Deletions not settled yet
        are accounted for, not settled (the store's writer does that). Its one write, on
        PostgreSQL only, orders the rows stored in parallel (index.sequence)."""
        db = self.db
        with self._lock:
            known = self.arena.version
            if known is None:  # the store's path, or the arena's first catch-up
                with db.snapshot("read the dictionary version") as conn:
                    db.live.follow(conn)  # a flip (maybe by another process) is followed here
                    if not self._use_arena:
                        rows, _, _ = totals(conn)
                        self._use_arena = rows > self.store_rows
                if not self._use_arena:
                    sequence(db)  # PostgreSQL: rows other writers stored (the arena does it itself)
                    return 0
            read = self.arena.catch_up()
            if known is not None and self.arena.version != known:
                # The arena's version names the live dictionary, so it moves with a flip (maybe
                # by another process), which is followed here, before any query or rebuild
                # tokenises with it. Otherwise that is not read again: on PostgreSQL the
                # snapshot reading it cost three round trips a search (BEGIN, the read, COMMIT).
                with failing_as("read the dictionary version"):
                    db.live.follow(db.connection())
            if self.arena.stale():  # a flip re-derived every row, or most rows are dead
                fresh = Arena(db, self.arena.layout, self.arena.threads)
                read = fresh.catch_up()
                self.arena = fresh  # readers keep the old arena's view until this
            return read

    def search(self, query: str, user_id: int | None, limit: int = 10,
               exclude: Iterable[int] = frozenset(), conversation_id: int | None = None,
               during: tuple[float, float] | None = None, again: int | None = None) -> list[Hit]:
        """Rank the rows `user_id` may see (all rows for None) against `query`; with `during`,
        only the rows said in that [start, end) span of epoch seconds; `again`: the
        conversation ranked again by its own statistic (`_top`), else the best row's."""
        exclude = frozenset(exclude)
        if limit <= 0 or not query.strip():
            return []
        if self.one_person:
            user_id = None
        pool = self.pool_of(user_id) if self.pool_of and self.share_pool and user_id else None
        visible = Visibility(user_id, self.share_pool, conversation_id, during, pool)
        k = limit + len(exclude)  # excluded rows are dropped after ranking: fetch enough
        with failing_as("search memory"):
            self.catch_up()
            if self._use_arena:
                ranked = self._arena_top(query, k, visible, again)
            else:
                ranked = self._store_top(query, k, visible, again)
            hits = fetch_hits(self.db, ranked)
        return [h for h in hits if h.item_id not in exclude][:limit]

    def _arena_top(self, text: str, k: int, visible: Visibility,
                   again: int | None) -> list[tuple[float, int, bool]]:
        view = self.arena.view
        if view.df is None:  # nothing stored yet
            return []
        return self._top(view, text, view.query(self.db.dictionary, text, self.params), k,
                         visible, view.df.get, self.db.connection(), again)

    def _top(self, view: View, text: str, q: Query, k: int, visible: Visibility,
             df_of: Callable[[np.ndarray], np.ndarray], conn: Sql,
             again: int | None = None) -> list[tuple[float, int, bool]]:
        """The k best visible rows for `q` (`text` against the pooled statistic), the best
        row's conversation (or `again`) ranked again as its own memory would rank it: `text`
        against that conversation's own statistic (View.statistics), with the terms its rows
        among the FEEDBACK_ROWS best bring (bm25.fed_back; rows excluded later feed back
        too). Its rows take that conversation's places in the first ranking, scores and all,
        in their new order. In a person's memory a word rare in the pool (a name, a topic) is
        common within the conversation it tells apart, and pooled idf ranked its every row a
        good match (docs/tuning.md). The first ranking's mix of conversations and its scores (which the
        frame's budget reads) stay: letting the fed scores rise cost LoCoMo `--personal` 1.4
        points of the frame and BEAM's 3. A conversation that is most of the memory
        (OWN_BELOW) is ranked again by the memory's counts: they are mostly its own."""
        first = view.top(q, max(k, FEEDBACK_ROWS) if self.params.feedback > 0 else k, visible)
        if self.params.feedback <= 0 or not first:
            return first[:k]
        got = bags(self.db, conn, [s for _, s, _ in first[:FEEDBACK_ROWS]])
        best = [(got[s], score) for score, s, _ in first[:FEEDBACK_ROWS] if s in got]
        if not best and again is None:
            return first[:k]
        conv = best[0][0][3] if again is None else again
        best = [(b, score) for b, score in best if b[3] == conv]
        own = view.statistics(conv)
        if own.n_rows < OWN_BELOW * q.n_rows:
            q = make_query(self.db.dictionary, text, own.df, own.n_rows, own.total_length,
                           self.params)
            df_of = own.df
        fed = fed_back(q, [b for b, _ in best], [s for _, s in best], df_of, self.params)
        inside = view.conversations(np.array([s for _, s, _ in first], np.int64)) == conv
        ranked = view.top(fed, k, replace(visible, conversation_id=conv))
        # A row the first ranking held may score nothing again (its cosine by the
        # conversation's own idf below zero): that conversation's rows of the first ranking
        # not taken yet fill the places left, in their order.
        taken = {s for _, s, _ in ranked}
        rows = iter(ranked + [p for p, there in zip(first, inside.tolist(), strict=True)
                              if there and p[1] not in taken])
        return [(place[0], *next(rows)[1:]) if there else place
                for place, there in zip(first, inside.tolist(), strict=True)][:k]

    def _store_top(self, text: str, k: int, visible: Visibility,
                   again: int | None) -> list[tuple[float, int, bool]]:
        """The small-memory path: score the visible rows read straight from the store."""
        db = self.db
        with db.snapshot("search memory") as conn:
            n_rows, total, _ = totals(conn)
            q = make_query(db.dictionary, text, lambda t: unfolded_df(db, conn, t), n_rows,
                           total, self.params)
            if q.empty:
                return []
            return self._store_rows_top(conn, text, q, k, visible, again)

    def _store_rows_top(self, conn: Sql, text: str, q: Query, k: int, visible: Visibility,
                        again: int | None) -> list[tuple[float, int, bool]]:
        """`_store_top` within its snapshot, where the feedback's rows and counts are read."""
        db = self.db
        where, args = "", []
        if visible.user_id is not None and not visible.share_pool:
            where, args = f"WHERE user_id = {marks(db.postgres, 1)}", [visible.user_id]
        elif visible.user_id is not None and visible.pool is not None:
            args = [visible.user_id, *visible.pool]
            where = f"WHERE user_id IN ({marks(db.postgres, len(args))})"
        rows = conn.execute("SELECT seq, user_id, conversation_id, at, length, terms, counts,"
                            f" vec FROM retrieval {where} ORDER BY seq", args).fetchall()
        if not rows:
            return []
        tmp = Arena(db, ROWS, threads=1)
        seq, user, conv, at, length, terms_b, counts_b, vec_b = zip(*rows)
        tmp.put_rows(np.asarray(seq, COLUMNS["seq"]), np.asarray(user, COLUMNS["user"]),
                     np.asarray(conv, COLUMNS["conv"]), np.asarray(at, COLUMNS["at"]),
                     np.asarray(length, COLUMNS["length"]),
                     vectors.matrix(b"".join(vec_b), len(rows)))
        row_len = np.fromiter((len(c) for c in counts_b), np.int64, len(counts_b))
        tmp.segments = [build_segment(0, row_len, np.frombuffer(b"".join(terms_b), "<i4"),
                                      np.frombuffer(b"".join(counts_b), np.uint8), ROWS)]
        return self._top(tmp.publish(), text, q, k, visible,
                         lambda t: unfolded_df(db, conn, t), conn, again)


def fetch_hits(db: Database, ranked: list[tuple[float, int, bool]]) -> list[Hit]:
    """Hits for ranked (score, seq, own) triples, in that order; rows deleted meanwhile drop.
    Which are there is read every time, seqs only; a hit's row is read whole once and kept
    (memory.storage.kept: seqs are never reused), where reading 200 hits' text again took
    1.1 of a search's 1.3 ms (LoCoMo, a first prompt's frame)."""
    if not ranked:
        return []
    # Which are there by the retrieval row's key alone: a retrieval row goes with its item (its
    # foreign key cascades), an item never outlives its message, so the joins that read a hit
    # whole would find every one. Asked only of the seqs not found before while no retrieval
    # row went (each deletion logged, a flip counted; kept.There): 200 a search.
    conn = db.connection()

    def ask(seqs: list[int]) -> list[int]:
        where, args = one_of(db.postgres, "seq", seqs)
        return [s for (s,) in conn.execute(f"SELECT seq FROM retrieval WHERE {where}", args)]

    gone = tuple(conn.execute(_GONE_SO_FAR).fetchone())
    there = kept(db, "hits there", There).among(gone, [s for _, s, _ in ranked], ask)
    cache: Kept[Hit] = kept(db, "hits", lambda: Kept(HITS_KEPT, _hit_chars))
    known = cache.get(there)
    if missing := [s for s in there if s not in known]:
        where, args = one_of(db.postgres, "r.seq", missing)
        read = {r[0]: Hit(r[1], r[2], r[3], r[4], r[5], r[6], 0.0, item_text("", r[7], r[8]),
                          seq=r[0], tokens=r[9])
                for r in db.connection().execute(
                    "SELECT r.seq, r.item_id, r.message_id, r.user_id, r.conversation_id, m.role,"
                    f" m.at, i.name, i.text, r.tokens FROM retrieval r {_HIT_JOINS}"
                    f" WHERE {where}", args)}
        cache.put(read)
        known |= read
    hits = []
    for score, s, _ in ranked:
        h = known.get(s)
        if h is not None:
            hits.append(Hit(h.item_id, h.message_id, h.user_id, h.conversation_id, h.role, h.at,
                            score, h.text, s, h.tokens))  # by position: keywords cost more
    return hits


def bags(db: Database, conn: Sql, seqs: list[int]) -> dict[int, Bag]:
    """The bags of the rows `seqs` that are still there (the arena holds postings by term,
    not a row's terms: these few are read by key)."""
    where, args = one_of(db.postgres, "seq", seqs)
    return {s: (np.frombuffer(t, "<i4"), np.frombuffer(c, np.uint8), n, conv)
            for s, t, c, n, conv in conn.execute(
                f"SELECT seq, terms, counts, length, conversation_id FROM retrieval WHERE {where}",
                args)}


# The retrieval rows deleted so far (their log's last seq, never handed out again) and the
# flips, which re-write every row unlogged: while both stand, a seq found there still is.
_GONE_SO_FAR = ("SELECT (SELECT coalesce(max(seq), 0) FROM retrieval_gone),"
                " (SELECT value FROM setting WHERE key = 'flips')")
_HIT_JOINS = "JOIN item i ON i.id = r.item_id JOIN message m ON m.id = r.message_id"
HITS_KEPT = 16 * 1024 * 1024  # characters of hits' text kept per database


def _hit_chars(h: Hit) -> int:
    return len(h.text)
