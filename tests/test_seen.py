"""A long session's request read as far as it was read before (wire.seen, issue 22): each body
reads as json.loads reads it, a late call reads and digests only what is new, and what is
stored stays exactly once across a restart (the store is the truth; the cache only saves
work)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core.frame import tenants
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture, names, templates
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.serve import pipeline
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.wire import conversation, seen
from perpetuity_core.wire.conversation import Protocol
from perpetuity_core.wire.protocols import ADAPTERS, anthropic
from perpetuity_core.wire.seen import Seen
from tests.conftest import SHARED, query
from tests.test_fixtures import to_request
from tests.test_plan import Session

MARK = {"type": "ephemeral"}


def _body(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Claude Code's shape: the model first, the history with its cache mark on the last
    message, then the rest."""
    marked = [*history[:-1], {**history[-1], "cache_control": MARK}] if history else []
    return {"model": "m", "messages": marked, "system": [{"type": "text", "text": "s"}],
            "tools": [{"name": "Read"}], "max_tokens": 100, "stream": True}


_TEXT = st.text(st.sampled_from(["a", " ", "\n", '"', "\\", "é", "😀", "\u2028", "}", ",", "]"]),
                max_size=8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_TEXT, st.booleans(), st.sampled_from([None, 1, 2])), min_size=1,
                max_size=12))
def test_a_growing_history_reads_as_json_loads_reads_it(turns: list[tuple[str, bool, Any]]) -> None:
    """Call after call, each body read from where the last one was read up to equals
    json.loads of it, key order included (what goes upstream is dumped from it)."""
    seen, history = Seen(), []
    for text, ascii_only, indent in turns:
        history.append({"role": "user", "content": [{"type": "text", "text": text}]})
        raw = json.dumps(_body(history), ensure_ascii=ascii_only, indent=indent).encode()
        read = seen.read(raw)
        assert json.dumps(read.data) == json.dumps(json.loads(raw))
        seen.keep(read, [None] * len(history))


def test_a_look_says_whether_a_body_reads_on_and_takes_nothing_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`Seen.look` (asked on the event loop before a tool round is prepared there) continues
    exactly when `read` reads on from a body kept, and leaves that body kept; `read` handed
    the look compares no byte again, and one whose body another read took out looks again."""
    kept = Seen()
    task = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "on it"}]
    first = json.dumps(_body(task)).encode()
    assert not kept.look(first).continues(1000)
    kept.keep(kept.read(first), "known")
    # (the cache mark moves to the last message: the first is what reads on)
    longer = json.dumps(_body([*task, {"role": "user", "content": "and the tests"}])).encode()
    other = json.dumps(_body([{"role": "user", "content": "another task"}, *task])).encode()
    look = kept.look(longer)
    assert look.found is not None and longer[:look.found[1]].endswith(b'"fix it"}')
    unread = len(longer) - look.found[1]  # the bytes past the first message
    assert look.continues(unread) and kept.look(longer).continues(unread)
    assert not look.continues(unread - 1)  # counted in bytes not read before
    assert not kept.look(other).continues(1000)
    with monkeypatch.context() as m:
        m.setattr(seen, "_same_up_to", None)  # (compared again: TypeError)
        read = kept.read(longer, look)
    assert read.known == "known" and read.reused == 1 and read.data == json.loads(longer)
    again = kept.read(longer, look)  # its body went with the read above: read whole
    assert again.reused == 0 and again.data == json.loads(longer)


@pytest.mark.parametrize("raw", [
    b"", b"[1]", b"null", b' {"messages" : [ {"a":1} , {"b":2} ] } ', b'{"messages": []}',
    b'{"messages": [1,]}', b'{"messages": [1], }', b'{"messages": [1]} x', b'{"messages": [1]',
    b'{"a": 1, "messages": [1], "messages": [2]}', b'{"messages": [1], "a": {"messages": 2}}',
    b'{"x": {"messages": [1]}}', b'\xef\xbb\xbf{"messages": []}', b'{"messages": "no"}',
    b'{"contents": [{"role": "user"}], "model": "g"}', b'{"messages": [NaN, 1e999]}',
    b'{"messages": ["\\ud800"]}', '{"messages": ["é"]}'.encode("utf-16"), b"{}", b'{"a": 1,}',
    b"{,}", b'{"a": 1, 2}', b'{"a": 1} {}', b'{"request": {"contents": [1]}, "model": "g"}',
])
def test_odd_bodies_read_as_json_loads_reads_them(raw: bytes) -> None:
    """Read cold and again after a body it starts like: the same value, or the same error."""
    def outcome(read: Any) -> Any:
        try:
            return json.dumps(read(raw))
        except ValueError as e:
            return type(e)

    warm = Seen()
    if raw[:14] == b'{"messages": [':
        warm.keep(warm.read(b'{"messages": [1, 2], "z": 0}'), [None, None])
    want = outcome(json.loads)
    assert outcome(lambda r: Seen().read(r).data) == want
    assert outcome(lambda r: warm.read(r).data) == want


class _Counted:
    """Counts the calls of a module's function it stands in for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.calls = 0
        real = getattr(module, name)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(module, name, counted)


