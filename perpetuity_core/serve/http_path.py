"""The HTTP path: each request decided by the pipeline and the decision applied to the flow at
once; the reply streamed to the client through our tee (or run by the relay, with the recall
tools' loop); the request's end, whatever it was, closing the turn's capture.

It fails open: if anything in the memory pipeline raises, the request goes upstream exactly as
the client sent it (routed, when the client addressed us as its base URL) and the error is
logged. Changes to a flow are applied all at once, after everything they depend on succeeded,
because mitmproxy catches hook exceptions and carries on with whatever state the flow was left in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from mitmproxy import ctx, http

from perpetuity_core.errors import UpstreamError
from perpetuity_core.serve.chain import Chain
from perpetuity_core.serve.drain import REFUSED as DRAIN_REFUSED
from perpetuity_core.serve.exchange import HOP_BY_HOP, Decision, HttpRequest
from perpetuity_core.serve.flowstate import (
    STATE,
    BodyCopy,
    FlowState,
    Forwarded,
    StreamTee,
    state_of,
)
from perpetuity_core.serve.flowview import FACTS
from perpetuity_core.serve.relay import JOB_HEADER, REFUSED, as_sent
from perpetuity_core.serve.serving import Serving
from perpetuity_core.serve.settle import readable
from perpetuity_core.serve.tee import ReplyTee
from perpetuity_core.serve.upstream import Request, decoded
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire.route import credential

log = logging.getLogger("perpetuity")
# Not carried onto a retry beside the hop-by-hop headers: encodings (the retry decodes what it
# reads).
_NOT_RESENT = HOP_BY_HOP | {"content-encoding"}
_JOB = JOB_HEADER.encode()


class HttpPath:
    def __init__(self, shared: Serving) -> None:
        self.shared = shared

    def load(self, loader: Any) -> None:
        loader.add_option("perpetuity_tool_timeout", int, 30,
                          "Seconds one recall tool call may take before the model is told it "
                          "timed out.")

    def configure(self, updated: set[str]) -> None:
        if "perpetuity_tool_timeout" in updated:
            self.shared.relay.tool_timeout = ctx.options.perpetuity_tool_timeout

    async def request(self, flow: http.HTTPFlow) -> None:
        pipeline = self.shared.pipeline
        if flow.response or flow.error or not flow.live or pipeline is None:
            return
        drain = self.shared.drain
        if drain.closing:  # the store is closing: nothing new is read, or stored
            flow.response = http.Response.make(503, DRAIN_REFUSED, {
                "content-type": "text/plain; charset=utf-8", "retry-after": "1",
                "connection": "close"})
            return
        drain.begin(flow.id, flow)
        req = HttpRequest(
            method=flow.request.method,
            host=flow.request.pretty_host,
            path=flow.request.path,
            headers=tuple(flow.request.headers.items(multi=True)),
            body=flow.request.raw_content or b"",
            direct=await self.shared.addressing.is_direct(
                flow.client_conn.id, flow.client_conn.sockname, flow.request.host,
                flow.request.pretty_host, flow.request.port),
        )
        fell_open, decoded = "", False
        try:
            # What the line and headers decide is decided here, on the loop: no thread hop.
            understood = pipeline.understand(req)
            decision = understood.decision if understood.done else None
            if decision is None and "content-encoding" in flow.request.headers:
                req, decoded = _decoded(flow, req)
                if decoded:
                    understood = pipeline.understand(req)
                else:
                    decision = pipeline.reader.route_only(req)
            if decision is None:
                decision = await self.shared.parser.decide(pipeline, understood)
        except Exception as e:
            log.exception("perpetuity: pipeline failed; forwarding the request untouched")
            decision = pipeline.reader.route_only(req)
            fell_open = f"the pipeline failed ({type(e).__name__}: {e})"
        state = self._apply(flow, decision, fell_open, decoded)
        if state is None:
            drain.end(flow.id)  # not provider traffic: nothing of it is stored
        if (state and decision.route
                and flow.request.headers.get("upgrade", "").lower() == "websocket"):
            state.handshake = req  # the identity of every message to come
            headers = {k.lower(): v for k, v in req.headers}
            state.chain = Chain(self.shared.histories, credential(headers, req.path))

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Whatever comes through a tunnel was addressed to the tunnel's host, never to us."""
        self.shared.addressing.tunnels.add(flow.client_conn.id)

    def client_disconnected(self, client: Any) -> None:
        self.shared.addressing.tunnels.discard(client.id)

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
        if d.job is not None and self.shared.pipeline is not None:
            state.capture = Capture(d.job, self.shared.pipeline, self.shared.executor,
                                    self.shared.pipeline.landing)
            state.relayed = d.job.relay
        token = ""
        if state.capture and state.relayed:
            state.capture.job.forwarded = asyncio.Event()  # the first bytes out (Forwarded)
            token = self.shared.relay.submit(state.capture)
        for name in d.strip:
            del flow.request.headers[name]
        if token:
            # The job carries the headers and the body: the relay would read mitmproxy's copies
            # only to drop them (a coding session's requests grow to hundreds of KB, sent
            # again every round, under a harness's 20-odd headers). _end puts the headers
            # back, and settle.Settle what went upstream, for inspection.
            state.headers = flow.request.headers.fields
            flow.request.headers = http.Headers(((b"host", b""), (_JOB, token.encode())))
            flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.shared.relay.port
            flow.request.content = b""
        else:
            flow.request.url = route.upstream_url
            if d.job:  # the reply is read by our tee, which cannot read every encoding
                flow.request.headers.pop("accept-encoding", None)
            if d.body is not None:
                state.original = flow.request.raw_content
                flow.request.content = d.body
        # The facts are made from the state's references once the reply is done (settle.Settle).
        state.upstream = route.upstream_url
        flow.metadata[FACTS] = {"upstream": route.upstream_url, "note": d.note}
        if token:  # last: the flow is the relay's now, and the provider hears of it at once
            self.shared.relay.begin(token)
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
        if readable():  # mitmproxy keeps nothing of a streamed body: a copy to inspect
            state.kept = BodyCopy(stream)
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
        client = self.shared.relay.client
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

    async def _end(self, flow: http.HTTPFlow) -> None:
        """A flow's end (its response, or its error): the turn stored, the real destination
        shown. Its facts are made after this, by settle.Settle."""
        self.shared.drain.end(flow.id)
        state = state_of(flow.metadata)
        if state is None:
            return
        state.finish()
        if state.headers is not None:
            # A job the flow ended without delivering (an error, another addon's answer) is
            # dropped with its upstream call; one the relay ran is gone already.
            self.shared.relay.drop(flow.request.headers.get(JOB_HEADER, ""))
            # Show the real destination in mitmweb, not the relay, and what the client sent.
            flow.request.headers = http.Headers(state.headers)
            flow.request.url = state.upstream



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
