#!/usr/bin/env python3
"""Retrieval speed and scale, side by side with SQLite FTS5 and bm25s, as JSON.

    scripts/bench_retrieval.py [--sizes 1M,10M,20M,82M] [--queries 200] [--out FILE]

Memories are built from the conversations in ../shared/data: a "unit" of 20 users, user i
holding BEAM chat i (long turns) and LoCoMo conversation i mod 10 (short turns), about 4M
tokens (4 characters a token). A size takes as many units as it needs, each copy with distinct
users, and the pooled size (from 80M tokens) at least 500 users: 25 units, 87M tokens; a size
below one unit takes its first users whole.

Per size:
  ingest        the first unit (or the whole size below one unit: data set beam+locomo-SIZE,
                else beam+locomo) goes through the real write path (importers.write ->
                capture.record -> Store.add_message and its derivers; one transaction per
                message), and FTS5 gets the same messages, one transaction each, --ingest-rounds
                times interleaved by scripts/ingest_timer.py, as bench_ingest.py times them (the
                same figures on the same set: rates by wall and CPU, per round and median); the
                last round's databases are kept. The other units are copied in SQL with new ids,
                counts scaled, which gives the rows the write path would have written.
  query         p50/p99 of Scanner.search(question, asking user, limit 10) over real LoCoMo
                and BEAM questions, each asked by a user who holds that conversation; for both
                arena layouts (term-major shipped, row-major measured), 1 and 2 threads; FTS5
                (porter unicode61, OR of the question's words, user filter, ORDER BY bm25());
                bm25s (retrieve k=10 with the asking user's weight mask; its backend named,
                numba where installed, else numpy).
  exactness     top-10 of the two layouts, and of a store scan, identical for every question.
  catch-up      10k new rows written by a new user through the write path, then one catch-up
                (the median of three, each on a copy of the arena as it was before); against
                bm25s re-indexing the whole memory: index only, and tokenise + index.
  memory        arena bytes per stored token, and the process's resident growth.
The machine's memory bandwidth (numpy sum over 1 GB) is reported as the physical reference.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.memory.derived import index, scan  # noqa: E402
from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.store import Store  # noqa: E402
from scripts.ingest_timer import (  # noqa: E402
    UNIT_USERS,
    DataSet,
    cut,
    data_set,
    interleaved,
    ours,
    parse_size,
    tokens_of,
    unit_threads,
    write,
)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def bandwidth_gbs() -> float:
    a = np.ones(1 << 27)  # 1 GiB of float64
    a.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        a.sum()
    dt = (time.perf_counter() - t0) / 3
    del a
    return round(a_bytes() / dt / 1e9, 2)


def a_bytes() -> int:
    return 8 << 27


# ------------------------------------------------------------------------------ data


def questions(data: Path) -> list[tuple[str, list[int]]]:
    """Real questions, LoCoMo and BEAM alternating, each with the unit users who hold its
    conversation (LoCoMo conversation c: users c and c + 10; BEAM chat i: user i)."""
    rng = random.Random(0)
    lo = []
    for c, conv in enumerate(json.loads((data / "locomo" / "locomo10.json").read_text())):
        lo += [(qa["question"], [u for u in range(UNIT_USERS) if u % 10 == c])
               for qa in conv["qa"]]
    be = []
    chats = sorted((data / "beam-100k").iterdir(), key=lambda p: int(p.name)
                   if p.name.isdigit() else 0)
    for i, chat in enumerate(chats):
        pq = json.loads((chat / "probing_questions.json").read_text())
        for qs in pq.values():
            be += [(q["question"], [i]) for q in qs if isinstance(q, dict) and "question" in q]
    rng.shuffle(lo)
    rng.shuffle(be)
    return [x for pair in zip(lo, be, strict=False) for x in pair]


# ------------------------------------------------------------------------------ building


def ingest(store: Store, users: list[list[importers.Thread]], budget: int) -> None:
    """Write users' threads through the real write path until `budget` tokens are in, then
    the batched structures: nothing is left owed."""
    write(store, DataSet("", cut(users, budget)))


def replicate(store: Store, copies: int) -> float:
    """Copy every row of the store `copies` more times under new ids and users (SQL only),
    with its chains (ingest wrote every base row's) and activations, so that no batch is left
    owed and `memory check` holds."""
    t0 = time.perf_counter()
    conn = store.db.connection()  # SQLite's own: this benchmark builds SQLite memories
    maxid = {t: conn.execute(f"SELECT coalesce(max(id), 0) FROM {t}").fetchone()[0]
             for t in ("user", "conversation", "message", "item")}
    (maxseq,) = conn.execute("SELECT coalesce(max(seq), 0) FROM retrieval").fetchone()
    ref = {"user_id": "user", "conversation_id": "conversation", "message_id": "message",
           "item_id": "item"}

    def cols(table: str) -> list[str]:
        return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]

    conn.execute("BEGIN")
    index.fold(store.db, conn)  # every base row in the counts, so that scaling them stays exact
    for r in range(1, copies + 1):
        for table in ("user", "conversation", "message", "item", "retrieval", "chain",
                      "activation"):
            names = cols(table)
            exprs = []
            for c in names:
                if c == "id":
                    exprs.append(f"id + {r * maxid[table]}")
                elif c == "seq":
                    exprs.append(f"seq + {r * maxseq}")
                elif c in ref:
                    exprs.append(f"{c} + {r * maxid[ref[c]]}")
                elif table == "user" and c == "key":
                    exprs.append(f"key || '#{r}'")
                else:
                    exprs.append(c)
            key, limit = {"retrieval": ("seq", maxseq), "chain": ("item_id", maxid["item"]),
                          "activation": ("item_id", maxid["item"])}.get(
                table, ("id", maxid.get(table)))
            conn.execute(f"INSERT INTO {table} ({','.join(names)}) SELECT {','.join(exprs)}"
                         f" FROM {table} WHERE {key} <= {limit} ORDER BY {key}")
    conn.execute(f"UPDATE retrieval_term SET df = df * {copies + 1}")
    conn.execute(f"UPDATE derived SET seq = {(copies + 1) * maxseq} WHERE name = 'chain'")
    conn.execute(f"UPDATE retrieval_total SET rows = rows * {copies + 1},"
                 f" length = length * {copies + 1}, tokens = tokens * {copies + 1},"
                 f" folded_seq = {(copies + 1) * maxseq}")
    conn.execute("COMMIT")
    return round(time.perf_counter() - t0, 2)


def fts5_copy(path: Path, copies: int, n_users: int) -> float:
    """The FTS5 peer's other units: its rows copied `copies` times under new users."""
    conn = sqlite3.connect(path, isolation_level=None)
    t0 = time.perf_counter()
    if copies:
        conn.execute("CREATE TEMP TABLE base AS SELECT text, user FROM t")
        conn.execute("BEGIN")
        for r in range(1, copies + 1):
            conn.execute("INSERT INTO t (text, user) SELECT text, user + ? FROM base",
                         (r * n_users,))
        conn.execute("COMMIT")
    conn.close()
    return round(time.perf_counter() - t0, 2)


def fts5_query(conn: sqlite3.Connection, q: str, user: int) -> list[int]:
    words = re.findall(r"\w+", q)
    if not words:
        return []
    match = " OR ".join(f'"{w}"' for w in words)
    return [r[0] for r in conn.execute(
        "SELECT rowid FROM t WHERE t MATCH ? AND user = ? ORDER BY bm25(t) LIMIT 10",
        (match, user))]


# ------------------------------------------------------------------------------ measuring


def pct(xs: list[float]) -> dict:
    a = np.array(xs) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3)}


