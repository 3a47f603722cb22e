"""One flow's serving state, under one `flow.metadata` key while the flow runs, and the
`flow.response.stream` callables that read through it.

The key is dropped once the flow is done: mitmproxy deep-copies flow.metadata to save a flow,
and a capture (its Future's lock) cannot be copied, so a flow holding one was dropped from `-w`
files. What stays is the facts under `flowview.FACTS`, plain values that save and reopen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from perpetuity_core.serve.chain import Chain
from perpetuity_core.serve.exchange import Decision, HttpRequest
from perpetuity_core.serve.socket_tools import SocketReply
from perpetuity_core.serve.tee import ReplyTee
from perpetuity_core.serve.writer import Capture

log = logging.getLogger("perpetuity")

STATE = "perpetuity_state"  # flow.metadata key of a live flow's FlowState


@dataclass(slots=True, kw_only=True)
class FlowState:
    decision: Decision | None = None  # what the pipeline decided (references, for the facts)
    capture: Capture | None = None  # the turn's writes (None: nothing of this flow is stored)
    relayed: bool = False  # the relay runs the exchange and reads the reply itself
    upstream: str = ""  # the real destination, shown in place of the relay's address
    # A relayed flow's headers as the client sent them (their fields), while mitmproxy's
    # request to the relay carries only the job's token.
    headers: tuple[tuple[bytes, bytes], ...] | None = None
    original: bytes | None = None  # the body as the client sent it, when we changed it
    tee: ReplyTee | None = None  # reads the reply on mitmproxy's stream until it ends
    kept: BodyCopy | None = None  # a copy of a streamed body, for inspection
    fell_open: str = ""  # why the request went upstream as the client sent it after all
    # A WebSocket's: its handshake (the identity of every message to come), its two chains,
    # and the client message whose reply is being read.
    handshake: HttpRequest | None = None
    chain: Chain | None = None
    message: SocketReply | None = None

    def finish(self) -> None:
        """Every flow with a turn ends here: the turn is stored even if no reply came, and
        what the tee read of a body that never ended (cut, client gone) with it."""
        if self.capture is None:
            return
        tee, self.tee = self.tee, None
        self.capture.replied(tee.reply() if tee else None)


def state_of(metadata: dict[str, Any]) -> FlowState | None:
    state = metadata.get(STATE)
    return state if isinstance(state, FlowState) else None


class BodyCopy:
    """A `flow.response.stream` callable that keeps a copy of the body as it passed, for
    inspection, around the tee when there is one."""

    def __init__(self, inner: Callable[[bytes], bytes] | None) -> None:
        self.inner = inner
        self.chunks: list[bytes] = []

    def __call__(self, chunk: bytes) -> bytes:
        self.chunks.append(chunk)
        return self.inner(chunk) if self.inner else chunk


class StreamTee:
    """A `flow.response.stream` callable: every chunk goes to the client unchanged, a copy is read.

    Runs synchronously on mitmproxy's event loop, so it only parses, and it cannot raise: an
    exception here would silently drop the chunk. A body that never ends (cut, client gone) is
    stored by the addon's `error` hook from what the tee read (`FlowState.finish`).
    """

    def __init__(self, state: FlowState, capture: Capture) -> None:
        self.state = state
        self.capture = capture
        self.started = False

    def __call__(self, chunk: bytes) -> bytes:
        try:
            tee = self.state.tee
            if tee is None:
                return chunk
            if self.started and chunk:
                tee.feed(chunk)
            elif chunk:
                # The first chunk is read, and the request's write queued, once it is on its
                # way (the next turn of the loop), so neither delays the first byte; a chunk
                # or the end coming before that reads it first.
                self.started = True
                tee.defer(chunk)
                asyncio.get_running_loop().call_soon(self._first, tee)
            else:
                # The end of the body, before the client sees it: the reply is queued first, so
                # the harness's next request finds it stored.
                self.state.tee = None
                self.capture.replied(tee.reply())
        except Exception:
            log.exception("perpetuity: capture failed; the reply is forwarded unchanged")
        return chunk

    def _first(self, tee: ReplyTee) -> None:
        tee.catch_up()  # (a no-op when a chunk after it came first)
        self.capture.sent()


class Forwarded:
    """A relayed flow's `flow.response.stream` callable: every chunk goes to the client
    unchanged; the first tells the relay it is on its way (`relay.forwarded`). It cannot raise."""

    def __init__(self, event: asyncio.Event) -> None:
        self.event = event

    def __call__(self, chunk: bytes) -> bytes:
        if chunk and not self.event.is_set():
            self.event.set()
        return chunk
