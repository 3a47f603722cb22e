"""The migrations that cut the pages of each message's commit (m014, m015) upgrade a memory
made without them in place: every row kept, the integrity check clean, the same ranks, and seqs
that are never handed out twice."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from perpetuity_core.memory import schema
from perpetuity_core.memory.derived import index
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.jobs import integrity
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part
from tests.test_retrieval import fill

NEW = (schema.m014_message_lookup, index.m015_retrieval_numbered)
TABLES = ("message", "item", "retrieval", "retrieval_gone", "retrieval_term", "retrieval_total",
          "activation", "chain")
QUERIES = ["support group", "painting sunrise", "python server latency", "dog cat guitar",
           "memory arena segment", "beach hiking"]


def snapshot(store: Store) -> dict[str, list[tuple]]:
    conn = store.db.translated()
    return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall()) for t in TABLES}


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
    before, ranked = snapshot(old), ranks(old)
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
