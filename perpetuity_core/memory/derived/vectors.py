"""The semantic half of the dictionary: a static token table shipped as data, and the vector
each retrieval row carries (docs/semantic.md says what the table is and where it comes from).

No model runs. WordLlama's `l2_supercat_256` table (32,000 Llama-2 BPE tokens x 256, fp16) is
read from the `wordllama` wheel's own files (its `WordLlama.load()` looks for a tokenizer where
the wheel has none, then tries the network). From it each term of the retrieval dictionary gets
a vector once (`Table.terms`: its surface forms' token sums), and a row's vector is its bag's
terms' vectors summed by count (stop words are in no bag), stored as int8 scaled to its largest
component (DIMS bytes a row). It is written with the row, by the retrieval rows' one writer
(index.derive_retrieval), in the message's transaction; a flip (maintenance.py) re-derives it
with the row. A question's vector weighs its terms by their BM25 idf in the memory (a term no
row holds by the highest), as the counts stand when it is asked.

Measured on LoCoMo (scripts/eval_retrieval.py, its ten conversations in one memory; the
ranking's recall_all within 2k / 4k / 8k tokens, fused as bm25.Params.semantic says; BM25
alone 0.775 / 0.834 / 0.881). Rows and question as plain means of their BPE tokens: 0.765 /
0.816 / 0.891, below BM25 at 4k. Weighed by rarity, on the question's side (its words' idf)
with stop words out of the rows: 0.780 / 0.848 / 0.908 from the rows' own BPE tokens, 0.782 /
0.848 / 0.909 from their bags as shipped, where tokenising every text a second time cost more
CPU than the rest of its write (bench_ingest: 146 against ~40 us a LoCoMo message). Weighing
the rows too, by the memory's token idf fixed when each was written, did 0.5 point better at
4k in a one-off measure, at the price of a count kept beside BM25's. A static rarity (the
token's rank in the BPE vocabulary, its norm, the stem's rank in the retrieval dictionary) did
worse than none (0.816-0.823 at 4k); a floor under the cosine (0.1 to 0.3) cost 0.8 to 2.2
points; 128 dimensions 0.3, 64 dimensions 0.7. In sequence (perpetuity eval), weighing a row's
terms as SIF does, by the dictionary's order of stems read as Zipf's law, with or without the
common component, gained LoCoMo at most 0.45 point and cost BEAM's frame 0.8 to 1.1
(docs/tuning.md): rows stay plain sums.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.storage.dictionary import Dictionary

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DIMS = 256  # bytes a row: the table's width
ZERO = bytes(DIMS)  # the vector of a row with no term the table knows
# A question's term also looks for the dictionary's terms nearest it by the table (Table.near,
# bm25.expanded): at most NEAR of those at a cosine of NEAR_MIN or more that the memory holds
# (docs/tuning.md: 3 at 0.5 and 5 at 0.4 measured).
NEAR = 5
NEAR_MIN = 0.4
# Table.near's product over the rows it looks at, copied out, costs less than over every row
# below this share of them (3,800 of 11,490: 0.33 ms against 0.47; 5,000: 0.43 against 0.45).
GATHER_BELOW = 0.4
_ONES = b"\x01" * 512  # a bag's counts when each of its terms occurs once


class Table:
    """The token table and its tokenizer, and the vectors of a retrieval dictionary's terms."""

    def __init__(self, embedding: np.ndarray, tokenizer: Tokenizer) -> None:
        self.embedding = embedding.astype(np.float32)
        self.tokenizer = tokenizer
        self._terms: dict[str, np.ndarray] = {}
        # Each term's nearest terms among the first `upto` of the terms looked at (`_looked`,
        # in the order `cover` added them), for the dictionary version `_near_of`.
        self._near: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
        self._near_of = ""
        self._looked = np.zeros(0, np.int64)
        self._covered = np.zeros(0, bool)  # over the term ids: among `_looked`
        self._lock = threading.Lock()  # the frame's searches and the recall tools' threads

    def terms(self, d: Dictionary) -> np.ndarray:
        """A vector per term id of `d` below its hashed range (float32, unit length; zero for
        stop words): the mean of its surface forms' token sums, each at unit length. Made once
        per dictionary (about 0.1 s), so a row's vector is read from the bag its retrieval row
        already counted: tokenising every text again cost more than the rest of its write."""
        held = self._terms.get(d.version)
        if held is not None:
            return held
        words = [w for w, t in d.word_ids.items() if t > 0]
        out = np.zeros((d.hash_base, self.embedding.shape[1]), np.float32)
        for enc, w in zip(self.tokenizer.encode_batch(words, add_special_tokens=False), words,
                          strict=True):
            v = self.embedding[enc.ids].sum(axis=0)
            if (n := float(np.linalg.norm(v))) > 0:
                out[d.word_ids[w]] += v / n
        norm = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norm, out=out, where=norm > 0)
        self._terms = {d.version: out}  # one dictionary is live at a time
        return out

    def cover(self, d: Dictionary, held: np.ndarray | None) -> None:
        """Look among the terms `held` names (a mask over the term ids below d.hash_base: those
        some row holds; None: every term) from now on too, when `near` is asked. A mask of
        another dictionary's (counts read before a flip was followed) names every term."""
        with self._lock:
            self._follow(d)
            if held is None or held.size != self._covered.size:
                held = np.ones(self._covered.size, bool)
            new = np.flatnonzero(held & ~self._covered)
            if new.size:
                self._looked = np.concatenate((self._looked, new))
                self._covered[new] = True

    def near(self, d: Dictionary, term: int) -> tuple[np.ndarray, np.ndarray]:
        """The terms nearest `term` by the table among those `cover` named so far: those at a
        cosine of NEAR_MIN or more, best first (ties by id), `term` itself left out, as (ids
        int32, cosines float64). A term's cosines are found once per dictionary (a product of
        its vector with the others' by einsum's own loop, 0.47 ms for all 11,490 terms:
        OpenBLAS's threaded one took 0.1 ms idle and 19 on average on a loaded machine), and
        only with the terms a memory holds (bm25.expanded reads no other), each einsum's row
        the same float32 sum however many rows it is given; a term held later is looked at
        then. A memory asks about the same words again and again."""
        with self._lock:
            self._follow(d)
            ids, cos, upto = self._near.get(term, (np.zeros(0, np.int32), np.zeros(0), 0))
            if upto == self._looked.size:
                return ids, cos
            rows = self._looked[upto:]
            table = self.terms(d)
            if rows.size > GATHER_BELOW * table.shape[0]:  # no copy of most of the table
                sims = np.einsum("ij,j->i", table, table[term]).astype(np.float64)[rows]
            else:
                sims = np.einsum("ij,j->i", table[rows], table[term]).astype(np.float64)
            keep = (sims >= NEAR_MIN) & (rows != term)
            if keep.any():  # most terms held since are near no term asked of
                ids = np.concatenate((ids, rows[keep].astype(np.int32)))
                cos = np.concatenate((cos, sims[keep]))
                order = np.lexsort((ids, -cos))
                ids, cos = ids[order], cos[order]
            self._near[term] = ids, cos, self._looked.size
            return ids, cos

    def _follow(self, d: Dictionary) -> None:
        # One dictionary is live at a time: another's nearest terms are dropped.
        if self._near_of != d.version:
            self._near, self._near_of = {}, d.version
            self._looked, self._covered = np.zeros(0, np.int64), np.zeros(d.hash_base, bool)

    def row(self, d: Dictionary, terms: bytes, counts: bytes) -> bytes:
        """A row's vector from its retrieval row's bag (terms ascending, their counts): the
        terms' vectors summed by count, int8. A hashed term (a word the dictionary never saw)
        has none: BM25 ranks by it. Paid on every write (a tenth of a LoCoMo message's CPU),
        so in as few numpy calls as it takes: no search unless the bag holds a hashed term,
        a plain sum when every count is one (most rows), the scale applied in place."""
        t = np.frombuffer(terms, "<i4")
        n = t.size
        if n == 0 or t[0] >= d.hash_base:
            return ZERO
        if t[-1] >= d.hash_base:
            n = int(np.searchsorted(t, np.int32(d.hash_base)))
            t = t[:n]
        table = self.terms(d)
        if n <= len(_ONES) and counts.startswith(_ONES[:n]):
            s = table[t].sum(axis=0)
        else:
            s = np.einsum("i,ij->j", np.frombuffer(counts, np.uint8, n).astype(np.float32),
                          table[t])
        top = max(float(s.max()), -float(s.min()))
        if top == 0.0:
            return ZERO
        s *= 127.0 / top
        return s.round().astype(np.int8).tobytes()

    def query(self, d: Dictionary, terms: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        """A question's vector: its terms' vectors by `weights` (qtf * idf), int8; None when
        none has a vector."""
        known = terms < d.hash_base
        if not (known & (weights > 0)).any():
            return None
        q = quantised(np.einsum("i,ij->j", weights[known],
                                self.terms(d)[terms[known]].astype(np.float64)))
        return q if q.any() else None


def quantised(v: np.ndarray) -> np.ndarray:
    """int8, the largest component at 127 (a cosine does not see the scale)."""
    top = max(float(v.max()), -float(v.min()))
    if top == 0.0:
        return np.zeros(v.size, np.int8)
    return np.rint(v * (127.0 / top)).astype(np.int8)


def load() -> Table:
    """The table from the installed `wordllama` wheel's files, nothing fetched."""
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    try:
        root = resources.files("wordllama")
        weights = load_file(str(root / "weights" / "l2_supercat_256.safetensors"))
        tokenizer = Tokenizer.from_file(
            str(root / "tokenizers" / "l2_supercat_tokenizer_config.json"))
    except (ModuleNotFoundError, OSError, ValueError) as e:
        raise ConfigError(f"the semantic table (wordllama 0.4.0.post1) cannot be read: {e}") from e
    return Table(weights["embedding.weight"], tokenizer)


@lru_cache(maxsize=1)
def table() -> Table:
    """The shipped table, loaded on first use (about 0.3 s)."""
    return load()


def norms(vectors: np.ndarray) -> np.ndarray:
    """1 / |v| of each int8 row (0 for a zero vector), float64."""
    sq = np.einsum("ij,ij->i", vectors, vectors, dtype=np.int64).astype(np.float64)
    out = np.zeros(sq.size)
    np.divide(1.0, np.sqrt(sq), out=out, where=sq > 0)
    return out


BLOCK = 8192  # rows converted to float32 at once (8 MB)


def dots(vectors: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Dot products of int8 rows with an int8 query, exact, as int64: in float32 a block at a
    time, exact whatever the order of its additions, each product and every partial sum being
    an integer below 2**24 (256 * 127 * 127). einsum's own float32 loop, not BLAS: a matrix
    times a vector through OpenBLAS's threads took 2.4 ms for 1,800 rows on a loaded 2-core
    machine, einsum 0.09 (an int8 einsum into int32 0.59)."""
    out = np.empty(vectors.shape[0], np.int64)
    qf = q.astype(np.float32)
    for a in range(0, vectors.shape[0], BLOCK):
        out[a:a + BLOCK] = np.einsum("ij,j->i", vectors[a:a + BLOCK].astype(np.float32), qf)
    return out


def cosines(vectors: np.ndarray, inv: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Cosine of each row with the query, negatives at zero (float64)."""
    qn = float(np.sqrt(np.dot(q.astype(np.int64), q.astype(np.int64))))
    c = dots(vectors, q) * inv / qn
    return np.maximum(c, 0.0, out=c)


def matrix(blob: bytes, n: int) -> np.ndarray:
    """n rows' vectors read back from their concatenated blobs."""
    v = np.frombuffer(blob, np.int8)
    if v.size != n * DIMS:
        raise AssertionError("semantic vectors read cut or missing")
    return v.reshape(n, DIMS)
