"""`perpetuity replay`: Claude Code sessions rebuilt call by call, billed under the cache rules."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from perpetuity_core.cli import replay
from perpetuity_core.cli.main import main
from perpetuity_core.cli.replay import drive
from perpetuity_core.cli.replay.drive import proxy_shape
from perpetuity_core.cli.replay.measure import (
    Tally,
    identifiers,
    older_names,
    parts_text,
    with_context,
)
from perpetuity_core.cli.replay.report import LEGEND, saving, table
from perpetuity_core.cli.replay.request import (
    DEFAULT_TEMPLATE,
    STAND_IN_SOURCE,
    STAND_IN_SYSTEM,
    STAND_IN_TOOLS,
    build,
    load_template,
    stand_in,
)
from perpetuity_core.cli.replay.sessions import read_session
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.billing import (
    AnthropicCache,
    Bill,
    GeminiCache,
    OpenAICache,
    anthropic_blocks,
    anthropic_min_tokens,
    gemini_blocks,
)
from perpetuity_core.frame.blocks import (
    Block,
    Blocks,
    anthropic_groups,
    gemini_groups,
    openai_groups,
)
from perpetuity_core.frame.prices import Price, dollars, list_price
from perpetuity_core.wire.protocols import anthropic
from tests.conftest import FIXTURES, SHARED, Proxy, needs_fixtures, opened, owned, query
from tests.fake_provider import FakeProvider, Text
from tests.test_evaluate import tiny_locomo

SESSIONS = SHARED / "data" / "claude-code"
SID = "5e55104e-0000-4000-8000-000000000001"

# --------------------------------------------------------------------------- a session file


class Recorder:
    """Writes a session file the way Claude Code does: one line per content block."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0
        self.last = ""

    def _base(self, kind: str, parent: str | None = None, **flags: Any) -> dict[str, Any]:
        self.n += 1
        uuid = f"u{self.n}"
        record = {"type": kind, "uuid": uuid, "parentUuid": self.last if parent is None else parent,
                  "sessionId": SID, "version": "2.1.90", "cwd": "/home/dev/proj",
                  "timestamp": f"2026-03-01T10:{self.n // 60:02d}:{self.n % 60:02d}.000Z", **flags}
        self.last = uuid
        return record

    def user(self, content: Any, parent: str | None = None, **flags: Any) -> str:
        r = self._base("user", parent, **flags)
        r["message"] = {"role": "user", "content": content}
        self.lines.append(json.dumps(r))
        return r["uuid"]

    def assistant(self, mid: str, block: dict[str, Any], model: str = "claude-sonnet-4-6",
                  **flags: Any) -> str:
        r = self._base("assistant", **flags)
        r["message"] = {"id": mid, "role": "assistant", "model": model, "content": [block]}
        self.lines.append(json.dumps(r))
        return r["uuid"]

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.lines) + "\n")
        return path


