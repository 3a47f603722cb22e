"""Added latency of the proxy: time to first byte and total time, direct vs through mitmdump.

Runs the fake provider and a real mitmdump with the addon, then sends N streamed Anthropic
requests each way, interleaved so every side shares the machine's noise. Through the proxy,
the paths: the default (a frame, and the recall tools riding along, so the relay, where their
loop runs), the frame without tools (mitmproxy's own stream), capture alone (recall off), and
pure pass-through (x-perpetuity: off). Each of those requests is a first prompt. The two
`task_*` sides send what a coding harness sends: a prompt, then four tool rounds of the same
task (the shared Claude Code sessions average 4.5 calls a prompt), where the frame chosen at the
prompt is reused as it was. Beside them, Gemini's streamed path (`gemini_*`) and Codex's
WebSocket (`ws_*`: a `response.create` on a socket opened beforehand, time to its first event
and to `response.completed`), each against its own direct side.
Prints JSON.

Where a relayed request's time went (issue 24; one request traced from arrival to first byte,
a busy 2-core machine): the frame, built on the preparing thread, is the same on both paths
(8-16 ms for a first prompt here; a task's tool rounds carry it). Past it, the relay's own
upstream call (httpx then; its own h11 client since, serve/upstream.py) costs about what
mitmproxy's does; what the relay added was ordering: with the provider's reply already read,
the relay decoded, merged and queued the writes of all of it before mitmproxy passed on the
first chunk (6 ms from the relay's head to mitmproxy's responseheaders, 4 more to the first
chunk, the store's writer thread competing). It now waits
for mitmproxy to pass on its first bytes (relay.forwarded): 0.6 and 2 ms. Added ttfb p50,
medians of four runs of --requests 100 each, the old code and this alternating (load 2-4 on 2
cores): relay over stream for the same first prompt 9.4 ms before, 3.8 after; a task's tool
rounds through the relay 12.5 before, 9.4 after (stream 6.3 / 6.5), 6.1 over stream before,
3.1 after. Before this script gave each side its own conversation, the relay built the frame
6 times in 7 and the stream side carried it: 20 ms of "relay over stream" on a first prompt.

Since (h-round7): a frame's messages rendered on the message itself (a 512-entry FIFO was
emptied by this script's first prompts between two tool rounds: 4 renders in 5 missed, and
every miss was written anew), our tools' definitions made once, and a harness's system prompt
and tools handed back by wire.seen as the same objects while their text is, what is walked and
measured of them made once. Prepare CPU a tool round (bench_prepare.py, three pairs, load 8-10):
1.77 -> 1.00 ms; Claude Code-shaped (its 64 KB of tools and system) 3.59 -> 0.89. Added ttfb
p50, one pair near idle (load 0.0-0.6): task_relay 6.91 -> 5.39, task_stream 5.47 -> 4.18,
capture 3.46 -> 3.15, pass-through 2.76 -> 2.48; `--floor` the same minute: mitmdump alone
3.18, with a no-op addon 2.54, pass-through 2.93, capture 3.45 (mitmproxy's own is most of
pass-through's; our hooks' CPU ~0.25 ms of it: passed 0.08, apply 0.11).

Since (h-first9, h-ingest9; bench_prepare.py): three pairs of --requests 100 --floor, the old
code and this alternating, load 1.0-1.8, on a machine where mitmdump alone added 6.1-7.5 ms
(twice the earlier runs'): the relay's first prompt 27.3 -> 22.5 ms added (lower in all three
pairs), the stream's 30.0 -> 26.8; task rounds, capture and pass-through the same within noise
(task_relay 11.8 / 11.9, pass-through 8.1 / 7.3, mitmdump_bare 6.7 / 6.3).

Since (h-task10: a carried tool round prepared on the event loop; h-first10: which rows are
there, and their births, kept while nothing is deleted): four pairs of --requests 100 --floor,
d5ec79e and this alternating, load 0.7-1.8, on the same machine now adding 3.2-3.5 ms with a
no-op addon; medians of the added ttfb: the relay's first prompt 15.18 -> 14.65, the stream's
15.64 -> 14.91, task_relay 7.00 -> 6.25, task_stream 6.01 -> 5.31, capture 4.96 -> 4.44,
pass-through 3.67 -> 3.74 (mitmdump_noop 3.54 / 3.29, mitmdump_bare 5.24 / 4.47).

What the issue's first figures were (issue 24: 29.5 / 32.6 ms for the relay's first prompt, 14.9
/ 15.1 for task rounds, 4.6 / 4.7 capture, 3.8 / 4.6 pass-through, on a fresh clone): the
machine. 033b077, the code they were measured on, run on a later session's machine with its own
script (two runs of --requests 100): 16.7 / 15.9, 8.2 / 7.1, 2.38 / 2.37, 2.11 / 2.09, the same
factor (1.8 to 2.2) on every path, pass-through's code among them nearly unchanged since; that
script also had the relay build the frame 6 times in 7 (above). With this script, the same
minutes, medians of two: 033b077 22.0 ms, task rounds 9.4, capture 3.7, pass-through 2.9;
28f135e 10.8, 3.6, 2.45, 1.55.

Since (28f135e, the arena read as the proxy starts, the ingest and latest-stretch changes):
three pairs of --requests 100 --floor, 28f135e and this alternating, load 1.0-1.1, on a machine
whose no-op mitmdump added 2.3-3.0 ms; medians: the relay's first prompt 11.95 -> 10.93 ms
(runs 10.1-12.7 either side), the stream's 10.84 -> 10.03, task_relay 4.15 -> 4.00, task_stream
3.88 -> 3.60, capture 3.40 -> 3.12, pass-through 2.58 -> 2.26 (mitmdump_noop 2.86 / 2.56): the
same within the runs' spread, as expected of changes off this script's path (a first prompt
after the warm-up, a memory of a few hundred short rows).

`--floor` adds mitmproxy's own: `mitmdump_bare` (a reverse proxy to the provider, every body
streamed, no addon) and `mitmdump_noop` (the same with an addon whose one hook streams the
response, as ours does): what pass-through and capture are measured against.

    .venv/bin/python scripts/bench_latency.py [--requests 200] [--floor]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from wsproto import ConnectionType, WSConnection
from wsproto.events import CloseConnection, Request, TextMessage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import MITMDUMP, free_port, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text

SIDES = {"direct": {}, "frame_and_tools_relay": {}, "frame_stream": {"x-perpetuity-tools": "off"},
         "capture_stream": {"x-perpetuity-recall": "off"}, "pass_through": {"x-perpetuity": "off"},
         "task_relay": {}, "task_stream": {"x-perpetuity-tools": "off"},
         "gemini_direct": {}, "gemini_frame_and_tools_relay": {}, "ws_direct": {}, "ws_frame": {}}
FLOOR = ("mitmdump_bare", "mitmdump_noop")  # (--floor) mitmproxy alone, reverse to the provider
NOOP = "class Noop:\n    def responseheaders(self, flow):\n        flow.response.stream = True\n" \
       "\n\naddons = [Noop()]\n"
GEMINI = "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
ROUNDS = 5  # calls of a task: its prompt and four tool rounds


def messages(side: str, n: int) -> list[dict]:
    """A first prompt; on the task sides, call n % ROUNDS of task n // ROUNDS. Each side's
    prompts are its own conversation: sides sharing one, the first to send a prompt built its
    frame and the others carried it (the rotation gave the build to the relay 6 times in 7)."""
    if not side.startswith("task"):
        return [{"role": "user", "content": f"benchmark turn {n} on {side}"}]
    task, rounds = divmod(n, ROUNDS)
    out: list[dict] = [{"role": "user", "content": f"benchmark task {task} on {side}"}]
    for k in range(rounds):
        out += [{"role": "assistant", "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": f"t{k}", "name": "Read", "input": {"n": k}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"t{k}", "content": f"line {k} " * 50}]}]
    return out


def timed(client: httpx.Client, url: str, side: str, n: int) -> tuple[float, float]:
    if side.startswith("ws_"):
        return timed_socket(url, side, n)
    if side.startswith("gemini_"):
        return timed_gemini(client, url, side, n)
    if side in FLOOR:  # a first prompt, as the direct side sends it
        side = "direct"
    body = {"model": "claude-opus-4-8", "max_tokens": 100, "stream": True,
            "metadata": {"user_id": "bench"}, "messages": messages(side, n)}
    return streamed(client, url + "/v1/messages", body,
                    {"x-api-key": "sk-ant-bench", **SIDES[side]})


def timed_gemini(client: httpx.Client, url: str, side: str, n: int) -> tuple[float, float]:
    body = {"contents": [{"role": "user", "parts": [{"text": f"benchmark turn {n} on {side}"}]}]}
    return streamed(client, url + GEMINI, body,
                    {"x-goog-api-key": "AIza-bench", "x-perpetuity-user": "bench"})


def streamed(client: httpx.Client, url: str, body: dict, headers: dict[str, str]
             ) -> tuple[float, float]:
    """One streamed POST: its time to first byte and to the end, in ms."""
    start = time.perf_counter()
    with client.stream("POST", url, json=body, headers=headers) as r:
        chunks = r.iter_raw()
        next(chunks)
        first = time.perf_counter() - start
        for _ in chunks:
            pass
    return first * 1000, (time.perf_counter() - start) * 1000


def timed_socket(url: str, side: str, n: int) -> tuple[float, float]:
    """Codex's first prompt on a new socket: the upgrade before the clock starts."""
    host, port = urlsplit(url).hostname or "", urlsplit(url).port or 80
    with socket.create_connection((host, port), timeout=30) as conn:
        ws = WSConnection(ConnectionType.CLIENT)
        conn.sendall(ws.send(Request(host=f"{host}:{port}", target="/v1/responses", extra_headers=[
            (b"authorization", b"Bearer sk-bench"), (b"session-id", f"bench-{side}-{n}".encode()),
            (b"openai-beta", b"responses_websockets=2026-02-06")])))

        def events() -> Iterator[object]:
            while True:
                yield from ws.events()
                ws.receive_data(conn.recv(65536))

        got = events()
        next(got)  # accepted
        body = {"type": "response.create", "model": "gpt-5", "stream": True, "store": False,
                "input": [{"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": f"benchmark turn {n} on {side}"}]}]}
        start = time.perf_counter()
        conn.sendall(ws.send(TextMessage(json.dumps(body))))
        first = 0.0
        text = ""
        for ev in got:
            if not isinstance(ev, TextMessage):
                continue
            first = first or time.perf_counter() - start
            text += ev.data
            if ev.message_finished:
                if json.loads(text).get("type") in ("response.completed", "error"):
                    break
                text = ""
        total = time.perf_counter() - start
        conn.sendall(ws.send(CloseConnection(code=1000)))
    return first * 1000, total * 1000


