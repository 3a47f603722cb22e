"""The CLI reads what is there (issue 41): a read command on a memory that does not exist says
so in one line and creates nothing; `perpetuity notes list` finds the notes a personal proxy
wrote."""

from __future__ import annotations

from pathlib import Path

import anthropic
import pytest

from perpetuity_core.cli.main import main
from perpetuity_core.memory.schema import open_memory
from tests.conftest import owned, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall

READS = [
    ["stats"], ["search", "harbour"], ["memory", "stats"], ["memory", "search", "harbour"],
    ["memory", "users"], ["memory", "tenants"], ["memory", "check"],
    ["memory", "purge", "--user", "alice"], ["memory", "dictionary", "list"],
    ["memory", "tenants", "part", "key-abc"],
]


@pytest.mark.parametrize("argv", READS, ids=" ".join)
def test_a_mistyped_db_is_refused_and_nothing_created(argv: list[str], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "mistyped" / "memroy.db"
    assert main([*argv, "--db", str(missing)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"perpetuity: no memory at {missing} (nothing created; check --db or"
                   " $PERPETUITY_DB)"]
    assert not missing.parent.exists()


def test_a_read_command_reads_a_memory_that_exists(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    open_memory(tmp_path / "m.db").close()
    assert main(["memory", "users", "--db", str(tmp_path / "m.db")]) == 0
    assert "0 users in" in capsys.readouterr().err


def test_notes_list_finds_what_a_personal_proxy_wrote(fake: FakeProvider, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "notes-root"
    (tmp_path / "proxy").mkdir()
    proxy = start_proxy(tmp_path / "proxy", fake.url, "--set", f"perpetuity_notes_dir={root}",
                        tenants=None)
    try:
        c = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-me", max_retries=0))
        fake.script(Text("Noted."))  # a memory to reach: the recall tools ride from then on
        c.messages.create(model="claude-opus-4-8", max_tokens=50, messages=[
            {"role": "user", "content": "The build needs NODE_OPTIONS set."}])
        proxy.wait_messages("personal", 2)
        fields = {"name": "node-build-memory", "description": "Fix the build's heap errors.",
                  "tags": ["node"], "when": "The build dies with heap errors.",
                  "procedure": "1. export NODE_OPTIONS=--max-old-space-size=4096",
                  "pitfalls": "None.", "verification": "The build completes."}
        fake.script(ToolCall("note_capture", fields, call_id="toolu_cap"), Text("Saved."))
        r = c.messages.create(model="claude-opus-4-8", max_tokens=50, messages=[
            {"role": "user", "content": "Fixed the build, remember how."}])
        assert r.content[0].text == "Saved."
    finally:
        stop_proxy(proxy)
    assert (root / "tenants" / "personal" / "notes" / "node-build-memory.md").is_file()
    monkeypatch.setenv("PERPETUITY_NOTES_DIR", str(root))
    assert main(["notes", "list"]) == 0
    assert capsys.readouterr().out.startswith("node-build-memory  active")
    assert main(["notes", "show", "node-build-memory"]) == 0
    assert "NODE_OPTIONS" in capsys.readouterr().out
