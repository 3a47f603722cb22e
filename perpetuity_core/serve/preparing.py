"""Where a request is prepared: on the parser's one thread, so that the event loop never waits
on a frame's retrieval, or at once on the loop where that costs less than the two thread hops
(issue 24) and no other request is being prepared: capture alone (`Pipeline.light`) and a
task's tool round whose plan is carried (`Pipeline.carried`). The pipeline's caches (the bodies
last read, the shapes kept, the plans) are one preparer's at a time: a lock.

Why the loop can take a tool round: the thread spares it nothing for work far shorter than the
GIL's switch interval (5 ms), since the loop waits for the interpreter either way, and the two
hops cost the request their own wall time and CPU (futures, a thread woken, the loop's
self-pipe). A tool round's prepare measured ~0.8 ms CPU (profile_latency.py) where the hops
took 0.3 and 0.15 ms of wall time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from perpetuity_core.serve.exchange import Decision
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.reading import Understood


class Preparing:
    def __init__(self) -> None:
        # Requests are parsed on their own thread, so a request never queues behind a write.
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-parse")
        self._lock = threading.Lock()  # held while a request is prepared, on either side

    async def decide(self, pipeline: Pipeline, u: Understood) -> Decision:
        """`pipeline.decide(u)`, on the loop when it is light or a tool round whose plan is
        carried (`Pipeline.carried`), and the thread idle. A round that is not carried goes
        to the thread with what the loop read of it: its body is not read again."""
        if self._lock.acquire(blocking=False):
            try:
                if pipeline.light(u):
                    return pipeline.decide(u)
                if (decision := pipeline.carried(u)) is not None:
                    return decision
            finally:
                self._lock.release()
        return await self.run(pipeline.decide, u)

    async def run[T](self, prepare: Callable[..., T], *args: Any) -> T:
        """`prepare(*args)` on the parser's thread, while no other request is prepared."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._locked,
                                                                prepare, *args)

    def _locked[T](self, prepare: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return prepare(*args)

    def shutdown(self) -> None:
        self.thread.shutdown(wait=False)
