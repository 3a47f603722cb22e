"""The mitmproxy addon: the only module that imports mitmproxy.

It fails open: if anything in the memory pipeline raises, the request goes upstream exactly as the
client sent it (routed, when the client addressed us as its base URL) and the error is logged.
Changes to a flow are applied all at once, after everything they depend on succeeded, because
mitmproxy catches hook exceptions and carries on with whatever state the flow was left in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from mitmproxy import contentviews, ctx, exceptions, http

from perpetuity_core.errors import PerpetuityError
from perpetuity_core.memory.cap import Cap
from perpetuity_core.memory.location import where
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.store import Store, default_db_path
from perpetuity_core.notes.library import notes_root
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve import inspection
from perpetuity_core.serve.direct import Addressing
from perpetuity_core.serve.exchange import Decision, HttpRequest, Job
from perpetuity_core.serve.flowview import PerpetuityView, round_flows
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.relay import JOB_HEADER, Relay, ReplyTee
from perpetuity_core.wire.conversation import Provider, Reply
from perpetuity_core.wire.protocols import responses
from perpetuity_core.wire.route import DEFAULT_UPSTREAMS, parse_upstream
from perpetuity_core.wire.sse import Event

log = logging.getLogger("perpetuity")
# Not carried onto a retry: hop-by-hop, and encodings (httpx decodes what it reads).
_NOT_RESENT = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
               "proxy-connection", "content-encoding"}
# What a flow carries while it runs and never once it is done: mitmproxy deep-copies
# flow.metadata to save a flow, and a Job (its Future's lock) cannot be copied, so a flow holding
# one was dropped from `-w` files.
_LIVE = ("perpetuity_decision", "perpetuity_job", "perpetuity_original", "perpetuity_tee",
         "perpetuity_fell_open", "perpetuity_kept")


class Perpetuity:
    def __init__(self) -> None:
        self.store: Store | None = None
        self.pipeline: Pipeline | None = None
        self.relay = Relay(self._store_request, self._store_reply, self._run_tool)
        # One thread owns the store: SQLite has one writer, and the event loop never waits on disk.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-store")
        # Requests are parsed on their own thread, so a request never queues behind a write.
        self.parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-parse")
        # The recall tools run on their own threads: a slow tool (a long scan, a cold catch-up)
        # never queues another client's request behind it (the scanner's catch-ups take turns;
        # its scans read the arena's published view without a lock).
        self.tools = ThreadPoolExecutor(max_workers=4, thread_name_prefix="perpetuity-tools")
        self.notes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-notes")
        self.serving = False  # from the running hook on, the database is fixed
        self.addressing = Addressing()  # did the client address us or a host through us?

    def load(self, loader: Any) -> None:
        contentviews.add(PerpetuityView)
        loader.add_option("perpetuity_db", str, str(default_db_path()),
                          "SQLite file (a path or sqlite:///path) holding the memory ($PERPETUITY_DB overrides the default).")
        loader.add_option("perpetuity_anthropic_upstream", str, DEFAULT_UPSTREAMS[Provider.ANTHROPIC],
                          "Where Anthropic traffic goes (scheme://host[:port]).")
        loader.add_option("perpetuity_openai_upstream", str, DEFAULT_UPSTREAMS[Provider.OPENAI],
                          "Where OpenAI traffic goes (scheme://host[:port]).")
        loader.add_option("perpetuity_gemini_upstream", str, DEFAULT_UPSTREAMS[Provider.GOOGLE],
                          "Where Gemini traffic goes (scheme://host[:port]); left as it is, "
                          "Code Assist's goes to its own host.")
        loader.add_option("perpetuity_notes_dir", str, "",
                          "The notes library (default: $PERPETUITY_NOTES_DIR, a repository's "
                          ".perpetuity/, else ~/.claude/perpetuity/).")
        loader.add_option("perpetuity_frame_ceiling", int, Cap().ceiling,
                          "The largest frame of memory a request gets, in tokens; a narrow "
                          "question gets less (the breadth-sized cap).")
        loader.add_option("perpetuity_share_pool", str, "",
                          "Tenants whose users see each other's memory (own rows ranked first), "
                          "comma-separated (key-<hash>, anonymous); empty, each user sees only "
                          "their own.")
        loader.add_option("perpetuity_trust_identity", bool, False,
                          "Trust x-perpetuity-user and the harnesses' identity fields across "
                          "credentials: only behind a gateway that authenticates them. Off, "
                          "every identity is scoped under its request's credential.")
        loader.add_option("perpetuity_notes_capture", bool, True,
                          "Offer note_capture and answer /perpetuity-curate through the proxy.")
        loader.add_option("perpetuity_tool_timeout", int, 30,
                          "Seconds one recall tool call may take before the model is told it "
                          "timed out.")
        loader.add_option("perpetuity_tool_rounds", int, 4,
                          "Upstream rounds one reply may take for the recall tools; the last "
                          "round must answer.")
        loader.add_option("perpetuity_tools", bool, True,
                          "Offer the recall tools; their loop runs in the relay. Off, replies "
                          "stream on mitmproxy's own path (x-perpetuity-tools: off, per request).")

    def configure(self, updated: set[str]) -> None:
        try:
            self._configure(updated)
        except exceptions.OptionsError as e:
            if self.serving:
                raise
            # At start-up mitmproxy prints an error raised from a script's configure with its
            # traceback, and exits on any error logged: logged, the cause is one line.
            log.error("perpetuity: %s", e)

    def _configure(self, updated: set[str]) -> None:
        keys = {"perpetuity_db", "perpetuity_anthropic_upstream", "perpetuity_openai_upstream",
                "perpetuity_gemini_upstream",
                "perpetuity_tools", "perpetuity_notes_dir", "perpetuity_frame_ceiling",
                "perpetuity_share_pool", "perpetuity_tool_rounds", "perpetuity_trust_identity",
                "perpetuity_notes_capture", "perpetuity_tool_timeout"}
        if not updated & keys:
            return
        try:
            moved = ("perpetuity_db" in updated and self.store is not None
                     and where(ctx.options.perpetuity_db) != self.store.path)
        except PerpetuityError as e:
            raise exceptions.OptionsError(str(e)) from e
        if moved and self.serving and self.store is not None:
            # The preparing thread's reads would stay on the old file while writes went to the
            # new one: one memory split in two.
            raise exceptions.OptionsError(
                f"perpetuity_db cannot change while running (memory is in {self.store.shown}); "
                "restart the proxy to use another file")
        pooled = frozenset(t.strip() for t in ctx.options.perpetuity_share_pool.split(",")
                           if t.strip())
        if pooled & {"true", "false", "1", "0", "yes", "no", "on", "off"}:
            raise exceptions.OptionsError(
                "perpetuity_share_pool names the tenants that pool their memory "
                "(comma-separated key-<hash> or anonymous); it no longer shares with everyone")
        self.relay.tool_timeout = ctx.options.perpetuity_tool_timeout
        try:
            upstreams = {
                Provider.ANTHROPIC: parse_upstream(ctx.options.perpetuity_anthropic_upstream),
                Provider.OPENAI: parse_upstream(ctx.options.perpetuity_openai_upstream),
                Provider.GOOGLE: parse_upstream(ctx.options.perpetuity_gemini_upstream),
            }
            if self.store is None or moved:  # before serving: the file given at start-up
                self.store = self.executor.submit(self._open, ctx.options.perpetuity_db).result()
        except PerpetuityError as e:
            raise exceptions.OptionsError(str(e)) from e
        notes_dir = ctx.options.perpetuity_notes_dir
        ceiling = ctx.options.perpetuity_frame_ceiling
        if ceiling < Cap().floor:
            raise exceptions.OptionsError(f"perpetuity_frame_ceiling must be at least {Cap().floor}")
        self.pipeline = Pipeline(self.store, upstreams, ctx.options.perpetuity_tools,
                                 Path(notes_dir).expanduser() if notes_dir else notes_root(),
                                 Cap(ceiling=ceiling), pooled,
                                 max(1, ctx.options.perpetuity_tool_rounds),
                                 ctx.options.perpetuity_trust_identity,
                                 ctx.options.perpetuity_notes_capture)

    def _open(self, path: str) -> Store:
        if self.store is not None:
            self.store.close()
        return open_memory(path)

    async def running(self) -> None:
        self.serving = True
        if "web_columns" in ctx.options and "comment" not in ctx.options.web_columns:
            # mitmweb: each flow's one-line summary in the flow list.
            ctx.options.update(web_columns=[*ctx.options.web_columns, "comment"])
        await self.relay.start()
        host = ctx.options.listen_host or "127.0.0.1"
        port = ctx.options.listen_port or 8080
        print(
            f"perpetuity: listening on http://{host}:{port}, memory in {self.store.shown if self.store else ''}\n"
            f"  Claude Code / Anthropic SDK: ANTHROPIC_BASE_URL=http://{host}:{port}\n"
            f"  OpenAI SDK / opencode:       OPENAI_BASE_URL=http://{host}:{port}/v1\n"
            f"  gemini-cli / Google GenAI SDK: GOOGLE_GEMINI_BASE_URL=http://{host}:{port}\n"
            f"  Codex (~/.codex/config.toml): [model_providers.perpetuity] base_url = "
            f"\"http://{host}:{port}/v1\", wire_api = \"responses\"\n"
            f"  any other harness: HTTPS_PROXY=http://{host}:{port} with the mitmproxy CA trusted",
            flush=True,
        )
        if self.store is not None and self.store.notice:
            print(f"perpetuity: {self.store.notice}", flush=True)

    async def done(self) -> None:
        await self.relay.stop()
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.store.close)
        self.executor.shutdown(wait=False)
        self.parser.shutdown(wait=False)
        self.tools.shutdown(wait=False)
        self.notes.shutdown(wait=False)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or self.pipeline is None:
            return
        req = HttpRequest(
            method=flow.request.method,
            host=flow.request.pretty_host,
            path=flow.request.path,
            headers=tuple(flow.request.headers.items(multi=True)),
            body=flow.request.raw_content or b"",
            direct=await self.addressing.is_direct(
                flow.client_conn.id, flow.client_conn.sockname, flow.request.host,
                flow.request.pretty_host, flow.request.port),
        )
        loop = asyncio.get_running_loop()
        try:
            decision = await loop.run_in_executor(self.parser, self.pipeline.prepare, req)
        except Exception as e:
            log.exception("perpetuity: pipeline failed; forwarding the request untouched")
            decision = self.pipeline.route_only(req)
            flow.metadata["perpetuity_fell_open"] = f"the pipeline failed ({type(e).__name__}: {e})"
        self._apply(flow, decision)
        if decision.route and flow.request.headers.get("upgrade", "").lower() == "websocket":
            flow.metadata["perpetuity_handshake"] = req  # the identity of every message to come

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Codex's own provider speaks Responses over a WebSocket: each client message is a
        request (stored like one, without a frame: later ones chain to server-side state by
        previous_response_id) and the server's events are its reply."""
        handshake: HttpRequest | None = flow.metadata.get("perpetuity_handshake")
        if handshake is None or flow.websocket is None or self.pipeline is None:
            return
        message = flow.websocket.messages[-1]
        try:
            if message.from_client:
                req = HttpRequest("POST", handshake.host, handshake.path,
                                  handshake.headers + (("x-perpetuity-recall", "off"),),
                                  message.content, handshake.direct)
                decision = await asyncio.get_running_loop().run_in_executor(
                    self.parser, self.pipeline.prepare, req)
                if decision.job is not None:
                    self._store_request(decision.job)
                    flow.metadata["perpetuity_ws"] = (decision.job, responses.ReplyAssembler())
            elif state := flow.metadata.get("perpetuity_ws"):
                job, assembler = state
                event = json.loads(message.content)
                kind = str(event.get("type", "")) if isinstance(event, dict) else ""
                assembler.feed(Event(kind, message.text))
                if kind in ("response.completed", "response.incomplete", "response.failed"):
                    del flow.metadata["perpetuity_ws"]
                    self._store_reply(job, assembler.reply(), time.time())
        except Exception:
            log.exception("perpetuity: could not capture a WebSocket message; it went through as sent")

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Whatever comes through a tunnel was addressed to the tunnel's host, never to us."""
        self.addressing.tunnels.add(flow.client_conn.id)

    def client_disconnected(self, client: Any) -> None:
        self.addressing.tunnels.discard(client.id)

    def _apply(self, flow: http.HTTPFlow, d: Decision) -> None:
        if d.answer is not None:
            flow.response = http.Response.make(d.answer.status, d.answer.body,
                                               {"content-type": d.answer.content_type})
            flow.metadata["perpetuity"] = {"upstream": "", "note": d.note}
            flow.metadata["perpetuity_decision"] = d
            return
        token = self.relay.submit(d.job) if d.job and d.job.relay else ""
        for name in d.strip:
            del flow.request.headers[name]
        if token:
            flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.relay.port
            flow.request.headers[JOB_HEADER] = token
        elif d.route:
            flow.request.url = d.route.upstream_url
            if d.job:  # the reply is read by our tee, which cannot read every encoding
                flow.request.headers.pop("accept-encoding", None)
            if d.body is not None:
                flow.metadata["perpetuity_original"] = flow.request.raw_content
                flow.request.content = d.body
        if d.route:
            # The facts are made from these references once the reply is done (_settle).
            flow.metadata["perpetuity"] = {"upstream": d.route.upstream_url, "note": d.note}
            flow.metadata["perpetuity_decision"] = d
        if d.job and not token:
            flow.metadata["perpetuity_job"] = d.job

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if "perpetuity" not in flow.metadata or flow.response is None:
            return
        job: Job | None = flow.metadata.get("perpetuity_job")
        if flow.response.status_code == 400 and "perpetuity_original" in flow.metadata:
            return  # buffered: the response hook retries it as the client sent it
        stream: StreamTee | None = None
        if job and flow.response.status_code < 400:
            flow.metadata["perpetuity_tee"] = ReplyTee(job, flow.response.headers.get("content-encoding", ""))
            stream = StreamTee(self, flow, job)
        if _readable():  # mitmproxy keeps nothing of a streamed body: a copy to inspect
            flow.metadata["perpetuity_kept"] = Kept(stream)
            flow.response.stream = flow.metadata["perpetuity_kept"]
        else:  # no buffering: every chunk goes to the client as it comes
            flow.response.stream = stream or True

    async def response(self, flow: http.HTTPFlow) -> None:
        original = flow.metadata.pop("perpetuity_original", None)
        if original is not None and flow.response is not None and flow.response.status_code == 400:
            try:
                await self._retry_as_sent(flow, original)
            except Exception:
                log.exception("perpetuity: the retry failed; the 400 stands")
        self._finish(flow)
        self._restore(flow)
        await self._settle(flow)

    async def _retry_as_sent(self, flow: http.HTTPFlow, original: bytes) -> None:
        """A 400 for a request we changed may be our doing (the frame): sent once more exactly
        as the client sent it, and that answer is the client's."""
        client = self.relay.client
        if client is None:
            return
        log.warning("perpetuity: upstream refused the request with our frame (400); retrying "
                    "it as the client sent it")
        headers = [(k, v) for k, v in flow.request.headers.items(multi=True)
                   if k.lower() not in _NOT_RESENT]
        try:
            resp = await client.request(flow.request.method, flow.request.url, headers=headers,
                                        content=original)
        except httpx.HTTPError as e:
            log.warning("perpetuity: the retry failed (%s); the 400 stands", type(e).__name__)
            return
        flow.request.content = original
        flow.metadata["perpetuity_fell_open"] = "upstream refused our request (400); retried as sent"
        flow.response = http.Response.make(
            resp.status_code, resp.content,
            [(k.encode(), v.encode()) for k, v in resp.headers.multi_items()
             if k.lower() not in _NOT_RESENT])
        job: Job | None = flow.metadata.get("perpetuity_job")
        if job is not None and resp.status_code < 400:
            tee = ReplyTee(job, "")
            tee.feed(resp.content)
            flow.metadata["perpetuity_tee"] = tee  # stored by _finish

    async def error(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)
        self._restore(flow)
        await self._settle(flow)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop("perpetuity_handshake", None)
        flow.metadata.pop("perpetuity_ws", None)

    async def _settle(self, flow: http.HTTPFlow) -> None:
        """The flow's facts as plain values (what mitmproxy saves and mitmweb shows), its
        comment and mark, and the tool loop's hidden rounds as flows of their own; the live
        references dropped. After the reply: nothing here is on the request path."""
        d: Decision | None = flow.metadata.get("perpetuity_decision")
        fell_open = flow.metadata.get("perpetuity_fell_open", "")
        kept: Kept | None = flow.metadata.get("perpetuity_kept")
        if kept is not None and flow.response is not None and flow.response.raw_content is None:
            flow.response.raw_content = b"".join(kept.chunks)  # the reply the client received
        for key in _LIVE + (() if flow.websocket else ("perpetuity_handshake",)):
            flow.metadata.pop(key, None)
        if d is None or not _readable():
            return
        try:
            job = d.job if d.job and d.job.relay else None
            if job and d.body is not None and job.original is None and not fell_open:
                fell_open = ("upstream refused our request (400); retried as sent"
                             if job.rounds and job.rounds[0].status == 400 else
                             "the recall tools failed before the first byte; sent as sent")
            facts = inspection.facts(d, d.job, fell_open)
            if job and job.body != flow.request.raw_content:
                flow.request.content = job.body  # what went upstream, as on mitmproxy's path
            # One round is the flow itself (the model answered); more were hidden from it.
            children = round_flows(flow, job.method, job.url, job.headers, job.rounds,
                                   facts["rounds"]) if job and len(job.rounds) > 1 else []
            flow.metadata["perpetuity"] = facts
            flow.comment = inspection.summary(facts)
            if facts["fell_open"] or facts["repaired"]:
                flow.marked = ":warning:" if facts["fell_open"] else ":wrench:"
            for child in children:
                await ctx.master.load_flow(child)
        except Exception:
            log.exception("perpetuity: could not gather what this flow showed the model")

    def _finish(self, flow: http.HTTPFlow) -> None:
        """Every flow with a turn ends here: the turn is stored even if no reply came."""
        job: Job | None = flow.metadata.get("perpetuity_job")
        if job is None:
            return
        tee = flow.metadata.pop("perpetuity_tee", None)
        if tee is not None:  # the body never ended (cut, client gone): store what came
            self._finish_reply(job, tee)
        self._store_request(job)

    def _finish_reply(self, job: Job, tee: ReplyTee) -> None:
        self._store_request(job)
        if (reply := tee.reply()) is not None:
            self._store_reply(job, reply, job.at if job.at is not None else time.time())

    def _restore(self, flow: http.HTTPFlow) -> None:
        """Show the real destination in mitmweb, not the relay."""
        meta = flow.metadata.get("perpetuity")
        if meta and JOB_HEADER in flow.request.headers:
            del flow.request.headers[JOB_HEADER]
            flow.request.url = meta["upstream"]

    def _store_request(self, job: Job) -> None:
        """Queue the request's write on the store's thread, once."""
        if job.turn is None and self.pipeline is not None:
            job.turn = self.executor.submit(self.pipeline.store_turn, job.pending)
            job.turn.add_done_callback(_report_unstored)  # read even when no reply follows

    async def _run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        """On the tools' threads, so the event loop and the preparing thread never wait."""
        pipeline = self.pipeline
        assert pipeline is not None
        # The notes' own thread: a hung disk never holds up the recall tools.
        pool = self.notes if pipeline.writes_notes(name) else self.tools
        return await asyncio.get_running_loop().run_in_executor(
            pool, pipeline.run_tool, name, arguments, memory)

    def _store_reply(self, job: Job, reply: Reply, at: float) -> None:
        """Queue the reply behind its request on the store's thread (FIFO: one writer, in order)."""
        pipeline, turn = self.pipeline, job.turn
        if pipeline is None or turn is None:
            return

        def write() -> None:
            if turn.exception() is not None:
                return  # the turn's failure is logged; a reply cannot be stored without it
            try:
                pipeline.store_reply(turn.result(), reply, at, job.pending)
            except Exception:
                log.exception("perpetuity: could not store the reply")

        self.executor.submit(write)


