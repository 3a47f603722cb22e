"""A job's writes, on the store's one writer thread: `sent` (the request's messages) and
`replied` (the reply and the call's live tally, queued behind them).

Many paths reach the point where a write is due (the relay as the first bytes go out and again
at the end, the tee on mitmproxy's stream, the addon's `response` and `error` hooks, a fallback
after a 400), so each step is idempotent by design: a step that already ran is a no-op, never
a second write. Both steps run on the event loop, and only queue.

The client has its reply before the writer has run what it queued (the turn, its reheats, the
reply, the clock's moves). `Landing` keeps each user's latest queued write, which that user's
next request waits for (bounded) before it retrieves: its frame then reads what came before it,
whatever the machine's load; another user's request is not held for them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_for
from typing import Any, Protocol

from perpetuity_core.memory.storage.capture import TurnContext
from perpetuity_core.serve.exchange import Job, PendingTurn
from perpetuity_core.wire.conversation import Reply

log = logging.getLogger("perpetuity")

# How long a request waits for its user's earlier writes: far past a reply's write (~1-20 ms,
# more under load), short enough that a stuck disk delays a request, never stops it.
LANDING_BOUND = 2.0  # seconds


class Stores(Protocol):
    """The writes themselves (the pipeline's), run on the writer's thread."""

    def store_turn(self, p: PendingTurn) -> TurnContext: ...

    def store_reply(self, turn: TurnContext, reply: Reply, at: float,
                    pending: PendingTurn | None = None) -> None: ...

    def tally(self, job: Job, reply: Reply) -> None: ...


class Landing:
    """Each user's latest write queued on the one writer thread, until it has run: FIFO, so
    when it has, so have all that user's writes queued before it."""

    def __init__(self, bound: float = LANDING_BOUND) -> None:
        self.bound = bound
        self._last: dict[str, Future[Any]] = {}  # user key -> their latest write not yet run
        self._lock = threading.Lock()  # queued on the event loop, waited for on the parser's

    def queued(self, user: str, write: Future[Any]) -> None:
        with self._lock:
            self._last[user] = write
        write.add_done_callback(lambda done: self._landed(user, done))  # (at once, if run)

    def _landed(self, user: str, done: Future[Any]) -> None:
        with self._lock:
            if self._last.get(user) is done:
                del self._last[user]

    def wait(self, user: str) -> bool:
        """Wait, up to `bound` seconds, for `user`'s writes queued so far; whether any were
        pending."""
        with self._lock:
            write = self._last.get(user)
        if write is None:
            return False
        if wait_for([write], timeout=self.bound).not_done:
            log.warning("perpetuity: a request was prepared before its user's earlier writes"
                        " were stored (the writer was busy over %.1f s)", self.bound)
        return True


class Capture:
    """One job's capture: made with the job, carried with it wherever it runs; its writes
    are told to `landing` (the pipeline's), which the user's next request waits for."""

    def __init__(self, job: Job, pipeline: Stores, writer: Executor,
                 landing: Landing | None = None) -> None:
        self.job = job
        self._pipeline = pipeline
        self._writer = writer  # one thread: SQLite has one writer, and FIFO keeps replies in order
        self._landing = landing
        self._turn: Future[TurnContext] | None = None  # the request's write, once queued
        self._replied = False

    def sent(self) -> None:
        """Queue the request's write; once."""
        if self._turn is not None:
            return
        self._turn = self._writer.submit(self._pipeline.store_turn, self.job.pending)
        self._turn.add_done_callback(_report_unstored)  # read even when no reply follows
        self._tell(self._turn)

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

        self._tell(self._writer.submit(write))

    def _tell(self, write: Future[Any]) -> None:
        if self._landing is not None:
            self._landing.queued(self.job.pending.user, write)


def _report_unstored(turn: Future) -> None:
    """Fail open, not silent: the reply went to the client; the turn is stored when the
    conversation's next request re-sends it (capture recognises what the store holds)."""
    if not turn.cancelled() and (e := turn.exception()) is not None:
        log.error("perpetuity: a turn was not stored (%s); the conversation's next request"
                  " re-sends it and it is stored then", e)
