"""Shared fixtures: a fake provider, a real mitmdump process running the addon, the database."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider
from tests import postgres
from tests.fake_provider import FakeProvider

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
FIXTURES = SHARED / "fixtures" / "harness"
MITMDUMP = Path(sys.executable).with_name("mitmdump")

needs_fixtures = pytest.mark.skipif(
    not FIXTURES.is_dir(), reason=f"harness captures not present at {FIXTURES}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proxy:
    url: str
    port: int
    db: Path | str  # a SQLite file, or a PostgreSQL URL
    confdir: Path
    process: subprocess.Popen
    log: Path

    def rows(self, sql: str, *args: object) -> list[tuple]:
        if isinstance(self.db, str):
            with postgres.other_connection(self.db) as other:
                return other.execute(sql, args).fetchall()
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return con.execute(sql, args).fetchall()
        finally:
            con.close()

    def messages(self, user: str | None = None) -> list[tuple[str, str, str, int]]:
        """(role, source, text of the message's items, complete) in storage order."""
        texts = ("string_agg(i.text, '|' ORDER BY i.seq)" if isinstance(self.db, str)
                 else "group_concat(i.text, '|')")
        sql = (
            f"select m.role, m.source, {texts}, m.complete from message m "
            "join user u on u.id = m.user_id left join item i on i.message_id = m.id "
            # A claimed user is stored under its tenant: "<tenant>/<user>".
            + ("where (u.key = ? or substr(u.key, instr(u.key, '/') + 1) = ?) " if user else "")
            + "group by m.id order by m.id"
        )
        return self.rows(sql, *([user, user] if user else []))

    def wait_messages(self, user: str, n: int, timeout: float = 5.0) -> list[tuple]:
        """Replies are stored after the stream ends, a moment after the client saw it."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.messages(user)
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.process.poll() is None


def start_proxy(tmp: Path, upstream: str, *extra: str, port: int | None = None,
                db: Path | str | None = None, tenants: str | None = "credential",
                quiet: bool = True) -> Proxy:
    """`tenants`: the suite's proxies serve many tests' "people" at once, each its own key or
    claimed user, so they keep tenants apart as a shared proxy does; None leaves the
    deployment's default (personal on loopback), as tests/test_personal.py means to. `quiet`
    False: the log shows warnings too (mitmdump -q, errors only, overrides any --set)."""
    port = port or free_port()
    db = db or tmp / "memory.db"
    confdir = tmp / "mitm"
    log = tmp / "mitmdump.log"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    cmd = [
        str(MITMDUMP), *(("-q",) if quiet else ("--set", "termlog_verbosity=warn",
                                                 "--set", "flow_detail=0")),
        "-s", str(ROOT / "addon" / "perpetuity.py"),
        "--listen-host", "127.0.0.1", "--listen-port", str(port),
        "--set", f"confdir={confdir}",
        "--set", f"perpetuity_db={db}",
        "--set", f"perpetuity_anthropic_upstream={upstream}",
        "--set", f"perpetuity_openai_upstream={upstream}",
        "--set", f"perpetuity_gemini_upstream={upstream}",
        "--set", "connection_strategy=lazy",
        *(("--set", f"perpetuity_tenants={tenants}") if tenants else ()),
        *extra,
    ]
    with open(log, "ab") as out:  # a restarted proxy (same tmp) appends to its log
        start = out.tell()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mitmdump exited: {log.read_text()}")
        if b"perpetuity: listening" in log.read_bytes()[start:]:
            return Proxy(f"http://127.0.0.1:{port}", port, db, confdir, proc, log)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"mitmdump did not start: {log.read_text()}")


def stop_proxy(p: Proxy) -> None:
    p.process.terminate()
    try:
        p.process.wait(10)
    except subprocess.TimeoutExpired:
        p.process.kill()
        p.process.wait()


class _Closeable(Protocol):
    def close(self) -> None: ...


_OPENED: list[_Closeable] = []


def owned[C: _Closeable](thing: C) -> C:
    """A client (an SDK's, httpx's) or connection of the test's own, closed when the test ends.
    Left to the collector, a client and its pooled socket die in one collection, in no set
    order: when the socket goes first it warns (ResourceWarning), in whichever test runs then."""
    _OPENED.append(thing)
    return thing


def opened(path: str | Path, **options: object) -> sqlite3.Connection:
    """A connection of the test's own to a memory file (read, or changed behind the store's
    back), closed when the test ends."""
    return owned(sqlite3.connect(path, **options))  # type: ignore[arg-type]


def opened_other(location: Path | str) -> postgres.Other:
    """Another connection to a memory on either backend (tests/postgres.py), autocommitting,
    closed when the test ends."""
    return owned(postgres.other_connection(location))


def query(path: str | Path, sql: str, *args: object) -> list[tuple]:
    """The rows of `sql` on the memory at `path` (a file, or a PostgreSQL URL), through a
    connection opened and closed here."""
    if isinstance(path, str) and path.startswith("postgresql://"):
        with postgres.other_connection(path) as other:
            return other.execute(sql, args).fetchall()
    with closing(sqlite3.connect(path)) as con:
        return con.execute(sql, args).fetchall()


@pytest.fixture(autouse=True)
def _close_opened() -> Iterator[None]:
    yield
    while _OPENED:
        _OPENED.pop().close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as f:
        yield f


@pytest.fixture(scope="module")
def proxy(fake: FakeProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("proxy"), fake.url)
    yield p
    stop_proxy(p)
    # mitmproxy may log its own cancelled connections at shutdown; ours must never fail.
    assert b"perpetuity_core" not in p.log.read_bytes(), p.log.read_text()


@pytest.fixture
def personal(fake: FakeProvider, tmp_path: Path) -> Iterator[Proxy]:
    """One proxy on loopback with default settings (personal tenancy)."""
    (tmp_path / "proxy").mkdir()
    p = start_proxy(tmp_path / "proxy", fake.url, tenants=None)
    yield p
    stop_proxy(p)
    assert b"perpetuity_core" not in p.log.read_bytes(), p.log.read_text()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """One real PostgreSQL server for the whole run (tests/postgres.py); skips with the reason
    where none can be started. fsync off: a test never survives a power cut anyway."""
    if why := postgres.unavailable():
        pytest.skip(why)
    with postgres.server("fsync=off", "max_connections=200") as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server: str, request: pytest.FixtureRequest) -> str:
    """A new empty database on the run's server, named after the test."""
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:50].lower()
    return postgres.fresh_database(postgres_server, name)


