"""The memory's composition root: the ordered list of migrations, and `open_memory`, which opens
a Store with the derivers that keep every structure derived from its rows.

The migrations of the store's own tables past the first (m006, m007, m010, m011, m013) are
here, beside the list: the store's module keeps the models and the write path.

The store knows nothing of what is derived from its rows: it calls the derivers it is given,
inside each message's transaction (retrieval rows, each with its birth, heat.py: no item may
exist without them, and harness context is stored, born cold, and never retrieved) or a batch
at a time (the chains, `Store.flush`). Each derived structure owns its migrations; `MIGRATIONS` lists them in
their historical order, by the names already recorded in users' databases.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from perpetuity_core.memory.derived import heat, vectors
from perpetuity_core.memory.derived.chains import derive_chains, m004_recall
from perpetuity_core.memory.derived.heat import m003_heat, m005_standing
from perpetuity_core.memory.derived.index import (
    derive_retrieval,
    m002_retrieval,
    m008_retrieval_time,
    m012_retrieval_pending,
    m015_retrieval_numbered,
    m016_born_with_retrieval,
    m019_vectors,
    sequence_in,
    settle_in,
)
from perpetuity_core.memory.storage import dictionary
from perpetuity_core.memory.storage.dialect import Sql, trigger
from perpetuity_core.memory.storage.names import opening_words
from perpetuity_core.memory.storage.savings import m018_savings
from perpetuity_core.memory.storage.secrets import secret_kind
from perpetuity_core.memory.storage.store import (
    Database,
    Deriver,
    Forget,
    Migrate,
    Store,
    m001_initial,
)
from perpetuity_core.wire.conversation import Kind, text_part


def m006_batched(db: Database) -> None:
    """Fewer pages in each message's commit, which writes one per B-tree page it touches.

    The chains touched up to seven (one per subject, one for their item index): they are now
    written a batch of messages at a time (Store.flush), and `derived` holds how far, in
    retrieval.seq (which is never reused, unlike item ids), each batched structure is written;
    every row stored before has its chains. The index on message.conversation_id alone goes:
    the (conversation_id, pair_key) index serves the same lookups. retrieval_total, updated
    with every message, now counts only the rows up to its folded_seq, as retrieval_term does
    (see index.totals): rows past it, and unsettled deletions of them, leave its counts."""
    past = "FROM retrieval WHERE seq > folded_seq"
    gone = "FROM retrieval_gone WHERE settled = 0 AND row_seq > folded_seq"
    for sql in (
        "CREATE TABLE derived (name TEXT PRIMARY KEY, seq INTEGER NOT NULL) WITHOUT ROWID",
        "INSERT INTO derived SELECT 'chain', coalesce(max(seq), 0) FROM retrieval",
        "DROP INDEX IF EXISTS storedmessage_conversation_id",
        "UPDATE retrieval_total SET"
        f" rows = rows - (SELECT count(*) {past}) - (SELECT count(*) {gone}),"
        f" length = length - (SELECT coalesce(sum(length), 0) {past})"
        f" - (SELECT coalesce(sum(length), 0) {gone}),"
        f" tokens = tokens - (SELECT coalesce(sum(tokens), 0) {past})"
        f" - (SELECT coalesce(sum(tokens), 0) {gone})",
    ):
        db.connection().execute(db.legacy(sql))


def m007_conversation_order(db: Database) -> None:
    """The messages of a conversation in store order. m006 dropped the index on
    conversation_id as redundant, but the (conversation_id, pair_key) and (conversation_id,
    fingerprint) indexes do not keep id order: every "latest / around message X" lookup read
    and sorted the whole conversation, on every request of a long coding session."""
    db.connection().execute(
        db.legacy("CREATE INDEX message_conversation_order ON message (conversation_id, id)"))


def m010_store_guarantees(db: Database) -> None:
    """Ids that are never handed out twice, and the retrieval dictionary kept as data.

    SQLite gives a new row max(id) + 1, so a deleted newest message or item lent its id to the
    next one, while frame caches assume ids only grow. A trigger keeps the highest id ever
    deleted (`high_water`) and the write path numbers rows past both (no AUTOINCREMENT table
    rebuild). `dictionary` holds every version uploaded (the live one named by the setting
    `dictionary`), `retrieval_next` the dark rows a new version is re-derived into before its
    flip (see maintenance.py). The live version is the one the stored rows were made with."""
    shipped = dictionary.shipped()
    versions = [v for (v,) in db.connection().execute(
        db.legacy("SELECT DISTINCT version FROM retrieval"))]
    live = versions[0] if len(versions) == 1 else shipped.version
    for sql in (
        "CREATE TABLE high_water (name TEXT PRIMARY KEY, id INTEGER NOT NULL) WITHOUT ROWID",
        "INSERT INTO high_water SELECT 'message', coalesce(max(id), 0) FROM message",
        "INSERT INTO high_water SELECT 'item', coalesce(max(id), 0) FROM item",
        "CREATE TABLE dictionary (version TEXT PRIMARY KEY, body BLOB NOT NULL,"
        " uploaded_at REAL NOT NULL)",
        "CREATE TABLE retrieval_next (item_id INTEGER PRIMARY KEY REFERENCES item(id)"
        " ON DELETE CASCADE, version TEXT NOT NULL, length INTEGER NOT NULL,"
        " tokens INTEGER NOT NULL, terms BLOB NOT NULL, counts BLOB NOT NULL,"
        " subjects TEXT NOT NULL)",  # the row's chains under that version, space-separated
    ):
        db.connection().execute(db.legacy(sql))
    for table in ("message", "item"):
        for sql in trigger(db.postgres, f"{table}_high_water", table,
                           f"old.id > (SELECT id FROM high_water WHERE name = '{table}')",
                           f"UPDATE high_water SET id = old.id WHERE name = '{table}'"):
            db.connection().execute(db.legacy(sql))
    if live == shipped.version:
        db.connection().execute(db.legacy("INSERT INTO dictionary VALUES (?, ?, ?)"),
                                (live, dictionary.shipped_path().read_bytes(), time.time()))
    db.connection().execute(db.legacy(
        "INSERT OR REPLACE INTO setting (key, value) VALUES ('dictionary', ?)"), (live,))


def m011_secret(db: Database) -> None:
    """Each row carries the kind of credential the notes' scan finds in it (capture-time, off
    the request path): stored verbatim, it is shown to another conversation only as
    `[secret withheld: <kind>]`. Rows stored before are scanned here."""
    db.connection().execute(
        db.legacy("ALTER TABLE item ADD COLUMN secret TEXT NOT NULL DEFAULT ''"))
    last = 0
    while rows := db.connection().execute(db.legacy(
            "SELECT id, text FROM item WHERE id > ? ORDER BY id LIMIT 5000"), (last,)).fetchall():
        flagged = [(kind, i) for i, text in rows if (kind := secret_kind(text))]
        for kind, i in flagged:
            db.connection().execute(db.legacy("UPDATE item SET secret = ? WHERE id = ?"), (kind, i))
        last = rows[-1][0]


def m013_id_sequences(db: Database) -> None:
    """PostgreSQL: messages and items take their ids from their sequences, since writers store
    in parallel there (database.py); until now the write path numbered them itself, so the
    sequences start past every id stored or freed (high_water). SQLite: nothing changes."""
    if db.postgres:
        ids_past_high_water(db.connection())


def ids_past_high_water(conn: Sql) -> None:
    """PostgreSQL: the message and item sequences set past every id stored or freed."""
    for table in ("message", "item"):
        conn.execute(
            f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), greatest((SELECT"
            f" coalesce(max(id), 0) FROM {table}), (SELECT id FROM high_water WHERE"
            f" name = '{table}')) + 1, false)")



def m014_message_lookup(db: Database) -> None:
    """One index finds a conversation's stored messages by content, where two did: fewer pages
    in each message's commit, which writes one per B-tree page it touches (m006).

    The (conversation_id, pair_key) and (conversation_id, fingerprint) indexes were written with
    every message, each at a place of its own in the B-tree. A pair key digests its message's
    fingerprint (capture.pair_key), so the message a known pair key names is found by its
    fingerprint: (conversation_id, fingerprint, pair_key) answers both lookups from the index
    (Store.known), and the integrity check's pass over copies."""
    for sql in (
        "DROP INDEX IF EXISTS storedmessage_conversation_id_pair_key",
        "DROP INDEX IF EXISTS storedmessage_conversation_id_fingerprint",
        "CREATE INDEX message_lookup ON message (conversation_id, fingerprint, pair_key)",
    ):
        db.connection().execute(db.legacy(sql))


