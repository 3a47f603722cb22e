"""A job's writes, on the store's one writer thread: `sent` (the request's messages) and
`replied` (the reply and the call's live tally, queued behind them).

Many paths reach the point where a write is due (the relay as the first bytes go out and again
at the end, the tee on mitmproxy's stream, the addon's `response` and `error` hooks, a fallback
after a 400), so each step is idempotent by design: a step that already ran is a no-op, never
a second write. Both steps run on the event loop, and only queue.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from typing import Protocol

from perpetuity_core.memory.storage.capture import TurnContext
from perpetuity_core.serve.exchange import Job, PendingTurn
from perpetuity_core.wire.conversation import Reply

log = logging.getLogger("perpetuity")


class Stores(Protocol):
    """The writes themselves (the pipeline's), run on the writer's thread."""

    def store_turn(self, p: PendingTurn) -> TurnContext: ...

    def store_reply(self, turn: TurnContext, reply: Reply, at: float,
                    pending: PendingTurn | None = None) -> None: ...

    def tally(self, job: Job, reply: Reply) -> None: ...


class Capture:
    """One job's capture: made with the job, carried with it wherever it runs."""

    def __init__(self, job: Job, pipeline: Stores, writer: Executor) -> None:
        self.job = job
        self._pipeline = pipeline
        self._writer = writer  # one thread: SQLite has one writer, and FIFO keeps replies in order
        self._turn: Future[TurnContext] | None = None  # the request's write, once queued
        self._replied = False

    def sent(self) -> None:
        """Queue the request's write; once."""
        if self._turn is not None:
            return
        self._turn = self._writer.submit(self._pipeline.store_turn, self.job.pending)
        self._turn.add_done_callback(_report_unstored)  # read even when no reply follows

    def replied(self, reply: Reply | None) -> None:
        """Queue the reply behind its request (the request first, if it was not yet); once. None,
        a reply that could not be read: the request alone is stored."""
        self.sent()
        if reply is None or self._replied:
            return
        self._replied = True
        pipeline, turn, job = self._pipeline, self._turn, self.job
        at = job.at if job.at is not None else time.time()
        assert turn is not None

        def write() -> None:
            if turn.exception() is None:  # (the turn's failure is logged; no reply without it)
                try:
                    pipeline.store_reply(turn.result(), reply, at, job.pending)
                except Exception:
                    log.exception("perpetuity: could not store the reply")
            pipeline.tally(job, reply)  # after the reply, which the next request may read

        self._writer.submit(write)


def _report_unstored(turn: Future) -> None:
    """Fail open, not silent: the reply went to the client; the turn is stored when the
    conversation's next request re-sends it (capture recognises what the store holds)."""
    if not turn.cancelled() and (e := turn.exception()) is not None:
        log.error("perpetuity: a turn was not stored (%s); the conversation's next request"
                  " re-sends it and it is stored then", e)
