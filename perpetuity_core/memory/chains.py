"""The subject chains (`chain`), derived for the recall tools, with one writer.

Every text row joins the chains of its subjects (`subjects`: its rarest non-trivial words, at
most SUBJECTS a row), ordered by when it was said. `derive_chains` writes them from the store's
writer a batch of messages at a time (Store.flush), up to a cursor; memory_chains reads them
(`chain_of`) and derives the rows past the cursor itself, so a row is in its chains from the
moment it is stored, and a fact and its later updates are one chain with the latest state last.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable

import peewee as pw

from perpetuity_core.memory import dictionary
from perpetuity_core.memory.dialect import Sql
from perpetuity_core.memory.store import connection, in_list, snapshot
from perpetuity_core.wire.conversation import Kind

# Chains. A row's subjects are its words that are neither stop words nor among the commonest
# stems of the dictionary's corpus (ids are numbered by falling corpus frequency: "time",
# "make", "use", "work" say nothing about what a row is about), nor numbers or two-letter
# fragments; of those, the most repeated, then the rarest, at most SUBJECTS a row, so a chain
# row costs a few dozen bytes and a long text joins only the chains of what it is most about.
SUBJECTS = 6
COMMON_STEMS = 50
SUBJECT_CHARS = 4_000  # a long text's subject is in its opening: the rest is not read


def chain_of(user_id: int, stems: list[str]) -> tuple[list[int], int]:
    """The chain of rows about `stems`: the rows in the most of their chains (in all of them
    when any row is), ordered by when they were said, then by item id; and how many they
    share. Rows past the chains' cursor (at most a batch, see Store.flush) are chained here,
    in the same snapshot as the table, so none is missed while its batch is pending."""
    with snapshot("read the chains") as conn:
        rows = conn.execute(
            "SELECT item_id, max(at), count(*) FROM chain WHERE user_id = ? AND term IN"
            f" ({in_list(stems)}) GROUP BY item_id", (user_id, *stems)).fetchall()
        (after,) = conn.execute("SELECT seq FROM derived WHERE name = 'chain'").fetchone()
        pending = _text_rows(conn, after, None, user_id)
    found = {i: (at, n) for i, at, n in rows}
    wanted = set(stems)
    for i, _, at, text in pending:
        if n := len(wanted.intersection(subjects(text))):
            found[i] = (at, n)  # a row re-derived since it was chained has the same subjects
    if not found:
        return [], 0
    best = max(n for _, n in found.values())
    return [i for i, (_, n) in sorted(found.items(), key=lambda r: (r[1][0], r[0]))
            if n == best], best


def subject_words(text: str) -> tuple[dict[str, int], dict[str, str]]:
    """The words of `text` that can be subjects, by stem: occurrences, and the first form seen."""
    text = text[:SUBJECT_CHARS]
    # ASCII text is split as Dictionary.id_list splits it (the same words as the tokenizer's
    # pipeline, several times faster); anything else goes through the pipeline.
    words: Iterable[bytes | str] = (
        text.encode("ascii").translate(dictionary._ASCII_FOLD).split() if text.isascii()
        else dictionary.load().words(text))
    counts: dict[str, int] = {}
    forms: dict[str, str] = {}
    cache = _SUBJECT_STEM.setdefault(dictionary.load().version, {})
    # Counter counts in C, in order of first occurrence; stems are then looked up per distinct
    # word only (a text repeats most of its words).
    for w, n in Counter(words).items():
        if w in cache:
            known = cache[w]
        else:
            known = cache[w] = _subject_stem(w.decode() if isinstance(w, bytes) else w)
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


def _subject_stem(word: str) -> tuple[str, str] | None:
    if len(word) < 3 or word.isdigit() or word in dictionary.STOP_WORDS:
        return None
    s = dictionary.stem(word)
    return None if stem_rank(s) < dictionary.FIRST_STEM_ID + COMMON_STEMS else (s, word)


def subjects(text: str) -> list[str]:
    """The stems of the chains a text row joins: its most repeated subject words, then the
    rarest (a stem the corpus never saw counts rarest), at most SUBJECTS; ties by stem."""
    counts, _ = subject_words(text)
    d = dictionary.load()
    rank, unseen = d.stem_ids, d.hash_base
    return heapq.nsmallest(SUBJECTS, counts, key=lambda s: (-counts[s], -rank.get(s, unseen), s))


def stem_rank(stem: str) -> int:
    """A stem's place in the dictionary's corpus by falling frequency; unseen ones rank last."""
    d = dictionary.load()
    return d.stem_ids.get(stem, d.hash_base)


_INSERT_CHAIN = "INSERT OR IGNORE INTO chain (user_id, term, at, item_id) VALUES (?, ?, ?, ?)"


def derive_chains(after: int, upto: int) -> None:
    """Join the text rows stored with after < retrieval.seq <= upto to their subjects' chains
    (Store.flush calls this in the batch's transaction: the chains' only writer)."""
    conn = connection()
    conn.executemany(_INSERT_CHAIN, [(user, s, at, i) for i, user, at, text
                                     in _text_rows(conn, after, upto, None)
                                     for s in subjects(text)])


def _text_rows(conn: Sql, after: int, upto: int | None,
               user_id: int | None) -> list[tuple[int, int, float, str]]:
    """(item id, user id, when said, text) of the non-blank text rows past retrieval.seq
    `after` (up to `upto`; of `user_id` only, when given)."""
    where, args = "", [Kind.TEXT.value, after]
    if upto is not None:
        where, args = where + " AND r.seq <= ?", [*args, upto]
    if user_id is not None:
        where, args = where + " AND r.user_id = ?", [*args, user_id]
    return [r for r in conn.execute(
        "SELECT r.item_id, r.user_id, m.at, i.text FROM retrieval r"
        " JOIN item i ON i.id = r.item_id JOIN message m ON m.id = r.message_id"
        f" WHERE i.kind = ? AND r.seq > ?{where} ORDER BY r.seq", args) if r[3].strip()]


def backfill_chains(conn: Sql) -> int:
    """Chains for the text rows stored before chains existed (their migration calls this, so
    no row is ever without its chains). Returns the rows read."""
    last = done = 0
    while rows := conn.execute(
            "SELECT i.id, i.text, m.user_id, m.at FROM item i JOIN message m ON m.id = i.message_id"
            " WHERE i.kind = ? AND i.id > ? ORDER BY i.id LIMIT 1000",
            (Kind.TEXT.value, last)).fetchall():
        conn.executemany(_INSERT_CHAIN, [(user, s, at, i) for i, text, user, at in rows
                                         if text.strip() for s in subjects(text)])
        last, done = rows[-1][0], done + len(rows)
    return done


def m004_recall(database: pw.Database) -> None:
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
        connection().execute(sql)
    backfill_chains(connection())
