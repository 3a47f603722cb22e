"""The relay: a small HTTP endpoint on 127.0.0.1, inside mitmproxy's event loop, that performs a
job's upstream exchange and streams it back while capturing the reply.

mitmproxy cannot stream a body an addon produces, and its response-stream callables are
synchronous, so anything that must talk to the provider mid-reply (the recall tools' loop) lives
here: the `request` hook submits a `Job` and points the flow at this endpoint; mitmproxy streams
whatever we write to the client unbuffered.

How it fails: before upstream's first byte, a connection error becomes a 502 (what mitmproxy
itself would answer); after it, the upstream's bytes pass through exactly, and a cut upstream
cuts the client the same way. Capture can never break the stream: its errors are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import h11

from perpetuity_core.errors import UpstreamError
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.exchange import HOP_BY_HOP, Job
from perpetuity_core.serve.http11 import Http11
from perpetuity_core.serve.tee import ReplyTee
from perpetuity_core.serve.upstream import Client, Request, Response
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire.protocols import ADAPTERS
from perpetuity_core.wire.protocols.base import BodyMerging, StreamMerging
from perpetuity_core.wire.sse import SSEDecoder

log = logging.getLogger("perpetuity")

JOB_HEADER = "x-perpetuity-job"
_JOB = JOB_HEADER.encode()
_JOB_TTL = 120.0  # a job mitmproxy never delivered (client gone) is dropped after this long

# Why a flow went upstream as the client sent it after a 400 (its facts' `fell_open`).
REFUSED = "upstream refused our request (400); retried as sent"


def as_sent(status: int, original: bytes | None) -> bytes | None:
    """The body to send once more after upstream answered `status` to a request we changed
    (`original`: as the client sent it; None, we changed nothing), or None. A 400 may be our
    doing (the frame, a tool), so it is retried once, exactly as the client sent it, and that
    answer is the client's; any other answer stands. The one rule of both paths: mitmproxy's
    (the addon) and the relay's (the tool loop)."""
    if status != 400 or original is None:
        return None
    log.warning("perpetuity: upstream refused the request with our changes (400); retrying it "
                "as the client sent it")
    return original


# Runs one of our tools off the event loop: (name, arguments, the turn's memory) -> result text.
RunTool = Callable[[str, Any, TurnMemory], Awaitable[str]]

PING_EVERY = 1.0  # seconds between keep-alive pings while our tools run
# The longest the relay waits, after its first bytes, for mitmproxy to pass them on.
FORWARD_WAIT = 0.05


async def forwarded(job: Job) -> None:
    """Until mitmproxy has the relay's first bytes on their way to the client (the addon's
    stream callable sets `job.forwarded`), bounded by FORWARD_WAIT; at once if no one will.
    The relay runs on mitmproxy's event loop: a provider whose whole reply is already read
    would otherwise have the relay decode, merge and queue the writes of all of it before
    mitmproxy passed on the first chunk, and the store's writer (its thread) would compete
    with that chunk for the interpreter. The stream path's tee starts the writes after the
    first chunk is on its way (flowstate.StreamTee); this puts the relay in the same order."""
    event = job.forwarded
    if event is None or event.is_set():
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), FORWARD_WAIT)


@dataclass(slots=True)
class Begun:
    """A job's first upstream call, begun when the flow was pointed at the relay."""

    started: float  # time.time(), for the round's inspection
    request: Request
    response: asyncio.Future[Response]


@dataclass(slots=True)
class Pending:
    """A job submitted, until mitmproxy's request to the relay claims it."""

    at: float  # time.monotonic() at submission
    capture: Capture
    begun: Begun | None = None


def _discard(begun: Begun) -> None:
    """An upstream call no one will read: stopped, or its response closed (the provider bills
    what it generates)."""
    if begun.response.cancel() or begun.response.cancelled():
        return
    if begun.response.exception() is None:
        asyncio.ensure_future(begun.response.result().aclose())


class Upstream(Protocol):
    """What the tool loop asks of the relay."""

    tool_timeout: float  # seconds one tool call may take

    def request(self, job: Job, body: bytes) -> Request:
        """The job's upstream request, with this body."""
        ...

    async def send(self, request: Request) -> Response:
        """The request sent; the response's head read, its body streaming."""
        ...

    async def forward(self, capture: Capture, http: Http11, begun: Begun | None = None) -> bool:
        """The plain exchange of the job as it stands (its upstream call begun, or not)."""
        ...

    async def run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        ...


