#!/usr/bin/env python3
"""How long a dictionary flip holds the write lock, with a writer storing turns meanwhile.

    scripts/bench_flip.py [--size 10M] [--postgresql] [--out FILE]

The memory is built as bench_steady.py builds it (with --postgresql, then copied by `memory
migrate`'s copy into a PostgreSQL server started for the run, tests/postgres.py). Then the dictionary is re-derived (under
the live version: the work is the same for any version) and flipped, while a second thread
stores one turn every 20 ms through the write path, as the proxy does. Reported: the
re-derivation's and the flip's seconds (maintenance.rederive / flip; the flip's whole call is
the write lock's hold, apart from dropping the old version's tables after it, a table per
transaction), and the writer's p50/max latency per turn during each, in ms: a
turn that waits past the busy timeout (5 s) fails.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.derived import index  # noqa: E402
from perpetuity_core.memory.jobs import importers, maintenance  # noqa: E402
from perpetuity_core.memory.jobs.transfer import copy_memory  # noqa: E402
from perpetuity_core.memory.schema import open_memory  # noqa: E402
from perpetuity_core.memory.storage import capture  # noqa: E402
from perpetuity_core.memory.storage.store import Database, Store  # noqa: E402
from perpetuity_core.wire.conversation import Message  # noqa: E402
from scripts.bench_retrieval import parse_size, pct  # noqa: E402
from scripts.bench_steady import build  # noqa: E402
from tests import postgres  # noqa: E402


class Writer(threading.Thread):
    """Stores a LoCoMo turn every 20 ms (a growing conversation), timing each."""

    def __init__(self, store: Store, turns: list[Message]) -> None:
        super().__init__(daemon=True)
        self.store, self.turns = store, turns
        self.latency: list[tuple[float, float]] = []  # (start, seconds)
        self.failures = 0
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            history = self.turns[: (i % 40) + 1]
            t0 = time.perf_counter()
            try:
                capture.record(self.store, user_key="bench:0", conversation_key=f"flip-{i // 40}",
                               provider="anthropic", model="m", messages=history,
                               times=[1.7e9 + i] * len(history), source="request")
            except Exception:  # noqa: BLE001 - counted: a failed turn is the finding
                self.failures += 1
            self.latency.append((t0, time.perf_counter() - t0))
            i += 1
            time.sleep(0.02)

    def during(self, start: float, end: float) -> dict:
        xs = [dt for t0, dt in self.latency if start <= t0 + dt and t0 <= end]
        return {**pct(xs), "max_ms": round(1000 * max(xs, default=0), 1), "turns": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--size", default="10M")
    ap.add_argument("--postgresql", action="store_true",
                    help="flip on PostgreSQL (the memory built in SQLite, then copied)")
    ap.add_argument("--tmp", help="where the database goes (default: a temporary folder)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    data = Path(args.data)
    if not data.is_dir():
        raise SystemExit(f"benchmark data not found at {data} (../shared/data)")
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp, ExitStack() as stack:
        path = Path(tmp) / "flip.db"
        store = open_memory(path)
        build(store, data, size)
        n_rows, _, n_tokens = index.totals(store.db.connection())
        if args.postgresql:
            url = postgres.fresh_database(stack.enter_context(postgres.server()), "flip")
            target = open_memory(url)
            copy_memory(store, target)
            target.close()
            store.close()
            store = open_memory(url)  # reopened: the copied settings are read afresh
        turns = [m for t in importers.locomo(data / "locomo" / "locomo10.json")
                 for m in t.messages]
        writer = Writer(store, turns)
        writer.start()
        version = store.db.dictionary.version
        # The old version's tables are dropped after the flip's transaction, inside flip():
        # timed apart, so the lock's hold shows.
        dropping: list[float] = []
        drop_old = maintenance._drop_old

        def timed_drop(db: Database) -> None:
            t = time.perf_counter()
            drop_old(db)
            dropping.append(time.perf_counter() - t)

        maintenance._drop_old = timed_drop
        t0 = time.perf_counter()
        maintenance.rederive(store, version, progress=False)
        t1 = time.perf_counter()
        maintenance.flip(store, version)
        t2 = time.perf_counter()
        time.sleep(0.5)
        writer.stop.set()
        writer.join()
        store.close()
    out = {"backend": "postgresql" if args.postgresql else "sqlite", "rows": n_rows, "tokens": n_tokens, "rederive_s": round(t1 - t0, 2),
           "flip_s": round(t2 - t1 - sum(dropping[1:]), 3),
           "drop_old_s": round(sum(dropping[1:]), 3), "writes_during_rederive": writer.during(t0, t1),
           "writes_during_flip": writer.during(t1, t2), "write_failures": writer.failures}
    text = json.dumps({"flip": out})
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