def tool_use(call_id: str, path: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": "Read", "input": {"file_path": path}}


def result(call_id: str, text: str, error: bool = False) -> list[dict[str, Any]]:
    return [{"type": "tool_result", "tool_use_id": call_id, "content": text, "is_error": error}]


def coding_session() -> Recorder:
    r = Recorder()
    r.user("Fix the bug in the date parser, please")
    r.assistant("msg_1", {"type": "thinking", "thinking": "Look first.", "signature": "sig-1"})
    r.assistant("msg_1", tool_use("t1", "src/dates/parse_util.py"))
    r.user(result("t1", "def parse_when(text): ..."))
    r.assistant("msg_1", tool_use("t2", "tests/test_dates.py"))  # parallel: results interleave
    r.user(result("t2", "def test_parse_when(): ..."))
    r.assistant("msg_2", {"type": "text", "text": "Fixed parse_when in src/dates/parse_util.py."})
    r.user([{"type": "text", "text": "Skill: how to write tests."}], isMeta=True)
    r.user([{"type": "text", "text": "Now run the test suite"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}])
    r.assistant("msg_3", {"type": "tool_use", "id": "t3", "name": "Bash",
                          "input": {"command": "pytest -q"}})
    r.user(result("t3", "The user doesn't want to proceed with this tool use.", error=True))
    r.user([{"type": "text", "text": "[Request interrupted by user for tool use]"}])
    r.user("Use make test instead")
    r.assistant("msg_x", {"type": "text", "text": "API Error: rate limited"}, model="<synthetic>")
    r.assistant("msg_side", {"type": "text", "text": "subagent work"}, isSidechain=True)
    r.assistant("msg_4", {"type": "text", "text": "Running make test."})
    r.user("This session is being continued from a previous conversation. Summary: parse_when.",
           isCompactSummary=True)
    r.user("What did we change?")
    r.assistant("msg_5", {"type": "text", "text": "We changed parse_when."})
    r.lines.append("{not json")
    return r


# --------------------------------------------------------------------------- reconstruction


def test_calls_rebuilt_as_claude_code_sent_them(tmp_path: Path) -> None:
    s = read_session(coding_session().write(tmp_path / "s.jsonl"))
    assert s.id == SID and s.version == "2.1.90" and s.skipped_lines == 1
    assert [len(c.messages) for c in s.calls] == [1, 3, 5, 7, 1]  # synthetic, sidechain: none
    first, second, third, fourth, fifth = s.calls
    # parallel calls: one reply of three blocks (the thinking keeps its signature), one message
    # of results
    assert [b["type"] for b in first.reply] == ["thinking", "tool_use", "tool_use"]
    assert second.messages[1]["content"][0]["signature"] == "sig-1"
    assert [b["tool_use_id"] for b in second.messages[2]["content"]] == ["t1", "t2"]
    # meta text and the prompt after it are one message; the prompt starts the live task
    assert [b["type"] for b in third.messages[4]["content"]] == ["text", "text", "image"]
    assert third.live_from == 4 and third.starts_task and not second.starts_task
    # the interrupted call: its result, the marker and the next prompt in one message, result first
    assert [b.get("text", b["type"]) for b in fourth.messages[6]["content"]] == [
        "tool_result", "[Request interrupted by user for tool use]", "Use make test instead"]
    assert fourth.live_from == 6
    # compaction starts afresh: the summary (not a prompt) and the next prompt
    assert fifth.messages[0]["content"][0]["text"].startswith("This session is being continued")
    assert fifth.live_from == 0 and fifth.starts_task
    assert s.prompts == 4
    assert all(anthropic.check({"messages": c.messages}) == [] for c in s.calls)


def test_a_stopped_tool_call_is_not_in_later_requests(tmp_path: Path) -> None:
    r = Recorder()
    r.user("Comment on the ticket, then edit GEMINI.md")
    said = r.assistant("msg_1", {"type": "text", "text": "Commenting first."})
    r.assistant("msg_1", tool_use("t1", "GEMINI.md"))
    r.user("PING", parent=said)  # the person stopped the call: the chain goes on from the text
    r.assistant("msg_2", {"type": "text", "text": "Here."})
    r.assistant("msg_2", {"type": "text", "text": "Anything else?"})
    r.user("Yes", parent=said)  # a line of an older reply: the reply before it stays whole
    r.assistant("msg_3", {"type": "text", "text": "Go on."})
    first, second, third = read_session(r.write(tmp_path / "s.jsonl")).calls
    assert [b["type"] for b in first.reply] == ["text", "tool_use"]  # the reply as recorded
    assert [b["type"] for b in second.messages[1]["content"]] == ["text"]  # as sent after
    assert len(third.messages[3]["content"]) == 2
    assert anthropic.check({"messages": second.messages}) == []


def template_file(path: Path) -> Path:
    body = {"model": "claude-sonnet-4-6", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                       {"type": "text", "text": "You are Claude Code. " * 400,
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Read", "description": "Read a file. " * 200,
                       "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Today is 2026-03-01.</system-reminder>"},
                {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Available agent types: general-purpose"}]}
    path.write_text(json.dumps({"headers": [["anthropic-beta", "claude-code-20250219"],
                                            ["x-api-key", "REDACTED"]], "body": body}))
    return path


def test_request_as_claude_code_sends_it(tmp_path: Path) -> None:
    session = read_session(coding_session().write(tmp_path / "s.jsonl"))
    shape = load_template(template_file(tmp_path / "t.json"))
    built = build(session.calls[2], shape, session)
    messages = built.body["messages"]
    assert messages[0]["content"][0]["text"].startswith("<system-reminder>")  # the preamble
    assert messages[1] == {"role": "system", "content": "Available agent types: general-purpose"}
    assert built.live_from == 5 and messages[5]["content"][-1]["cache_control"]  # marked last
    assert json.dumps(built.body).count("cache_control") == 2  # system block + last block
    assert session.calls[2].messages[-1]["content"][-1].get("cache_control") is None  # a copy
    headers = dict(built.headers)
    assert headers["x-claude-code-session-id"] == SID and "x-api-key" in headers
    assert headers["user-agent"].startswith("claude-cli/2.1.90")
    assert json.loads(built.body["metadata"]["user_id"])["session_id"] == SID
    assert anthropic.check(built.body) == []


def test_without_a_capture_stand_ins_of_its_size_take_its_place(tmp_path: Path) -> None:
    session = read_session(coding_session().write(tmp_path / "s.jsonl"))
    shape = load_template(None, default=tmp_path / "absent.json")
    assert shape.source == STAND_IN_SOURCE
    assert [len(b["text"]) for b in shape.system] == list(STAND_IN_SYSTEM)
    assert [len(json.dumps(t)) for t in shape.tools] == list(STAND_IN_TOOLS)
    body = build(session.calls[3], shape, session).body
    assert anthropic.check(body) == []
    assert body["messages"][0]["content"][0]["text"].startswith("<system-reminder>")
    assert json.dumps(body).count("cache_control") == 3  # two system blocks + the last block
    with pytest.raises(ConfigError):
        load_template(tmp_path / "s.jsonl")  # not a captured request


def test_the_replay_takes_the_request_claude_code_last_sent_through_the_proxy(
        proxy: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    capture = json.loads(template_file(tmp_path / "t.json").read_text())
    body = {**capture["body"], "metadata": {"user_id": json.dumps({"device_id": "d" * 64})}}
    headers = {"x-api-key": "sk-ant-kept-secret", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219", "user-agent": "claude-cli/2.1.90",
               "content-type": "application/json"}
    assert proxy_shape(proxy.db) is None  # nothing kept yet
    for tools in (body["tools"][:0], body["tools"]):  # the later request's shape is kept
        fake.script(Text("Hi."))
        r = owned(httpx.Client(timeout=30)).post(f"{proxy.url}/v1/messages?beta=true",
                                                 json={**body, "tools": tools}, headers=headers)
        assert r.status_code == 200, r.text
        fake.wait_requests(1)
        fake.clear()
    deadline = time.monotonic() + 10
    while (kept := proxy_shape(proxy.db)) is None or not kept[0]["body"]["tools"]:
        assert time.monotonic() < deadline, "the proxy kept no request shape"
        time.sleep(0.05)
    stored = json.dumps(query(proxy.db, "select key, value from setting"))
    assert "sk-ant-kept-secret" not in stored and "d" * 64 not in stored  # no credential, no ids
    assert "hello" not in stored  # the person's words are memory's, not the shape's
    shape = load_template(None, default=tmp_path / "absent.json", kept=kept)
    assert str(proxy.db) in shape.source
    assert shape.system == body["system"] and shape.tools == body["tools"]
    assert shape.preamble == [body["messages"][0]["content"][0]]
    assert shape.extra == [body["messages"][1]]
    assert ("anthropic-beta", "claude-code-20250219") in shape.headers
    session = read_session(coding_session().write(tmp_path / "s.jsonl"))
    built = build(session.calls[2], shape, session)
    assert built.body["tools"] == body["tools"] and anthropic.check(built.body) == []
    # The repository's capture, where there is one, still comes first; a file given, first of all.
    assert load_template(None, default=tmp_path / "t.json", kept=kept).source.endswith("t.json")


def test_identifiers_are_code_names_not_words() -> None:
    found = identifiers("Edit src/app/main.py: call parse_when and HttpRequest, not Parser; "
                        "store.find_user too, and/or Mind/Body in ~/notes/todo and lib/a/b. "
                        "The quick brown fox.")
    assert found == {"src/app/main.py", "parse_when", "HttpRequest", "store.find_user",
                     "~/notes/todo", "lib/a/b"}


def test_a_tool_calls_escapes_make_no_names() -> None:
    """A tool call's arguments are read as JSON: the word after an escaped line break is a
    word, as it was in the command, not a camel-case name ("nEOF", "nRead")."""
    call = json.dumps({"command": "cat <<'EOF'\nEOF\nRead src/app/main.py\tparse_when"})
    assert identifiers(call) == {"src/app/main.py", "parse_when"}


def test_a_hyphenated_file_name_is_one_name() -> None:
    """A file named in kebab-case is that file, not the tail after its last hyphen: "pr.yml"
    of "auto-pr.yml" would find its latest mention in "linear-pr.yml", another file."""
    assert identifiers("Edit auto-pr.yml, then docker-compose.yml; a well-known fix.") == {
        "auto-pr.yml", "docker-compose.yml"}


def test_the_tool_a_reply_calls_is_not_a_name_taken_from_history() -> None:
    """A model calls only the tools its request defines: the name of the tool a reply calls is
    the harness's text, though the replay's template lacks the session's own tools (an MCP
    server's). Its arguments still count."""
    tool = "mcp__linear__get_issue"
    messages = [
        {"role": "user", "content": "Find the Linear tools and src/app/main.py."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": f"select:{tool}"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": f"{tool} loaded"}]},
        {"role": "user", "content": "Now read LAF-7."},
    ]
    reply = [{"type": "text", "text": "Reading it."},
             {"type": "tool_use", "id": "t2", "name": tool,
              "input": {"id": "LAF-7", "path": "src/app/main.py"}}]
    assert older_names(reply, messages, 3, set()) == {"src/app/main.py"}


def test_the_arguments_names_of_a_tool_call_are_not_names_taken_from_history() -> None:
    """The names of a tool call's arguments are its tool's schema's ("planFilePath" of a newer
    ExitPlanMode than the template's), though history named them too; their values count."""
    messages = [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ExitPlanMode",
                                           "input": {"planFilePath": "plans/quiet-fox.md"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "rejected"}]},
        {"role": "user", "content": "Shorter, please."},
    ]
    reply = [{"type": "tool_use", "id": "t2", "name": "ExitPlanMode",
              "input": {"plan": "Two steps.", "planFilePath": "plans/quiet-fox.md"}}]
    assert older_names(reply, messages, 2, set()) == {"plans/quiet-fox.md"}


