"""A memory database named by a URL the store cannot open is refused at start, in one line,
by every way of naming it: `perpetuity proxy --db`, mitmdump's `perpetuity_db`, the CLI's --db.
`sqlite:///path` and plain paths are SQLite files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.location import sqlite_path
from tests.conftest import MITMDUMP, ROOT, free_port

PERPETUITY = Path(sys.executable).with_name("perpetuity")
# Nothing listens on a port just freed: a PostgreSQL URL the store cannot reach.
URL = f"postgresql://postgres:hunter2@127.0.0.1:{free_port()}/perpetuity"


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PERPETUITY_DB"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def refused_in_one_line(done: subprocess.CompletedProcess[str], cwd: Path) -> str:
    assert done.returncode != 0
    assert list(cwd.iterdir()) == [], "nothing may be created for a refused URL"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "perpetuity" in line]
    assert len(lines) == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "hunter2" not in done.stdout + done.stderr  # the password is not shown
    return lines[0]


def test_paths_and_sqlite_urls_name_a_file(tmp_path: Path) -> None:
    assert sqlite_path(str(tmp_path / "m.db")) == tmp_path / "m.db"
    assert sqlite_path(f"sqlite://{tmp_path}/m.db") == tmp_path / "m.db"
    assert sqlite_path("~/m.db") == Path.home() / "m.db"
    assert sqlite_path(tmp_path / "a:b.db") == tmp_path / "a:b.db"


@pytest.mark.parametrize("url", ["mysql://h/db", "sqlite://host/m.db", "sqlite:///"])
def test_other_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="cannot open the memory database"):
        sqlite_path(url)


def test_a_sqlite_url_opens_the_file_it_names(tmp_path: Path) -> None:
    store = open_memory(f"sqlite://{tmp_path}/m.db")
    try:
        assert store.path == tmp_path / "m.db" and store.path.is_file()
    finally:
        store.close()


@pytest.mark.parametrize("verb", [["memory", "stats"], ["memory", "check"], ["search", "x"],
                                  ["memory", "purge", "--user", "u"], ["memory", "import", "locomo", "x"],
                                  ["memory", "dictionary", "list"], ["replay", "chat", "locomo", "x"]])
def test_the_cli_refuses_a_url_it_cannot_open(tmp_path: Path, verb: list[str]) -> None:
    line = refused_in_one_line(run([str(PERPETUITY), *verb, "--db", URL], tmp_path), tmp_path)
    # replay fills a new file, so a PostgreSQL URL is not one it takes
    assert line.startswith(("perpetuity: could not open the memory database postgresql://postgres:***@",
                            "perpetuity: cannot open the memory database postgresql://postgres:***@"))
    other = run([str(PERPETUITY), *verb, "--db", "mysql://u:hunter2@h/db"], tmp_path)
    assert "mysql:// is not a store" in refused_in_one_line(other, tmp_path)


def test_perpetuity_proxy_refuses_it_before_starting(tmp_path: Path) -> None:
    done = run([str(PERPETUITY), "proxy", "--port", str(free_port()), "--db",
                "mysql://u:hunter2@h/db"], tmp_path)
    assert "mysql:// is not a store" in refused_in_one_line(done, tmp_path)


def test_mitmdump_refuses_it_as_perpetuity_db(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    done = run([str(MITMDUMP), "-q", "-s", str(ROOT / "addon" / "perpetuity.py"),
                "--listen-host", "127.0.0.1", "--listen-port", str(free_port()),
                "--set", f"confdir={tmp_path / 'mitm'}", "--set", f"perpetuity_db={URL}"],
               tmp_path / "run")
    line = refused_in_one_line(done, tmp_path / "run")
    assert "could not open the memory database postgresql://postgres:***@" in line
