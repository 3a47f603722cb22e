"""The relay on its own, in-process: keep-alive pings while a slow tool runs, a connection
mitmproxy reuses, and a job's capture written once whatever paths reach it."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest

from perpetuity_core.memory.schema import open_memory
from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve import relay as relay_module
from perpetuity_core.serve.exchange import HttpRequest, Job, PendingTurn
from perpetuity_core.serve.http11 import Http11
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.serve.relay import JOB_HEADER, Relay
from perpetuity_core.serve.upstream import Request
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire.conversation import Message, Protocol, Provider, Reply, Usage, text_part
from perpetuity_core.wire.protocols import ADAPTERS
from tests.fake_provider import Error, FakeProvider, Text, ToolCall


class CaptureLog:
    """The writes a capture made, in the order it made them (no database)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def store_turn(self, p: PendingTurn) -> Any:
        self.log.append(("turn", p.conversation))
        return p.conversation

    def store_reply(self, turn: Any, reply: Reply, at: float,
                    pending: PendingTurn | None = None) -> None:
        self.log.append(("reply", "".join(p.text for p in reply.message.parts)))


class Inline(Executor):
    """An executor that runs each write at once, on the caller's thread."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as e:
            done.set_exception(e)
        return done


def _job(fake: FakeProvider | None, body: dict[str, Any], **options: Any) -> Job:
    url = (fake.url if fake else "http://upstream.test") + "/v1/messages"
    return Job(method="POST", url=url, headers=[("x-api-key", "k")],
               body=json.dumps(body).encode(), protocol=Protocol.ANTHROPIC,
               pending=PendingTurn(user="u", conversation="c", provider="anthropic", model="m",
                                   messages=[], at=0.0), **options)


def test_a_capture_writes_each_step_once_and_in_order() -> None:
    """Sent and replied are reached from many paths (each chunk, the end, a fallback, the
    addon's hooks): a step that already ran is a no-op, and a reply is never stored before
    its request."""
    job = _job(None, {}, stream=False)
    reply = Reply(Message("assistant", (text_part("Hello."),)), Usage())
    written = CaptureLog()
    capture = Capture(job, written, Inline())
    capture.replied(None)  # an unreadable reply: the request alone
    capture.sent()
    capture.replied(reply)
    capture.replied(reply)
    capture.sent()
    assert written.log == [("turn", "c"), ("reply", "Hello.")]
    first = CaptureLog()
    Capture(job, first, Inline()).replied(reply)
    assert first.log == [("turn", "c"), ("reply", "Hello.")]  # its request written before it


async def _exchange(fake: FakeProvider) -> bytes:
    # The tool returns once the client has seen two pings. The round with our call is hidden
    # and the provider pings once a reply, so at least one of the two is the relay's own.
    pinged = asyncio.Event()

    async def slow_tool(name: str, arguments: object, memory: TurnMemory) -> str:
        await asyncio.wait_for(pinged.wait(), 20)
        return "nothing found"

    relay = Relay(slow_tool)
    await relay.start()
    body = {"model": "claude-opus-4-8", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "what did I say?"}]}
    specs = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
             for t in tools.TOOLS]
    job = _job(fake, body, stream=True, memory=TurnMemory(1, None, 0.0), tool_specs=specs)
    token = relay.submit(Capture(job, CaptureLog(), Inline()))
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    # The relay keeps its connection to mitmproxy alive: read to the body's last chunk.
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(65536), 20)
        assert chunk, raw
        raw += chunk
        if raw.count(b"event: ping") >= 2:
            pinged.set()
    writer.close()
    await writer.wait_closed()
    await relay.stop()
    return raw


def test_pings_keep_the_stream_alive_while_a_tool_runs() -> None:
    with FakeProvider() as fake:
        fake.script(ToolCall("memory_search", {"query": "x"}, call_id="toolu_slow"), Text("Done."))
        raw = asyncio.run(_exchange(fake))
    # Pings while the tool ran, before the next round's first block; then the provider's own.
    second_ping = raw.index(b"event: ping", raw.index(b"event: ping") + 1)
    assert raw.index(b"event: content_block_start") > second_ping
    assert raw.count(b"event: ping", raw.index(b"event: content_block_start")) == 1
    assert raw.count(b"event: message_start") == 1 and raw.count(b"event: message_stop") == 1
    assert b"memory_search" not in raw


async def _after_a_chunked_request(fake: FakeProvider, written: CaptureLog) -> tuple[bytes, bytes]:
    relay = Relay(None)  # type: ignore[arg-type]
    await relay.start()
    body = {"model": "claude-opus-4-8", "max_tokens": 20,
            "messages": [{"role": "user", "content": "hello"}]}
    token = relay.submit(Capture(_job(fake, body, stream=False), written,
                                 Inline()))
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    # Two requests on one connection, as mitmproxy reuses it: the first one's body chunked
    # (its job unknown), the second a real job.
    writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-perpetuity-job: nothing\r\n"
                 b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"unknown relay job"), 20)
    second = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
    writer.close()
    await writer.wait_closed()
    await relay.stop()
    return first, second


def test_a_chunked_request_body_is_read_whole() -> None:
    with FakeProvider() as fake:
        fake.script(Text("Hi there."))
        written = CaptureLog()
        first, second = asyncio.run(_after_a_chunked_request(fake, written))
    assert first.startswith(b"HTTP/1.1 502 ")
    # The second request reached its job: the chunked body was not read as a request.
    assert second.lstrip().startswith(b"HTTP/1.1 200 "), second[:200]
    assert b"Hi there." in second
    # Every chunk, the end and the clean-up reach the capture: one write each, in order.
    assert written.log == [("turn", "c"), ("reply", "Hi there.")]


def test_the_first_round_is_built_when_preparing_as_the_relay_built_it(tmp_path: Path) -> None:
    """The tool loop's first body comes made from the preparing thread (the event loop sends
    it as it is): the same bytes as the relay's own reading, adding and writing of the request,
    the last round's tool_choice included when there is only one."""
    for rounds in (4, 1):
        store = open_memory(tmp_path / f"m{rounds}.db")
        pipeline = Pipeline(store, Settings(upstreams={Provider.ANTHROPIC: "https://a.test",
                                                       Provider.OPENAI: "https://o.test"},
                                            tool_rounds=rounds))

        def request(conversation: str, text: str) -> HttpRequest:
            body = {"model": "m", "max_tokens": 9, "stream": True,
                    "messages": [{"role": "user", "content": text}]}
            return HttpRequest("POST", "api.anthropic.com", "/v1/messages", (
                ("x-api-key", "sk-ant-k"), ("x-perpetuity-user", "ann"),
                ("x-perpetuity-conversation", conversation)), json.dumps(body).encode(), False)

        first = pipeline.prepare(request("earlier", "The vault code is 4471 — ünïcode."))
        assert first.job is not None
        turn = pipeline.store_turn(first.job.pending)
        pipeline.store_reply(turn, Reply(Message("assistant", (text_part("Noted."),)), Usage()),
                             1.0)
        job = pipeline.prepare(request("now", "What is the vault code?")).job
        assert job is not None and job.relay and job.first_round is not None
        built = ADAPTERS[Protocol.ANTHROPIC].add_tools(json.loads(job.body), job.tool_specs,
                                                       rounds == 1)
        assert job.first_round == json.dumps(built).encode()
        assert ("tool_choice" in json.loads(job.first_round)) == (rounds == 1)
        store.close()


