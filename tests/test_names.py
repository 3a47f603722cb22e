"""Conversations are named as a person knows them: the title the harness asks for in its side
request (tied to the conversation by its session id), else the first prompt's opening words,
with the project folder the harness states; never a session id. Each source of a name through
the real pipeline, the importer, the migration of an older store, and a real mitmdump."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from perpetuity_core.memory import schema
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture, names
from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.wire.conversation import Kind, Message, Part, Reply, Usage, text_part
from tests.conftest import Proxy, opened, query
from tests.fake_provider import FakeProvider, Text
from tests.test_fixtures import to_request
from tests.test_migrations import before_m016

DEVICE = "d" * 64
REMINDER = ("<system-reminder>\nAs you answer the user's questions, you can use the following"
            " context:\n# currentDate\nToday's date is 2026-11-30.\n</system-reminder>")
ENV = ("You are an interactive agent.\n\n# Environment\nYou have been invoked in the following"
       " environment: \n - Primary working directory: /home/ann/checkout-app\n"
       " - Is a git repository: true\n")
TITLE_SYSTEM = "Generate a concise, sentence-case title (3-7 words). Return JSON."


def claude_code(session: str, messages: list[dict], *, title: bool = False,
                time_: str = "") -> dict:
    """A request shaped as Claude Code sends it (../shared/fixtures/harness/claude-code):
    identity in a header and in metadata.user_id; a title side request has no tools and asks
    for JSON through output_config.format."""
    body: dict = {"model": "claude-opus-4-8", "stream": True, "max_tokens": 512,
                  "messages": messages,
                  "metadata": {"user_id": json.dumps({"device_id": DEVICE, "session_id": session})}}
    if title:
        body |= {"system": [{"type": "text", "text": TITLE_SYSTEM}], "tools": [],
                 "output_config": {"format": {"type": "json_schema", "schema": {
                     "type": "object", "properties": {"title": {"type": "string"}}}}}}
    else:
        body |= {"system": [{"type": "text", "text": ENV}],
                 "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {}}]}
    headers = [["user-agent", "claude-cli/2.1.197 (external, cli)"],
               ["x-claude-code-session-id", session], ["x-api-key", "sk-test"]]
    if time_:
        headers.append(["x-perpetuity-time", time_])
    return {"method": "POST", "path": "/v1/messages", "headers": headers, "body": body}


def prompt(text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": REMINDER},
                                        {"type": "text", "text": text}]}


def send(pipeline: Pipeline, request: dict, answer: str) -> None:
    """One exchange through the pipeline: the request prepared and stored, the reply stored."""
    job = pipeline.prepare(to_request(request)).job
    assert job is not None
    turn = pipeline.store_turn(job.pending)
    pipeline.store_reply(turn, Reply(Message("assistant", (text_part(answer),)), Usage()),
                         time.time(), job.pending)


TRUST_IDENTITY = True  # the captures name their device (the `pipeline` fixture, conftest)


def conversation_names(pipeline: Pipeline) -> dict[str, tuple[str, str, str]]:
    con = opened(pipeline.store.path)
    try:
        return {k: (t, o, f) for k, t, o, f in
                con.execute("SELECT key, title, opening, folder FROM conversation")}
    finally:
        con.close()


def frame_text(pipeline: Pipeline, session: str, question: str) -> str:
    """The text of every block the request goes upstream with, in order."""
    body = json.loads(pipeline.prepare(to_request(
        claude_code(session, [prompt(question)]))).body or b"{}")
    return "\n".join(b.get("text", "") for m in body.get("messages", [])
                     for b in (m["content"] if isinstance(m["content"], list) else []))


def test_title_side_request_names_its_conversation_in_frames_and_tool_answers(
        pipeline: Pipeline) -> None:
    session = "1a2f693d-bbf8-4c4e-9d57-7d1b2f1c0001"
    send(pipeline, claude_code(session, [prompt("The basket total rounds wrong at checkout")]),
         "The rounding happens in basket.py before tax.")
    # The title request carries the same session id; its reply is JSON.
    send(pipeline, claude_code(session, [{"role": "user", "content": "<session>The basket total"
                                          " rounds wrong</session>"}], title=True),
         '{"title": "Fix basket rounding at checkout"}')
    assert conversation_names(pipeline)[session] == (
        "Fix basket rounding at checkout", "The basket total rounds wrong at checkout",
        "/home/ann/checkout-app")
    # A later title request (Claude Code asks again on later prompts) does not rename it.
    send(pipeline, claude_code(session, [{"role": "user", "content": "<session>x</session>"}],
                               title=True), '{"title": "Something else entirely"}')
    assert conversation_names(pipeline)[session][0] == "Fix basket rounding at checkout"
    # The title request stored no turn and its reply is no memory row.
    con = opened(pipeline.store.path)
    texts = [t for (t,) in con.execute("SELECT text FROM item")]
    con.close()
    assert not any("title" in t for t in texts)

    # Another session's frame names the conversation by its title and folder, not its id.
    quoted = frame_text(pipeline, "2b3c4d5e-0000-4000-8000-000000000002",
                        "why does the basket total round wrong")
    assert '[conversation "Fix basket rounding at checkout" in checkout-app, ' in quoted
    assert session not in quoted and session[:8] not in quoted
    # So does a recall tool's answer.
    uid = pipeline.store.find_user(DEVICE)
    out = tools.run("memory_search", {"query": "basket rounding"},
                    TurnMemory(uid, None, time.time()), pipeline.scanner)
    assert '"Fix basket rounding at checkout" in checkout-app' in out and session not in out


def test_without_a_title_the_first_prompt_names_it_and_a_late_title_changes_it_once(
        pipeline: Pipeline) -> None:
    session = "3c4d5e6f-0000-4000-8000-000000000003"
    asked = "2b3c4d5e-0000-4000-8000-000000000002"
    first = ("please look at the flaky login test in the auth suite, it fails one run in"
             " ten on CI")
    send(pipeline, claude_code(session, [prompt(first)]), "The login test races the token refresh.")
    _, opening, folder = conversation_names(pipeline)[session]
    # The person's words, not the reminder block before them, cut at a word.
    assert opening == names.opening_words(first) == "please look at the flaky login test in…"
    assert folder == "/home/ann/checkout-app"
    before = frame_text(pipeline, asked, "what about the flaky login test")
    assert '[conversation "please look at the flaky login test in…" in checkout-app, ' in before
    assert frame_text(pipeline, asked, "what about the flaky login test") == before  # stable
    # A reply that is not the JSON asked for is no title.
    send(pipeline, claude_code(session, [{"role": "user", "content": "x"}], title=True),
         "Hello there.")
    assert conversation_names(pipeline)[session][0] == ""
    send(pipeline, claude_code(session, [{"role": "user", "content": "x"}], title=True),
         '{"title": "Fix flaky login test"}')
    # The session that already quoted it keeps its frame as it was (the cached prefix); a new
    # frame uses the title.
    assert frame_text(pipeline, asked, "what about the flaky login test") == before
    after = frame_text(pipeline, "4d5e6f70-0000-4000-8000-00000000000a",
                       "is the flaky login test fixed yet")
    assert '[conversation "Fix flaky login test" in checkout-app, ' in after


def test_opencode_plain_title_and_codex_folder(pipeline: Pipeline) -> None:
    headers = [["user-agent", "opencode/1.18.33"], ["x-session-id", "ses_abc"],
               ["authorization", "Bearer k"]]
    env = "You are opencode.\n<env>\n  Working directory: /home/ann/garden-planner\n</env>"
    turn = {"model": "m", "stream": True, "tools": [{"type": "function", "function": {
        "name": "bash", "parameters": {}}}], "messages": [
        {"role": "system", "content": env}, {"role": "user", "content": "plan the tomato beds"}]}
    send(pipeline, {"method": "POST", "path": "/v1/chat/completions", "headers": headers,
                    "body": turn}, "Three beds, staggered.")
    title = {"model": "m", "stream": True, "messages": [
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "plan the tomato beds"}]}
    send(pipeline, {"method": "POST", "path": "/v1/chat/completions", "headers": headers,
                    "body": title}, "Tomato bed planning\n")
    assert conversation_names(pipeline)["ses_abc"] == (
        "Tomato bed planning", "plan the tomato beds", "/home/ann/garden-planner")

    codex = {"model": "gpt-5-codex", "stream": True, "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text":
            "<environment_context>\n  <cwd>/home/ann/ledger</cwd>\n</environment_context>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "reconcile the March invoices"}]}]}
    send(pipeline, {"method": "POST", "path": "/v1/responses", "headers": [
        ["originator", "codex_cli_rs"], ["session-id", "0199-codex"],
        ["authorization", "Bearer k"]], "body": codex}, "Done.")
    assert conversation_names(pipeline)["0199-codex"] == (
        "", "reconcile the March invoices", "/home/ann/ledger")


def test_claude_code_import_takes_the_sessions_title_folder_and_meta_lines(tmp_path: Path) -> None:
    lines = [
        {"type": "user", "isMeta": True, "cwd": "/home/ann/vault",
         "timestamp": "2026-03-01T10:00:00Z",
         "message": {"role": "user", "content": "Base directory for this skill: /home/ann/.claude"
                     "/skills/dream\n\nConsolidate the notes."}},
        {"type": "user", "cwd": "/home/ann/vault", "timestamp": "2026-03-01T10:00:01Z",
         "message": {"role": "user", "content": "sort the reading list by topic"}},
        {"type": "assistant", "timestamp": "2026-03-01T10:00:05Z",
         "message": {"id": "msg_1", "role": "assistant", "model": "claude-opus-4-8",
                     "content": [{"type": "text", "text": "Sorted into five topics."}]}},
        {"type": "ai-title", "sessionId": "s1", "aiTitle": "Sort reading list by topic"},
    ]
    path = tmp_path / "s1.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    store = open_memory(tmp_path / "m.db")
    importers.run(store, "claude-code", path, progress=False)
    con = opened(store.path)
    assert con.execute("SELECT title, opening, folder FROM conversation").fetchone() == (
        "Sort reading list by topic", "sort the reading list by topic", "/home/ann/vault")
    # The skill text is stored, as context, and is no retrieval row.
    assert con.execute("SELECT i.kind, (SELECT count(*) FROM retrieval r WHERE r.item_id = i.id)"
                       " FROM item i WHERE i.text LIKE 'Base directory%'").fetchall() == [
        ("context", 0)]
    con.close()
    store.close()


def test_migration_names_older_conversations_and_unindexes_their_harness_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written before m009: system messages and IDE notes stored as text and indexed."""
    db = tmp_path / "m.db"
    monkeypatch.setattr(schema, "MIGRATIONS", [  # the later ones this code needs stay
        m for m in schema.MIGRATIONS if m is not schema.m009_harness_text])
    old = open_memory(db)
    uid = old.user_id("u")
    cid = old.conversation_id(uid, "1a2f693d-bbf8", "anthropic")
    said = [Message("user", (Part(Kind.TEXT, "<ide_opened_file>a.py</ide_opened_file>"),
                             Part(Kind.TEXT, "why is the cache cold"))),
            Message("system", (Part(Kind.TEXT, "Available agent types for the Agent tool: ..."),)),
            Message("assistant", (Part(Kind.TEXT, "It is evicted nightly."),)),
            Message("user", (Part(Kind.TOOL_RESULT, "1 import os\n<system-reminder>Whenever"
                                  " you read a file, consider malware.</system-reminder>",
                                  call_id="t"),))]
    for i, m in enumerate(said):
        old.add_message(conversation_id=cid, user_id=uid, message=m, provider="anthropic",
                        model="m", at=1.0 + i, pair_key=capture.pair_key(str(i), m),
                        source="request")
    before_m016(old)  # m009 leaves the rows it re-derives to m016, which must come after it
    old.close()
    monkeypatch.undo()

    with pytest.raises(sqlite3.OperationalError):  # the old store has no names yet
        query(db, "SELECT opening FROM conversation")
    store = open_memory(db)
    con = opened(db)
    assert con.execute("SELECT title, opening, folder FROM conversation").fetchone() == (
        "", "why is the cache cold", "")
    indexed = con.execute("SELECT i.kind, i.text, r.tokens FROM item i LEFT JOIN retrieval r"
                          " ON r.item_id = i.id ORDER BY i.id").fetchall()
    assert [(k, t is not None) for k, _, t in indexed] == [
        ("context", False), ("text", True), ("context", False), ("text", True),
        ("tool_result", True)]
    # The tool result is indexed again without the reminder appended to it.
    assert indexed[-1][2] == (len("1 import os") + 3) // 4
    con.close()
    store.close()


