#!/usr/bin/env python3
"""Late calls against early ones, end to end through a real mitmdump (issue 43, target 2): the
six shared Claude Code sessions chained into one conversation that never ends (as `perpetuity
replay claude-code --chain` chains them), each call's request sent as Claude Code would have
sent it, through the proxy and, the same bytes, straight to a sink.

The sink (here, on its own thread) reads a request whole and answers a short streamed
Messages reply at once; it is the proxy's upstream too. A call's added time is its time
through the proxy less the time the same bytes took to the sink: what the proxy adds, whatever
the body's size costs to send. The two sides alternate call by call.

    .venv/bin/python scripts/bench_late.py [--passes 1] [--calls N] [--out FILE] [--against DIR]
                                           [--trace]

Prints JSON: the added time's p50 (ms, to the last byte) over calls 100-200 and over the last
100, their ratio, and per tenth of the calls; `--out` keeps every call's figures. `--against`
runs a second proxy from another checkout (its addon, its code) beside this one, each call sent
to both in turn: a paired comparison under the same load (a 2-core machine's load moves the
added time 2x within one run). `--trace` loads profile_latency.py's tracing addon into this
checkout's proxy: where each call's time to first byte went (its segments, and the CPU of
prepare and of the event loop), medians over calls 100-200 and over the last 100.

What it found (h-code43; the chain of 678 calls, bodies 0.7 to 7.3 MB, 2 to 1,356 messages; a
2-core machine at load 9): the added time's p50 early / late 57.7 / 70.2 ms (1.22x) in one run,
105.6 / 79.9 (0.76x) in the traced one, 78.6 / 55.3 (0.70x) paired with bfffdb6 (before the
live tally and the count before parsing; 75.4 / 54.9 there): the load moves it more than the
history does. Paired, this against bfffdb6: -0.8 ms median over all calls, -1.9 past 600
messages. Traced, early / late medians: mitmproxy reading the body to our hook 32.3 / 50.4 ms
(the direct side's send 15.8 / 23.0), to the preparing thread 0.5 / 8.8, prepare 11.8 / 3.7
wall for 2.65 / 2.67 ms CPU (flat), the event loop's CPU 11.0 / 13.4. Every round past
INLINE_MESSAGES prepared on the thread, the hop is what late calls pay; but with no bound at
all (late rounds prepared on the loop too), paired against this: +5.3 ms past 600 messages
(+0.4 below), so the bound stays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.cli.replay.request import build, load_template  # noqa: E402
from perpetuity_core.cli.replay.sessions import chained, sessions_in_order  # noqa: E402
from tests import conftest  # noqa: E402
from tests.conftest import free_port, start_proxy, stop_proxy  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "claude-code"
_EVENTS = [
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_sink", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
        "content": [], "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Done."}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 2}}),
    ("message_stop", {"type": "message_stop"}),
]
REPLY = b"".join(f"event: {n}\ndata: {json.dumps(d)}\n\n".encode() for n, d in _EVENTS)
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
        + str(len(REPLY)).encode() + b"\r\n\r\n")


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read each request whole (content-length or chunked), answer REPLY; keep-alive."""
    try:
        while head := await reader.readuntil(b"\r\n\r\n"):
            fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
            fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
            if b"content-length" in fields:
                await reader.readexactly(int(fields[b"content-length"]))
            elif fields.get(b"transfer-encoding", b"").lower() == b"chunked":
                while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                    await reader.readexactly(size + 2)
                await reader.readuntil(b"\r\n")
            writer.write(HEAD + REPLY)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def sink() -> str:
    """The sink's URL, served on a thread of its own."""
    port = free_port()
    ready = threading.Event()

    async def run() -> None:
        server = await asyncio.start_server(_serve, "127.0.0.1", port, limit=1 << 20)
        ready.set()
        async with server:
            await server.serve_forever()

    threading.Thread(target=lambda: asyncio.run(run()), daemon=True).start()
    ready.wait(10)
    return f"http://127.0.0.1:{port}"


def timed(client: httpx.Client, url: str, raw: bytes, headers: list[tuple[str, str]],
          stamps: dict[str, float] | None = None) -> float:
    """One streamed POST of `raw`, to its last byte, in ms; its send and first byte stamped
    in `stamps` (perf_counter: the clock the trace stamps on)."""
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/messages?beta=true", content=raw,
                       headers=headers) as r:
        for n, _ in enumerate(r.iter_raw()):
            if n == 0 and stamps is not None:
                stamps.update(sent=start, ttfb=time.perf_counter())
        assert r.status_code == 200, r.status_code
    return (time.perf_counter() - start) * 1000


