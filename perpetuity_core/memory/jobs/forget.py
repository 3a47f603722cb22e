"""Forgetting on request: `perpetuity memory purge --conversation ID` and `--matching TEXT`
(docs/forgetting.md says what "forgotten" covers).

On a personal proxy every conversation is one user's, so removing a user removes everything;
a person wants one conversation gone, or every message holding what they pasted. `select`
finds those messages (a preview changes nothing), `forget` removes them and everything derived
from them in one transaction (the selection made again inside it): their rows, each derived
table's rows of them (cascaded from the items, or through a deriver's own hook,
schema.FORGET), their counts (settled), the name of a conversation left empty or naming the
text, and a harness's kept request shape quoting the text (templates.py). A running proxy
follows the deletions as it follows any purge (kept.There, the arena's cursors), so search,
the frame, the recall tools and `memory check` agree at once.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.derived.index import settle_in
from perpetuity_core.memory.schema import FORGET
from perpetuity_core.memory.storage import templates, users
from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.memory.storage.store import Store, failing_as, in_chunks

EXCERPT = 70  # characters of a message shown in a preview, around the text matched


@dataclasses.dataclass(frozen=True, slots=True)
class Doomed:
    """A message a purge removes, as its preview shows it."""

    id: int
    conversation_id: int
    conversation: str  # its key, as the harness named it
    role: str
    at: float
    excerpt: str


@dataclasses.dataclass(frozen=True, slots=True)
class Purge:
    """What a purge removes (previewed until --yes)."""

    messages: list[Doomed]
    items: int
    emptied: list[int]  # conversations with no message left: their names go too
    names: list[int]  # conversations whose name holds the text matched
    shapes: list[str]  # settings keeping a harness's request shape that quotes it
    wal_cleared: bool | None = None  # SQLite, after a purge: the WAL checkpointed and emptied


def select(store: Store, *, conversation: str | None = None, matching: str | None = None,
           user: str | None = None) -> Purge:
    """What a purge would remove; nothing changes."""
    with store.db.snapshot("preview a purge") as raw:
        return _select(store.db.translated(raw), conversation, matching, user)


def forget(store: Store, *, conversation: str | None = None, matching: str | None = None,
           user: str | None = None) -> Purge:
    """Remove what `select` finds, in one transaction; returns what went. On SQLite the pages
    it frees are overwritten with zeros (secure_delete, which not every build turns on) and the
    WAL is checkpointed and truncated after it, so that the file no longer holds the text
    (`wal_cleared`: False while a reader's snapshot still needs older pages)."""
    db = store.db
    if not db.postgres:
        with failing_as("zero what a purge frees"):
            db.connection().execute("PRAGMA secure_delete = ON")
    with db.writing("purge messages") as raw:
        conn = db.translated(raw)
        chosen = _select(conn, conversation, matching, user)
        ids = [m.id for m in chosen.messages]
        items = [i for chunk in in_chunks(ids) for (i,) in conn.execute(
            f"SELECT id FROM item WHERE message_id IN ({_marks(chunk)})", chunk)]
        for hook in FORGET:
            hook(conn, items)
        # Items first (retrieval rows, chains and bindings cascade), then their messages.
        conn.executemany("DELETE FROM item WHERE id = ?", [(i,) for i in items])
        conn.executemany("DELETE FROM message WHERE id = ?", [(i,) for i in ids])
        conn.executemany("UPDATE conversation SET title = '', opening = '', folder = ''"
                         " WHERE id = ?", [(c,) for c in {*chosen.emptied, *chosen.names}])
        conn.executemany("DELETE FROM setting WHERE key = ?", [(k,) for k in chosen.shapes])
        settle_in(db, raw)
    if db.postgres:
        return chosen
    with failing_as("checkpoint the WAL after a purge"):
        (busy, _, _), = db.connection().execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return dataclasses.replace(chosen, wal_cleared=not busy)


def _select(conn: Sql, conversation: str | None, matching: str | None,
            user: str | None) -> Purge:
    if not conversation and not matching:
        raise ConfigError("name what to forget: --conversation ID and/or --matching TEXT")
    where: list[str] = ["1 = 1"]
    args: list[int | str] = []
    if conversation:
        where.append("m.conversation_id = ?")
        args.append(_conversation(conn, conversation))
    if user:
        where.append("m.user_id = ?")
        args.append(users.find_user(conn, user)[0])
    if matching:
        where.append("m.id IN (SELECT message_id FROM item WHERE instr(lower(text), lower(?)) > 0)")
        args.append(matching)
    rows = conn.execute(
        "SELECT m.id, m.conversation_id, c.key, m.role, m.at, (SELECT group_concat(i.text)"
        " FROM item i WHERE i.message_id = m.id) FROM message m JOIN conversation c"
        f" ON c.id = m.conversation_id WHERE {' AND '.join(where)} ORDER BY m.id",
        tuple(args)).fetchall()
    doomed = [Doomed(i, c, key, role, at, _excerpt(text or "", matching))
              for i, c, key, role, at, text in rows]
    ids = [d.id for d in doomed]
    items = sum(conn.execute(f"SELECT count(*) FROM item WHERE message_id IN ({_marks(chunk)})",
                             chunk).fetchone()[0] for chunk in in_chunks(ids))
    per = Counter(d.conversation_id for d in doomed)
    emptied = [c for c, n in sorted(per.items()) if conn.execute(
        "SELECT count(*) FROM message WHERE conversation_id = ?", (c,)).fetchone()[0] == n]
    names, shapes = [], []
    if matching:
        names = [c for (c,) in conn.execute(
            "SELECT id FROM conversation WHERE instr(lower(title || ' ' || opening || ' '"
            " || folder), lower(?)) > 0", (matching,))]
        shapes = [k for (k,) in conn.execute(
            "SELECT key FROM setting WHERE key LIKE ? AND instr(lower(value), lower(?)) > 0",
            (templates.PREFIX + "%", matching))]
    return Purge(doomed, items, emptied, names, shapes)


def _conversation(conn: Sql, spec: str) -> int:
    """The conversation `spec` names: its id (as search shows it, `c12` or `12`) or its key."""
    if spec.lstrip("c").isdigit():
        row = conn.execute("SELECT id FROM conversation WHERE id = ?",
                           (int(spec.lstrip("c")),)).fetchone()
        if row:
            return int(row[0])
    found = [c for (c,) in conn.execute("SELECT id FROM conversation WHERE key = ? ORDER BY id",
                                        (spec,))]
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError(f"{spec!r} names {len(found)} conversations (users' own):"
                          f" {', '.join(f'c{c}' for c in found)}; give the id of one")
    raise ConfigError(f"no conversation {spec!r} in this memory (give its id, as"
                      " `perpetuity search` shows it, or its key)")


def _marks(values: list[int]) -> str:
    return ",".join("?" * len(values))


def _excerpt(text: str, matching: str | None) -> str:
    """The message's words around what matched (its start without a match), on one line."""
    at = text.lower().find(matching.lower()) if matching else -1
    start = max(0, at - EXCERPT // 2) if at >= 0 else 0
    cut = " ".join(text[start:start + EXCERPT].split())
    return ("..." if start else "") + cut + ("..." if start + EXCERPT < len(text) else "")