@pytest.fixture(params=["sqlite", "postgresql"])
def memory_at(request: pytest.FixtureRequest, tmp_path: Path) -> Path | str:
    """Where a test's memory lives: a SQLite file, then a PostgreSQL database (skipped with
    the reason where no server can start). One suite runs against both."""
    if request.param == "sqlite":
        return tmp_path / "memory.db"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(memory_at: Path | str) -> Iterator[Store]:
    """A new migrated memory on SQLite, then on PostgreSQL; closed after the test."""
    s = open_memory(memory_at)
    yield s
    s.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Store]:
    """A new migrated memory in a SQLite file, for what only SQLite does (its files, its WAL)."""
    s = open_memory(tmp_path / "memory.db")
    yield s
    s.close()


@pytest.fixture
def pipeline(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pipeline]:
    """A pipeline over a new SQLite memory whose upstreams are never reached. A test module
    whose captures name their device sets `TRUST_IDENTITY = True`."""
    s = open_memory(tmp_path / "m.db")
    yield Pipeline(s, Settings(upstreams={Provider.ANTHROPIC: "https://a.test",
                                          Provider.OPENAI: "https://o.test"},
                               trust_identity=getattr(request.module, "TRUST_IDENTITY", False)))
    s.close()


@pytest.fixture(autouse=True)
def _clean_fake(request: pytest.FixtureRequest) -> None:
    if "fake" in request.fixturenames:
        request.getfixturevalue("fake").clear()
