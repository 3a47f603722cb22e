"""Every read the frame and the recall tools make of the store, returning rows and ids: what a
model may be shown of memory (SHOWN_KINDS, not blank), each row with its conversation's name;
a conversation's order (the messages around a hit, the other half of its exchange, which
messages are adjacent); and the recall tools' reads of conversations, retrieval terms and the
binding log. Above memory/, no module writes SQL or holds the handle's connection.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from perpetuity_core.memory.storage.dialect import SQL, Sql, marks, one_of
from perpetuity_core.memory.storage.kept import Kept, There, deletions, kept
from perpetuity_core.memory.storage.names import label
from perpetuity_core.memory.storage.store import IN_CHUNK, Database, failing_as, in_chunks
from perpetuity_core.wire.conversation import Kind, without_scaffold

# What a model may be shown of memory: what was said and done, not harness scaffolding or
# thinking.
SHOWN_KINDS = (Kind.TEXT.value, Kind.TOOL_CALL.value, Kind.TOOL_RESULT.value, Kind.MEDIA.value)


@dataclass(frozen=True, slots=True)
class Row:
    """A stored row as the frame and the recall tools show it."""

    item_id: int
    message_id: int
    conversation_id: int
    conversation: str  # its name as a person knows it (names.label), "" when it has none
    role: str
    at: float  # wall time the turn was said
    kind: str
    name: str
    text: str
    secret: str = ""  # the kind of credential the row holds (m011), shown only as withheld
    excerpt: bool = False  # `text` is part of the row's (frame_stretch.excerpt)


def shown_rows(db: Database, item_ids: Iterable[int],
               user_id: int | None = None) -> dict[int, Row]:
    """The rows among `item_ids` (of `user_id` only, when given) that a model may be shown:
    SHOWN_KINDS, and not blank. Ascending ids within each IN_CHUNK of them (SQLite's order)."""
    ids = list(dict.fromkeys(item_ids))
    out: dict[int, Row] = {}
    if len(ids) <= IN_CHUNK:
        # One statement reads one commit by itself: no transaction, whose BEGIN and COMMIT
        # are two more round trips on PostgreSQL.
        with failing_as("read rows"):
            return _shown_rows(db, db.connection(), ids, user_id, out)
    with db.snapshot("read rows") as conn:
        return _shown_rows(db, conn, ids, user_id, out)


_SHOWN_COLUMNS = ("SELECT {} FROM item i JOIN message m ON m.id = i.message_id"
                  " JOIN conversation c ON c.id = m.conversation_id"
                  " WHERE {} AND i.kind IN ({})")
# Which of the rows are there, ids only: the item's key alone. An item never outlives its
# message, nor a message its conversation (their foreign keys; a purge deletes items first and
# keeps the conversation rows), and a row's conversation is never changed, so the joins to them
# that read the rows whole (`_SHOWN_COLUMNS`) would find every one of these; a user's rows alone
# go by their message's user.
_THERE = "SELECT id FROM item WHERE {} AND kind IN ({})"
_THERE_OWNED = ("SELECT i.id FROM item i JOIN message m ON m.id = i.message_id"
                " WHERE {} AND i.kind IN ({}) AND m.user_id = {}")


def _shown_rows(db: Database, conn: Sql, ids: list[int], user_id: int | None,
                out: dict[int, Row]) -> dict[int, Row]:
    """Which rows are there (and their conversations' names, which change) is read every
    time, ids only; a row itself is read whole once and kept (memory.storage.kept): the
    frame reads the same warm rows call after call (LoCoMo: 2.8 ms of a first prompt's
    13 went to reading ~350 rows' text again)."""
    kinds = marks(db.postgres, len(SHOWN_KINDS))
    cache = _kept(db)
    names: dict[int, str] = {}  # each conversation's, made once: a frame's ~100 rows have a few
    # Anyone's rows: which are there is asked only of those not found before, while nothing
    # was deleted (kept.There; counted before anything is read).
    seen, count = (_there(db), deletions(conn)) if user_id is None else (None, None)

    def ask(chunk: list[int]) -> list[int]:
        these, args = one_of(db.postgres, "id", chunk)
        return [item for (item,) in conn.execute(_THERE.format(these, kinds),
                                                 [*args, *SHOWN_KINDS])]

    for chunk in in_chunks(ids):
        if seen is not None:
            there = seen.among(count, chunk, ask)
        else:
            these, args = one_of(db.postgres, "i.id", chunk)
            there = sorted([item for (item,) in conn.execute(
                _THERE_OWNED.format(these, kinds, marks(db.postgres, 1)),
                [*args, *SHOWN_KINDS, user_id])])  # a list: no generator step a row
        known = cache.get(there)
        if len(known) < len(there):  # most calls read no row whole: no test of each
            missing = [item for item in there if item not in known]
            known |= _read_rows(db, conn, missing, kinds, cache)
        # A blank row (kept as None) is not shown: its conversation is not named.
        if unnamed := sorted({r.conversation_id for r in known.values() if r} - names.keys()):
            names |= _labels(db, conn, unnamed)
        for item in there:
            if (row := known.get(item)) is None:  # blank, or gone since `there` was read
                continue
            named = names.get(row.conversation_id, row.conversation)
            out[item] = row if row.conversation == named else replace(row, conversation=named)
    return out


def _read_rows(db: Database, conn: Sql, ids: list[int], kinds: str,
               cache: Kept[Row | None]) -> dict[int, Row | None]:
    """The rows `ids` read whole (None for a blank one), and kept in `cache`."""
    these, args = one_of(db.postgres, "i.id", ids)
    read: dict[int, Row | None] = {}
    for (item, message, conv, title, opening, folder, role, at, kind, name,
         text, secret) in conn.execute(_SHOWN_COLUMNS.format(
            "i.id, m.id, m.conversation_id, c.title, c.opening, c.folder, m.role, m.at,"
            " i.kind, i.name, i.text, i.secret", these, kinds), [*args, *SHOWN_KINDS]):
        shown = without_scaffold(text)
        read[item] = (Row(item, message, conv, label(title, opening, folder), role, at, kind,
                          name, shown, secret) if shown.strip() else None)
    cache.put(read)
    return read


# Text kept of the rows read, in characters: the warm sets of a few busy users (a frame on
# LoCoMo reads ~350 rows of ~170 characters, and every one of them again for the next).
ROWS_KEPT = 16 * 1024 * 1024


def _kept(db: Database) -> Kept[Row | None]:
    return kept(db, "shown rows", lambda: Kept(ROWS_KEPT, lambda r: len(r.text) if r else 0))


def _there(db: Database) -> There:
    return kept(db, "rows there", There)


# A hit's neighbours on PostgreSQL: each hit's two reads as a lateral join over the hits as
# arrays, one statement whatever their number (hit index from 0).
_AROUND_PG = (
    "SELECT h.k - 1, i.id, x.id FROM unnest(%s::bigint[], %s::bigint[]) WITH ORDINALITY"
    " AS h(c, m, k) CROSS JOIN LATERAL ((SELECT id FROM message WHERE conversation_id = h.c"
    " AND id < h.m ORDER BY id DESC LIMIT %s) UNION ALL (SELECT id FROM message"
    " WHERE conversation_id = h.c AND id > h.m ORDER BY id LIMIT %s)) x"
    " JOIN item i ON i.message_id = x.id")


def around(db: Database, hits: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int, int]]:
    """(hit index, item_id, message_id) of the rows of the `n` messages before each hit's message
    and the `n` after it, in its conversation; `hits` are (conversation_id, message_id).

    One statement for all of them: the frame asks for 20 hits' neighbours, 40 statements when
    sent one by one (PostgreSQL, 10M tokens pooled: the frame's reads took 15.0 ms p50 so,
    against 2.3 on SQLite). On SQLite each hit's two reads are branches of one UNION ALL (0.25
    ms for 20 hits; it takes up to 500 branches, 250 hits); on PostgreSQL that took 4 ms (planning 40 branches), the lateral join
    0.45 ms, planned per call (with the generic plan a prepared statement falls back to after
    five calls: 3 ms)."""
    if not hits:
        return []
    if db.postgres:
        raw = db.connection().raw  # type: ignore[attr-defined]  # PgConnection's psycopg one
        return raw.execute(_AROUND_PG, ([c for c, _ in hits], [m for _, m in hits], n, n),
                           prepare=False).fetchall()
    branches: list[str] = []
    args: list[int] = []
    for k, (conversation_id, message_id) in enumerate(hits):
        for branch in _AROUND_SQLITE:
            branches.append(branch.format(k))
            args += (conversation_id, message_id, conversation_id, message_id, n)
    return db.connection().execute(" UNION ALL ".join(branches), args).fetchall()