class _CountedSearch:
    """A compiled pattern whose searches are counted."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.calls = 0

    def search(self, text: str) -> re.Match[str] | None:
        self.calls += 1
        return self.pattern.search(text)


REMINDER = "<system-reminder>The file was read; it may be stale.</system-reminder>"


def _long_session(tmp_path: Path, rounds: int, memory: Path | str | None = None) -> Session:
    """A task of `rounds` tool rounds, each result with Claude Code's reminder after it."""
    s = Session(tmp_path, tools=[{"name": "Read", "input_schema": {"type": "object"}}],
                memory=memory)
    s.prompt("Port the yaml module, file by file")
    for k in range(rounds):
        s.tool_round(f"file {k} body " * 20, REMINDER)
    return s


def test_a_late_call_reads_and_digests_only_what_is_new(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Work proportional to what is new, not to the history: after 120 tool rounds (241
    messages), the next call reads (message_from) and fingerprints only the messages it added
    and the one whose cache mark moved, on the request path and in storing it; it keys (pair
    keys) only the tail it asks the store about, looks for the harness's folder in its new
    messages alone and for web reading in none; the store is asked about the tail only."""
    s = _long_session(tmp_path, 120)
    read = _Counted(monkeypatch, anthropic, "message_from")
    digested = _Counted(monkeypatch, conversation, "_fingerprint")
    paired = _Counted(monkeypatch, capture, "_pair")
    web = _Counted(monkeypatch, tenants, "_reads_web")
    folder = _CountedSearch(names._FOLDER)
    monkeypatch.setattr(names, "_FOLDER", folder)
    asked: list[int] = []
    known = Store.known

    def counted_known(store: Store, conv: int, keys: list[str], replies: list[str]) -> Any:
        asked.append(len(keys))
        return known(store, conv, keys, replies)

    monkeypatch.setattr(Store, "known", counted_known)
    s.tool_round("file 120 body", REMINDER)
    assert len(s.asked) == 243
    assert read.calls <= 3, read.calls
    assert digested.calls <= 4, digested.calls  # the two new, the reply stored, the moved mark
    assert max(asked) <= capture.TAIL
    assert paired.calls <= capture.TAIL + 1, paired.calls  # the tail asked about, the reply
    assert folder.calls <= 3, folder.calls  # the system prompt, the new and the re-read message
    assert web.calls == 0, web.calls


def test_a_replaced_body_is_freed_by_the_store_s_writer_and_never_more_wait(
        tmp_path: Path) -> None:
    """The body a longer one replaced is not freed on the request path: it waits for the
    store's writer (store_turn releases it), and never more than seen.RETIRED wait when no
    write comes (probes, capture off)."""
    s = _long_session(tmp_path, 3)
    retired = s.pipeline.reader.seen._retired
    d = s.pipeline.prepare(_request(s))  # the last call's body read again, then replaced
    assert [e.raw for e in retired] == [_request(s).body]
    s.pipeline.store_turn(d.job.pending)
    assert not retired
    looked, bodies = Seen(), []
    for k in range(seen.RETIRED + 3):
        raw = json.dumps(_body([{"role": "user", "content": f"turn {i}"}
                                for i in range(k + 1)])).encode()
        looked.keep(looked.read(raw), None)
        bodies.append(raw)
    assert [e.raw for e in looked._retired] == bodies[-seen.RETIRED - 1:-1]
    looked.release()
    assert not looked._retired


def _stored(memory: Path | str) -> list[tuple[str, str]]:
    return query(memory, "SELECT role, fingerprint FROM message ORDER BY id")


def _restarted(s: Session) -> None:
    """A new proxy on the same memory: its caches empty, the store as it was."""
    s.store.close()
    s.store = open_memory(s.memory)
    s.pipeline = Pipeline(s.store, s.pipeline.settings)


def _lose_a_call(s: Session) -> None:
    """One more round read (its body kept) whose writes never happen: the proxy dies after
    sending it."""
    s.history[-1] = {"role": "assistant", "content": [
        *s.history[-1]["content"],
        {"type": "tool_use", "id": "lost", "name": "Read", "input": {"path": "lost.py"}}]}
    s.history.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "lost", "content": "never stored"}]})
    s.asked = list(s.history)
    assert s.pipeline.prepare(_request(s)).job is not None  # read, never stored
    s.history.append({"role": "assistant", "content": [{"type": "text", "text": "lost reply"}]})


def test_a_restart_mid_session_stores_every_message_once(tmp_path: Path,
                                                         memory_at: Path | str) -> None:
    """The caches are optimisations only, on either backend: a proxy restarted mid-task (the
    bodies it read, their messages and the plans forgotten), after a call it read and never
    stored, stores what the same session stores on SQLite without the restart, each message
    once, and loses none: every message of the conversation as the harness last sent it."""
    runs = []
    for memory in (tmp_path / "reference.db", memory_at):
        s = _long_session(tmp_path, 30, memory)
        _lose_a_call(s)
        if memory == memory_at:
            _restarted(s)
        for k in range(5):
            s.tool_round(f"after the restart {k} " * 20, REMINDER)
        runs.append(_stored(memory))
        s.store.close()
    assert runs[0] == runs[1]
    assert len(runs[1]) == len(set(runs[1]))
    sent = anthropic.parse_request({"messages": s.history}).messages
    assert {m.fingerprint() for m in sent} <= {f for _, f in runs[1]}


def test_a_call_whose_writes_were_lost_is_stored_by_the_next(tmp_path: Path) -> None:
    """A call read (and its body kept) whose writes never happened, the proxy killed after
    sending it: the next call stores its messages from the store's own record, once."""
    s = _long_session(tmp_path, 30)
    _lose_a_call(s)
    _restarted(s)
    s.tool_round("the call after")
    lost = anthropic.parse_request({"messages": s.history[-5:-3]}).messages
    stored = [f for _, f in _stored(s.memory)]
    assert [stored.count(m.fingerprint()) for m in lost] == [1, 1]
    assert len(stored) == len(set(stored))


def _request(s: Session) -> Any:
    return to_request({
        "method": "POST", "path": "/v1/messages",
        "headers": [["x-api-key", "k"], ["x-perpetuity-user", "dev"],
                    ["x-perpetuity-conversation", "now"]],
        "body": {"model": "m", "max_tokens": 100, "messages": s.asked, "tools": s.tools}})


_ITEMS = {
    "chat": st.sampled_from([
        {"role": "system", "content": "cwd: /w"}, {"role": "developer", "content": "d"},
        {"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"}, "not a message"]),
    "responses": st.sampled_from([
        {"type": "message", "role": "developer", "content": "d"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "s"}]},
        {"type": "message", "role": "user", "content": "u"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "reasoning", "summary": [{"text": "r"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
        {"type": "compaction_trigger"}, {"type": "additional_tools"}, 7]),
    "gemini": st.sampled_from([
        {"role": "user", "parts": [{"text": "u"}]},
        {"role": "model", "parts": [{"functionCall": {"name": "f", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {"o": 1}}}]},
        {"role": "model", "parts": [{"text": "t", "thought": True}, {"text": "a"}]}, [1]]),
}
_ITEMS["anthropic"] = st.sampled_from([
    {"role": "system", "content": "agents"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "r"}]},
    "not a message"])
