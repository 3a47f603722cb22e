"""The notes library: schema round-trips, recall, capture, curate, reindex and the CLI."""

from __future__ import annotations

import io
import json
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core import notes
from perpetuity_core.cli import main as cli
from perpetuity_core.errors import PerpetuityError
from perpetuity_core.memory.storage import dictionary

REPO = Path(__file__).resolve().parent.parent
TODAY = date(2026, 11, 30)
REGISTERED_COMMANDS = list(cli.COMMAND_MODULES)  # before the fixture below narrows it


def note_text(
    name: str,
    *,
    description: str = "Fixes a thing",
    tags: str = "[alpha]",
    created: str = "2026-11-20",
    confidence: str = "medium",
    state: str = "active",
    use_count: int = 0,
    last_used: str = "null",
    supersedes: str = "null",
    pinned: str = "false",
    origin: str = "agent-created",
    when: str = "Something happens.",
    procedure: str = "1. Do the thing.",
    pitfalls: str = "- None known.",
    verification: str = "It works.",
) -> str:
    return (
        "---\n"
        f"name: {name}\n"
        f"description: {description}\n"
        f"tags: {tags}\n"
        f"created: {created}\n"
        "source_task: a task\n"
        f"confidence: {confidence}\n"
        f"state: {state}\n"
        f"use_count: {use_count}\n"
        f"last_used: {last_used}\n"
        f"supersedes: {supersedes}\n"
        f"pinned: {pinned}\n"
        f"origin: {origin}\n"
        "---\n\n"
        f"## When\n\n{when}\n\n"
        f"## Procedure\n\n{procedure}\n\n"
        f"## Pitfalls\n\n{pitfalls}\n\n"
        f"## Verification\n\n{verification}\n"
    )


def put(root: Path, name: str, text: str | None = None, **kw: object) -> Path:
    path = root / "notes" / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = note_text(name, **kw) if text is None else text  # type: ignore[arg-type]
    path.write_text(text, encoding="utf-8")
    return path


def days_ago(n: int) -> str:
    return (TODAY - timedelta(days=n)).isoformat()


def all_files(root: Path) -> dict[Path, bytes]:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def count_notes_and_archive(root: Path) -> int:
    return sum(1 for d in ("notes", ".archive") for p in (root / d).rglob("*") if p.is_file())


# Hand formatting a person might use: comments, block lists, quoting, odd spacing, CRLF-free.
HAND_WRITTEN = """\
---
# written by hand; keep this comment
name: docker-dns-in-ci
description: "Fixes DNS lookups failing inside Docker on the CI runner: use the host's resolver"
tags:
  - docker
  - dns
  - ci
created: 2026-10-01
source_task:   Unblock the nightly build
confidence: high
state: active
use_count: 2
last_used: 2026-11-01
supersedes: ~
pinned: true
origin: hand-authored
extra_key: kept as is
---

# Docker DNS in CI

## When
Lookups time out only inside containers.

## Procedure
1. Pass `--dns` from `/etc/resolv.conf`.

## Pitfalls
## Verification
`getent hosts example.com` answers inside the container.
"""

PYTEST_NOTE: dict[str, str] = dict(  # noqa: C408 (keyword arguments, spread into put)
    description="Fixes pytest import file mismatch when two test modules share a basename",
    tags="[pytest, ImportPathMismatchError, monorepo]",
    when="Collection stops with import file mismatch for two test_utils.py modules.",
    procedure="1. Set --import-mode=importlib in addopts.\n2. Remove stale __pycache__ folders.",
    pitfalls="- Renaming one file only hides the clash.",
    verification="pytest --collect-only lists both modules.",
)

PYTEST_DUPLICATE: dict[str, str] = dict(  # noqa: C408 (keyword arguments, spread into put)
    description="Fixes pytest import mismatch for test modules sharing a basename in a monorepo",
    tags="[pytest, ImportPathMismatchError, test-collection]",
    when="pytest collection reports import file mismatch for duplicate test module basenames.",
    procedure="1. Use --import-mode=importlib in addopts.\n2. Clear stale __pycache__ folders.\n"
    "3. Rerun collection.",
    pitfalls="- Renaming the module only hides the clash.",
    verification="pytest --collect-only shows both test modules.",
)

POSTGRES_NOTE: dict[str, str] = dict(  # noqa: C408 (keyword arguments, spread into put)
    description="Restores a Postgres database dump into a container with the right roles",
    tags="[postgres, pg_restore, docker]",
    when="pg_restore reports role does not exist while loading a production dump locally.",
    procedure="1. Create the owner roles first.\n2. Run pg_restore with --no-owner.",
    pitfalls="- The dump's extensions need superuser.",
    verification="psql lists the restored tables with the expected row counts.",
)


