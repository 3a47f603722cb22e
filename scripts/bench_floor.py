"""mitmproxy's own part of a pass-through request (issue 24): what any addon pays before ours runs.

Runs the fake provider and three mitmdumps side by side, and sends bench_latency's
pass-through request (`x-perpetuity: off`, streamed) to each and to the provider directly,
interleaved so every side shares the machine's noise:
- `mitmproxy_floor`: mitmdump as a reverse proxy to the provider, no addon but this file's
  one hook that streams the reply (unstreamed, the client's first byte waits for the last);
- `noop_addon`: the proxy addressed as a base URL, this file's addon routing the request to the
  provider in its `request` hook: the least an addon in our place can do;
- `perpetuity`: our addon, as `perpetuity proxy` runs it.
For each, the added time to first byte (p50, against direct) and the proxy process's CPU per
request (every thread's, from /proc/<pid>/task/*/schedstat, read once the request settled).

    .venv/bin/python scripts/bench_floor.py [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUTE = "BENCH_FLOOR_ROUTE"  # set in a mitmdump's environment: the provider to route to


class Stream:
    """Loaded into the floor's mitmdumps: the reply streamed, as both our paths stream it."""

    def request(self, flow: Any) -> None:
        if flow.response or flow.error or not flow.live or not os.environ.get(ROUTE):
            return
        flow.request.url = os.environ[ROUTE] + flow.request.path

    def responseheaders(self, flow: Any) -> None:
        if flow.response is not None:
            flow.response.stream = True


if __name__ != "__main__":  # loaded by mitmdump
    addons = [Stream()]


def _bare(tmp: Path, *args: str, route: str = "") -> tuple[subprocess.Popen, str]:
    from tests.conftest import MITMDUMP, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env[ROUTE] = route
    proc = subprocess.Popen([str(MITMDUMP), "-q", "-s", str(Path(__file__).resolve()),
                             "--listen-host", "127.0.0.1", "--listen-port", str(port),
                             "--set", f"confdir={tmp / 'mitm'}", "--set", "connection_strategy=lazy",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("mitmdump did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "scripts")]
    import httpx
    from bench_latency import streamed  # type: ignore[import-not-found]
    from profile_latency import SETTLE, cpu_ns  # type: ignore[import-not-found]

    from tests.conftest import start_proxy, stop_proxy
    from tests.fake_provider import FakeProvider, Text

    with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
        floor, floor_url = _bare(Path(tmp), "--mode", f"reverse:{fake.url}")
        noop, noop_url = _bare(Path(tmp), route=fake.url)
        ours = start_proxy(Path(tmp), fake.url)
        sides: dict[str, tuple[str, int]] = {
            "direct": (fake.url, 0), "mitmproxy_floor": (floor_url, floor.pid),
            "noop_addon": (noop_url, noop.pid), "perpetuity": (ours.url, ours.process.pid)}
        ttfb: dict[str, list[float]] = {s: [] for s in sides}
        cpu: dict[str, list[float]] = {s: [] for s in sides}
        names = list(sides)
        try:
            with httpx.Client(trust_env=False, timeout=30) as client:
                for i in range(args.requests + 5):
                    for side in names[i % len(names):] + names[:i % len(names)]:  # rotate
                        fake.script(Text("A reply of a few words, streamed in pieces.", chunks=8))
                        url, pid = sides[side]
                        body = {"model": "claude-opus-4-8", "max_tokens": 100, "stream": True,
                                "metadata": {"user_id": "bench"}, "messages": [
                                    {"role": "user", "content": f"benchmark turn {i} on {side}"}]}
                        before = cpu_ns(pid) if pid else 0
                        first, _ = streamed(client, url + "/v1/messages", body,
                                            {"x-api-key": "sk-ant-bench", "x-perpetuity": "off"})
                        time.sleep(SETTLE)
                        if i >= 5:  # the first few warm connections up
                            ttfb[side].append(first)
                            if pid:
                                cpu[side].append((cpu_ns(pid) - before) / 1e6)
        finally:
            floor.terminate()
            noop.terminate()
            floor.wait(10)
            noop.wait(10)
            stop_proxy(ours)
    direct = statistics.median(ttfb["direct"])
    out: dict[str, Any] = {"requests": args.requests, "load": os.getloadavg()[0],
                           "direct_ttfb_ms_p50": round(direct, 3)}
    for side in names[1:]:
        out[side] = {"added_ttfb_ms_p50": round(statistics.median(ttfb[side]) - direct, 3),
                     "proxy_cpu_ms_p50": round(statistics.median(cpu[side]), 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