_HISTORY = {"chat": "messages", "responses": "input", "gemini": "contents",
            "anthropic": "messages"}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(_ITEMS)), st.data())
def test_every_wire_reads_on_from_what_it_read_as_it_reads_the_whole(wire: str,
                                                                    data: st.DataObject) -> None:
    """Every wire reads a body from the messages an earlier body
    read (the same objects, wire.seen's `reused`) as they read it whole: the same messages,
    raw indexes, system prompt, standing entries and compaction."""
    adapter = ADAPTERS[{"chat": Protocol.CHAT, "responses": Protocol.RESPONSES,
                        "gemini": Protocol.GEMINI, "anthropic": Protocol.ANTHROPIC}[wire]]
    items = st.lists(_ITEMS[wire].map(lambda i: json.loads(json.dumps(i))), max_size=8)
    before, after = data.draw(items), data.draw(items)
    reused = data.draw(st.integers(0, len(before)))
    key = _HISTORY[wire]
    known = adapter.parse_request({key: before, "instructions": "i"})
    body = {key: before[:reused] + after, "instructions": "i"}
    assert adapter.parse_request(body, known, reused) == adapter.parse_request(body)


def test_the_kept_shape_is_read_from_the_standing_messages_alone() -> None:
    """Claude Code's request shape (memory.storage.templates) taken from its first user message
    and its system-role messages, found as the body was read, is the shape of the whole body."""
    captures = sorted((SHARED / "fixtures" / "harness" / "claude-code").glob("*-messages-*.json"))
    if not captures:
        pytest.skip(f"no Claude Code captures under {SHARED}")
    for path in [p for p in captures if not p.name.endswith(".response.json")]:
        body = json.loads(path.read_text())["body"]
        later = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}] * 3
        for history in (body["messages"] + later, [{"role": "system", "content": "agents"},
                                                   *body["messages"], *later,
                                                   {"role": "system", "content": "x"}]):
            whole = {**body, "messages": history}
            parsed = anthropic.parse_request(whole)
            assert (templates.shape(pipeline._shaped(whole, parsed), [])
                    == templates.shape(whole, [])), path.name


def test_what_follows_the_history_is_the_same_objects_while_its_text_is() -> None:
    """A harness's system prompt and tools follow its messages, the same every call: read once
    and handed back as the same objects (what is walked or written of them is then kept), and
    read anew the moment their text changes; either way the body is what json.loads reads."""
    reader = Seen()
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}"}
             for i in range(1, 8)]
    calls = [_body(turns[:3]), _body(turns[:5]), {**_body(turns), "tools": [{"name": "Write"}]}]
    reads = []
    for body in calls:
        raw = json.dumps(body).encode()
        read = reader.read(raw)
        assert read.data == json.loads(raw)
        reader.keep(read, None)
        reads.append(read)
    first, second, third = (r.data for r in reads)
    assert reads[1].reused and reads[2].reused  # each read on from the one before
    assert second["tools"] is first["tools"] and second["system"] is first["system"]
    assert third["tools"] is not second["tools"] and third["system"] is not second["system"]
