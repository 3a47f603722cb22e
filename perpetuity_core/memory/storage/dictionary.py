"""The retrieval dictionary: how a text becomes the term ids its retrieval row is made of.

A `tokenizers` pipeline does the heavy part in Rust: the normaliser (NFKD, strip accents,
lowercase), the pre-tokeniser (runs of letters and digits; everything else separates words) and
a word-level vocabulary that maps every surface form seen in the build corpus to the id of its
stem. Stop words map to id 0 and are not indexed.

A word the vocabulary never saw is still retrievable: it is stemmed with the same light stemmer
the build used, looked up by stem, and otherwise hashed (blake2b, deterministic across processes
and machines) into a reserved range above the vocabulary. Two unseen words can share a bucket;
with 2**22 buckets that is rare and only merges two rare words.

The dictionary ships as package data (`data/retrieval-dictionary.json.gz`) with a version
string; every retrieval row records the version it was derived with, so rows made by an older
dictionary can be found and re-derived. `scripts/build_dictionary.py` rebuilds it from a corpus.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import struct
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.storage.dialect import SQL, Sql

if TYPE_CHECKING:
    from tokenizers.normalizers import Normalizer
    from tokenizers.pre_tokenizers import PreTokenizer

DATA_FILE = "retrieval-dictionary.json.gz"
STOP_ID = 0  # stop words: counted nowhere, scored nowhere
UNK_ID = 0  # the word-level model's id for an unseen surface form, resolved in Python
UNSEEN = 1  # term_of's mark for that id (never a term: term ids of stems start at 2)
FIRST_STEM_ID = 2
HASH_BITS = 22
# Term frequencies are kept in one byte: BM25's tf saturation (k1 = 1.2) makes counts above a
# few dozen indistinguishable, and the byte keeps the arena small. The score is defined with
# this cap, in the scan and in the reference alike.
MAX_TF = 255

# Common English function words: near-zero idf, and a third of all word occurrences, so leaving
# them out halves the postings a query has to read.
STOP_WORDS = frozenset(
    ["a", "about", "above", "after", "again", "against", "all", "am", "an", "and", "any", "are", "as", "at", "be", "because", "been", "before", "being", "below", "between", "both", "but", "by", "can", "could", "did", "do", "does", "doing", "don", "down", "during", "each", "few", "for", "from", "further", "had", "has", "have", "having", "he", "her", "here", "hers", "herself", "him", "himself", "his", "how", "i", "if", "in", "into", "is", "it", "its", "itself", "just", "ll", "me", "might", "more", "most", "my", "myself", "no", "nor", "not", "now", "of", "off", "on", "once", "only", "or", "other", "our", "ours", "ourselves", "out", "over", "own", "re", "s", "same", "she", "should", "so", "some", "such", "t", "than", "that", "the", "their", "theirs", "them", "themselves", "then", "there", "these", "they", "this", "those", "through", "to", "too", "under", "until", "up", "us", "very", "was", "we", "were", "what", "when", "where", "which", "while", "who", "whom", "why", "will", "with", "would", "you", "your", "yours", "yourself", "yourselves", "d", "m", "ve", "y", "o", "isn", "aren", "wasn", "weren", "hasn", "haven", "hadn", "doesn", "didn", "won", "wouldn", "shan", "shouldn", "can", "couldn", "mustn", "let", "also", "get", "got"]
)

# ASCII letters and digits to themselves (upper case lowered), every other byte to a space.
ASCII_FOLD = bytes((c | 0x20 if 65 <= c <= 90 else c) if chr(c).isalnum() and c < 128 else 32
                    for c in range(256))
_ALPHA = re.compile(r"^[a-z]+$")
_VOWEL = re.compile(r"[aeiouy]")


def stem(word: str) -> str:
    """A light stemmer: Porter's step 1a and a simplified 1b (Porter 1980), then a final e.

    Folds plurals and -ed/-ing forms onto one stem ("paints", "painted", "painting" -> "paint";
    "bake", "baked", "baking" -> "bak"), and leaves short words, numbers and mixed tokens alone.
    It errs on the side of folding less than Porter: a wrong merge costs precision on every
    query that touches it, a missed merge only the queries that use the other form.
    """
    if len(word) <= 3 or not _ALPHA.match(word):
        return word
    w = word
    if w.endswith("sses"):
        w = w[:-2]
    elif w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("s") and not w.endswith(("ss", "us", "is")):
        w = w[:-1]
    for suffix in ("ing", "ed"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 3 and _VOWEL.search(w[: -len(suffix)]):
            w = w[: -len(suffix)]
            if len(w) >= 3 and w[-1] == w[-2] and w[-1] not in "lsz":
                w = w[:-1]  # running -> run, stopped -> stop
            break
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    return w


def hash_term(word: str, hash_base: int) -> int:
    """The id of a stem the vocabulary does not hold: a stable hash into the reserved range."""
    h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return hash_base + (h & ((1 << HASH_BITS) - 1))


@dataclass(frozen=True, slots=True)
class Bag:
    """A text as a retrieval row sees it: distinct term ids, their counts, its length."""

    terms: np.ndarray  # int32, sorted ascending, distinct
    counts: np.ndarray  # uint8, capped at MAX_TF
    length: int  # indexed words (stop words excluded): BM25's document length


class Dictionary:
    """Text to term ids. Loading parses a few MB of JSON: do it once, not at import."""

    def __init__(self, tokenizer_json: str, version: str, stems: list[str],
                 term_of: list[int]) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.version = version
        self.stem_ids = {s: FIRST_STEM_ID + i for i, s in enumerate(stems)}
        self.stems = stems  # by id - FIRST_STEM_ID: a known word's stem without the stemmer
        self.hash_base = FIRST_STEM_ID + len(stems)
        # Ids run from 0 to n_terms - 1; frequency tables are dense arrays of this length.
        self.n_terms = self.hash_base + (1 << HASH_BITS)
        # The word-level model numbers surface forms; term_of folds them onto stems.
        self.term_of = np.asarray(term_of, dtype=np.int32)
        # In the model's own order: get_vocab() is a Rust hash map, listed in another order in
        # every process, and a sum over these words in float32 (vectors.Table.terms) moved with it.
        self.word_ids = {w: int(self.term_of[i]) for w, i in
                         sorted(self.tokenizer.get_vocab().items(), key=lambda wi: wi[1])}
        self._ascii_ids = {w.encode(): i for w, i in self.word_ids.items()
                           if w.isascii() and w.isalnum()}
        # The same, except that a word no chain is named by (shorter than three letters, or a
        # number: chains.subjects) counts under its id negated, so one count serves the bag and
        # the chains (packed_counted).
        self._keyed = {w: -i if i and (len(w) < 3 or w.isdigit()) else i
                       for w, i in self._ascii_ids.items()}
        self._normalizer = self.tokenizer.normalizer
        self._unseen: dict[str, int] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> Dictionary:
        return cls.from_bytes(Path(path).read_bytes())

    @classmethod
    def from_bytes(cls, body: bytes) -> Dictionary:
        """A dictionary from its file's bytes (gzipped JSON), as the store keeps it."""
        try:
            data = json.loads(gzip.decompress(body))
            return cls(json.dumps(data["tokenizer"]), data["version"], data["stems"],
                       data["term_of"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"not a retrieval dictionary file: {e}") from e

    def _resolve(self, word: str) -> int:
        """The id of a word the word-level model did not know (the slow, rarer path)."""
        tid = self._unseen.get(word)
        if tid is None:
            if word in STOP_WORDS:
                tid = STOP_ID
            else:
                s = stem(word)
                tid = self.stem_ids.get(s)
                if tid is None:
                    tid = hash_term(s, self.hash_base)
            if len(self._unseen) > 1_000_000:  # bound the cache in a long-lived process
                self._unseen.clear()
            self._unseen[word] = tid
        return tid

    def ids(self, text: str) -> np.ndarray:
        """Term ids of every indexed word of `text`, in order (int32; stop words left out)."""
        return np.array(self.id_list(text), dtype=np.int32)

    def id_list(self, text: str) -> list[int]:
        if not text:
            return []
        if text.isascii():
            # For ASCII text NFKD and accent stripping are the identity and the pre-tokeniser's
            # letters-and-digits runs are exactly [a-z0-9]+ after lowercasing: the same words
            # as the Rust pipeline. One bytes.translate (lowercase, everything else a space)
            # and a split find them several times faster than the pipeline or a regex.
            get = self._ascii_ids.get
            words = text.encode("ascii").translate(ASCII_FOLD).split()
            ids = [get(w, -1) for w in words]
            if -1 in ids:
                resolve = self._resolve
                ids = [resolve(w.decode()) if i < 0 else i
                       for w, i in zip(words, ids, strict=True)]
        else:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            term_of = self.term_of
            ids = [int(term_of[i]) for i in enc.ids]
            if UNK_ID in enc.ids:
                norm = self._normalizer.normalize_str
                for j, (i, (a, b)) in enumerate(zip(enc.ids, enc.offsets, strict=True)):
                    if i == UNK_ID:
                        ids[j] = self._resolve(norm(text[a:b]))
        return [i for i in ids if i != STOP_ID]

    def bag(self, text: str) -> Bag:
        return _bag(self._counts(text))

    def packed(self, text: str) -> Packed:
        """bag(text) as its retrieval row stores it."""
        return _packed(self._counts(text))

    def _counts(self, text: str) -> Counter[int]:
        """A text's count by term id, stop words left out."""
        # Written once per stored item, so counted without materialising the id list: on ASCII
        # text get(word, word) maps known words to ids and leaves unseen ones as bytes keys,
        # all inside Counter's C loop; only distinct unseen words go through Python.
        if text.isascii():
            words = text.encode("ascii").translate(ASCII_FOLD).split()
            counts = Counter(map(self._ascii_ids.get, words, words))
            for w in [k for k in counts if type(k) is bytes]:
                n = counts.pop(w)
                counts[self._resolve(w.decode())] += n
            counts.pop(STOP_ID, None)
            return cast(Counter[int], counts)  # only ids are left
        return Counter(self.id_list(text))

    def packed_counted(self, text: str, head: int | None = None
                       ) -> tuple[Packed, dict[int, int], dict[bytes, int]]:
        """packed(text) of an ASCII text, with what it was counted from, so that the chains
        (chains.counted_subjects) need no count of their own: by term id, the occurrences of
        the vocabulary words of its first `head` characters (all of it by default; a
        vocabulary word's id is its stem's), those no chain is named by under their id
        negated; and the occurrences of its unseen words there."""
        folded = text.encode("ascii").translate(ASCII_FOLD)
        if head is not None and len(folded) > head:
            return self._packed_head_counted(folded, head)
        words = folded.split()
        keyed = Counter(map(self._keyed.get, words, words))
        unseen = {w: keyed.pop(w) for w in [k for k in keyed if type(k) is bytes]}
        known = cast(Counter[int], keyed)  # only ids are left
        counts = known
        # Most texts (9 in 10 of LoCoMo's) hold neither an unseen word nor a negated id: their
        # count is the bag's as it stands, not copied.
        if unseen or min(known, default=0) < 0:
            counts = Counter(known)
            for t in [t for t in known if t < 0]:
                counts[-t] += counts.pop(t)
            for w, n in unseen.items():
                counts[self._resolve(w.decode())] += n
        return _packed(counts), known, unseen

    def _packed_head_counted(self, folded: bytes, head: int
                             ) -> tuple[Packed, dict[int, int], dict[bytes, int]]:
        """packed_counted of a text longer than `head` (its ASCII_FOLD), each word counted
        once: the head's words, then, on a copy of their count, the rest's (counting the whole
        text for the bag and its head again for the subjects cost 8 us a BEAM message,
        averaged: 6 in 100 are longer than chains.SUBJECT_CHARS). A word the cut splits is
        one word of the bag, counted with the rest, and its head part is one of the head's."""
        words = folded[:head].split()
        fragment = None
        cut = head
        # ASCII_FOLD leaves the space the only separator: a word runs across the cut.
        if folded[head - 1] != 32 and folded[head] != 32:
            fragment = words.pop()
            cut -= len(fragment)
        get = self._keyed.get
        keyed = Counter(map(get, words, words))
        counts = Counter(keyed)  # the bag's: the head's words, then the rest's
        rest = folded[cut:].split()
        counts.update(map(get, rest, rest))
        if fragment is not None:
            keyed[get(fragment, fragment)] += 1
        unseen = {w: keyed.pop(w) for w in [k for k in keyed if type(k) is bytes]}
        for k in [k for k in counts if isinstance(k, bytes) or k < 0]:
            n = counts.pop(k)
            counts[self._resolve(k.decode()) if isinstance(k, bytes) else -k] += n
        return _packed(cast(Counter[int], counts)), cast(Counter[int], keyed), unseen

    def words(self, text: str) -> list[str]:
        """The normalised words of `text`, stop words included (for phrase checks and display)."""
        pre = self.tokenizer.pre_tokenizer
        return [w for w, _ in pre.pre_tokenize_str(self._normalizer.normalize_str(text))]


def _bag(counts: Counter[int]) -> Bag:
    """The bag of term counts (stop words left out)."""
    terms = sorted(counts)
    tf = [counts[t] for t in terms]
    length = sum(tf)
    if length > MAX_TF and max(tf) > MAX_TF:  # only a long text can need the cap
        tf = [min(c, MAX_TF) for c in tf]
    return Bag(np.array(terms, dtype=np.int32), np.frombuffer(bytes(tf), dtype=np.uint8), length)


class Packed(NamedTuple):
    """A Bag as a retrieval row stores it: built without numpy, whose arrays cost more to make
    than a row's few dozen terms (7 of a LoCoMo row's 33 us of counting)."""

    terms: bytes  # Bag.terms as little-endian int32
    counts: bytes  # Bag.counts
    length: int


def _packed(counts: dict[int, int]) -> Packed:
    """The packed bag of term counts (ids not negative; stop words, id 0, left out)."""
    terms = sorted(counts)
    if terms and terms[0] == STOP_ID:
        del terms[0]
    tf = list(map(counts.__getitem__, terms))
    length = sum(tf)
    if length > MAX_TF and max(tf) > MAX_TF:  # only a long text can need the cap
        tf = [min(c, MAX_TF) for c in tf]
    return Packed(struct.pack(f"<{len(terms)}i", *terms), bytes(tf), length)


def shipped_path() -> Path:
    return Path(str(resources.files("perpetuity_core") / "data" / DATA_FILE))


@lru_cache(maxsize=1)
def shipped() -> Dictionary:
    """The dictionary shipped with the package, loaded on first use."""
    return Dictionary.from_file(shipped_path())


def build(word_counts: dict[str, int], min_count: int = 2) -> dict:
    """The dictionary's data from the word counts of a corpus (see scripts/build_dictionary.py).

    Stems seen at least `min_count` times are numbered by falling frequency, so the common ones
    get small ids; every surface form of those stems goes into the word-level vocabulary, with
    `term_of` folding it onto its stem's id, so nearly every word resolves without the
    stemmer.
    """
    from tokenizers import Tokenizer, models

    stem_counts: dict[str, int] = {}
    for w, c in word_counts.items():
        if w not in STOP_WORDS:
            s = stem(w)
            stem_counts[s] = stem_counts.get(s, 0) + c
    stems = sorted((s for s, c in stem_counts.items() if c >= min_count),
                   key=lambda s: (-stem_counts[s], s))
    stem_ids = {s: FIRST_STEM_ID + i for i, s in enumerate(stems)}
    vocab: dict[str, int] = {"[UNK]": UNK_ID}
    term_of = [UNSEEN]
    for w in sorted(word_counts):
        tid = STOP_ID if w in STOP_WORDS else stem_ids.get(stem(w))
        if tid is not None:
            vocab[w] = len(term_of)
            term_of.append(tid)
    for w in sorted(STOP_WORDS - vocab.keys()):
        vocab[w] = len(term_of)
        term_of.append(STOP_ID)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = make_normalizer()
    tok.pre_tokenizer = make_pre_tokenizer()
    tokenizer = json.loads(tok.to_str())
    digest = hashlib.blake2b(
        json.dumps([stems, sorted(vocab.items()), term_of]).encode(), digest_size=4
    ).hexdigest()
    return {"version": f"1-{digest}", "stems": stems, "term_of": term_of, "tokenizer": tokenizer}


def make_normalizer() -> Normalizer:
    from tokenizers import normalizers

    return normalizers.Sequence(
        [normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()]
    )


def make_pre_tokenizer() -> PreTokenizer:
    from tokenizers import Regex, pre_tokenizers

    # Words are runs of letters and digits; apostrophes split ("don't" -> "don", "t"), and the
    # leftover fragments are stop words.
    return pre_tokenizers.Split(Regex(r"[^\p{L}\p{N}]+"), behavior="removed")


# --- The live version of a memory


class Live:
    """One memory's live dictionary: the one its rows are derived with, as the database names
    it (the shipped one until read). Each store's handle holds its own (`Database.live`), so
    two memories in one process each follow their own flips."""

    def __init__(self, postgres: bool) -> None:
        self._body = _BODY.postgres if postgres else _BODY.sqlite
        self.current: Dictionary | None = None
        self.missing: set[str] = set()  # live versions whose body the database does not hold

    @property
    def dictionary(self) -> Dictionary:
        return self.current if self.current is not None else shipped()

    def follow(self, conn: Sql) -> Dictionary:
        """The dictionary the database names live, made this memory's (loaded once per
        version): a flip by another process is followed by the next write or catch-up."""
        row = conn.execute("SELECT value FROM setting WHERE key = 'dictionary'").fetchone()
        return self.named(conn, row[0] if row else None)

    def named(self, conn: Sql, version: str | None) -> Dictionary:
        """`follow` for a caller that read the live version (the setting) itself, in a
        statement of its own (index.derive_retrieval's one read a message)."""
        current = self.dictionary
        if version is None or version == current.version or version in self.missing:
            return current
        if version == shipped().version:
            d = shipped()
        elif body := conn.execute(self._body, (version,)).fetchone():
            d = Dictionary.from_bytes(body[0])
        else:
            self.missing.add(version)
            return current
        self.current = d
        return d

    def notice(self, conn: Sql) -> str | None:
        """One line when the memory's rows are not on the dictionary this release ships."""
        (live,) = conn.execute("SELECT value FROM setting WHERE key = 'dictionary'").fetchone()
        ours = shipped().version
        if live == ours:
            return None
        how = ("run `perpetuity memory dictionary rederive` (in the background, the proxy keeps"
               " serving), then `perpetuity memory dictionary flip`")
        if live in self.missing:
            return (f"the memory's rows are on retrieval dictionary {live}, which it does not"
                    f" hold: searches tokenise with the shipped {ours} until re-derived; {how}")
        return (f"the memory's rows are on retrieval dictionary {live}, this release ships"
                f" {ours}; {how}")


_BODY = SQL.both("SELECT body FROM dictionary WHERE version = ?")
