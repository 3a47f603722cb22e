"""The score as array maths: BM25 with conversational context, and the top-k merge (memory.scan
explains the formula and the measured choices).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from perpetuity_core.memory.derived import vectors
from perpetuity_core.memory.storage.dictionary import Dictionary


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

    `semantic` weighs the semantic half (vectors.py): a row of a conversation holding one of
    the best lexical rows (view.SEMANTIC_FROM) scores its score above plus semantic * best *
    max(cosine, 0), `best` the best score above among the rows visible: the two halves
    min-max normalised (the lexical minimum is 0), in the lexical score's units, so the
    frame's breadth (cap.py) reads them as before. When no row scores, nothing is added. 0
    turns it off. Picked on LoCoMo with every visible row fused (scripts/eval_retrieval.py: its
    ten conversations, recall_all within 2k/4k/8k tokens): 0 gives 0.775/0.834/0.881, 1.0
    0.782/0.848/0.909, 1.5 0.784/0.842/0.909, 2.0 0.782/0.841/0.909, 3.0 0.769/0.838/0.900.

    `expand` bridges words lexically, in every conversation (with `semantic` on): each query
    term brings its nearest terms by the table that the memory holds (expanded), each counted
    `expand` * its cosine times (docs/tuning.md: 0.3 and 0.5 measured).

    `feedback` bridges a second hop (pseudo-relevance feedback, fed_back): the terms the best
    rows of a first ranking hold and the question does not, searched again at that fraction
    of a question term's weight, re-order the best row's conversation (scan.Scanner._top).
    0 turns it off.
    """

    k1: float = 0.9
    b: float = 0.4
    before: tuple[float, ...] = (0.5, 0.3, 0.2)
    after: tuple[float, ...] = (0.3, 0.2, 0.1)
    semantic: float = 1.0
    expand: float = 0.3
    feedback: float = 0.2


def idf(n_rows: int, df: np.ndarray) -> np.ndarray:
    """Okapi idf with Lucene's +1 inside the log, so no term ever weighs below zero."""
    df = df.astype(np.float64)
    return np.log1p((n_rows - df + 0.5) / (df + 0.5))


@dataclass(frozen=True, slots=True)
class Near:
    """The nearest terms by the table (vectors.Table.near) of a query's known terms, as
    `expanded` reads them: each term's list in turn, best first, concatenated (`ids`, their
    cosines and the query term's count), the lists' `lengths`, and whether an id is a query
    term itself (`asked`); `read`, the query's terms and these ascending, each once, and where
    the terms (`at_terms`) and the ids (`at_ids`) are in it: one document-frequency read
    serves both."""

    ids: np.ndarray  # int32
    cos: np.ndarray  # float64
    count: np.ndarray  # int64
    lengths: np.ndarray  # int64
    asked: np.ndarray  # bool
    read: np.ndarray  # int32, ascending
    at_terms: np.ndarray
    at_ids: np.ndarray


@dataclass(frozen=True, slots=True)
class Words:
    """A query's text as the live dictionary reads it, whatever the statistic it is scored
    against: its distinct terms ascending, their counts, and their nearest terms when the
    table bridges words (`near`, Params.expand). Read once a search: its second query making
    (scan.Scanner._top, a conversation's own counts) reads the same words."""

    terms: np.ndarray  # int32, ascending
    qtf: np.ndarray  # int64
    near: Near | None = None


@dataclass(slots=True)
class Query:
    """A query resolved against the pooled statistic: distinct terms ascending, their weights."""

    terms: np.ndarray  # int32, ascending
    weights: np.ndarray  # float64: qtf * idf * (k1 + 1)
    a: float  # k1 * (1 - b)
    c: float  # k1 * b / avgdl
    before: tuple[float, ...] = ()
    after: tuple[float, ...] = ()
    vec: np.ndarray | None = None  # int8 (vectors.py), None with the semantic half off
    semantic: float = 0.0  # Params.semantic
    n_rows: int = 0  # the pooled statistic's rows, for the idf of terms fed back
    words: Words | None = None  # what it was made from (make_query), for another statistic

    @property
    def empty(self) -> bool:
        return self.terms.size == 0  # the semantic half looks only where the words found


