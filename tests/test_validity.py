"""Never an invalid request: each adapter's `check` against the independent rules in
tests/validity.py; what a person's prompt is; and sessions through a real pipeline whose memory
replaces their history (interrupts, parallel calls, compaction, images, thinking, every harness
capture), each request upstream accepted and its live task kept byte for byte."""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core.frame.billing import AnthropicCache
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.exchange import Decision
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire import repair
from perpetuity_core.wire.conversation import (
    Message,
    Protocol,
    Provider,
    Reply,
    Usage,
    is_prompt,
    prompt_text,
    text_part,
)
from perpetuity_core.wire.protocols import ADAPTERS, anthropic, cache_marks, chat, responses
from tests.conftest import needs_fixtures
from tests.test_fixtures import http_fixtures, replay, to_request
from tests.test_frame import say
from tests.validity import CHECKS

PRODUCTION = {"/v1/messages": anthropic.check, "/v1/chat/completions": chat.check,
              "/v1/responses": responses.check}
INTERRUPT = "[Request interrupted by user for tool use]"


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def call(i: str, command: str = "ls") -> dict[str, Any]:
    return {"type": "tool_use", "id": i, "name": "Bash", "input": {"command": command}}


def result(i: str, content: str = "ok") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": i, "content": content}


def thinking(signature: str = "sig") -> dict[str, Any]:
    return {"type": "thinking", "thinking": "hm", "signature": signature}


VALID_ANTHROPIC = [
    # The exact Claude Code interrupt: the interrupted call's result, the marker, the new prompt.
    [user(text("list files")), assistant(thinking(), call("t1")),
     user(result("t1"), text(INTERRUPT), text("no, list only the tests"))],
    # Parallel calls answered in one user message; a system message read past.
    [user(text("read both")), {"role": "system", "content": "agents: ..."},
     assistant(call("a"), call("b")), user(result("b"), result("a"))],
    # A tool_use in the last message is the model's own prefill, not yet answered.
    [user(text("go")), assistant(call("a"))],
    [user(text("what is this"), {"type": "image", "source": {"type": "base64",
          "media_type": "image/png", "data": "iVBO"}})],
]

INVALID_ANTHROPIC = {
    "result without its call (the frame replaced the tool_use)": [
        user(text("[memory]")), assistant(text("[end]")),
        user(result("t1"), text(INTERRUPT), text("no, list only the tests"))],
    "call not answered by the next message": [
        user(text("go")), assistant(call("a"), call("b")), user(result("a"))],
    "starts with the assistant": [assistant(text("hi")), user(text("go"))],
    "two users in a row": [user(text("a")), user(text("b"))],
    "thinking without its signature": [user(text("go")), assistant(thinking(""), text("x")),
                                       user(text("next"))],
}


@pytest.mark.parametrize("messages", VALID_ANTHROPIC)
def test_anthropic_accepts_what_the_api_accepts(messages: list[dict[str, Any]]) -> None:
    body = {"model": "claude", "messages": messages}
    assert anthropic.check(body) == []
    assert CHECKS["/v1/messages"](body) == []


@pytest.mark.parametrize("why", sorted(INVALID_ANTHROPIC))
def test_anthropic_refuses_what_the_api_refuses(why: str) -> None:
    assert anthropic.check({"model": "claude", "messages": INVALID_ANTHROPIC[why]}), why