async def _held_at_the_first_bytes(fake: FakeProvider, written: CaptureLog,
                                   memory: TurnMemory | None) -> tuple[bytes, list, bytes]:
    relay = Relay(None)  # type: ignore[arg-type]
    await relay.start()
    body = {"model": "claude-opus-4-8", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}
    specs = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
             for t in tools.TOOLS] if memory else []
    job = _job(fake, body, stream=True, memory=memory, tool_specs=specs)
    job.forwarded = asyncio.Event()
    token = relay.submit(Capture(job, written, Inline()))
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"event: message_start"), 20)
    first += await asyncio.wait_for(reader.readuntil(b"\n\n"), 20)
    await asyncio.sleep(0.2)  # the relay, given time, goes no further
    held = list(written.log)
    job.forwarded.set()  # mitmproxy has them on their way
    rest = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
    writer.close()
    await writer.wait_closed()
    await relay.stop()
    return first, held, rest


@pytest.mark.parametrize("memory", [None, TurnMemory(1, None, 0.0)], ids=["plain", "tool loop"])
def test_the_relay_goes_on_once_its_first_bytes_are_passed_on(
        monkeypatch: pytest.MonkeyPatch, memory: TurnMemory | None) -> None:
    """Nothing more is sent and nothing is queued for the store until mitmproxy has the
    first bytes on their way (the addon's Forwarded sets job.forwarded), then all of it, the
    request stored before its reply."""
    monkeypatch.setattr(relay_module, "FORWARD_WAIT", 30.0)
    with FakeProvider() as fake:
        fake.script(Text("Hi there.", chunks=3))
        written = CaptureLog()
        first, held, rest = asyncio.run(_held_at_the_first_bytes(fake, written, memory))
    assert first.startswith(b"HTTP/1.1 200 ") and b"content_block" not in first
    assert held == []
    assert b"event: message_stop" in rest
    assert written.log == [("turn", "c"), ("reply", "Hi there.")]


