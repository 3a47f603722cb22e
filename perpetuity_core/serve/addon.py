"""The mitmproxy addon: the only module that imports mitmproxy.

It fails open: if anything in the memory pipeline raises, the request goes upstream exactly as the
client sent it (routed, when the client addressed us as its base URL) and the error is logged.
Changes to a flow are applied all at once, after everything they depend on succeeded, because
mitmproxy catches hook exceptions and carries on with whatever state the flow was left in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mitmproxy import contentviews, ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ProxyMode

from perpetuity_core.errors import PerpetuityError
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.location import where
from perpetuity_core.memory.storage.store import Store, default_db_path
from perpetuity_core.notes.library import notes_root
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve import inspection
from perpetuity_core.serve.chain import Chain, Histories, framed
from perpetuity_core.serve.direct import Addressing
from perpetuity_core.serve.drain import BOUND as DRAIN_BOUND
from perpetuity_core.serve.drain import REFUSED as DRAIN_REFUSED
from perpetuity_core.serve.drain import Drain
from perpetuity_core.serve.exchange import HOP_BY_HOP, Decision, HttpRequest
from perpetuity_core.serve.flowstate import (
    STATE,
    FlowState,
    Forwarded,
    Kept,
    StreamTee,
    state_of,
)
from perpetuity_core.serve.flowview import FACTS, PerpetuityView, round_flows, socket_facts
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.serve.preparing import Preparing
from perpetuity_core.serve.relay import JOB_HEADER, REFUSED, Relay, as_sent
from perpetuity_core.serve.socket_tools import SocketReply
from perpetuity_core.serve.tee import ReplyTee
from perpetuity_core.serve.upstream import Request, UpstreamError, decoded
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire import identity
from perpetuity_core.wire.conversation import Provider
from perpetuity_core.wire.route import DEFAULT_UPSTREAMS, credential, parse_upstream

log = logging.getLogger("perpetuity")
# Not carried onto a retry beside the hop-by-hop headers: encodings (the retry decodes what it
# reads).
_NOT_RESENT = HOP_BY_HOP | {"content-encoding"}
_JOB = JOB_HEADER.encode()
_TENANCY = {identity.PERSONAL: "one person's memory, whatever the key: whoever can reach the "
                              "port reads it",
            identity.CREDENTIAL: "a memory per credential; `perpetuity memory tenants join` "
                                "joins one person's"}


class Perpetuity:
    def __init__(self) -> None:
        self.store: Store | None = None
        self.pipeline: Pipeline | None = None
        self.relay = Relay(self._run_tool)
        # One thread owns the store: SQLite has one writer, and the event loop never waits on disk.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-store")
        self.parser = Preparing()  # the parser's thread, or the loop where that costs less
        # The recall tools run on their own threads: a slow tool (a long scan, a cold catch-up)
        # never queues another client's request behind it (the scanner's catch-ups take turns;
        # its scans read the arena's published view without a lock).
        self.tools = ThreadPoolExecutor(max_workers=4, thread_name_prefix="perpetuity-tools")
        self.notes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-notes")
        self.serving = False  # from the running hook on, the database is fixed
        self.addressing = Addressing()  # did the client address us or a host through us?
        self.tenancy = identity.CREDENTIAL  # whose memory a request reaches (identity.tenancy)
        self.histories = Histories()  # Codex's WebSocket chains: the client's side (chain)
        self.drain = Drain()  # the flows in flight, waited for at shutdown

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
        loader.add_option("perpetuity_tenants", str, "",
                          "personal: every credential is one person's and reaches one memory "
                          "(with every row already stored); credential: a tenant per credential. "
                          "Empty: personal when every listen address is loopback, else credential.")
        loader.add_option("perpetuity_notes_capture", bool, True,
                          "Offer note_capture and answer /perpetuity-curate through the proxy.")
        loader.add_option("perpetuity_tool_timeout", int, 30,
                          "Seconds one recall tool call may take before the model is told it "
                          "timed out.")
        loader.add_option("perpetuity_tool_rounds", int, 4,
                          "Upstream rounds one reply may take for the recall tools; the last "
                          "round must answer.")
        loader.add_option("perpetuity_drain", int, int(DRAIN_BOUND),
                          "Seconds a stop (SIGTERM, SIGINT) waits for the replies in flight to "
                          "finish and be stored, no longer accepting; then they are stored as "
                          "far as they came.")
        loader.add_option("perpetuity_tools", bool, True,
                          "Offer the recall tools; their loop runs in the relay. Off, replies "
                          "stream on mitmproxy's own path (x-perpetuity-tools: off, per request).")

    def configure(self, updated: set[str]) -> None:
        if "perpetuity_drain" in updated:
            self.drain.bound = max(0, ctx.options.perpetuity_drain)
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
                "perpetuity_notes_capture", "perpetuity_tool_timeout", "perpetuity_tenants",
                "listen_host", "mode"}
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
        try:
            self.tenancy = identity.tenancy(ctx.options.perpetuity_tenants, listening())
        except ValueError as e:
            raise exceptions.OptionsError(str(e)) from e
        notes_dir = ctx.options.perpetuity_notes_dir
        ceiling = ctx.options.perpetuity_frame_ceiling
        if ceiling < Cap().floor:
            raise exceptions.OptionsError(f"perpetuity_frame_ceiling must be at least {Cap().floor}")
        self.pipeline = Pipeline(self.store, Settings(
            upstreams=upstreams, tools=ctx.options.perpetuity_tools,
            tool_rounds=max(1, ctx.options.perpetuity_tool_rounds),
            notes_root=Path(notes_dir).expanduser() if notes_dir else notes_root(),
            notes_capture=ctx.options.perpetuity_notes_capture, limits=Cap(ceiling=ceiling),
            share_pool=pooled, trust_identity=ctx.options.perpetuity_trust_identity,
            personal=self.tenancy == identity.PERSONAL))
        # On the store's thread, where the store is closed (`_open`, `done`): never under a
        # catch-up still reading (a connection closed from another thread mid-statement crashed
        # the process). The loop goes on at once; writes queue behind it, off the request path.
        self.executor.submit(self.pipeline.warm)

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
            f"  Codex (~/.codex/config.toml): openai_base_url = \"http://{host}:{port}/v1\"; "
            f"signed in with ChatGPT, HTTPS_PROXY=http://{host}:{port} with "
            f"CODEX_CA_CERTIFICATE=~/.mitmproxy/mitmproxy-ca-cert.pem\n"
            f"  any other harness: HTTPS_PROXY=http://{host}:{port} with the mitmproxy CA trusted",
            flush=True,
        )
        print(f"perpetuity: tenants: {self.tenancy} ({_TENANCY[self.tenancy]})", flush=True)
        if self.store is not None and self.store.notice:
            print(f"perpetuity: {self.store.notice}", flush=True)

    async def done(self) -> None:
        for flow in await self.drain.wait(_stop_accepting):
            if (state := state_of(flow.metadata)) is not None:
                state.finish()  # queued before the store closes; the flow's end is a no-op
        await self.relay.stop()
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.store.close)
        self.executor.shutdown(wait=False)
        self.parser.shutdown()
        self.tools.shutdown(wait=False)
        self.notes.shutdown(wait=False)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or self.pipeline is None:
            return
        if self.drain.closing:  # the store is closing: nothing new is read, or stored
            flow.response = http.Response.make(503, DRAIN_REFUSED, {
                "content-type": "text/plain; charset=utf-8", "retry-after": "1",
                "connection": "close"})
            return
        self.drain.begin(flow.id, flow)
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
        fell_open, decoded = "", False
        try:
            # What the body cannot change is decided here, on the loop: no thread hop.
            decision = self.pipeline.passed(req)
            if decision is None and "content-encoding" in flow.request.headers:
                req, decoded = _decoded(flow, req)
                if not decoded:
                    decision = self.pipeline.route_only(req)
            if decision is None:
                decision = await self.parser.decide(self.pipeline, req)
        except Exception as e:
            log.exception("perpetuity: pipeline failed; forwarding the request untouched")
            decision = self.pipeline.route_only(req)
            fell_open = f"the pipeline failed ({type(e).__name__}: {e})"
        state = self._apply(flow, decision, fell_open, decoded)
        if state is None:
            self.drain.end(flow.id)  # not provider traffic: nothing of it is stored
        if (state and decision.route
                and flow.request.headers.get("upgrade", "").lower() == "websocket"):
            state.handshake = req  # the identity of every message to come
            headers = {k.lower(): v for k, v in req.headers}
            state.chain = Chain(self.histories, credential(headers, req.path))

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Codex's own provider speaks Responses over a WebSocket: each client message is a
        request, read whole through the client's chain (`chain`), framed and stored as the
        HTTP request it stands for, and sent upstream on the proxy's own chain; the server's
        events are its reply. Anything we cannot read goes as sent."""
        state = state_of(flow.metadata)
        handshake = state.handshake if state else None
        if (state is None or handshake is None or state.chain is None or flow.websocket is None
                or self.pipeline is None):
            return
        message = flow.websocket.messages[-1]
        if message.injected:
            return  # ours: a tool round's next message, chained already (socket_tools)
        try:
            if message.from_client:
                await self._client_message(flow, state, handshake, state.chain, message)
            else:
                await self._server_message(flow, state, state.chain, message)
        except Exception:
            state.chain.lost()
            log.exception("perpetuity: could not read a WebSocket message; it went through as sent")

    async def _client_message(self, flow: http.HTTPFlow, state: FlowState,
                              handshake: HttpRequest, link: Chain, message: Any) -> None:
        state.message = None
        assert self.pipeline is not None
        decision, content = await self.parser.run(framed, self.pipeline, handshake, link,
                                                  message.content)
        original = message.content
        if content is not None:  # every change at once, after everything it needs succeeded
            message.content = content
        if decision.job is not None and flow.websocket is not None:
            capture = Capture(decision.job, self.pipeline, self.executor)
            capture.sent()
            state.message = SocketReply(
                link, capture, decision, message.content, None if content is None else original,
                self._run_tool, self.relay.tool_timeout, len(flow.websocket.messages) - 1)

    async def _server_message(self, flow: http.HTTPFlow, state: FlowState, link: Chain,
                              message: Any) -> None:
        reply, raw = state.message, message.content
        if reply is None:
            with contextlib.suppress(ValueError):
                link.event(json.loads(raw))
            return
        step = await reply.event(raw)
        if step.show is None:
            message.drop()
        elif step.show is not raw:
            message.content = step.show
        if step.send is not None:  # the next round, on this connection, hidden from the client
            ctx.master.commands.call("inject.websocket", flow, False, step.send, True)
        if step.done:
            state.message = None
            if _readable():
                socket_facts(flow, reply.decision, reply.job, reply.index, reply.fell_open)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Whatever comes through a tunnel was addressed to the tunnel's host, never to us."""
        self.addressing.tunnels.add(flow.client_conn.id)

    def client_disconnected(self, client: Any) -> None:
        self.addressing.tunnels.discard(client.id)

    def _apply(self, flow: http.HTTPFlow, d: Decision, fell_open: str,
               decoded: bool = False) -> FlowState | None:
        """The decision, on the flow all at once, and its state under one key; None, and the
        flow left as it came, when it is not provider traffic. `decoded`: the pipeline read
        the body decoded, and it goes upstream so (`_decoded`)."""
        if d.answer is None and d.route is None:
            return None
        if decoded:
            flow.request.decode()
        state = FlowState(decision=d, fell_open=fell_open)
        flow.metadata[STATE] = state
        if d.answer is not None:
            flow.response = http.Response.make(d.answer.status, d.answer.body,
                                               {"content-type": d.answer.content_type})
            flow.metadata[FACTS] = {"upstream": "", "note": d.note}
            return state
        route = d.route
        assert route is not None  # (provider traffic: neither answered nor left alone above)
        if d.job is not None and self.pipeline is not None:
            state.capture = Capture(d.job, self.pipeline, self.executor)
            state.relayed = d.job.relay
        token = ""
        if state.capture and state.relayed:
            state.capture.job.forwarded = asyncio.Event()  # the first bytes out (Forwarded)
            token = self.relay.submit(state.capture)
        for name in d.strip:
            del flow.request.headers[name]
        if token:
            # The job carries the headers and the body: the relay would read mitmproxy's copies
            # only to drop them (a coding session's requests grow to hundreds of KB, sent
            # again every round, under a harness's 20-odd headers). _end puts the headers
            # back, and _settle what went upstream, for inspection.
            state.headers = flow.request.headers.fields
            flow.request.headers = http.Headers(((b"host", b""), (_JOB, token.encode())))
            flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.relay.port
            flow.request.content = b""
        else:
            flow.request.url = route.upstream_url
            if d.job:  # the reply is read by our tee, which cannot read every encoding
                flow.request.headers.pop("accept-encoding", None)
            if d.body is not None:
                state.original = flow.request.raw_content
                flow.request.content = d.body
        # The facts are made from the state's references once the reply is done (_settle).
        state.upstream = route.upstream_url
        flow.metadata[FACTS] = {"upstream": route.upstream_url, "note": d.note}
        if token:  # last: the flow is the relay's now, and the provider hears of it at once
            self.relay.begin(token)
        return state

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow.metadata)
        if state is None or flow.response is None:
            return
        if flow.response.status_code == 400 and state.original is not None:
            return  # buffered: the response hook retries it as the client sent it
        stream: StreamTee | Forwarded | None = None
        capture = None if state.relayed else state.capture  # the relay reads its own reply
        if capture and flow.response.status_code < 400:
            state.tee = ReplyTee(capture.job, flow.response.headers.get("content-encoding", ""))
            stream = StreamTee(state, capture)
        elif state.relayed and state.capture and (event := state.capture.job.forwarded):
            stream = Forwarded(event)
        if _readable():  # mitmproxy keeps nothing of a streamed body: a copy to inspect
            state.kept = Kept(stream)
            flow.response.stream = state.kept
        else:  # no buffering: every chunk goes to the client as it comes
            flow.response.stream = stream or True

    async def response(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow.metadata)
        if state is not None and state.original is not None and flow.response is not None:
            original, state.original = state.original, None
            try:
                if (resend := as_sent(flow.response.status_code, original)) is not None:
                    await self._retry_as_sent(flow, state, resend)
            except Exception:
                log.exception("perpetuity: the retry failed; the 400 stands")
        await self._end(flow)

    async def error(self, flow: http.HTTPFlow) -> None:
        await self._end(flow)

    async def _retry_as_sent(self, flow: http.HTTPFlow, state: FlowState, original: bytes) -> None:
        """mitmproxy's path of `relay.as_sent`: the whole answer, buffered, is the client's."""
        client = self.relay.client
        if client is None:
            return
        headers = [(k, v) for k, v in flow.request.headers.items(multi=True)
                   if k.lower() not in _NOT_RESENT]
        try:
            resp = await client.send(Request(flow.request.method, flow.request.url, headers,
                                             original))
            try:
                content = decoded(await resp.aread(), resp.header("content-encoding"))
            finally:
                await resp.aclose()
        except UpstreamError as e:
            log.warning("perpetuity: the retry failed (%s); the 400 stands", e)
            return
        flow.request.content = original
        state.fell_open = REFUSED
        flow.response = http.Response.make(
            resp.status_code, content,
            [(k.encode(), v.encode("utf-8", "surrogateescape")) for k, v in resp.headers
             if k not in _NOT_RESENT])
        if state.capture is not None and resp.status_code < 400:
            tee = ReplyTee(state.capture.job, "")
            tee.feed(content)
            state.tee = tee  # stored by FlowState.finish

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(STATE, None)

    async def _end(self, flow: http.HTTPFlow) -> None:
        """A flow's end (its response, or its error): the turn stored, the real destination
        shown, the facts made."""
        self.drain.end(flow.id)
        state = state_of(flow.metadata)
        if state is None:
            return
        state.finish()
        if state.headers is not None:
            # A job the flow ended without delivering (an error, another addon's answer) is
            # dropped with its upstream call; one the relay ran is gone already.
            self.relay.drop(flow.request.headers.get(JOB_HEADER, ""))
            # Show the real destination in mitmweb, not the relay, and what the client sent.
            flow.request.headers = http.Headers(state.headers)
            flow.request.url = state.upstream
        await self._settle(flow, state)

    async def _settle(self, flow: http.HTTPFlow, state: FlowState) -> None:
        """The flow's facts as plain values (what mitmproxy saves and mitmweb shows), its
        comment and mark, and the tool loop's hidden rounds as flows of their own; the live
        state dropped (a WebSocket keeps its handshake). After the reply: nothing here is on
        the request path."""
        d, fell_open, kept = state.decision, state.fell_open, state.kept
        if kept is not None and flow.response is not None and flow.response.raw_content is None:
            flow.response.raw_content = b"".join(kept.chunks)  # the reply the client received
        if flow.websocket and state.handshake is not None:
            flow.metadata[STATE] = FlowState(handshake=state.handshake, chain=state.chain)
        else:
            del flow.metadata[STATE]
        if d is None or not _readable():
            return
        try:
            job = d.job if d.job and d.job.relay else None
            if job and d.body is not None and job.original is None and not fell_open:
                fell_open = (REFUSED if job.rounds and job.rounds[0].status == 400 else
                             "the recall tools failed before the first byte; sent as sent")
            facts = inspection.facts(d, d.job, fell_open)
            if job and job.body != flow.request.raw_content:
                flow.request.content = job.body  # what went upstream, as on mitmproxy's path
            # One round is the flow itself (the model answered); more were hidden from it.
            children = round_flows(flow, job.method, job.url, job.headers, job.rounds,
                                   facts["rounds"]) if job and len(job.rounds) > 1 else []
            flow.metadata[FACTS] = facts
            flow.comment = inspection.summary(facts)
            if facts["fell_open"] or facts["repaired"]:
                flow.marked = ":warning:" if facts["fell_open"] else ":wrench:"
            for child in children:
                await ctx.master.load_flow(child)
        except Exception:
            log.exception("perpetuity: could not gather what this flow showed the model")

    async def _run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        """On the tools' threads, so the event loop and the preparing thread never wait."""
        pipeline = self.pipeline
        assert pipeline is not None
        # The notes' own thread: a hung disk never holds up the recall tools.
        pool = self.notes if pipeline.writes_notes(name) else self.tools
        return await asyncio.get_running_loop().run_in_executor(
            pool, pipeline.run_tool, name, arguments, memory)


