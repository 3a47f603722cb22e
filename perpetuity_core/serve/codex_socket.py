"""The Codex socket: Codex's own provider speaks Responses over a WebSocket. Each client message
is a request, read whole through the client's chain (`serve.chain`), framed and stored as the
HTTP request it stands for, and sent upstream on the proxy's own chain; the server's events are
its reply. The handshake's identity is the HTTP path's (its `request` hook keeps it on the
flow's state). Anything we cannot read goes as sent, and the chain is marked lost.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mitmproxy import http

from perpetuity_core.serve.chain import ENDED, Chain, framed
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.flowstate import STATE, FlowState, state_of
from perpetuity_core.serve.serving import Serving
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire.protocols import responses
from perpetuity_core.wire.sse import Event

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
        try:
            if message.from_client:
                await self._client_message(state, handshake, state.chain, message)
            else:
                self._server_message(state, state.chain, message)
        except Exception:
            state.chain.lost()
            log.exception("perpetuity: could not read a WebSocket message; it went through as sent")

    async def _client_message(self, state: FlowState, handshake: HttpRequest, link: Chain,
                              message: Any) -> None:
        state.message = None
        pipeline = self.shared.pipeline
        assert pipeline is not None
        decision, content = await self.shared.parser.run(framed, pipeline, handshake, link,
                                                         message.content)
        if content is not None:  # every change at once, after everything it needs succeeded
            message.content = content
        if decision.job is not None:
            capture = Capture(decision.job, pipeline, self.shared.executor)
            capture.sent()
            state.message = (capture, responses.ReplyAssembler())

    @staticmethod
    def _server_message(state: FlowState, link: Chain, message: Any) -> None:
        try:
            event = json.loads(message.content)
        except ValueError:
            return
        link.event(event)
        if state.message is None or not isinstance(event, dict):
            return
        capture, assembler = state.message
        kind = str(event.get("type", ""))
        assembler.feed(Event(kind, message.text))
        if kind in ("response.completed", *ENDED):
            state.message = None
            capture.replied(assembler.reply())

    def websocket_end(self, flow: http.HTTPFlow) -> None:
        flow.metadata.pop(STATE, None)