def test_the_relays_upstream_calls_make_no_log_records(caplog: pytest.LogCaptureFixture) -> None:
    """mitmdump sets the root logger to DEBUG: httpcore made a record at every step of every
    upstream call, and httpx one a request, each through mitmproxy's handlers (4% of a relayed
    request's CPU, issue 24). The relay's exchange makes none (asyncio's note of its selector,
    at the loop's start, aside)."""
    caplog.set_level(logging.DEBUG)
    with FakeProvider() as fake:
        fake.script(Text("Hi there."))
        asyncio.run(_after_a_chunked_request(fake, CaptureLog()))
    assert not [r for r in caplog.records if r.name != "asyncio"]


async def _begun(fake: FakeProvider, written: CaptureLog, memory: TurnMemory | None,
                 deliver: bool) -> bytes:
    """A job submitted and begun as the addon does; then claimed by mitmproxy's request, or
    dropped as the addon does when its flow ends first."""
    relay = Relay(None)  # type: ignore[arg-type]
    await relay.start()
    body = {"model": "claude-opus-4-8", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}
    job = _job(fake, body, stream=True, memory=memory, first_round=json.dumps(body).encode()
               if memory else None)
    token = relay.submit(Capture(job, written, Inline()))
    relay.begin(token)
    for _ in range(400):  # the provider hears of it before anyone reaches the relay
        if fake.requests:
            break
        await asyncio.sleep(0.01)
    assert len(fake.requests) == 1
    raw = b""
    if deliver:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                     "content-length: 0\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
        writer.close()
        await writer.wait_closed()
    else:
        relay.drop(token)
        # Hung up while the relay still serves (its stop would close every connection).
        await asyncio.to_thread(fake.wait_hung_up, fake.requests[0])
    await relay.stop()
    return raw


@pytest.mark.parametrize("memory", [None, TurnMemory(1, None, 0.0)], ids=["plain", "tool loop"])
def test_the_upstream_call_begins_before_mitmproxy_reaches_the_relay(
        memory: TurnMemory | None) -> None:
    """Issue 24: the addon begins the job's first upstream call as it points the flow at the
    relay, so mitmproxy's hop to the relay no longer comes before the provider's work; the
    relay then reads that call's reply, and makes no second one."""
    with FakeProvider() as fake:
        fake.script(Text("Hi there.", chunks=3))
        written = CaptureLog()
        raw = asyncio.run(_begun(fake, written, memory, deliver=True))
        assert len(fake.requests) == 1
    assert raw.startswith(b"HTTP/1.1 200 ") and b"event: message_stop" in raw
    assert written.log == [("turn", "c"), ("reply", "Hi there.")]