def _walked_check(body: dict[str, Any]) -> list[str]:
    """anthropic.check as it was before it read past plain text messages: every message's
    blocks walked, every container searched for marks."""
    raw = body.get("messages")
    if not isinstance(raw, list):
        return ["no messages list"]
    msgs = [m for m in raw if isinstance(m, dict) and m.get("role") != "system"]
    errors: list[str] = []
    if not msgs or msgs[0].get("role") != "user":
        errors.append("the first message is not the user's")

    def calls(m: dict[str, Any]) -> set[str]:
        return {str(b.get("id")) for b in cache_marks.content_blocks(m)
                if b.get("type") == "tool_use"}
    for i, m in enumerate(msgs):
        blocks = cache_marks.content_blocks(m)
        if i and m.get("role") == msgs[i - 1].get("role"):
            errors.append(f"message {i}: two {m.get('role')} messages in a row")
        results = [str(b.get("tool_use_id")) for b in blocks if b.get("type") == "tool_result"]
        if results:
            called = calls(msgs[i - 1]) if i and msgs[i - 1].get("role") == "assistant" else set()
            if missing := [r for r in results if r not in called]:
                errors.append(f"message {i}: tool_result without its tool_use just before: {missing}")
            first_other = next((k for k, b in enumerate(blocks) if b.get("type") != "tool_result"),
                               len(blocks))
            if any(b.get("type") == "tool_result" for b in blocks[first_other:]):
                errors.append(f"message {i}: tool_result after other content")
        if (made := calls(m)) and i + 1 < len(msgs):
            answered = {str(b.get("tool_use_id")) for b in cache_marks.content_blocks(msgs[i + 1])
                        if b.get("type") == "tool_result"}
            if unanswered := sorted(made - answered):
                errors.append(f"message {i}: tool_use not answered in the next message: {unanswered}")
        for b in blocks:
            if b.get("type") == "thinking" and not b.get("signature"):
                errors.append(f"message {i}: thinking block without its signature")
            elif b.get("type") == "redacted_thinking" and not b.get("data"):
                errors.append(f"message {i}: redacted_thinking block without its data")
    marks = cache_marks.markers(body)
    if len(marks) > cache_marks.MAX_CACHE_MARKERS:
        errors.append(f"{len(marks)} cache_control markers (at most {cache_marks.MAX_CACHE_MARKERS})")
    if any(isinstance(m, dict) and m.get("ttl") == "1h" for m in marks) and \
            cache_marks.hour_after_minutes(body):
        errors.append("a 1h cache_control marker after a 5-minute one")
    return errors


_MARK = st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}, None])
_ID = st.sampled_from(["a", "b"])
_BLOCK = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.sampled_from(["x", "[memory]"])),
    st.builds(lambda t, m: {"type": "text", "text": t, "cache_control": m}, st.just("y"), _MARK),
    st.builds(lambda i, m: {"type": "tool_use", "id": i, "name": "Bash", "input": {"c": m}},
              _ID, _MARK),
    st.builds(lambda i, c: {"type": "tool_result", "tool_use_id": i, "content": c}, _ID,
              st.one_of(st.just("ok"), st.lists(st.builds(
                  lambda m: {"type": "text", "text": "r", "cache_control": m}, _MARK),
                  max_size=2))),
    st.builds(lambda s: {"type": "thinking", "thinking": "hm", "signature": s},
              st.sampled_from(["", "sig"])),
    st.just({"type": "redacted_thinking", "data": ""}), st.just({"type": "text", "text": 3}),
    st.just("a string block"), st.just({"type": "text", "text": "z", "more": []}))
_MESSAGE = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c},
              st.sampled_from(["user", "assistant", "system"]),
              st.one_of(st.just("a prompt"), st.lists(_BLOCK, max_size=3), st.none())),
    st.builds(lambda c: {"role": ["user"], "content": c}, st.just([{"type": "text", "text": "x"}])),
    st.builds(lambda m: {"role": "user", "content": "p", "cache_control": m}, _MARK),
    st.just(["not", "a", "message"]), st.just(7))


@settings(max_examples=300, deadline=None)
@given(st.lists(_MESSAGE, max_size=8), st.lists(_MARK, max_size=4), _MARK)
def test_anthropic_check_reads_past_plain_text_as_the_walk_of_every_block(
        messages: list[Any], system_marks: list[Any], top: Any) -> None:
    """Read past (a frame's message, a prompt as a string) or walked block by block, the same
    errors in the same order, the same marks counted."""
    body: dict[str, Any] = {"model": "claude", "messages": messages,
                            "system": [{"type": "text", "text": "s", "cache_control": m}
                                       for m in system_marks]}
    if top is not None:
        body["cache_control"] = top
    assert anthropic.check(body) == _walked_check(body)


