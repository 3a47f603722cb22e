"""A request body through a bare mitmdump: the client's reads and mitmproxy's HTTP/1 path alone
(serve/client_reads.py, serve/heap.py, and an answer to every request at once; no store, no
frame). This checkout's beside another's (`--against DIR`), each body sent to both in turn;
per size, each proxy's CPU for a body (every thread's) and the client's time to the answer,
p50 over `--sends`. Prints JSON.

    .venv/bin/python scripts/bench_client_body.py --against DIR [--mb 21 2.3] [--sends 40]

Loaded by mitmdump (`-s` this file), it is that addon, from the checkout PERPETUITY_CHECKOUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _addons() -> list[object]:
    sys.path.insert(0, os.environ["PERPETUITY_CHECKOUT"])
    from mitmproxy import http

    from perpetuity_core.serve.client_reads import LargeReads
    from perpetuity_core.serve.heap import LargeBlocks

    class Answer:
        def request(self, flow: http.HTTPFlow) -> None:
            flow.response = http.Response.make(200, b"ok")

    return [LargeReads(), LargeBlocks(), Answer()]


if "PERPETUITY_CHECKOUT" in os.environ:
    addons = _addons()


def body(size: int) -> bytes:
    """A Messages body of about `size` bytes: messages of 5,000 characters each."""
    one = b'{"role": "user", "content": "' + b"x" * 5000 + b'"}'
    return b'{"messages": [' + b", ".join([one] * max(1, size // (len(one) + 2))) + b"]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, metavar="DIR")
    ap.add_argument("--mb", type=float, nargs="+", default=[21.0, 2.3])
    ap.add_argument("--sends", type=int, default=40)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import httpx

    from scripts.profile_latency import cpu_ns
    from tests.conftest import free_port

    sides = {"this": ROOT, "against": args.against.resolve()}
    procs, ports = {}, {}
    for code, checkout in sides.items():
        ports[code] = free_port()
        procs[code] = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "mitmdump"), "-q", "--listen-host", "127.0.0.1",
             "--listen-port", str(ports[code]), "-s", str(Path(__file__).resolve())],
            env={**os.environ, "PERPETUITY_CHECKOUT": str(checkout)})
    out: dict[str, object] = {"load": os.getloadavg()[0]}
    try:
        time.sleep(5)  # (both listening)
        with httpx.Client(trust_env=False, timeout=60) as client:
            for mb in args.mb:
                raw = body(int(mb * 1e6))
                got: dict[str, list[tuple[float, float]]] = {code: [] for code in sides}
                for i in range(args.sends + 3):  # (the first three warm each proxy's heap)
                    for code in list(sides)[i % 2:] + list(sides)[:i % 2]:
                        pid = procs[code].pid
                        before, start = cpu_ns(pid), time.perf_counter()
                        client.post(f"http://127.0.0.1:{ports[code]}/v1/messages", content=raw)
                        took = (time.perf_counter() - start) * 1000
                        time.sleep(0.03)  # (its CPU for this body done)
                        if i >= 3:
                            got[code].append((took, (cpu_ns(pid) - before) / 1e6))
                out[f"{len(raw) / 1e6:.1f} MB"] = {
                    code: {"ms_p50": round(statistics.median(t for t, _ in v), 2),
                           "cpu_ms_p50": round(statistics.median(c for _, c in v), 2)}
                    for code, v in got.items()}
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(10)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