def _readable() -> bool:
    """Can anyone read a flow's facts: a flow list (mitmweb, the console), a flow file being
    written, or mitmdump printing bodies? Otherwise making them would cost the event loop
    0.18 ms a request (p50; 0.9 ms p90, on bench_latency's sides) for no one."""
    o = ctx.options
    return (ctx.master.addons.get("view") is not None
            or ("save_stream_file" in o and bool(o.save_stream_file))
            or ("flow_detail" in o and o.flow_detail >= 3))


def _report_unstored(turn: Future) -> None:
    """Fail open, not silent: the reply went to the client; the turn is stored when the
    conversation's next request re-sends it (capture recognises what the store holds)."""
    if not turn.cancelled() and (e := turn.exception()) is not None:
        log.error("perpetuity: a turn was not stored (%s); the conversation's next request"
                  " re-sends it and it is stored then", e)


class Kept:
    """A `flow.response.stream` callable that keeps a copy of the body as it passed, for
    inspection (`_readable`), around the tee when there is one."""

    def __init__(self, inner: StreamTee | None) -> None:
        self.inner = inner
        self.chunks: list[bytes] = []

    def __call__(self, chunk: bytes) -> bytes:
        self.chunks.append(chunk)
        return self.inner(chunk) if self.inner else chunk


class StreamTee:
    """A `flow.response.stream` callable: every chunk goes to the client unchanged, a copy is read.

    Runs synchronously on mitmproxy's event loop, so it only parses, and it cannot raise: an
    exception here would silently drop the chunk. A body that never ends (cut, client gone) is
    stored by the addon's `error` hook from what the tee read.
    """

    def __init__(self, addon: Perpetuity, flow: http.HTTPFlow, job: Job) -> None:
        self.addon = addon
        self.flow = flow
        self.job = job
        self.started = False

    def __call__(self, chunk: bytes) -> bytes:
        try:
            tee: ReplyTee | None = self.flow.metadata.get("perpetuity_tee")
            if tee is None:
                return chunk
            if chunk:
                tee.feed(chunk)
                if not self.started:
                    self.started = True
                    # After this chunk is on its way, so the write never delays it.
                    asyncio.get_running_loop().call_soon(self.addon._store_request, self.job)
            else:
                # The end of the body, before the client sees it: the reply is queued first, so
                # the harness's next request finds it stored.
                self.flow.metadata.pop("perpetuity_tee")
                self.addon._finish_reply(self.job, tee)
        except Exception:
            log.exception("perpetuity: capture failed; the reply is forwarded unchanged")
        return chunk