def test_the_frames_mark_goes_on_a_copy_of_the_message_rendered() -> None:
    """A frame is rendered once while its plan keeps it (the same objects, written once): the
    mark at its end goes on a copy, so a later call with no mark to spare sends none there."""
    frame = [Message("user", (text_part("[memory] earlier"),)),
             Message("assistant", (text_part("[end of memory]"),))]
    mark = {"cache_control": {"type": "ephemeral"}}
    first = anthropic.replace_history({"messages": [user(text("go"))]}, frame, 0)
    full = anthropic.replace_history({"messages": [user({**text("go"), **mark}),
                                                   assistant({**text("a"), **mark}),
                                                   user({**text("b"), **mark}),
                                                   assistant({**text("c"), **mark}),
                                                   user(text("d"))]}, frame, 0)
    assert first["messages"][1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in full["messages"][1]["content"][-1]
    assert full["messages"][0] is first["messages"][0]  # rendered once
    assert anthropic.check(full) == []


def test_a_frames_messages_stay_rendered_while_they_live_and_no_longer() -> None:
    """A frame kept by its plan is the same objects every tool round, however many other
    messages were rendered between (a 512-entry FIFO dropped them: bench_latency's rotation
    re-rendered four rounds in five); the rendering is the message's own, so it goes with the
    message (bounded by what is alive), is never another message's with equal text (another
    tenant's), and two threads rendering one frame get equal bodies."""
    frame = [Message("user", (text_part(f"[memory] row {i}"),)) for i in range(200)]
    first = anthropic.replace_history({"messages": [user(text("go"))]}, frame, 0)["messages"]
    for k in range(4):  # other conversations' frames rendered between two rounds
        anthropic.replace_history({"messages": [user(text("go"))]},
                                  [Message("user", (text_part(f"{k}.{i}"),)) for i in range(300)], 0)
    again = anthropic.replace_history({"messages": [user(text("go"))]}, frame, 0)["messages"]
    assert all(a is b for a, b in zip(first[:-2], again[:-2], strict=True))
    twin = Message("user", (text_part("[memory] row 0"),))  # equal, another tenant's object
    mine = anthropic._render([twin])[0]
    assert mine == first[0] and mine is not first[0]
    rendered = again[0]
    del first, again
    assert [type(r).__name__ for r in gc.get_referrers(rendered)] == ["tuple"]  # the message's
    del frame
    gc.collect()
    assert gc.get_referrers(rendered) == []  # gone with its message: nothing else holds it
    shared = [Message("user", (text_part(f"shared {i}"),)) for i in range(300)]
    with ThreadPoolExecutor(2) as pool:
        bodies = list(pool.map(lambda _: anthropic.replace_history(
            {"messages": [user(text("go"))]}, shared, 0)["messages"], range(40)))
    assert all(b == bodies[0] for b in bodies)
    assert anthropic._render(shared) == anthropic._render(shared)


def test_anthropic_counts_cache_markers_across_tools_system_and_messages() -> None:
    mark = {"cache_control": {"type": "ephemeral"}}
    body = {"tools": [{"name": "t", **mark}], "system": [{"type": "text", "text": "s", **mark}],
            "messages": [user({**text("a"), **mark}, {**result("x"), "content": [
                {**text("r"), **mark}]})]}
    assert [e for e in anthropic.check(body) if "cache_control" in e] == []
    # A new body (the request path never changes one in place: what is walked of its
    # members is kept while they are the same objects, cache_marks.markers_outside).
    body = {**body, "system": [*body["system"], {"type": "text", "text": "t", **mark}]}
    assert any("5 cache_control markers" in e for e in anthropic.check(body))


def test_anthropic_refuses_an_hours_mark_after_five_minutes() -> None:
    minutes, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    body = {"system": [{"type": "text", "text": "s", "cache_control": hour}],
            "messages": [user({**text("a"), "cache_control": minutes})]}
    assert anthropic.check(body) == []
    body["system"][0]["cache_control"] = minutes
    body["messages"][0]["content"][0]["cache_control"] = hour
    assert any("1h cache_control" in e for e in anthropic.check(body))


def test_an_hours_marks_are_the_harness_own_on_its_tools_and_system() -> None:
    minutes = {"type": "ephemeral"}
    body = {"model": "claude", "tools": [{"name": "Bash", "cache_control": minutes},
                                         {"name": "Read"}],
            "system": [{"type": "text", "text": "s"}, {"type": "text", "text": "t",
                                                        "cache_control": minutes}],
            "messages": [user({**text("go"), "cache_control": minutes})]}
    sent = cache_marks.lasting(body)
    assert [t.get("cache_control") for t in sent["tools"]] == [cache_marks.HOUR_MARK, None]
    assert [b.get("cache_control") for b in sent["system"]] == [None, cache_marks.HOUR_MARK]
    assert sent["messages"] == body["messages"]  # the harness's own marks there stay
    assert anthropic.check(sent) == []
    assert body["system"][1]["cache_control"] == minutes  # the harness's body is not changed
    assert cache_marks.lasting({"system": "one string"}) == {"system": "one string"}
    ours = anthropic.add_tools(body, [{"name": "memory_search", "description": "d",
                                       "input_schema": {"type": "object"}}], False)
    assert ours["system"] == sent["system"] and ours["tools"][:2] == sent["tools"]


def test_our_tools_definitions_go_as_the_same_objects_every_call() -> None:
    """Made once, so each call writes their JSON from what the last call wrote
    (wire.written); a definition with more members than the API's three is copied down."""
    spec = {"name": "memory_search", "description": "d", "input_schema": {"type": "object"}}
    body = {"model": "claude", "messages": [user(text("go"))]}
    assert anthropic.add_tools(body, [spec], False)["tools"][0] is spec
    wider = {**spec, "note": "ours only"}
    assert anthropic.add_tools(body, [wider], False)["tools"] == [spec]


def test_what_is_made_of_a_harness_s_tools_is_kept_for_those_objects_alone() -> None:
    """cache_marks.LastMade: made once while the objects are the same ones; equal objects that
    are not the same (another request's, another tenant's) are made afresh, never answered
    from the other's; one entry; two threads alternating objects each get their own's."""
    made: list[int] = []

    def length(tools: list[Any]) -> int:
        made.append(len(tools))
        return len(json.dumps(tools))

    last = cache_marks.LastMade(length)
    tools, twin = [{"name": "Read"}], [{"name": "Read"}]
    assert last(tools) == last(tools) == len(json.dumps(tools)) and len(made) == 1
    assert last(twin) == len(json.dumps(twin)) and len(made) == 2  # equal, not the same
    assert last(tools) and len(made) == 3  # one entry: the twin replaced it
    bodies = [[{"name": "x" * n}] for n in range(1, 9)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda k: (k, last(bodies[k % 8])), range(4000)))
    assert all(n == len(json.dumps(bodies[k % 8])) for k, n in got)
    body = {"model": "m", "tools": tools, "system": [{"type": "text", "text": "s",
                                                     "cache_control": {"type": "ephemeral"}}],
            "messages": [user(text("go"))]}
    assert cache_marks.markers_outside(body) == [{"type": "ephemeral"}]
    assert cache_marks.markers_outside({**body, "system": "s"}) == []  # another member