# --- Schema ---------------------------------------------------------------------------------------


def test_untouched_notes_round_trip_byte_identical() -> None:
    for text in (note_text("plain-note"), HAND_WRITTEN, (REPO / "notes/_example.md").read_text()):
        assert notes.render_note(notes.parse_note(text)) == text


def test_a_note_without_origin_counts_as_hand_authored() -> None:
    text = "---\nname: n\ndescription: d\n---\n\n## When\n\nx\n"
    note = notes.parse_note(text)
    assert note.origin == "hand-authored" and note.protected
    assert notes.render_note(note) == text


def test_hand_written_note_parses_to_the_schema() -> None:
    note = notes.parse_note(HAND_WRITTEN)
    assert note.tags == ("docker", "dns", "ci")
    assert note.source_task == "Unblock the nightly build"
    assert note.supersedes is None and note.pinned and note.protected
    assert note.created == "2026-10-01" and note.last_used == "2026-11-01"


def test_changing_a_key_rewrites_only_its_lines() -> None:
    import dataclasses

    note = notes.parse_note(HAND_WRITTEN)
    changed = dataclasses.replace(note, use_count=3, tags=("docker", "dns", "ci", "resolv.conf"))
    text = notes.render_note(changed)
    before, after = HAND_WRITTEN.splitlines(), text.splitlines()
    assert "use_count: 3" in after and "tags: [docker, dns, ci, resolv.conf]" in after
    assert [ln for ln in before if ln not in after] == [
        "tags:",
        "  - docker",
        "  - dns",
        "  - ci",
        "use_count: 2",
    ]
    assert "# written by hand; keep this comment" in after and "extra_key: kept as is" in after
    assert text.endswith(HAND_WRITTEN.split("---\n", 2)[2])  # the body is untouched
    assert notes.parse_note(text) == dataclasses.replace(changed, text=text)


def test_values_that_need_quoting_are_quoted() -> None:
    import dataclasses

    note = notes.parse_note(note_text("q"))
    changed = dataclasses.replace(note, description="yes: a # tricky: one", source_task="true")
    again = notes.parse_note(notes.render_note(changed))
    assert again.description == "yes: a # tricky: one" and again.source_task == "true"


@pytest.mark.parametrize(
    "text",
    [
        "no frontmatter\n",
        "---\nname: x\n",
        "---\nname: x\n---\n",
        "---\nname: x\ndescription: d\nconfidence: certain\n---\n",
        "---\nname: x\ndescription: d\ncreated: yesterday\n---\n",
        "---\nname: x\ndescription: d\npinned: maybe\n---\n",
        "---\n[not, a, mapping]\n---\n",
    ],
)
def test_malformed_notes_are_a_note_error(text: str) -> None:
    with pytest.raises(notes.NoteError):
        notes.parse_note(text)


def test_seed_index_matches_the_example() -> None:
    example = notes.parse_note((REPO / "notes/_example.md").read_text())
    assert (REPO / "notes/INDEX.md").read_text() == notes.render_index([example])
    keys = {line.split(":")[0] for line in example.text.split("---")[1].splitlines() if line}
    assert set(notes.FIELDS) <= keys
    _, sections = notes.split_sections(example.body)
    assert [h for h, _ in sections] == list(notes.SECTIONS)


def test_skill_has_frontmatter_and_commands() -> None:
    import yaml

    text = (REPO / "notes/SKILL.md").read_text()
    meta = yaml.safe_load(text.split("---")[1])
    assert meta["name"] == "perpetuity-notes" and len(meta["description"]) <= 1024
    for needle in (
        "perpetuity notes recall",
        "perpetuity notes capture",
        "/perpetuity-curate",
        "perpetuity notes curate",
    ):
        assert needle in text


