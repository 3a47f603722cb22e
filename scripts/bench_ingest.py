#!/usr/bin/env python3
"""Ingest through the write path against SQLite FTS5, side by side, as JSON.

    scripts/bench_ingest.py [--rounds 3] [--without chains,activation,retrieval] [--out FILE]

Every LoCoMo message (5,882) goes through the real write path (importers.write ->
capture.record -> Store.add_message and its derivers, one transaction per message, then the
writer's batched work, so nothing is left owed), into a fresh database; FTS5 (porter
unicode61, WAL, synchronous NORMAL, a user column, as bench_retrieval.py builds it) gets the
same texts, one transaction per message. Each round times both, alternately, so a noisy machine slows both;
the report gives every round and the medians, and the ratio of the medians.

`--without` drops derivers from the store (the ablation): the result is no longer a memory
the product could serve, only a measure of what each deriver costs. The chains are derived
from the retrieval rows, so without retrieval there are no chains either.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.derived import heat, index  # noqa: E402
from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.schema import open_memory
from scripts.bench_retrieval import fts5_insert  # noqa: E402

DERIVERS = {"retrieval": index.derive_retrieval, "activation": heat.derive_activation}
BATCHED = {"chains": "chain"}


def ours(path: Path, threads: list[importers.Thread], without: set[str]) -> float:
    store = open_memory(path)
    dropped = {DERIVERS[name] for name in without & DERIVERS.keys()}
    store.derivers = [d for d in store.derivers if d not in dropped]
    for name in without & BATCHED.keys():
        del store.batched[BATCHED[name]]
    t0 = time.perf_counter()
    for t in threads:
        importers.write(store, t)
    store.flush()
    dt = time.perf_counter() - t0
    store.close()
    return dt


def fts5(path: Path, texts: list[tuple[int, str]]) -> float:
    conn, seconds = fts5_insert(path, texts)
    conn.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--without", default="",
                    help="derivers to drop: " + ",".join([*DERIVERS, *BATCHED]))
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    without = {w for w in args.without.split(",") if w}
    if unknown := without - DERIVERS.keys() - BATCHED.keys():
        raise SystemExit(f"unknown derivers {sorted(unknown)}")
    threads = list(importers.locomo(Path(args.data) / "locomo" / "locomo10.json"))
    texts = [(u, p.text) for u, t in enumerate(threads) for m in t.messages for p in m.parts]
    n = sum(len(t.messages) for t in threads)
    rates: dict[str, list[float]] = {"ours": [], "fts5": []}
    with tempfile.TemporaryDirectory(prefix="perpetuity-ingest-") as tmp:
        for r in range(args.rounds):
            rates["ours"].append(n / ours(Path(tmp) / f"ours-{r}.db", threads, without))
            rates["fts5"].append(n / fts5(Path(tmp) / f"fts-{r}.db", texts))
    med = {k: statistics.median(v) for k, v in rates.items()}
    report = {"messages": n, "without": sorted(without),
              "rounds_messages_per_s": {k: [round(x) for x in v] for k, v in rates.items()},
              "median_messages_per_s": {k: round(v) for k, v in med.items()},
              "ratio_of_medians": round(med["ours"] / med["fts5"], 3)}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
