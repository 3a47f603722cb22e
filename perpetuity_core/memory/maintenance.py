"""Upkeep of a memory beside a serving proxy: purge a user, swap the retrieval dictionary as
data, and check every invariant the write path promises.

Each write here goes through `store.writing` (BEGIN IMMEDIATE), so it queues behind the
proxy's writer instead of failing, and the proxy's arena follows by its cursors: a purge is a
batch of deletions, a flip re-writes every retrieval row under new seqs and a new version
(the arena sees the version change and rebuilds).

The dictionary. Every version lives in the `dictionary` table; the setting `dictionary` names
the live one, which every retrieval row is derived with. A new version is uploaded dark;
`rederive` writes each item's row under it into `retrieval_next`, a batch per transaction
(resumable: items only grow, see m010, so the cursor is the highest item re-derived) while
the proxy serves on the live version; `flip` re-derives what was stored since and swaps the
rows, the pooled counts, the chains (a stem's rank picks a row's subjects) and the setting in
one transaction. Heat (activations, clocks) and the binding log are keyed by item and are
not touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory import chains, dictionary
from perpetuity_core.memory.dialect import Sql
from perpetuity_core.memory.index import fold, item_text, settle_in, token_estimate
from perpetuity_core.memory.store import Store, postgres, snapshot, writing
from perpetuity_core.wire.conversation import Kind

_CONTEXT = Kind.CONTEXT.value  # harness text: stored, never retrieved (no retrieval row)

# Items re-derived per transaction: each holds the write lock for a few tens of milliseconds,
# so the proxy's writes interleave.
REDERIVE_BATCH = 500


# --------------------------------------------------------------------------- purge


@dataclass(frozen=True, slots=True)
class Purged:
    messages: int
    items: int


def purge_user(store: Store, user_key: str) -> Purged:
    """Remove a user's memory as a unit: messages, rows, retrieval rows and their counts,
    activations, clock, chains, conversation names, and every binding to their rows, in one
    transaction. The user and conversation rows stay (keys only, no content): a running proxy
    holds their ids."""
    with writing("purge a user") as conn:
        row = conn.execute("SELECT id FROM user WHERE key = ?", (user_key,)).fetchone()
        if row is None and user_key.isdigit():
            row = conn.execute("SELECT id FROM user WHERE id = ?", (int(user_key),)).fetchone()
        if row is None:
            raise ConfigError(f"no user {user_key!r} in this memory")
        (uid,) = row
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
        settle_in(conn)
    return Purged(messages, items)


# --------------------------------------------------------------------------- the dictionary


@dataclass(frozen=True, slots=True)
class Version:
    version: str
    uploaded_at: float
    live: bool
    rederived: int  # items re-derived into retrieval_next under it, waiting for the flip


def versions(store: Store) -> list[Version]:
    with snapshot("list dictionary versions") as conn:
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
    with writing("upload a dictionary") as conn:
        conn.execute("INSERT OR IGNORE INTO dictionary VALUES (?, ?, ?)",
                     (version, body, time.time()))
    return version


def target(store: Store, version: str | None = None) -> str:
    """The version to re-derive into: the one named, else the newest uploaded that is not
    live, else the shipped one (uploaded here) when the memory is not on it."""
    with snapshot("read dictionary versions") as conn:
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
    """Re-derive every item's retrieval row under `version` into retrieval_next, a batch per
    transaction, resuming where a previous run stopped; returns the items written now."""
    from tqdm import tqdm

    d = _dictionary(version)
    with writing("start re-deriving") as conn:  # rows of an abandoned version are dropped
        conn.execute("DELETE FROM retrieval_next WHERE version != ?", (version,))
        (total,) = conn.execute("SELECT count(*) FROM item WHERE kind != ?",
                                (_CONTEXT,)).fetchone()
        (done,) = conn.execute("SELECT count(*) FROM retrieval_next").fetchone()
    bar = tqdm(total=total, initial=done, unit="row", desc=f"re-deriving {version}",
               disable=not progress)
    written = 0
    while n := _rederive_batch(d, REDERIVE_BATCH):
        written += n
        bar.update(n)
    bar.close()
    return written


def flip(store: Store, version: str) -> int:
    """Make `version` live in one transaction: the rows stored since the re-derivation are
    re-derived, then every retrieval row, the pooled counts and the chains are swapped for
    theirs. Returns the rows now live."""
    d = _dictionary(version)
    with writing("flip the dictionary") as conn:
        (dark,) = conn.execute("SELECT count(*) FROM retrieval_next WHERE version = ?",
                               (version,)).fetchone()
        if not dark:
            raise ConfigError(f"nothing re-derived under {version}: run rederive first")
        while _rederive_batch(d, REDERIVE_BATCH):  # savepoints inside this transaction
            pass
        # Everything of the old version goes at once, its pending deletions with it (the counts
        # are recounted below). Arenas rebuild on the version change, so the deletions are not
        # logged one by one (the trigger would copy every row).
        conn.execute("UPDATE retrieval_gone SET settled = 1 WHERE settled = 0")
        before = _delete_unlogged(conn)
        conn.execute(
            "INSERT INTO retrieval (item_id, message_id, user_id, conversation_id, at, length,"
            " tokens, version, terms, counts) SELECT n.item_id, m.id, m.user_id,"
            " m.conversation_id, CAST(m.at AS INTEGER), n.length, n.tokens, n.version, n.terms,"
            " n.counts FROM retrieval_next n JOIN item i ON i.id = n.item_id"
            " JOIN message m ON m.id = i.message_id ORDER BY n.item_id")
        conn.execute("DELETE FROM retrieval_term")
        conn.execute("UPDATE retrieval_total SET rows = 0, length = 0, tokens = 0, folded_seq = ?",
                     (before,))
        fold(conn)
        conn.execute("DELETE FROM chain")
        conn.executemany(chains._INSERT_CHAIN, (
            (user, s, at, i) for i, user, at, subjects in conn.execute(
                "SELECT n.item_id, m.user_id, m.at, n.subjects FROM retrieval_next n"
                " JOIN item i ON i.id = n.item_id JOIN message m ON m.id = i.message_id"
                " WHERE n.subjects != ''").fetchall() for s in subjects.split()))
        conn.execute("UPDATE derived SET seq = (SELECT coalesce(max(seq), 0) FROM retrieval)")
        conn.execute("DELETE FROM retrieval_next")
        conn.execute("UPDATE setting SET value = ? WHERE key = 'dictionary'", (version,))
        conn.execute("INSERT INTO setting VALUES ('flips', '1') ON CONFLICT(key) DO UPDATE"
                     " SET value = CAST(CAST(setting.value AS INTEGER) + 1 AS TEXT)")
        (rows,) = conn.execute("SELECT count(*) FROM retrieval").fetchone()
    dictionary.use(d)
    return rows


def _delete_unlogged(conn: Sql) -> int:
    """Delete every retrieval row without the trigger logging each; returns the last seq ever
    handed out (the new rows' seqs start past it)."""
    # PostgreSQL: a trigger disabled inside the transaction is disabled for it alone (readers
    # wait for the flip to commit: ALTER TABLE locks the table).
    if postgres():
        conn.execute("ALTER TABLE retrieval DISABLE TRIGGER retrieval_deleted")
        conn.execute("DELETE FROM retrieval")
        conn.execute("ALTER TABLE retrieval ENABLE TRIGGER retrieval_deleted")
        return int(conn.execute("SELECT CASE WHEN is_called THEN last_value ELSE 0 END"
                                " FROM retrieval_seq_seq").fetchone()[0])
    (trigger,) = conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'retrieval_deleted'").fetchone()
    conn.execute("DROP TRIGGER retrieval_deleted")
    conn.execute("DELETE FROM retrieval")
    conn.execute(trigger)
    return int(conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'retrieval'"
                            ).fetchone()[0])