def timed(fn: Callable[[Any], Any], items: Iterable[Any]) -> tuple[list, list[float]]:
    out, times = [], []
    for it in items:
        t0 = time.perf_counter()
        out.append(fn(it))
        times.append(time.perf_counter() - t0)
    return out, times


def run_size(size: int, data: Path, qs: list[tuple[str, int]], args: argparse.Namespace,
             tmp: Path) -> dict:
    res: dict = {"target_tokens": size}
    users = unit_threads(data)
    unit_tokens = sum(tokens_of(t) for u in users for t in u)
    copies = max(0, round(size / unit_tokens) - 1)
    if size >= args.pool_from:  # the pooled memory: at least --pool-users users
        copies = max(copies, -(-args.pool_users // UNIT_USERS) - 1)
    ds = data_set("beam+locomo" if copies else f"beam+locomo-{args.size_names[size]}", data)
    built = tmp / f"built-{size}"
    built.mkdir(exist_ok=True)
    res["ingest"] = interleaved(ds, args.ingest_rounds, built)
    (built / "ours.db").rename(tmp / f"mem-{size}.db")
    for f in built.glob("ours.db-*"):
        f.rename(tmp / f"mem-{size}.db{f.name.removeprefix('ours.db')}")
    (built / "fts5.db").rename(tmp / f"fts-{size}.db")
    for f in built.glob("fts5.db-*"):
        f.rename(tmp / f"fts-{size}.db{f.name.removeprefix('fts5.db')}")
    built.rmdir()
    store = open_memory(tmp / f"mem-{size}.db")
    if args.ingest_breakdown:
        # The same messages through the same path without the retrieval deriver: what the
        # store and capture cost by themselves.
        wall, cpu = ours(tmp / f"bare-{size}.db", ds, {"retrieval"})
        res["ingest_without_retrieval"] = {"messages_per_s": {"wall": round(ds.messages / wall),
                                                              "cpu": round(ds.messages / cpu)}}
    n_users_unit = len({u for u, _ in ds.threads})
    res["replicate_seconds"] = replicate(store, copies) if copies else 0.0
    conn = store.db.connection()
    n_rows, _, n_tokens = index.totals(conn)
    res.update(users=n_users_unit * (copies + 1), rows=n_rows, tokens=n_tokens,
               messages=conn.execute("SELECT count(*) FROM message").fetchone()[0])
    print(f"[{size:,}] {n_rows:,} rows, {n_tokens:,} tokens; ingest {res['ingest']}",
          file=sys.stderr)

    # FTS5 peer
    if "fts5" in args.peers:
        res["fts5"] = {"copy_seconds": fts5_copy(tmp / f"fts-{size}.db", copies, UNIT_USERS)}

    # the asking users: unit user i (copy 0) and the same in the last copy
    uid = {}
    for i in range(UNIT_USERS):
        row = conn.execute("SELECT id FROM user WHERE key = ?", (f"bench:{i}",)).fetchone()
        if row:
            uid[i] = row[0]
    asked = [(q, uid[us[0]]) for q, us in ((q, [u for u in us if u in uid]) for q, us in qs)
             if us][: args.queries]
    res["queries"] = len(asked)

    # our arenas: cold load (first catch-up), memory, latency, layouts and threads
    layouts = {}
    tops = {}
    for layout in args.layouts:
        gc.collect()
        before = rss()
        sc = scan.Scanner(store, layout=layout, store_rows=0, threads=1)
        t0 = time.perf_counter()
        sc.catch_up()
        cold = time.perf_counter() - t0
        grown = rss() - before
        a = sc.arena
        entry = {"cold_catch_up_s": round(cold, 2), "arena_bytes": a.nbytes(),
                 "bytes_per_token": round(a.nbytes() / n_tokens, 3),
                 "postings_bytes": sum(s.nbytes() for s in a.segments),
                 "rss_growth_bytes": grown, "segments": len(a.segments)}
        for threads in args.threads:
            a.threads = threads
            a._pool = None
            sc.search(asked[0][0], asked[0][1], 10)  # warm the pool
            hits, times = timed(lambda x: sc.search(x[0], x[1], 10), asked)  # noqa: B023 - called here
            entry[f"threads_{threads}"] = pct(times)
            tops[(layout, threads)] = [[h.item_id for h in hs] for hs in hits]
        shared = scan.Scanner(store, layout=layout, store_rows=0, threads=max(args.threads),
                              share_pool=True)
        shared.arena = sc.arena
        _, times = timed(lambda x: shared.search(x[0], x[1], 10), asked)  # noqa: B023 - called here
        entry["shared_pool"] = pct(times)
        layouts[layout] = entry
        print(f"[{size:,}] {layout}: {entry}", file=sys.stderr)
        if layout != args.layouts[0]:
            del sc, shared
        else:
            keep = sc
    res["scan"] = layouts
    first = next(iter(tops.values()))
    res["top10_identical_across_layouts_and_threads"] = all(t == first for t in tops.values())
    if n_rows <= args.store_check_rows:
        store_sc = scan.Scanner(store, store_rows=10**12)
        res["top10_identical_to_store_scan"] = all(
            [h.item_id for h in store_sc.search(q, u, 10)] == first[i]
            for i, (q, u) in enumerate(asked[:20]))

    if "fts5" in args.peers:
        fconn = sqlite3.connect(tmp / f"fts-{size}.db")
        unit_user = {v: k for k, v in uid.items()}
        _, times = timed(lambda x: fts5_query(fconn, x[0], unit_user[x[1]]), asked)
        res["fts5"]["query"] = pct(times)
        fconn.close()
        print(f"[{size:,}] fts5 query {res['fts5']['query']}", file=sys.stderr)

    # catch-up: 10k new rows from a new user through the write path, then one catch-up
    sc = keep
    new_user = [importers.Thread("bench:new", f"new:{i}", t.messages, t.times, t.labels,
                                 t.provider) for i, t in enumerate(sum(users, []))]
    todo, got = [], 0
    for t in new_user:
        take = min(len(t.messages), args.catch_up_rows - got)
        if take <= 0:
            break
        todo.append(importers.Thread(t.user_key, t.conversation_key, t.messages[:take],
                                     t.times[:take], t.labels[:take], t.provider))
        got += take
    t0 = time.perf_counter()
    for t in todo:
        importers.write(store, t)
    write_s = time.perf_counter() - t0
    sc.arena._pool = None  # a thread pool cannot be copied; the scanner makes a new one
    # The copies share the store's database (its connections cannot be copied, and a copy
    # of the arena reads the same store): only the arena's own arrays are copied.
    db = sc.arena.db
    runs = []
    for arena in [copy.deepcopy(sc.arena, {id(db): db}) for _ in range(2)] + [sc.arena]:
        t0 = time.perf_counter()
        read = arena.catch_up()
        runs.append(time.perf_counter() - t0)
    catch = float(np.median(runs))
    new_id = conn.execute("SELECT id FROM user WHERE key = 'bench:new'").fetchone()[0]
    probe = todo[0].messages[0].parts[0].text
    seen = any(h.user_id == new_id for h in sc.search(probe, new_id, 10))
    res["catch_up"] = {"rows": read, "seconds": round(catch, 4),
                       "runs_seconds": [round(r, 4) for r in runs],
                       "write_path_messages_per_s": round(got / write_s),
                       "new_rows_found": seen}
    print(f"[{size:,}] catch-up {res['catch_up']}", file=sys.stderr)

    if "bm25s" in args.peers and n_tokens <= args.bm25s_max_tokens:
        res["bm25s"] = bm25s_peer(conn, asked)
        res["catch_up"]["speedup_vs_bm25s_index"] = round(
            res["bm25s"]["index_seconds"] / max(catch, 1e-9), 1)
        res["catch_up"]["speedup_vs_bm25s_tokenise_and_index"] = round(
            res["bm25s"]["reindex_seconds"] / max(catch, 1e-9), 1)
        print(f"[{size:,}] bm25s {res['bm25s']}", file=sys.stderr)
    store.close()
    for f in tmp.glob(f"*-{size}.db*"):
        f.unlink()
    return res


def bm25s_peer(conn: sqlite3.Connection, asked: list[tuple[str, int]]) -> dict:
    import bm25s

    rows = conn.execute("SELECT r.user_id, i.text FROM retrieval r JOIN item i"
                        " ON i.id = r.item_id ORDER BY r.seq").fetchall()
    users = np.array([r[0] for r in rows], np.int32)
    texts = [r[1] for r in rows]
    del rows
    t0 = time.perf_counter()
    tok = bm25s.tokenize(texts, stopwords="en", show_progress=False)
    t1 = time.perf_counter()
    retriever = bm25s.BM25(backend="auto")  # numba where installed (its default is numpy)
    retriever.index(tok, show_progress=False)
    t2 = time.perf_counter()
    del texts
    masks = {u: (users == u).astype(np.float32) for u in {u for _, u in asked}}
    vocab = tok.vocab

    def query(x: tuple[str, int]) -> list[int]:
        q = bm25s.tokenize([x[0]], stopwords="en", show_progress=False, return_ids=False)
        ids = [[vocab[w] for w in q[0] if w in vocab]]
        if not ids[0]:
            return []
        docs, _ = retriever.retrieve(ids, k=10, weight_mask=masks[x[1]], show_progress=False,
                                     n_threads=1)
        return docs[0].tolist()

    query(asked[0])  # numba compiles on the first retrieve
    _, times = timed(query, asked)
    # The backend decides the figure: on numba (not a project dependency) bm25s answered in
    # 0.31-0.38 ms at 21M tokens, on numpy in 25-41 (issue 24's 0.55 ms is numba's).
    return {"documents": len(users), "backend": retriever.backend,
            "tokenize_seconds": round(t1 - t0, 3),
            "index_seconds": round(t2 - t1, 3), "reindex_seconds": round(t2 - t0, 3),
            "query": pct(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--sizes", default="1M,10M,20M,82M")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--layouts", default="terms,rows")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--peers", default="fts5,bm25s")
    ap.add_argument("--pool-users", type=int, default=500)
    ap.add_argument("--pool-from", type=float, default=80e6,
                    help="sizes from this many tokens hold at least --pool-users users")
    ap.add_argument("--bm25s-max-tokens", type=float, default=30e6)
    ap.add_argument("--catch-up-rows", type=int, default=10_000)
    ap.add_argument("--store-check-rows", type=int, default=100_000,
                    help="compare with a store scan up to this many rows")
    ap.add_argument("--ingest-rounds", type=int, default=3,
                    help="interleaved ingest rounds, ours and FTS5's (the last one's are kept)")
    ap.add_argument("--ingest-breakdown", action="store_true",
                    help="also time the write path without the retrieval deriver")
    ap.add_argument("--tmp", help="where the databases go (default: a temporary folder)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    args.layouts = args.layouts.split(",")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.peers = args.peers.split(",")
    data = Path(args.data)
    if not (data / "locomo" / "locomo10.json").is_file():
        print(f"no benchmark data at {data}", file=sys.stderr)
        return 2
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="perpetuity-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    report = {"machine": {"cpus": os.cpu_count(), "numpy_sum_1GB_GBps": bandwidth_gbs()},
              "sizes": {}}
    qs = questions(data)
    args.size_names = {parse_size(s): s for s in args.sizes.split(",")}
    for s in args.sizes.split(","):
        report["sizes"][s] = run_size(parse_size(s), data, qs, args, tmp)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
