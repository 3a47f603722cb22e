"""The addon's hooks called directly (mitmproxy's test flows): how it fails and what mitmweb
shows."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.flowstate import STATE, FlowState
from perpetuity_core.serve.pipeline import INLINE_BODY, INLINE_MESSAGES, Pipeline
from perpetuity_core.serve.reading import RequestReader
from perpetuity_core.serve.relay import JOB_HEADER
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire.conversation import Message, Provider, text_part
from tests.addons import Perpetuity


def direct_flow(body: bytes) -> tflow.http.HTTPFlow:
    flow = tflow.tflow()
    flow.request.host, flow.request.port, flow.request.path = "127.0.0.1", 8080, "/v1/messages"
    flow.request.method = "POST"
    flow.request.headers["x-api-key"] = "sk-ant-k"
    flow.request.headers["x-perpetuity-user"] = "addon"
    flow.request.content = body
    flow.client_conn.sockname = ("127.0.0.1", 8080)
    return flow


def test_a_failing_pipeline_still_routes_the_request_untouched(tmp_path: Path, monkeypatch) -> None:
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")

        def broken(self: Pipeline, req: object) -> None:
            raise RuntimeError("a bug in the memory pipeline")

        monkeypatch.setattr(Pipeline, "decide", broken)
        body = b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "hi"}]}'
        flow = direct_flow(body)
        asyncio.run(addon.request(flow))
        assert flow.request.url == "http://upstream.test:9/v1/messages"
        assert flow.request.content == body and "x-perpetuity-user" not in flow.request.headers
        assert flow.response is None  # forwarded, not answered


def test_mitmweb_shows_the_real_destination_not_the_relay(tmp_path: Path) -> None:
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"))
        flow = direct_flow(b"{}")
        sent = flow.request.headers.fields
        flow.request.url = "http://127.0.0.1:5555/v1/messages"
        flow.request.headers = http.Headers(host="127.0.0.1:5555", **{JOB_HEADER: "token"})
        flow.metadata[STATE] = FlowState(upstream="https://api.anthropic.com/v1/messages",
                                         relayed=True, headers=sent)
        asyncio.run(addon.response(flow))
        assert flow.request.url == "https://api.anthropic.com/v1/messages"
        assert JOB_HEADER not in flow.request.headers
        assert flow.request.headers["x-api-key"] == "sk-ant-k"  # as the client sent them


def test_every_path_that_reaches_a_write_makes_it_once(tmp_path: Path, monkeypatch) -> None:
    """The tee's first chunk, the body's end, the response hook and a late error hook all reach
    the capture: the request is stored once, then its reply once, and no live state is left."""
    writes: list[str] = []
    store_turn, store_reply = Pipeline.store_turn, Pipeline.store_reply

    def counted_turn(self: Pipeline, p: Any) -> Any:
        writes.append("turn")
        return store_turn(self, p)

    def counted_reply(self: Pipeline, *args: Any) -> None:
        writes.append("reply")
        store_reply(self, *args)

    monkeypatch.setattr(Pipeline, "store_turn", counted_turn)
    monkeypatch.setattr(Pipeline, "store_reply", counted_reply)
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"), perpetuity_tools=False,
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        flow = direct_flow(b'{"model": "claude-opus-4-8", "max_tokens": 20, '
                           b'"messages": [{"role": "user", "content": "hi"}]}')
        answer = (b'{"id": "msg_1", "type": "message", "role": "assistant", "model": "m", '
                  b'"stop_reason": "end_turn", "content": [{"type": "text", "text": "Hello."}], '
                  b'"usage": {"input_tokens": 1, "output_tokens": 1}}')

        async def hooks() -> None:
            await addon.request(flow)
            flow.response = http.Response.make(200, b"", {"content-type": "application/json"})
            addon.responseheaders(flow)
            stream = flow.response.stream
            assert callable(stream)
            stream(answer[:40])
            stream(answer[40:])
            await asyncio.sleep(0)  # the first chunk's write, queued after it went out
            stream(b"")
            await addon.response(flow)
            await addon.error(flow)

        asyncio.run(hooks())
        addon.executor.submit(lambda: None).result()  # the store's thread is done
        assert writes == ["turn", "reply"]
        assert STATE not in flow.metadata


def test_a_relayed_request_goes_to_the_relay_without_its_body(tmp_path: Path) -> None:
    """The job carries the body upstream: mitmproxy sends the relay none (issue 24: a coding
    session's requests grow to hundreds of KB, every round)."""
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        first = direct_flow(b'{"model": "claude-opus-4-8", "max_tokens": 20, "messages": '
                            b'[{"role": "user", "content": "the lighthouse keeper is Ingrid"}]}')
        answer = (b'{"id": "msg_1", "type": "message", "role": "assistant", "model": "m", '
                  b'"stop_reason": "end_turn", "content": [{"type": "text", "text": "Noted."}], '
                  b'"usage": {"input_tokens": 1, "output_tokens": 1}}')
        body = (b'{"model": "claude-opus-4-8", "max_tokens": 20, "messages": '
                b'[{"role": "user", "content": "who keeps the lighthouse?"}]}')
        second = direct_flow(body)

        async def hooks() -> None:
            await addon.request(first)  # nothing in memory yet: mitmproxy's own stream
            first.response = http.Response.make(200, b"", {"content-type": "application/json"})
            addon.responseheaders(first)
            stream = first.response.stream
            assert callable(stream)
            stream(answer)
            stream(b"")
            await addon.response(first)
            addon.executor.submit(lambda: None).result()  # stored
            await addon.request(second)

        asyncio.run(hooks())
        state = second.metadata[STATE]
        assert state.relayed and second.request.headers[JOB_HEADER]
        assert second.request.port == addon.relay.port
        assert second.request.content == b"" and second.request.headers["content-length"] == "0"
        # Nor the client's headers: the job carries them upstream.
        assert sorted(second.request.headers) == ["content-length", "host", JOB_HEADER]
        job = state.capture.job
        assert job.original == body and b"Ingrid" in job.body and job.first_round
        assert ("x-api-key", "sk-ant-k") in job.headers


_SSE = b"".join(b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(data).encode()) for kind, data in [
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Deferred, "}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "never lost."}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 4}}),
    ("message_stop", {"type": "message_stop"})])


