"""What reading a Codex WebSocket reply costs the event loop, per provider event: the hook's
body before the recall tools rode the socket (parse, the chain, the stored reply's assembler),
and `socket_tools.SocketReply.event` now, without our tools (the same work) and with them (each
event renumbered and written again by the merger). Over the largest captured Codex reply
(../shared/fixtures/harness/codex), its text deltas cut finer to `--deltas`. Prints JSON.

    .venv/bin/python scripts/bench_socket_events.py [--repeat 200] [--deltas 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.chain import ENDED, Chain, Histories
from perpetuity_core.serve.exchange import Decision, Job, PendingTurn
from perpetuity_core.serve.socket_tools import SocketReply
from perpetuity_core.wire.conversation import Protocol
from perpetuity_core.wire.protocols import responses
from perpetuity_core.wire.sse import Event

CAPTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "harness" / "codex"
SPECS = [{"name": "memory_search", "description": "", "input_schema": {}}]


def reply_events(deltas: int) -> list[bytes]:
    """The largest captured reply, its text deltas replaced by `deltas` pieces of its text."""
    files = [f for f in CAPTURES.glob("*ws_message*.response.json")]
    frames = max((json.loads(f.read_text())["frames"] for f in files), key=len)
    out: list[dict[str, Any]] = []
    for frame in frames:
        if frame.get("type") == "response.output_text.delta":
            continue
        if frame.get("type") == "response.output_text.done":
            text = frame["text"] or "word " * 200
            step = max(1, len(text) // deltas)
            out += [{**frame, "type": "response.output_text.delta", "delta": text[i:i + step]}
                    for i in range(0, len(text), step)]
        out.append(frame)
    return [json.dumps(f).encode() for f in out]


class Stored:
    def __init__(self, job: Job) -> None:
        self.job = job

    def replied(self, reply: Any) -> None:
        pass


def job(tools: bool) -> Job:
    pending = PendingTurn(user="u", conversation="c", provider="openai", model="m",
                          messages=[], at=0.0)
    return Job(method="POST", url="", headers=[], body=b"", protocol=Protocol.RESPONSES,
               stream=True, pending=pending, tool_specs=SPECS if tools else [],
               memory=TurnMemory(user_id=1, conversation_id=1, asked_at=0.0) if tools else None)


def before(events: list[bytes]) -> None:
    link = Chain(Histories(), "k")
    link.send({"input": []}, [], [])
    assembler = responses.ReplyAssembler()
    for raw in events:
        event = json.loads(raw)
        link.event(event)
        kind = str(event.get("type", ""))
        assembler.feed(Event(kind, raw.decode()))
        if kind in ("response.completed", *ENDED):
            assembler.reply()


async def now(events: list[bytes], tools: bool) -> None:
    link = Chain(Histories(), "k")
    link.send({"input": []}, [], [])
    reply = SocketReply(link, Stored(job(tools)), Decision(), b"{}", None,  # type: ignore[arg-type]
                        None, 5.0, 0)  # type: ignore[arg-type]
    for raw in events:
        await reply.event(raw)


async def timed(events: list[bytes], repeat: int) -> dict[str, list[float]]:
    """Each side's time per event, interleaved so that load falls on every side alike; on one
    event loop, as the hook runs."""
    times: dict[str, list[float]] = {"before": [], "no_tools": [], "tools": []}
    for _ in range(repeat):
        for name in times:
            t0 = time.perf_counter()
            if name == "before":
                before(events)
            else:
                await now(events, name == "tools")
            times[name].append((time.perf_counter() - t0) * 1e6 / len(events))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--deltas", type=int, default=400)
    args = ap.parse_args()
    events = reply_events(args.deltas)
    times = asyncio.run(timed(events, args.repeat))
    print(json.dumps({"events": len(events), "repeat": args.repeat, "us_per_event_p50": {
        k: round(statistics.median(v), 2) for k, v in times.items()}}))


if __name__ == "__main__":
    main()
