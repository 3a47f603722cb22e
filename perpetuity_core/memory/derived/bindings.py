"""The binding log (`binding`), derived for the recall tools, with one writer: the rows that came
up together in one turn, what the turn retrieved and what it stored. `record_bindings` writes it
from the store's writer after each turn; memory_cooccur reads it.
"""

from __future__ import annotations

from collections.abc import Iterable

from perpetuity_core.memory.storage.dialect import SQL, Rows, marks
from perpetuity_core.memory.storage.store import Database, in_chunks

_USER_OF = SQL.both("SELECT user_id FROM message WHERE id = ?")
_ITEMS_OF = SQL.both("SELECT id FROM item WHERE message_id = ?")
_BIND = Rows("INSERT OR IGNORE INTO binding (turn_message_id, item_id) VALUES (?, ?)",
             "INSERT INTO binding (turn_message_id, item_id) VALUES ", "(%s, %s)",
             " ON CONFLICT DO NOTHING")


def record_bindings(db: Database, message_id: int, item_ids: Iterable[int]) -> int:
    """Log that `item_ids` (what a turn retrieved and showed the model: frame rows, tool
    results) came up together with the rows of `message_id` (what the turn stored, usually the
    reply), under that message. The store's writer calls this after each turn: it is the
    binding log's only writer. A row of another user than the message's is never bound.
    Returns how many rows the turn binds."""
    with db.writing("log the turn's bindings", ordered=False) as conn:
        row = conn.execute(db.pick(_USER_OF), (message_id,)).fetchone()
        if row is None:
            return 0
        ids = {i for (i,) in conn.execute(db.pick(_ITEMS_OF), (message_id,))}
        wanted = sorted(set(item_ids) - ids)
        mark = "%s" if db.postgres else "?"
        for chunk in in_chunks(wanted):
            ids.update(i for (i,) in conn.execute(
                "SELECT i.id FROM item i JOIN message m ON m.id = i.message_id WHERE"
                f" m.user_id = {mark} AND i.id IN ({marks(db.postgres, len(chunk))})",
                (row[0], *chunk)))
        _BIND.run(conn, db.postgres, [(message_id, i) for i in sorted(ids)])
    return len(ids)