def test_the_frames_mark_lasts_an_hour_where_a_mark_after_it_does() -> None:
    frame = [Message("user", (text_part("what memory holds"),)),
             Message("assistant", (text_part("noted"),))]
    for later, expected in (({"type": "ephemeral"}, {"type": "ephemeral"}),
                            (cache_marks.HOUR_MARK, cache_marks.HOUR_MARK)):
        body = {"model": "claude", "system": [{"type": "text", "text": "s",
                                               "cache_control": cache_marks.HOUR_MARK}],
                "messages": [user(text("old")), assistant(text("old reply")),
                             user({**text("go"), "cache_control": later})]}
        sent = anthropic.replace_history(body, frame, 2)
        assert sent["messages"][1]["content"][-1]["cache_control"] == expected
        assert anthropic.check(sent) == []


def test_anthropic_tool_results_come_before_text() -> None:
    body = {"messages": [user(text("go")), assistant(call("a")), user(text("and"), result("a"))]}
    assert anthropic.check(body)


def test_chat_pairs_tool_messages_with_the_calls_before_them() -> None:
    def calls(*ids: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]}

    def tool(i: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": i, "content": "ok"}

    go = {"role": "user", "content": "go"}
    assert chat.check({"messages": [go, calls("a", "b"), tool("b"), tool("a"), go]}) == []
    assert chat.check({"messages": [{"role": "user", "content": "[memory]"}, tool("a"), go]})
    assert chat.check({"messages": [go, calls("a", "b"), tool("a"), go]})
    assert chat.check({"messages": [go, calls("a")]})  # a call must be answered before sending


def test_responses_pairs_outputs_with_earlier_calls() -> None:
    def fc(i: str) -> dict[str, Any]:
        return {"type": "function_call", "call_id": i, "name": "f", "arguments": "{}"}

    def out(i: str) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": i, "output": "ok"}

    go = {"type": "message", "role": "user", "content": "go"}
    assert responses.check({"input": [go, fc("a"), out("a")]}) == []
    assert responses.check({"input": [go, out("a"), fc("a")]})
    assert responses.check({"input": [go, fc("a"), go]})
    assert responses.check({"input": "go"}) == []
    assert responses.check({"input": [out("a")], "previous_response_id": "resp_1"}) == []


@needs_fixtures
def test_every_capture_is_valid_to_production_and_reference_alike() -> None:
    checked = 0
    for harness in ("claude-code", "codex", "opencode", "anthropic-python", "openai-python"):
        for f in http_fixtures(harness):
            raw = json.loads(f.read_text())
            if (path := raw["path"]) in PRODUCTION:
                assert PRODUCTION[path](raw["body"]) == [] == CHECKS[path](raw["body"]), f
                checked += 1
    assert checked >= 30, checked


# --------------------------------------------------------------------------- a person's prompt


def parsed_user(*blocks: dict[str, Any]) -> Message:
    return anthropic.parse_request({"messages": [user(*blocks)]}).messages[0]


def test_a_prompt_is_what_the_person_typed() -> None:
    interrupt = parsed_user(result("t1"), text(INTERRUPT), text("no, list only the tests"))
    assert prompt_text(interrupt) == "no, list only the tests"
    assert not is_prompt(parsed_user(text("[Request interrupted by user]")))
    assert not is_prompt(parsed_user(result("t1"), text(INTERRUPT)))
    assert not is_prompt(parsed_user(result("t1")))
    assert not is_prompt(parsed_user(text("<system-reminder>Today is Monday.</system-reminder>")))
    assert not is_prompt(parsed_user(text(COMPACT_SUMMARY)))
    assert not is_prompt(parsed_user(text("<ide_opened_file>The user opened src/a.py</ide_opened_file>")))
    said = parsed_user(text("<system-reminder>skills: ...</system-reminder>"), text("fix the parser"))
    assert prompt_text(said) == "fix the parser"
    assert not is_prompt(anthropic.parse_request({"messages": [assistant(text("done"))]}).messages[0])


# --------------------------------------------------------------------------- sessions through a pipeline

COMPACT_SUMMARY = ("This session is being continued from a previous conversation that ran out of "
                   "context. The summary below covers the earlier portion of the conversation.\n"
                   "Summary: the parser in src/parse.py drops trailing commas.")
PNG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}
UPSTREAMS = {Provider.ANTHROPIC: "https://a.test", Provider.OPENAI: "https://o.test"}
REBUILD = 600.0  # seconds between calls: the cache has expired, so every prompt rebuilds
ADDENDA = 10.0  # the cache holds: the frame stays and new prompts get addenda
# Memory from an earlier conversation, large enough that a frame replaces the history.
OLDER = [f"The parser in src/parse.py {w}; the tokenizer in src/lex.py handles {w} too."
         for w in ("drops trailing commas", "reads nested lists", "skips comments", "keeps quotes",
                   "counts lines", "reports columns", "rejects tabs", "folds whitespace")] + [
    "The deploy script stages every build through zeppelin before release."]


