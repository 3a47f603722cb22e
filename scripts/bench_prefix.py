"""Prompt-cache friendliness: how much of each request upstream repeats the previous one's prefix.

Providers cache by exact prefix. This replays a LoCoMo conversation as a chat client would send
it (the whole history every turn, replies stored as replies) through the request pipeline and
measures, for each request, the share of its characters that equal the previous request's
prefix, with the frame and, side by side, with recall off (the history as the client sent it).
Also what each request costs in units of an uncached input token, at Anthropic's prompt-cache
prices: the prefix the previous request left cached is read at 0.1, the rest is written to the
cache at 1.25 (a cache lives minutes; this counts every request as within its life).
Prints JSON.

    .venv/bin/python scripts/bench_prefix.py [--format locomo|beam] [--data PATH] [--turns 300]

The defaults replay LoCoMo's first conversation (a history of about 7,600 tokens a request on
average over its first 300 turns); `--format beam` replays BEAM's first chat (long turns: the
history passes 75,000 tokens), where re-sending the history costs more than a frame.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core import importers
from perpetuity_core.conversation import Provider, Reply, Usage
from perpetuity_core.evaluate import _request
from perpetuity_core.pipeline import Pipeline
from perpetuity_core.store import Store


CACHE_READ, CACHE_WRITE = 0.1, 1.25  # Anthropic's prices, as multiples of an input token's


def shared_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # binary search on equal prefixes: bytes compare in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def replay(thread: importers.Thread, turns: int, recall: bool,
           tmp: Path) -> tuple[list[float], list[int], list[int]]:
    store = Store(tmp / f"prefix-{recall}.db")
    pipeline = Pipeline(store, {p: "http://127.0.0.1:9" for p in Provider})
    history: list[dict[str, str]] = []
    shares: list[float] = []
    uncached: list[int] = []  # characters past the shared prefix, per request
    sizes: list[int] = []  # characters sent, per request
    previous = b""
    turn = None
    for i, m in enumerate(thread.messages[:turns]):
        if m.role == "assistant" and turn is not None and history[-1]["role"] == "user":
            history.append({"role": "assistant", "content": m.text})
            pipeline.store_reply(turn, Reply(m, Usage()), thread.times[i])
            continue
        history.append({"role": "user", "content": m.text})
        req = _request(thread.user_key, thread.conversation_key, thread.times[i], history)
        if not recall:
            req = req.__class__(req.method, req.host, req.path,
                                req.headers + (("x-perpetuity-recall", "off"),), req.body, True)
        d = pipeline.prepare(req)
        sent = d.body if d.body is not None else req.body
        if previous:
            common = shared_prefix(previous, sent)
            shares.append(common / len(sent))
            uncached.append(len(sent) - common)
            sizes.append(len(sent))
        previous = sent
        turn = pipeline.store_turn(d.job.pending)
    store.close()
    return shares, uncached, sizes


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--format", choices=("locomo", "beam"), default="locomo")
    ap.add_argument("--data", type=Path)
    ap.add_argument("--turns", type=int, default=300)
    args = ap.parse_args()
    data = args.data or here.parent / "shared/data" / {
        "locomo": "locomo/locomo10.json", "beam": "beam-100k"}[args.format]
    thread = next(getattr(importers, args.format)(data))
    with tempfile.TemporaryDirectory() as tmp:
        out = {}
        for recall in (True, False):
            s, u, n = replay(thread, args.turns, recall, Path(tmp))
            out["frame" if recall else "history_as_sent"] = {
                "requests": len(s) + 1, "prefix_share_mean": round(statistics.mean(s), 4),
                "prefix_share_median": round(statistics.median(s), 4),
                # characters / 4: the rule of thumb the frame's own token counts use
                "uncached_tokens_mean": round(statistics.mean(u) / 4),
                "sent_tokens_mean": round(statistics.mean(n) / 4),
                "cost_units_mean": round(statistics.mean(
                    CACHE_WRITE * x + CACHE_READ * (t - x) for x, t in zip(u, n, strict=True)) / 4)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
