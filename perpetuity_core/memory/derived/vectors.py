"""The semantic half of the dictionary: a static token table shipped as data, and the vector
each retrieval row carries (docs/semantic.md says what the table is and where it comes from).

No model runs. A text's vector is a lookup and a sum: its Llama-2 BPE tokens (stop words and
punctuation left out) looked up in WordLlama's `l2_supercat_256` table (32,000 x 256, fp16),
summed, and stored as int8 scaled to its largest component (DIMS bytes a row). The table and
its tokenizer are read from the `wordllama` wheel's own files: its `WordLlama.load()` looks
for a tokenizer where the wheel has none and then tries the network.

A row's vector is a pure function of its text, written by the retrieval rows' one writer
(index.derive_retrieval) in the row itself, in the message's transaction. A query's is weighed
by rarity instead: each word's tokens count by the word's BM25 idf in the memory (an unseen
word by the highest idf), as the live counts stand when it is asked. Measured on LoCoMo (one
memory per conversation, the ranking's recall_all within 2k / 4k / 8k tokens, fused as
bm25.Params.semantic says): the rows' plain mean with the query's plain mean 0.765 / 0.816 /
0.891 (below BM25 alone at 4k, 0.834); both weighed by the memory's token idf, fixed when each
row was written, 0.802 / 0.864 / 0.921; stop tokens out of the rows and the query weighed by
its words' idf, as shipped, 0.794 / 0.859 / 0.919, with no count kept beside BM25's. A token's
rank in the BPE vocabulary, its norm, or the stem's rank in the retrieval dictionary as a
static rarity all did worse than no weight (0.816-0.823 at 4k). 128 dimensions cost 0.3 points
at 4k, 64 cost 0.7.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Executor
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.storage.dictionary import STOP_WORDS

if TYPE_CHECKING:
    from tokenizers import Tokenizer

DIMS = 256  # bytes a row: the table's width
# The table as the memory's rows were derived with it (the setting `semantic`).
TABLE = "wordllama-0.4.0.post1:l2_supercat_256"
# Characters of a row's text its vector is made of: a long tool result's first screens say
# what it is about, and tokenising 100 kB for one mean cost milliseconds of the writer's time.
ROW_CHARS = 4096
ZERO = bytes(DIMS)  # the vector of a text with no content token


class Table:
    """The token table and its tokenizer, with which tokens count in a row's vector."""

    def __init__(self, embedding: np.ndarray, tokenizer: Tokenizer) -> None:
        self.embedding = embedding.astype(np.float32)
        self.tokenizer = tokenizer
        # Stop words and pieces without a letter or digit carry no topic: left out of rows.
        self.content = np.ones(embedding.shape[0], bool)
        for piece, i in tokenizer.get_vocab().items():
            word = piece.replace("\u2581", "").lower()
            if word in STOP_WORDS or not re.search(r"[^\W_]", word):
                self.content[i] = False

    def row(self, text: str) -> bytes:
        """A row's vector: its content tokens' sum, int8."""
        ids = np.asarray(self.tokenizer.encode(text[:ROW_CHARS], add_special_tokens=False).ids,
                         np.int64)
        ids = ids[self.content[ids]]
        if ids.size == 0:
            return ZERO
        return quantised(self.embedding[ids].sum(axis=0)).tobytes()

    def query(self, words: list[str], weights: np.ndarray) -> np.ndarray | None:
        """A question's vector: each word's tokens weighed by `weights` (one a word), int8;
        None when no word weighs anything."""
        if not words or not (weights > 0).any():
            return None
        v = np.zeros(self.embedding.shape[1], np.float64)
        for enc, w in zip(self.tokenizer.encode_batch(words, add_special_tokens=False),
                          weights.tolist(), strict=True):
            if w > 0 and enc.ids:
                v += w * self.embedding[enc.ids].sum(axis=0, dtype=np.float64)
        q = quantised(v)
        return q if q.any() else None


def quantised(v: np.ndarray) -> np.ndarray:
    """int8, the largest component at 127 (a cosine does not see the scale)."""
    top = float(np.abs(v).max())
    if top == 0.0:
        return np.zeros(v.size, np.int8)
    return np.round(v * (127.0 / top)).astype(np.int8)


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
    """The shipped table, loaded on first use (about 0.1 s)."""
    return load()


# A question's words as the retrieval dictionary splits them (runs of letters and digits).
_WORD = re.compile(r"[^\W_]+")


def query_vector(text: str, idf_of: Callable[[list[str]], np.ndarray]) -> np.ndarray | None:
    """`text`'s vector, each word weighed by `idf_of(words)` (0 for a stop word), looked up
    lowercased: a name's pieces then weigh less than its word's meaning (BM25 has the name).
    LoCoMo recall_all within 4k tokens 0.848 so, 0.843 as written (scripts/eval_retrieval.py,
    its ten conversations in one memory)."""
    words = _WORD.findall(text)
    return table().query([w.lower() for w in words], idf_of(words)) if words else None


def norms(vectors: np.ndarray) -> np.ndarray:
    """1 / |v| of each int8 row (0 for a zero vector), float64."""
    sq = np.einsum("ij,ij->i", vectors, vectors, dtype=np.int64).astype(np.float64)
    out = np.zeros(sq.size)
    np.divide(1.0, np.sqrt(sq), out=out, where=sq > 0)
    return out


BLOCK = 8192  # rows a dot product converts at once (8 MB of int32)


def dots(vectors: np.ndarray, q: np.ndarray, pool: Executor | None = None) -> np.ndarray:
    """Exact integer dot products of int8 rows with an int8 query, int64, a block at a time
    (on `pool`'s threads for many rows: integers, so the same whatever the order)."""
    out = np.empty(vectors.shape[0], np.int64)

    def block(a: int) -> None:
        out[a:a + BLOCK] = np.einsum("ij,j->i", vectors[a:a + BLOCK], q, dtype=np.int32)

    starts = range(0, vectors.shape[0], BLOCK)
    if pool is not None and len(starts) > 4:
        list(pool.map(block, starts))
    else:
        for a in starts:
            block(a)
    return out


def cosines(vectors: np.ndarray, inv: np.ndarray, q: np.ndarray,
            pool: Executor | None = None) -> np.ndarray:
    """Cosine of each row with the query, negatives at zero (float64)."""
    qn = float(np.sqrt(np.dot(q.astype(np.int64), q.astype(np.int64))))
    c = dots(vectors, q, pool) * inv / qn
    return np.maximum(c, 0.0, out=c)


def matrix(blob: bytes, n: int) -> np.ndarray:
    """n rows' vectors read back from their concatenated blobs."""
    v = np.frombuffer(blob, np.int8)
    if v.size != n * DIMS:
        raise AssertionError("semantic vectors read cut or missing")
    return v.reshape(n, DIMS)
