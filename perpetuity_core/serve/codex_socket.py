"""The Codex socket: Codex's own provider speaks Responses over a WebSocket. Each client message
is a request, read whole through the client's chain (`serve.chain`), framed and stored as the
HTTP request it stands for, and sent upstream on the proxy's own chain; the server's events are
its reply. A round of the recall tools' calls alone is hidden from the client, its calls run
and the next round injected on the same connection (`serve.socket_tools`). The handshake's
identity is the HTTP path's (its `request` hook keeps it on the flow's state). Anything we
cannot read goes as sent, and the chain is marked lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from mitmproxy import ctx, http

from perpetuity_core.serve.chain import Chain, framed
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.flowstate import STATE, FlowState, state_of
from perpetuity_core.serve.flowview import socket_facts
from perpetuity_core.serve.serving import Serving
from perpetuity_core.serve.settle import readable
from perpetuity_core.serve.socket_tools import SocketReply
from perpetuity_core.serve.writer import Capture

log = logging.getLogger("perpetuity")


class CodexSocket:
    def __init__(self, shared: Serving) -> None:
        self.shared = shared

    async def websocket_message(self, flow: http.HTTPFlow) -> None:
        state = state_of(flow.metadata)
        handshake = state.handshake if state else None
        if (state is None or handshake is None or state.chain is None or flow.websocket is None
                or self.shared.pipeline is None):
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
        s = self.shared
        pipeline = s.pipeline
        assert pipeline is not None
        decision, content = await s.parser.run(framed, pipeline, handshake, link, message.content)
        original = message.content
        if content is not None:  # every change at once, after everything it needs succeeded
            message.content = content
        if decision.job is not None and flow.websocket is not None:
            capture = Capture(decision.job, pipeline, s.executor, pipeline.landing)
            capture.sent()
            state.message = SocketReply(
                link, capture, decision, message.content, None if content is None else original,
                s.run_tool, s.relay.tool_timeout, len(flow.websocket.messages) - 1)

    @staticmethod
    async def _server_message(flow: http.HTTPFlow, state: FlowState, link: Chain,
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
            if readable():
                socket_facts(flow, reply.decision, reply.job, reply.index, reply.fell_open)

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(STATE, None)
