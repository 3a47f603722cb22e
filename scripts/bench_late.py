"""Late calls against early ones, end to end through a real mitmdump (issue 43, target 2): the
six shared Claude Code sessions chained into one conversation that never ends (as `perpetuity
replay claude-code --chain --passes 3` chains them: 2,034 calls, the last 100 past 1.2M tokens,
bodies to 21.8 MB), each call's request sent as Claude Code would have sent it, through the
proxy and, the same bytes, straight to a sink.

The sink (here, on its own thread) reads a request whole and answers a short streamed
Messages reply at once; it is the proxy's upstream too. A call's added time is its time
through the proxy less the time the same bytes took to the sink (the median of `--direct`
sends around it): what the proxy adds, whatever the body's size costs to send.

    .venv/bin/python scripts/bench_late.py [--passes 3] [--window 100] [--runs 1] [--direct 3]
                                           [--against DIR] [--trace] [--sequential] [--out F]

By default the two windows are timed side by side: one proxy is fed the chain's calls before
call 100 and another those before its last `window` (untimed), then early call 100 + i and
late call N - window + i go in turn, each to its own proxy, under the same load. After each
call the proxy is left to finish its writes (its CPU still for 10 ms) before the next is sent,
as a harness's next call comes after a reply and its tools. `--sequential` is the issue's
set-up instead: one proxy, every call timed in order with no pause (the writes of one call
overlap the next), its windows calls 100-199 and the last `window`, minutes apart.

Prints JSON: per run and window the added time's p50 (ms, to the last byte and to the first),
the proxy process's CPU per call (every thread's, its writes included), late over early, the
load average over the run; the median ratio over `--runs` (each with fresh proxies).
`--against DIR` runs another checkout's proxies beside these, each call sent to both: before
and after, under the same load. `--trace` loads profile_latency.py's tracing addon into this
checkout's proxies: where a call's time went (its segments, the CPU of prepare and of the event
loop, the collector's pauses), medians per window and the call at each window's median added
time. `--out` keeps every call's figures.

What it found (h-late43; a 2-core machine shared with other sessions): side by side, load 4.0,
this against main (24235af) beside it: added p50 early / late 10.0 / 10.5 ms (1.05x) against
10.4 / 18.7 (1.81x); proxy CPU a call 11.2 / 32.4 against 11.0 / 37.7; again at load 3.5,
8.5 / 10.1 (1.19x) against 10.5 / 14.5 (1.39x). --sequential (load 3.4
to 6.9): 17.4 / 28.6 (1.65x) against 15.9 / 38.4 (2.42x). What changed: each client connection
read in 1 MB pieces where mitmproxy asked 64 KB (serve/client_reads.py), and a late body
compared with the one kept once, not twice (wire/seen.Look). Before (h-code43, --passes 1, the
windows minutes apart): 57.7 / 70.2 ms (1.22x) in one run, 0.76x and 0.70x in others: the load
moved it more than the history did, which timing the windows side by side removes. Since
(h-late43b, large bodies kept in the heap, serve/heap.py) --sequential beside main, loads 1.5
to 3.4: a late call's whole time 26.8 / 36.1 / 23.9 ms against 35.2 / 46.5 / 33.2, its CPU
18.3 / 22.1 / 21.4 against 26.1 / 31.3 / 28.9 (docs/benchmarks.md, "Late calls"). Since
(h-late43, second pass: a body's pieces joined once, a late tool round decided on the loop)
--sequential beside 801b1a4 at load 11.3: added 10.6 / 3.4 ms (0.32x) against 9.2 / 12.5
(1.36x).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.cli.replay.request import build, load_template  # noqa: E402
from perpetuity_core.cli.replay.sessions import chained, sessions_in_order  # noqa: E402
from scripts.profile_latency import cpu_ns, segments  # noqa: E402
from tests import conftest  # noqa: E402
from tests.conftest import Proxy, free_port, start_proxy, stop_proxy  # noqa: E402

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
          stamps: dict[str, float] | None = None) -> tuple[float, float]:
    """One streamed POST of `raw`: its time to the last byte and to the first, in ms; its send
    and first byte stamped in `stamps` (perf_counter: the clock the trace stamps on)."""
    start = time.perf_counter()
    first = 0.0
    with client.stream("POST", url + "/v1/messages?beta=true", content=raw,
                       headers=headers) as r:
        for n, _ in enumerate(r.iter_raw()):
            if n == 0:
                first = time.perf_counter()
        assert r.status_code == 200, r.status_code
    if stamps is not None:
        stamps.update(sent=start, ttfb=first)
    return (time.perf_counter() - start) * 1000, (first - start) * 1000


def settled(pid: int, still_ms: float = 10.0, most_s: float = 2.0) -> None:
    """Wait until the proxy's CPU stays still for `still_ms` (its writes done), at most `most_s`."""
    step, still, last = 0.002, 0.0, cpu_ns(pid)
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline and still < still_ms / 1000:
        time.sleep(step)
        now = cpu_ns(pid)
        still = still + step if now - last < 100_000 else 0.0  # under 0.1 ms of CPU a step
        last = now


