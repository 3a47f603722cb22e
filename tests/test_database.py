"""Each store owns its database (memory.database.Database, `store.db`): two stores open in one
process (a migration, a test) each read and write their own, and closing one leaves the other
serving. Nothing but the store reaches the handle's module."""

from __future__ import annotations

import random
import re
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from perpetuity_core.memory.derived import heat, index, scan
from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.store import Store
from tests.test_retrieval import add, fill, ranked, reference, same

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "perpetuity_core"


def _both_serve(a: Store, b: Store) -> None:
    """Each store holds what was written to it, and only that, searched and counted."""
    for store, said in ((a, "the violin lesson"), (b, "the garden party")):
        uid = store.find_user("u")
        assert uid is not None
        hits = scan.Scanner(store).search(said, uid, 5)
        assert hits and hits[0].text == said
        assert check(store) == []
    assert not scan.Scanner(a).search("garden party", a.find_user("u"), 5)
    assert not scan.Scanner(b).search("violin lesson", b.find_user("u"), 5)


def _two_stores(first: Path | str, second: Path | str) -> None:
    a, b = open_memory(first), open_memory(second)
    try:
        add(a, "u", "c", ["the violin lesson"])
        add(b, "u", "c", ["the garden party"])
        fill(a, random.Random(3), 20)
        heat.advance(a.db, a.user_id("u"), 100)
        _both_serve(a, b)
        assert heat.clock(a.db, a.user_id("u")) == 100 and heat.clock(b.db, b.user_id("u")) == 0
        a.close()
        # The other store keeps its connections and goes on writing and reading.
        add(b, "u", "c", ["a later note on the garden"])
        uid = b.user_id("u")
        index.sequence(b.db)  # PostgreSQL: the rows are ordered in before the reference reads
        want = reference(b, "garden", uid, 5)
        same(ranked(scan.Scanner(b, store_rows=0).search("garden", uid, 5)), want)
        assert len(want) == 2 and check(b) == []
    finally:
        a.close()
        b.close()


def test_two_sqlite_stores_in_one_process(tmp_path: Path) -> None:
    _two_stores(tmp_path / "a.db", tmp_path / "b.db")


def test_a_sqlite_and_a_postgresql_store_in_one_process(tmp_path: Path,
                                                        postgres_url: str) -> None:
    _two_stores(tmp_path / "a.db", postgres_url)


def test_closing_the_store_closes_every_threads_connection(tmp_path: Path) -> None:
    """Peewee opens a connection per reading thread (the scanner's, the tools'): closing the
    store closes them all; a store opened after it reads its own file on that thread."""
    first = open_memory(tmp_path / "first.db")

    def where(store: Store) -> str:
        return store.db.connection().execute("PRAGMA database_list").fetchone()[2]

    with ThreadPoolExecutor(1) as reader:
        conn = reader.submit(first.db.connection).result()
        assert reader.submit(where, first).result() == str(tmp_path / "first.db")
        second = open_memory(tmp_path / "second.db")
        try:
            assert reader.submit(where, second).result() == str(tmp_path / "second.db")
            first.close()
            with pytest.raises(sqlite3.ProgrammingError, match="closed"):
                conn.execute("SELECT 1")
            assert reader.submit(where, second).result() == str(tmp_path / "second.db")
        finally:
            second.close()


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_only_the_store_reaches_the_database_module() -> None:
    """The handle is reached through a store (or the handle it hands out), never imported:
    no module but the store imports memory.storage.database, and no module holds a process-wide
    connection (the names the module had before its handle)."""
    importers = {path for path, text in _sources().items()
                 if re.search(r"storage(\.database import|\.database\b| import database)", text)}
    assert importers == {"perpetuity_core/memory/storage/store.py"}
    for path, text in _sources().items():
        assert not re.search(r"^(db|connection|snapshot|writing|postgres)\s*=|"
                             r"^def (connection|snapshot|writing|postgres)\(", text, re.M), path
        assert "DatabaseProxy" not in text, path


