"""What the proxy's addons share (serve/script.py lists them): the memory, its pipeline, the
relay that runs the recall tools' loop, and the threads the work runs on. Start-up
(`serve.startup`) fills it from the options; the HTTP path, the Codex socket and inspection
read it; `stop` is the one place the proxy lets go of it at shutdown, once the replies in
flight drained (`drain`: the HTTP path begins and ends each flow in it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from perpetuity_core.memory.storage.store import Store
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.chain import Histories
from perpetuity_core.serve.direct import Addressing
from perpetuity_core.serve.drain import Drain
from perpetuity_core.serve.flowstate import state_of
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.preparing import Preparing
from perpetuity_core.serve.relay import Relay
from perpetuity_core.wire import identity


class Serving:
    def __init__(self) -> None:
        self.store: Store | None = None
        self.pipeline: Pipeline | None = None
        self.relay = Relay(self.run_tool)
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

    async def stop(self, stop_accepting: Callable[[], Awaitable[object]]) -> None:
        """The proxy's shutdown: no longer accepting (`stop_accepting`: mitmproxy's listeners
        closed), the replies in flight drained (serve.drain), the relay stopped, the store
        closed on its own thread (where it was opened and is written), the threads let go."""
        for flow in await self.drain.wait(stop_accepting):
            if (state := state_of(flow.metadata)) is not None:
                state.finish()  # queued before the store closes; the flow's end is a no-op
        await self.relay.stop()
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.store.close)
        self.executor.shutdown(wait=False)
        self.parser.shutdown()
        self.tools.shutdown(wait=False)
        self.notes.shutdown(wait=False)

    async def run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        """On the tools' threads, so the event loop and the preparing thread never wait."""
        pipeline = self.pipeline
        assert pipeline is not None
        # The notes' own thread: a hung disk never holds up the recall tools.
        pool = self.notes if pipeline.writes_notes(name) else self.tools
        return await asyncio.get_running_loop().run_in_executor(
            pool, pipeline.run_tool, name, arguments, memory)