class Relay:
    def __init__(self, run_tool: RunTool) -> None:
        self._run_tool = run_tool
        self.port = 0
        self.tool_timeout = 30.0  # seconds one tool call may take (perpetuity_tool_timeout)
        self._jobs: dict[str, Pending] = {}
        self._server: asyncio.Server | None = None
        # The one client to every provider, for every tenant: it carries nothing from one
        # request to the next (no cookie), and reads no proxy from the environment (the
        # proxy's own HTTPS_PROXY would route its calls back to us).
        self._client: Client | None = None

    async def start(self) -> None:
        self._client = Client()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def client(self) -> Client | None:
        return self._client

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        for token in list(self._jobs):
            self.drop(token)
        if self._client:
            await self._client.aclose()

    def submit(self, capture: Capture) -> str:
        """The token by which mitmproxy's request to the relay names this job."""
        now = time.monotonic()
        for token in [t for t, pending in self._jobs.items() if now - pending.at > _JOB_TTL]:
            self.drop(token)
        token = secrets.token_hex(16)
        self._jobs[token] = Pending(now, capture)
        return token

    def begin(self, token: str) -> None:
        """Start the job's first upstream call now, on the event loop, while mitmproxy makes its
        way to the relay with the flow (issue 24: its hop to the relay, ~1 ms on a busy
        machine, was paid before the provider heard of the request). The tool loop's first
        round is sent as prepared; one that must still be built waits for the relay."""
        pending = self._jobs.get(token)
        if pending is None or pending.begun is not None or self._client is None:
            return  # (no client: the relay is not serving, and the flow will find no one)
        job = pending.capture.job
        body = job.body if job.memory is None else job.first_round
        if body is None:
            return
        request = self.request(job, body)
        pending.begun = Begun(time.time(), request, asyncio.ensure_future(self.send(request)))

    def drop(self, token: str) -> None:
        """A job mitmproxy will not deliver (its flow ended first): forgotten, and its upstream
        call, if begun, stopped. A job already claimed is the relay's: nothing happens."""
        pending = self._jobs.pop(token, None)
        if pending is not None and pending.begun is not None:
            _discard(pending.begun)

    def request(self, job: Job, body: bytes) -> Request:
        return Request(job.method, job.url, job.headers, body)

    async def send(self, request: Request) -> Response:
        assert self._client is not None
        return await self._client.send(request)

    async def run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        return await self._run_tool(name, arguments, memory)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One mitmproxy server connection; kept alive across requests, as mitmproxy reuses it."""
        http = Http11(reader, writer)
        try:
            while (token := await http.request(_JOB)) is not None:
                pending = self._jobs.pop(token, None)
                if pending is None:
                    await http.respond(502, b"perpetuity: unknown relay job")
                elif not await self._exchange(pending.capture, http, pending.begun):
                    return
        except (h11.ProtocolError, ConnectionError):
            pass
        except asyncio.CancelledError:
            # Shutdown: a cancelled connection callback would be logged as an error by asyncio's
            # streams, and there is no one left to tell.
            pass
        except Exception:
            log.exception("perpetuity: relay failure")
        finally:
            if not writer.is_closing():
                writer.close()

    async def _exchange(self, capture: Capture, http: Http11, begun: Begun | None) -> bool:
        """Relay one exchange; False when the connection to mitmproxy can no longer be used."""
        if capture.job.memory is not None:
            return await ToolLoop(self, capture, http, begun).run()
        return await self.forward(capture, http, begun)

    async def forward(self, capture: Capture, http: Http11, begun: Begun | None = None) -> bool:
        """The plain exchange: upstream's bytes to the client as they come."""
        job = capture.job
        try:
            resp = await (begun.response if begun else self.send(self.request(job, job.body)))
        except UpstreamError as e:
            capture.sent()
            await http.respond(502, f"perpetuity: upstream {job.url} failed: {e}".encode())
            return True
        tee = ReplyTee(job, resp.header("content-encoding")) if resp.status_code < 400 else None
        try:
            # Always chunked, so the reply can be handed to the store before the client sees
            # its end: the harness's next request must find it stored (one writer, in order).
            _start(http, resp)  # (its head goes out with the first chunk, if that is here)
            first = True
            async for chunk in resp.aiter_raw():
                if not chunk:
                    continue
                http.send(chunk)
                if tee:
                    tee.feed(chunk)
                await http.drain()
                if first:
                    # Once the first bytes are on their way, so the write never delays them.
                    first = False
                    await forwarded(job)
                    capture.sent()
            _reply(capture, tee)  # the request, then its reply, before the client sees the end
            tee = None
            await http.end()
        except UpstreamError:
            # The provider cut the stream: cut the client the same way, keep what came.
            http.abort()
            return False
        except ConnectionError:
            return False  # the client went away; closing the upstream response stops the provider
        finally:
            await resp.aclose()
            _reply(capture, tee)
        return True


