"""Shutdown that loses no reply: told to stop (SIGTERM, SIGINT), the proxy stops accepting, lets
the replies in flight reach their clients whole (their turns stored as they end), and only then
closes the store, waiting at most `BOUND` seconds. A request that comes meanwhile (on a
connection accepted before) is answered 503, and its harness sends it again.

mitmproxy runs every addon's `done` hook and then cancels whatever connections remain: without
the wait, a reply streaming at SIGTERM was cut mid-stream and its end was stored only if the
harness sent the turn again, and the cancelled flow's capture reached an executor already shut
down ("cannot schedule new futures after shutdown"). A reply still running at the bound is
stored as far as it came (`Drain.left`), before the store closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("perpetuity")

BOUND = 30.0  # seconds the replies in flight get to finish
# The answer to a request that comes while the proxy drains: a harness retries a 503.
REFUSED = b"perpetuity: the proxy is shutting down; send this request again\n"
_POLL = 0.05


class Drain:
    """The flows in flight (from their request to their end), and the wait for them."""

    def __init__(self, bound: float = BOUND) -> None:
        self.bound = bound
        self._flows: dict[str, Any] = {}  # flow id -> the flow, while it runs
        # Set as the wait begins: a request that comes after (on a connection accepted before)
        # is refused with REFUSED, not read by a pipeline whose store is about to close.
        self.closing = False

    def begin(self, flow_id: str, flow: Any) -> None:
        self._flows[flow_id] = flow

    def end(self, flow_id: str) -> None:
        self._flows.pop(flow_id, None)

    async def wait(self, stop_accepting: Callable[[], Awaitable[object]]) -> list[Any]:
        """Stop accepting, then wait for the flows in flight to end, up to the bound; the flows
        still running then."""
        self.closing = True
        try:
            await stop_accepting()
        except Exception as e:  # keep draining: the listener is closed at exit anyway
            log.warning("perpetuity: could not stop accepting connections (%s)", e)
        if not self._flows:
            return []
        log.info("perpetuity: shutting down: waiting up to %.0f s for %d repl%s in flight",
                    self.bound, len(self._flows), "y" if len(self._flows) == 1 else "ies")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.bound
        while self._flows and loop.time() < deadline:
            await asyncio.sleep(_POLL)
        left = list(self._flows.values())
        if left:
            log.warning("perpetuity: %d repl%s still in flight after %.0f s; stored as far as "
                        "they came", len(left), "y" if len(left) == 1 else "ies", self.bound)
        return left
