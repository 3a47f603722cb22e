"""The store's SQL is SQLite's; on PostgreSQL each statement is translated once (and cached) by
`translate`, so every module keeps one code path. What differs:

- placeholders `?` become `%s` (a literal `%` doubles);
- `INSERT OR IGNORE` becomes `ON CONFLICT DO NOTHING`; `INSERT OR REPLACE` (tables keyed by one
  column, `_KEYS`) becomes an upsert of every column named;
- `instr` is `strpos`, `group_concat(x)` is `string_agg(x::text, ',')`, the `user` table is quoted,
  a time cast to INTEGER is truncated first (PostgreSQL's cast rounds);
- DDL: BLOB is BYTEA, REAL is DOUBLE PRECISION (PostgreSQL's REAL is 4 bytes: epoch seconds
  would lose their minutes), INTEGER is BIGINT, AUTOINCREMENT keys are BIGSERIAL, WITHOUT ROWID
  goes; triggers are written per dialect where they are created (`trigger`);
- an INSERT into a table whose key the write path reads back (`lastrowid`) gets `RETURNING`.

Sums come back as `numeric`; they are loaded as int (or float), as SQLite returns them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Protocol

import peewee as pw

_KEYS = {"setting": "key", "activation": "item_id", "retrieval_next": "item_id"}
_RETURNING = {"message": "id", "item": "id", "retrieval": "seq", "user": "id",
              "conversation": "id"}


class Sql(Protocol):
    """What the store's modules use of a connection: sqlite3.Connection, or PgConnection."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...
    def executemany(self, sql: str, parameters: Any, /) -> Any: ...


def _ddl(sql: str) -> str:
    sql = sql.replace(" WITHOUT ROWID", "")
    sql = re.sub(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b", "BIGSERIAL PRIMARY KEY", sql)
    sql = re.sub(r"\bBLOB\b", "BYTEA", sql)
    sql = re.sub(r"\bREAL\b", "DOUBLE PRECISION", sql)
    return re.sub(r"\bINTEGER\b", "BIGINT", sql)


@lru_cache(maxsize=1024)
def translate(sql: str) -> str:
    """SQLite's statement as PostgreSQL runs it."""
    if sql.lstrip().upper().startswith(("CREATE", "ALTER")):
        sql = _ddl(sql)
    sql = re.sub(r"\b(FROM|INTO|JOIN|UPDATE|TABLE|ON) user\b", r'\1 "user"', sql, flags=re.I)
    sql = re.sub(r"\binstr\(", "strpos(", sql)
    # SQLite's CAST of a REAL to INTEGER truncates (as Python's int() does where rows are
    # derived); PostgreSQL's rounds: a message said at x.5 s or later would disagree.
    sql = re.sub(r"CAST\((\w+\.at) AS INTEGER\)", r"CAST(trunc(\1) AS BIGINT)", sql)
    sql = re.sub(r"\bgroup_concat\(([^(),]+)\)", r"string_agg(CAST(\1 AS TEXT), ',')", sql)
    if m := re.match(r"\s*INSERT OR IGNORE INTO ", sql):
        sql = "INSERT INTO " + sql[m.end():] + " ON CONFLICT DO NOTHING"
    elif m := re.match(r"\s*INSERT OR REPLACE INTO (\w+) \(([^)]*)\)", sql):
        key = _KEYS[m.group(1)]
        columns = [c.strip() for c in m.group(2).split(",") if c.strip() != key]
        sets = ", ".join(f"{c} = excluded.{c}" for c in columns)
        sql = (f"INSERT INTO {sql[m.start(1):]} ON CONFLICT ({key}) DO "
               + (f"UPDATE SET {sets}" if sets else "NOTHING"))
    elif ((m := re.match(r'\s*INSERT INTO "?(\w+)"? ', sql)) and m.group(1) in _RETURNING
          and (values := re.search(r"\bVALUES\b", sql)) and "SELECT" not in sql[:values.start()]
          and "RETURNING" not in sql):  # one row inserted from values, not a copy of a query
        sql += f" RETURNING {_RETURNING[m.group(1)]}"
    # `?` outside string literals only (the even pieces between quotes); `%` everywhere.
    pieces = sql.replace("%", "%%").split("'")
    return "'".join(p.replace("?", "%s") if i % 2 == 0 else p for i, p in enumerate(pieces))


class _Cursor:
    """A psycopg cursor with sqlite3's `lastrowid` (from the RETURNING translate adds)."""

    def __init__(self, cursor: Any, returning: bool) -> None:
        self._cursor = cursor
        self.lastrowid: int | None = None
        if returning:
            row = cursor.fetchone()
            self.lastrowid = row[0] if row else None

    @property
    def rowcount(self) -> int:
        return int(self._cursor.rowcount)

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    def __iter__(self) -> Any:
        return iter(self._cursor)


class PgConnection:
    """A psycopg connection that runs the store's SQLite statements (see `translate`)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, parameters: Any = ()) -> _Cursor:
        text = translate(sql)
        cursor = self.raw.cursor()
        cursor.execute(text, tuple(parameters) if parameters else None)
        return _Cursor(cursor, text.endswith(("RETURNING id", "RETURNING seq"))
                       and cursor.description is not None)

    def executemany(self, sql: str, parameters: Any) -> _Cursor:
        rows = [tuple(p) for p in parameters]
        text = translate(sql)
        cursor = self.raw.cursor()
        # A message's few rows in one statement: psycopg's executemany costs a pipeline's
        # round trips, and the write path runs it several times a message. Only where one
        # statement means the same as a row at a time: one row, or an insert whose rows
        # cannot collide in an update.
        values = re.search(r"\bVALUES (\([^()]*\))", text)
        if len(rows) == 1:
            cursor.execute(text, rows[0])
        elif (values and text.startswith("INSERT") and "DO UPDATE" not in text
              and 1 < len(rows) <= 100):
            many = ", ".join([values.group(1)] * len(rows))
            cursor.execute(text[:values.start(1)] + many + text[values.end(1):],
                           [v for row in rows for v in row])
        else:
            cursor.executemany(text, rows)
        return _Cursor(cursor, False)


def register_numeric(conn: Any) -> None:
    """Load `numeric` (what PostgreSQL's sum of bigints is) as int, or float when fractional."""
    from psycopg.adapt import Loader

    class NumericLoader(Loader):
        def load(self, data: Any) -> int | float:
            text = bytes(data).decode()
            return float(text) if "." in text or "e" in text.lower() else int(text)

    conn.adapters.register_loader("numeric", NumericLoader)


class Postgres(pw.PostgresqlDatabase):
    # peewee's FloatField is REAL, 4 bytes on PostgreSQL: epoch seconds would lose minutes.
    field_types = {**pw.PostgresqlDatabase.field_types, "FLOAT": "DOUBLE PRECISION"}

    def _initialize_connection(self, conn: object) -> None:
        register_numeric(conn)


def driver_errors() -> tuple[type[BaseException], ...]:
    """psycopg's errors (imported here: a SQLite memory never loads the driver otherwise)."""
    import psycopg

    return (psycopg.Error,)


def trigger(postgres: bool, name: str, table: str, when: str, body: str) -> list[str]:
    """The statements creating an AFTER DELETE trigger running `body` (one statement reading
    `old`) for each deleted row where `when` holds."""
    if not postgres:
        return [f"CREATE TRIGGER {name} AFTER DELETE ON {table} WHEN {when} BEGIN {body}; END"]
    return [f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF {when} THEN {body}; END IF; RETURN NULL; END $$",
            f"CREATE TRIGGER {name} AFTER DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION {name}()"]
