"""Where one request's time goes, arrival to first byte, per path (issue 24). Prints JSON.

Runs the fake provider and a real mitmdump with the addon and, loaded after it, this file as a
second script: a tracing addon that wraps the addon's hooks (`request`, `responseheaders`,
`response`), the first chunk through the stream callable, and the pipeline's steps where they
run (`passed` on the event loop, `prepare` on its thread, the relay's exchange and its httpx
leg, the store's writes), stamping wall time and the running thread's CPU time. The client
stamps its send and its first byte on the same clock (perf_counter is CLOCK_MONOTONIC, shared
by processes), so the segments sum to the client's time to first byte (on the relay, its
upstream call now overlaps the hop to it). Beside them, the event loop's CPU per request and
the proxy process's (every thread's on-CPU time from /proc/<pid>/task/*/schedstat, read after
the request's writes settled): figures the machine's load changes far less than wall time.
`--perf FILE` samples the proxy with `perf record` and CPython's jitdump (Python frames
unwound; `perf inject --jit` then `perf report --children`).

Sides as in bench_latency.py, interleaved, each request alone: the default relay's first
prompt, its tool rounds (`task_relay`), the stream path's, capture alone and pass-through.

What it found (a 2-core machine at load 10-13; three runs of --requests 60 a side, main and
the change alternating; medians): a relayed tool round's added 51 ms to first byte went to
mitmproxy reading the request before any hook (4.6), the hop to the preparing thread (2.2),
prepare (1.4; 1.4 CPU), the hop back and the flow's changes (3.1), mitmproxy's hop to the
relay (0.7), the relay's httpx call to the provider's head (16.0, where mitmproxy's own took
8.7 on the stream path), the relay's head to mitmproxy (1.0), to the first chunk (1.1) and on
to the client (3.0): wall time 2-4x the CPU behind it. The proxy's CPU per request: 13.1 ms
relayed, 8.0 on the stream path, 4.5 passed through; the relay's CPU over the stream path's
in the same run 5.1 ms (4.9-5.5). perf on the relay: httpx and httpcore about 18% of the
process's CPU (2.5 ms; httpcore's debug records through mitmproxy's root DEBUG 4% more before
they were silenced), the relay's own h11 side and writes 4%, its tee 3%, the addon's hooks
6%, the store's writes 14% (after the first byte), mitmproxy's layers and hook dispatch
about half. After the change (Pipeline.passed on the loop, httpx's loggers quiet, the
upstream call begun as the flow is pointed at the relay, a chunk a read, select.fill's drops
in one pass; six runs of each, loads 10-15, medians and ranges): a relayed tool round 12.4
ms CPU (10.9-13.7; base 13.4, 13.0-14.1), the relay over the stream path in the same run 3.5
(2.7-4.1; base 5.3, 4.8-5.7) for a tool round and 3.1 (3.0-4.5; base 5.7, 4.7-6.3) for a first
prompt; pass-through 4.2 (4.1-4.8; base 4.5, 4.3-4.7), with no thread hop (1.3-2.3 ms of hops
at these loads).

The relay's upstream leg on its own client since (serve/upstream.py, h11 over asyncio streams,
in place of httpx; the `httpx_*` stamps name that call) and its head written with its first
chunk. Runs of --requests 80 ordered base, change, change, base, base, change (load 9 on 2
cores), medians of the three: a relayed tool round's proxy CPU 12.1 ms (base 14.8), its event
loop's 6.1 (8.8), the stream path's for the same request 10.0 (10.0): the relay over the
stream path 2.1 ms CPU where it was 4.8; a first prompt's 25.8 (29.4), loop 6.4 (9.3). The
relay's call to the provider's head 5.8 ms (8.7), mitmproxy's hop to the relay 0.8 (1.3).

Since (h-task10): a tool round whose plan is carried is prepared on the event loop
(Pipeline.carried), not on the preparing thread. Two pairs of --requests 60 --sides
task_relay,task_stream, base and change alternating (load 4.1-4.8 on 2 cores), medians: a relayed
tool round's proxy CPU 13.1 / 13.7 -> 10.0 / 9.9 ms, its prepare's 1.29 / 1.34 -> 0.87 / 0.87
(the same work, measured where it ran), the loop's 6.7 / 8.2 -> 6.5 / 6.5; the
hop back 0.21-0.24 -> 0.01. Added time to first byte moved less than these runs' noise (16.2 /
10.4 -> 15.8 / 14.2). `prepare` stamps `_prepare` where there is one (both ways in).

    .venv/bin/python scripts/profile_latency.py [--requests 60] [--sides task_relay] [--perf F]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SETTLE = 0.03  # seconds after a request's end for its writes to run before its CPU is read


class Trace:
    """The tracing addon (mitmdump -s this file, after the addon): it wraps the addon's hooks
    and the pipeline's steps; its stamps go to $PERPETUITY_TRACE, one JSON line a request."""

    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.lock = threading.Lock()
        self.out = open(os.environ["PERPETUITY_TRACE"], "a", buffering=1)  # noqa: SIM115
        self._patch()
        self._gc_started = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        """The collector's pauses, on any thread (no lock: it may run while one is held)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        self.cur["gc"] = self.cur.get("gc", 0.0) + time.perf_counter() - self._gc_started
        if info["generation"] == 2:
            self.cur["gc2"] = self.cur.get("gc2", 0) + 1

    def stamp(self, name: str, value: float | None = None) -> None:
        with self.lock:
            self.cur.setdefault(name, time.perf_counter() if value is None else value)

    def add(self, name: str, value: float) -> None:
        with self.lock:
            self.cur[name] = self.cur.get(name, 0.0) + value

    def requestheaders(self, flow: Any) -> None:
        with self.lock:
            self.cur = {"arrived": time.perf_counter(), "loop_cpu": -time.thread_time()}

    def done(self) -> None:
        self.out.close()

    def _patch(self) -> None:
        from perpetuity_core.serve import http_path, pipeline, relay

        def timed(cls: Any, name: str, wall: str, cpu: str) -> None:
            inner = getattr(cls, name)

            @functools.wraps(inner)
            def wrapper(*a: Any, **k: Any) -> Any:
                w, c = time.perf_counter(), time.thread_time()
                self.stamp(wall + "_start", w)
                try:
                    return inner(*a, **k)
                finally:
                    self.stamp(wall + "_end")
                    self.add(cpu, time.thread_time() - c)
            setattr(cls, name, wrapper)

        # (`decide`: also a tool round decided on the loop, Pipeline.carried)
        timed(pipeline.Pipeline, "decide", "prepare", "prepare_cpu")
        timed(http_path.HttpPath, "_apply", "apply", "apply_cpu")  # the decision on the flow
        timed(pipeline.Pipeline, "understand", "passed", "passed_cpu")  # on the event loop

        exchange, send = relay.Relay._exchange, relay.Relay.send
        request, responseheaders, response = (http_path.HttpPath.request,
                                              http_path.HttpPath.responseheaders,
                                              http_path.HttpPath.response)

        async def exchange_(r: Any, *a: Any) -> bool:
            self.stamp("relay_in")
            return await exchange(r, *a)

        async def send_(r: Any, req: Any) -> Any:
            self.stamp("httpx_start")
            resp = await send(r, req)
            self.stamp("httpx_head")
            return resp

        async def request_(a: Any, flow: Any) -> None:
            self.stamp("body_read")
            await request(a, flow)
            self.stamp("decided")

        def responseheaders_(a: Any, flow: Any) -> None:
            self.stamp("response_head")
            responseheaders(a, flow)
            inner = flow.response.stream

            def first(chunk: bytes) -> bytes:
                if chunk:
                    self.stamp("first_chunk")
                return inner(chunk) if callable(inner) else chunk
            flow.response.stream = first

        async def response_(a: Any, flow: Any) -> None:
            await response(a, flow)
            self.add("loop_cpu", time.thread_time())
            with self.lock:
                self.out.write(json.dumps(self.cur) + "\n")
                self.cur = {}

        relay.Relay._exchange, relay.Relay.send = exchange_, send_
        http_path.HttpPath.request, http_path.HttpPath.response = request_, response_
        http_path.HttpPath.responseheaders = responseheaders_


if "PERPETUITY_TRACE" in os.environ and __name__ != "__main__":  # loaded by mitmdump
    addons = [Trace()]


def cpu_ns(pid: int) -> int:
    """Every thread's on-CPU time so far, in ns."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


