"""`perpetuity memory check`: every invariant the write path promises, recomputed from the
stored rows in one read snapshot (it runs beside a serving proxy and never writes).

One line per violation; none means the memory is whole:
- every item but harness context has exactly one retrieval row (context none; on PostgreSQL it
  may still be waiting for its seq in retrieval_pending), of the live
  dictionary version, agreeing with its message (user, conversation, time), and holding its
  birth (heat.py); an activation agrees with its message;
- the pooled counts (rows, length, tokens, document frequency per term) equal a recount of
  the folded rows, less the deletions the writer has not settled yet;
- nothing points at what is gone: items without a message, messages without a conversation
  or user, activations, chains, bindings or dark rows without their item;
- the chains up to their cursor are exactly what the live dictionary derives from the rows'
  text, and the binding log binds rows of the turn's own user only;
- ids are never handed out twice: the high-water marks of deleted ids are kept;
- no message of a harness's history is stored twice: a later copy of a message (same
  conversation, pair key and content) stored somewhere else than after the message its key
  names (a re-sent history taken for new), or one keyed as following a copy of itself (a turn
  sent again after its unanswered copy, capture.py). The same pair said again later (a second
  "Continue" answered the same way) is stored in its place, and is another message.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from perpetuity_core.memory.derived import chains
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.memory.storage.store import Database, Store
from perpetuity_core.wire.conversation import Kind

SHOWN = 5  # ids listed per violation


def check(store: Store) -> list[str]:
    """The violations found, one line each. Its statements are written once, in SQLite's
    dialect (`Database.translated`): this runs by hand, never per request."""
    db = store.db
    with db.snapshot("check the memory") as conn:
        live = db.live.follow(conn).version
        legacy = db.translated(conn)
        return [*_rows(legacy, live), *_counts(legacy), *_orphans(legacy),
                *_chains(db, conn, legacy), *_ids(legacy), *_twice(legacy)]


def _ids_of(conn: Sql, what: str, sql: str, *args: object) -> list[str]:
    """One violation line when `sql` (selecting ids) finds any."""
    return _listed(what, [r[0] for r in conn.execute(sql, args)])


# Retrieval rows, ordered or still waiting for their seq (PostgreSQL, index.sequence).
_RETRIEVAL = ("(SELECT item_id, message_id, user_id, conversation_id, at, version FROM retrieval"
              " UNION ALL SELECT item_id, message_id, user_id, conversation_id, at, version"
              " FROM retrieval_pending)")


def _rows(conn: Sql, live: str) -> list[str]:
    return [
        *_ids_of(conn, "items without a retrieval row", "SELECT i.id FROM item i"
                 f" LEFT JOIN {_RETRIEVAL} r ON r.item_id = i.id WHERE r.item_id IS NULL"
                 " AND i.kind != ?", Kind.CONTEXT.value),
        *_ids_of(conn, "items with a retrieval row both ordered and waiting",
                 "SELECT p.item_id FROM retrieval_pending p JOIN retrieval r"
                 " ON r.item_id = p.item_id"),
        *_ids_of(conn, "harness context with a retrieval row", "SELECT i.id FROM item i"
                 f" JOIN {_RETRIEVAL} r ON r.item_id = i.id WHERE i.kind = ?",
                 Kind.CONTEXT.value),
        *_ids_of(conn, f"retrieval rows not of the live dictionary {live}",
                 f"SELECT item_id FROM {_RETRIEVAL} r WHERE version != ?", live),
        *_ids_of(conn, "retrieval rows disagreeing with their message",
                 f"SELECT r.item_id FROM {_RETRIEVAL} r JOIN item i ON i.id = r.item_id"
                 " JOIN message m ON m.id = i.message_id WHERE r.message_id != m.id"
                 " OR r.user_id != m.user_id OR r.conversation_id != m.conversation_id"
                 " OR r.at != CAST(m.at AS INTEGER)"),
        *_ids_of(conn, "activations disagreeing with their message",
                 "SELECT a.item_id FROM activation a JOIN item i ON i.id = a.item_id"
                 " JOIN message m ON m.id = i.message_id WHERE a.user_id != m.user_id"
                 " OR a.conversation_id != m.conversation_id"),
    ]


def _counts(conn: Sql) -> list[str]:
    (folded,) = conn.execute("SELECT folded_seq FROM retrieval_total").fetchone()
    rows = length = tokens = 0
    df: Counter[int] = Counter()
    last = 0
    while chunk := conn.execute("SELECT seq, length, tokens, terms FROM retrieval WHERE seq > ?"
                                " AND seq <= ? ORDER BY seq LIMIT 50000",
                                (last, folded)).fetchall():
        rows += len(chunk)
        length += sum(r[1] for r in chunk)
        tokens += sum(r[2] for r in chunk)
        t, n = np.unique(np.frombuffer(b"".join(r[3] for r in chunk), "<i4"), return_counts=True)
        df.update(dict(zip(t.tolist(), n.tolist(), strict=True)))
        last = chunk[-1][0]
    # Deletions of folded rows not settled yet are still in the stored counts.
    gone = conn.execute("SELECT length, tokens, terms FROM retrieval_gone"
                        " WHERE settled = 0 AND row_seq <= ?", (folded,)).fetchall()
    stored_df: Counter[int] = Counter(dict(conn.execute("SELECT term, df FROM retrieval_term")))
    for g in gone:
        stored_df.subtract(np.frombuffer(g[2], "<i4").tolist())
    stored = conn.execute("SELECT rows, length, tokens FROM retrieval_total").fetchone()
    stored = (stored[0] - len(gone), stored[1] - sum(g[0] for g in gone),
              stored[2] - sum(g[1] for g in gone))
    out = []
    if stored != (rows, length, tokens):
        out.append(f"pooled totals (rows, length, tokens) {stored} != recount"
                   f" {(rows, length, tokens)}")
    wrong = sorted(t for t in df.keys() | stored_df.keys() if df[t] != stored_df[t])
    if wrong:
        shown = ", ".join(f"{t}: {stored_df[t]} != {df[t]}" for t in wrong[:SHOWN])
        out.append(f"document frequencies != recount: {len(wrong)} terms ({shown})")
    return out


def _orphans(conn: Sql) -> list[str]:
    def missing(child: str, column: str, parent: str) -> list[str]:
        return _ids_of(conn, f"{child} rows whose {parent} is gone",
                       f"SELECT c.{column} FROM {child} c LEFT JOIN {parent} p"
                       f" ON p.id = c.{column} WHERE p.id IS NULL")

    return [
        *missing("item", "message_id", "message"),
        *missing("message", "conversation_id", "conversation"),
        *missing("message", "user_id", "user"),
        *missing("conversation", "user_id", "user"),
        *missing("activation", "item_id", "item"),
        *missing("chain", "item_id", "item"),
        *missing("binding", "item_id", "item"),
        *missing("binding", "turn_message_id", "message"),
        *missing("retrieval_next", "item_id", "item"),
        *_ids_of(conn, "bindings to another user's rows", "SELECT b.item_id FROM binding b"
                 " JOIN message t ON t.id = b.turn_message_id JOIN item i ON i.id = b.item_id"
                 " JOIN message m ON m.id = i.message_id WHERE m.user_id != t.user_id"),
    ]


def _chains(db: Database, raw: Sql, conn: Sql) -> list[str]:
    """`raw`: the connection chains' own statements (written per backend) run on."""
    (cursor,) = conn.execute("SELECT seq FROM derived WHERE name = 'chain'").fetchone()
    d = db.dictionary
    want = {(user, s, at, i) for i, user, at, text in chains.text_rows(db, raw, 0, cursor, None)
            for s in chains.subjects(d, text)}
    have = set(conn.execute(
        "SELECT c.user_id, c.term, c.at, c.item_id FROM chain c"
        " JOIN retrieval r ON r.item_id = c.item_id WHERE r.seq <= ?", (cursor,)).fetchall())
    return [*_listed("rows missing from their chains", sorted({r[3] for r in want - have})),
            *_listed("chain entries no row derives", sorted({r[3] for r in have - want}))]