def _rederive_batch(d: dictionary.Dictionary, limit: int) -> int:
    """Re-derive the next `limit` items past the cursor under `d`; returns how many."""
    with writing("re-derive rows") as conn:
        (after,) = conn.execute("SELECT coalesce(max(item_id), 0) FROM retrieval_next").fetchone()
        items = conn.execute("SELECT id, kind, name, text FROM item WHERE id > ? AND kind != ?"
                             " ORDER BY id LIMIT ?", (after, _CONTEXT, limit)).fetchall()
        rows = []
        with dictionary.using(d):
            for i, kind, name, text in items:
                t = item_text(kind, name, text)
                bag = d.bag(t)
                chained = kind == Kind.TEXT.value and text.strip()
                rows.append((i, d.version, bag.length, token_estimate(t),
                             bag.terms.astype("<i4", copy=False).tobytes(), bag.counts.tobytes(),
                             " ".join(chains.subjects(text)) if chained else ""))
        conn.executemany("INSERT OR REPLACE INTO retrieval_next (item_id, version, length, tokens,"
                         " terms, counts, subjects) VALUES (?,?,?,?,?,?,?)", rows)
    return len(rows)


def _dictionary(version: str) -> dictionary.Dictionary:
    if version == dictionary.shipped().version:
        return dictionary.shipped()
    with snapshot("read a dictionary") as conn:
        row = conn.execute("SELECT body FROM dictionary WHERE version = ?", (version,)).fetchone()
    if row is None:
        raise ConfigError(f"no dictionary version {version!r} uploaded")
    return dictionary.Dictionary.from_bytes(row[0])


def _live_version(conn: Sql) -> str:
    return conn.execute("SELECT value FROM setting WHERE key = 'dictionary'").fetchone()[0]

