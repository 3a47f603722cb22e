"""Which rows are there is kept between calls while nothing is deleted (m017 counts every
message and item deleted; memory.storage.kept.There): asked once, never stale after a purge,
by this store or by another on the same file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from perpetuity_core.memory.derived import heat, index, scan
from perpetuity_core.memory.jobs import maintenance
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.kept import There, deletions
from perpetuity_core.memory.storage.reads import shown_rows
from perpetuity_core.memory.storage.store import Store
from tests.test_frame import say
from tests.test_kept import items_of
from tests.test_retrieval import add


def test_every_deleted_message_and_item_is_counted(store: Store) -> None:
    msgs = say(store, "c", "the harbour master is called Ines", "noted, Ines",
               "the ferry leaves at noon")
    items = items_of(store, msgs)
    conn = store.db.connection()
    assert deletions(conn) == 0
    say(store, "c", "the harbour master is called Ines", "noted, Ines", "and the bus at one")
    assert deletions(conn) == 0  # storing deletes nothing
    index.purge(store, items[:1])
    assert deletions(conn) == 1
    maintenance.purge_user(store, "u")  # three items left, four messages
    assert deletions(conn) == 1 + 3 + 4


def asked(conn: sqlite3.Connection) -> list[str]:
    """The statements asking which rows are there, as the connection runs them (values
    bound)."""
    statements: list[str] = []
    conn.set_trace_callback(lambda sql: statements.append(sql)
                            if sql.startswith("SELECT id FROM item WHERE id") else None)
    return statements


def test_rows_found_there_are_asked_again_only_after_a_deletion(sqlite_store: Store) -> None:
    store = sqlite_store
    items = items_of(store, say(store, "c", "the harbour master is called Ines", "noted, Ines",
                                "the ferry leaves at noon"))
    statements = asked(store.db.connection())  # type: ignore[arg-type]
    texts = [r.text for r in shown_rows(store.db, items).values()]
    assert len(statements) == 1
    assert [r.text for r in shown_rows(store.db, items).values()] == texts
    assert len(statements) == 1  # nothing deleted: what was found there still is
    newer = items_of(store, say(store, "d", "the lighthouse opens at nine"))
    assert [r.text for r in shown_rows(store.db, items + newer).values()] == [
        *texts, "the lighthouse opens at nine"]
    assert len(statements) == 2 and f"IN ({newer[0]})" in statements[-1]  # the new id alone
    index.purge(store, items[1:2])
    assert list(shown_rows(store.db, items + newer)) == [items[0], items[2], *newer]
    assert len(statements) == 3


def test_a_purge_by_another_store_on_the_file_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    serving, other = open_memory(path), open_memory(path)
    try:
        items = items_of(serving, say(serving, "c", "the harbour master is called Ines",
                                      "noted, Ines"))
        assert list(shown_rows(serving.db, items)) == items
        index.purge(other, items[:1])
        assert list(shown_rows(serving.db, items)) == items[1:]
    finally:
        serving.close()
        other.close()


def test_there_answers_as_asking_for_every_id_would() -> None:
    rows = {2, 3, 5, 8}  # there, of the kinds asked for
    questions: list[list[int]] = []

    def ask(ids: list[int]) -> list[int]:
        questions.append(ids)
        return [i for i in ids if i in rows]

    there = There()
    assert there.among(0, [8, 1, 3, 2], ask) == [2, 3, 8]
    assert there.among(0, [5, 3, 1, 2], ask) == [2, 3, 5]
    assert questions == [[8, 1, 3, 2], [5]]  # 1 is never there: not asked again
    rows.discard(3)
    assert there.among(1, [3, 2], ask) == [2]  # a deletion counted: asked again
    assert there.among(None, [2], ask) == [2] and questions[-1] == [2]  # nothing known
    assert there.among(None, [2], ask) == [2] and len(questions) == 5


def test_births_kept_are_the_births_read_and_go_with_a_deletion(store: Store) -> None:
    items = items_of(store, say(store, "c", "the harbour master is called Ines", "noted, Ines",
                                "the ferry leaves at noon"))
    conn = store.db.connection()
    every = heat.births(store.db, conn, items)
    assert heat.trajectories(store.db, conn, items[::-1]) == {
        i: (b.at, b.peak, b.half_life) for i, b in every.items()}
    assert heat.trajectories(store.db, conn, items) == heat.trajectories(store.db, conn, items)
    index.purge(store, items[:1])
    assert list(heat.trajectories(store.db, conn, items)) == items[1:]


def test_hits_found_there_are_asked_again_only_after_a_retrieval_row_went(
        sqlite_store: Store) -> None:
    store = sqlite_store
    alice = add(store, "alice", "a1", ["garden violin", "violin lessons"])
    add(store, "bob", "b1", ["garden tomatoes"])
    scanner = scan.Scanner(store, store_rows=0)
    statements: list[str] = []
    store.db.connection().set_trace_callback(  # type: ignore[attr-defined]
        lambda sql: statements.append(sql) if sql.startswith("SELECT seq FROM retrieval") else None)
    first = scanner.search("garden violin", None, 10)
    assert scanner.search("garden violin", None, 10) == first and len(statements) == 1
    index.purge(store, alice[:1])
    # The others are found (their order may move: the pooled counts, and the best score the
    # semantic half is scaled by, went with the row).
    assert {h.item_id for h in scanner.search("garden violin", None, 10)} == {
        h.item_id for h in first if h.item_id != alice[0]}
    assert len(statements) == 2
