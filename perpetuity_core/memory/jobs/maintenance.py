"""Upkeep of a memory beside a serving proxy: purge a user, swap the retrieval dictionary as
data, and check every invariant the write path promises.

Each write here goes through `store.writing` (BEGIN IMMEDIATE), so it queues behind the
proxy's writer instead of failing, and the proxy's arena follows by its cursors: a purge is a
batch of deletions, a flip re-writes every retrieval row under new seqs and a new version
(the arena sees the version change and rebuilds).

The dictionary. Every version lives in the `dictionary` table; the setting `dictionary` names
the live one, which every retrieval row is derived with. A new version is uploaded dark;
`rederive` prepares everything the flip needs, a batch per transaction (resumable: items only
grow, see m010, so the cursor is the highest item re-derived), while the proxy serves on the
live version: each item's row goes into `retrieval_next`, and into staged twins of the four
structures a flip swaps (`retrieval_staged` with its rows under seqs past every live one,
`retrieval_term_staged` and `retrieval_total_staged` counting them, `chain_staged` their
chains: a stem's rank picks a row's subjects). Items purged meanwhile leave the staged rows
by cascade, logged by a trigger. `flip` is then one short transaction: it re-derives the
items stored since, takes the logged deletions out of the staged counts, and renames each
swapped table with its twin (a rename touches the schema only); the old version's tables are
emptied after it, DROP_BATCH rows per transaction, and dropped. Measured by
scripts/bench_flip.py, a turn stored every 20 ms meanwhile: at 10M tokens (52k rows) the flip
that rebuilt every structure inside its transaction held the write lock 2.9 s (and a turn
failed during the re-derivation, see REDERIVE_PAUSE); the staged flip 0.07 s, the turns
stored during it and the drops after it waited 90 ms at most, none failed. At 82M (437k rows;
the old flip was seen holding the lock 26 s) the staged flip took 0.48 s, and with the old
tables then dropped whole a turn waited 1.3 s behind a drop, hence the batches. Heat
(activations, clocks) and the binding log are keyed by item and are not touched.
On PostgreSQL the staging is not done yet: rederive fills retrieval_next alone and the flip
rebuilds the rows, counts and chains inside its transaction (`_flip_in_place`), holding the
write lock 3.3 s at 10M tokens pooled (2.5 s of it the chains: 318k rows, each with its key,
index and foreign key checked) and 30 s at 82M, where the turn stored meanwhile waited 30 s
(scripts/bench_flip.py --postgresql; none failed: PostgreSQL's lock has no busy timeout).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.derived import chains, vectors
from perpetuity_core.memory.derived.index import (
    count_terms,
    fold,
    item_text,
    sequence_in,
    settle_in,
    token_estimate,
)
from perpetuity_core.memory.storage import dictionary, users
from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.memory.storage.store import Database, Store
from perpetuity_core.wire.conversation import Kind

_CONTEXT = Kind.CONTEXT.value  # harness text: stored, never retrieved (no retrieval row)

# Items re-derived per transaction: each holds the write lock for a few tens of milliseconds
# (~85 ms at 10M tokens), so the proxy's writes interleave.
REDERIVE_BATCH = 500
# The pause after each batch. SQLite's lock is not fair: a writer waiting on it retries on
# its busy handler's schedule, every 100 ms once it has waited a while, so batches back to
# back starved it (scripts/bench_flip.py at 10M: turns stored during a re-derivation waited
# 3.2 s at the median, and one failed past the 5 s busy timeout).
REDERIVE_PAUSE = 0.1
# Rows of the previous version's tables deleted per transaction after a flip (_drop_old).
DROP_BATCH = 20000


# --------------------------------------------------------------------------- purge


@dataclass(frozen=True, slots=True)
class Purged:
    messages: int
    items: int
    key: str  # the user's full key (the harness's name resolved)


def purge_user(store: Store, user_key: str) -> Purged:
    """Remove a user's memory as a unit (the user named as users.find_user takes it):
    messages, rows, retrieval rows and their counts, activations, clock, chains, conversation
    names, and every binding to their rows, in one transaction. The user and conversation rows
    stay (keys only, no content): a running proxy holds their ids."""
    db = store.db
    with db.writing("purge a user") as raw:
        conn = db.translated(raw)
        uid, key = users.find_user(conn, user_key)
        mine = "SELECT id FROM message WHERE user_id = ?"
        (items,) = conn.execute(f"SELECT count(*) FROM item WHERE message_id IN ({mine})",
                                (uid,)).fetchone()
        # Items first (their retrieval rows, chains and bindings cascade), then the messages.
        conn.execute(f"DELETE FROM item WHERE message_id IN ({mine})", (uid,))
        messages = conn.execute("DELETE FROM message WHERE user_id = ?", (uid,)).rowcount
        for table in ("activation", "clock", "chain"):
            conn.execute(f"DELETE FROM {table} WHERE user_id = ?", (uid,))
        # A conversation's name is made of what was said in it (names.py).
        conn.execute("UPDATE conversation SET title = '', opening = '', folder = ''"
                     " WHERE user_id = ?", (uid,))
        settle_in(db, raw)
    return Purged(messages, items, key)


# --------------------------------------------------------------------------- the dictionary


@dataclass(frozen=True, slots=True)
class Version:
    version: str
    uploaded_at: float
    live: bool
    rederived: int  # items re-derived into retrieval_next under it, waiting for the flip


def versions(store: Store) -> list[Version]:
    with store.db.snapshot("list dictionary versions") as raw:
        conn = store.db.translated(raw)
        live = _live_version(conn)
        dark = dict(conn.execute("SELECT version, count(*) FROM retrieval_next GROUP BY version"))
        return [Version(v, at, v == live, dark.get(v, 0)) for v, at in conn.execute(
            "SELECT version, uploaded_at FROM dictionary ORDER BY uploaded_at")]


def upload(store: Store, path: Path) -> str:
    """Store a dictionary file (gzipped JSON, as scripts/build_dictionary.py writes) dark."""
    try:
        body = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    version = dictionary.Dictionary.from_bytes(body).version
    with store.db.writing("upload a dictionary") as raw:
        store.db.translated(raw).execute("INSERT OR IGNORE INTO dictionary VALUES (?, ?, ?)",
                     (version, body, time.time()))
    return version


def target(store: Store, version: str | None = None) -> str:
    """The version to re-derive into: the one named, else the newest uploaded that is not
    live, else the shipped one (uploaded here) when the memory is not on it."""
    with store.db.snapshot("read dictionary versions") as conn:
        live = _live_version(conn)
        held = [v for (v,) in conn.execute(
            "SELECT version FROM dictionary ORDER BY uploaded_at DESC")]
    if version is not None:
        if version not in held:
            raise ConfigError(f"no dictionary version {version!r} uploaded")
        return version
    if dark := [v for v in held if v != live]:
        return dark[0]
    shipped = dictionary.shipped()
    if shipped.version == live:
        raise ConfigError(f"the memory is on the shipped dictionary {live}: upload another first")
    return upload(store, dictionary.shipped_path())


def rederive(store: Store, version: str, progress: bool = True) -> int:
    """Re-derive every item's retrieval row under `version` into retrieval_next and the staged
    structures (module docstring), a batch per transaction, resuming where a previous run
    stopped; returns the items written now."""
    from tqdm import tqdm

    db = store.db
    d = _dictionary(db, version)
    if not db.postgres:
        _drop_old(db)
    with db.writing("start re-deriving") as raw:
        conn = db.translated(raw)
        staged = {v for (v,) in conn.execute("SELECT version FROM retrieval_next LIMIT 1")}
        if db.postgres:  # see _flip_in_place
            conn.execute("DELETE FROM retrieval_next WHERE version != ?", (version,))
        elif not _staging(conn) or staged - {version}:  # rows of an abandoned version go
            _unstage(conn)
            _stage(conn)
        (total,) = conn.execute("SELECT count(*) FROM item WHERE kind != ?",
                                (_CONTEXT,)).fetchone()
        (done,) = conn.execute("SELECT count(*) FROM retrieval_next").fetchone()
        # Up to the newest item now: the proxy stores on meanwhile, and the flip re-derives
        # what it stored (a re-derivation chasing it would never end).
        (upto,) = conn.execute("SELECT coalesce(max(id), 0) FROM item").fetchone()
    bar = tqdm(total=total, initial=done, unit="row", desc=f"re-deriving {version}",
               disable=not progress)
    written = 0
    while n := _rederive_batch(db, d, REDERIVE_BATCH, upto):
        written += n
        bar.update(n)
        time.sleep(REDERIVE_PAUSE)
    bar.close()
    return written


def flip(store: Store, version: str) -> int:
    """Make `version` live in one short transaction: the rows stored since the re-derivation
    are re-derived, the deletions since taken out of the staged counts, and each swapped
    structure renamed with its staged twin (SQLite; on PostgreSQL the rows, counts and chains
    are still rebuilt inside the flip's transaction, _flip_in_place). Returns the rows now
    live."""
    db = store.db
    d = _dictionary(db, version)
    with db.writing("flip the dictionary") as raw:
        conn = db.translated(raw)
        (dark,) = conn.execute("SELECT count(*) FROM retrieval_next WHERE version = ?",
                               (version,)).fetchone()
        if not dark or not (db.postgres or _staging(conn)):
            raise ConfigError(f"nothing re-derived under {version}: run rederive first")
        # PostgreSQL: the rows still waiting for their seq (stored under the old dictionary)
        # are ordered in first, so the flip replaces them with the rest. Item ids past the
        # re-derivation's cursor are the only ones it has not seen, although writers run in
        # parallel there: every batch, like this flip, holds the lock exclusive, so no id
        # handed out before it belongs to a transaction still in flight (database.py).
        sequence_in(db, raw)
        while _rederive_batch(db, d, REDERIVE_BATCH):  # savepoints inside this transaction
            pass
        # Every deletion of the old version goes with it (its counts go whole); arenas rebuild
        # on the version change, so nothing else is logged.
        conn.execute("UPDATE retrieval_gone SET settled = 1 WHERE settled = 0")
        if db.postgres:
            _flip_in_place(db, raw)
        else:
            _swap_staged(db, raw)
        conn.execute("UPDATE derived SET seq = (SELECT coalesce(max(seq), 0) FROM retrieval)")
        conn.execute("UPDATE setting SET value = ? WHERE key = 'dictionary'", (version,))
        conn.execute("INSERT INTO setting VALUES ('flips', '1') ON CONFLICT(key) DO UPDATE"
                     " SET value = CAST(CAST(setting.value AS INTEGER) + 1 AS TEXT)")
        (rows,) = conn.execute("SELECT rows FROM retrieval_total").fetchone()
    db.live.current = d
    if not db.postgres:
        _drop_old(db)
    return rows


def _swap_staged(db: Database, conn: Sql) -> None:
    """Rename each swapped structure with its staged twin (SQLite: a rename touches the
    schema only), the staged counts first cleared of the rows purged since they were staged."""
    _settle_staged(db, conn)
    (trigger,) = conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'retrieval_deleted'").fetchone()
    conn.execute("DROP TRIGGER retrieval_deleted")
    for table in _SWAPPED:
        conn.execute(f"ALTER TABLE {table} RENAME TO {table}_old")
        conn.execute(f"ALTER TABLE {table}_staged RENAME TO {table}")
    conn.execute(trigger)
    conn.execute("DELETE FROM high_water WHERE name = 'retrieval_staged'")
    conn.execute("ALTER TABLE retrieval_next RENAME TO retrieval_next_old")
    _twin(conn, "retrieval_next_old", "retrieval_next")


def _flip_in_place(db: Database, raw: Sql) -> None:
    """PostgreSQL: every retrieval row, the pooled counts and the chains rebuilt from
    retrieval_next inside the flip's transaction (staging there is left to do: its tables
    would share the retrieval sequence, which belongs to the table it was made with)."""
    conn = db.translated(raw)
    before = _delete_unlogged(conn)
    conn.execute(
        "INSERT INTO retrieval (item_id, message_id, user_id, conversation_id, at, length,"
        " tokens, version, terms, counts, born, half_life, vec) SELECT n.item_id, m.id,"
        " m.user_id, m.conversation_id, CAST(m.at AS INTEGER), n.length, n.tokens, n.version,"
        " n.terms, n.counts, n.born, n.half_life, n.vec FROM retrieval_next n JOIN item i ON i.id = n.item_id"
        " JOIN message m ON m.id = i.message_id ORDER BY n.item_id")
    conn.execute("DELETE FROM retrieval_term")
    conn.execute("UPDATE retrieval_total SET rows = 0, length = 0, tokens = 0, folded_seq = ?",
                 (before,))
    fold(db, raw)
    conn.execute("DELETE FROM chain")
    # One statement splitting the subjects in the server: sent a row at a time (318k at 10M
    # tokens pooled) they took 4.3 s of a 5.9 s flip.
    conn.execute(
        "INSERT INTO chain (user_id, term, at, item_id) SELECT m.user_id, s.term, m.at,"
        " n.item_id FROM retrieval_next n JOIN item i ON i.id = n.item_id"
        " JOIN message m ON m.id = i.message_id"
        " CROSS JOIN unnest(string_to_array(n.subjects, ' ')) AS s(term)"
        " WHERE n.subjects != '' ON CONFLICT DO NOTHING")
    conn.execute("DELETE FROM retrieval_next")


# -- the staged structures

# What a flip swaps, each for its twin `<table>_staged` that re-derivation batches fill.
_SWAPPED = ("retrieval", "retrieval_term", "retrieval_total", "chain")
# The staged rows' seqs start this far past the live ones: rows stored live while staging
# take the seqs between, so no seq is handed out twice (a reader holding a seq from before
# the flip finds no row under it).
SEQ_GAP = 1 << 32


def _staging(conn: Sql) -> bool:
    (n,) = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'"
                        " AND name IN ('retrieval_staged_gone'"
                        + "".join(f", '{t}_staged'" for t in _SWAPPED) + ")").fetchone()
    return n == len(_SWAPPED) + 1


def _stage(conn: Sql) -> None:
    """Empty staged twins of the swapped structures, and a log of their rows deleted (items
    purged while staging: cascades) for the flip to take out of the staged counts."""
    (gen,) = conn.execute("SELECT coalesce((SELECT value FROM setting WHERE key = 'flips'), 0)"
                          " + 1").fetchone()
    for table in _SWAPPED:
        _twin(conn, table, f"{table}_staged", int(gen))
    conn.execute("INSERT INTO retrieval_total_staged VALUES (1, 0, 0, 0, 0)")
    # Staged rows are numbered past this mark, as live ones past theirs (index.m015).
    conn.execute("INSERT OR REPLACE INTO high_water SELECT 'retrieval_staged', ? + max((SELECT"
                 " coalesce(max(seq), 0) FROM retrieval), (SELECT id FROM high_water"
                 " WHERE name = 'retrieval'))", (SEQ_GAP,))
    conn.execute("CREATE TABLE retrieval_staged_gone (length INTEGER NOT NULL,"
                 " tokens INTEGER NOT NULL, terms BLOB NOT NULL)")
    conn.execute("CREATE TRIGGER retrieval_staged_deleted AFTER DELETE ON retrieval_staged"
                 " BEGIN INSERT INTO retrieval_staged_gone VALUES (old.length, old.tokens,"
                 " old.terms); END")
    conn.execute("DELETE FROM retrieval_next")


def _unstage(conn: Sql) -> None:
    for table in (*(f"{t}_staged" for t in _SWAPPED), "retrieval_staged_gone"):
        conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.execute("DELETE FROM high_water WHERE name = 'retrieval_staged'")


def _twin(conn: Sql, table: str, twin: str, gen: int = 0) -> None:
    """Create `twin`, empty, as `table` is declared, with its indexes (named for generation
    `gen`: index names are global, and a twin outlives the table it copies)."""
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?",
                          (table,)).fetchone()
    conn.execute(re.sub(r'^CREATE TABLE\s+("[^"]+"|\w+)', f"CREATE TABLE {twin}", sql))
    for name, index in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index'"
                                    " AND tbl_name = ? AND sql IS NOT NULL", (table,)).fetchall():
        index = re.sub(r'INDEX\s+("[^"]+"|\w+)\s+ON\s+("[^"]+"|\w+)',
                       f"INDEX {name.split('__')[0]}__{gen} ON {twin}", index)
        conn.execute(index)


def _settle_staged(db: Database, conn: Sql) -> None:
    """Take the staged rows deleted since they were staged out of the staged counts."""
    gone = conn.execute("SELECT length, tokens, terms FROM retrieval_staged_gone").fetchall()
    conn.execute("DROP TRIGGER retrieval_staged_deleted")
    conn.execute("DROP TABLE retrieval_staged_gone")
    if not gone:
        return
    terms = np.frombuffer(b"".join(g[2] for g in gone), "<i4")
    count_terms(db, conn, terms, -1, "retrieval_term_staged")
    conn.executemany("DELETE FROM retrieval_term_staged WHERE term = ? AND df <= 0",
                     [(t,) for t in np.unique(terms).tolist()])
    conn.execute("UPDATE retrieval_total_staged SET rows = rows - ?, length = length - ?,"
                 " tokens = tokens - ?", (len(gone), sum(g[0] for g in gone),
                                          sum(g[1] for g in gone)))


def _drop_old(db: Database) -> None:
    """Drop what the last flip swapped out, after it (resumed by the next rederive or flip):
    DROP_BATCH rows per transaction, pausing between, then the empty table (dropped whole,
    one made a turn wait 1.3 s at 82M tokens, scripts/bench_flip.py)."""
    for table in (*(f"{t}_old" for t in _SWAPPED), "retrieval_next_old"):
        while True:
            with db.writing("drop the previous dictionary's rows") as conn:
                if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table'"
                                    " AND name = ?", (table,)).fetchone():
                    break
                key = _row_key(conn, table)
                gone = conn.execute(f"DELETE FROM {table} WHERE ({key}) IN (SELECT {key}"
                                    f" FROM {table} LIMIT ?)", (DROP_BATCH,)).rowcount
                if gone < DROP_BATCH:
                    conn.execute(f"DROP TABLE {table}")
                    break
            time.sleep(REDERIVE_PAUSE)


def _delete_unlogged(conn: Sql) -> int:
    """PostgreSQL: delete every retrieval row without the trigger logging each; returns the
    last seq ever handed out (the new rows' seqs start past it)."""
    # A trigger disabled inside the transaction is disabled for it alone (readers wait for the
    # flip to commit: ALTER TABLE locks the table).
    conn.execute("ALTER TABLE retrieval DISABLE TRIGGER retrieval_deleted")
    conn.execute("DELETE FROM retrieval")
    conn.execute("ALTER TABLE retrieval ENABLE TRIGGER retrieval_deleted")
    return int(conn.execute("SELECT CASE WHEN is_called THEN last_value ELSE 0 END"
                            " FROM retrieval_seq_seq").fetchone()[0])


def _row_key(conn: Sql, table: str) -> str:
    """What names a row of `table`: rowid, or a WITHOUT ROWID table's primary key (chain)."""
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    if not sql.rstrip().upper().endswith("WITHOUT ROWID"):
        return "rowid"
    return ", ".join(name for _, name in sorted(
        (r[5], r[1]) for r in conn.execute(f"PRAGMA table_info({table})") if r[5]))


def _rederive_batch(db: Database, d: dictionary.Dictionary, limit: int,
                    upto: int | None = None) -> int:
    """Re-derive the next `limit` items past the cursor (up to item `upto`) under `d` into
    retrieval_next and the staged structures (rows, counts, chains); returns how many."""
    with db.writing("re-derive rows") as raw:
        conn = db.translated(raw)
        staging = not db.postgres  # see _flip_in_place
        if staging and not _staging(conn):
            _unstage(conn)
            _stage(conn)
        (after,) = conn.execute("SELECT coalesce(max(item_id), 0) FROM retrieval_next").fetchone()
        # A row keeps its birth (heat.py) under every dictionary.
        items = conn.execute(
            "SELECT i.id, i.kind, i.name, i.text, m.id, m.user_id, m.conversation_id, m.at,"
            " coalesce(r.born, p.born), coalesce(r.half_life, p.half_life)"
            " FROM item i JOIN message m ON m.id = i.message_id"
            " LEFT JOIN retrieval r ON r.item_id = i.id"
            " LEFT JOIN retrieval_pending p ON p.item_id = i.id WHERE i.id > ? AND i.id <= ?"
            " AND i.kind != ? ORDER BY i.id LIMIT ?",
            (after, upto if upto is not None else 1 << 62, _CONTEXT, limit)).fetchall()
        if not items:
            return 0
        nxt, staged, chained, bags = [], [], [], []
        table = vectors.table()  # a row's vector is re-derived with its terms
        for i, kind, name, text, message, user, conversation, at, born, half in items:
            t = item_text(kind, name, text)
            bag = d.bag(t)
            bags.append(bag.terms)
            terms = bag.terms.astype("<i4", copy=False).tobytes()
            vec = table.row(d, terms, bag.counts.tobytes())
            subjects = chains.subjects(d, text) if kind == Kind.TEXT.value and text.strip() else []
            n_tokens = token_estimate(t)
            nxt.append((i, d.version, bag.length, n_tokens, terms, bag.counts.tobytes(),
                        " ".join(subjects), born, half, vec))
            staged.append((i, message, user, conversation, int(at), bag.length, n_tokens,
                           d.version, terms, bag.counts.tobytes(), born, half, vec))
            chained += [(user, s, at, i) for s in subjects]
        conn.executemany("INSERT OR REPLACE INTO retrieval_next (item_id, version, length, tokens,"
                         " terms, counts, subjects, born, half_life, vec)"
                         " VALUES (?,?,?,?,?,?,?,?,?,?)",
                         nxt)
        if not staging:
            return len(items)
        conn.executemany(
            "INSERT INTO retrieval_staged (seq, item_id, message_id, user_id, conversation_id,"
            " at, length, tokens, version, terms, counts, born, half_life, vec) VALUES (max((SELECT"
            " coalesce(max(seq), 0) FROM retrieval_staged), (SELECT id FROM high_water WHERE"
            " name = 'retrieval_staged')) + 1, ?,?,?,?,?,?,?,?,?,?,?,?,?)", staged)
        chains.insert_chain("chain_staged").run(raw, db.postgres, chained)
        count_terms(db, raw, np.concatenate(bags), +1, "retrieval_term_staged")
        conn.execute("UPDATE retrieval_total_staged SET rows = rows + ?, length = length + ?,"
                     " tokens = tokens + ?, folded_seq = (SELECT max(seq) FROM retrieval_staged)",
                     (len(staged), sum(s[5] for s in staged), sum(s[6] for s in staged)))
    return len(items)


def _dictionary(db: Database, version: str) -> dictionary.Dictionary:
    if version == dictionary.shipped().version:
        return dictionary.shipped()
    with db.snapshot("read a dictionary") as raw:
        row = db.translated(raw).execute("SELECT body FROM dictionary WHERE version = ?",
                                         (version,)).fetchone()
    if row is None:
        raise ConfigError(f"no dictionary version {version!r} uploaded")
    return dictionary.Dictionary.from_bytes(row[0])


def _live_version(conn: Sql) -> str:
    return conn.execute("SELECT value FROM setting WHERE key = 'dictionary'").fetchone()[0]