@pytest.mark.parametrize("turn_between", [True, False])
def test_the_first_chunk_is_read_after_it_is_passed_on(tmp_path: Path, monkeypatch,
                                                       turn_between: bool) -> None:
    """On mitmproxy's stream the first chunk goes to the client before the tee reads it (its
    events decoded on the loop's next turn, not before the first byte: issue 24); a chunk or
    the body's end coming first reads it first, so the reply stored is whole."""
    replies: list[Any] = []
    store_reply = Pipeline.store_reply

    def kept(self: Pipeline, turn: Any, reply: Any, *args: Any) -> None:
        replies.append(reply)
        store_reply(self, turn, reply, *args)

    monkeypatch.setattr(Pipeline, "store_reply", kept)
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"), perpetuity_tools=False,
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        flow = direct_flow(b'{"model": "claude-opus-4-8", "max_tokens": 20, "stream": true, '
                           b'"messages": [{"role": "user", "content": "hi"}]}')
        cut = _SSE.index(b"never")

        async def hooks() -> None:
            await addon.request(flow)
            flow.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
            addon.responseheaders(flow)
            stream, tee = flow.response.stream, flow.metadata[STATE].tee
            assert callable(stream)
            fed: list[object] = []
            real = tee._assembler.feed
            tee._assembler.feed = lambda ev: (fed.append(ev), real(ev))[1]
            assert stream(_SSE[:cut]) == _SSE[:cut]
            assert fed == []  # passed on unread
            if turn_between:
                await asyncio.sleep(0)
                assert len(fed) == 3  # read on the loop's next turn
            assert stream(_SSE[cut:]) == _SSE[cut:]
            stream(b"")
            await addon.response(flow)

        asyncio.run(hooks())
        addon.executor.submit(lambda: None).result()  # the store's thread is done
        assert [p.text for p in replies[0].message.parts] == ["Deferred, never lost."]