# A hit's n messages before it (and after it) on SQLite: those of its conversation between the
# hit and the nth message from it, one range of the conversation's index in store order. As
# `m.id IN (the n nearest)` each branch built a temporary index of the n ids (pages allocated
# and zeroed: 40 a frame), and the reads cost 2.5 times as much (20 hits, pooled LoCoMo).
_AROUND_SQLITE = tuple(
    "SELECT {}, i.id, m.id FROM message m JOIN item i ON i.message_id = m.id"
    f" WHERE m.conversation_id = ? AND m.id {cmp} ? AND m.id {edge} (SELECT {bound}(id) FROM"
    f" (SELECT id FROM message WHERE conversation_id = ? AND id {cmp} ? ORDER BY id {order}"
    " LIMIT ?))" for cmp, order, bound, edge in (("<", "DESC", "min", ">="),
                                                 (">", "ASC", "max", "<=")))


def next_spoken(db: Database, conversation_id: int, message_id: int, *,
                after: bool) -> tuple[int, str] | None:
    """(id, role) of the nearest user or assistant message after (or before) a message in its
    conversation. Harness text between them (Claude Code's mid-conversation system message) is
    skipped."""
    row = db.connection().execute(db.pick(_NEXT_SPOKEN[after]),
                                  (conversation_id, message_id)).fetchone()
    return (row[0], row[1]) if row else None


