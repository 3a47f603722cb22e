"""Prompt-cache friendliness: how much of each request upstream repeats the previous one's prefix.

Providers cache by exact prefix. This replays a LoCoMo conversation as a chat client would send
it (the whole history every turn, replies stored as replies) through the request pipeline and
measures, for each request, the share of its characters that equal the previous request's
prefix, with the frame and, side by side, with recall off (the history as the client sent it).
Prints JSON.

    .venv/bin/python scripts/bench_prefix.py [--data ../shared/data/locomo/locomo10.json] [--turns 300]
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
           tmp: Path) -> tuple[list[float], list[int]]:
    store = Store(tmp / f"prefix-{recall}.db")
    pipeline = Pipeline(store, {p: "http://127.0.0.1:9" for p in Provider})
    history: list[dict[str, str]] = []
    shares: list[float] = []
    uncached: list[int] = []  # characters past the shared prefix, per request
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
        previous = sent
        turn = pipeline.store_turn(d.job.pending)
    store.close()
    return shares, uncached


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=here.parent / "shared/data/locomo/locomo10.json")
    ap.add_argument("--turns", type=int, default=300)
    args = ap.parse_args()
    thread = next(importers.locomo(args.data))
    with tempfile.TemporaryDirectory() as tmp:
        out = {}
        for recall in (True, False):
            s, u = replay(thread, args.turns, recall, Path(tmp))
            out["frame" if recall else "history_as_sent"] = {
                "requests": len(s) + 1, "prefix_share_mean": round(statistics.mean(s), 4),
                "prefix_share_median": round(statistics.median(s), 4),
                # characters / 4: the rule of thumb the frame's own token counts use
                "uncached_tokens_mean": round(statistics.mean(u) / 4)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
