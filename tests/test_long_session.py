"""A session that never ends (issue 22): every upstream request within the bound, rebuilt
mid-task when it is about to pass it, the live task's oldest tool results sent as stubs that
memory_more gives back, real sessions chained past a million tokens, and count_tokens answered
for the request as it would go upstream."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic as anthropic_sdk
import pytest
from hypothesis import given
from hypothesis import strategies as st

from perpetuity_core.cli import replay
from perpetuity_core.cli.replay.sessions import chained, read_session
from perpetuity_core.frame import build as frame
from perpetuity_core.frame import plan
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve import reading
from perpetuity_core.wire.conversation import Kind, Message, Part
from perpetuity_core.wire.protocols import anthropic
from tests.conftest import SHARED, Proxy, owned
from tests.fake_provider import FakeProvider, Text
from tests.test_plan import T0, TALK, Session, _plan
from tests.test_replay import Recorder

SESSIONS = SHARED / "data" / "claude-code"
BOUND = Cap(floor=100, ceiling=300, bound=4_000)


def _tokens(messages: list[dict[str, Any]]) -> int:
    """An upstream request's tokens as the plan counts them (these carry no system or tools)."""
    return messages_tokens(anthropic.parse_request({"messages": messages}).messages)


# --------------------------------------------------------------------------- the decision


def _result(call_id: str, tokens: int) -> Message:
    return Message("user", (Part(Kind.TOOL_RESULT, "r" * tokens * 4, call_id=call_id),))


def _call(call_id: str) -> Message:
    return Message("assistant", (Part(Kind.TOOL_CALL, "{}", name="Read", call_id=call_id),))


# A prompt (message 4 of TALK) and a long task after it: twelve rounds of 500-token results.
TASK = [*TALK[:5], *(m for n in range(12) for m in (_call(f"t{n}"), _result(f"t{n}", 500)))]


@pytest.mark.parametrize(("case", "old", "talk", "bound", "expected"), [
    ("a tool round within the bound", _plan(anchor=2, prompt=4, talk=TASK[:9]), TASK[:9],
     10_000, plan.Carry),
    ("a tool round about to pass it, turns before the task to drop",
     _plan(anchor=0, prompt=4, talk=TASK), TASK, 6_000, plan.Rebuild),
    ("a tool round about to pass it, nothing before the task to drop",
     _plan(anchor=4, prompt=4, talk=TASK), TASK, 6_000, plan.Trim),
    ("the system prompt and tools count", _plan(anchor=4, prompt=4, talk=TASK), TASK,
     6_600, plan.Trim),
])
def test_decide_at_the_bound(case: str, old: plan.Plan, talk: list[Message], bound: int,
                             expected: type) -> None:
    fixed = 1_000 if "system" in case else 0
    got = plan.decide(old, talk, 4, T0 + 10, replace(BOUND, ceiling=1_000, bound=bound), fixed)
    assert type(got) is expected, case


def test_a_trim_stubs_the_oldest_results_never_the_prompt_or_the_last_rounds() -> None:
    old = _plan(anchor=4, prompt=4, talk=TASK)
    stubs = {f"t{n}": f"[stub {n}]" for n in range(12)}
    limits = Cap(floor=100, ceiling=1_000, bound=4_000)
    size = plan.size(old, TASK, 4, 0)
    assert size > limits.bound
    got = plan.trimmed(old, TASK, 4, 4, 0, limits, stubs)
    ids = [c for c, _ in got.stubs]
    assert ids == [f"t{n}" for n in range(len(ids))]  # oldest first
    assert plan.size(got, TASK, 4, 0) <= limits.bound - limits.bound // plan.HEADROOM
    assert not {f"t{n}" for n in range(12 - plan.LAST_ROUNDS, 12)} & set(ids)
    assert plan.trimmed(got, TASK, 4, 4, 0, limits, stubs) == got  # within: nothing more
    # Only what may go as a stub (stored) is stubbed; the rest stays as sent.
    assert {c for c, _ in plan.trimmed(old, TASK, 4, 4, 0, limits, {"t3": "[s]"}).stubs} == {"t3"}


# --------------------------------------------------------------------------- through a pipeline


class _Long(Session):
    def _reply(self) -> Message:
        self.calls += 1
        return Message("assistant", (Part(Kind.TEXT, f"Step {self.calls}."),))


def test_a_long_task_is_rebuilt_mid_task_and_its_stubs_are_recallable(tmp_path: Path) -> None:
    s = _Long(tmp_path, BOUND)
    s.prompt("Which module parses toml files?")
    for k in range(6):
        s.tool_round(f"earlier {k} " * 150)
    s.prompt("Now port the yaml module, file by file")
    sizes, stubbed = [], []
    for k in range(30):
        sent, d = s.tool_round(f"file {k:02d} body " * 120)
        sizes.append(_tokens(sent))
        assert d.recall is not None and d.recall.plan is not None
        stubbed = [c for c, _ in d.recall.plan.stubs]
        live = s.asked[s.asked.index(
            {"role": "user", "content": [{"type": "text",
                                           "text": "Now port the yaml module, file by file"}]}):]
        assert "Now port the yaml module, file by file" in json.dumps(sent[-len(live)])
        # The last rounds exactly as sent, whatever went as a stub before them.
        assert k < plan.LAST_ROUNDS or sent[-2 * plan.LAST_ROUNDS:] == s.asked[-2 * plan.LAST_ROUNDS:]
        assert "earlier 0" not in json.dumps(sent) or k < 3  # the turns before the task go
    assert max(sizes) <= BOUND.bound, sizes
    assert stubbed and stubbed[0] == "t8"  # the task's first result, the oldest
    text = json.dumps(sent)
    item = int(re.search(r"memory_more\(item=(\d+)\)", text)[1])  # type: ignore[index]
    memory = TurnMemory(s.store.find_user("dev") or 0, None, s.at)
    back = s.pipeline.run_tool("memory_more", {"item": item}, memory)
    assert "file 00 body" in back  # the stub's result, whole, from memory