def test_no_sql_above_memory() -> None:
    """The frame and the recall tools read through memory.storage.reads: no statement and no
    connection of the handle is written in frame/ or recall/."""
    above = {path: text for path, text in _sources().items()
             if path.startswith(("perpetuity_core/frame/", "perpetuity_core/recall/"))}
    assert above
    for path, text in above.items():
        assert not re.search(r"\b(SELECT|INSERT|UPDATE|DELETE)\b", text), path
        assert ".connection()" not in text and ".pick(" not in text, path


def test_translation_is_named_where_it_is_used() -> None:
    """SQL written once in SQLite's dialect runs on PostgreSQL only through the handle's
    `legacy` or `translated` (migrations, maintenance commands, the check): the per-request
    modules write theirs per backend."""
    per_request = ("memory/derived/scan", "memory/derived/arena", "memory/derived/heat",
                   "memory/derived/index", "memory/derived/bindings", "memory/derived/chains",
                   "memory/storage/users", "memory/storage/reads", "frame/read")
    for name in per_request:
        text = (PACKAGE / f"{name}.py").read_text()
        body = text.split("\ndef m0", 1)[0]  # a module's migrations come last
        assert ".translated(" not in body and "translate_legacy" not in body, name
        assert ".legacy(" not in body, name


def test_a_failed_write_rolls_back_and_fails_as_one_store_error(store: Store) -> None:
    """writing's transaction on both backends (on SQLite a class of its own): a database error
    inside it rolls the whole write back and leaves as StoreError naming the write; any other
    error rolls it back and passes unchanged; a failed nested write undoes only itself."""
    from perpetuity_core.errors import StoreError

    db = store.db
    key = "test:write"

    def value(k: str = key) -> str | None:
        row = db.connection().execute(db.legacy("SELECT value FROM setting WHERE key = ?"),
                                      (k,)).fetchone()
        return row[0] if row else None

    insert = db.legacy("INSERT INTO setting (key, value) VALUES (?, ?)")
    with pytest.raises(StoreError, match=r"^could not write twice: "):
        with db.writing("write twice") as conn:
            conn.execute(insert, (key, "a"))
            conn.execute(insert, (key, "b"))  # the primary key refuses it
    assert value() is None
    with pytest.raises(KeyError):
        with db.writing("write, then fail") as conn:
            conn.execute(insert, (key, "a"))
            raise KeyError(key)
    assert value() is None
    if not db.postgres:  # peewee's atomic() nests on PostgreSQL
        with db.writing("write around a failed one") as conn:
            conn.execute(insert, (key, "outer"))
            with pytest.raises(StoreError, match="could not write inside"):
                with db.writing("write inside") as inner:
                    inner.execute(insert, (f"{key}:inner", "x"))
                    inner.execute(insert, (key, "again"))
        assert (value(), value(f"{key}:inner")) == ("outer", None)
    with db.writing("write once") as conn:
        conn.execute(insert, (f"{key}:once", "c"))
    assert value(f"{key}:once") == "c"


@pytest.mark.parametrize("n", [0, 1, 99, 100, 101, 250])
def test_rows_go_in_as_one_row_at_a_time_would(store: Store, n: int) -> None:
    """dialect.Rows: MANY_ROWS rows a statement on SQLite (the rest one at a time), a few in
    one statement on PostgreSQL; rows that collide with a stored one or one another are
    ignored one by one, as one-row inserts were."""
    from perpetuity_core.memory.storage.dialect import Rows

    insert = Rows("INSERT OR IGNORE INTO setting (key, value) VALUES (?, ?)",
                  "INSERT INTO setting (key, value) VALUES ", "(%s, %s)", " ON CONFLICT DO NOTHING")
    rows = [(f"rows-{i % max(1, n - 3)}", str(i)) for i in range(n)]  # the last 3 collide
    with store.db.writing("insert rows") as conn:
        conn.execute(store.db.legacy("INSERT INTO setting (key, value) VALUES ('rows-0', 'kept')"))
        insert.run(conn, store.db.postgres, rows)
    got = dict(store.db.connection().execute(store.db.legacy(
        "SELECT key, value FROM setting WHERE key LIKE 'rows-%'")).fetchall())
    want = {"rows-0": "kept"}
    for key, value in rows:
        want.setdefault(key, value)
    assert got == want