def _ids(conn: Sql) -> list[str]:
    marks = dict(conn.execute("SELECT name, id FROM high_water"))
    return [f"no high-water mark for {t} ids" for t in ("message", "item") if t not in marks]


def _twice(conn: Sql) -> list[str]:
    # Only a message with another copy in its conversation (the same content: one pass over
    # the fingerprint index) can be one stored twice. The later copy is listed when it is not
    # where its pair key says it was said (after the message stored before it), and so is the
    # rest of a history stored again after it, each in place after the copy before it.
    copies: dict[tuple[int, str], set[str]] = {}
    twice: dict[int, None] = {}  # in id order
    for i, conversation, key, fp, before, before_fp in conn.execute(
            "SELECT m.id, m.conversation_id, m.pair_key, m.fingerprint, b.id, b.fingerprint"
            " FROM message m JOIN (SELECT conversation_id, fingerprint FROM message"
            " GROUP BY conversation_id, fingerprint HAVING count(*) > 1) d"
            " ON d.conversation_id = m.conversation_id AND d.fingerprint = m.fingerprint"
            " LEFT JOIN message b ON b.id = (SELECT max(p.id) FROM message p"
            " WHERE p.conversation_id = m.conversation_id AND p.id < m.id)"
            " ORDER BY m.id").fetchall():
        earlier = copies.setdefault((conversation, fp), set())
        if earlier and (capture.after_itself(key, fp) or key in earlier and (
                not capture.follows(key, before_fp or "", fp) or before in twice)):
            twice[i] = None
        earlier.add(key)
    return _listed("messages of a harness's history stored twice (same conversation, same"
                   " place, same content)", list(twice))


def _listed(what: str, ids: list[int]) -> list[str]:
    if not ids:
        return []
    shown = ", ".join(str(i) for i in ids[:SHOWN]) + (" ..." if len(ids) > SHOWN else "")
    return [f"{what}: {len(ids)} ({shown})"]