class Counted(ThreadPoolExecutor):
    """The preparing thread, counting what is sent to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_pass_through_never_waits_for_the_preparing_thread(tmp_path: Path) -> None:
    """`x-perpetuity: off` and another host's traffic through us are decided on the event loop
    (issue 24: each request paid two thread hops, and the body was parsed to be passed on); a
    request that may be framed still goes to the preparing thread."""
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        counted = addon.parser.thread = Counted()
        body = b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "hi"}]}'
        off = direct_flow(body)
        off.request.headers["x-perpetuity"] = "off"
        other = tflow.tflow()  # through us to a host that is no provider
        other.request.host, other.request.path = "example.com", "/v1/messages"
        asyncio.run(addon.request(off))
        asyncio.run(addon.request(other))
        assert counted.submitted == 0
        assert off.request.url == "http://upstream.test:9/v1/messages"
        assert off.request.content == body
        assert "x-perpetuity" not in off.request.headers
        assert "x-perpetuity-user" not in off.request.headers
        assert other.request.host == "example.com" and STATE not in other.metadata
        asyncio.run(addon.request(direct_flow(body)))
        assert counted.submitted == 1
        counted.shutdown()


class Busy(Counted):
    """The preparing thread while another request is being prepared on it (the lock held),
    until it takes this one."""

    def __init__(self, addon: Perpetuity) -> None:
        super().__init__()
        self.addon = addon

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        self.addon.parser._lock.release()
        return super().submit(fn, *args, **kwargs)


def test_capture_alone_is_prepared_on_the_loop_when_the_thread_is_idle(tmp_path: Path) -> None:
    """Recall off, a small body is read where it arrived: no thread hop (issue 24). A large
    body, a curate command, recall on, or another request being prepared (the pipeline's caches
    are one thread's) still go to the preparing thread."""
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        counted = addon.parser.thread = Counted()

        def captured(body: bytes, recall: str = "off") -> http.HTTPFlow:
            flow = direct_flow(body)
            flow.request.headers["x-perpetuity-recall"] = recall
            asyncio.run(addon.request(flow))
            return flow

        flow = captured(_CLAUDE)
        assert counted.submitted == 0
        state = flow.metadata[STATE]
        assert state.capture is not None and not state.relayed
        assert flow.request.url == "http://upstream.test:9/v1/messages"
        assert flow.request.content == _CLAUDE and "x-perpetuity-recall" not in flow.request.headers
        big = (b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "'
               + b"x" * INLINE_BODY + b'"}]}')
        curate = b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "/perpetuity-curate"}]}'
        for body, recall in ((big, "off"), (curate, "off"), (_CLAUDE, "on")):
            captured(body, recall)
        assert counted.submitted == 3
        counted.shutdown()
        busy = addon.parser.thread = Busy(addon)
        addon.parser._lock.acquire()
        flow = captured(_CLAUDE.replace(b"hi", b"while busy"))
        assert busy.submitted == 1 and flow.metadata[STATE].capture is not None
        busy.shutdown()


_CLAUDE = b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "hi"}]}'
_GPT = b'{"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]}'
_GEMINI = "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"


@pytest.mark.parametrize(("host", "path", "direct", "headers", "body", "decided"), [
    ("127.0.0.1", "/v1/messages", True, {"x-api-key": "k", "x-perpetuity": "off"}, _CLAUDE, True),
    ("127.0.0.1", "/v1/messages", True, {"x-api-key": "k", "x-perpetuity": " OFF"}, b"{", True),
    ("127.0.0.1", "/v1/messages", True, {"x-api-key": "k"}, _CLAUDE, False),
    ("127.0.0.1", _GEMINI, True, {"x-goog-api-key": "g", "x-perpetuity": "no"}, b"{}", True),
    # Only the model tells Anthropic from OpenAI here: the preparing thread reads it.
    ("127.0.0.1", "/v1/chat/completions", True,
     {"authorization": "Bearer sk-o", "x-perpetuity": "off"}, _CLAUDE, False),
    ("127.0.0.1", "/v1/chat/completions", True,
     {"authorization": "Bearer sk-o", "x-perpetuity": "off"}, _GPT, False),
    ("127.0.0.1", "/v1/chat/completions", True, {"x-goog-api-key": "g"}, _GPT, True),  # 421
    ("127.0.0.1", "/backend-api/codex/responses", True,
     {"authorization": "Bearer t", "x-perpetuity": "off"}, _GPT, True),
    ("example.com", "/v1/messages", False, {"x-api-key": "k"}, _CLAUDE, True),
    ("api.openai.com", "/v1/responses", False,
     {"authorization": "Bearer sk-o", "x-perpetuity": "0"}, _GPT, True),
    ("api.openai.com", "/v1/responses", False, {"authorization": "Bearer sk-o"}, _GPT, False),
    ("chatgpt.com", "/backend-api/codex/responses", False, {"x-perpetuity": "off"}, _GPT, True),
    ("chatgpt.com", "/backend-api/conversation", False, {}, _GPT, True),
])
def test_what_is_decided_on_the_loop_is_what_prepare_decides(
        pipeline: Pipeline, host: str, path: str, direct: bool, headers: dict[str, str],
        body: bytes, decided: bool) -> None:
    req = HttpRequest(method="POST", host=host, path=path, headers=tuple(headers.items()),
                      body=body, direct=direct)
    understood = pipeline.understand(req)
    assert understood.done == decided and not understood.read  # no body read on the loop
    if understood.done:
        prepared = pipeline.prepare(req)
        passed = understood.decision
        assert passed == prepared and passed is not None and passed.job is None
        assert passed.body is None