def test_a_name_counts_in_context_only_with_the_text_around_its_latest_mention() -> None:
    older = parts_text([
        {"role": "user", "content": "Look at src/app/main.py first."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Edit",
                                           "input": {"path": "src/app/main.py", "old": "x = 1"}}]},
    ])
    latest = older[-1]  # the tool call as stored: its arguments' keys sorted
    assert latest == '{"old": "x = 1", "path": "src/app/main.py"}'
    names = {"src/app/main.py"}
    assert with_context(names, older, "Memory: Edit " + latest) == 1
    assert with_context(names, older, "src/app/main.py, parse_when") == 0  # a bare list of names
    assert with_context(names, older, "Look at src/app/main.py first.") == 0  # an older mention
    assert with_context({"absent_name"}, older, latest) == 0


# --------------------------------------------------------------------------- billing


def blocks(*spec: tuple[str, int, float]) -> list[Block]:
    """Blocks whose keys are the prefix so far: ("a", 1500, 300) is a 1,500-token marked block."""
    out, prefix = [], ""
    for key, tokens, ttl in spec:
        prefix += key + "|"
        out.append(Block(prefix.encode(), tokens, ttl))
    return out


def test_anthropic_writes_at_marks_and_reads_within_their_lifetime() -> None:
    cache = AnthropicCache()
    first = cache.bill_blocks(blocks(("a", 1500, 300), ("b", 100, 0)), 0, "claude-sonnet-4-5")
    assert (first.written, first.uncached, first.cost) == (1500, 100, 1500 * 1.25 + 100)
    second = cache.bill_blocks(blocks(("a", 1500, 0), ("b", 600, 300)), 100, "claude-sonnet-4-5")
    assert (second.read, second.written, second.cost) == (1500, 600, 150 + 750)
    # 5 minutes from last use: read at 100, gone after 400
    late = cache.bill_blocks(blocks(("a", 1500, 0), ("b", 600, 300)), 401, "claude-sonnet-4-5")
    assert (late.read, late.written) == (0, 2100)
    hour = AnthropicCache()
    assert hour.bill_blocks(blocks(("a", 2000, 3600)), 0, "claude-sonnet-4-5").cost == 4000
    assert hour.bill_blocks(blocks(("a", 2000, 3600)), 1800, "claude-sonnet-4-5").cost == 200


