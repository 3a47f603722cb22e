"""A real PostgreSQL server for one test run (or one benchmark): `initdb` into a temporary
folder, `pg_ctl start` on a free loopback port, stopped and removed at the end.

PostgreSQL refuses to run as root: as root, the server runs as the `postgres` account (the
Debian package creates it). `unavailable()` says why no server can be started here, or "".
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return versions[0] if versions else None


def _account() -> pwd.struct_passwd | None:
    """Who runs the server: this user, or `postgres` when this is root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


def unavailable() -> str:
    if not _bin("initdb") or not _bin("pg_ctl"):
        return "PostgreSQL's initdb/pg_ctl not found (install the postgresql package)"
    if os.geteuid() == 0 and _account() is None:
        return "running as root and no `postgres` account to run PostgreSQL as"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], who: pwd.struct_passwd | None) -> None:
    if who is not None:
        cmd = ["setpriv", f"--reuid={who.pw_uid}", f"--regid={who.pw_gid}", "--init-groups",
               *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stdout}{done.stderr}")


@contextmanager
def server(*settings: str) -> Iterator[str]:
    """A running server; yields the URL of its `postgres` database (user postgres, trust on
    loopback). `settings` are extra `-c name=value` server settings."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    assert initdb and pg_ctl, unavailable()
    who = _account()
    # Not under pytest's tmp (mode 0700, root's): the `postgres` account must reach it.
    home = Path(tempfile.mkdtemp(prefix="perpetuity-pg-"))
    data, log = home / "data", home / "server.log"
    if who is not None:
        os.chown(home, who.pw_uid, who.pw_gid)
    port = _free_port()
    options = " ".join([f"-p {port}", "-h 127.0.0.1", "-k ''", *(f"-c {s}" for s in settings)])
    try:
        _run([initdb, "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
              "--no-sync", "--locale=C"], who)
        _run([pg_ctl, "-D", str(data), "-l", str(log), "-o", options, "-w", "start"], who)
        try:
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            _run([pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], who)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def fresh_database(url: str, name: str) -> str:
    """A new empty database on the server at `url`; its URL."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + f"/{name}"


class Other:
    """A second connection to a memory, autocommitting, beside the store's own: what another
    process (or a person at a SQL prompt) does behind the store's back."""

    def __init__(self, location: object) -> None:
        import sqlite3

        from perpetuity_core.memory.storage.dialect import PgConnection, Translated

        if isinstance(location, str):
            import psycopg

            self.raw = psycopg.connect(location, autocommit=True)
            # The tests' statements are SQLite's, translated (the store's own are per backend).
            self.conn: object = Translated(PgConnection(self.raw))
        else:
            self.raw = sqlite3.connect(location, isolation_level=None)
            self.raw.execute("PRAGMA foreign_keys = ON")
            self.conn = self.raw

    def execute(self, sql: str, parameters: object = ()) -> object:
        return self.conn.execute(sql, parameters)  # type: ignore[attr-defined]

    def commit(self) -> None:
        """Autocommitting: nothing to do (kept so SQLite-era tests read the same)."""

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> Other:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def other_connection(location: object) -> Other:
    return Other(location)