@dataclass
class Side:
    """One proxy: whose code ("this" or "against"), which window it serves, its trace."""

    code: str
    proxy: Proxy
    trace: Path | None = None
    lines: int = 0  # trace lines read so far

    def traced(self) -> dict[str, float]:
        """The trace's line for the call just sent (all threads' stamps, one line a call)."""
        if self.trace is None or not self.trace.exists():
            return {}
        lines = self.trace.read_text().splitlines()
        new, self.lines = lines[self.lines:], len(lines)
        return json.loads(new[-1]) if new else {}


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.session = chained(list(sessions_in_order([DATA])) * args.passes)
        self.shape = load_template(None)
        self.calls = self.session.calls[:args.calls or None]
        self.upstream = sink()
        self.client = httpx.Client(trust_env=False, timeout=300)
        self.rows: list[dict[str, Any]] = []

    def request(self, n: int) -> tuple[bytes, list[tuple[str, str]], int]:
        built = build(self.calls[n], self.shape, self.session)
        headers = [(k, v) for k, v in built.headers if k.lower() != "content-length"]
        return json.dumps(built.body).encode(), headers, len(built.body["messages"])

    def start(self, name: str) -> list[Side]:
        """This checkout's proxy (traced with --trace), and the other's with --against."""
        folder = self.tmp / name
        for code in ("this", "against"):
            (folder / code).mkdir(parents=True)
        trace = folder / "trace.jsonl" if self.args.trace else None
        extra = ("-s", str(ROOT / "scripts" / "profile_latency.py")) if trace else ()
        os.environ["PERPETUITY_TRACE"] = str(trace or "")  # (read by the tracing addon alone)
        sides = [Side("this", start_proxy(folder / "this", self.upstream, *extra), trace)]
        if self.args.against:
            here, conftest.ROOT = conftest.ROOT, self.args.against.resolve()  # its addon script
            try:
                sides.append(Side("against", start_proxy(folder / "against", self.upstream)))
            finally:
                conftest.ROOT = here
        return sides

    def send(self, n: int, window: str, sides: list[Side], settle: bool) -> None:
        """Call `n` to the sink (--direct times) and to each side, in an order rotated call by
        call; one row of figures."""
        raw, headers, messages = self.request(n)
        order: list[Side | None] = [None] * self.args.direct + list(sides)
        k = n % len(order)
        direct: list[float] = []
        got: dict[str, tuple[float, float, float, dict[str, float]]] = {}
        for side in order[k:] + order[:k]:
            if side is None:
                direct.append(timed(self.client, self.upstream, raw, headers)[0])
                continue
            pid = side.proxy.process.pid
            before, stamps = cpu_ns(pid), {}
            total, first = timed(self.client, side.proxy.url, raw, headers, stamps)
            if settle:
                settled(pid)
            traced = side.traced()
            got[side.code] = (total, first, (cpu_ns(pid) - before) / 1e6,
                              segments({**traced, **stamps}) if traced else {})
        d = statistics.median(direct)
        row: dict[str, Any] = {"call": n, "window": window, "bytes": len(raw),
                               "messages": messages, "direct_ms": round(d, 2),
                               "load": os.getloadavg()[0]}
        for code, (total, first, cpu, segs) in got.items():
            row[code] = {"ms": round(total, 2), "added_ms": round(total - d, 2),
                         "added_ttfb_ms": round(first - d, 2), "cpu_ms": round(cpu, 2),
                         **({"segments": {k: round(v, 2) for k, v in segs.items()}}
                            if segs else {})}
        self.rows.append(row)

    def feed(self, upto: dict[str, int], sides: dict[str, list[Side]]) -> None:
        """Calls before `upto[window]` to that window's proxies, untimed, each built once."""
        for n in range(max(upto.values())):
            raw, headers, _ = self.request(n)
            for window, last in upto.items():
                for side in sides[window] if n < last else ():
                    timed(self.client, side.proxy.url, raw, headers)
        for window in sides:
            for side in sides[window]:
                settled(side.proxy.process.pid, most_s=30)
                side.traced()  # (the fed calls' lines skipped)

    def interleaved(self) -> list[dict[str, Any]]:
        """One run: the two windows' proxies fed, then their calls in turn."""
        w, total = self.args.window, len(self.calls)
        first = {"early": EARLY, "late": total - w}
        sides = {window: self.start(f"{window}{len(self.rows)}") for window in first}
        try:
            self.feed(first, sides)
            start = len(self.rows)
            for i in range(w):
                for window, at in first.items():
                    self.send(at + i, window, sides[window], settle=True)
            return self.rows[start:]
        finally:
            for side in (s for group in sides.values() for s in group):
                stop_proxy(side.proxy)

    def sequential(self) -> list[dict[str, Any]]:
        """The issue's set-up: one proxy, every call timed in order, no pause."""
        sides = self.start(f"sequential{len(self.rows)}")
        w = self.args.window
        try:
            for n in range(len(self.calls)):
                window = ("early" if EARLY <= n < EARLY + w else
                          "late" if n >= len(self.calls) - w else "")
                self.send(n, window, sides, settle=False)
            return [r for r in self.rows if r["window"]]
        finally:
            for side in sides:
                stop_proxy(side.proxy)