def bare(tmp: Path, upstream: str, side: str) -> tuple[str, str, subprocess.Popen[bytes]]:
    """A mitmdump of the floor's, reverse to the provider, ready: (side, its URL, it)."""
    port = free_port()
    script = tmp / "noop.py"
    script.write_text(NOOP)
    how = ["-s", str(script)] if side == "mitmdump_noop" else ["--set", "stream_large_bodies=1"]
    process = subprocess.Popen(
        [str(MITMDUMP), "-q", "--mode", f"reverse:{upstream}", "--listen-host", "127.0.0.1",
         "--listen-port", str(port), "--set", f"confdir={tmp / 'mitm'}",
         "--set", "connection_strategy=lazy", *how],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return side, url, process
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"{side}: mitmdump did not start")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--floor", action="store_true",
                    help="also mitmdump alone (no addon, and a no-op addon): mitmproxy's own")
    args = ap.parse_args()
    sides = [*SIDES, *(FLOOR if args.floor else ())]
    results = {side: {"ttfb": [], "total": []} for side in sides}
    with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
        proxy = start_proxy(Path(tmp), fake.url)
        urls = {side: fake.url if side.endswith("direct") else proxy.url for side in sides}
        floors: list[tuple[str, str, subprocess.Popen[bytes]]] = []
        try:
            floors += [bare(Path(tmp), fake.url, side) for side in FLOOR] if args.floor else []
            urls.update((side, url) for side, url, _ in floors)
            with httpx.Client(trust_env=False, timeout=30) as client:
                for i in range(args.requests + 5):
                    for side in sides[i % len(sides):] + sides[:i % len(sides)]:  # rotate
                        fake.script(Text("A reply of a few words, streamed in pieces.", chunks=8))
                        ttfb, total = timed(client, urls[side], side, i)
                        if i >= 5:  # the first few warm connections and the database up
                            results[side]["ttfb"].append(ttfb)
                            results[side]["total"].append(total)
        finally:
            stop_proxy(proxy)
            for _, _, process in floors:
                process.terminate()
                process.wait(10)
    out: dict[str, object] = {"requests": args.requests}
    for side, r in results.items():
        out[side] = {f"{m}_ms_{q}": pct(v, p) for m, v in r.items()
                     for q, p in (("p50", 0.5), ("p99", 0.99))}
    def direct(side: str) -> dict[str, list[float]]:  # each protocol against its own
        return results[side.split("_")[0] + "_direct" if side.startswith(("ws_", "gemini_"))
                       else "direct"]

    out["added_ms_p50"] = {
        side: {m: round(statistics.median(r[m]) - statistics.median(direct(side)[m]), 3)
               for m in r}
        for side, r in results.items() if not side.endswith("direct")
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
