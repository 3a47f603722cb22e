"""Where a request is prepared: on the parser's one thread, so that the event loop never waits
on a frame's retrieval, or at once on the loop where that costs less than the two thread hops
(`Pipeline.light`: capture alone, issue 24) and no other request is being prepared. The
pipeline's caches (the bodies last read, the shapes kept) are one preparer's at a time: a lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from perpetuity_core.serve.exchange import Decision, HttpRequest
from perpetuity_core.serve.pipeline import Pipeline


class Preparing:
    def __init__(self) -> None:
        # Requests are parsed on their own thread, so a request never queues behind a write.
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-parse")
        self._lock = threading.Lock()  # held while a request is prepared, on either side

    async def decide(self, pipeline: Pipeline, req: HttpRequest) -> Decision:
        """`pipeline.prepare(req)`, on the loop when it is light and the thread idle."""
        if pipeline.light(req) and self._lock.acquire(blocking=False):
            try:
                return pipeline.prepare(req)
            finally:
                self._lock.release()
        return await self.run(pipeline.prepare, req)

    async def run[T](self, prepare: Callable[..., T], *args: Any) -> T:
        """`prepare(*args)` on the parser's thread, while no other request is prepared."""
        return await asyncio.get_running_loop().run_in_executor(self.thread, self._locked,
                                                                prepare, *args)

    def _locked[T](self, prepare: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return prepare(*args)

    def shutdown(self) -> None:
        self.thread.shutdown(wait=False)