def test_anthropic_minimum_by_model_family() -> None:
    assert anthropic_min_tokens("claude-opus-4-6") == 4096
    assert anthropic_min_tokens("claude-haiku-4-5-20251001") == 4096
    assert anthropic_min_tokens("claude-3-5-haiku-20241022") == 2048
    assert anthropic_min_tokens("claude-sonnet-4-5-20250929") == 1024
    cache = AnthropicCache()
    for at in (0, 10):  # under Opus 4.6's 4,096 tokens nothing is cached: full price each time
        bill = cache.bill_blocks(blocks(("a", 3000, 300)), at, "claude-opus-4-6")
        assert (bill.read, bill.written, bill.cost) == (0, 0, 3000)


def test_anthropic_lookback_is_twenty_blocks() -> None:
    def grown(n: int) -> list[Block]:
        return blocks(("a", 1100, 0), *[(f"x{i}", 10, 300 if i == n - 1 else 0)
                                        for i in range(n)])

    near, far = AnthropicCache(), AnthropicCache()
    for cache in (near, far):
        cache.bill_blocks(blocks(("a", 1100, 300)), 0, "claude-sonnet-4-5")
    hit = near.bill_blocks(grown(20), 60, "claude-sonnet-4-5")  # the mark 20 blocks after
    assert (hit.read, hit.written) == (1100, 200)
    miss = far.bill_blocks(grown(21), 60, "claude-sonnet-4-5")  # 21 blocks after: not found
    assert (miss.read, miss.written) == (0, 1310)


