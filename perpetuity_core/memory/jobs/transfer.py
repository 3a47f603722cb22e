"""`perpetuity memory migrate`: copy a SQLite memory into another store (a PostgreSQL database),
row for row, in one transaction.

Everything is copied as stored, ids and seqs included: the derived structures (retrieval rows,
pooled counts, chains, activations, clocks, cursors) stay true of the rows they were derived
from, and the identity salt comes along, so every user's key hashes to the same user. The
source is read through its own Store, open beside the target's (so it is at the current schema,
as the target is, on opening), in one read snapshot; the target must hold no memory yet. Serial columns are then set past the copied ids. `memory check` holds
on the target exactly when it held on the source.
"""

from __future__ import annotations

from collections.abc import Iterator

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.schema import ids_past_high_water
from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.memory.storage.store import Database, Store

# Parents before children (foreign keys are checked per statement on PostgreSQL); the tables
# a migration fills (settings, totals, cursors) are replaced by the source's.
ORDER = ("setting", "user", "conversation", "message", "item", "retrieval", "retrieval_pending",
         "retrieval_next", "binding", "chain", "activation", "clock", "retrieval_term", "retrieval_total",
         "retrieval_gone", "derived", "high_water", "dictionary", "saving")
BATCH = 5000


def source_tables(source: Store, conn: Sql) -> list[str]:
    """The source's tables, in copy order; refuses a schema this version does not know."""
    tables = {t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"
                                         " AND name NOT LIKE 'sqlite_%'")}
    unknown = tables - set(ORDER) - {"migration"}
    if unknown:
        raise ConfigError(f"{source.shown} holds tables this version does not copy:"
                          f" {sorted(unknown)}")
    return [t for t in ORDER if t in tables]


def _batches(conn: Sql, table: str) -> Iterator[tuple[list[str], list[tuple]]]:
    cur = conn.execute(f"SELECT * FROM {table}")  # noqa: S608 - names from ORDER
    columns = [d[0] for d in cur.description]
    while rows := cur.fetchmany(BATCH):
        yield columns, rows


def _booleans(db: Database, conn: Sql, table: str) -> set[str]:
    """Columns PostgreSQL keeps as boolean (SQLite stores them as 0 and 1)."""
    if not db.postgres:
        return set()
    return {c for (c,) in conn.execute("SELECT column_name FROM information_schema.columns"
                                       " WHERE table_name = %s AND data_type = 'boolean'",
                                       (table,))}


def copy_memory(source: Store, target: Store, progress: bool = False) -> dict[str, int]:
    """Copy every row of the SQLite memory `source` into `target`; rows copied per table."""
    if source.db.postgres:
        raise ConfigError(f"{source.shown}: the source of a copy is a SQLite memory")
    with source.db.snapshot("read the memory to copy") as read:
        return _copy(source, read, target, progress)


def _copy(source: Store, read: Sql, target: Store, progress: bool) -> dict[str, int]:
    from tqdm import tqdm

    db = target.db
    tables = source_tables(source, read)
    copied: dict[str, int] = {}
    bar = tqdm(total=len(tables), unit="table", disable=not progress)
    with db.writing("copy a memory in") as conn:
        (messages,) = conn.execute("SELECT count(*) FROM message").fetchone()
        if messages:
            raise ConfigError("the target already holds a memory; migrate into an empty one")
        for table in reversed(tables):
            conn.execute(f'DELETE FROM "{table}"')  # quoted: `user` is a keyword on PostgreSQL
        for table in tables:
            flags = _booleans(db, conn, table)
            n = 0
            for columns, rows in _batches(read, table):
                if flags:
                    at = [i for i, c in enumerate(columns) if c in flags]
                    rows = [tuple(bool(v) if i in at and v is not None else v
                                  for i, v in enumerate(r)) for r in rows]
                _insert(db, conn, table, columns, rows)
                n += len(rows)
            copied[table] = n
            bar.set_postfix_str(f"{table} {n}")
            bar.update(1)
        if db.postgres:
            _past_copied_ids(conn)
            conn.execute("ANALYZE")  # the planner's statistics, before the first query plans
    bar.close()
    return copied


def _insert(db: Database, conn: Sql, table: str, columns: list[str], rows: list[tuple]) -> None:
    names = ", ".join(columns)
    if not db.postgres:
        conn.executemany(f"INSERT INTO {table} ({names}) VALUES"
                         f" ({', '.join('?' * len(columns))})", rows)
        return
    # PostgreSQL's COPY: the 10M-token pooled memory (528k rows in all, 306k of them chains)
    # took 9.5 to 10.8 s as batches of inserts, 4.4 s so.
    raw = conn.raw  # type: ignore[attr-defined]  # PgConnection's psycopg one
    with raw.cursor().copy(f'COPY "{table}" ({names}) FROM STDIN') as copy:
        for row in rows:
            copy.write_row(row)


def _past_copied_ids(conn: Sql) -> None:
    """Set every serial column's sequence past the ids copied into it."""
    serials = conn.execute("SELECT table_name, column_name FROM information_schema.columns"
                           " WHERE table_schema = current_schema()"
                           " AND column_default LIKE 'nextval%'").fetchall()
    for table, column in serials:
        conn.execute(f"SELECT setval(pg_get_serial_sequence('\"{table}\"', '{column}'),"
                     f" (SELECT coalesce(max({column}), 0) + 1 FROM \"{table}\"), false)")
    ids_past_high_water(conn)  # and past the ids the source freed