def test_a_job_its_flow_never_delivers_has_its_upstream_call_stopped() -> None:
    """A flow that ended before mitmproxy reached the relay (the client gone, another addon's
    answer): the call begun for it is closed, not left streaming a billed reply to no one."""
    with FakeProvider() as fake:
        fake.script(Text("Hi there. " * 200, chunks=200))
        written = CaptureLog()
        asyncio.run(_begun(fake, written, None, deliver=False))
    assert written.log == []


class Sent:
    """The relay's side toward mitmproxy, as written (no socket)."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def start(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        pass

    def send(self, data: bytes) -> None:
        self.chunks.append(data)

    async def drain(self) -> None:
        pass

    async def end(self) -> None:
        pass

    def hung_up(self) -> bool:
        return False


class OneReadResponse:
    """A streamed reply that arrives whole, in one read (upstream.Response's reading side)."""

    status_code, reason_phrase = 200, "OK"
    headers = [("content-type", "text/event-stream")]

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def aiter_raw(self) -> Any:
        yield self.raw

    async def aclose(self) -> None:
        pass


class OneRead:
    """An upstream whose whole streamed reply arrives in one read."""

    tool_timeout = 1.0

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def request(self, job: Job, body: bytes) -> Request:
        return Request(job.method, job.url, [], body)

    async def send(self, request: Request) -> OneReadResponse:
        return OneReadResponse(self.raw)

    async def forward(self, capture: Capture, http: Any, begun: Any = None) -> bool:
        raise AssertionError("no fallback expected")

    async def run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        raise AssertionError("no tool expected")


def test_what_one_upstream_read_brings_goes_on_as_one_chunk() -> None:
    """Issue 24: the tool loop wrote each event on its own, so mitmproxy and the client
    handled a chunk per event where mitmproxy's own path hands on what each read brought."""
    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    raw = b"".join([
        event("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
            "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}),
        event("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}}),
        event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                      "delta": {"type": "text_delta", "text": "Hi."}}),
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                "usage": {"output_tokens": 2}}),
        event("message_stop", {"type": "message_stop"})])
    job = _job(None, {"model": "m", "stream": True, "messages": []}, stream=True,
               memory=TurnMemory(1, None, 0.0))
    written, sent = CaptureLog(), Sent()
    loop = relay_module.ToolLoop(OneRead(raw), Capture(job, written, Inline()), sent)  # type: ignore[arg-type]
    assert asyncio.run(loop.run())
    assert b"event: message_start" in sent.chunks[0] and b"event: content_block_stop" in sent.chunks[0]
    assert b"".join(sent.chunks).count(b"event: ") == 6
    assert written.log == [("turn", "c"), ("reply", "Hi.")]


