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
import json
import logging
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import h11
import httpx

from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.exchange import Job
from perpetuity_core.serve.http11 import Http11
from perpetuity_core.wire.conversation import Reply
from perpetuity_core.wire.protocols import ADAPTERS
from perpetuity_core.wire.protocols.base import BodyMerging, StreamMerging
from perpetuity_core.wire.sse import SSEDecoder

log = logging.getLogger("perpetuity")

JOB_HEADER = "x-perpetuity-job"
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}
_JOB_TTL = 120.0  # a job mitmproxy never delivered (client gone) is dropped after this long

# Hands a finished reply to the store without waiting; called before the client sees the end.
StoreReply = Callable[[Job, Reply, float], None]


class ReplyTee:
    """Reads a copy of the reply bytes into a neutral Reply. Never raises."""

    def __init__(self, job: Job, content_encoding: str) -> None:
        self.adapter = ADAPTERS[job.protocol]
        self.stream = job.stream
        self.failed = False
        self._sse = SSEDecoder()
        self._assembler = self.adapter.ReplyAssembler()
        self._body = bytearray()
        enc = content_encoding.strip().lower()
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32) if enc in ("gzip", "deflate") else None
        if enc not in ("", "identity", "gzip", "deflate"):
            self.failed = True  # an encoding we cannot read: forward it, store no reply

    def feed(self, chunk: bytes) -> None:
        if self.failed:
            return
        try:
            if self._inflate is not None:
                chunk = self._inflate.decompress(chunk)
            if self.stream:
                for ev in self._sse.feed(chunk):
                    self._assembler.feed(ev)
            else:
                self._body += chunk
        except Exception:
            log.exception("perpetuity: could not read the reply; it is forwarded but not stored")
            self.failed = True

    def reply(self) -> Reply | None:
        if self.failed:
            return None
        try:
            if self.stream:
                return self._assembler.reply()
            return self.adapter.reply_from_body(json.loads(bytes(self._body)))
        except Exception:
            log.exception("perpetuity: could not assemble the reply")
            return None


# Runs one of our tools off the event loop: (name, arguments, the turn's memory) -> result text.
RunTool = Callable[[str, Any, TurnMemory], Awaitable[str]]
PING_EVERY = 1.0  # seconds between keep-alive pings while our tools run