def calls(items: list[dict[str, Any]], reply_side: Callable[[dict[str, Any]], bool]
          ) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """A harness's calls over a session: the history before each run of reply items, with that
    run (what the provider answered), then the whole session as the last call."""
    out = []
    for i, item in enumerate(items):
        if i and reply_side(item) and not reply_side(items[i - 1]):
            run = i
            while run < len(items) and reply_side(items[run]):
                run += 1
            out.append((items[:i], items[i:run]))
    return out + [(items, [])]


@dataclass(frozen=True, slots=True)
class Wire:
    path: str
    key: str  # where the body holds its history
    protocol: Protocol
    auth: list[str]
    reply_side: Callable[[dict[str, Any]], bool]


ANTHROPIC = Wire("/v1/messages", "messages", Protocol.ANTHROPIC, ["x-api-key", "k"],
                 lambda m: m["role"] == "assistant")
CHAT = Wire("/v1/chat/completions", "messages", Protocol.CHAT, ["authorization", "Bearer k"],
            lambda m: m["role"] == "assistant")
RESPONSES = Wire("/v1/responses", "input", Protocol.RESPONSES, ["authorization", "Bearer k"],
                 lambda i: i.get("role") == "assistant" or i.get("type") in ("function_call",
                                                                             "reasoning"))