def test_title_side_request_through_mitmdump(proxy: Proxy, fake: FakeProvider) -> None:
    session = "4d5e6f70-0000-4000-8000-000000000004"
    turn = claude_code(session, [prompt("the invoice PDF has no page numbers")])
    title = claude_code(session, [{"role": "user", "content": "<session>invoice</session>"}],
                        title=True)
    fake.script(Text("Page numbers go in the footer template."),
                Text('{"title": "Add page numbers to invoice PDF"}'))
    for request in (turn, title):
        headers = dict(request["headers"])
        with httpx.stream("POST", proxy.url + "/v1/messages", json=request["body"],
                          headers=headers) as r:
            assert r.status_code == 200
            r.read()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        got = proxy.rows("SELECT title, opening, folder FROM conversation WHERE key = ?", session)
        if got and got[0][0]:
            break
        time.sleep(0.02)
    assert got == [("Add page numbers to invoice PDF", "the invoice PDF has no page numbers",
                    "/home/ann/checkout-app")]
    # Only the turn and its reply are messages: the title exchange is not.
    assert [role for role, *_ in proxy.messages(DEVICE)] == ["user", "assistant"]


@pytest.mark.parametrize(("title", "opening", "folder", "expected"), [
    ("Fix login", "fix the login", "/home/ann/shop", '"Fix login" in shop'),
    ("", "fix the login", "", '"fix the login"'),
    ("", "", "/home/ann/shop", ""),
    # A Claude Code worktree is named by its repository, not its generated folder name.
    ("", "tidy the docs", r"C:\Users\ann\Documents\Vault\.claude\worktrees\brave-otter",
     '"tidy the docs" in Vault'),
    ("", "tidy the docs", "/home/ann/vault/.claude/worktrees/brave-otter",
     '"tidy the docs" in vault'),
])
def test_label(title: str, opening: str, folder: str, expected: str) -> None:
    assert names.label(title, opening, folder) == expected


def test_opening_words_and_titles() -> None:
    assert names.opening_words("# Release plan\n\nShip the beta on Monday, then") == \
        "Release plan Ship the beta on Monday, then"
    assert names.opening_words("x" * 100) == "x" * names.OPENING_CHARS + "…"
    reply = Reply(Message("assistant", (text_part('{"title": "Ship the beta"}'),)), Usage())
    assert names.title(reply, structured=True) == "Ship the beta"
    for text, structured in (('{"name": "x"}', True), ("not json", True),
                             ("line one\nline two", False), ("w " * 60, False)):
        said = Reply(Message("assistant", (text_part(text),)), Usage())
        assert names.title(said, structured=structured) == "", text
