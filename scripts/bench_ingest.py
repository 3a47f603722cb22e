#!/usr/bin/env python3
"""Ingest through the write path against SQLite FTS5, side by side, as JSON.

    scripts/bench_ingest.py [--rounds 3] [--without chains,retrieval] [--out FILE]

Every LoCoMo message (5,882) goes through the real write path (importers.write ->
capture.record -> Store.add_message and its derivers, one transaction per message, then the
writer's batched work, so nothing is left owed), into a fresh database; FTS5 (porter
unicode61, WAL, synchronous NORMAL, a user column, as bench_retrieval.py builds it) gets the
same texts, one transaction per message. Each round times both, alternately, so a noisy machine slows both;
the report gives every round and the medians, and the ratio of the medians.

`--pages` reports, instead of rates, the pages each side writes per message, by B-tree: one
untimed pass each, the WAL read frame by frame (each frame is one page a commit wrote) and
checkpointed away after every thread (every 500 texts for FTS5), the pages named by dbstat.

`--without` drops derivers from the store (the ablation): the result is no longer a memory
the product could serve, only a measure of what each deriver costs. The chains are derived
from the retrieval rows, and the rows' births are written in them (heat.py), so without
retrieval there are no chains and no heat either.
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.derived import index  # noqa: E402
from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.schema import open_memory
from scripts.bench_retrieval import fts5_insert  # noqa: E402

DERIVERS = {"retrieval": index.derive_retrieval}
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


def drain(conn: sqlite3.Connection, wal: Path, pages: collections.Counter[str]) -> None:
    """Count the WAL's frames by the B-tree each page belongs to, then empty the WAL."""
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    names = {p: n for n, p in conn.execute("SELECT name, pageno FROM dbstat")}
    data = wal.read_bytes()
    for off in range(32, len(data) - 23, 24 + size):  # a 32-byte header, then frames
        (page,) = struct.unpack(">I", data[off:off + 4])
        pages[names.get(page, "freelist")] += 1
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def ours_pages(path: Path, threads: list[importers.Thread]) -> collections.Counter[str]:
    store = open_memory(path)
    conn = store.db.connection()
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages: collections.Counter[str] = collections.Counter()
    for t in threads:
        importers.write(store, t)
        drain(conn, Path(f"{path}-wal"), pages)
    store.flush()
    drain(conn, Path(f"{path}-wal"), pages)
    store.close()
    return pages


def fts5_pages(path: Path, texts: list[tuple[int, str]]) -> collections.Counter[str]:
    conn, _ = fts5_insert(path, [])
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    pages: collections.Counter[str] = collections.Counter()
    for i, (u, text) in enumerate(texts, 1):
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t (text, user) VALUES (?, ?)", (text, u))
        conn.execute("COMMIT")
        if i % 500 == 0 or i == len(texts):
            drain(conn, Path(f"{path}-wal"), pages)
    conn.close()
    return pages


def pages_report(threads: list[importers.Thread], texts: list[tuple[int, str]], n: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="perpetuity-pages-") as tmp:
        sides = {"ours": ours_pages(Path(tmp) / "ours.db", threads),
                 "fts5": fts5_pages(Path(tmp) / "fts.db", texts)}
    return {"messages": n, "pages_per_message": {
        side: {"total": round(sum(c.values()) / n, 2),
               **{name: round(k / n, 3) for name, k in c.most_common() if k / n >= 0.001}}
        for side, c in sides.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--without", default="",
                    help="derivers to drop: " + ",".join([*DERIVERS, *BATCHED]))
    ap.add_argument("--pages", action="store_true",
                    help="pages written per message by B-tree, instead of rates")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    without = {w for w in args.without.split(",") if w}
    if unknown := without - DERIVERS.keys() - BATCHED.keys():
        raise SystemExit(f"unknown derivers {sorted(unknown)}")
    threads = list(importers.locomo(Path(args.data) / "locomo" / "locomo10.json"))
    texts = [(u, p.text) for u, t in enumerate(threads) for m in t.messages for p in m.parts]
    n = sum(len(t.messages) for t in threads)
    if args.pages:
        print(json.dumps(pages_report(threads, texts, n), indent=1))
        return 0
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