def drive(tmp_path: Path, wire: Wire, items: list[dict[str, Any]], gap: float = REBUILD,
          **extra: Any) -> list[tuple[dict[str, Any], Decision]]:
    """Each call of the session through a real pipeline on a store that already remembers an
    earlier conversation, `gap` seconds apart, with frames small enough that the session's own
    history outgrows them; every reply stored as the relay would. (body sent, decision) each."""
    store = open_memory(tmp_path / "m.db")
    say(store, "older", *[t for line in OLDER for t in (line, "Noted.")], user="dev")
    pipeline = Pipeline(store, Settings(upstreams=UPSTREAMS, limits=Cap(floor=60, ceiling=120),
                                         trust_identity=True))
    headers = [wire.auth, ["x-perpetuity-user", "dev"], ["x-perpetuity-conversation", "live"]]
    adapter = ADAPTERS[wire.protocol]
    out = []
    for n, (history, reply) in enumerate(calls(items, wire.reply_side)):
        body = {"model": "m", wire.key: history, **extra}
        when = datetime.fromtimestamp(1_700_000_000 + n * gap, UTC).isoformat()
        d = pipeline.prepare(to_request({"method": "POST", "path": wire.path, "body": body,
                                         "headers": [*headers, ["x-perpetuity-time", when]]}))
        out.append((body, d))
        turn = pipeline.store_turn(d.job.pending)
        if reply:
            said = adapter.parse_request({wire.key: reply}).messages[0]
            pipeline.store_reply(turn, Reply(said, Usage()), 0.0)
    store.close()
    return out


def assert_accepted_and_live_task_kept(wire: Wire, sent: list[tuple[dict[str, Any], Decision]]
                                       ) -> int:
    """Every request upstream passes the production and the reference check, and keeps the
    live task (the person's last prompt on) byte for byte; how many had their history replaced."""
    replaced = 0
    for body, d in sent:
        upstream = json.loads(d.body) if d.body is not None else body
        assert ADAPTERS[wire.protocol].check(upstream) == [], (d.note, upstream[wire.key])
        assert CHECKS[wire.path](upstream) == [], d.note
        assert "left as sent" not in d.note, d.note
        parsed = ADAPTERS[wire.protocol].parse_request(body)
        live = next(i for i in reversed(range(len(parsed.messages)))
                    if is_prompt(parsed.messages[i]))
        task = body[wire.key][parsed.raw_index[live]:]
        assert json.dumps(upstream[wire.key][-len(task):]) == json.dumps(task), d.note
        history = body[wire.key]
        replaced += upstream[wire.key][-len(history):] != history  # some of it was dropped
    return replaced


def claude_code_session() -> list[dict[str, Any]]:
    """A Claude Code session with every shape that has broken a frame: thinking with signatures,
    parallel calls, an image, and an interrupted tool call whose result shares the user message
    with the marker and the person's next prompt."""
    return [
        user(text("<system-reminder>skills: ...</system-reminder>"),
             text("the parser in src/parse.py drops trailing commas, fix it")),
        assistant(thinking("sig-1"), text("Reading it."), call("read1")),
        user(result("read1")),
        assistant(call("grep1"), call("grep2")),
        user(result("grep1"), result("grep2")),
        assistant(text("Fixed the comma handling.")),
        user(PNG, text("the tokenizer in src/lex.py now shows this error")),
        # A long call, so that what accumulated since the last frame outgrows a frame: the
        # interrupt's prompt is a rebuild.
        assistant(thinking("sig-2"), call("run1", "pytest tests/lex/test_columns.py " * 60)),
        user(result("run1"), text(INTERRUPT), text("no, first check how the deploy script uses zeppelin")),
        assistant(call("run2")),
        user(result("run2")),
        assistant(text("The lexer tests pass.")),
        user(text("now make the parser report columns")),
        assistant(thinking("sig-3"), text("Done: columns are reported.")),
        user(text("and have it reject tabs like the lexer")),
        assistant(call("edit1")),
        user(result("edit1")),
        assistant(text("Tabs are rejected.")),
        user(text("does the parser still skip comments?")),
    ]


@pytest.mark.parametrize("gap", [REBUILD, ADDENDA])
def test_claude_code_shapes_stay_valid_when_memory_replaces_history(tmp_path: Path,
                                                                   gap: float) -> None:
    sent = drive(tmp_path, ANTHROPIC, claude_code_session(), gap,
                 system=[{"type": "text", "text": "You are Claude Code.",
                          "cache_control": {"type": "ephemeral"}}])
    assert assert_accepted_and_live_task_kept(ANTHROPIC, sent) >= 4


def test_the_interrupted_call_stays_with_its_result(tmp_path: Path) -> None:
    """A rebuild at the interrupt's message, a prompt that carries the interrupted call's
    result: the history is kept from the prompt before the call, so the call stays with it."""
    session = claude_code_session()
    interrupted = next(i for i, m in enumerate(session)
                       if any(b.get("text") == INTERRUPT for b in m["content"]))
    asked = session[:interrupted + 1]
    body, d = next((b, d) for b, d in drive(tmp_path, ANTHROPIC, session)
                   if b["messages"] == asked)
    upstream = json.loads(d.body)["messages"]
    kept = asked[interrupted - 2:]  # from the prompt before the interrupted call
    assert upstream[-len(kept):] == kept and upstream[-len(kept) - 1]["role"] == "assistant"
    assert upstream[0] != asked[0]  # the history before it was replaced


