"""What differs between the backends, written out side by side: no statement is rewritten at
run time on the request path.

- `SQL(sqlite=..., postgres=...)`: a statement per backend, each with its driver's placeholders
  (sqlite3's `?`, psycopg's `%s`); `SQL.both` for one spelled alike but for them. The handle
  picks (`Database.pick`); precomputed strings, so a per-request statement costs no building.
- `Rows`: an insert of a message's rows, one statement on PostgreSQL (round trips), executemany
  on SQLite; `marks` and `one_of`: IN-lists in each driver's style.
- `trigger`: an AFTER DELETE trigger, per backend.
- `translate_legacy`: SQLite's dialect translated for PostgreSQL (cached), kept for what is
  written once and runs by hand: the migrations' DDL and statements, the maintenance commands
  (purge, dictionary upload/rederive/flip), `memory check`, the CLI's stats, and the tests. It
  rewrites placeholders, `INSERT OR IGNORE/REPLACE` (tables keyed by one column, `_KEYS`),
  `instr`, `group_concat`, the `user` table's quoting, a time cast to INTEGER (truncated first:
  PostgreSQL's cast rounds), and DDL types: BLOB is BYTEA, REAL is DOUBLE PRECISION
  (PostgreSQL's REAL is 4 bytes: epoch seconds would lose their minutes), INTEGER is BIGINT,
  AUTOINCREMENT keys are BIGSERIAL, WITHOUT ROWID goes.

Sums come back as `numeric`; they are loaded as int (or float), as SQLite returns them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, NamedTuple, Protocol

import peewee as pw

_KEYS = {"setting": "key", "activation": "item_id", "retrieval_next": "item_id"}


class Sql(Protocol):
    """What the store's modules use of a connection: sqlite3.Connection, or PgConnection."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...
    def executemany(self, sql: str, parameters: Any, /) -> Any: ...


def marks(postgres: bool, n: int) -> str:
    """`n` placeholders, comma-separated, in the driver's style: an IN-list's."""
    return ",".join(("%s",) * n) if postgres else ",".join("?" * n)


class SQL(NamedTuple):
    """One statement written out per backend, side by side: the handle picks one
    (`Database.pick`). Each has its driver's placeholders: sqlite3's `?`, psycopg's `%s`."""

    sqlite: str
    postgres: str

    @classmethod
    def both(cls, sqlite: str) -> SQL:
        """A statement both backends spell alike but for their placeholders (made once, at
        import): `?` there never stands in a string literal."""
        return cls(sqlite, sqlite.replace("?", "%s"))


def _ddl(sql: str) -> str:
    sql = sql.replace(" WITHOUT ROWID", "")
    sql = re.sub(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b", "BIGSERIAL PRIMARY KEY", sql)
    sql = re.sub(r"\bBLOB\b", "BYTEA", sql)
    sql = re.sub(r"\bREAL\b", "DOUBLE PRECISION", sql)
    return re.sub(r"\bINTEGER\b", "BIGINT", sql)


@lru_cache(maxsize=1024)
def translate_legacy(sql: str) -> str:
    """SQLite's statement as PostgreSQL runs it: the migrations' and the cold statements still
    written once (the maintenance commands', the integrity check's, the CLI's stats: run by
    hand, never per request), through `Database.legacy` or `Database.translated`. The write
    path and the read paths are written per backend (`SQL`, `Rows`) or built by peewee."""
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
    # `?` outside string literals only (the even pieces between quotes); `%` everywhere.
    pieces = sql.replace("%", "%%").split("'")
    return "'".join(p.replace("?", "%s") if i % 2 == 0 else p for i, p in enumerate(pieces))


class Translated:
    """A connection running statements written once in SQLite's dialect, each translated
    (`translate_legacy`, cached): for the cold paths only (`Database.translated`)."""

    def __init__(self, conn: Sql) -> None:
        self.conn = conn

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        return self.conn.execute(translate_legacy(sql), parameters)

    def executemany(self, sql: str, parameters: Any) -> Any:
        return self.conn.executemany(translate_legacy(sql), parameters)


class PgConnection:
    """A psycopg connection with sqlite3's two methods: each statement runs as written (with
    psycopg's `%s`), its cursor returned."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, sql: str, parameters: Any = ()) -> Any:
        return self.raw.execute(sql, tuple(parameters) if parameters else None)

    def executemany(self, sql: str, parameters: Any) -> Any:
        rows = [tuple(p) for p in parameters]
        cursor = self.raw.cursor()
        # One row: one statement, not a pipeline (its sync is a round trip of its own).
        if len(rows) == 1:
            cursor.execute(sql, rows[0])
        else:
            cursor.executemany(sql, rows)
        return cursor


# The most rows one multi-row VALUES statement takes (more go by psycopg's executemany).
MANY_ROWS = 100


@cache
def _sqlite_many(sql: str) -> str:
    """A one-row SQLite `INSERT ... VALUES (?, ?)` made to take MANY_ROWS rows."""
    head, _, row = sql.partition(" VALUES ")
    return f"{head} VALUES {', '.join([row] * MANY_ROWS)}"


@dataclass(frozen=True, slots=True)
class Rows:
    """An INSERT of rows from values, per backend: SQLite's one-row statement (run by
    executemany: one writer, no round trips), and PostgreSQL's `head VALUES row, row... tail`.

    A message's few rows go in one PostgreSQL statement: psycopg's executemany costs a
    pipeline's round trips, and the write path inserts several times a message. Only where one
    statement means the same as a row at a time: an insert whose rows cannot collide in an
    update (no DO UPDATE tail), up to MANY_ROWS rows."""

    sqlite: str
    head: str  # "INSERT INTO t (a, b) VALUES "
    row: str  # "(%s, %s)"
    tail: str = ""  # " ON CONFLICT DO NOTHING"

    def run(self, conn: Sql, postgres: bool, rows: Sequence[Sequence[Any]]) -> None:
        if not postgres:
            # A batch's many rows (the chains', ~1,500 a batch) MANY_ROWS a statement: 9 against
            # 12 us a LoCoMo message's chain rows by executemany alone. The rest go one at a
            # time, so the statement cache holds one more statement, not one per remainder.
            full = len(rows) - len(rows) % MANY_ROWS
            for start in range(0, full, MANY_ROWS):
                conn.execute(_sqlite_many(self.sqlite),
                             [v for row in rows[start:start + MANY_ROWS] for v in row])
            conn.executemany(self.sqlite, rows[full:])
        elif len(rows) == 1:
            conn.execute(self.head + self.row + self.tail, rows[0])
        elif 1 < len(rows) <= MANY_ROWS:
            conn.execute(self.head + ", ".join([self.row] * len(rows)) + self.tail,
                         [v for row in rows for v in row])
        elif rows:
            conn.executemany(self.head + self.row + self.tail, rows)


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


def one_of(postgres: bool, column: str, values: Sequence[int]) -> tuple[str, list[Any]]:
    """`column` is one of the integers `values`, as SQL and its parameters: an IN-list on SQLite;
    on PostgreSQL `= ANY` of one array (with psycopg's placeholder), a statement whose text does not change with the list's
    length, so psycopg parses it once, not per call (the rows of a frame, ~280 ids: 1.7 ms
    against 2.3 as an IN-list, 10M tokens pooled)."""
    if postgres:
        return f"{column} = ANY(CAST(%s AS BIGINT[]))", [list(values)]
    return f"{column} IN ({','.join('?' * len(values))})", list(values)


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
