"""The memory's composition root: the ordered list of migrations, and `open_memory`, which opens
a Store with the derivers that keep every structure derived from its rows.

The store knows nothing of what is derived from its rows: it calls the derivers it is given,
inside each message's transaction (retrieval rows and activations: no item may exist without
them, and harness context is stored, born cold, and never retrieved) or a batch at a time (the
chains, `Store.flush`). Each derived structure owns its migrations; `MIGRATIONS` lists them in
their historical order, by the names already recorded in users' databases.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from perpetuity_core.memory.chains import derive_chains, m004_recall
from perpetuity_core.memory.heat import derive_activation, m003_heat, m005_standing
from perpetuity_core.memory.index import (
    derive_retrieval,
    items_by_message,
    m002_retrieval,
    m008_retrieval_time,
    m012_retrieval_pending,
    sequence_in,
    settle_in,
)
from perpetuity_core.memory.names import opening_words
from perpetuity_core.memory.store import (
    Database,
    Deriver,
    Migrate,
    Store,
    m001_initial,
    m006_batched,
    m007_conversation_order,
    m010_store_guarantees,
    m011_secret,
    m013_id_sequences,
)
from perpetuity_core.wire.conversation import Kind, text_part


def m009_harness_text(db: Database) -> None:
    """Harness text is not memory; conversations have names (names.py).

    Items the harness wrote, stored before this was told (Claude Code's mid-conversation system
    messages, its IDE notes, task notices, skill text and interrupt markers: see
    conversation.text_part), become context: their retrieval rows, chains and bindings go, and
    they are cold, as context is born (heat.py). Rows that quote a reminder the harness appended
    (tool results) are indexed again without it. Conversations get the title, opening words and
    folder their label is made of; those stored before get their first prompt's opening words.
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
    for items in items_by_message(db, reminded):
        derive_retrieval(db, items)
    for (cid,) in conn.execute("SELECT id FROM conversation").fetchall():
        first = conn.execute(
            "SELECT i.text FROM message m JOIN item i ON i.message_id = m.id WHERE"
            " m.conversation_id = ? AND m.role = 'user' AND i.kind = ? AND trim(i.text) != ''"
            " ORDER BY m.id, i.seq LIMIT 1", (cid, Kind.TEXT.value)).fetchone()
        if first:
            conn.execute("UPDATE conversation SET opening = ? WHERE id = ?",
                         (opening_words(first[0]), cid))


MIGRATIONS: list[Migrate] = [m001_initial, m002_retrieval, m003_heat,
                                                   m004_recall, m005_standing, m006_batched,
                                                   m007_conversation_order, m008_retrieval_time,
                                                   m009_harness_text, m010_store_guarantees,
                                                   m011_secret, m012_retrieval_pending,
                                                   m013_id_sequences]


def open_memory(path: str | Path, derivers: Iterable[Deriver] = ()) -> Store:
    """The store at `path`, migrated, with every deriver wired (and `derivers` after them)."""
    return Store(path, migrations=MIGRATIONS,
                 derivers=[derive_retrieval, derive_activation, *derivers],
                 batched={"chain": derive_chains}, settle=settle_in,
                 sequence=sequence_in)
