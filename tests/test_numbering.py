"""The ids a message's write hands out, counted by their one writer (database.Numbering): the
same ids the tables alone would give, whatever happened between two messages: a write rolled
back, one nested in a write rolled back, another writer on the file, a row written around the
write path, a purge of the newest rows, a reopening. Real SQLite files, no mocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from perpetuity_core.errors import StoreError
from perpetuity_core.memory.derived import index
from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.store import Database, Store, StoredItem
from tests.test_retrieval import add

NEXT = ("SELECT max((SELECT coalesce(max(id), 0) FROM message), (SELECT id FROM high_water"
        " WHERE name = 'message')) + 1, max((SELECT coalesce(max(id), 0) FROM item),"
        " (SELECT id FROM high_water WHERE name = 'item')) + 1, max((SELECT coalesce(max(seq),"
        " 0) FROM retrieval), (SELECT id FROM high_water WHERE name = 'retrieval')) + 1")


def numbered_next(store: Store) -> tuple[int, int, int]:
    """The next message id, item id and seq as the tables alone number them (m010, m015)."""
    return store.db.connection().execute(NEXT).fetchone()


def stored(store: Store, texts: list[str]) -> tuple[int, int, int]:
    """Store one message per text; the first one's message id, item id and seq."""
    before = numbered_next(store)
    items = add(store, "u", "c", texts)
    message, seq = store.db.connection().execute(
        "SELECT message_id, seq FROM retrieval WHERE item_id = ?", (items[0],)).fetchone()
    assert (message, items[0], seq) == before
    return message, items[0], seq


def refusing(word: str) -> list:
    """A deriver that fails the message holding `word`, after the store wrote its rows."""

    def derive(db: Database, items: list[StoredItem]) -> None:
        if any(word in it.text for it in items):
            raise RuntimeError(f"refused {word}")

    return [derive]


def test_a_rolled_back_message_lends_its_ids_to_the_next(tmp_path: Path) -> None:
    """The tables never held the failed message's ids: the next message takes them, as the
    tables alone would number it, and nothing collides."""
    store = open_memory(tmp_path / "memory.db", refusing("boom"))
    try:
        stored(store, ["one garden", "two violin | parts"])
        expected = numbered_next(store)
        with pytest.raises(RuntimeError, match="refused boom"):
            add(store, "u", "c", ["boom concert"])
        assert numbered_next(store) == expected
        assert stored(store, ["three guitar", "four"]) == expected
        assert check(store) == []
    finally:
        store.close()


def test_a_message_inside_a_write_rolled_back_after_it_leaves_no_count_behind(
        tmp_path: Path) -> None:
    store = open_memory(tmp_path / "memory.db")
    try:
        stored(store, ["one garden"])
        expected = numbered_next(store)
        with pytest.raises(StoreError, match="outer"), store.db.writing("outer"):
            add(store, "u", "c", ["nested violin", "nested two"])
            store.db.connection().execute("SELECT * FROM no_such_table")
        assert stored(store, ["after guitar"]) == expected
        assert check(store) == []
    finally:
        store.close()


def test_two_writers_on_one_file_number_past_each_other(tmp_path: Path) -> None:
    """Another connection's messages (another process, another store) between two of this
    writer's: each is numbered past them."""
    a, b = open_memory(tmp_path / "memory.db"), open_memory(tmp_path / "memory.db")
    try:
        for i in range(6):
            stored(a if i % 2 else b, [f"turn {i} garden", f"reply {i} | parts {i}"])
        assert check(a) == []
    finally:
        a.close()
        b.close()


def test_rows_written_around_the_write_path_on_its_own_connection_are_numbered_past(
        tmp_path: Path) -> None:
    """A message inserted on the writer's own connection, outside any write (autocommit) or
    in a write of its own: the next message is numbered past it."""
    store = open_memory(tmp_path / "memory.db")
    try:
        stored(store, ["one garden"])
        conn = store.db.connection()
        copy = ("INSERT INTO message SELECT (SELECT max(id) + 1 FROM message), conversation_id,"
                " user_id, role, provider, model, at, stored_at, pair_key, fingerprint, source,"
                " complete, stop_reason, usage FROM message WHERE id = (SELECT max(id)"
                " FROM message)")
        conn.execute(copy)
        stored(store, ["two violin"])
        with store.db.writing("copy a message"):
            conn.execute(copy)
        stored(store, ["three guitar"])
    finally:
        store.close()


def test_the_newest_rows_purged_then_reopened_are_never_numbered_again(tmp_path: Path) -> None:
    """Read from the tables (on opening, after a purge), the count starts past every id and
    seq a deletion freed (high_water)."""
    store = open_memory(tmp_path / "memory.db")
    try:
        stored(store, ["one garden", "two violin"])
        newest = store.db.connection().execute(
            "SELECT message_id, item_id, seq FROM retrieval ORDER BY seq DESC LIMIT 1").fetchone()
        index.purge(store, [newest[1]])
        store.db.connection().execute("DELETE FROM message WHERE id = ?", (newest[0],))
        assert numbered_next(store) == tuple(n + 1 for n in newest)
    finally:
        store.close()
    store = open_memory(tmp_path / "memory.db")
    try:
        assert stored(store, ["three guitar"]) == tuple(n + 1 for n in newest)
        store.flush()
        assert check(store) == []
    finally:
        store.close()


def test_many_messages_through_every_kind_of_interruption_match_the_tables(
        tmp_path: Path) -> None:
    """A random run of messages, each between some interruption or none: every message is
    numbered exactly as the tables alone would number it (`stored` checks each)."""
    rng = random.Random(5)
    store = open_memory(tmp_path / "memory.db", refusing("boom"))
    other = open_memory(tmp_path / "memory.db")
    try:
        for i in range(60):
            match rng.randrange(5):
                case 0:
                    with pytest.raises(RuntimeError):
                        add(store, "u", "c", [f"boom {i}"])
                case 1:
                    add(other, "u", "c", [f"elsewhere {i} | two"])
                case 2:
                    store.flush()
                case 3:
                    newest = store.db.connection().execute(
                        "SELECT item_id FROM retrieval ORDER BY seq DESC LIMIT 1").fetchone()
                    index.purge(store, [newest[0]])
            stored(store, [f"turn {i} garden" + " | part" * rng.randrange(3)])
        store.flush()
        assert check(store) == []
    finally:
        other.close()
        store.close()