def words_of(d: Dictionary, text: str, params: Params,
             held: Callable[[], np.ndarray] | None = None) -> Words:
    """`text` tokenised by `d` (the live dictionary), with its known terms' nearest terms
    when the table bridges words (Params.expand): among the terms `held()` names (a mask over
    the term ids: those a row holds, a df above zero by the statistic every query making of
    the search counts within), every term without it."""
    # Counted in Python: a question's few ids cost a third of np.unique's 22 us so.
    counts = Counter(d.id_list(text))
    terms = np.array(sorted(counts), np.int32)
    qtf = np.array([counts[t] for t in terms.tolist()], np.int64)
    if not counts or params.semantic <= 0 or params.expand <= 0:
        return Words(terms, qtf)
    table = vectors.table()
    known = [(t, f) for t, f in zip(terms.tolist(), qtf.tolist(), strict=True) if t < d.hash_base]
    if known:
        table.cover(d, None if held is None else held())
    near = [table.near(d, t) for t, _ in known]
    ids = np.concatenate([i for i, _ in near] + [np.zeros(0, np.int32)])
    every = np.union1d(terms, ids).astype(np.int32)
    lengths = np.array([i.size for i, _ in near], np.int64)
    asked = terms[np.minimum(np.searchsorted(terms, ids), terms.size - 1)] == ids
    return Words(terms, qtf, Near(
        ids, np.concatenate([c for _, c in near] + [np.zeros(0)]),
        np.repeat(np.array([f for _, f in known], np.int64), lengths), lengths, asked, every,
        np.searchsorted(every, terms), np.searchsorted(every, ids)))


def make_query(d: Dictionary, text: str, df_of: Callable[[np.ndarray], np.ndarray], n_rows: int,
               total_length: int, params: Params, words: Words | None = None,
               held: Callable[[], np.ndarray] | None = None) -> Query:
    """`text` tokenised by `d` (the live dictionary); `df_of(terms) -> df array` reads the
    pooled document frequencies, `held()` which terms they count above zero, when known
    (words_of). `words`: the text as an earlier query making of the same search read it (its
    Query.words), not read again."""
    if n_rows == 0:
        return Query(np.zeros(0, np.int32), np.zeros(0), 0.0, 0.0, n_rows=n_rows)
    words = words or words_of(d, text, params, held)
    if words.terms.size == 0:
        return Query(np.zeros(0, np.int32), np.zeros(0), 0.0, 0.0, n_rows=n_rows)
    terms, qtf = words.terms, words.qtf
    k1, b = params.k1, params.b
    if words.near is None:
        df = np.asarray(df_of(terms), dtype=np.int64)
    else:  # the terms' and their nearest terms' in one read
        df_read = np.asarray(df_of(words.near.read), dtype=np.int64)
        df = df_read[words.near.at_terms]
    vec = None
    if params.semantic > 0:
        # Each term by its idf, a term no row holds at the highest: a word the memory never
        # said still carries its meaning.
        vec = vectors.table().query(d, terms, qtf * idf(n_rows, df))
    if words.near is not None:
        terms, qtf, df = expanded(terms, qtf, df, words.near, df_read, params.expand)
    if not (keep := df > 0).all():  # a term no row holds scores every row zero
        terms, qtf, df = terms[keep], qtf[keep], df[keep]
    avgdl = max(total_length / n_rows, 1e-9)
    w = idf(n_rows, df)
    return Query(terms, qtf * w * (k1 + 1), k1 * (1 - b), k1 * b / avgdl,
                 params.before, params.after, vec, params.semantic, n_rows, words)


# Pseudo-relevance feedback (fed_back): the best rows of the first ranking read, and the most
# terms they bring (docs/tuning.md, "Pseudo-relevance feedback": 3 to 20 rows, 5 to 50 terms).
FEEDBACK_ROWS = 10
FEEDBACK_TERMS = 20
# A row longer than this (in terms) feeds nothing back: a long reply holds many topics, and
# its words brought other long replies into BEAM's frames (docs/tuning.md).
FEEDBACK_LENGTH = 200


# A row's terms ascending, their counts, its length and conversation (scan.bags reads them).
Bag = tuple[np.ndarray, np.ndarray, int, int]


