"""The command line as a newcomer meets it: help that says the real defaults and names no
source file, one clear line for a file of the wrong kind, counts in good English, and
`perpetuity try`, which shows the frame a question got with no key and no network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perpetuity_core.cli import main as cli
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.wire.conversation import Kind, Message, Part

PERPETUITY = Path(sys.executable).with_name("perpetuity")


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [("memory", "search"), ("memory", "stats"), ("memory", "import"),
                                  ("memory", "users"), ("memory", "check"), ("search",),
                                  ("stats",)])
def test_db_help_names_the_real_default(capsys: pytest.CaptureFixture[str],
                                        argv: tuple[str, ...]) -> None:
    text = " ".join(_help(capsys, *argv).split())
    assert "~/.perpetuity/memory.db" in text and "~/.perpetuity)" not in text


@pytest.mark.parametrize(("argv", "option"), [(("memory", "search"), "--limit LIMIT"),
                                              (("memory", "stats"), "--json")])
def test_every_option_has_help(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                               option: str) -> None:
    line = next(x for x in _help(capsys, *argv).splitlines() if x.strip().startswith(option))
    assert line.strip() != option, f"{option} has no help text"


def test_replay_claude_code_help_describes_it(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(_help(capsys, "replay", "claude-code").split())
    assert "prompt-cache rules" in text and "PATH session files" in text


@pytest.mark.parametrize("argv", [("memory",), ("notes",), ("replay",)])
def test_help_names_no_source_file(capsys: pytest.CaptureFixture[str],
                                   argv: tuple[str, ...]) -> None:
    text = _help(capsys, *argv)
    assert ".py" not in text and "perpetuity_core" not in text


def test_show_a_json_file_that_is_no_flow_file(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "replay.json"
    report.write_text('{"sessions": []}\n')
    assert cli.main(["show", str(report)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"perpetuity: {report} is JSON but not a HAR file; `perpetuity"
                                " show` reads flows saved with `perpetuity proxy -w FILE` (or a"
                                " HAR export)"]


def test_counts_of_one_are_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "memory.db"
    s = open_memory(db)
    try:
        capture.record(s, user_key="key-aaa/ada", conversation_key="c", provider="anthropic",
                       model="m", messages=[Message("user", (Part(Kind.TEXT, "one turn"),))],
                       times=[1_700_000_000.0], source="request")
    finally:
        s.close()
    assert cli.main(["memory", "users", "--db", str(db)]) == 0
    assert capsys.readouterr().err.startswith("1 user in ")
    assert cli.main(["memory", "tenants", "--db", str(db)]) == 0
    out, err = capsys.readouterr()
    assert "  key-aaa/ada  1 conversation, 1 message" in out.splitlines()
    assert err.startswith("1 tenant in ")
    assert cli.main(["memory", "purge", "--user", "key-aaa/ada", "--db", str(db)]) == 0
    assert capsys.readouterr().err.startswith("purged key-aaa/ada: 1 message, 1 row")


def test_try_shows_the_frame_a_question_got_with_no_key(tmp_path: Path) -> None:
    """One command, no key, no network: a stand-in provider, the real proxy, and the request
    the question reached the model as, its frame quoting the earlier conversation."""
    env = {k: v for k, v in os.environ.items()
           if not k.endswith("_API_KEY") and not k.lower().endswith("_proxy")}
    done = subprocess.run([str(PERPETUITY), "try"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=110)
    assert done.returncode == 0, done.stderr
    received = done.stdout.split("What the model received", 1)[1]
    frame, question = received.split("[End of quoted memory.", 1)
    assert "[Memory: turns quoted verbatim" in frame
    assert "Ada is allergic to shellfish" in frame and "Rua dos Remedios" in frame
    assert question.rstrip().endswith("Recall tools the proxy added: memory_search, memory_more,"
                                      " memory_cooccur, memory_count, memory_chains,"
                                      " memory_dates, note_capture")
    assert "Which restaurants near where we're staying would suit Ada?" in question
    assert list(tmp_path.iterdir()) == []  # nothing left behind where it ran
