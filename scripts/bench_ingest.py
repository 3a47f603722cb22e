#!/usr/bin/env python3
"""Ingest through the write path against SQLite FTS5, side by side, as JSON.

    scripts/bench_ingest.py [--sets locomo,beam+locomo-1M] [--rounds 3] [--without chains]
                            [--out FILE]

Per named data set (scripts/ingest_timer.py: `locomo`, LoCoMo alone; `beam+locomo-1M`, the
data bench_retrieval.py's 1M row ingests), the timer bench_retrieval.py uses too: each round
writes the set through the real write path into a fresh database, then the same texts into
FTS5, one transaction per message each. The report gives every round's rates, by wall and by
CPU time, the medians, and the ratios of the medians; on the same set, bench_retrieval.py's
ingest row reports the same figures.

`--pages` reports, instead of rates, the pages each side writes per message, by B-tree: one
untimed pass each on the first set, the WAL read frame by frame (each frame is one page a
commit wrote) and checkpointed away after every thread (every 500 texts for FTS5), the pages
named by dbstat.

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
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.schema import open_memory
from scripts.ingest_timer import BATCHED, DERIVERS, data_set, fts5_open, interleaved  # noqa: E402


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
    conn = fts5_open(path)
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
    ap.add_argument("--sets", default="locomo", help="data sets, comma-separated")
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
    sets = [data_set(name, Path(args.data)) for name in args.sets.split(",")]
    if args.pages:
        ds = sets[0]
        report = {"data_set": ds.name, **pages_report([t for _, t in ds.threads], ds.texts,
                                                      ds.messages)}
        print(json.dumps(report, indent=1))
        return 0
    reports = []
    for ds in sets:
        with tempfile.TemporaryDirectory(prefix="perpetuity-ingest-") as tmp:
            reports.append(interleaved(ds, args.rounds, Path(tmp), without))
    text = json.dumps(reports, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