def m009_harness_text(db: Database) -> None:
    """Harness text is not memory; conversations have names (names.py).

    Items the harness wrote, stored before this was told (Claude Code's mid-conversation system
    messages, its IDE notes, task notices, skill text and interrupt markers: see
    conversation.text_part), become context: their retrieval rows, chains and bindings go, and
    they are cold, as context is born (heat.py). Rows that quote a reminder the harness appended
    (tool results) are indexed again without it (by m016). Conversations get the title,
    opening words and folder their label is made of; those stored before get their first
    prompt's opening words.
    """
    raw = db.connection()
    conn = db.translated(raw)  # a migration's statements: written once (dialect.translate_legacy)
    for column in ("title", "opening", "folder"):
        conn.execute(f"ALTER TABLE conversation ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
    written = conn.execute("SELECT i.id, i.text, m.role FROM item i JOIN message m"
                           " ON m.id = i.message_id WHERE i.kind = ?"
                           " AND m.role IN ('user', 'system')", (Kind.TEXT.value,)).fetchall()
    harness = [(i,) for i, text, role in written
               if role == "system" or text_part(text).kind == Kind.CONTEXT]
    conn.executemany("UPDATE item SET kind = ? WHERE id = ?",
                     [(Kind.CONTEXT.value, i) for (i,) in harness])
    harness += conn.execute("SELECT item_id FROM retrieval WHERE item_id IN"
                            " (SELECT id FROM item WHERE kind = ?)",
                            (Kind.CONTEXT.value,)).fetchall()
    for sql in ("DELETE FROM retrieval WHERE item_id = ?", "DELETE FROM chain WHERE item_id = ?",
                "DELETE FROM binding WHERE item_id = ?",
                "UPDATE activation SET peak = 0 WHERE item_id = ?"):
        conn.executemany(sql, harness)
    reminded = [i for (i,) in conn.execute(
        "SELECT id FROM item WHERE kind = ? AND instr(text, '<system-reminder>') > 0",
        (Kind.TOOL_RESULT.value,))]
    conn.executemany("DELETE FROM retrieval WHERE item_id = ?", [(i,) for i in reminded])
    settle_in(db, raw)
    # Their rows are derived again by m016 (the insert writes columns that come with it).
    for (cid,) in conn.execute("SELECT id FROM conversation").fetchall():
        first = conn.execute(
            "SELECT i.text FROM message m JOIN item i ON i.message_id = m.id WHERE"
            " m.conversation_id = ? AND m.role = 'user' AND i.kind = ? AND trim(i.text) != ''"
            " ORDER BY m.id, i.seq LIMIT 1", (cid, Kind.TEXT.value)).fetchone()
        if first:
            conn.execute("UPDATE conversation SET opening = ? WHERE id = ?",
                         (opening_words(first[0]), cid))


def m017_deletions_counted(db: Database) -> None:
    """Every message and item deleted is counted, by trigger (`high_water`'s `deletions`): a
    reader that kept which rows are there (memory.storage.kept.There) knows they still are
    while the count stands, instead of asking for each on every call. Only deletions pay
    (purges, a user's removal); the write path deletes nothing."""
    conn = db.connection()
    conn.execute(db.legacy("INSERT INTO high_water (name, id) VALUES ('deletions', 0)"))
    for table in ("message", "item"):
        for sql in trigger(db.postgres, f"{table}_deletions", table, "true",
                           "UPDATE high_water SET id = id + 1 WHERE name = 'deletions'"):
            conn.execute(db.legacy(sql))


MIGRATIONS: list[Migrate] = [m001_initial, m002_retrieval, m003_heat,
                                                   m004_recall, m005_standing, m006_batched,
                                                   m007_conversation_order, m008_retrieval_time,
                                                   m009_harness_text, m010_store_guarantees,
                                                   m011_secret, m012_retrieval_pending,
                                                   m013_id_sequences, m014_message_lookup,
                                                   m015_retrieval_numbered,
                                                   m016_born_with_retrieval,
                                                   m017_deletions_counted, m018_savings,
                                                   m019_vectors]


# Each derived table's own purge hook (store.Forget), run before a purge deletes items. The
# tables whose rows reference item(id) ON DELETE CASCADE (retrieval and its pending, numbered
# and next rows, chain, binding) need none: the deletion takes them, and retrieval's trigger
# logs what its counts must give back. A new derived table keyed by item either references it
# so, or adds its hook here.
FORGET: list[Forget] = [heat.forget]


def open_memory(path: str | Path, derivers: Iterable[Deriver] = ()) -> Store:
    """The store at `path`, migrated, with every deriver wired (and `derivers` after them)."""
    # The semantic table and its terms' vectors made before any write takes the lock (0.3 s,
    # once a process): made by a message's write, they held the lock long enough for parallel
    # writers to fail.
    vectors.table().terms(dictionary.shipped())
    return Store(path, migrations=MIGRATIONS,
                 derivers=[derive_retrieval, *derivers],
                 batched={"chain": derive_chains}, settle=settle_in,
                 sequence=sequence_in)