def fed_back(q: Query, bags: Sequence[Bag],
             scores: Sequence[float], df_of: Callable[[np.ndarray], np.ndarray],
             params: Params) -> Query:
    """`q` with the terms its best rows hold and it does not (a relevance model, Lavrenko &
    Croft 2001, as RM3 adds it to the query: Abdul-Jaleel et al., TREC 2004). `bags` are those
    rows' (terms ascending, counts, length, conversation) in rank order, `scores` their
    first-pass scores. Only the first one's conversation feeds back (in a person's memory the
    others' words pulled their own rows in), and no row longer than FEEDBACK_LENGTH. A term
    weighs the sum over the rows of score * count / length, times its idf; the FEEDBACK_TERMS
    heaviest (ties by id) are counted `params.feedback` * weight / the heaviest's times, the
    question's own terms as they were: a multi-hop question's second turn shares words with
    its first evidence turn, not with the question."""
    if not bags:
        return q
    kept = [(b, s) for b, s in zip(bags, scores, strict=True)
            if b[2] <= FEEDBACK_LENGTH and b[3] == bags[0][3]]
    if not kept:
        return q
    terms = np.concatenate([t for (t, _, _, _), _ in kept])
    # Added row by row in rank order (bincount sums in input order), as the reference does.
    part = np.concatenate([s * c.astype(np.float64) / max(n, 1)
                           for (_, c, n, _), s in kept])
    new = np.setdiff1d(np.unique(terms), q.terms, assume_unique=True)
    if new.size == 0:
        return q
    at = np.searchsorted(new, terms)
    mine = (at < new.size) & (new[np.minimum(at, new.size - 1)] == terms)
    mass = np.bincount(at[mine], weights=part[mine], minlength=new.size)
    df = np.asarray(df_of(new), np.int64)
    w = idf(q.n_rows, df)
    weight = np.where(df > 0, mass * w, 0.0)
    pick = np.lexsort((new, -weight))[:FEEDBACK_TERMS]
    pick = pick[weight[pick] > 0]
    if pick.size == 0:
        return q
    pick.sort()  # ascending id, as the query's terms
    count = params.feedback * weight[pick] / weight[pick].max()
    every = np.concatenate((q.terms, new[pick].astype(np.int32)))
    order = np.argsort(every, kind="stable")
    weights = np.concatenate((q.weights, count * w[pick] * (params.k1 + 1)))
    return Query(every[order], weights[order], q.a, q.c, q.before, q.after, q.vec, q.semantic,
                 q.n_rows)


def expanded(terms: np.ndarray, qtf: np.ndarray, df: np.ndarray, near: Near,
             df_read: np.ndarray, weight: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query's terms (ascending, their counts and dfs) and, for each, its vectors.NEAR
    nearest terms by the table (`near`, Table.near; `df_read` the dfs of near.read) that some
    row holds and the query does not, each counted `weight` * cosine * the query term's count
    (the most, when several bring it): the memory's own words for what the question says in
    others ("puppy" for "dog"), found by BM25 in every conversation, at a fraction of the
    question's own words' weight."""
    if near.ids.size == 0:
        return terms, qtf.astype(np.float64), df
    # In arrays, not a Python step per nearest term (~160 a question, twice a search): each
    # query term's first NEAR that some row holds and the query (ascending) does not, by a
    # running count of those within its own list.
    ok = (df_read[near.at_ids] > 0) & ~near.asked
    run = np.cumsum(ok)
    before = np.concatenate(([0], run))[np.cumsum(near.lengths) - near.lengths]
    pick = ok & (run - np.repeat(before, near.lengths) <= vectors.NEAR)
    brought: dict[int, float] = {}
    for u, c, n in zip(near.ids[pick].tolist(), near.cos[pick].tolist(),
                       near.count[pick].tolist(), strict=True):
        brought[u] = max(brought.get(u, 0.0), weight * c * n)
    if not brought:
        return terms, qtf.astype(np.float64), df
    new = np.array(sorted(brought), np.int32)
    all_terms = np.concatenate((terms, new))
    order = np.argsort(all_terms, kind="stable")
    counts = np.concatenate((qtf.astype(np.float64), [brought[u] for u in new.tolist()]))
    dfs = np.concatenate((df, df_read[np.searchsorted(near.read, new)]))
    return all_terms[order], counts[order], dfs[order]


def contributions(q: Query, slot: np.ndarray, tf: np.ndarray, length: np.ndarray) -> np.ndarray:
    """w * tf / (tf + a + c * |d|) per posting, in float64 (the reference uses the same order)."""
    tf = tf.astype(np.float64)
    return q.weights[slot] * tf / (tf + (q.a + q.c * length))


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