def profile(stamps: list[dict[str, float]], trace: Path) -> dict[str, dict[str, float]]:
    """The trace's segments of each call (profile_latency.segments), medians over calls
    100-200 and over the last 100."""
    from scripts.profile_latency import segments

    lines = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    recs = [segments({**line, **client}) for line, client in zip(lines, stamps)]

    def medians(part: list[dict[str, float]]) -> dict[str, float]:
        names = sorted({k for r in part for k in r})
        return {k: round(statistics.median(r[k] for r in part if k in r), 2) for k in names}

    return {"calls_100_200": medians(recs[100:200]), "last_100": medians(recs[-100:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--calls", type=int, default=0, help="only the chain's first N calls")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--against", type=Path, metavar="DIR", help="another checkout's proxy too")
    ap.add_argument("--trace", action="store_true", help="where this proxy's time went")
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"bench_late: needs the shared sessions at {DATA}")
    session = chained(list(sessions_in_order([DATA])) * args.passes)
    shape = load_template(None)
    calls = session.calls[:args.calls or None]
    rows = []
    upstream = sink()
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("this", "against"):
            (Path(tmp) / side).mkdir()
        trace = Path(tmp) / "trace.jsonl"
        extra = ("-s", str(ROOT / "scripts" / "profile_latency.py")) if args.trace else ()
        os.environ["PERPETUITY_TRACE"] = str(trace)  # (read by the tracing addon alone)
        proxies = {"proxy": start_proxy(Path(tmp) / "this", upstream, *extra)}
        if args.against:
            here, conftest.ROOT = conftest.ROOT, args.against.resolve()  # its addon script
            try:
                proxies["against"] = start_proxy(Path(tmp) / "against", upstream)
            finally:
                conftest.ROOT = here
        stamps: list[dict[str, float]] = []
        try:
            with httpx.Client(trust_env=False, timeout=120) as client:
                for n, call in enumerate(calls):
                    built = build(call, shape, session)
                    raw = json.dumps(built.body).encode()
                    headers = [(k, v) for k, v in built.headers if k.lower() != "content-length"]
                    sides = [(upstream, "direct"), *((p.url, s) for s, p in proxies.items())]
                    order = sides[n % len(sides):] + sides[:n % len(sides)]  # rotated
                    stamps.append({})
                    got = {side: timed(client, url, raw, headers,
                                       stamps[-1] if side == "proxy" else None)
                           for url, side in order}
                    rows.append({"call": n, "bytes": len(raw),
                                 "messages": len(built.body["messages"]),
                                 "direct_ms": round(got["direct"], 2),
                                 **{f"{s}_ms": round(got[s], 2) for s in proxies},
                                 **{"added_ms" if s == "proxy" else f"{s}_added_ms":
                                    round(got[s] - got["direct"], 2) for s in proxies}})
        finally:
            for p in proxies.values():
                stop_proxy(p)
        profiled = profile(stamps, trace) if args.trace else None
    if args.out:
        args.out.write_text(json.dumps(rows))

    def p50(part: list[dict], key: str = "added_ms") -> float:
        return round(statistics.median(r[key] for r in part), 2) if part else 0.0

    def summary(key: str) -> dict[str, float | None]:
        early, late = p50(rows[100:200], key), p50(rows[-100:], key)
        return {"calls_100_200": early, "last_100": late,
                "late_over_early": round(late / early, 2) if early else None}

    tenth = max(1, len(rows) // 10)
    keys = ["added_ms", *(["against_added_ms"] if args.against else [])]
    print(json.dumps({
        "calls": len(rows), "largest_bytes": max(r["bytes"] for r in rows),
        **{f"{k}_p50": summary(k) for k in keys},
        "tenths": [{"from_call": i, "messages": rows[i]["messages"], "bytes": rows[i]["bytes"],
                    **{f"{k}_p50": p50(rows[i:i + tenth], k) for k in keys},
                    "direct_ms_p50": p50(rows[i:i + tenth], "direct_ms")}
                   for i in range(0, len(rows), tenth)],
        **({"profile_ms": profiled} if profiled else {})}, indent=1))


if __name__ == "__main__":
    main()