def test_anthropic_prefix_is_tools_system_messages() -> None:
    mark = {"type": "ephemeral"}
    body = {"model": "claude-sonnet-4-5",
            "tools": [{"name": "Read", "description": "r " * 3000, "input_schema": {}}],
            "system": [{"type": "text", "text": "s " * 2000, "cache_control": mark}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "q " * 400, "cache_control": mark}]}]}
    cache = AnthropicCache()
    cache.bill(body, 0)
    other_question = {**body, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "w " * 400, "cache_control": mark}]}]}
    bill = cache.bill(other_question, 30)  # tools and system read, the new question written
    assert bill.read == sum(b.tokens for b in anthropic_blocks(body)[:2]) and bill.written == 200
    other_tool = {**body, "tools": [{"name": "Read", "description": "x " * 3000,
                                     "input_schema": {}}]}
    assert cache.bill(other_tool, 40).read == 0  # a changed tool changes every prefix after it


def test_openai_prefix_cache() -> None:
    cache = OpenAICache()
    assert cache.bill_blocks(blocks(("a", 1500, 0), ("b", 500, 0)), 0, "gpt-4o").cost == 2000
    bill = cache.bill_blocks(blocks(("a", 1500, 0), ("b", 500, 0), ("c", 300, 0)), 60, "gpt-4o")
    assert bill.read == 1024 + 896 and bill.cost == 1920 * 0.5 + 380  # 128-token steps
    gpt5 = cache.bill_blocks(blocks(("a", 1500, 0)), 120, "gpt-5")
    assert gpt5.read == 1024 + 384 and gpt5.cost == pytest.approx(1408 * 0.1 + 92)
    small = OpenAICache()
    small.bill_blocks(blocks(("a", 900, 0)), 0, "gpt-4o")
    assert small.bill_blocks(blocks(("a", 900, 0)), 1, "gpt-4o").read == 0  # under 1,024