def _task(rounds: int, prompts: int = 1) -> bytes:
    """A coding task as a harness sends it: `prompts` prompts, the last one's `rounds` tool
    rounds after it (each the call and its result)."""
    messages: list[dict[str, Any]] = []
    for p in range(prompts):
        if p:
            messages.append({"role": "assistant", "content": f"done with step {p - 1}"})
        messages.append({"role": "user", "content": f"fix the parser's bug, step {p}"})
    for k in range(rounds):
        messages += [{"role": "assistant", "content": [
                         {"type": "text", "text": "Reading."},
                         {"type": "tool_use", "id": f"t{k}", "name": "Read", "input": {"n": k}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": f"t{k}", "content": f"line {k}"}]}]
    return json.dumps({"model": "claude-opus-4-8", "max_tokens": 100, "stream": True,
                       "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
                       "messages": messages}).encode()


def _stored(pipeline: Pipeline, body: bytes) -> Any:
    """`prepare` of a request, its turn stored as the proxy's writer would."""
    decision = pipeline.prepare(_request(body))
    assert decision.job is not None
    pipeline.store_turn(decision.job.pending)
    return decision


def _request(body: bytes) -> HttpRequest:
    return HttpRequest("POST", "127.0.0.1", "/v1/messages",
                       (("x-api-key", "sk-ant-k"), ("x-perpetuity-user", "carried")), body,
                       direct=True)


def _same(a: Any, b: Any) -> None:
    """Two decisions that send, store and show the same."""
    assert a.note == b.note and a.body == b.body and a.route == b.route
    assert (a.job is None) == (b.job is None)
    if a.job is not None:
        assert (a.job.body, a.job.first_round, a.job.original, a.job.tool_specs) == (
            b.job.body, b.job.first_round, b.job.original, b.job.tool_specs)
        pa, pb = a.job.pending, b.job.pending
        assert (pa.messages, pa.sent_tokens, pa.shown, pa.frame_rows, pa.folder, pa.shape) == (
            pb.messages, pb.sent_tokens, pb.shown, pb.frame_rows, pb.folder, pb.shape)
        assert a.job.memory.shown == b.job.memory.shown


def test_a_carried_tool_round_is_what_prepare_decides(tmp_path: Path, monkeypatch) -> None:
    """`Pipeline.carried` decides a tool round whose plan is carried exactly as `prepare`
    does, and declines anything else (a first prompt, a new prompt of the conversation) having
    changed nothing: what `decide` then makes of what it read is what `prepare` would have,
    and the body is not read again."""
    parses: list[int] = []
    parse = RequestReader._parse

    def counted(self: RequestReader, *args: Any) -> Any:
        parses.append(1)
        return parse(self, *args)

    monkeypatch.setattr(RequestReader, "_parse", counted)
    pipelines = [Pipeline(open_memory(tmp_path / f"{side}.db"),
                          Settings(upstreams={Provider.ANTHROPIC: "https://a.test"}))
                 for side in ("carried", "prepared")]
    ours, theirs = pipelines
    first = _task(0)
    assert ours.carried(ours.understand(_request(first))) is None  # nothing read: a first prompt
    _same(_stored(ours, first), _stored(theirs, first))
    # The person's first request found no one to recall for, and left no plan to carry.
    assert ours.carried(ours.understand(_request(_task(1)))) is None
    _same(_stored(ours, _task(1)), _stored(theirs, _task(1)))
    for k in (2, 3):
        body = _task(k)
        carried = ours.carried(ours.understand(_request(body)))
        assert carried is not None and carried.job is not None
        ours.store_turn(carried.job.pending)
        _same(carried, _stored(theirs, body))
    prompt = _task(3).replace(b']}', b', {"role": "assistant", "content": "done"}, '
                               b'{"role": "user", "content": "now the tests"}]}')
    understood = ours.understand(_request(prompt))
    assert ours.carried(understood) is None  # a new prompt: the plan is not carried
    parses.clear()
    decided = ours.decide(understood)
    assert parses == []  # read once, on the loop: the thread lays it out
    assert decided.job is not None
    ours.store_turn(decided.job.pending)
    _same(decided, _stored(theirs, prompt))
    for p in pipelines:
        p.store.close()


def test_a_long_history_is_carried_on_the_loop_its_live_task_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool round is decided on the loop however long the history before its task (issue 43:
    past 600 messages every late request went to the thread, a 1-6 ms hop under load); what
    the decision walks is the live task, so a live task past INLINE_MESSAGES goes to the
    thread, and a body mostly not read before is refused before it is read."""
    ours = Pipeline(open_memory(tmp_path / "m.db"),
                    Settings(upstreams={Provider.ANTHROPIC: "https://a.test"}))
    prompts = INLINE_MESSAGES  # a history of 1,200 messages before the task
    for k in (1, 2):
        _stored(ours, _task(k, prompts=prompts))
    long = ours.carried(ours.understand(_request(_task(3, prompts=prompts))))
    assert long is not None and long.job is not None  # carried on the loop
    ours.store_turn(long.job.pending)
    rounds = INLINE_MESSAGES // 2 + 5  # a live task past INLINE_MESSAGES: the thread's
    _stored(ours, _task(rounds, prompts=prompts))
    understood = ours.understand(_request(_task(rounds + 1, prompts=prompts)))
    assert ours.carried(understood) is None and understood.turn is not None  # read, declined
    assert ours.decide(understood).job is not None
    reads = []
    monkeypatch.setattr(ours.reader.seen, "read", lambda raw, look=None: reads.append(raw))
    unread = _task(rounds + 1, prompts=prompts).replace(b"line ", b"line " + b"x" * 1000)
    assert ours.carried(ours.understand(_request(unread))) is None and reads == []
    ours.store.close()


def test_a_tool_round_is_prepared_on_the_loop_when_its_plan_is_carried(tmp_path: Path) -> None:
    """A task's tool round whose frame is carried costs less to prepare than the two thread
    hops (issue 24): it is prepared where it arrived. A first prompt, or any round while
    another request is being prepared, still goes to the preparing thread."""
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        counted = addon.parser.thread = Counted()

        def sent(body: bytes) -> http.HTTPFlow:
            flow = direct_flow(body)
            asyncio.run(addon.request(flow))
            state = flow.metadata[STATE]
            state.capture.sent()  # stored, as the relay stores it once the reply begins
            addon.executor.submit(lambda: None).result()
            return flow

        sent(_task(0))
        sent(_task(1))  # (the person's first request left no plan: see above)
        assert counted.submitted == 2
        flow = sent(_task(2))
        assert counted.submitted == 2  # the tool round: on the loop
        assert flow.metadata[STATE].relayed and flow.request.headers.get(JOB_HEADER)
        counted.shutdown()
        busy = addon.parser.thread = Busy(addon)
        addon.parser._lock.acquire()
        sent(_task(3))
        assert busy.submitted == 1
        busy.shutdown()


def test_the_memory_is_read_as_the_proxy_starts_not_by_the_first_prompt(tmp_path: Path) -> None:
    """A new proxy reads every stored row into its arena before a request asks: the first
    prompt after a start read a whole memory first (issue 24: 90-112 ms to its first byte at
    4M tokens, against 10-21 for the next)."""
    store = open_memory(tmp_path / "m.db")
    said = [Message("user", (text_part(f"turn {n} about the harbour"),)) for n in range(3)]
    capture.record(store, user_key="u", conversation_key="c", provider="anthropic", model="m",
                   messages=said, times=[0.0] * len(said), source="request")
    store.close()
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"))
        addon.executor.submit(lambda: None).result()  # what the start queued there is done
        assert addon.pipeline is not None
        assert addon.pipeline.scanner.arena.n_rows == 3


def test_a_memory_that_cannot_be_read_ahead_is_a_warning_not_a_failed_start(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """Reading ahead never fails the start: it is logged below error level (mitmdump exits on
    an error logged while starting); the first search then reads what it needs itself."""
    def broken(self: Scanner) -> int:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Scanner, "catch_up", broken)
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"))
        addon.executor.submit(lambda: None).result()
    assert any("read memory ahead" in r.message and r.levelname == "WARNING"
               for r in caplog.records)
