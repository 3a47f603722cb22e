"""`perpetuity replay claude-code` rebuilds a tool call whose result the session file never
recorded as Claude Code sent it (issue 41: one unanswered ExitPlanMode made 92 of a real
session's 319 calls skipped), and says why any call is still skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perpetuity_core.cli import replay
from perpetuity_core.cli.main import main
from perpetuity_core.cli.replay.sessions import MISSING_RESULT, read_session
from perpetuity_core.wire.protocols import anthropic
from tests.test_replay import SESSIONS, SID, Recorder, result, template_file, tool_use


def plan_session() -> Recorder:
    r = Recorder()
    r.user("Plan the refactor of the date parser")
    r.assistant("msg_1", {"type": "text", "text": "Here is the plan."})
    plan = r.assistant("msg_1", {"type": "tool_use", "id": "plan_1", "name": "ExitPlanMode",
                                 "input": {"plan": "1. split parse_when"}})
    r.user("Go ahead, but keep the public API", parent=plan)  # no result was ever recorded
    r.assistant("msg_2", tool_use("t1", "src/dates/parse_util.py"))
    r.user(result("t1", "def parse_when(text): ..."))
    r.user(result("t0", "a result answering no call"))
    r.assistant("msg_3", {"type": "text", "text": "Split it; the API is unchanged."})
    r.user("Thanks")
    r.assistant("msg_4", {"type": "text", "text": "You're welcome."})
    return r


def test_an_unanswered_call_is_answered_as_claude_code_does(tmp_path: Path) -> None:
    calls = read_session(plan_session().write(tmp_path / "s.jsonl")).calls
    assert len(calls) == 4
    assert all(anthropic.check({"messages": c.messages}) == [] for c in calls)
    answered = calls[1].messages[2]["content"]
    assert answered[0] == {"type": "tool_result", "tool_use_id": "plan_1",
                           "content": MISSING_RESULT, "is_error": True}
    assert answered[1] == {"type": "text", "text": "Go ahead, but keep the public API"}
    # the result answering no call of the reply before it is not sent
    assert [b["tool_use_id"] for b in calls[2].messages[4]["content"]] == ["t1"]


def test_a_call_still_skipped_is_reported_with_its_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = plan_session()
    r.assistant("msg_5", {"type": "thinking", "thinking": "Hm."})  # no signature: refused
    r.assistant("msg_5", {"type": "text", "text": "Anything else?"})
    r.user("No")
    r.assistant("msg_6", {"type": "text", "text": "Bye."})
    r.write(tmp_path / "projects" / "s.jsonl")
    assert main(["replay", "claude-code", str(tmp_path / "projects"), "--json",
                 "--request-template", str(template_file(tmp_path / "t.json"))]) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    assert (total["calls"], total["skipped_invalid_calls"]) == (5, 1)
    (reason,) = total["skipped_reasons"]
    assert reason.startswith(f"{SID} call 6: ") and "signature" in reason


@pytest.mark.skipif(not SESSIONS.is_dir(), reason=f"Claude Code sessions not at {SESSIONS}")
def test_the_shared_sessions_skip_no_call() -> None:
    """Three of them hold ExitPlanMode calls (answered in the file)."""
    for path in sorted(SESSIONS.glob("*.jsonl")):
        calls = read_session(path).calls
        assert calls and [i for i, c in enumerate(calls)
                          if anthropic.check({"messages": c.messages})] == [], path.name
    report = replay.claude_code(sorted(SESSIONS.glob("*.jsonl"))[:1], calls=5)
    assert report.total.skipped_calls == 0 and report.total.as_dict()["skipped_reasons"] == []