def test_gemini_implicit_cache_reads_to_the_token_from_its_minimum() -> None:
    cache = GeminiCache()
    assert cache.bill_blocks(blocks(("a", 4000, 0), ("b", 500, 0)), 0, "gemini-3.8-flash").cost == 4500
    bill = cache.bill_blocks(blocks(("a", 4000, 0), ("b", 500, 0), ("c", 300, 0)), 60,
                             "gemini-3.8-flash")
    assert bill.read == 4500 and bill.cost == pytest.approx(4500 * 0.1 + 300)  # no steps
    small = GeminiCache()
    small.bill_blocks(blocks(("a", 3000, 0)), 0, "gemini-3.1-pro-preview")
    assert small.bill_blocks(blocks(("a", 3000, 0)), 1, "gemini-3.1-pro-preview").read == 0
    assert small.bill_blocks(blocks(("a", 3000, 0)), 2, "gemini-2.5-pro").read == 0  # not cached
    assert small.bill_blocks(blocks(("a", 3000, 0)), 3, "gemini-2.5-pro").read == 3000  # 2,048
    assert GeminiCache().bill_blocks(blocks(("a", 9000, 0)), 0, "gemini-2.0-flash").read == 0
    expired = GeminiCache()
    expired.bill_blocks(blocks(("a", 5000, 0)), 0, "gemini-3-flash")
    assert expired.bill_blocks(blocks(("a", 5000, 0)), 301, "gemini-3-flash").read == 0


def test_gemini_blocks_read_the_code_assist_envelope() -> None:
    request = {"systemInstruction": {"parts": [{"text": "s " * 50}]},
               "contents": [{"role": "user", "parts": [{"text": "q " * 40}]}]}
    direct = gemini_blocks(request)
    assert [b.tokens for b in direct] == [b.tokens for b in gemini_blocks(
        {"model": "gemini-2.5-pro", "project": "p", "request": request})]
    assert len(direct) == 2 and direct[1].tokens > 0


# --------------------------------------------------------------------------- end to end


def test_replay_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    coding_session().write(tmp_path / "projects" / "-home-dev-proj" / f"{SID}.jsonl")
    db, png = tmp_path / "memory.db", tmp_path / "cost.png"
    assert main(["replay", "claude-code", str(tmp_path / "projects"), "--db", str(db), "--json",
                 "--plot", str(png), "--request-template",
                 str(template_file(tmp_path / "t.json"))]) == 0
    out = json.loads(capsys.readouterr().out)
    total = out["total"]
    assert (total["calls"], total["prompts"], total["skipped_lines"]) == (5, 4, 1)
    assert total["invalid_requests"] == 0 and total["skipped_invalid_calls"] == 0
    assert total["cost"]["direct"] > 0 and total["tokens"]["direct"] > 0
    assert total["live_task_identical"] == 1.0
    assert png.stat().st_size > 0
    with opened(db) as conn:  # the memory holds the conversation
        assert conn.execute("select count(*) from message").fetchone()[0] >= 9
    assert main(["replay", "claude-code", str(tmp_path / "projects"), "--db", str(db)]) == 1
    assert main(["replay", "claude-code", str(tmp_path / "nowhere")]) == 1
    assert main(["replay", "claude-code", str(tmp_path / "projects"), "--calls", "2",
                 "--request-template", str(tmp_path / "t.json")]) == 0
    printed = capsys.readouterr().out
    assert "total" in printed and "floor" in printed and "of direct" in printed


