"""The write side of retrieval: one retrieval row per stored item that is memory, and the pooled counts.

`derive_retrieval` runs inside each message's transaction (memory.schema.open_memory wires it
into every Store): one retrieval row per item that is memory, not harness context (term ids and
counts as little-endian blobs, length, dictionary version), which is also its own increment of
the pooled counts BM25 needs (rows, total length, and document frequency per term): these are
folded into retrieval_total and retrieval_term every FOLD_EVERY rows, and readers add the rows
stored since (`totals`, `unfolded_df`). Deleted retrieval rows are logged by a trigger; the
writer settles them (takes their counts back out: `purge` deletes and settles in one
transaction, `Store.flush` settles what was deleted behind its back) and readers take out the
unsettled ones themselves, so no reader ever writes. On PostgreSQL, where several processes
store at once, a message's rows wait in retrieval_pending and `sequence` (a write, run before
each catch-up and each batch) gives them their place in `retrieval` (database.py explains
why). A new dictionary is re-derived and flipped in by maintenance.py. The read side is
memory.scan.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from perpetuity_core.memory.derived import chains, heat, vectors
from perpetuity_core.memory.derived.chains import SUBJECT_CHARS
from perpetuity_core.memory.storage.dialect import SQL, Rows, Sql, marks, trigger
from perpetuity_core.memory.storage.dictionary import Dictionary
from perpetuity_core.memory.storage.store import Database, Store, StoredItem, in_chunks
from perpetuity_core.wire.conversation import Kind, Message, without_scaffold


def token_estimate(text: str) -> int:
    """Model tokens of a text, by the usual rule of four characters a token."""
    return (len(text) + 3) // 4


def messages_tokens(messages: Iterable[Message]) -> int:
    """The estimated tokens of messages' text (token_estimate's rule, written out: a frame's
    hundreds of parts are measured several times a request)."""
    return sum((len(p.text) + 3) // 4 for m in messages for p in m.parts)


def item_text(kind: str, name: str, text: str) -> str:
    """What a row is retrieved by: a tool call is found by its tool's name as well; the
    reminders a harness appends to a tool result are not."""
    text = without_scaffold(text)
    return f"{name} {text}" if name else text


# The pooled counts are folded every FOLD_EVERY rows, in the transaction of the message whose
# rows cross a multiple of it (PostgreSQL: when due, sequence_in; a fold reads its own cursor):
# a batch's distinct terms upserted once cost a fraction of every row's. The write path's cost a
# message: `scripts/bench_ingest.py --sets locomo` (trials: docs/tuning.md). Only the
# small-memory path (store_rows) reads the unfolded rows, and it reads every row anyway.
FOLD_EVERY = 4096


_CONTEXT = Kind.CONTEXT.value
_TEXT = Kind.TEXT.value


def derive_retrieval(db: Database, items: list[StoredItem], semantic: bool = True) -> None:
    """Write the retrieval rows and counts of a message's items (inside its transaction), each
    with its birth (heat.py: the clock position it was stored at and its half-life) and its
    vector (vectors.py). On PostgreSQL they wait in retrieval_pending until `sequence` orders
    them (database.py). `semantic` False: without the vector, for m016, which runs on tables
    m019 has not given one yet (m019 derives them)."""
    if not items:
        return
    conn = db.connection()
    if db.postgres:  # inside the write lock: a flip elsewhere is seen here
        rows = _rows(db, db.live.follow(conn), items, semantic)
        if rows:
            (_PENDING if semantic else _PENDING_LEXICAL).run(conn, True, rows)
        return
    d, seq = _numbered(db, conn)
    rows = _rows(db, d, items, semantic)
    if not rows:
        return
    insert = _INSERT_ROW if semantic else _INSERT_LEXICAL
    if len(rows) == 1:  # most messages: executemany's own cost is not paid for one row
        conn.execute(insert, (seq, *rows[0]))
    else:
        conn.executemany(insert, [(seq + k, *r) for k, r in enumerate(rows)])
    db.numbering.counted["retrieval"] = (d, seq + len(rows))
    last = seq + len(rows) - 1
    if (last - len(rows)) // FOLD_EVERY < last // FOLD_EVERY:  # the rows crossed a mark
        fold(db, conn)


def _numbered(db: Database, conn: Sql) -> tuple[Dictionary, int]:
    """SQLite, inside a message's write: the live dictionary and the next seq, as the writer
    counts them (derive_retrieval, the retrieval rows' one writer), or read again (one
    statement) when database.Numbering dropped the count. The live dictionary changes only by
    a write, which drops it: a flip elsewhere is followed, and the rows are derived with the
    dictionary the database names."""
    if (counted := db.numbering.counted.get("retrieval")) is not None:
        return counted
    seq, version = conn.execute(_NEXT_SEQ).fetchone()
    return db.live.named(conn, version), seq


def _rows(db: Database, d: Dictionary, items: list[StoredItem], semantic: bool) -> list[tuple]:
    """The retrieval rows of a message's items under `d`, each born at its user's clock (the
    insert reads it: the row holds the user's id in its place), with its vector."""
    rows = []
    table = vectors.table() if semantic else None
    for it in items:
        if it.kind == _CONTEXT:  # harness text is stored with its message, never retrieved
            continue
        text = item_text(it.kind, it.name, it.text)
        if it.kind == _TEXT and text is it.text and text.isascii():
            # The chains' subjects from the bag's own count (the next batch's, chains.py): of
            # the text's first SUBJECT_CHARS characters, as `chains.subjects` reads them.
            bag, known, unseen = d.packed_counted(text, SUBJECT_CHARS)
            chains.note(db, d.version, it.id, chains.counted_subjects(d, known, unseen))
        else:
            bag = d.packed(text)
        row = (it.id, it.message_id, it.user_id, it.conversation_id, int(it.at), bag.length,
               token_estimate(text), d.version, bag.terms, bag.counts, it.user_id,
               heat.half_life(it.kind, it.role, it.text))
        rows.append(row if table is None else (*row, table.row(d, bag.terms, bag.counts)))
    return rows


_LEXICAL = ("item_id, message_id, user_id, conversation_id, at, length, tokens, version, terms,"
            " counts, born, half_life")
_COLUMNS = _LEXICAL + ", vec"
# SQLite numbers a row past the newest and past every seq a deletion freed (m015: no
# AUTOINCREMENT, whose counter was one more page in every message's commit), as the writer
# counts them (_numbered); a row is born at its user's clock as the insert reads it.
_INSERT_ROW = (f"INSERT INTO retrieval (seq, {_COLUMNS}) VALUES ({marks(False, 11)},"
               " coalesce((SELECT position FROM clock WHERE user_id = ?), 0.0), ?, ?)")
_INSERT_LEXICAL = (f"INSERT INTO retrieval (seq, {_LEXICAL}) VALUES ({marks(False, 11)},"
                   " coalesce((SELECT position FROM clock WHERE user_id = ?), 0.0), ?)")
# Past AUTOINCREMENT's counter too, which numbered the rows of a memory not migrated past m015
# yet (the migrations' tests write through the path on one).
_NEXT_SEQ = ("SELECT max((SELECT coalesce(max(seq), 0) FROM retrieval), coalesce((SELECT id FROM"
             " high_water WHERE name = 'retrieval'), (SELECT seq FROM sqlite_sequence WHERE"
             " name = 'retrieval'), 0)) + 1, (SELECT value FROM setting WHERE key = 'dictionary')")
# PostgreSQL: the rows wait for their seq (`sequence`), each born at its user's clock as the
# insert reads it; SQLite never writes this table.
_PENDING = Rows(f"INSERT INTO retrieval_pending ({_COLUMNS}) VALUES ({marks(False, 13)})",
                f"INSERT INTO retrieval_pending ({_COLUMNS}) VALUES ",
                f"({marks(True, 10)}, coalesce((SELECT position FROM clock WHERE user_id = %s),"
                " 0.0), %s, %s)")
_PENDING_LEXICAL = Rows(
    f"INSERT INTO retrieval_pending ({_LEXICAL}) VALUES ({marks(False, 12)})",
    f"INSERT INTO retrieval_pending ({_LEXICAL}) VALUES ",
    f"({marks(True, 10)}, coalesce((SELECT position FROM clock WHERE user_id = %s), 0.0), %s)")


def _fold_due(db: Database, conn: Sql, seq: int) -> None:
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    if seq - folded >= FOLD_EVERY:
        fold(db, conn)


def sequence(db: Database) -> int:
    """PostgreSQL: order the retrieval rows stored since the last call (by any process) into
    `retrieval`; returns how many. Called before every catch-up and every batch, so a reader
    never misses a committed row. SQLite writes them there directly (one writer at a time)."""
    if not db.postgres or not pending(db.connection()):
        return 0
    return order_pending(db)


def pending(conn: Sql) -> bool:
    return bool(conn.execute("SELECT EXISTS (SELECT 1 FROM retrieval_pending)").fetchone()[0])


def order_pending(db: Database) -> int:
    """`sequence` for a caller that has just seen rows pending (no second look)."""
    with db.writing("order the stored rows") as conn:
        return sequence_in(db, conn)


def sequence_in(db: Database, conn: Sql) -> int:
    """`sequence` inside a write that holds the lock exclusive: the pending rows move into
    `retrieval` in the order they were stored, each getting its seq there, under the lock, so
    seqs follow commit order (database.py); the counts are folded when due."""
    if not db.postgres:
        return 0
    moved = conn.execute(
        f"WITH moved AS (DELETE FROM retrieval_pending RETURNING *) INSERT INTO retrieval"
        f" ({_COLUMNS}) SELECT {_COLUMNS} FROM moved ORDER BY id").rowcount
    if moved:
        _fold_due(db, conn, conn.execute("SELECT max(seq) FROM retrieval").fetchone()[0])
    return moved


def count_terms(db: Database, conn: Sql, terms: np.ndarray, sign: int,
                table: str = "retrieval_term") -> None:
    """Add (or take back) one to the document frequency of each occurrence in `terms` (in
    `table`: the live counts, or the staged ones a re-derivation fills, maintenance.py)."""
    if terms.size == 0:
        return
    t, n = np.unique(terms, return_counts=True)
    conn.executemany(f"INSERT INTO {table} (term, df) VALUES ({marks(db.postgres, 2)})"
                     f" ON CONFLICT(term) DO UPDATE SET df = {table}.df + excluded.df",
                     zip(t.tolist(), (n * sign).tolist(), strict=True))


def fold(db: Database, conn: Sql) -> None:
    """Add the rows stored since the last fold to the pooled counts."""
    # Deletions first: a row deleted before this fold was never counted, and settling it
    # after the cursor passed its seq would take it out all the same.
    settle_in(db, conn)
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    rows = conn.execute(db.pick(_UNFOLDED), (folded,)).fetchall()
    if not rows:
        return
    count_terms(db, conn, np.frombuffer(b"".join(r[3] for r in rows), "<i4"), +1)
    conn.execute(db.pick(_FOLDED),
                 (len(rows), sum(r[1] for r in rows), sum(r[2] for r in rows), rows[-1][0]))


# Deletions the writer has not settled yet, of rows already in the folded counts: every reader
# takes them back out itself (only the writer settles, see Store.flush and fold).
_UNSETTLED = ("FROM retrieval_gone g, retrieval_total t WHERE g.settled = 0"
              " AND g.row_seq <= t.folded_seq")


_UNFOLDED = SQL.both("SELECT seq, length, tokens, terms FROM retrieval WHERE seq > ? ORDER BY seq")
_FOLDED = SQL.both("UPDATE retrieval_total SET rows = rows + ?, length = length + ?,"
                   " tokens = tokens + ?, folded_seq = ? WHERE id = 1")


def totals(conn: Sql) -> tuple[int, int, int]:
    """Live rows, their total length and tokens: the folded counts plus the rows stored since,
    less the deletions not settled yet."""
    rows, length, tokens = conn.execute(
        "SELECT t.rows + count(r.seq), t.length + coalesce(sum(r.length), 0),"
        " t.tokens + coalesce(sum(r.tokens), 0) FROM retrieval_total t"
        " LEFT JOIN retrieval r ON r.seq > t.folded_seq WHERE t.id = 1 GROUP BY t.id").fetchone()
    gone = conn.execute("SELECT count(*), coalesce(sum(g.length), 0), coalesce(sum(g.tokens), 0) "
                        + _UNSETTLED).fetchone()
    return rows - gone[0], length - gone[1], tokens - gone[2]


def unfolded_df(db: Database, conn: Sql, terms: np.ndarray) -> np.ndarray:
    """Document frequency of `terms` (ascending): folded counts plus rows not folded yet, less
    unsettled deletions of folded rows."""
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total WHERE id = 1").fetchone()
    got = dict(conn.execute(
        f"SELECT term, df FROM retrieval_term WHERE term IN ({marks(db.postgres, terms.size)})",
        terms.tolist()).fetchall())
    df = np.asarray([got.get(t, 0) for t in terms.tolist()], np.int64)
    recent = conn.execute(db.pick(_RECENT_TERMS), (folded,)).fetchall()
    gone = conn.execute("SELECT g.terms " + _UNSETTLED).fetchall()
    for blobs, sign in ((recent, 1), (gone, -1)):
        if blobs:
            t = np.frombuffer(b"".join(r[0] for r in blobs), "<i4")
            u, c = np.unique(t[np.isin(t, terms)], return_counts=True)
            df[np.searchsorted(terms, u)] += sign * c
    return df


_RECENT_TERMS = SQL.both("SELECT terms FROM retrieval WHERE seq > ?")


def settle(store: Store) -> int:
    """Take the counts of deleted retrieval rows back out; returns how many were settled.
    The store's writer calls this (or settle_in inside its own write)."""
    with store.db.writing("settle deletions") as conn:
        return settle_in(store.db, conn)


def settle_in(db: Database, conn: Sql) -> int:
    """`settle` inside a write."""
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
        count_terms(db, conn, terms, -1)
        conn.executemany(db.pick(_EMPTY_TERM), [(t,) for t in np.unique(terms).tolist()])
        conn.execute(db.pick(_SETTLED_TOTAL),
                     (len(counted), sum(g[1] for g in counted), sum(g[2] for g in counted)))
    conn.executemany(db.pick(_SETTLED), [(g[0],) for g in gone])
    return len(gone)


_EMPTY_TERM = SQL.both("DELETE FROM retrieval_term WHERE term = ? AND df <= 0")
_SETTLED_TOTAL = SQL.both("UPDATE retrieval_total SET rows = rows - ?, length = length - ?,"
                          " tokens = tokens - ? WHERE id = 1")
_SETTLED = SQL.both("UPDATE retrieval_gone SET settled = 1 WHERE seq = ?")


def purge(store: Store, item_ids: Iterable[int]) -> int:
    """Delete items (and their retrieval rows, with their births, counts and activations) in
    one transaction."""
    ids = [(int(i),) for i in item_ids]
    db = store.db
    with db.writing("purge rows") as conn:
        conn.executemany(db.pick(_PURGE_ITEM), ids)  # cascades
        conn.executemany(db.pick(_PURGE_ACTIVATION), ids)  # keyed, not linked
        settle_in(db, conn)
    return len(ids)


_PURGE_ITEM = SQL.both("DELETE FROM item WHERE id = ?")
_PURGE_ACTIVATION = SQL.both("DELETE FROM activation WHERE item_id = ?")


def items_by_message(db: Database, item_ids: list[int]) -> list[list[StoredItem]]:
    """The items with these ids (their messages joined, as derive_retrieval reads them),
    grouped by message."""
    by_message: dict[int, list[StoredItem]] = {}
    for chunk in in_chunks(item_ids):
        for row in db.connection().execute(
                "SELECT i.id, m.id, m.user_id, m.conversation_id, m.role, m.at, i.seq, i.kind,"
                " i.name, i.call_id, i.text FROM item i JOIN message m ON m.id = i.message_id"
                f" WHERE i.id IN ({marks(db.postgres, len(chunk))}) ORDER BY i.id", chunk):
            by_message.setdefault(row[1], []).append(StoredItem(*row))
    return list(by_message.values())


def m002_retrieval(db: Database) -> None:
    """Retrieval rows (this module, and scan.py for the reads): one per item, with the pooled frequency counts BM25 needs.

    `seq` only grows, so a reader catches up by reading rows past its cursor; a re-derived row
    is deleted and inserted again under a new seq. Deletions are logged by trigger (with the
    terms, so the counts can be settled) and a reader catches up on them the same way.
    """
    for sql in (
        "CREATE TABLE retrieval (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        " item_id INTEGER NOT NULL UNIQUE REFERENCES item(id) ON DELETE CASCADE,"
        " message_id INTEGER NOT NULL, user_id INTEGER NOT NULL, conversation_id INTEGER NOT NULL,"
        " length INTEGER NOT NULL, tokens INTEGER NOT NULL, version TEXT NOT NULL,"
        " terms BLOB NOT NULL, counts BLOB NOT NULL)",
        "CREATE TABLE retrieval_term (term INTEGER PRIMARY KEY, df INTEGER NOT NULL)",
        "CREATE TABLE retrieval_total (id INTEGER PRIMARY KEY CHECK (id = 1),"
        " rows INTEGER NOT NULL, length INTEGER NOT NULL, tokens INTEGER NOT NULL,"
        " folded_seq INTEGER NOT NULL)",  # retrieval_term counts rows up to this seq
        "INSERT INTO retrieval_total VALUES (1, 0, 0, 0, 0)",
        "CREATE TABLE retrieval_gone (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        " row_seq INTEGER NOT NULL, item_id INTEGER NOT NULL, length INTEGER NOT NULL,"
        " tokens INTEGER NOT NULL, terms BLOB NOT NULL, settled INTEGER NOT NULL DEFAULT 0)",
        "CREATE INDEX retrieval_gone_unsettled ON retrieval_gone (seq) WHERE settled = 0",
        *trigger(db.postgres, "retrieval_deleted", "retrieval", "true",
                 "INSERT INTO retrieval_gone (row_seq, item_id, length, tokens, terms)"
                 " VALUES (old.seq, old.item_id, old.length, old.tokens, old.terms)"),
    ):
        db.connection().execute(db.legacy(sql))


def m008_retrieval_time(db: Database) -> None:
    """Each retrieval row carries when its message was said, so a search can rank the rows of a
    day the question names first (dates.py) from the arena alone. Whole seconds: a catch-up
    reads integers as text several times faster than REALs, and days are what is asked."""
    for sql in (
        "ALTER TABLE retrieval ADD COLUMN at INTEGER NOT NULL DEFAULT 0",
        ("UPDATE retrieval SET at = (SELECT CAST(m.at AS INTEGER) FROM message m"
         " WHERE m.id = retrieval.message_id)"),
    ):
        db.connection().execute(db.legacy(sql))


def m012_retrieval_pending(db: Database) -> None:
    """Parallel writers on PostgreSQL (database.py): a message's retrieval rows wait here, in
    the order they were stored, until `sequence` moves them into `retrieval` under the
    exclusive lock. SQLite has the table too (the same schema on both) and never fills it."""
    db.connection().execute(db.legacy(
        "CREATE TABLE retrieval_pending (id INTEGER PRIMARY KEY AUTOINCREMENT,"
        " item_id INTEGER NOT NULL UNIQUE REFERENCES item(id) ON DELETE CASCADE,"
        " message_id INTEGER NOT NULL, user_id INTEGER NOT NULL, conversation_id INTEGER NOT NULL,"
        " at INTEGER NOT NULL, length INTEGER NOT NULL, tokens INTEGER NOT NULL,"
        " version TEXT NOT NULL, terms BLOB NOT NULL, counts BLOB NOT NULL)"))


def m015_retrieval_numbered(db: Database) -> None:
    """SQLite: retrieval rows numbered past the highest seq ever handed out (`high_water`, as
    m010 does for messages and items) instead of by AUTOINCREMENT, which wrote its counter's
    page (sqlite_sequence) in every message's commit: one of its 11 pages. The table is rebuilt
    without it, the deletion trigger keeps the mark, and a re-derivation staged for a flip
    starts again (its staged rows were numbered by the counter; maintenance.py). PostgreSQL
    numbers by its sequence, which is no page of the table: nothing changes there."""
    if db.postgres:
        return
    conn = db.connection()
    _drop_staged(conn)
    for sql in (
        "CREATE TABLE retrieval_numbered (seq INTEGER PRIMARY KEY,"
        " item_id INTEGER NOT NULL UNIQUE REFERENCES item(id) ON DELETE CASCADE,"
        " message_id INTEGER NOT NULL, user_id INTEGER NOT NULL, conversation_id INTEGER NOT NULL,"
        " length INTEGER NOT NULL, tokens INTEGER NOT NULL, version TEXT NOT NULL,"
        " terms BLOB NOT NULL, counts BLOB NOT NULL, at INTEGER NOT NULL DEFAULT 0)",
        "INSERT INTO retrieval_numbered (seq, item_id, message_id, user_id, conversation_id,"
        " length, tokens, version, terms, counts, at) SELECT seq, item_id, message_id, user_id,"
        " conversation_id, length, tokens, version, terms, counts, at FROM retrieval ORDER BY seq",
        "INSERT INTO high_water SELECT 'retrieval', max(coalesce((SELECT seq FROM sqlite_sequence"
        " WHERE name = 'retrieval'), 0), (SELECT coalesce(max(seq), 0) FROM retrieval))",
        "DELETE FROM sqlite_sequence WHERE name IN ('retrieval', 'retrieval_staged')",
        "DROP TRIGGER retrieval_deleted",
        "DROP TABLE retrieval",
        "ALTER TABLE retrieval_numbered RENAME TO retrieval",
        # One trigger, which a flip carries over to the table it swaps in (maintenance.py).
        "CREATE TRIGGER retrieval_deleted AFTER DELETE ON retrieval BEGIN"
        " INSERT INTO retrieval_gone (row_seq, item_id, length, tokens, terms)"
        " VALUES (old.seq, old.item_id, old.length, old.tokens, old.terms);"
        " UPDATE high_water SET id = old.seq WHERE name = 'retrieval' AND id < old.seq; END",
    ):
        conn.execute(sql)


def m016_born_with_retrieval(db: Database) -> None:
    """A row's birth (heat.py: the clock position it was stored at, its half-life) is written
    in its retrieval row, no longer as an activation row of its own, whose two B-trees
    (activation, activation_warm) were two of the ~10 pages of every message's commit; one
    index on the retrieval rows (user_id, born) finds the warm births. `activation` keeps
    what retrieval writes after birth, the reheats, which override the birth.

    Every row's birth is its activation as it stood (the same trajectory), and the activations
    a birth now implies go: a row's at peak BIRTH_PEAK, and harness context's, born cold (it
    has no retrieval row). Rows m009 left without their retrieval row (it re-derives those
    that quote a reminder, and the insert now writes a birth) are derived here first. SQLite:
    a re-derivation staged for a flip starts again (its staged rows have no birth)."""
    conn = db.translated(db.connection())
    for table in ("retrieval", "retrieval_pending", "retrieval_next"):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN born REAL NOT NULL DEFAULT 0")
        conn.execute(f"ALTER TABLE {table} ADD COLUMN half_life REAL NOT NULL DEFAULT 1")
    if not db.postgres:
        _drop_staged(conn)
        conn.execute("DELETE FROM high_water WHERE name = 'retrieval_staged'")
    rowless = [i for (i,) in conn.execute(
        "SELECT id FROM item i WHERE kind != ? AND NOT EXISTS (SELECT 1 FROM retrieval r"
        " WHERE r.item_id = i.id) AND NOT EXISTS (SELECT 1 FROM retrieval_pending p"
        " WHERE p.item_id = i.id) ORDER BY id", (_CONTEXT,))]
    for items in items_by_message(db, rowless):
        derive_retrieval(db, items, semantic=False)
    for table in ("retrieval", "retrieval_pending", "retrieval_next"):
        conn.execute(
            f"UPDATE {table} SET born = coalesce((SELECT a.at FROM activation a WHERE"
            f" a.item_id = {table}.item_id), born), half_life = coalesce((SELECT a.half_life"
            f" FROM activation a WHERE a.item_id = {table}.item_id), half_life)")
    rowed = ("EXISTS (SELECT 1 FROM {0} r WHERE r.item_id = activation.item_id"
             " AND r.born = activation.at AND r.half_life = activation.half_life)")
    conn.execute(
        f"DELETE FROM activation WHERE (peak = ? AND ({rowed.format('retrieval')}"
        f" OR {rowed.format('retrieval_pending')})) OR (peak = 0 AND half_life = ?"
        " AND NOT EXISTS (SELECT 1 FROM retrieval r WHERE r.item_id = activation.item_id)"
        " AND NOT EXISTS (SELECT 1 FROM retrieval_pending p WHERE p.item_id = activation.item_id))",
        (heat.BIRTH_PEAK, heat.HALF_LIFE[Kind.CONTEXT]))
    # Covering: the warm set reads its births from the index alone (heat.warm_set).
    for sql in ("CREATE INDEX retrieval_warm ON retrieval (user_id, born, half_life, item_id)",
                "CREATE INDEX retrieval_standing ON retrieval (user_id, born, half_life, item_id)"
                f" WHERE half_life >= {heat.STANDING_HALF_LIFE}"):
        conn.execute(sql)


def _drop_staged(conn: Sql) -> None:
    """SQLite: a re-derivation staged for a flip starts again (maintenance.py stages it)."""
    for table in ("retrieval_staged", "retrieval_term_staged", "retrieval_total_staged",
                  "chain_staged", "retrieval_staged_gone"):
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def m019_vectors(db: Database) -> None:
    """Each retrieval row carries its vector (vectors.py: the semantic half of the dictionary,
    DIMS int8 bytes, read from the row's own bag), written with the row, so the arena scores
    every row by meaning as well as by words. The rows stored before are derived here, a
    progress bar on a terminal; a re-derivation staged for a flip starts again."""
    from tqdm import tqdm

    conn = db.translated(db.connection())
    for table in ("retrieval", "retrieval_pending", "retrieval_next"):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN vec BLOB")
    if not db.postgres:
        _drop_staged(conn)
    conn.execute("DELETE FROM retrieval_next")
    d = db.live.follow(conn)
    semantic = vectors.table()
    tables = ("retrieval", "retrieval_pending")
    total = sum(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables)
    with tqdm(total=total, unit="row", desc="perpetuity: deriving the rows' vectors",
              disable=None if total else True) as bar:
        for name in tables:
            last = 0
            while rows := conn.execute(
                    f"SELECT item_id, terms, counts FROM {name} WHERE item_id > ?"
                    " ORDER BY item_id LIMIT 5000", (last,)).fetchall():
                conn.executemany(f"UPDATE {name} SET vec = ? WHERE item_id = ?",
                                 [(semantic.row(d, bytes(t), bytes(c)), i) for i, t, c in rows])
                last = rows[-1][0]
                bar.update(len(rows))