def test_a_compacted_session_stays_valid(tmp_path: Path) -> None:
    """After /compact, Claude Code's first user turn is the summary (not a prompt) with the
    command's scaffolding and the next prompt beside it."""
    session = [user(text("<system-reminder>date</system-reminder>"), text(COMPACT_SUMMARY),
                    text("<command-name>/compact</command-name>"),
                    text("keep going on the parser columns")),
               *claude_code_session()[1:]]
    sent = drive(tmp_path, ANTHROPIC, session)
    assert assert_accepted_and_live_task_kept(ANTHROPIC, sent) >= 4


@pytest.mark.parametrize("gap", [REBUILD, ADDENDA])
def test_chat_sessions_with_parallel_calls_stay_valid(tmp_path: Path, gap: float) -> None:
    def asks(i: str, *ids: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": None, "tool_calls": [
            {"id": c, "type": "function", "function": {"name": "read", "arguments": "{}"}}
            for c in ids]}, *[{"role": "tool", "tool_call_id": c, "content": f"{i} ok"} for c in ids]]

    session: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for n, line in enumerate(OLDER[:6]):
        session += [{"role": "user", "content": f"check that {line}"},
                    *asks(line, f"a{n}", f"b{n}"), {"role": "assistant", "content": "Checked."}]
    session.append({"role": "user", "content": "does the parser still skip comments?"})
    sent = drive(tmp_path, CHAT, session, gap)
    assert assert_accepted_and_live_task_kept(CHAT, sent) >= 6