def test_the_cost_above_the_floor_is_split_by_what_each_call_did(tmp_path: Path) -> None:
    coding_session().write(tmp_path / f"{SID}.jsonl")
    report = replay.claude_code([tmp_path / f"{SID}.jsonl"],
                                template=template_file(tmp_path / "t.json"))
    t = report.total
    # The floor is each call's system prompt, tools and live task billed alone: never above
    # what went upstream, and the causes add up to the rest.
    assert 0 < t.floor.cost <= t.upstream.cost
    assert sum(t.above.values()) == pytest.approx(t.upstream.cost - t.floor.cost)
    assert set(t.above) <= {"first_frame", "rebuild", "rebuild_expired", "addendum",
                            "prompt_kept", "tool_round"} and "rebuild" in t.above
    out = t.as_dict()
    assert out["floor"]["ratio"] == round(t.floor.cost / t.direct.cost, 4)
    assert set(out["above_floor"]) == set(t.above)
    assert "floor" not in replay.chat_locomo(tiny_locomo(tmp_path / "l.json")).total.as_dict()


def test_chat_replay(tmp_path: Path) -> None:
    report = replay.chat_locomo(tiny_locomo(tmp_path / "locomo.json"))
    total = report.total
    assert total.calls == 2 and total.invalid == 0
    assert total.direct.tokens > 0 and total.upstream.tokens > 0


@pytest.mark.skipif(not SESSIONS.is_dir(), reason=f"Claude Code sessions not at {SESSIONS}")
def test_real_session(tmp_path: Path) -> None:
    path = min(SESSIONS.glob("*.jsonl"))
    report = replay.claude_code([path], calls=20)
    s = report.sessions[0].as_dict()
    assert s["calls"] == 20 and s["skipped_invalid_calls"] == 0 and s["skipped_lines"] == 0
    assert s["cost"]["direct"] > 0 and s["cost"]["ratio"] is not None
    assert 0 < s["direct"]["read_tokens"] < s["tokens"]["direct"]  # the cache works direct


@needs_fixtures
def test_the_default_template_is_shareds_claude_code_capture() -> None:
    # A path computed from this package's place in the checkout: moving the module must not
    # silently fall back to the short built-in prompt (the replay's figures depend on it).
    assert DEFAULT_TEMPLATE == FIXTURES / "claude-code" / "02-basic-messages-stream.json"
    assert DEFAULT_TEMPLATE.is_file()


# --------------------------------------------------------------------------- in plain words


def test_the_saving_is_said_in_money_first_and_stand_ins_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coding_session().write(tmp_path / f"{SID}.jsonl")
    report = replay.claude_code([tmp_path / f"{SID}.jsonl"],
                                template=template_file(tmp_path / "t.json"))
    out = report.as_dict()
    t = out["total"]
    # Every call is claude-sonnet-4-6, $3 per million uncached input tokens.
    assert t["money"]["direct_usd"] == round(report.total.direct.cost * 3 / 1e6, 2) > 0
    assert t["money"]["saved"] == round(1 - report.total.upstream_usd / report.total.direct_usd, 4)
    lines = table(out).splitlines()
    assert lines[0] == (f"${t['money']['direct_usd']:,.2f} direct, ${t['money']['upstream_usd']:,.2f}"
                        f" through Perpetuity, {t['money']['saved']:.0%} less (5 calls, input at"
                        " each model's list price, prompt cache included)")
    head = next(line for line in lines if line.startswith("session"))
    for column in ("calls", "prompts", "$ direct", "$ Perpetuity", "less", "tokens", "refused",
                   "skipped", "older kept", "+context", "live same"):  # each column explained
        assert column in head and any(f"{column}:" in line or f"{column}," in line
                                      for line in LEGEND), column
    monkeypatch.setattr(drive, "load_template", lambda template, kept=None: stand_in())
    guessed = replay.claude_code([tmp_path / f"{SID}.jsonl"]).as_dict()
    assert guessed["stand_ins"] and table(guessed).splitlines()[0] == (
        f"Stand-in prompts: {STAND_IN_SOURCE}; the figures are a guess.")