def test_notes_root(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "repo"
    cwd.mkdir()
    assert notes.notes_root({}, cwd, home) == home / ".claude" / "perpetuity"
    (cwd / ".perpetuity").mkdir()
    assert notes.notes_root({}, cwd, home) == cwd / ".perpetuity"
    env = {"PERPETUITY_NOTES_DIR": str(tmp_path / "elsewhere")}
    assert notes.notes_root(env, cwd, home) == tmp_path / "elsewhere"


# --- Recall ---------------------------------------------------------------------------------------


def test_terms_are_the_memorys_stems_without_stop_words() -> None:
    found = notes.terms("Please fix the ModuleNotFoundError in node.js tests with docker-compose")
    # The memory's words (runs of letters and digits) and stems: what a memory search sees.
    assert found == {"modulenotfounderror", "nod", "js", "test", "docker", "compos"}
    assert found == {dictionary.stem(w) for w in ("node", "js", "tests", "docker", "compose",
                                                    "modulenotfounderror")}
    assert notes.terms("containers") == notes.terms("container")
    # Every form of a word every note says is left out; a single letter (c++) and short numbers too.
    assert notes.terms("fixes failing c++ builds on port 42 with exit 137") == {
        "build", "port", "exit", "137"}


def test_recall_by_tag_and_by_body_and_nothing_for_unrelated(tmp_path: Path) -> None:
    put(tmp_path, "pytest-mismatch", **PYTEST_NOTE)
    put(tmp_path, "postgres-restore", **POSTGRES_NOTE)

    by_tag = notes.recall(tmp_path, "The monorepo CI is red again")
    assert by_tag.names == ["pytest-mismatch"]
    assert by_tag.notes[0].matched == ("monorepo",)

    by_body = notes.recall(tmp_path, "my psql session shows no tables")
    assert by_body.names == ["postgres-restore"]
    assert "=== note postgres-restore ===" in by_body.text
    assert (tmp_path / "notes/postgres-restore.md").read_text().rstrip() in by_body.text

    nothing = notes.recall(tmp_path, "Write a haiku about autumn leaves")
    assert nothing.notes == () and "No note matches this task." in nothing.text
    assert len(nothing.index_lines) == 2  # the index is always loaded


def test_recall_ranks_tags_above_bodies(tmp_path: Path) -> None:
    put(tmp_path, "by-tag", tags="[kubectl]", when="Unrelated words.")
    put(tmp_path, "by-body", tags="[other]", when="Run kubectl here.")
    assert notes.recall(tmp_path, "kubectl hangs").names == ["by-tag", "by-body"]


def test_recall_marks_leads_and_superseded_notes_yield(tmp_path: Path) -> None:
    put(tmp_path, "old-way", tags="[webpack]", when="Webpack build is slow.")
    put(
        tmp_path,
        "new-way",
        tags="[vite]",
        supersedes="old-way",
        confidence="tentative",
        when="Switch the bundler.",
    )
    result = notes.recall(tmp_path, "webpack build takes ten minutes")
    assert result.names == ["new-way"]
    assert result.notes[0].lead and result.notes[0].replaces == ("old-way",)
    assert "LEAD: tentative" in result.text and "supersedes old-way" in result.text


def test_recall_on_missing_root_is_empty(tmp_path: Path) -> None:
    result = notes.recall(tmp_path / "absent", "pytest")
    assert result.notes == () and result.index_lines == ()


# --- Use ------------------------------------------------------------------------------------------


def test_cited_notes() -> None:
    names = ["pytest-mismatch", "pytest", "docker-dns"]
    reply = "Following pytest-mismatch, I set importlib mode. Docker-DNS was not needed."
    assert notes.cited_notes(reply, names) == ["pytest-mismatch", "docker-dns"]
    assert notes.cited_notes("nothing here", names) == []


def test_mark_used(tmp_path: Path) -> None:
    put(tmp_path, "a", state="stale", created=days_ago(40), use_count=2)
    put(tmp_path, "b")
    assert notes.mark_used(tmp_path, ["a", "missing"], TODAY) == ["a"]
    a = notes.find_note(tmp_path, "a")
    assert (a.use_count, a.last_used, a.state) == (3, TODAY.isoformat(), "active")
    assert (tmp_path / "notes/b.md").read_text() == note_text("b")
    assert "- a —" in (tmp_path / "INDEX.md").read_text()


# --- Credentials ----------------------------------------------------------------------------------

SECRETS = {
    "anthropic": "export ANTHROPIC_API_KEY=sk-ant-api03-"
    + "aB3dE5fG7hJ9kL1mN3pQ5rS7tU9vW1xY"
    + "-zz",
    "openai": "key sk-proj-" + "Zt7Qm2Xv9Lr4Ns8Kp1Hd6Wb3Jc5Fg0Ya",
    "aws": "aws_access_key_id = " + "AKIA" + "IOSFODNN7EXAMPLE",
    "github": "token ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "slack": "SLACK=xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOp",
    "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----",
    "openssh": "-----BEGIN OPENSSH PRIVATE KEY-----",
    "jwt": "Authorization: eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "password": "DB_PASSWORD=hunter2hunter2",
    "password-yaml": 'password: "correct horse battery"',
    "bearer": "curl -H 'Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123456789'",
}

CLEAN = [
    "Set --import-mode=importlib and rerun pytest.",
    "Read the password from $DB_PASSWORD; never paste it.",
    "password: ask the admin for it",
    'api_key = os.environ["OPENAI_API_KEY"]',
    "password=<your password>",
    "cd $(pwd) and skip the ask-for-help step",
    "The AKIA prefix marks an AWS access key id; sk- marks an OpenAI key.",
]


@pytest.mark.parametrize("kind", sorted(SECRETS))
def test_credential_scan_catches_real_key_shapes(kind: str) -> None:
    assert notes.scan_credentials(SECRETS[kind]), kind


@pytest.mark.parametrize("text", CLEAN)
def test_credential_scan_passes_clean_text(text: str) -> None:
    assert notes.scan_credentials(text) == []


# --- Capture --------------------------------------------------------------------------------------

FIELDS = {
    "name": "Pytest Import Mismatch",
    "description": "Fixes pytest import file mismatch when test modules share a basename",
    "tags": ["pytest", "ImportPathMismatchError"],
    "source_task": "CI for the monorepo",
    "confidence": "medium",
    "when": "Collection stops with import file mismatch.",
    "procedure": "1. Set --import-mode=importlib in addopts.\n2. Remove stale __pycache__ folders.",
    "pitfalls": "- Renaming one file only hides the clash.",
    "verification": "pytest --collect-only lists both modules.",
}


def test_capture_creates_an_agent_note_and_the_index(tmp_path: Path) -> None:
    result = notes.capture(tmp_path / "lib", FIELDS, TODAY)
    assert result.action == "created" and result.name == "pytest-import-mismatch"
    note = notes.find_note(tmp_path / "lib", "pytest-import-mismatch")
    assert note.path == tmp_path / "lib/notes/pytest-import-mismatch.md"
    assert (note.origin, note.state, note.created, note.use_count) == (
        "agent-created",
        "active",
        TODAY.isoformat(),
        0,
    )
    assert [h for h, _ in notes.split_sections(note.body)[1]] == list(notes.SECTIONS)
    assert "- pytest-import-mismatch —" in (tmp_path / "lib/INDEX.md").read_text()
    assert notes.render_note(note) == note.text


def test_capture_patches_the_same_name_instead_of_duplicating(tmp_path: Path) -> None:
    notes.capture(tmp_path, FIELDS, TODAY)
    refined = {
        **FIELDS,
        "tags": ["pytest", "conftest"],
        "confidence": "high",
        "procedure": "1. Set --import-mode=importlib in addopts.\n2. Move shared helpers "
        "into conftest.py.",
    }
    result = notes.capture(tmp_path, refined, TODAY + timedelta(days=1))
    assert result.action == "patched"
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["pytest-import-mismatch.md"]
    note = notes.find_note(tmp_path, "pytest-import-mismatch")
    assert note.tags == ("pytest", "ImportPathMismatchError", "conftest")
    assert note.confidence == "high" and note.created == TODAY.isoformat()
    assert note.body.count("importlib") == 1 and "conftest.py" in note.body
    assert "__pycache__" in note.body


def test_capture_patches_a_similar_note_under_another_name(tmp_path: Path) -> None:
    put(tmp_path, "pytest-mismatch", **PYTEST_NOTE)
    fields = {
        "name": "pytest-duplicate-basenames",
        "description": PYTEST_DUPLICATE["description"],
        "tags": ["pytest", "ImportPathMismatchError", "test-collection"],
        "when": PYTEST_DUPLICATE["when"],
        "procedure": PYTEST_DUPLICATE["procedure"],
        "pitfalls": PYTEST_DUPLICATE["pitfalls"],
        "verification": PYTEST_DUPLICATE["verification"],
    }
    result = notes.capture(tmp_path, fields, TODAY)
    assert result.action == "patched" and result.name == "pytest-mismatch"
    assert result.similarity is not None and result.similarity >= notes.SIMILARITY_THRESHOLD
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["pytest-mismatch.md"]


def test_capture_new_ground_is_a_new_note(tmp_path: Path) -> None:
    put(tmp_path, "postgres-restore", **POSTGRES_NOTE)
    assert notes.capture(tmp_path, FIELDS, TODAY).action == "created"
    assert len(list((tmp_path / "notes").iterdir())) == 2


def test_capture_refuses_credentials_and_writes_nothing(tmp_path: Path) -> None:
    fields = {**FIELDS, "procedure": "1. " + SECRETS["aws"]}
    with pytest.raises(notes.CredentialError) as e:
        notes.capture(tmp_path, fields, TODAY)
    assert "AWS access key" in str(e.value) and "AKIA" not in str(e.value)
    assert not tmp_path.joinpath("notes").exists()
    with pytest.raises(notes.CredentialError):
        notes.capture(tmp_path, {**FIELDS, "tags": ["pytest", SECRETS["github"]]}, TODAY)


def test_capture_never_patches_a_hand_authored_note(tmp_path: Path) -> None:
    path = put(tmp_path, "pytest-import-mismatch", origin="hand-authored")
    before = path.read_bytes()
    with pytest.raises(notes.NoteError, match="hand-authored"):
        notes.capture(tmp_path, FIELDS, TODAY)
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    "change",
    [
        {"name": "!!!"},
        {"tags": []},
        {"confidence": "sure"},
        {"when": ""},
        {"colour": "red"},
        {"origin": "hand-authored"},
    ],
)
def test_capture_rejects_bad_fields(tmp_path: Path, change: dict[str, object]) -> None:
    with pytest.raises(notes.NoteError):
        notes.capture(tmp_path, {**FIELDS, **change}, TODAY)


