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
Then, where ../shared/data is present, a pooled memory of real conversations (BEAM-100k and
the Claude Code sessions, imported into SQLite through the write path) is migrated to
PostgreSQL (`memory migrate`'s copy, timed) and both get a cold arena and `queries` searches of
three words drawn from stored rows.
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

from perpetuity_core.memory import importers, index, scan  # noqa: E402
from perpetuity_core.memory.integrity import check  # noqa: E402
from perpetuity_core.memory.schema import open_memory  # noqa: E402
from perpetuity_core.memory.store import Store, connection  # noqa: E402
from perpetuity_core.memory.transfer import copy_memory  # noqa: E402
from tests import postgres  # noqa: E402

WRITERS = ROOT / "scripts" / "bench_writers.py"
SHARED = ROOT.parent / "shared" / "data"
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


def arena_and_queries(store: Store, queries: list[str]) -> dict:
    t0 = time.perf_counter()
    scanner = scan.Scanner(store, store_rows=0)
    scanner.catch_up()
    cold_s = time.perf_counter() - t0
    rows, _, tokens = index.totals(connection())
    times = []
    for q in queries:
        t0 = time.perf_counter()
        scanner.search(q, None, 10)
        times.append(time.perf_counter() - t0)
    return {"rows": rows, "tokens": tokens, "cold_arena_ms": round(cold_s * 1e3, 1),
            "query_p50_ms": round(float(np.percentile(times, 50)) * 1e3, 3),
            "query_p99_ms": round(float(np.percentile(times, 99)) * 1e3, 3)}


def pooled(tmp: str, url: str, n_queries: int) -> dict:
    """Real conversations pooled in SQLite, migrated to PostgreSQL; the same queries on both."""
    path = Path(tmp) / "pooled.db"
    store = open_memory(path)
    t0 = time.perf_counter()
    importers.run(store, "beam", SHARED / "beam-100k", progress=False)
    importers.run(store, "claude-code", SHARED / "claude-code", progress=False)
    import_s = time.perf_counter() - t0
    rng = random.Random(11)
    texts = [t for (t,) in connection().execute("SELECT text FROM item WHERE kind = 'text'")]
    queries = []
    while len(queries) < n_queries:
        words = [w for w in rng.choice(texts).split() if w.isalpha() and len(w) > 4]
        if len(words) >= 3:
            queries.append(" ".join(rng.sample(words, 3)))
    out = {"import_s": round(import_s, 1), "sqlite": arena_and_queries(store, queries)}
    store.close()
    db = postgres.fresh_database(url, "pooled")
    target = open_memory(db)
    t0 = time.perf_counter()
    copy_memory(path, target)
    out["migrate_s"] = round(time.perf_counter() - t0, 1)
    target.close()
    target = open_memory(db)  # reopened: the copied settings are read afresh
    out["postgresql"] = arena_and_queries(target, queries)
    out["check_violations"] = check(target)
    target.close()
    return out


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
        if SHARED.is_dir():
            with tempfile.TemporaryDirectory() as tmp:
                out["pooled"] = pooled(tmp, url, args.queries)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