def _decoded(flow: http.HTTPFlow, req: HttpRequest) -> tuple[HttpRequest, bool]:
    """The request with its body decoded (gzip, deflate, br, zstd) and no content-encoding, as
    it then goes upstream: stored like any other, and readable by a provider that reads only
    JSON (re-encoding what the frame rebuilt would cost a compression a call); or as it came,
    said in the log, where it cannot be decoded."""
    encoding = flow.request.headers["content-encoding"]
    try:
        body = flow.request.get_content(strict=True) or b""
    except ValueError:  # (its message quotes the body's first bytes: not for the log)
        log.warning("perpetuity: %s %s: not stored, forwarded as sent: its content-encoding "
                    "%r could not be decoded", req.method, req.path.split("?", 1)[0], encoding)
        return req, False
    headers = tuple((k, v) for k, v in req.headers if k.lower() != "content-encoding")
    return dataclasses.replace(req, body=body, headers=headers), True


async def _stop_accepting() -> None:
    """Close every listening socket; the connections they accepted go on."""
    if (server := ctx.master.addons.get("proxyserver")) is not None:
        await server.servers.update([])


def listening() -> list[str]:
    """Every address the proxy listens on (each mode's own, else listen_host; "" is all)."""
    hosts = []
    for spec in ctx.options.mode:
        try:
            hosts.append(ProxyMode.parse(spec).listen_host(ctx.options.listen_host))
        except ValueError:
            hosts.append("")  # mitmproxy refuses it anyway; never taken for loopback
    return hosts


def _readable() -> bool:
    """Can anyone read a flow's facts: a flow list (mitmweb, the console), a flow file being
    written, or mitmdump printing bodies? Otherwise making them would cost the event loop
    0.18 ms a request (p50; 0.9 ms p90, on bench_latency's sides) for no one."""
    o = ctx.options
    return (ctx.master.addons.get("view") is not None
            or ("save_stream_file" in o and bool(o.save_stream_file))
            or ("flow_detail" in o and o.flow_detail >= 3))