def test_capture_schema_and_rules() -> None:
    schema = notes.CAPTURE_TOOL_SCHEMA
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert set(schema["required"]) <= set(schema["properties"])  # type: ignore[arg-type]
    assert set(FIELDS) <= set(schema["properties"])  # type: ignore[arg-type]
    for phrase in ("5 or more steps", "non-obvious error", "correction", "quirk", "secrets"):
        assert phrase in notes.CAPTURE_RULES


def test_capture_definition_is_short() -> None:
    """note_capture's definition rides along with every request that carries our tools, read
    on every call: each rule said once (it was 529 tokens, a third of our definitions)."""
    spec = {"name": notes.CAPTURE_TOOL_NAME, "description": notes.CAPTURE_RULES,
            "input_schema": notes.CAPTURE_TOOL_SCHEMA}
    assert len(json.dumps(spec)) // 4 <= 350
    assert "patches it" in notes.CAPTURE_RULES  # a shown note's name refines, not duplicates
    confidence = notes.CAPTURE_TOOL_SCHEMA["properties"]["confidence"]  # type: ignore[index]
    assert "tentative" in confidence["description"]


# --- Reindex --------------------------------------------------------------------------------------


def test_reindex_lists_active_notes_and_reports_budget(tmp_path: Path) -> None:
    put(tmp_path, "b-note", tags="[x, y]")
    put(tmp_path, "a-note", description='"Fixes  the\\tspacing"')
    put(tmp_path, "stale-note", state="stale")
    report = notes.reindex(tmp_path)
    index = (tmp_path / "INDEX.md").read_text()
    lines = "- a-note — Fixes the spacing [alpha]\n- b-note — Fixes a thing [x, y]\n"
    assert index.endswith(lines)
    assert (report.lines, report.written, report.over_budget) == (2, True, False)
    assert not notes.reindex(tmp_path).written
    assert "2/40 lines" in report.text


