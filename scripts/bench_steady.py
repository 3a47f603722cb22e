#!/usr/bin/env python3
"""The steady state: store one turn, then answer one query, repeated, at a pooled size.

    scripts/bench_steady.py [--sizes 1M,10M,82M] [--requests 400] [--out FILE]

The memory is built as bench_retrieval.py builds it (a unit of 20 users from BEAM and LoCoMo
through the real write path, then SQL copies up to the size; from 80M tokens at least 500
users). Then, per request, as the proxy does: one turn is stored through the write path
(capture.record: a LoCoMo turn in a new conversation of the asking user), and the scanner
answers a real LoCoMo/BEAM question for that user (catch-up on what was stored since, then
the exact scan and the hits' text). Reported per request: write, catch-up, query (scan and
hits), and catch-up + query, p50/p99/mean in ms; the arena on its default threads.

Prints one JSON object (one entry per size).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.derived import index, scan  # noqa: E402
from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture  # noqa: E402
from perpetuity_core.memory.storage.store import Store  # noqa: E402
from scripts.bench_retrieval import (  # noqa: E402
    UNIT_USERS,
    ingest,
    parse_size,
    pct,
    questions,
    replicate,
    tokens_of,
    unit_threads,
)


def build(store: Store, data: Path, size: int) -> int:
    """Fill `store` to `size` tokens pooled, as bench_retrieval.py does; returns the copies
    made of the first unit."""
    users = unit_threads(data)
    unit_tokens = sum(tokens_of(t) for u in users for t in u)
    copies = max(0, round(size / unit_tokens) - 1)
    if size >= 80e6:
        copies = max(copies, -(-500 // UNIT_USERS) - 1)
    ingest(store, users, size if copies == 0 else 10**12)
    if copies:
        replicate(store, copies)
    return copies


def run_size(size: int, data: Path, args: argparse.Namespace, tmp: Path) -> dict:
    store = open_memory(tmp / f"steady-{size}.db")
    t0 = time.perf_counter()
    copies = build(store, data, size)
    built = time.perf_counter() - t0
    conn = store.db.translated()
    n_rows, _, n_tokens = index.totals(conn)
    print(f"[{size:,}] built {n_rows:,} rows, {n_tokens:,} tokens in {built:.0f}s",
          file=sys.stderr)
    uid = {i: r[0] for i in range(UNIT_USERS)
           if (r := conn.execute("SELECT id FROM user WHERE key = ?", (f"bench:{i}",)).fetchone())}
    asked = [(q, us[0]) for q, us in ((q, [u for u in us if u in uid]) for q, us in
                                      questions(data)) if us][:args.requests]
    sc = scan.Scanner(store, store_rows=0)
    t0 = time.perf_counter()
    sc.catch_up()
    cold = time.perf_counter() - t0
    turns = [m for t in importers.locomo(data / "locomo" / "locomo10.json") for m in t.messages]
    write, catch, query, rows_read = [], [], [], []
    for i, (q, u) in enumerate(asked):
        history = turns[: (i % 40) + 1]  # a growing conversation: one new turn each request
        t0 = time.perf_counter()
        capture.record(store, user_key=f"bench:{u}", conversation_key=f"steady-{i // 40}",
                       provider="anthropic", model="m", messages=history,
                       times=[1.7e9 + i] * len(history), source="request")
        t1 = time.perf_counter()
        rows_read.append(sc.catch_up())
        t2 = time.perf_counter()
        sc.search(q, uid[u], 10)  # its own catch-up finds nothing new
        t3 = time.perf_counter()
        write.append(t1 - t0)
        catch.append(t2 - t1)
        query.append(t3 - t2)
    total = [c + q for c, q in zip(catch, query, strict=True)]
    store.close()
    return {"target_tokens": size, "rows": n_rows, "tokens": n_tokens,
            "users": len(uid) * (copies + 1), "build_seconds": round(built, 1),
            "cold_catch_up_s": round(cold, 2), "arena_bytes": sc.arena.nbytes(),
            "requests": len(asked), "rows_per_catch_up": round(sum(rows_read) / len(asked), 2),
            "write": pct(write), "catch_up": pct(catch), "query": pct(query),
            "catch_up_plus_query": pct(total)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--sizes", default="1M,10M,82M")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--tmp", help="where the databases go (default: a temporary folder)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    data = Path(args.data)
    if not data.is_dir():
        raise SystemExit(f"benchmark data not found at {data} (../shared/data)")
    out = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for s in args.sizes.split(","):
            out.append(run_size(parse_size(s), data, args, Path(tmp)))
            print(json.dumps(out[-1]), file=sys.stderr)
    text = json.dumps({"steady_state": out})
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
