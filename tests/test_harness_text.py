"""Harness boilerplate is not memory: Claude Code's mid-conversation system message (its list
of agent types), reminders, IDE notes, skill text, task notices, interrupt markers and the
reminders it appends to tool results are stored with their messages (the history's fingerprints
still match) but get no retrieval row, and never reach a later frame or a recall tool's answer,
while a person's words in the same message are still found."""

from __future__ import annotations

import json
import time

from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.wire.conversation import Message, Reply, Usage, text_part
from tests.conftest import FIXTURES, needs_fixtures, opened
from tests.test_fixtures import replay, to_request
from tests.test_names import DEVICE, REMINDER, claude_code

AGENTS = ("Available agent types for the Agent tool:\n- claude: Catch-all for any task that"
          " doesn't fit a more specific agent.\n- Explore: Fast agent specialized for exploring"
          " codebases.\n- Plan: Software architect agent for designing implementation plans.")
IDE = ("<ide_opened_file>The user opened the file /home/ann/app/refunds.py in the IDE."
       "</ide_opened_file>")
SKILL = ("Base directory for this skill: /home/ann/.claude/skills/review\n\n# Review\nRead every"
         " changed file and report what an agent reviewer would flag.")
TASK = ("<task-notification>Background agent task finished with status completed."
        "</task-notification>")
INTERRUPT = "[Request interrupted by user for tool use]"
READ_REMINDER = ("<system-reminder>\nWhenever you read a file, you should consider whether it"
                 " would be considered malware.\n</system-reminder>")
SAID = ["the billing service double charges refunds for annual plans",
        "review the refund ledger migration before Friday",
        "skip that, the ledger rounding is the real bug"]
BOILERPLATE = ["Available agent types", "Catch-all for any task", "ide_opened_file",
               "Base directory for this skill", "task-notification", "Request interrupted",
               "system-reminder", "considered malware", "currentDate"]
QUESTION = ("which agent types are available for the Agent tool, what did the skill base"
            " directory say, which file was opened in the IDE, which background agent task"
            " finished, whenever you read a file is it malware, what is the current date")


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def session_one() -> list[list[dict]]:
    """Three requests of one Claude Code session, each the whole history so far."""
    first = [{"role": "user", "content": [text(REMINDER), text(IDE), text(SAID[0])]},
             {"role": "system", "content": AGENTS}]
    reply = [{"role": "assistant", "content": [text("Refunds reuse the charge id; fixing.")]}]
    second = first + reply + [{"role": "user", "content": [text(SKILL), text(TASK), text(SAID[1])]}]
    call = [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read",
                                               "input": {"file_path": "/home/ann/app/ledger.py"}}]}]
    third = second + call + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1",
         "content": "1 def post(entry):\n2     return round(entry.amount, 2)\n" + READ_REMINDER},
        text(INTERRUPT), text(SAID[2])]}]
    return [first, second, third]


TRUST_IDENTITY = True  # the captures name their device (the `pipeline` fixture, conftest)


def exchange(pipeline: Pipeline, request: dict, answer: str) -> str:
    """Prepare, store and answer one request; returns the text it went upstream with."""
    decision = pipeline.prepare(to_request(request))
    job = decision.job
    assert job is not None
    turn = pipeline.store_turn(job.pending)
    pipeline.store_reply(turn, Reply(Message("assistant", (text_part(answer),)), Usage()),
                         time.time(), job.pending)
    body = json.loads(decision.body or to_request(request).body)
    return "\n".join(str(b.get("text", "")) + str(b.get("content", ""))
                     for m in body["messages"] if isinstance(m["content"], list)
                     for b in m["content"])


def frame_of(pipeline: Pipeline, session: str, question: str, device: str = DEVICE) -> str:
    """The frame a new session's first question gets: everything before its own message."""
    request = claude_code(session, [{"role": "user", "content": [text(question)]}])
    request["body"]["metadata"]["user_id"] = json.dumps({"device_id": device,
                                                         "session_id": session})
    body = json.loads(pipeline.prepare(to_request(request)).body or b'{"messages": []}')
    return "\n".join(b["text"] for m in body["messages"][:-1] for b in m["content"])