def test_over_budget_is_reported_not_widened(tmp_path: Path) -> None:
    for i in range(notes.INDEX_MAX_LINES + 1):
        put(tmp_path, f"note-{i:02d}")
    report = notes.reindex(tmp_path)
    assert report.over_budget and "over budget" in report.text and "curate" in report.text
    assert len((tmp_path / "INDEX.md").read_text().splitlines()) == 7 + notes.INDEX_MAX_LINES + 1
    result = notes.capture(tmp_path, FIELDS, TODAY)
    assert result.index.over_budget and "over budget" in result.text


def test_reindex_without_a_library_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(notes.NoteError):
        notes.reindex(tmp_path / "absent")


# --- Curate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "age, state, where",
    [
        (0, "active", "notes"),
        (29, "active", "notes"),
        (30, "stale", "notes"),
        (89, "stale", "notes"),
        (90, "archived", ".archive"),
        (400, "archived", ".archive"),
    ],
)
def test_ageing_thresholds(tmp_path: Path, age: int, state: str, where: str) -> None:
    put(tmp_path, "by-created", created=days_ago(age))
    put(
        tmp_path,
        "by-last-used",
        created=days_ago(500),
        last_used=days_ago(age),
        use_count=1,
        **POSTGRES_NOTE,
    )
    notes.curate(tmp_path, TODAY)
    for name in ("by-created", "by-last-used"):
        path = tmp_path / where / f"{name}.md"
        assert notes.parse_note(path.read_text()).state == state, (name, age)


def test_a_recently_used_stale_note_is_active_again(tmp_path: Path) -> None:
    put(tmp_path, "n", state="stale", created=days_ago(100), last_used=days_ago(3))
    summary = notes.curate(tmp_path, TODAY)
    assert summary.revived == ["n"] and notes.find_note(tmp_path, "n").state == "active"


