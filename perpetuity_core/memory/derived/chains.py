"""The subject chains (`chain`), derived for the recall tools, with one writer.

Every text row joins the chains of its subjects (`subjects`: its rarest non-trivial words, at
most SUBJECTS a row), ordered by when it was said. `derive_chains` writes them from the store's
writer a batch of messages at a time (Store.flush), up to a cursor, with the subjects counted
when each row's bag was (`note`: a text is not split and counted twice); memory_chains reads them
(`chain_of`) and derives the rows past the cursor itself, so a row is in its chains from the
moment it is stored, and a fact and its later updates are one chain with the latest state last.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Sequence

from perpetuity_core.memory.storage import dictionary
from perpetuity_core.memory.storage.dialect import SQL, Rows, Sql, marks
from perpetuity_core.memory.storage.dictionary import Dictionary
from perpetuity_core.memory.storage.store import BATCH_ROWS, Database
from perpetuity_core.wire.conversation import Kind

# Chains. A row's subjects are its words that are neither stop words nor among the commonest
# stems of the dictionary's corpus (ids are numbered by falling corpus frequency: "time",
# "make", "use", "work" say nothing about what a row is about), nor numbers or two-letter
# fragments; of those, the most repeated, then the rarest, at most SUBJECTS a row, so a chain
# row costs a few dozen bytes and a long text joins only the chains of what it is most about.
SUBJECTS = 6
COMMON_STEMS = 50
SUBJECT_CHARS = 4_000  # a long text's subject is in its opening: the rest is not read


def chain_of(db: Database, user_id: int | None, stems: list[str]) -> tuple[list[int], int]:
    """The chain of rows about `stems`: the rows in the most of their chains (in all of them
    when any row is), ordered by when they were said, then by item id; and how many they
    share. Rows past the chains' cursor (at most a batch, see Store.flush) are chained here,
    in the same snapshot as the table, so none is missed while its batch is pending."""
    mark = "%s" if db.postgres else "?"
    # Everyone's chains for None (a personal proxy's asker: the whole file is theirs).
    mine = "" if user_id is None else f"user_id = {mark} AND "
    args: list[int] = [] if user_id is None else [user_id]
    with db.snapshot("read the chains") as conn:
        rows = conn.execute(
            f"SELECT item_id, max(at), count(*) FROM chain WHERE {mine}term IN"
            f" ({marks(db.postgres, len(stems))}) GROUP BY item_id", (*args, *stems)).fetchall()
        (after,) = conn.execute("SELECT seq FROM derived WHERE name = 'chain'").fetchone()
        pending = text_rows(db, conn, after, None, user_id)
    found = {i: (at, n) for i, at, n in rows}
    wanted = set(stems)
    for i, _, at, text in pending:
        if n := len(wanted.intersection(subjects(db.dictionary, text))):
            found[i] = (at, n)  # a row re-derived since it was chained has the same subjects
    if not found:
        return [], 0
    best = max(n for _, n in found.values())
    return [i for i, (_, n) in sorted(found.items(), key=lambda r: (r[1][0], r[0]))
            if n == best], best


def subject_words(d: Dictionary, text: str) -> tuple[dict[str, int], dict[str, str]]:
    """The words of `text` that can be subjects, by stem: occurrences, and the first form seen."""
    text = text[:SUBJECT_CHARS]
    # ASCII text is split as Dictionary.id_list splits it (the same words as the tokenizer's
    # pipeline, several times faster); anything else goes through the pipeline.
    words: Iterable[bytes | str] = (
        text.encode("ascii").translate(dictionary.ASCII_FOLD).split() if text.isascii()
        else d.words(text))
    counts: dict[str, int] = {}
    forms: dict[str, str] = {}
    cache = _SUBJECT_STEM.setdefault(d.version, {})
    # Counter counts in C, in order of first occurrence; stems are then looked up per distinct
    # word only (a text repeats most of its words).
    for w, n in Counter(words).items():
        if w in cache:
            known = cache[w]
        else:
            known = cache[w] = _subject_stem(d, w.decode() if isinstance(w, bytes) else w)
        if known is not None:
            stem, form = known
            if stem in counts:
                counts[stem] += n
            else:
                counts[stem] = n
                forms[stem] = form
    if len(cache) > 1_000_000:  # bound the cache in a long-lived process
        cache.clear()
    return counts, forms


# Per dictionary version (a stem's rank decides), word -> (its stem, the word) when the word can
# be a subject, None when it cannot: stemming every word of every stored row was most of the
# chains' write cost.
_SUBJECT_STEM: dict[str, dict[bytes | str, tuple[str, str] | None]] = {}
# The same, word -> its stem or None, as `subjects` counts them.
_SUBJECT_OF: dict[str, dict[bytes | str, str | None]] = {}


def _subject_stem(d: Dictionary, word: str) -> tuple[str, str] | None:
    if len(word) < 3 or word.isdigit() or word in dictionary.STOP_WORDS:
        return None
    s = dictionary.stem(word)
    return None if stem_rank(d, s) < dictionary.FIRST_STEM_ID + COMMON_STEMS else (s, word)


def _subject_of(d: Dictionary, word: str) -> str | None:
    """_subject_stem's stem: for a word the dictionary knows, its term id is its stem's
    (dictionary.build folds every form onto it), so the stemmer runs only on unknown words
    (a fresh writer meets a new word about every message)."""
    if len(word) < 3 or word.isdigit() or word in dictionary.STOP_WORDS:
        return None
    tid = d.word_ids.get(word, dictionary.STOP_ID)
    s = d.stems[tid - dictionary.FIRST_STEM_ID] if tid >= dictionary.FIRST_STEM_ID else (
        dictionary.stem(word))
    return None if stem_rank(d, s) < dictionary.FIRST_STEM_ID + COMMON_STEMS else s


def subjects(d: Dictionary, text: str) -> list[str]:
    """The stems of the chains a text row joins: its most repeated subject words, then the
    rarest (a stem the corpus never saw counts rarest), at most SUBJECTS; ties by stem."""
    # subject_words' counts, taken in C: every stored text row is chained (the chains' write
    # cost was mostly this Python loop per distinct word), so the words the cache has not seen
    # are found as a set difference, then Counter maps and counts them all by stem.
    text = text[:SUBJECT_CHARS]
    words: Sequence[bytes | str] = (
        text.encode("ascii").translate(dictionary.ASCII_FOLD).split() if text.isascii()
        else d.words(text))
    cache = _SUBJECT_OF.setdefault(d.version, {})
    for w in set(words).difference(cache):
        cache[w] = _subject_of(d, w.decode() if isinstance(w, bytes) else w)
    counts = Counter(map(cache.__getitem__, words))
    if len(cache) > 1_000_000:  # bound the cache in a long-lived process
        cache.clear()
    return _top(d, counts.items())


def counted_subjects(d: Dictionary, known: dict[int, int], unseen: dict[bytes, int]) -> list[str]:
    """subjects(d, text) from the counts its bag was made from (Dictionary.packed_counted), of
    an ASCII text's first SUBJECT_CHARS characters: a vocabulary word's id is its stem's and
    its rank (dictionary.build), so only the unseen words need the stemmer."""
    floor = dictionary.FIRST_STEM_ID + COMMON_STEMS
    fresh: dict[str, int] = {}  # stems the corpus never saw
    if unseen:
        known = dict(known)
        cache = _SUBJECT_OF.setdefault(d.version, {})
        for w, n in unseen.items():
            if w not in cache:
                cache[w] = _subject_of(d, w.decode())
            if (s := cache[w]) is None:
                continue
            if (t := d.stem_ids.get(s)) is None:
                fresh[s] = fresh.get(s, 0) + n
            else:
                known[t] = known.get(t, 0) + n
    stems = d.stems
    if fresh:
        return _top(d, [*((stems[t - dictionary.FIRST_STEM_ID], n) for t, n in known.items()
                          if t >= floor), *fresh.items()])
    # A vocabulary stem's rank is its id: count and id packed in one int sort as _top's
    # (-count, -rank) does, without a tuple or a rank lookup a candidate.
    top = sorted([n << 32 | t for t, n in known.items() if t >= floor], reverse=True)
    return [stems[(k & 0xFFFFFFFF) - dictionary.FIRST_STEM_ID] for k in top[:SUBJECTS]]


def _top(d: Dictionary, counts: Iterable[tuple[str | None, int]]) -> list[str]:
    """At most SUBJECTS of the stems counted (None is no subject): the most repeated, then the
    rarest (a stem the corpus never saw counts rarest); ties by stem."""
    rank, unseen = d.stem_ids, d.hash_base
    # sorted, not heapq.nsmallest: a row has a few dozen candidates, and sorting them in C
    # costs less than the heap's Python; the keys are distinct (stems), so the order is one.
    return [s for _, _, s in sorted([(-n, -rank.get(s, unseen), s)
                                     for s, n in counts if s])[:SUBJECTS]]


# The subjects the store's writer counted while deriving rows (index.derive_retrieval, from the
# count their bag was made from), by database: (dictionary version, item id -> subjects). The
# next batch takes them (derive_chains) instead of counting those texts again; a row it does not
# find there, or one counted under another version, is counted from its text. By item id, not
# by text: an item's text never changes, and the batch hashed every text it read back (2 us a
# BEAM message).
_NOTED: weakref.WeakKeyDictionary[Database, tuple[str, dict[int, list[str]]]] = (
    weakref.WeakKeyDictionary())
NOTED_ROWS = 4 * BATCH_ROWS  # a writer with no batch taking them (an ablation) stops there


def note(db: Database, version: str, item_id: int, found: list[str]) -> None:
    """Keep a text row's subjects, counted under `version`, for the next batch."""
    noted = _NOTED.get(db)
    if noted is None or noted[0] != version:
        noted = _NOTED[db] = (version, {})
    if len(noted[1]) < NOTED_ROWS:
        noted[1][item_id] = found