def responses_session() -> list[dict[str, Any]]:
    def said(role: str, words: str) -> dict[str, Any]:
        kind = "input_text" if role == "user" else "output_text"
        return {"type": "message", "role": role, "content": [{"type": kind, "text": words}]}

    session: list[dict[str, Any]] = [said("developer", "You are Codex.")]
    for n, line in enumerate(OLDER[:6]):
        session += [said("user", f"check that {line}"),
                    {"type": "reasoning", "summary": [], "encrypted_content": f"enc{n}"},
                    {"type": "function_call", "call_id": f"c{n}", "name": "shell", "arguments": "{}"},
                    {"type": "function_call", "call_id": f"d{n}", "name": "shell", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": f"c{n}", "output": "ok"},
                    {"type": "function_call_output", "call_id": f"d{n}", "output": "ok"},
                    said("assistant", "Checked.")]
    return session + [said("user", "does the parser still skip comments?")]


@pytest.mark.parametrize("gap", [REBUILD, ADDENDA])
def test_responses_sessions_stay_valid(tmp_path: Path, gap: float) -> None:
    sent = drive(tmp_path, RESPONSES, responses_session(), gap)
    assert assert_accepted_and_live_task_kept(RESPONSES, sent) >= 6


def test_a_result_after_the_next_prompt_keeps_its_call(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A call's output that arrives after the person's next prompt: kept from that prompt, it
    would lose its call, so the check moves the boundary to the prompt before, and says why."""
    session = responses_session()
    *head, last = session
    # A long call, so that what accumulated since the last frame outgrows a frame: a rebuild.
    call_item = {"type": "function_call", "call_id": "late", "name": "shell",
                 "arguments": json.dumps({"command": "pytest tests/lex " * 100})}
    session = [*head, {"type": "message", "role": "user", "content": "rerun the lexer"}, call_item,
               last, {"type": "function_call_output", "call_id": "late", "output": "ok"}]
    body = {"model": "m", "input": session}
    parsed = responses.parse_request(body)
    front = [Message("user", (text_part("[Memory: ...]"),)),
             Message("assistant", (text_part("[End of quoted memory.]"),))]
    prompt = max(i for i, m in enumerate(parsed.messages) if is_prompt(m))
    replaced = repair.replace_history(responses, body, parsed, front, prompt)
    assert replaced.body is not None and replaced.keep < prompt
    assert "not" in replaced.why and "output without its call" in replaced.why
    assert responses.check(replaced.body) == [] and replaced.body["input"][-4:] == session[-4:]
    # An agent's (its tools sent): a chat keeps its latest exchange, the call with it.
    shell = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
    with caplog.at_level(logging.INFO, logger="perpetuity"):
        body, d = drive(tmp_path, RESPONSES, session, tools=shell)[-1]
    assert assert_accepted_and_live_task_kept(RESPONSES, [(body, d)]) == 1
    assert "not" in d.note and "output without its call" in d.note
    assert json.loads(d.body)["input"][-4:] == body["input"][-4:]
    assert "output without its call" in caplog.text


def test_a_request_that_cannot_be_made_valid_goes_as_sent(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Claude Code's own record is sometimes invalid (a result whose call it never recorded):
    no boundary mends that, so the request goes as the harness sent it, and the log says why."""
    session = claude_code_session()
    session[-1] = user(result("never-called"), text("does the parser still skip comments?"))
    with caplog.at_level(logging.WARNING, logger="perpetuity"):
        body, d = drive(tmp_path, ANTHROPIC, session)[-1]
    assert d.body is None and d.frame is None and d.job is not None
    assert "history left as sent" in d.note and "never-called" in d.note
    assert "never-called" in caplog.text


def test_kept_start_never_splits_a_call_from_its_result() -> None:
    parsed = anthropic.parse_request({"messages": claude_code_session()})
    interrupted = 8
    assert is_prompt(parsed.messages[interrupted])
    assert repair.kept_start(parsed.messages, interrupted) == 6  # the prompt before the call
    assert repair.kept_start(parsed.messages, 2) == 0  # a tool round: back to the first prompt
    assert repair.kept_start(parsed.messages, 12) == 12


@needs_fixtures
def test_every_capture_through_a_remembering_pipeline_is_accepted(tmp_path: Path) -> None:
    """Each harness's session replayed once to fill memory, then every request again: each goes
    upstream accepted by the production check, with its live task as the harness sent it."""
    store = open_memory(tmp_path / "m.db")
    pipeline = Pipeline(store, Settings(upstreams=UPSTREAMS, trust_identity=True))
    harnesses = ("claude-code", "codex", "opencode", "anthropic-python", "openai-python")
    for harness in harnesses:
        replay(pipeline, harness)
    wires = {w.path: w for w in (ANTHROPIC, CHAT, RESPONSES)}
    replaced = 0
    for harness in harnesses:
        for f in http_fixtures(harness):
            raw = json.loads(f.read_text())
            if (wire := wires.get(raw["path"])) is None or not isinstance(raw["body"].get(wire.key), list):
                continue
            replaced += assert_accepted_and_live_task_kept(
                wire, [(raw["body"], pipeline.prepare(to_request(raw)))])
    store.close()
    assert replaced >= 10, replaced


def test_standing_messages_follow_the_frames_header_and_carry_its_mark() -> None:
    """Claude Code's system-role message (its agent list, 1.5k tokens) stays the same across
    rebuilt frames: it goes right after the frame's header (a user message, as Claude Code puts
    it after its first prompt), with the spare mark, so a new frame is written after a cached
    prefix that holds it (it came after the frame and was written with every one); the
    recall tools' `lasting` keeps it an hour, as the system prompt before it."""
    standing = {"role": "system", "content": "agents: Explore, Plan. " * 300}  # ~1.7k tokens
    body = {"model": "claude", "system": [{"type": "text", "text": "s" * 8_000,
                                           "cache_control": {"type": "ephemeral"}}],
            "messages": [user(text("old")), standing, assistant(text("old reply")),
                         user({**text("go"), "cache_control": {"type": "ephemeral"}})]}
    bills = []
    cache = AnthropicCache()
    for k, at in enumerate((0.0, 60.0, 1_000.0)):  # the last after the 5-minute cache expired
        frame = [Message("user", (text_part("[memory]"),)),
                 Message("assistant", (text_part(f"memory {k} " + "x" * 8_000),))]
        sent = anthropic.add_tools(anthropic.replace_history(body, frame, 3), [], False)
        assert [m["role"] for m in sent["messages"][:3]] == ["user", "system", "assistant"]
        assert anthropic.check(sent) == []
        assert sent["messages"][1]["content"][-1]["cache_control"] == cache_marks.HOUR_MARK
        assert "cache_control" not in sent["messages"][2]["content"][-1]  # the frame's end
        bills.append(cache.bill(sent, at))
    # The system prompt (2k tokens) and the standing message are read, after a pause too.
    assert bills[1].read == bills[2].read >= 3_500