SEGMENTS = [  # (name, from, to): consecutive, so they sum to the client's time to first byte
    ("client_to_hooks", "sent", "body_read"),
    ("hop_to_worker", "body_read", "prepare_start"),
    ("prepare", "prepare_start", "prepare_end"),
    ("hop_back_and_apply", "prepare_end", "decided"),
    ("hop_back", "prepare_end", "apply_start"),  # (the two inside hop_back_and_apply)
    ("apply", "apply_start", "apply_end"),
    ("to_relay", "decided", "relay_in"),
    ("relay_to_httpx", "relay_in", "httpx_start"),
    ("httpx_upstream_head", "httpx_start", "httpx_head"),
    ("relay_head_to_mitmproxy", "httpx_head", "response_head"),
    ("upstream_head", "decided", "response_head"),  # the stream path's own upstream leg
    ("head_to_first_chunk", "response_head", "first_chunk"),
    ("first_chunk_to_client", "first_chunk", "ttfb"),
]


def segments(rec: dict[str, float]) -> dict[str, float]:
    out = {}
    for name, a, b in SEGMENTS:
        if name == "upstream_head" and "relay_in" in rec:
            continue
        if a in rec and b in rec:
            out[name] = (rec[b] - rec[a]) * 1000
    out["prepare_cpu"] = rec.get("prepare_cpu", 0.0) * 1000
    out["passed_cpu"] = rec.get("passed_cpu", 0.0) * 1000
    out["apply_cpu"] = rec.get("apply_cpu", 0.0) * 1000
    out["loop_cpu"] = rec.get("loop_cpu", 0.0) * 1000
    out["gc"] = rec.get("gc", 0.0) * 1000  # the collector's pauses, every thread's
    out["gc2"] = rec.get("gc2", 0)  # full collections
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--sides", default="", help="comma-separated: only these (and direct)")
    ap.add_argument("--perf", default="",
                    help="sample the proxy with `perf record` into this file (Python frames unwound)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "scripts")]
    import httpx
    from bench_latency import SIDES, timed  # type: ignore[import-not-found]

    from tests.conftest import start_proxy, stop_proxy
    from tests.fake_provider import FakeProvider, Text

    sides = ["direct", "frame_and_tools_relay", "task_relay", "frame_stream", "task_stream",
             "capture_stream", "pass_through"]
    if args.sides:
        sides = ["direct", *args.sides.split(",")]
    assert set(sides) <= set(SIDES)
    if args.perf:
        os.environ["PYTHON_PERF_JIT_SUPPORT"] = "1"  # CPython 3.13 jitdump: Python frames unwound
    ttfb: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    traced: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        os.environ["PERPETUITY_TRACE"] = str(trace)
        here = str(Path(__file__).resolve())
        proxy = start_proxy(Path(tmp), fake.url, "-s", here)
        perf = (subprocess.Popen(["perf", "record", "-F", "1999", "-k", "1", "--call-graph",
                                  "dwarf,32768", "-o", args.perf, "-p", str(proxy.process.pid)],
                                 stderr=subprocess.DEVNULL) if args.perf else None)
        try:
            with httpx.Client(trust_env=False, timeout=30) as client:
                for i in range(args.requests + 5):
                    for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                        fake.script(Text("A reply of a few words, streamed in pieces.", chunks=8))
                        url = fake.url if side == "direct" else proxy.url
                        before = cpu_ns(proxy.process.pid)
                        lines = trace.stat().st_size if trace.exists() else 0
                        sent = time.perf_counter()
                        first, _ = timed(client, url, side, i)
                        time.sleep(SETTLE)
                        used = (cpu_ns(proxy.process.pid) - before) / 1e6
                        if i < 5:
                            continue
                        ttfb[side].append(first)
                        if side == "direct":
                            continue
                        cpu[side].append(used)
                        with open(trace) as f:
                            f.seek(lines)
                            rec = json.loads(f.readline() or "{}")
                        rec.update(sent=sent, ttfb=sent + first / 1000)
                        traced[side].append(segments(rec))
        finally:
            if perf is not None:
                perf.send_signal(signal.SIGINT)
                perf.wait()
            stop_proxy(proxy)
    direct = statistics.median(ttfb["direct"])
    out: dict[str, Any] = {"requests": args.requests, "load": os.getloadavg()[0],
                           "direct_ttfb_ms_p50": round(direct, 3)}
    for side in sides[1:]:
        names = {k for rec in traced[side] for k in rec}
        out[side] = {
            "added_ttfb_ms_p50": round(statistics.median(ttfb[side]) - direct, 3),
            "proxy_cpu_ms_p50": round(statistics.median(cpu[side]), 3),
            "segments_ms_p50": {
                k: round(statistics.median([r.get(k, 0.0) for r in traced[side]]), 3)
                for k in [s[0] for s in SEGMENTS] + ["loop_cpu", "prepare_cpu", "passed_cpu", "apply_cpu"]
                if k in names},
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