def test_curate_never_touches_pinned_or_hand_authored(tmp_path: Path) -> None:
    old = days_ago(365)
    protected = [
        put(tmp_path, "docker-dns-in-ci", HAND_WRITTEN),
        put(tmp_path, "pinned-old", created=old, pinned="true"),
        put(tmp_path, "hand-old", created=old, origin="hand-authored"),
        put(tmp_path, "pinned-dup", pinned="true", **PYTEST_NOTE),
        put(tmp_path, "hand-dup", origin="hand-authored", **PYTEST_DUPLICATE),
    ]
    put(tmp_path, "agent-old", created=old)
    before = {p: p.read_bytes() for p in protected}
    summary = notes.curate(tmp_path, TODAY)
    assert {p: p.read_bytes() for p in protected} == before
    assert summary.archived == ["agent-old"] and summary.merged == []
    assert sorted(summary.protected) == sorted(p.stem for p in protected)


def test_consolidation_merges_near_duplicates(tmp_path: Path) -> None:
    put(
        tmp_path,
        "pytest-mismatch",
        confidence="high",
        use_count=1,
        last_used=days_ago(2),
        **PYTEST_NOTE,
    )
    put(
        tmp_path,
        "pytest-duplicate-basenames",
        use_count=4,
        last_used=days_ago(1),
        **PYTEST_DUPLICATE,
    )
    put(tmp_path, "postgres-restore", **POSTGRES_NOTE)
    sim = notes.similarity(
        *(notes.find_note(tmp_path, n) for n in ("pytest-mismatch", "pytest-duplicate-basenames"))
    )
    assert sim >= notes.SIMILARITY_THRESHOLD

    summary = notes.curate(tmp_path, TODAY)
    assert summary.merged == [("pytest-duplicate-basenames", "pytest-mismatch")]
    strong = notes.find_note(tmp_path, "pytest-mismatch")
    assert strong.supersedes == "pytest-duplicate-basenames"
    assert strong.use_count == 5 and strong.last_used == days_ago(1)
    assert "test-collection" in strong.tags and "Rerun collection." in strong.body
    assert strong.body.count("importlib") == 1
    weak = notes.parse_note((tmp_path / ".archive/pytest-duplicate-basenames.md").read_text())
    assert weak.state == "archived"
    assert "pytest-duplicate-basenames" not in (tmp_path / "INDEX.md").read_text()
    assert notes.recall(tmp_path, "pytest ImportPathMismatchError").names == ["pytest-mismatch"]


def test_consolidation_folds_a_cluster_into_the_strongest(tmp_path: Path) -> None:
    put(tmp_path, "pytest-a", confidence="high", **PYTEST_NOTE)
    put(tmp_path, "pytest-b", **PYTEST_NOTE)
    put(tmp_path, "pytest-c", **PYTEST_DUPLICATE)
    put(tmp_path, "postgres-restore", **POSTGRES_NOTE)
    summary = notes.curate(tmp_path, TODAY)
    assert [stronger for _, stronger in summary.merged] == ["pytest-a", "pytest-a"]
    assert sorted(weaker for weaker, _ in summary.merged) == ["pytest-b", "pytest-c"]
    assert [n.name for n in notes.load_notes(tmp_path)] == ["postgres-restore", "pytest-a"]
    assert sorted(p.name for p in (tmp_path / ".archive").glob("*.md")) == [
        "pytest-b.md",
        "pytest-c.md",
    ]
    assert not notes.curate(tmp_path, TODAY).changed


def test_consolidation_leaves_distinct_notes_alone(tmp_path: Path) -> None:
    put(tmp_path, "pytest-mismatch", **PYTEST_NOTE)
    put(tmp_path, "postgres-restore", **POSTGRES_NOTE)
    put(
        tmp_path,
        "docker-dns",
        tags="[docker, dns, ci]",
        description="Fixes DNS in containers",
        when="Lookups time out inside containers.",
        procedure="1. Pass --dns to docker run.",
    )
    a, b, c = notes.load_notes(tmp_path)
    assert max(notes.similarity(a, b), notes.similarity(a, c), notes.similarity(b, c)) < 0.2
    summary = notes.curate(tmp_path, TODAY)
    assert summary.merged == [] and len(notes.load_notes(tmp_path)) == 3