async def _delivered(relay: Relay, token: str) -> None:
    """The job `token` fetched from the relay as mitmproxy does, its whole reply read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
    writer.close()
    await writer.wait_closed()


async def _two_calls_apart(fake: FakeProvider, pause: float) -> None:
    relay = Relay(None)  # type: ignore[arg-type]
    await relay.start()
    for n in range(2):
        body = {"model": "claude-opus-4-8", "max_tokens": 20,
                "messages": [{"role": "user", "content": f"call {n}"}]}
        token = relay.submit(Capture(_job(fake, body, stream=False), CaptureLog(), Inline()))
        await _delivered(relay, token)
        if not n:
            await asyncio.sleep(pause)
    # Still open after the second call: the first call's connection carried it.
    await asyncio.to_thread(_still_open, fake)
    await relay.stop()


def _still_open(fake: FakeProvider) -> None:
    with pytest.raises(TimeoutError):
        fake.wait_hung_up(fake.requests[0], timeout=0.5)


def test_the_connection_to_the_provider_outlives_a_pause_between_calls() -> None:
    """A harness pauses longer than httpx's 5 s (its default) between calls (a tool running, its user
    reading): the relay's next call must not pay a new connection's handshakes (issue 24)."""
    with FakeProvider() as fake:
        fake.script(Text("One."), Text("Two."))
        asyncio.run(_two_calls_apart(fake, 6.0))
        assert len(fake.requests) == 2


async def _two_clients(fake: FakeProvider) -> None:
    relay = Relay(None)  # type: ignore[arg-type]
    await relay.start()
    for key in ("sk-ant-first", "sk-ant-second"):
        body = {"model": "claude-opus-4-8", "max_tokens": 20,
                "messages": [{"role": "user", "content": "hello"}]}
        job = _job(fake, body, stream=False)
        job.headers = [("x-api-key", key)]
        token = relay.submit(Capture(job, CaptureLog(), Inline()))
        await _delivered(relay, token)
    await relay.stop()


def test_the_provider_is_offered_only_encodings_the_reply_reader_reads() -> None:
    """The client's accept-encoding is dropped (the reply is read to store it); httpx's own
    offer then named br and zstd, which ReplyTee cannot read: such a reply went unstored."""
    with FakeProvider() as fake:
        fake.script(Text("Hi."), Text("Hi."))
        asyncio.run(_two_clients(fake))
        offered = [r.headers.get("accept-encoding", "") for r in fake.requests]
    assert len(offered) == 2
    for header in offered:
        assert {e.strip() for e in header.split(",") if e.strip()} <= {"gzip", "deflate"}


def test_a_providers_cookie_never_rides_on_another_clients_request() -> None:
    """The relay's one client serves every tenant: a cookie the provider set on one client's
    reply (an edge's bot-management cookie) was kept and sent on the next client's request,
    which mitmproxy's own path never does."""
    with FakeProvider() as fake:
        fake.script(Error(429, headers={"Set-Cookie": "edge=first-client; Path=/"}), Text("Hi."))
        asyncio.run(_two_clients(fake))
        first, second = fake.requests
    assert first.headers["x-api-key"] == "sk-ant-first"
    assert "cookie" not in second.headers


class Writes:
    """What a StreamWriter was asked to write, one entry a call (no socket)."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def write(self, data: bytes) -> None:
        self.calls.append([bytes(data)])

    def writelines(self, data: list[bytes]) -> None:
        self.calls.append([bytes(d) for d in data])

    def is_closing(self) -> bool:
        return False

    async def drain(self) -> None:
        pass


async def _replied(first_chunk_at_hand: bool) -> list[list[bytes]]:
    reader = asyncio.StreamReader()
    reader.feed_data(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    writes = Writes()
    http = Http11(reader, writes)  # type: ignore[arg-type]
    assert await http.request(b"x-perpetuity-job") == ""
    http.start(200, "OK", [("content-type", "text/event-stream")])
    if not first_chunk_at_hand:
        await asyncio.sleep(0)  # the relay waits on upstream
    http.send(b"event: ping\ndata: {}\n\n")
    await http.end()
    return writes.calls


def test_a_replys_head_goes_out_with_its_first_chunk_when_that_is_at_hand() -> None:
    """A provider's head and first events come in one read: written apart, they cost
    mitmproxy a turn of its event loop between them before the client's first byte. The
    head never waits on upstream: alone, it goes on the loop's next turn."""
    together, apart = asyncio.run(_replied(True)), asyncio.run(_replied(False))
    head_and_chunk = b"".join(together[0])
    assert head_and_chunk.startswith(b"HTTP/1.1 200 ") and b"event: ping" in head_and_chunk
    head = b"".join(apart[0])
    assert head.startswith(b"HTTP/1.1 200 ") and b"event: ping" not in head
    assert b"event: ping" in b"".join(apart[1])