def test_a_model_is_priced_by_its_family_never_by_a_version_the_list_does_not_know() -> None:
    assert list_price("claude-haiku-4-5-20251001") == Price(1.0)
    assert list_price("claude-opus-4-20250514") == Price(15.0)  # a date: Opus 4
    assert list_price("claude-opus-4-6") == Price(5.0)
    assert list_price("claude-opus-4-9") is None  # a version: not Opus 4's price
    assert list_price("gpt-5-codex") == Price(1.25) and list_price("gpt-5.6-sol") is None
    assert list_price("models/gemini-2.5-flash-lite") == Price(0.1)
    bill = Bill(tokens=3000, read=1000, written=1000, uncached=1000, read_cost=100.0,
                write_cost=1250.0, uncached_cost=1000.0)
    assert dollars(bill, Price(3.0)) == pytest.approx(2350 * 3 / 1e6)
    # A model whose cache hits are priced apart: the hit at its own price.
    assert dollars(bill, Price(2.0, 0.1)) == pytest.approx(2250 * 2 / 1e6 + 1000 * 0.1 / 1e6)
    tally = Tally("t")
    tally.add(bill, bill, [], True, set(), "", False, model="gpt-6.2-sol")
    assert tally.as_dict()["money"]["unpriced_models"] == ["gpt-6.2-sol"]
    assert "no list price for gpt-6.2-sol" in saving(tally.as_dict())


def test_blocks_made_once_are_the_blocks_made_anew() -> None:
    """A body's blocks from the memo (the last bodies' shared start, then each unit by prefix,
    place and id) are those made from scratch, call after call: a history that grows with the
    same objects, a mark that moves, a message changed in the middle, a tool added, another
    conversation between, the same object at another place."""
    memo = Blocks()
    tools = [{"name": "Read", "description": "r " * 50, "input_schema": {}}]
    system = [{"type": "text", "text": "s " * 300, "cache_control": {"type": "ephemeral"}}]
    history: list[dict[str, Any]] = []
    other = [{"role": "user", "content": "another conversation"}]
    for n in range(40):
        history.append({"role": "user" if n % 2 == 0 else "assistant",
                        "content": [{"type": "text", "text": f"turn {n} " * (n + 1)}]})
        marked = [*history[:-1], {**history[-1], "content": [
            {**history[-1]["content"][0], "cache_control": {"type": "ephemeral"}}]}]
        if n == 20:
            history[5] = {"role": history[5]["role"], "content": "changed in the middle"}
        if n == 30:
            tools = [*tools, {"name": "Write", "description": "w", "input_schema": {}}]
        for body in ({"tools": tools, "system": system, "messages": marked},
                     {"tools": tools, "system": system, "messages": other + history[:3]},
                     {"tools": tools, "system": system, "messages": history[1:]}):
            for groups in (anthropic_groups(body), openai_groups(
                    {"tools": tools, "messages": body["messages"]}), gemini_groups(
                    {"contents": body["messages"]})):
                got, fresh = memo.chain(groups), Blocks().chain(groups)
                assert (got.blocks, got.ends, got.marks) == (fresh.blocks, fresh.ends,
                                                             fresh.marks)