def test_same_tags_on_different_problems_do_not_merge(tmp_path: Path) -> None:
    put(
        tmp_path,
        "pytest-flaky-async",
        tags="[pytest, python]",
        description="Fixes flaky pytest async fixtures that leak an event loop between tests",
        when="Tests pass alone but fail in the full run with event loop is closed.",
        procedure="1. Give async fixtures function scope.\n2. Set asyncio_mode = auto in pytest "
        "config.\n3. Close clients in fixture teardown.",
        pitfalls="- Session-scoped loops hide the leak until CI.",
        verification="pytest -p no:randomly passes three runs in a row.",
    )
    put(
        tmp_path,
        "pytest-mismatch-short",
        tags="[pytest, python]",
        description="Fixes pytest import file mismatch in a monorepo",
        when="Two test modules share a basename.",
        procedure="1. Set --import-mode=importlib.",
        pitfalls="- Renaming hides it.",
        verification="Collection passes.",
    )
    a, b = notes.load_notes(tmp_path)
    assert notes.similarity(a, b) < notes.SIMILARITY_THRESHOLD
    assert notes.curate(tmp_path, TODAY).merged == []


def test_curate_never_shrinks_and_snapshots_first(tmp_path: Path) -> None:
    put(tmp_path, "pytest-mismatch", **PYTEST_NOTE)
    put(tmp_path, "pytest-duplicate-basenames", **PYTEST_DUPLICATE)
    put(tmp_path, "stale-one", created=days_ago(45))
    put(tmp_path, "gone-one", created=days_ago(95))
    notes.reindex(tmp_path)
    before = all_files(tmp_path)
    count = count_notes_and_archive(tmp_path)
    def clock():
        return datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
    summary = notes.curate(tmp_path, TODAY, clock=clock)
    assert summary.snapshot == tmp_path / ".archive/snapshot-20261130T120000Z"
    snap = {
        Path(*p.parts[2:]): b
        for p, b in all_files(tmp_path).items()
        if p.parts[:2] == (".archive", "snapshot-20261130T120000Z")
    }
    assert snap == before  # the snapshot holds everything as it was before the pass
    assert count_notes_and_archive(tmp_path) >= count + len(before)
    assert "Marked stale" in summary.text and "gone-one" in summary.text
    assert "Merged" in summary.text

    # ageing and merging again at a later date still never deletes anything
    count = count_notes_and_archive(tmp_path)
    notes.curate(tmp_path, TODAY + timedelta(days=120), clock=clock)
    assert count_notes_and_archive(tmp_path) >= count
    assert (tmp_path / ".archive/snapshot-20261130T120000Z-2").is_dir()


def test_curate_is_idempotent(tmp_path: Path) -> None:
    put(tmp_path, "pytest-mismatch", **PYTEST_NOTE)
    put(tmp_path, "pytest-duplicate-basenames", **PYTEST_DUPLICATE)
    put(tmp_path, "stale-one", created=days_ago(45))
    put(tmp_path, "gone-one", created=days_ago(95))
    put(tmp_path, "fine", **POSTGRES_NOTE)
    first = notes.curate(tmp_path, TODAY)
    assert first.changed
    after_first = all_files(tmp_path)
    second = notes.curate(tmp_path, TODAY)
    assert not second.changed and second.snapshot is None
    assert all_files(tmp_path) == after_first
    assert second.text.startswith("Nothing to change")


def test_curate_on_a_tidy_library_writes_nothing(tmp_path: Path) -> None:
    put(tmp_path, "fine", **POSTGRES_NOTE)
    notes.reindex(tmp_path)
    before = all_files(tmp_path)
    assert not notes.curate(tmp_path, TODAY).changed
    assert all_files(tmp_path) == before and not (tmp_path / ".archive").exists()


def test_archiving_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / ".archive").mkdir(parents=True)
    (tmp_path / ".archive/old.md").write_text("an earlier archived note\n")
    put(tmp_path, "old", created=days_ago(100))
    notes.curate(tmp_path, TODAY)
    assert (tmp_path / ".archive/old.md").read_text() == "an earlier archived note\n"
    assert notes.parse_note((tmp_path / ".archive/old-2.md").read_text()).name == "old"


# --- CLI ------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def only_notes_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the real `perpetuity` parser with only this module's commands, so these tests do
    not depend on other command modules being importable; registration is checked below."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["perpetuity_core.cli.notes"])


