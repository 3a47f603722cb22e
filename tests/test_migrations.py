"""The migrations that cut the pages of each message's commit (m014, m015, m016) upgrade a
memory made without them in place: every row kept, the integrity check clean, the same ranks and
heat, and seqs that are never handed out twice."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from perpetuity_core.memory import schema
from perpetuity_core.memory.derived import heat, index
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.jobs import integrity
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part
from tests.test_retrieval import add, fill

NEW = (schema.m014_message_lookup, index.m015_retrieval_numbered)
TABLES = ("message", "item", "retrieval_gone", "retrieval_term", "retrieval_total", "chain")
# retrieval's columns before m016 (which adds each row's birth).
RETRIEVAL = ("seq, item_id, message_id, user_id, conversation_id, length, tokens, version, terms,"
             " counts, at")
QUERIES = ["support group", "painting sunrise", "python server latency", "dog cat guitar",
           "memory arena segment", "beach hiking"]


def snapshot(store: Store) -> dict[str, list[tuple]]:
    conn = store.db.translated()
    return {**{t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall()) for t in TABLES},
            "retrieval": sorted(conn.execute(f"SELECT {RETRIEVAL} FROM retrieval").fetchall()),
            "heat": trajectories(store)}


def trajectories(store: Store) -> list[tuple]:
    """Every row's (item id, at, peak, half-life): before m016 its activation row, after it
    its activation or the birth its retrieval row holds."""
    conn = store.db.translated()
    if not _born(store):
        return sorted(conn.execute("SELECT item_id, at, peak, half_life FROM activation"))
    ids = [i for (i,) in conn.execute("SELECT id FROM item ORDER BY id")]
    found = heat.trajectories(store.db, store.db.connection(), ids)
    return [(i, *found[i]) for i in ids]


def _born(store: Store) -> bool:
    sql = ("SELECT count(*) FROM information_schema.columns WHERE table_name = 'retrieval'"
           " AND column_name = 'born'" if store.db.postgres
           else "SELECT count(*) FROM pragma_table_info('retrieval') WHERE name = 'born'")
    return bool(store.db.connection().execute(sql).fetchone()[0])


def before_m016(store: Store) -> None:
    """Turn a memory into the shape m015 left it in: every row's birth an activation row of
    its own (harness context's born cold), no births in the retrieval rows."""
    conn = store.db.translated()
    with store.db.writing("undo m016"):
        for table in ("retrieval", "retrieval_pending"):
            conn.execute(
                "INSERT INTO activation (item_id, user_id, conversation_id, at, peak, half_life)"
                f" SELECT item_id, user_id, conversation_id, born, ?, half_life FROM {table} r"
                " WHERE NOT EXISTS (SELECT 1 FROM activation a WHERE a.item_id = r.item_id)",
                (heat.BIRTH_PEAK,))
        conn.execute(
            "INSERT INTO activation (item_id, user_id, conversation_id, at, peak, half_life)"
            " SELECT i.id, m.user_id, m.conversation_id, 0.0, 0.0, ? FROM item i JOIN message m"
            " ON m.id = i.message_id WHERE i.kind = ? AND NOT EXISTS (SELECT 1 FROM activation a"
            " WHERE a.item_id = i.id)", (heat.HALF_LIFE[Kind.CONTEXT], Kind.CONTEXT.value))
        conn.execute("DROP INDEX retrieval_warm")
        conn.execute("DROP INDEX retrieval_standing")
        for table in ("retrieval", "retrieval_pending", "retrieval_next"):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN born")
            conn.execute(f"ALTER TABLE {table} DROP COLUMN half_life")
        conn.execute("DELETE FROM migration WHERE name = 'm016_born_with_retrieval'")


def before_m019(store: Store) -> None:
    """Turn a memory into the shape m017 left it in: no vector in the retrieval rows."""
    conn = store.db.translated()
    with store.db.writing("undo m019"):
        for table in ("retrieval", "retrieval_pending", "retrieval_next"):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN vec")
        conn.execute("DELETE FROM migration WHERE name = 'm019_vectors'")


def ranks(store: Store) -> list[list[tuple[int, float]]]:
    scanner = Scanner(store, store_rows=0)  # the arena: what a large memory searches
    scanner.catch_up()
    return [[(h.item_id, round(h.score, 9)) for h in scanner.search(q, None, limit=20)]
            for q in QUERIES]


def indexes(store: Store) -> set[str]:
    sql = ("SELECT indexname FROM pg_indexes WHERE tablename = 'message'" if store.db.postgres
           else "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'message'")
    return {n for (n,) in store.db.connection().execute(sql)}


def test_a_memory_made_before_m014_and_m015_upgrades_in_place(
        memory_at: Path | str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema, "MIGRATIONS", [m for m in schema.MIGRATIONS if m not in NEW])
    old = open_memory(memory_at)
    fill(old, random.Random(41), 120)
    old.flush()
    # The newest row purged: its seq was handed out, and must not be handed out again.
    (newest,) = old.db.connection().execute("SELECT max(seq) FROM retrieval").fetchone()
    (item,) = old.db.connection().execute(
        old.db.legacy("SELECT item_id FROM retrieval WHERE seq = ?"), (newest,)).fetchone()
    index.purge(old, [item])
    ranked = ranks(old)
    before_m016(old)
    before_m019(old)  # m015 rebuilds the retrieval table as it stood before the vectors
    before = snapshot(old)
    assert "storedmessage_conversation_id_pair_key" in indexes(old)
    old.close()
    monkeypatch.undo()

    store = open_memory(memory_at)
    try:
        assert snapshot(store) == before
        assert integrity.check(store) == []
        assert ranks(store) == ranked
        assert {"storedmessage_conversation_id_pair_key",
                "storedmessage_conversation_id_fingerprint"}.isdisjoint(indexes(store))
        assert "message_lookup" in indexes(store)
        if not store.db.postgres:  # numbered past its mark, without AUTOINCREMENT's counter
            assert store.db.connection().execute(
                "SELECT count(*) FROM sqlite_sequence WHERE name = 'retrieval'").fetchone() == (0,)
        fill(store, random.Random(43), 5)
        store.flush()
        (low,) = store.db.connection().execute(
            store.db.legacy("SELECT min(seq) FROM retrieval WHERE item_id > ?"),
            (item,)).fetchone()
        assert low > newest
        assert integrity.check(store) == []
    finally:
        store.close()


def test_a_purged_newest_row_never_lends_its_seq(store: Store) -> None:
    """The mark the deletion trigger keeps (m015): the next row is numbered past a purged one."""
    fill(store, random.Random(47), 10)
    store.flush()
    seq_item = "SELECT seq, item_id FROM retrieval ORDER BY seq DESC LIMIT 1"
    for _ in range(2):
        store.flush()  # PostgreSQL: the pending rows get their seqs
        index.sequence(store.db)
        seq, item = store.db.connection().execute(seq_item).fetchone()
        index.purge(store, [item])
        fill(store, random.Random(seq), 1)
        index.sequence(store.db)
        (after,) = store.db.connection().execute("SELECT max(seq) FROM retrieval").fetchone()
        assert after > seq
    assert integrity.check(store) == []


def test_history_sent_again_is_recognised_by_its_fingerprint(store: Store) -> None:
    """Store.known finds a pair key through its message's fingerprint (m014): re-sent history
    stores nothing, a repeated answer after another question is a new message, and a reply
    whose predecessor a compaction rewrote is still known."""
    def text(role: str, words: str) -> Message:
        return Message(role, (Part(Kind.TEXT, words),))

    said = [text("user", "the build is green"), text("assistant", "shall I deploy it?"),
            text("user", "yes"), text("assistant", "shall I tag the release too?"),
            text("user", "yes")]

    def record(messages: list[Message]) -> list[int]:
        ids, _ = capture.record(store, user_key="u", conversation_key="c", provider="anthropic",
                                model="m", messages=messages, times=[1.0] * len(messages),
                                source="request")
        return ids

    assert len(record(said[:3])) == 3
    assert record(said[:3]) == []
    assert len(record(said)) == 2  # the second "yes" answers another question
    compacted = [text("user", "summary of what came before"), said[3], text("user", "go on")]
    assert len(record(compacted)) == 1  # the reply is known by its fingerprint: only the new turn


def reference_warm(rows: dict[int, tuple], user_id: int, now: float,
                   reheats: dict[int, float]) -> tuple[list[int], list[float], set[int]]:
    """The warm set from activations as m015 wrote them, one per row (item -> user, at, peak,
    half-life), by the formula alone: no window, no index."""
    ids, at, peak, half, boost = [], [], [], [], []
    foreign = set()
    for i, (user, a, p, h) in sorted(rows.items()):
        if user == user_id or i in reheats:
            if user != user_id:
                foreign.add(i)
                a, p, h = now, 0.0, 1.0
            ids.append(i)
            at.append(a)
            peak.append(p)
            half.append(h)
            boost.append(reheats.get(i, 0.0))
    w = np.maximum(heat.warmth(np.asarray(at), np.asarray(peak), np.asarray(half), now),
                   np.asarray(boost))
    keep = [(i, x) for i, x in zip(ids, w.tolist(), strict=True) if x >= heat.WARM_FLOOR]
    keep.sort(key=lambda r: (-r[1], r[0]))
    return [i for i, _ in keep], [x for _, x in keep], foreign


def written(store: Store) -> dict[int, tuple]:
    """m015's activations: item -> (user, at, peak, half-life)."""
    return {r[0]: tuple(r[1:]) for r in store.db.translated().execute(
        "SELECT item_id, user_id, at, peak, half_life FROM activation")}


def test_a_memory_made_before_m016_upgrades_in_place_with_the_same_heat(
        memory_at: Path | str) -> None:
    """Births written as activation rows (m015) become the births the retrieval rows hold:
    the warm set, a reheat's judgement and the ranks are what the written activations give,
    the activations a birth implies go, and a purge takes a row's birth with it."""
    old = open_memory(memory_at)
    fill(old, random.Random(53), 60)
    users = {u: old.user_id(u) for u in ("u0", "u1", "u2")}
    heat.advance(old.db, users["u0"], 3_000)
    later = add(old, "u0", "u0-c0", ["Always answer in French.", "the harbour ferry timetable"],
                at=100.0)
    cid = old.conversation_id(users["u0"], "u0-c0", "anthropic")
    harness = old.add_message(conversation_id=cid, user_id=users["u0"], message=Message(
        "user", (Part(Kind.CONTEXT, "<ide_opened_file>x.py</ide_opened_file>"),)),
        provider="anthropic", model="m", at=102.0, pair_key="ctx", source="import").item_ids
    heat.advance(old.db, users["u0"], 2_000)
    # Reheats on both sides of BIRTH_PEAK, one exactly at it (a neighbour of the top hit).
    heat.reheat(old.db, 5_000.0, {1: 2.0, 2: heat.BIRTH_PEAK, later[1]: 0.5})
    old.flush()
    before_m016(old)
    rows = written(old)
    assert len(rows) == len(trajectories(old)) > 60  # one activation per row, context too
    ranked = ranks(old)
    old.close()

    store = open_memory(memory_at)
    try:
        assert integrity.check(store) == []
        assert ranks(store) == ranked
        # Only what a birth does not imply is still written: the reheats that beat it.
        kept = {i for i, (_, at, peak, _) in written(store).items()}
        assert kept == {i for i, (_, at, peak, _) in rows.items()
                        if peak not in (heat.BIRTH_PEAK, 0.0)}
        reheats = {1: 1.2, later[0]: 1.5, harness[0]: 0.9, 7: 0.3}
        for now in (5_000.0, 8_000.0, 30_000.0, 40_000_000.0):
            for uid in users.values():
                for turn in ({}, reheats):
                    warm = heat.warm_set(store.db, uid, now, turn)
                    ids, w, foreign = reference_warm(rows, uid, now, turn)
                    assert warm.item_ids.tolist() == ids and warm.warmth.tolist() == w
                    assert warm.foreign == foreign
        # A reheat is judged against the same trajectory, and first reheats are written.
        now = 9_000.0
        heat.reheat(store.db, now, reheats)
        for i, p in reheats.items():
            user, at, peak, half = rows[i]
            if p > peak * 2.0 ** (-(now - at) / half):
                rows[i] = (user, now, p, half)
        after = {i: t for i, *t in trajectories(store)}
        assert all(after[i] == list(rows[i][1:]) for i in reheats)
        assert integrity.check(store) == []
        # A purge takes the row's birth with it, and a user's purge every birth of theirs.
        index.purge(store, [later[1]])
        assert later[1] not in {i for i, *_ in trajectories(store)}
        assert later[1] not in heat.warm_set(store.db, users["u0"], now, {}).item_ids.tolist()
        from perpetuity_core.memory.jobs import maintenance
        maintenance.purge_user(store, "u1")
        assert heat.warm_set(store.db, users["u1"], now, {}).item_ids.size == 0
        assert integrity.check(store) == []
    finally:
        store.close()
