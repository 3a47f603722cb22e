#!/usr/bin/env python3
"""PostgreSQL beside SQLite, same run: ingest, catch-up, cold arena and query latency.

    scripts/bench_postgres.py [--messages 1000] [--rows 10000] [--queries 300]

Per backend (a fresh SQLite file; a fresh database on a PostgreSQL server started for the run
by tests/postgres.py, default durability: fsync and synchronous_commit on):
- ingest: scripts/bench_writers.py with 1, 2 and 4 writer processes, `messages` each, through
  the write path (one transaction per message, plus a clock move and a reheat per message);
- catch-up: an arena caught up on an empty memory, then one other process stores `rows`
  one-row messages, then the time of this arena's one catch-up over them;
- cold arena: a new Scanner's first catch-up over the whole memory;
- query: p50/p99 of `queries` three-word searches through the arena (all users pooled), at
  the memory's size (rows and tokens reported). The arena answers from memory, so the query
  itself does not touch the database; only the catch-up before it does (one read of nothing
  new).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory import index, scan  # noqa: E402
from perpetuity_core.memory.schema import open_memory  # noqa: E402
from perpetuity_core.memory.store import connection  # noqa: E402
from tests import postgres  # noqa: E402

WRITERS = ROOT / "scripts" / "bench_writers.py"
WORDS = ["garden", "violin", "harbour", "lantern", "turn", "about", "writer", "shared"]


def writers(db: str, processes: int, messages: int) -> dict:
    out = subprocess.run([sys.executable, str(WRITERS), "--db", db, "--processes",
                          str(processes), "--messages", str(messages)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def backend(new_db: Callable[[str], str], args: argparse.Namespace) -> dict:
    ingest = {}
    for n in (1, 2, 4):
        r = writers(new_db(f"ingest{n}"), n, args.messages)
        assert r["stored"] == r["expected"] and not r["check_violations"], r
        ingest[f"{n}_processes"] = {"messages_per_s": r["messages_per_s"],
                                    "seconds": r["seconds"], "failures": sum(r["failures"])}
    db = new_db("catchup")
    store = open_memory(db)
    scanner = scan.Scanner(store, store_rows=0)
    scanner.catch_up()
    writers(db, 1, args.rows)  # another process
    t0 = time.perf_counter()
    caught = scanner.catch_up()
    catch_up_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cold = scan.Scanner(store, store_rows=0)
    cold.catch_up()
    cold_s = time.perf_counter() - t0
    rows, _, tokens = index.totals(connection())
    rng = random.Random(7)
    times = []
    for _ in range(args.queries):
        q = " ".join(rng.choice(WORDS) for _ in range(3))
        t0 = time.perf_counter()
        scanner.search(q, None, 10)
        times.append(time.perf_counter() - t0)
    store.close()
    return {"ingest": ingest,
            "catch_up": {"rows": caught, "ms": round(catch_up_s * 1e3, 1)},
            "cold_arena": {"rows": rows, "tokens": tokens, "ms": round(cold_s * 1e3, 1)},
            "query_ms": {"pooled_rows": rows, "pooled_tokens": tokens,
                         "p50": round(float(np.percentile(times, 50)) * 1e3, 3),
                         "p99": round(float(np.percentile(times, 99)) * 1e3, 3)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1000, help="per writer process")
    ap.add_argument("--rows", type=int, default=10_000, help="written for the catch-up")
    ap.add_argument("--queries", type=int, default=300)
    args = ap.parse_args()
    if why := postgres.unavailable():
        print(f"bench_postgres: {why}", file=sys.stderr)
        return 1
    out: dict = {"messages_per_writer": args.messages}
    with tempfile.TemporaryDirectory() as tmp:
        out["sqlite"] = backend(lambda name: str(Path(tmp) / f"{name}.db"), args)
    with postgres.server() as url:
        out["postgresql"] = backend(lambda name: postgres.fresh_database(url, name), args)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
