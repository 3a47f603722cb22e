"""The run's PostgreSQL server (tests/postgres.py) is real and each test gets its own database."""

from __future__ import annotations

import psycopg


def test_each_test_gets_a_fresh_database_on_a_real_server(postgres_url: str) -> None:
    with psycopg.connect(postgres_url) as conn:
        (version,) = conn.execute("SHOW server_version").fetchone()
        assert int(version.split(".")[0]) >= 13
        conn.execute("CREATE TABLE t (x int)")
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
        assert conn.info.dbname.startswith("t_test_each_test")
