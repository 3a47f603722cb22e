"""Added latency of the proxy: time to first byte and total time, direct vs through mitmdump.

Runs the fake provider and a real mitmdump with the addon, then sends N streamed Anthropic
requests each way, interleaved so both sides share the machine's noise. Prints JSON.

    .venv/bin/python scripts/bench_latency.py [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import start_proxy, stop_proxy  # noqa: E402
from tests.fake_provider import FakeProvider, Text  # noqa: E402


def timed(client: httpx.Client, url: str, n: int) -> tuple[float, float]:
    body = {"model": "claude-opus-4-8", "max_tokens": 100, "stream": True,
            "metadata": {"user_id": "bench"},
            "messages": [{"role": "user", "content": f"benchmark turn {n}"}]}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/messages", json=body,
                       headers={"x-api-key": "sk-ant-bench"}) as r:
        chunks = r.iter_raw()
        next(chunks)
        first = time.perf_counter() - start
        for _ in chunks:
            pass
    return first * 1000, (time.perf_counter() - start) * 1000


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    results: dict[str, dict[str, list[float]]] = {"direct": {"ttfb": [], "total": []},
                                                  "proxy": {"ttfb": [], "total": []}}
    with FakeProvider() as fake, tempfile.TemporaryDirectory() as tmp:
        proxy = start_proxy(Path(tmp), fake.url)
        try:
            with httpx.Client(trust_env=False, timeout=30) as client:
                for i in range(args.requests + 5):
                    order = [("direct", fake.url), ("proxy", proxy.url)]
                    for side, url in order if i % 2 else order[::-1]:
                        fake.script(Text("A reply of a few words, streamed in pieces.", chunks=8))
                        ttfb, total = timed(client, url, i)
                        if i >= 5:  # the first few warm connections and the database up
                            results[side]["ttfb"].append(ttfb)
                            results[side]["total"].append(total)
        finally:
            stop_proxy(proxy)
    out: dict[str, object] = {"requests": args.requests}
    for side, r in results.items():
        out[side] = {f"{m}_ms_{q}": pct(v, p) for m, v in r.items()
                     for q, p in (("p50", 0.5), ("p99", 0.99))}
    out["added_ms"] = {
        "ttfb_p50": round(statistics.median(results["proxy"]["ttfb"]) - statistics.median(results["direct"]["ttfb"]), 3),
        "total_p50": round(statistics.median(results["proxy"]["total"]) - statistics.median(results["direct"]["total"]), 3),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