def stem_rank(d: Dictionary, stem: str) -> int:
    """A stem's place in the dictionary's corpus by falling frequency; unseen ones rank last."""
    return d.stem_ids.get(stem, d.hash_base)


def insert_chain(table: str) -> Rows:
    """The insert of chain rows (user_id, term, at, item_id) into `table` (`chain`, or the
    staged copy a re-derivation fills, maintenance.py); an existing row stays."""
    head = f"INSERT INTO {table} (user_id, term, at, item_id) VALUES "
    return Rows(f"INSERT OR IGNORE{head[6:]}(?, ?, ?, ?)", head, "(%s, %s, %s, %s)",
                " ON CONFLICT DO NOTHING")


_INSERT_CHAIN = insert_chain("chain")


def derive_chains(db: Database, after: int, upto: int) -> None:
    """Join the text rows stored with after < retrieval.seq <= upto to their subjects' chains
    (Store.flush calls this in the batch's transaction: the chains' only writer)."""
    conn = db.connection()
    d = db.dictionary
    version, noted = _NOTED.pop(db, ("", {}))
    if version != d.version:
        noted = {}
    _INSERT_CHAIN.run(conn, db.postgres, [
        (user, s, at, i) for i, user, at, text in text_rows(db, conn, after, upto, None)
        for s in (noted[i] if i in noted else subjects(d, text))])