# --------------------------------------------------------------------------- replayed sessions


def _two_sessions(tmp_path: Path) -> list[Path]:
    paths = []
    for n in range(2):
        r = Recorder()
        r.user(f"session {n}: fix the parser")
        r.assistant(f"m{n}a", {"type": "text", "text": "Looking."})
        r.assistant(f"m{n}a", {"type": "tool_use", "id": f"c{n}", "name": "Read",
                               "input": {"file_path": "/p/a.py"}})
        r.user([{"type": "tool_result", "tool_use_id": f"c{n}", "content": "def a(): ..."}])
        r.assistant(f"m{n}b", {"type": "text", "text": "Fixed."})
        path = tmp_path / f"s{n}.jsonl"
        path.write_text("\n".join(r.lines).replace("2026-03-01", f"2026-03-0{n + 1}"))
        paths.append(path)
    return paths


def test_chained_sessions_are_one_conversation_that_never_ends(tmp_path: Path) -> None:
    first, second = (read_session(p) for p in _two_sessions(tmp_path))
    chain = chained([first, second])
    assert len(chain.calls) == len(first.calls) + len(second.calls)
    joined = chain.calls[len(first.calls)]
    carried = first.calls[-1].messages + [{"role": "assistant",
                                           "content": [{"type": "text", "text": "Fixed."}]}]
    assert joined.messages == carried + second.calls[0].messages
    assert joined.live_from == len(carried)  # the live task is the second session's prompt
    assert joined.at == pytest.approx(first.calls[-1].replied_at + 60)
    assert not anthropic.check({"messages": chain.calls[-1].messages})


@pytest.mark.skipif(not SESSIONS.exists(), reason=f"needs {SESSIONS} (../shared)")
def test_real_sessions_chained_stay_within_the_bound(tmp_path: Path) -> None:
    """The shared sessions' first calls as one conversation, under a bound it passes often."""
    bound = 40_000
    report = replay.claude_code([SESSIONS], calls=12, chain=1, tools=False,
                                limits=Cap(bound=bound)).as_dict()
    chain = report["sessions"][0]
    assert chain["calls"] == 72 and chain["largest_direct_tokens"] > 2 * bound
    assert chain["invalid_requests"] == 0
    # The system prompt and tools (~20k) included; the bound leaves images and our tools' note
    # (a few hundred tokens) uncounted.
    assert chain["largest_upstream_tokens"] <= bound * 1.02
    calls = chain["per_call"]
    assert all(c["live_identical"] or c["stubs"] for c in calls)
    assert any(c["stubs"] for c in calls)


# --------------------------------------------------------------------------- count_tokens


def test_count_tokens_answers_for_the_request_as_it_goes_upstream(
        proxy: Proxy, fake: FakeProvider) -> None:
    c = owned(anthropic_sdk.Anthropic(base_url=proxy.url, api_key="sk-ant-count-test",
                                      max_retries=0, default_headers={
                                          "x-perpetuity-user": "counter",
                                          "x-perpetuity-conversation": "long"}))
    history: list[dict[str, Any]] = []
    for n in range(8):  # a history far past a frame's ceiling
        history.append({"role": "user", "content": f"Step {n}: the vault code is 44{n}. "
                        + "padding words " * 700})
        fake.script(Text(f"Noted step {n}."))
        c.messages.create(model="claude-sonnet-4-6", max_tokens=50, messages=history)
        history.append({"role": "assistant", "content": f"Noted step {n}."})
    stored = len(proxy.wait_messages("counter", 16))
    asked = [*history, {"role": "user", "content": "What was the vault code at step 2?"}]
    counted = c.messages.count_tokens(model="claude-sonnet-4-6", messages=asked)
    sent = fake.requests[-1]
    assert sent.path.endswith("/v1/messages/count_tokens")
    whole = len(json.dumps({"model": "claude-sonnet-4-6", "messages": asked})) // 4
    # The framed request, not the whole history: the harness sees what the model reads.
    assert len(sent.json["messages"]) < len(asked) and counted.input_tokens < whole
    assert sent.json["messages"][0]["content"][0]["text"].startswith(frame.HEADER)
    assert counted.input_tokens == max(1, len(sent.body) // 4)
    names = [t["name"] for t in sent.json.get("tools", [])]
    assert "memory_search" in names  # our tools, as they ride along upstream
    assert sent.json["messages"][-1]["content"] == "What was the vault code at step 2?"
    assert len(proxy.messages("counter")) == stored  # a count is not a turn


# --------------------------------------------------------------------------- the request path

_TEXT = st.text(st.sampled_from(["\\", "u", "d", "8", "c", "0", '"', "x", "\ud83d", "\ude00",
                                 "\ud800", "\udc00", "😀"]), max_size=12)


@given(_TEXT)
def test_a_lone_surrogate_is_found_without_re_encoding_the_body(text: str) -> None:
    """A long history's emoji (paired escapes) no longer make every call dump and encode the
    whole body: the scan says what the encoding would, on every mix of escapes."""
    raw = json.dumps({"t": text}).encode()
    try:
        json.dumps(json.loads(raw), ensure_ascii=False).encode()
        lone = False
    except UnicodeEncodeError:
        lone = True
    assert reading.lone_surrogate(raw) == lone