def test_notes_commands_are_registered() -> None:
    assert "perpetuity_core.cli.notes" in REGISTERED_COMMANDS


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "lib"
    d = ["--dir", str(root)]
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(FIELDS)))
    code, out, _ = run(["notes", "capture", *d, "--today", "2026-11-30"], capsys)
    assert code == 0 and out.startswith("Created note pytest-import-mismatch")

    code, out, _ = run(
        [
            "notes",
            "capture",
            *d,
            "--name",
            "postgres-restore",
            "--description",
            "Restores a Postgres dump",
            "--tag",
            "postgres",
            "--tag",
            "pg_restore",
            "--when",
            "w",
            "--procedure",
            "p",
            "--pitfalls",
            "x",
            "--verification",
            "v",
        ],
        capsys,
    )
    assert code == 0 and "Created note postgres-restore" in out

    code, out, _ = run(["notes", "list", *d], capsys)
    assert code == 0 and out.splitlines()[0].startswith("postgres-restore  active  medium")
    code, out, _ = run(["notes", "list", *d, "--json"], capsys)
    assert [n["name"] for n in json.loads(out)] == ["postgres-restore", "pytest-import-mismatch"]

    code, out, _ = run(["notes", "show", *d, "pytest-import-mismatch"], capsys)
    assert out == (root / "notes/pytest-import-mismatch.md").read_text()

    code, out, _ = run(["notes", "recall", *d, "pytest says ImportPathMismatchError"], capsys)
    assert "=== note pytest-import-mismatch ===" in out and "postgres-restore ===" not in out
    code, out, _ = run(["notes", "recall", *d, "--json", "pg_restore fails"], capsys)
    assert [n["name"] for n in json.loads(out)["notes"]] == ["postgres-restore"]

    code, out, _ = run(["notes", "used", *d, "--today", "2026-12-01", "postgres-restore"], capsys)
    assert notes.find_note(root, "postgres-restore").use_count == 1

    code, out, _ = run(["notes", "reindex", *d], capsys)
    assert code == 0 and "INDEX.md: 2/40 lines" in out

    code, out, _ = run(["notes", "curate", *d, "--today", "2027-03-15"], capsys)
    assert code == 0 and "pytest-import-mismatch" in out and "Moved to .archive/" in out
    code, out, _ = run(["notes", "curate", *d, "--today", "2027-03-15", "--json"], capsys)
    data = json.loads(out)
    assert data["snapshot"] is None and data["text"].startswith("Nothing to change")


def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    d = ["--dir", str(tmp_path)]
    code, _, err = run(["notes", "show", *d, "nope"], capsys)
    assert code == 1 and err.startswith("perpetuity: no note named") and err.count("\n") == 1
    code, _, err = run(["notes", "curate", *d, "--today", "30/11/2026"], capsys)
    assert code == 1 and "YYYY-MM-DD" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps({**FIELDS, "when": SECRETS["jwt"]})))
    code, _, err = run(["notes", "capture", *d], capsys)
    assert code == 1 and "credential" in err and "eyJ" not in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("not json"))
    code, _, err = run(["notes", "capture", *d], capsys)
    assert code == 1 and "JSON" in err


def test_errors_share_the_project_base() -> None:
    assert issubclass(notes.CredentialError, notes.NoteError)
    assert issubclass(notes.NoteError, PerpetuityError)


EXOTIC = [
    "\u017fecret = 'hunter2hunter2'",  # long s: IGNORECASE matches it for s, lower() keeps it
    "ap\u0130_key = 'abc123def456'",  # dotted capital I, which lowers to two characters
    "ap\u0131key: 'abc123def456'",  # dotless i
    "notes\nline two\nDB_PASSWORD=hunter2hunter2\nsk-proj-" + "Zt7Qm2Xv9Lr4Ns8Kp1Hd6Wb3Jc5Fg0Ya",
    "api_key = os.environ['X']\ntoken ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "a task-list that passed\nthrough the keyboard",
]


@pytest.mark.parametrize("text", [*SECRETS.values(), *CLEAN, *EXOTIC])
def test_secret_kind_is_the_scans_first_finding(text: str) -> None:
    # secret_kind runs a pattern only on the lines holding one of its literals; the kind must
    # be the full per-line scan's first finding (on the old triggers the long s went unseen).
    from perpetuity_core.memory.storage.secrets import secret_kind

    findings = notes.scan_credentials(text)
    assert secret_kind(text) == (findings[0].kind if findings else "")


_FRAGMENTS = [*SECRETS.values(), *EXOTIC, "\n", "\r\n", "\u2028", " ", "api_key", "token",
              "secret: 'x1'", "passw", "ghp_", "Bearer ", "\u0130", "\u017f", "plain words"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_FRAGMENTS), max_size=12))
def test_secret_kind_finds_the_lines_as_the_scan_does(parts: list[str]) -> None:
    # secret_kind finds the lines holding a literal by searching the whole text lowered, not
    # line by line: the kind must still be the per-line scan's first finding, whatever the
    # line breaks and the characters that lower oddly around them.
    from perpetuity_core.memory.storage.secrets import secret_kind

    text = "".join(parts)
    findings = notes.scan_credentials(text)
    assert secret_kind(text) == (findings[0].kind if findings else "")