_NEXT_SPOKEN = {after: SQL.both(
    f"SELECT id, role FROM message WHERE conversation_id = ? AND id {cmp} ?"
    f" AND role IN ('user', 'assistant') ORDER BY id {order} LIMIT 1")
    for after, (cmp, order) in ((True, (">", "ASC")), (False, ("<", "DESC")))}


def items_of(db: Database, message_ids: set[int]) -> list[int]:
    """The ids of these messages' rows, in store order."""
    if not message_ids:
        return []
    ids = sorted(message_ids)
    return [i for (i,) in db.connection().execute(
        f"SELECT id FROM item WHERE message_id IN ({marks(db.postgres, len(ids))}) ORDER BY id",
        ids)]


def adjacent_pairs(db: Database, ids: tuple[int, ...]) -> frozenset[tuple[int, int]]:
    """Pairs of rendered messages (of one conversation, ids ascending) with nothing stored
    between them."""
    return following(db, list(zip(ids, ids[1:], strict=False)))


def following(db: Database, pairs: list[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    """Those of `pairs` (a, b: two messages of one conversation, a before b) with nothing
    stored between them: b is the message stored next after a in its conversation.

    Which message comes next after one is read once and kept (memory.storage.kept): ids only
    grow, so nothing can come between a message and the next one stored after it later (a
    purge could only add pairs, and then a run is labelled once more than it needs). One
    lookup a pair, not a read of each conversation's messages between its first and last
    shown (a first prompt's frame over many short conversations asked that ~170 times)."""
    if not pairs:
        return frozenset()
    cache = _next_kept(db)
    known = cache.get(a for a, _ in pairs)
    if missing := sorted({a for a, _ in pairs} - known.keys()):
        read = _next_messages(db, missing)
        cache.put(read)
        known |= read
    return frozenset(p for p in pairs if known.get(p[0]) == p[1])


# The message stored next after each message in its conversation; a conversation's latest
# has none yet and is read again until it does.
_NEXT = ("SELECT m.id, (SELECT n.id FROM message n WHERE n.conversation_id = m.conversation_id"
         " AND n.id > m.id ORDER BY n.id LIMIT 1) FROM message m WHERE {}")
NEXT_KEPT = 1 << 17  # messages whose next is kept per database (a few users' warm sets)


def _next_messages(db: Database, ids: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    conn = db.connection()
    for chunk in in_chunks(ids):
        where, args = one_of(db.postgres, "m.id", chunk)
        out.update((m, n) for m, n in conn.execute(_NEXT.format(where), args) if n is not None)
    return out


def _next_kept(db: Database) -> Kept[int]:
    return kept(db, "next message", lambda: Kept(NEXT_KEPT, lambda _: 1))


def conversation_labels(db: Database, conversation_ids: list[int]) -> dict[int, str]:
    """Each conversation's name as a person knows it (names.label), "" when it has none."""
    return _labels(db, db.connection(), conversation_ids) if conversation_ids else {}


def _labels(db: Database, conn: Sql, conversation_ids: list[int]) -> dict[int, str]:
    where, args = one_of(db.postgres, "id", conversation_ids)
    return {conv: label(title, opening, folder) for conv, title, opening, folder in
            conn.execute(f"SELECT id, title, opening, folder FROM conversation WHERE {where}",
                         args)}


def conversation_of(db: Database, conversation_id: int, owner: int | None) -> int | None:
    """`conversation_id` if it exists (and is `owner`'s, when given), else None."""
    row = db.connection().execute(
        db.pick(_ANY_CONVERSATION) if owner is None else db.pick(_OWN_CONVERSATION),
        (conversation_id,) if owner is None else (conversation_id, owner)).fetchone()
    return row[0] if row else None


_OWN_CONVERSATION = SQL.both("SELECT id FROM conversation WHERE id = ? AND user_id = ?")
_ANY_CONVERSATION = SQL.both("SELECT id FROM conversation WHERE id = ?")


def messages_items(db: Database, message_ids: list[int]) -> dict[int, list[int]]:
    """The ids of these messages' rows, by message, each in store order."""
    where, values = one_of(db.postgres, "message_id", sorted(set(message_ids)))
    by_message: dict[int, list[int]] = {}
    for item_id, message_id in db.connection().execute(
            f"SELECT id, message_id FROM item WHERE {where} ORDER BY id", values).fetchall():
        by_message.setdefault(message_id, []).append(item_id)
    return by_message


def holding(db: Database, item_ids: list[int], terms: np.ndarray) -> set[int]:
    """Which of the rows hold at least one of `terms` themselves (not only their context)."""
    if not item_ids or terms.size == 0:
        return set()
    rows = db.connection().execute(
        "SELECT item_id, terms FROM retrieval WHERE item_id IN"
        f" ({marks(db.postgres, len(item_ids))})", item_ids).fetchall()
    return {i for i, blob in rows if np.isin(np.frombuffer(blob, "<i4"), terms).any()}


def retrieval_terms(db: Database, user_id: int | None,
                    conversation_id: int | None) -> list[tuple[int, bytes]]:
    """(item id, its distinct term ids as little-endian int32) of every retrieval row of
    `user_id` (of everyone, for None), of one conversation when given."""
    sql, params = _USER_ROWS, [user_id]
    if user_id is None:
        sql, params = _ALL_ROWS, []
    if conversation_id is not None:
        sql, params = ((_CONVERSATION_ROWS, [conversation_id]) if user_id is None
                       else (_USER_CONVERSATION_ROWS, [user_id, conversation_id]))
    return db.connection().execute(db.pick(sql), params).fetchall()


_USER_ROWS = SQL.both("SELECT item_id, terms FROM retrieval WHERE user_id = ?")
_USER_CONVERSATION_ROWS = SQL.both(
    "SELECT item_id, terms FROM retrieval WHERE user_id = ? AND conversation_id = ?")
_ALL_ROWS = SQL.both("SELECT item_id, terms FROM retrieval")
_CONVERSATION_ROWS = SQL.both("SELECT item_id, terms FROM retrieval WHERE conversation_id = ?")


def said(db: Database, item_ids: list[int]) -> list[tuple[int, float, int, str, str]]:
    """(item id, when, conversation id, role, kind) of the rows `item_ids` (ascending), by id."""
    conn = db.connection()
    out: list[tuple[int, float, int, str, str]] = []
    for chunk in in_chunks(item_ids):
        out += conn.execute(
            "SELECT i.id, m.at, m.conversation_id, m.role, i.kind FROM item i JOIN message m"
            f" ON m.id = i.message_id WHERE i.id IN ({marks(db.postgres, len(chunk))})"
            " ORDER BY i.id", chunk).fetchall()
    return out


def bound_turns(db: Database, item_ids: list[int]) -> list[tuple[int, int]]:
    """(turn message id, item id) of the binding log's entries for the rows `item_ids`."""
    return db.connection().execute(
        f"SELECT turn_message_id, item_id FROM binding WHERE item_id IN"
        f" ({marks(db.postgres, len(item_ids))})", item_ids).fetchall()


def bound_in(db: Database, turns: list[int]) -> list[tuple[int, int]]:
    """(turn message id, item id) of every row the turns `turns` (ascending) bound, in that
    order."""
    conn = db.connection()
    out: list[tuple[int, int]] = []
    for chunk in in_chunks(turns):
        out += conn.execute(
            "SELECT turn_message_id, item_id FROM binding WHERE turn_message_id IN"
            f" ({marks(db.postgres, len(chunk))}) ORDER BY turn_message_id, item_id",
            chunk).fetchall()
    return out