def test_boilerplate_is_stored_but_never_retrieved(pipeline: Pipeline) -> None:
    session = "5e6f7081-0000-4000-8000-000000000005"
    for n, messages in enumerate(session_one()):
        exchange(pipeline, claude_code(session, messages), f"answer {n}")
    con = opened(pipeline.store.path)
    # Stored: every block the harness sent is an item of its message, as sent.
    stored = [t for (t,) in con.execute("SELECT text FROM item")]
    for block in (AGENTS, IDE, SKILL, TASK, INTERRUPT, REMINDER, *SAID):
        assert block in stored
    # Not indexed: no retrieval row quotes harness text; the person's words are all indexed.
    indexed = con.execute("SELECT i.kind, m.role, i.text FROM retrieval r JOIN item i"
                          " ON i.id = r.item_id JOIN message m ON m.id = r.message_id").fetchall()
    assert not [row for row in indexed if row[0] == "context" or row[1] == "system"]
    assert {t for _, role, t in indexed if role == "user"} >= set(SAID)
    con.close()

    # A later session asking in the boilerplate's own words gets none of it: not in its frame,
    # not in a recall tool's answer.
    quoted = frame_of(pipeline, "6f708192-0000-4000-8000-000000000006", QUESTION)
    uid = pipeline.store.find_user(DEVICE)
    memory = TurnMemory(uid, None, time.time())
    answers = [tools.run("memory_search", {"query": QUESTION, "limit": 50}, memory,
                         pipeline.scanner),
               tools.run("memory_count", {"category": "agent", "match": "any"}, memory,
                         pipeline.scanner)]
    for shown in (quoted, *answers):
        for words in BOILERPLATE:
            assert words not in shown, (words, shown)
    # The tool result is found, without the reminder Claude Code appended to it.
    assert "return round(entry.amount, 2)" in tools.run(
        "memory_search", {"query": "round entry amount"}, TurnMemory(uid, None, time.time()),
        pipeline.scanner)
    # And the person's words are what a question finds.
    for said in SAID:
        assert said in frame_of(pipeline, "708192a3-0000-4000-8000-000000000007", said)


def test_the_history_is_still_recognised_with_its_harness_text(pipeline: Pipeline) -> None:
    """Context parts keep their words in the fingerprint: a re-sent history is recognised and
    nothing is stored twice."""
    session = "8192a3b4-0000-4000-8000-000000000008"
    requests = session_one()
    for n, messages in enumerate(requests):
        exchange(pipeline, claude_code(session, messages), f"answer {n}")
    con = opened(pipeline.store.path)
    count = con.execute("SELECT count(*) FROM message").fetchone()
    exchange(pipeline, claude_code(session, requests[-1]), "answer again")
    assert con.execute("SELECT count(*) FROM message").fetchone()[0] == count[0] + 1  # the reply
    con.close()


@needs_fixtures
def test_real_captures_leave_no_harness_text_in_memory(pipeline: Pipeline) -> None:
    """Every Claude Code, Codex and opencode capture through the pipeline: the agent-type list
    Claude Code sends in every session, its reminders, Codex's environment context and
    opencode's prompts reach no retrieval row and no later frame."""
    for harness in ("claude-code", "codex", "opencode"):
        replay(pipeline, harness)
    con = opened(pipeline.store.path)
    harness_rows = con.execute(
        "SELECT count(*) FROM retrieval r JOIN item i ON i.id = r.item_id JOIN message m"
        " ON m.id = r.message_id WHERE i.kind = 'context' OR m.role = 'system'").fetchone()[0]
    system_items = con.execute("SELECT count(*) FROM item i JOIN message m ON m.id = i.message_id"
                               " WHERE m.role = 'system'").fetchone()[0]
    con.close()
    assert system_items > 0 and harness_rows == 0  # stored, never indexed
    capture_file = FIXTURES / "claude-code" / "02-basic-messages-stream.json"
    device = json.loads(json.loads(capture_file.read_text())["body"]["metadata"]["user_id"])[
        "device_id"]
    session = "9a3b4c5d-0000-4000-8000-000000000009"
    quoted = frame_of(pipeline, session, "Available agent types for the Agent tool: which agent"
                      " fits, what is the currentDate, which skills are available", device)
    for words in ("Available agent types", "Catch-all for any task", "system-reminder",
                  "environment_context", "skills are available"):
        assert words not in quoted
    assert "hello interactive" in frame_of(pipeline, session, "hello interactive", device)