EARLY = 100  # the early window's first call (the calls 100-200)


def p50(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else 0.0


def summary(rows: list[dict[str, Any]], codes: list[str]) -> dict[str, Any]:
    """A run's figures: per side and window the p50s, and late over early."""
    loads = [r["load"] for r in rows]
    out: dict[str, Any] = {"load": {"min": min(loads), "p50": p50(loads), "max": max(loads)}}
    for window in ("early", "late"):
        part = [r for r in rows if r["window"] == window]
        out[window] = {"calls": [part[0]["call"], part[-1]["call"]],
                       "bytes_p50": int(p50([r["bytes"] for r in part])),
                       "messages_p50": int(p50([r["messages"] for r in part])),
                       "direct_ms_p50": p50([r["direct_ms"] for r in part])}
    for code in codes:
        got = {}
        for window in ("early", "late"):
            part = [r[code] for r in rows if r["window"] == window]
            got[window] = {k: p50([p[k] for p in part])
                           for k in ("added_ms", "added_ttfb_ms", "cpu_ms")}
        got["late_over_early"] = {k: round(got["late"][k] / got["early"][k], 2)
                                  for k in got["early"] if got["early"][k] > 0}
        out[code] = got
    return out


def profile(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per window, the segments' medians and those of the call at the median added time."""
    out: dict[str, Any] = {}
    for window in ("early", "late"):
        part = sorted((r for r in rows if r["window"] == window and "segments" in r["this"]),
                      key=lambda r: r["this"]["added_ms"])
        if not part:
            continue
        names = sorted({k for r in part for k in r["this"]["segments"]})
        mid = part[len(part) // 2]
        out[window] = {
            "medians": {k: p50([r["this"]["segments"][k] for r in part
                                if k in r["this"]["segments"]]) for k in names},
            "median_call": {"call": mid["call"], "bytes": mid["bytes"],
                            "messages": mid["messages"], "added_ms": mid["this"]["added_ms"],
                            "cpu_ms": mid["this"]["cpu_ms"], **mid["this"]["segments"]}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3, help="the sessions chained this many times")
    ap.add_argument("--calls", type=int, default=0, help="only the chain's first N calls")
    ap.add_argument("--window", type=int, default=100, help="calls in each window")
    ap.add_argument("--runs", type=int, default=1, help="runs, each with fresh proxies")
    ap.add_argument("--direct", type=int, default=3, help="sends to the sink per call (median)")
    ap.add_argument("--sequential", action="store_true", help="the issue's set-up (see above)")
    ap.add_argument("--against", type=Path, metavar="DIR", help="another checkout's proxy too")
    ap.add_argument("--trace", action="store_true", help="where this proxy's time went")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"bench_late: needs the shared sessions at {DATA}")
    codes = ["this", *(["against"] if args.against else [])]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        try:
            for _ in range(args.runs):
                rows = bench.sequential() if args.sequential else bench.interleaved()
                runs.append((summary(rows, codes), rows))
        finally:
            bench.client.close()
    if args.out:
        args.out.write_text(json.dumps(bench.rows))
    print(json.dumps({
        "mode": "sequential" if args.sequential else "interleaved", "passes": args.passes,
        "calls": len(bench.calls), "largest_bytes": max(r["bytes"] for r in bench.rows),
        "runs": [s for s, _ in runs],
        "late_over_early_median": {
            code: {k: p50([s[code]["late_over_early"][k] for s, _ in runs])
                   for k in runs[0][0][code]["late_over_early"]} for code in codes},
        **({"profile_ms": profile(runs[-1][1])} if args.trace else {})}, indent=1))


if __name__ == "__main__":
    main()