def _reply(capture: Capture, tee: ReplyTee | None) -> None:
    """The request's write, and the reply's when the tee read one. Never raises: capture can
    never break the stream."""
    try:
        capture.replied(tee.reply() if tee else None)
    except Exception:
        log.exception("perpetuity: could not store the reply")


@dataclass(slots=True)
class Round:
    """One upstream exchange of the tool loop, as it happened: what the client never sees,
    kept by reference for inspection (the addon shows each as its own flow)."""

    started: float
    body: bytes  # the request as it went upstream, our tools added
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)  # the provider's reply's
    raw: list[bytes] = field(default_factory=list)  # the provider's reply bytes, as read
    ended: float = 0.0
    calls: list[tuple[str, str, Any]] = field(default_factory=list)  # ours: (id, name, arguments)
    results: list[tuple[str, str]] = field(default_factory=list)  # (id, answer)


class ToolLoop:
    """One reply the client sees, made of as many upstream rounds as our tools need.

    Each round streams through a merger that hides calls to our tools and renumbers what it
    forwards; when a round ends with only our calls, they run (off the event loop, with
    keep-alive pings) and the provider is called again with the calls and their results. The
    last allowed round must answer. Before the client has seen a byte, any failure falls back
    to the plain exchange; after, it ends the stream with the protocol's error event.
    """

    def __init__(self, upstream: Upstream, capture: Capture, http: Http11,
                 begun: Begun | None = None) -> None:
        self.upstream, self.capture, self.http = upstream, capture, http
        self.begun = begun  # the first round's upstream call, already on its way
        self.job = job = capture.job
        self.adapter = ADAPTERS[job.protocol]
        self.merger = (self.adapter.StreamMerger if job.stream else self.adapter.BodyMerger)(
            frozenset(str(t["name"]) for t in job.tool_specs))
        self.tee = ReplyTee(job, "")
        self.started = False  # the client has seen the response head
        self.forwarded = False  # mitmproxy passed on our first bytes (or we stopped waiting)
        self.round = Round(0.0, b"")  # the round in progress

    async def run(self) -> bool:
        job, upstream, capture = self.job, self.upstream, self.capture
        assert job.memory is not None
        body: dict[str, Any] | None = None  # the request's JSON, read when a round follows
        specs = job.tool_specs
        try:
            for round_ in range(job.max_rounds):
                last = round_ == job.max_rounds - 1
                begun, self.begun = self.begun, None
                if begun is None:
                    if round_ == 0 and job.first_round is not None:
                        content = job.first_round  # built when preparing, off the event loop
                    else:
                        body = json.loads(job.body) if body is None else body
                        content = json.dumps(self.adapter.add_tools(body, specs, last)).encode()
                    request = upstream.request(job, content)
                    self.round = Round(time.time(), request.content)
                    job.rounds.append(self.round)
                    resp = await upstream.send(request)
                else:
                    self.round = Round(begun.started, begun.request.content)
                    job.rounds.append(self.round)
                    resp = await begun.response
                self.round.status, self.round.headers = resp.status_code, resp.headers
                try:
                    # Our tools changed even a body we left alone: the client's own goes.
                    if round_ == 0 and (original := as_sent(resp.status_code,
                                                            job.original or job.body)) is not None:
                        return await self._as_sent(original)
                    if resp.status_code >= 400:
                        return await self._upstream_error(resp)
                    await self._round(resp)
                finally:
                    await resp.aclose()
                    self.round.ended = time.time()
                calls = self.merger.our_calls()
                if not calls or self.merger.others_called() or last:
                    break
                self.round.calls = calls
                results = await self._run_tools(calls)
                if results is None:
                    return False  # the client went away: no further upstream call
                self.round.results = results
                body = self.adapter.continue_body(json.loads(job.body) if body is None else body,
                                                  self.merger.assistant_blocks(), results)
                self.merger.next_round()
            await self._write(self.merger.finish())
            _reply(capture, self.tee)  # the request before its reply: one writer, in order
            await self.http.end()
            return True
        except ConnectionError:
            capture.sent()
            return False
        except Exception as e:  # upstream, a tool (an OSError from a notes root), our own bug
            if not isinstance(e, UpstreamError | ValueError):
                log.exception("perpetuity: the recall tools failed")
            capture.sent()
            if not self.started:  # fall back to the client's own request, untouched
                return await self._as_sent(job.original or job.body)
            what = "upstream" if isinstance(e, UpstreamError | ValueError) else "a recall tool"
            await self._write(self.adapter.error_event(f"perpetuity: {what} failed: {e}"))
            await self.http.end()
            return True

    async def _as_sent(self, original: bytes) -> bool:
        """The client's own request, untouched, through the plain exchange."""
        self.job.body, self.job.original = original, None
        return await self.upstream.forward(self.capture, self.http)

    async def _round(self, resp: Response) -> None:
        if not self.job.stream:
            raw = await resp.aread()
            self.round.raw.append(raw)
            cast(BodyMerging, self.merger).feed_body(json.loads(raw))
            return
        await self._start(resp)
        sse = SSEDecoder()
        merger = cast(StreamMerging, self.merger)
        async for chunk in resp.aiter_raw():
            self.round.raw.append(chunk)
            # What one read brought goes on as one chunk, as on mitmproxy's own path: a write
            # per event cost the relay, mitmproxy and the client a chunk's work each.
            out = b"".join(merger.feed(ev.event, data) for ev in sse.feed(chunk)
                           if (data := ev.json()) is not None)
            if out:
                await self._write(out)
        self.capture.sent()

    async def _start(self, resp: Response) -> None:
        if not self.started:
            self.started = True
            _start(self.http, resp)

    async def _write(self, data: bytes) -> None:
        if not self.started:  # a whole body: its head goes out with it
            self.started = True
            self.http.start(200, "OK", [("content-type", "application/json")])
        self.http.send(data)
        await self.http.drain()
        if not self.forwarded:
            self.forwarded = True
            await forwarded(self.job)  # the first bytes to the client before the rest
        # After them: the loop passes nothing on until we wait, and reading the first chunk
        # (a provider's first read often holds several events) would delay the client's
        # first byte. A failed write leaves no reply to store (run's ConnectionError).
        self.tee.feed(data)

    async def _run_tools(self, calls: list[tuple[str, str, Any]]) -> list[tuple[str, str]] | None:
        """Our calls' results, pinging the client while they run; None if it went away."""
        assert self.job.memory is not None
        results = []
        loop = asyncio.get_running_loop()
        for call_id, name, args in calls:
            task = asyncio.ensure_future(self.upstream.run_tool(name, args, self.job.memory))
            timeout = self.upstream.tool_timeout
            deadline = loop.time() + timeout
            while True:
                left = deadline - loop.time()
                done, _ = await asyncio.wait({task}, timeout=max(0.0, min(PING_EVERY, left)))
                if done or left <= 0:
                    break
                if self.job.stream:
                    try:
                        await self._write(self.adapter.ping())
                    except ConnectionError:
                        task.cancel()
                        return None
            if not task.done():
                # The model is told and the reply goes on; the tool's thread finishes on its own.
                task.cancel()
                log.warning("perpetuity: %s timed out after %g s", name, timeout)
                results.append((call_id, f"{name}: timed out after {timeout:g} s"))
                continue
            results.append((call_id, task.result()))
        await asyncio.sleep(0)  # let a hang-up that already arrived be seen
        if self.http.hung_up():
            return None  # mitmproxy closed our connection: its client is gone
        return results

    async def _upstream_error(self, resp: Response) -> bool:
        """An error from the provider: as it was sent, if the client has seen nothing yet."""
        raw = await resp.aread()
        self.capture.sent()
        if not self.started:
            self.started = True
            _start(self.http, resp)
            self.http.send(raw)
            await self.http.end()
            return True
        await self._write(self.adapter.error_event(raw.decode("utf-8", "replace")[:2000]))
        await self.http.end()
        return True


def _start(http: Http11, resp: Response) -> None:
    """Upstream's head, hop-by-hop headers left out; the body follows chunked."""
    http.start(resp.status_code, resp.reason_phrase,
               [(k, v) for k, v in resp.headers if k not in HOP_BY_HOP])