class Relay:
    def __init__(self, store_request: Callable[[Job], None], store_reply: StoreReply,
                 run_tool: RunTool) -> None:
        self.store_request = store_request
        self.store_reply = store_reply
        self.run_tool = run_tool
        self.port = 0
        self.tool_timeout = 30.0  # seconds one tool call may take (perpetuity_tool_timeout)
        self._jobs: dict[str, tuple[float, Job]] = {}
        self._server: asyncio.Server | None = None
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        # trust_env=False: the proxy's own HTTPS_PROXY must never route upstream calls back to us.
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=30.0, read=None, write=60.0, pool=30.0), trust_env=False
        )
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def client(self) -> httpx.AsyncClient | None:
        return self._client

    async def stop(self) -> None:
        if self._server:
            self._server.close()
        if self._client:
            await self._client.aclose()

    def submit(self, job: Job) -> str:
        now = time.monotonic()
        for token in [t for t, (at, _) in self._jobs.items() if now - at > _JOB_TTL]:
            del self._jobs[token]
        token = secrets.token_hex(16)
        self._jobs[token] = (now, job)
        return token

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One mitmproxy server connection; kept alive across requests, as mitmproxy reuses it."""
        http = Http11(reader, writer)
        try:
            while (headers := await http.request()) is not None:
                entry = self._jobs.pop(headers.get(JOB_HEADER, ""), None)
                if entry is None:
                    await http.respond(502, b"perpetuity: unknown relay job")
                elif not await self._exchange(entry[1], http):
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

    async def _exchange(self, job: Job, http: Http11) -> bool:
        """Relay one exchange; False when the connection to mitmproxy can no longer be used."""
        if job.memory is not None:
            return await ToolLoop(self, job, http).run()
        return await self._forward(job, http)

    async def _forward(self, job: Job, http: Http11) -> bool:
        """The plain exchange: upstream's bytes to the client as they come."""
        assert self._client is not None
        request = self._client.build_request(job.method, job.url, headers=job.headers, content=job.body)
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.HTTPError as e:
            self.store_request(job)
            await http.respond(502, f"perpetuity: upstream {job.url} failed: {e}".encode())
            return True
        tee = ReplyTee(job, resp.headers.get("content-encoding", "")) if resp.status_code < 400 else None
        try:
            # Always chunked, so the reply can be handed to the store before the client sees
            # its end: the harness's next request must find it stored (one writer, in order).
            _start(http, resp)
            await http.drain()
            async for chunk in resp.aiter_raw():
                if not chunk:
                    continue
                http.send(chunk)
                if tee:
                    tee.feed(chunk)
                await http.drain()
                # Once the first bytes are on their way, so the write never delays them.
                self.store_request(job)
            self.store_request(job)  # (a body with no bytes) the request before its reply
            self._store(job, tee)
            tee = None
            await http.end()
        except httpx.HTTPError:
            # The provider cut the stream: cut the client the same way, keep what came.
            http.abort()
            return False
        except ConnectionError:
            return False  # the client went away; closing the upstream response stops the provider
        finally:
            await resp.aclose()
            self.store_request(job)
            self._store(job, tee)
        return True

    def _store(self, job: Job, tee: ReplyTee | None) -> None:
        if tee is None or (reply := tee.reply()) is None:
            return
        try:
            self.store_reply(job, reply, job.at if job.at is not None else time.time())
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

    def __init__(self, relay: Relay, job: Job, http: Http11) -> None:
        self.relay, self.job, self.http = relay, job, http
        self.adapter = ADAPTERS[job.protocol]
        self.merger = (self.adapter.StreamMerger if job.stream else self.adapter.BodyMerger)(
            frozenset(str(t["name"]) for t in job.tool_specs))
        self.tee = ReplyTee(job, "")
        self.started = False  # the client has seen the response head
        self.round = Round(0.0, b"")  # the round in progress

    async def run(self) -> bool:
        job, client = self.job, self.relay._client
        assert client is not None and job.memory is not None
        body = json.loads(job.body)
        specs = job.tool_specs
        try:
            for round_ in range(job.max_rounds):
                last = round_ == job.max_rounds - 1
                sent = self.adapter.add_tools(body, specs, last)
                request = client.build_request(job.method, job.url, headers=job.headers,
                                               content=json.dumps(sent).encode())
                self.round = Round(time.time(), request.content)
                job.rounds.append(self.round)
                resp = await client.send(request, stream=True)
                self.round.status, self.round.headers = resp.status_code, resp.headers.multi_items()
                try:
                    if resp.status_code == 400 and round_ == 0:
                        # The rejection may be ours (the frame, a tool): once, as the client sent it.
                        log.warning("perpetuity: upstream refused the request with our changes "
                                    "(400); retrying it as the client sent it")
                        job.body, job.original = job.original or job.body, None
                        return await self.relay._forward(job, self.http)
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
                body = self.adapter.continue_body(body, self.merger.assistant_blocks(), results)
                self.merger.next_round()
            await self._write(self.merger.finish())
            self.relay.store_request(job)  # the request before its reply: one writer, in order
            self.relay._store(job, self.tee)
            await self.http.end()
            return True
        except ConnectionError:
            self.relay.store_request(job)
            return False
        except Exception as e:  # upstream, a tool (an OSError from a notes root), our own bug
            if not isinstance(e, httpx.HTTPError | ValueError):
                log.exception("perpetuity: the recall tools failed")
            self.relay.store_request(job)
            if not self.started:  # fall back to the client's own request, untouched
                job.body, job.original = job.original or job.body, None
                return await self.relay._forward(job, self.http)
            what = "upstream" if isinstance(e, httpx.HTTPError | ValueError) else "a recall tool"
            await self._write(self.adapter.error_event(f"perpetuity: {what} failed: {e}"))
            await self.http.end()
            return True

    async def _round(self, resp: httpx.Response) -> None:
        if not self.job.stream:
            raw = await resp.aread()
            self.round.raw.append(raw)
            cast(BodyMerging, self.merger).feed_body(json.loads(raw))
            return
        await self._start(resp)
        sse = SSEDecoder()
        async for chunk in resp.aiter_raw():
            self.round.raw.append(chunk)
            for ev in sse.feed(chunk):
                data = ev.json()
                if data is None:
                    continue
                if out := cast(StreamMerging, self.merger).feed(ev.event, data):
                    await self._write(out)
        self.relay.store_request(self.job)

    async def _start(self, resp: httpx.Response) -> None:
        if not self.started:
            self.started = True
            _start(self.http, resp)

    async def _write(self, data: bytes) -> None:
        if not self.started:  # a whole body: its head goes out with it
            self.started = True
            self.http.start(200, "OK", [("content-type", "application/json")])
        self.http.send(data)
        self.tee.feed(data)
        await self.http.drain()

    async def _run_tools(self, calls: list[tuple[str, str, Any]]) -> list[tuple[str, str]] | None:
        """Our calls' results, pinging the client while they run; None if it went away."""
        assert self.job.memory is not None
        results = []
        loop = asyncio.get_running_loop()
        for call_id, name, args in calls:
            task = asyncio.ensure_future(self.relay.run_tool(name, args, self.job.memory))
            deadline = loop.time() + self.relay.tool_timeout
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
                log.warning("perpetuity: %s timed out after %g s", name, self.relay.tool_timeout)
                results.append((call_id, f"{name}: timed out after {self.relay.tool_timeout:g} s"))
                continue
            results.append((call_id, task.result()))
        await asyncio.sleep(0)  # let a hang-up that already arrived be seen
        if self.http.hung_up():
            return None  # mitmproxy closed our connection: its client is gone
        return results

    async def _upstream_error(self, resp: httpx.Response) -> bool:
        """An error from the provider: as it was sent, if the client has seen nothing yet."""
        raw = await resp.aread()
        self.relay.store_request(self.job)
        if not self.started:
            self.started = True
            _start(self.http, resp)
            self.http.send(raw)
            await self.http.end()
            return True
        await self._write(self.adapter.error_event(raw.decode("utf-8", "replace")[:2000]))
        await self.http.end()
        return True


def _start(http: Http11, resp: httpx.Response) -> None:
    """Upstream's head, hop-by-hop headers left out; the body follows chunked."""
    http.start(resp.status_code, resp.reason_phrase,
               [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in _HOP])