def text_rows(db: Database, conn: Sql, after: int, upto: int | None,
               user_id: int | None) -> list[tuple[int, int, float, str]]:
    """(item id, user id, when said, text) of the non-blank text rows past retrieval.seq
    `after` (up to `upto`; of `user_id` only, when given)."""
    mark = "%s" if db.postgres else "?"
    where, args = "", [Kind.TEXT.value, after]
    if upto is not None:
        where, args = where + f" AND r.seq <= {mark}", [*args, upto]
    if user_id is not None:
        where, args = where + f" AND r.user_id = {mark}", [*args, user_id]
    return [r for r in conn.execute(
        "SELECT r.item_id, r.user_id, m.at, i.text FROM retrieval r"
        " JOIN item i ON i.id = r.item_id JOIN message m ON m.id = r.message_id"
        f" WHERE i.kind = {mark} AND r.seq > {mark}{where} ORDER BY r.seq", args)
        if r[3].strip()]


_TEXT_ITEMS = SQL.both(
    "SELECT i.id, i.text, m.user_id, m.at FROM item i JOIN message m ON m.id = i.message_id"
    " WHERE i.kind = ? AND i.id > ? ORDER BY i.id LIMIT 1000")


def backfill_chains(db: Database, conn: Sql) -> int:
    """Chains for the text rows stored before chains existed (their migration calls this, so
    no row is ever without its chains). Returns the rows read."""
    last = done = 0
    d = db.dictionary
    while rows := conn.execute(db.pick(_TEXT_ITEMS), (Kind.TEXT.value, last)).fetchall():
        _INSERT_CHAIN.run(conn, db.postgres, [(user, s, at, i) for i, text, user, at in rows
                                              if text.strip() for s in subjects(d, text)])
        last, done = rows[-1][0], done + len(rows)
    return done


def m004_recall(db: Database) -> None:
    """The recall tools' structures (this module and bindings.py), one writer each: the binding log (rows that
    came up together in one turn, written after the turn) and the subject chains (written with
    each message; rows stored before them are chained here, so none is without its chains)."""
    for sql in (
        "CREATE TABLE binding (turn_message_id INTEGER NOT NULL REFERENCES message(id)"
        " ON DELETE CASCADE, item_id INTEGER NOT NULL REFERENCES item(id) ON DELETE CASCADE,"
        " PRIMARY KEY (turn_message_id, item_id)) WITHOUT ROWID",
        "CREATE INDEX binding_item ON binding (item_id)",
        "CREATE TABLE chain (user_id INTEGER NOT NULL, term TEXT NOT NULL, at REAL NOT NULL,"
        " item_id INTEGER NOT NULL REFERENCES item(id) ON DELETE CASCADE,"
        " PRIMARY KEY (user_id, term, at, item_id)) WITHOUT ROWID",
        "CREATE INDEX chain_item ON chain (item_id)",
    ):
        db.connection().execute(db.legacy(sql))
    backfill_chains(db, db.connection())
