"""What a scan reads: an arena's published `View` (memory.arena explains how a catch-up
publishes one while readers scan the last), its segments and document frequencies, and the
`Visibility` rule of a query.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from perpetuity_core.memory.derived import vectors
from perpetuity_core.memory.derived.bm25 import (
    Params,
    Query,
    contributions,
    make_query,
    merge,
    top_k,
)
from perpetuity_core.memory.storage.dictionary import Dictionary


class Frequencies:
    """Document frequency per term id, immutable: a view keeps the one it was published with.

    A base (a dense int32 array over the vocabulary's ids, a dict over the hashed ids above it:
    a dense table of all 2**22 hash buckets would cost 16 MB however small the memory) plus a
    small delta (distinct term ids ascending, their counts). `plus` returns new frequencies
    sharing the base and copying only the delta, so a catch-up costs O(its own terms); the
    delta is folded into a fresh base once it holds FOLD_AT terms (the base copy, O(vocabulary),
    then comes once per FOLD_AT new terms, amortised)."""

    FOLD_AT = 4096

    def __init__(self, hash_base: int, dense: np.ndarray | None = None,
                 hashed: dict[int, int] | None = None,
                 delta: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.hash_base = hash_base
        self.dense = np.zeros(hash_base, np.int32) if dense is None else dense
        self.hashed: dict[int, int] = {} if hashed is None else hashed
        self.delta = delta or (np.zeros(0, np.int64), np.zeros(0, np.int64))

    def plus(self, terms: np.ndarray, counts: np.ndarray) -> Frequencies:
        """These frequencies with `counts` rows added to each of `terms` (distinct, ascending).
        Merged into the delta where they fall, not sorted with it: a catch-up of a few rows
        brings tens of terms to a delta of up to FOLD_AT, which np.unique sorted whole every
        time (a tenth of a small catch-up's 0.5 ms)."""
        ids, c = self.delta
        terms = terms.astype(np.int64)
        at = np.searchsorted(ids, terms)
        there = at < ids.size
        there[there] = ids[at[there]] == terms[there]
        c = c.copy()  # the delta is shared with the views published before
        c[at[there]] += counts[there]
        if not there.all():
            new = ~there
            ids = np.insert(ids, at[new], terms[new])
            c = np.insert(c, at[new], counts[new])
        if ids.size < self.FOLD_AT:
            return Frequencies(self.hash_base, self.dense, self.hashed, (ids, c))
        return self._fold(ids, c)

    def _fold(self, ids: np.ndarray, c: np.ndarray) -> Frequencies:
        """New frequencies with no delta: a copy of the base plus `c` for each of `ids`."""
        dense, hashed = self.dense.copy(), dict(self.hashed)
        v = ids < self.hash_base
        dense[ids[v]] += c[v].astype(np.int32)
        for term, n in zip(ids[~v].tolist(), c[~v].tolist(), strict=True):
            if left := hashed.get(term, 0) + n:
                hashed[term] = left
            else:
                hashed.pop(term, None)
        return Frequencies(self.hash_base, dense, hashed)

    def rows(self, terms: np.ndarray, sign: int = 1) -> Frequencies:
        """These frequencies with one row counted (sign 1) or uncounted (-1) for each
        occurrence in `terms`."""
        u, c = np.unique(terms, return_counts=True)
        return self.plus(u, sign * c)

    def get(self, terms: np.ndarray) -> np.ndarray:
        v = terms < self.hash_base
        out = np.zeros(terms.size, np.int64)
        out[v] = self.dense[terms[v]]
        out[~v] = [self.hashed.get(t, 0) for t in terms[~v].tolist()]
        ids, c = self.delta
        if ids.size:
            i = np.minimum(np.searchsorted(ids, terms), ids.size - 1)
            out += np.where(ids[i] == terms, c[i], 0)
        return out

    def held(self) -> np.ndarray:
        """Which terms below the hashed range some row holds (a df above zero), as a mask over
        their ids."""
        out = self.dense > 0
        ids, c = self.delta
        if (v := ids < self.hash_base).any():
            out[ids[v]] = self.dense[ids[v]] + c[v] > 0
        return out

    def table(self) -> tuple[np.ndarray, dict[int, int]]:
        """The frequencies folded: (dense, hashed without zeros)."""
        f = self._fold(*self.delta)
        return f.dense, f.hashed

    def nbytes(self) -> int:
        # A dict entry with its two small ints costs about 100 bytes in CPython.
        return self.dense.nbytes + 100 * len(self.hashed) + 16 * self.delta[0].size


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


# Below this fraction of rows visible, a scan scores only the visible rows' postings (picking
# them costs about what scoring them does, so past half it would cost more than it saves).
SCORE_VISIBLE_BELOW = 0.5
# The best lexical candidates whose conversations the semantic half ranks (View.semantic_rows;
# docs/tuning.md: 1, 3, 10 measured in sequence).
SEMANTIC_FROM = 1
# Rows up to which the segments are scored on the calling thread: handing a small memory's few
# segments to the workers and back cost more than scoring them (LoCoMo's 600 turns in three
# segments: 9% of a first prompt's frame build in its profile went to the hand-offs).
POOL_ROWS = 1 << 16


@dataclass(frozen=True, slots=True)
class View:
    """The arena as one catch-up left it: its first `n` rows, their segments and counts.

    Nothing a view reads changes after it is published: the columns are (views of the first
    `n` rows of) buffers the writer only appends to (past `n`), except a conversation's last
    row's next link, which `step` reads as none when it points past `n`; deletions copy
    the columns they change, segments are replaced, never changed, and frequencies are
    immutable. So any number of readers scan a view without a lock while the writer appends.
    """

    n: int
    seq: np.ndarray
    user: np.ndarray
    conv: np.ndarray
    at: np.ndarray
    length: np.ndarray
    vec: np.ndarray  # int8, vectors.DIMS a row
    inv: np.ndarray  # 1 / |vec|, float64
    prev: np.ndarray  # the links' whole buffers (see step): rows past n are not this view's
    next: np.ndarray
    segments: tuple[Segment, ...]
    df: Frequencies | None
    n_rows: int
    total_length: int
    row_cursor: int
    gone_cursor: int
    pool: ThreadPoolExecutor | None

    def query(self, d: Dictionary, text: str, params: Params) -> Query:
        """`text` as a query (tokenised by `d`, the live dictionary) over this view's rows."""
        df = self.df
        if df is None:
            return make_query(d, text, lambda t: np.zeros(t.size), 0, 0, params)
        return make_query(d, text, df.get, self.n_rows, self.total_length, params,
                          held=df.held)

    def top(self, q: Query, k: int, visible: Visibility) -> list[tuple[float, int, bool]]:
        """The k best visible rows as (score, seq, own), own first, then best, ties by seq."""
        if q.empty or k <= 0 or not self.segments:
            return []
        # Context never crosses a conversation, and a conversation is one user's, so rows the
        # asker cannot see are dropped before it is computed; a time span only picks among
        # the scored rows, which score as they would without it.
        seen = visible.masks(self.user, self.conv)
        near = seen[0] if seen[1] is None else seen[0] | seen[1]
        shown = np.flatnonzero(near)
        if shown.size < SCORE_VISIBLE_BELOW * self.n:
            cand, score = self.visible_scores(q, near, shown)
        else:
            cand, score = self.context(self.scores(q), q, near)
        if q.vec is not None:
            cand, score = self.fused(q, cand, score, near, shown)
        own, other = visible.masks(self.user[cand], self.conv[cand], self.at[cand])
        parts = []
        for mask, flag in ((own, True), (other, False)):
            if mask is not None:
                c = cand[mask]
                best = top_k(score[mask], np.arange(c.size), self.seq[c], k)
                parts.append((score[mask][best], self.seq[c][best], np.full(best.size, flag)))
        return merge(parts, k) if parts else []

    def statistics(self, conv: int) -> Statistics:
        """One conversation's own statistic: its live rows, their total length and a
        document-frequency reader counting only its rows (what its own memory would hold)."""
        mask = (self.conv[:self.n] == conv) & (self.user[:self.n] >= 0)
        kept = np.flatnonzero(mask)
        return Statistics(kept.size, int(self.length[kept].sum()),
                          lambda terms: self.frequencies(terms, mask, kept))

    def frequencies(self, terms: np.ndarray, mask: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """How many of the rows in `mask` (over this view's rows; `kept`, its rows ascending)
        hold each of `terms`: their postings of those terms alone, read as a visible scan reads
        them (`_postings`), never the other conversations' (a mask over every posting of the
        terms grew with the memory: 13 of a per-user search's 27 ms at 82M tokens)."""
        out = np.zeros(terms.size, np.int64)
        if terms.size == 0:
            return out
        order = np.argsort(terms, kind="stable")  # the row-major read wants them ascending
        q = Query(terms[order].astype(np.int32), np.zeros(terms.size), 0.0, 0.0)
        for seg in self.segments:
            a, b = np.searchsorted(kept, (seg.start, seg.start + seg.n))
            if a == b:
                continue
            out[order] += self._counted(seg, q, (mask[seg.start:seg.start + seg.n],
                                              kept[a:b] - seg.start))
        return out

    def _counted(self, seg: Segment, q: Query, keep: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """How many of a segment's rows `keep` (as `_postings` takes it) hold each of the
        query's terms: a term-major segment counts their postings without reading them out
        (`counted`), a row-major one reads them."""
        if seg.terms is None:
            _, _, slot = self._postings(seg, q, keep)
            return np.bincount(slot, minlength=q.terms.size)
        assert seg.rows is not None
        hit, lo, hi = self._extents(seg, q)
        out = np.zeros(q.terms.size, np.int64)
        out[hit] = counted(seg.rows, lo, hi, keep)
        return out

    def _extents(self, seg: Segment, q: Query) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A term-major segment's query terms that it holds (their places in `q`) and the
        extents [lo, hi) of their postings."""
        assert seg.terms is not None and seg.ptr is not None
        if seg.terms.size == 0:
            return np.zeros(0, np.int64), seg.ptr[:0], seg.ptr[:0]
        i = np.minimum(np.searchsorted(seg.terms, q.terms), seg.terms.size - 1)
        hit = np.flatnonzero(seg.terms[i] == q.terms)
        return hit, seg.ptr[i[hit]], seg.ptr[i[hit] + 1]

    def conversations(self, seqs: np.ndarray) -> np.ndarray:
        """The conversation of each of `seqs`, rows of this view (seq ascends in it)."""
        return self.conv[np.searchsorted(self.seq[:self.n], seqs)]

    def scores(self, q: Query) -> np.ndarray:
        """BM25 of every row, and an extra last slot, which none (-1) reads, a zero."""
        bm25 = np.zeros(self.n + 1)

        def fill(seg: Segment) -> None:
            rows, tf, slot = self._postings(seg, q)
            length = self.length[seg.start:seg.start + seg.n]
            # bincount adds in input order: for every row, ascending query term id.
            bm25[seg.start:seg.start + seg.n] = np.bincount(
                rows, weights=contributions(q, slot, tf, length[rows]), minlength=seg.n)

        if self.pool is not None and len(self.segments) > 1 and self.n > POOL_ROWS:
            list(self.pool.map(fill, self.segments))
        else:
            for seg in self.segments:
                fill(seg)
        return bm25

    def visible_scores(self, q: Query, near: np.ndarray,
                       shown: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`context`'s answer computed over the visible rows alone (`near`, a mask, and
        `shown`, its rows ascending): few of many (one user's), so every array here is as
        long as the rows shown, not the arena. Context never crosses a conversation, and a
        conversation is one user's, so a visible row's neighbours are visible: each row
        gets the same sums, in the same order, as over every row."""
        m = shown.size
        length = self.length[shown]
        where, weights = [], []
        for seg in self.segments:
            a, b = np.searchsorted(shown, (seg.start, seg.start + seg.n))
            if a == b:
                continue
            keep = (near[seg.start:seg.start + seg.n], shown[a:b] - seg.start)
            at, tf, slot = self._postings(seg, q, keep)
            at = at + a
            where.append(at)
            weights.append(contributions(q, slot, tf, length[at]))
        # BM25 per visible row, and an extra last slot, which none reads, a zero; bincount adds
        # in input order, and each row's postings are its segment's: ascending query term id.
        bm25 = np.zeros(m + 1)
        if where:
            bm25[:m] = np.bincount(np.concatenate(where), weights=np.concatenate(weights),
                                   minlength=m)
        score = bm25[:m].copy()
        for links, w in ((self.prev, q.before), (self.next, q.after)):
            to = among(shown, self.step(links, shown))
            x = np.arange(m)
            for weight in w:  # fixed order: before 1, 2, 3, then after 1, 2, 3
                x = to[x]  # none (m) reads the last slot, a zero, and steps to none
                score += weight * bm25[x]
        positive = score > 0
        return shown[positive], score[positive]

    def fused(self, q: Query, cand: np.ndarray, score: np.ndarray, near: np.ndarray,
              shown: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The lexical candidates (`cand` ascending, scoring `score`) and the visible rows
        (`near`, a mask, and `shown`, its rows ascending) of the conversations the words found
        (semantic_rows), each scoring its lexical score plus the semantic half
        (bm25.Params.semantic), those above zero, in no particular order."""
        assert q.vec is not None
        if cand.size == 0:  # nothing the words found: no conversation to look in
            return cand, score
        rows = self.semantic_rows(cand, score, near, shown)
        sem = q.semantic * float(score.max()) * vectors.cosines(self.vec[rows], self.inv[rows],
                                                                q.vec)
        # Each of `rows` is a lexical candidate or not (`cand` ascending): the sum for the
        # ones that are, the semantic half alone for the others, appended.
        at = np.minimum(np.searchsorted(cand, rows), cand.size - 1)
        lexical = cand[at] == rows
        total = score.copy()
        total[at[lexical]] = sem[lexical] + score[at[lexical]]
        cand = np.concatenate((cand, rows[~lexical]))
        total = np.concatenate((total, sem[~lexical]))
        keep = total > 0
        return cand[keep], total[keep]

    def semantic_rows(self, cand: np.ndarray, score: np.ndarray, near: np.ndarray,
                      shown: np.ndarray) -> np.ndarray:
        """The visible rows (ascending) of the conversations holding the SEMANTIC_FROM best
        lexical candidates (ties by row): conversation-level evidence from the words, so the
        table ranks within the conversations they point to, never the other conversations
        of a pooled memory, and a search pays a cosine for those rows alone."""
        top = cand[top_k(score, np.arange(cand.size), cand, SEMANTIC_FROM)]
        convs = np.unique(self.conv[top])
        if shown.size < SCORE_VISIBLE_BELOW * self.n:  # few of many: only theirs
            return shown[np.isin(self.conv[shown], convs)]
        return np.flatnonzero(near & np.isin(self.conv, convs))

    def step(self, links: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The rows `links` (prev or next) point to from rows `x`, -1 for none. The links are
        whole buffers whose last slot is -1, so none steps to none; a next link past n (a row
        appended after this view, linked since) reads as none too."""
        y = links[x]
        if links is self.next:
            y[y >= self.n] = -1
        return y

    def context(self, bm25: np.ndarray, q: Query,
                visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows with a positive score and their scores: BM25 plus the weighted BM25 of their
        neighbours (Params.before / after). Only rows holding a query term, and rows within
        reach of one, can score above zero, so only those are computed."""
        n = self.n
        hit = np.flatnonzero((bm25[:n] > 0) & visible)
        # Rows within reach: marked in a bitmap (an O(n) pass that beats a sort of the hits).
        reach = np.zeros(n + 1, bool)
        reach[hit] = True
        for links, weights in ((self.next, q.before), (self.prev, q.after)):
            x: np.ndarray = hit
            for _ in weights:  # a row d after a hit gets that hit as its d-th row before
                x = self.step(links, x)
                reach[x] = True
        reach[n] = False  # the "none" slot
        cand = np.flatnonzero(reach)
        score = bm25[cand]
        for links, weights in ((self.prev, q.before), (self.next, q.after)):
            x = cand
            for w in weights:  # fixed order: before 1, 2, 3, then after 1, 2, 3
                x = self.step(links, x)  # none (-1) reads bm25's last slot, a zero
                score += w * bm25[x]
        keep = score > 0
        return cand[keep], score[keep]

    def _postings(self, seg: Segment, q: Query,
                  keep: tuple[np.ndarray, np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A segment's postings of the query's terms as (local row, tf, query term), each row's
        in ascending term id; only the rows of `keep` (a mask over the segment's rows and
        their local indices) when given, each row then given as its index in those."""
        if seg.terms is not None:
            assert seg.rows is not None
            hit, lo, hi = self._extents(seg, q)
            if hit.size == 0:
                return seg.rows[:0], seg.tf[:0], np.zeros(0, np.int64)
            return postings(seg.rows, seg.tf, lo, hi, hit, keep)
        assert seg.row_terms is not None and seg.row_ptr is not None
        pos = np.searchsorted(q.terms, seg.row_terms)
        pos = np.minimum(pos, q.terms.size - 1)
        found = np.flatnonzero(q.terms[pos] == seg.row_terms)
        rows = np.searchsorted(seg.row_ptr, found, side="right") - 1
        if keep is not None:
            wanted = keep[0][rows]
            found, rows = found[wanted], np.searchsorted(keep[1], rows[wanted])
        return rows, seg.tf[found], pos[found]


def among(shown: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each row of `y` as its index in `shown` (ascending), m (its size) for none and for rows
    not shown; and one more slot, m, stepping to itself."""
    m = shown.size
    i = np.searchsorted(shown, y)
    found = i < m
    found[found] = shown[i[found]] == y[found]
    return np.append(np.where(found, i, m), m)


def postings(rows: np.ndarray, tf: np.ndarray, lo: np.ndarray, hi: np.ndarray, hit: np.ndarray,
             keep: tuple[np.ndarray, np.ndarray] | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A term-major segment's postings of the query terms `hit` (their extents [lo, hi) in
    `rows`, local rows ascending, and `tf`) as (local row, tf, query term): term by term, each
    in row order, so a row's terms come in ascending id; with `keep` (a mask over the
    segment's rows, and the kept rows' indices ascending), only the kept rows' postings, in
    the same order, each row given as its index in the kept rows.

    The kept rows of one user are a few runs of consecutive rows (a conversation is written
    in turns): each term's postings in a run are then one slice, found by two binary
    searches, and the other rows' postings are never read. Where the runs are many, a mask
    over every posting costs less."""
    spans = list(zip(lo.tolist(), hi.tolist()))  # one per query term held here
    if keep is not None:
        kept = keep[1]
        if kept.size == 0:
            return kept[:0], tf[:0], hit[:0]
        head, first, last = runs(kept, rows.dtype)
        if first.size * len(spans) * RUN_COST < int((hi - lo).sum()):
            ends = [(a + np.searchsorted(rows[a:b], first),
                     a + np.searchsorted(rows[a:b], last, side="right")) for a, b in spans]
            start = np.concatenate([f for f, _ in ends])
            count = np.concatenate([e for _, e in ends]) - start
            at = np.repeat(start - (np.cumsum(count) - count), count) + np.arange(count.sum())
            # Inside a run, a row's index in the kept rows is its run's plus its offset.
            shift = np.repeat((head - kept[head])[np.arange(count.size) % head.size], count)
            return rows[at] + shift, tf[at], np.repeat(np.repeat(hit, first.size), count)
    picked = np.concatenate([rows[a:b] for a, b in spans])
    freq = np.concatenate([tf[a:b] for a, b in spans])
    slot = np.repeat(hit, hi - lo)
    if keep is not None:  # a subsequence: each row's terms keep their order
        wanted = keep[0][picked]
        return np.searchsorted(keep[1], picked[wanted]), freq[wanted], slot[wanted]
    return picked, freq, slot


def counted(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray,
         keep: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """How many of `postings`' answer for these terms is each term's (int64 per term, their
    extents [lo, hi) in `rows`): the kept rows' postings counted, by the same runs or mask,
    never gathered (a conversation's own counts, View.frequencies, want no more)."""
    kept = keep[1]
    if kept.size == 0 or lo.size == 0:
        return np.zeros(lo.size, np.int64)
    _, first, last = runs(kept, rows.dtype)
    n = (hi - lo).astype(np.int64)
    if first.size * lo.size * RUN_COST < int(n.sum()):
        spans = [rows[a:b] for a, b in zip(lo.tolist(), hi.tolist())]
        ends = np.array([s.searchsorted(last, "right") for s in spans], np.int64)
        return (ends - np.array([s.searchsorted(first) for s in spans], np.int64)).sum(axis=1)
    at = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(n.sum())
    return np.bincount(np.repeat(np.arange(lo.size), n)[keep[0][rows[at]]], minlength=lo.size)


def runs(kept: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of consecutive rows in `kept` (ascending, not empty): each run's index in
    `kept`, and its first and last row as the postings' own type (a search for another type
    would convert the whole slice first)."""
    cut = np.flatnonzero(kept[1:] - kept[:-1] > 1)
    head = np.concatenate(([0], cut + 1))
    return (head, kept[head].astype(dtype),
            kept[np.concatenate((cut, [kept.size - 1]))].astype(dtype))


# Postings a mask reads for the price of one run's two binary searches (measured ~8 to 30).
RUN_COST = 16


@dataclass(frozen=True, slots=True)
class Statistics:
    """The counts a query's idf and length norm read (bm25.make_query)."""

    n_rows: int
    total_length: int
    df: Callable[[np.ndarray], np.ndarray]


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
        if self.user_id is not None and not self.share_pool:
            live = user == self.user_id  # a dead row's user is -1, no one's: one pass, not two
        else:
            live = user >= 0
        if self.conversation_id is not None:
            live = live & (conv == self.conversation_id)
        if self.during is not None and at is not None:
            live = live & (at >= self.during[0]) & (at < self.during[1])
        if self.user_id is None or not self.share_pool:
            return live, None
        mine = live & (user == self.user_id)
        others = live & (user != self.user_id)
        if self.pool is not None:
            others &= np.isin(user, np.fromiter(self.pool, np.int32, len(self.pool)))
        return mine, others

