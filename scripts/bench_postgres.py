#!/usr/bin/env python3
"""PostgreSQL beside SQLite, same run: ingest, catch-up, cold arena and query latency.

    scripts/bench_postgres.py [--messages 1000] [--rows 10000] [--queries 300]
    scripts/bench_postgres.py --sizes 10M,82M [--rows 10000] [--queries 300] [--tmp DIR]
                              [--pg-setting shared_buffers=1GB ...]

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

With --sizes, instead: per size, a pooled memory built in SQLite as scripts/bench_retrieval.py
builds it (a unit of 20 users through the write path, SQL copies up to the size; from 80M tokens
at least 500 users), copied to PostgreSQL by `memory migrate`'s copy (timed), both checked by
`memory check` (timed), then on each backend: the cold arena; p50/p99 of real LoCoMo and BEAM
questions through Scanner.search (the scan and the hits' text), each asked by a user who holds
the conversation, as the proxy asks them (scripts/bench_steady.py), and of the reads the frame
makes around it (the rows around the first hits and every row shown, frame/read.py); the
statements a search sends, per statement (PostgreSQL's pg_stat_statements); and the catch-up of
`rows` one-row messages another process stored (bench_writers.py's writer).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.frame import read as frame_read  # noqa: E402
from perpetuity_core.memory.derived import index, scan  # noqa: E402
from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.jobs.integrity import check  # noqa: E402
from perpetuity_core.memory.jobs.transfer import copy_memory  # noqa: E402
from perpetuity_core.memory.schema import open_memory  # noqa: E402
from perpetuity_core.memory.storage.reads import around, shown_rows  # noqa: E402
from perpetuity_core.memory.storage.store import Database, Store  # noqa: E402
from perpetuity_core.wire.conversation import Kind, Message, Part  # noqa: E402
from scripts.bench_retrieval import UNIT_USERS, parse_size, pct, questions  # noqa: E402
from scripts.bench_steady import build  # noqa: E402
from scripts.bench_writers import SHARED as WRITERS_SHARED  # noqa: E402
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
    rows, _, tokens = index.totals(store.db.connection())
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
    rows, _, tokens = index.totals(store.db.connection())
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
    texts = [t for (t,) in store.db.translated().execute(
        "SELECT text FROM item WHERE kind = 'text'")]
    queries = []
    while len(queries) < n_queries:
        words = [w for w in rng.choice(texts).split() if w.isalpha() and len(w) > 4]
        if len(words) >= 3:
            queries.append(" ".join(rng.sample(words, 3)))
    out = {"import_s": round(import_s, 1), "sqlite": arena_and_queries(store, queries)}
    db = postgres.fresh_database(url, "pooled")
    target = open_memory(db)
    t0 = time.perf_counter()
    copy_memory(store, target)
    out["migrate_s"] = round(time.perf_counter() - t0, 1)
    store.close()
    target.close()
    target = open_memory(db)  # reopened: the copied settings are read afresh
    out["postgresql"] = arena_and_queries(target, queries)
    out["check_violations"] = check(target)
    target.close()
    return out


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 2)


def frame_reads(scanner: scan.Scanner, q: str, user: int) -> None:
    """A question's search and the reads the frame makes around it (frame_read.retrieve, _rows):
    the rows around the first hits, then every row it may show."""
    hits = frame_read.search(scanner, q, user, 1.8e9)
    near = [i for _, i, _ in around(scanner.db, [(h.conversation_id, h.message_id)
                                                 for h in hits[:frame_read.NEIGHBOUR_HITS]],
                                    frame_read.NEIGHBOURS)]
    shown_rows(scanner.db, [h.item_id for h in hits] + near)


def statements(db: Database, run: Callable[[], object], n: int) -> list[dict]:
    """The statements `run` sends to PostgreSQL (pg_stat_statements), per call of it: how many
    of each (IN lists of any length as one) and the server's mean time."""
    conn = db.connection()
    conn.execute("SELECT pg_stat_statements_reset()")
    run()
    seen: dict[str, list[float]] = {}
    for calls, total, query in conn.execute(
            "SELECT calls, total_exec_time, query FROM pg_stat_statements WHERE dbid = (SELECT"
            " oid FROM pg_database WHERE datname = current_database()) AND query NOT LIKE"
            " '%pg_stat_statements%'"):
        sql = re.sub(r"IN \(\$[\d, $]*\)", "IN (...)", " ".join(query.split()))[:120]
        got = seen.setdefault(sql, [0, 0.0])
        got[0] += calls
        got[1] += total
    return [{"per_call": round(c / n, 2), "server_ms": round(t / c, 3), "sql": sql}
            for sql, (c, t) in sorted(seen.items(), key=lambda kv: -kv[1][0])]


def other_process_writes(location: str, store: Store, rows: int) -> None:
    """`rows` one-row messages stored by another process: bench_writers.py's writer (which
    reheats a row of its shared user: one is stored first)."""
    shared = store.user_id(WRITERS_SHARED)
    store.add_message(conversation_id=store.conversation_id(shared, "c", "anthropic"),
                      user_id=shared, message=Message("user", (Part(Kind.TEXT, "shared"),)),
                      provider="anthropic", model="m", at=1.7e9, pair_key="shared",
                      source="import")
    subprocess.run([sys.executable, str(WRITERS), "--db", location, "--write", "writer-0",
                    str(rows)], input="go\n", capture_output=True, text=True, check=True)


def serve(store: Store, location: str, asked: list[tuple[str, int]], rows: int) -> dict:
    """Cold arena, queries (and the frame's reads around them), catch-up of another process's
    rows, on the memory `store` holds."""
    scanner = scan.Scanner(store, store_rows=0)
    out: dict = {"cold_arena_s": timed(scanner.catch_up), "arena_bytes": scanner.arena.nbytes()}
    times = []
    for q, u in asked:
        t0 = time.perf_counter()
        scanner.search(q, u, 10)
        times.append(time.perf_counter() - t0)
    out["query"] = pct(times)
    times = []
    for q, u in asked:
        t0 = time.perf_counter()
        frame_reads(scanner, q, u)
        times.append(time.perf_counter() - t0)
    out["query_and_frame_reads"] = pct(times)
    if location.startswith("postgresql:"):
        some = asked[:50]
        out["statements_per_search"] = statements(
            store.db, lambda: [scanner.search(q, u, 10) for q, u in some], len(some))
        out["statements_per_frame_reads"] = statements(
            store.db, lambda: [frame_reads(scanner, q, u) for q, u in some], len(some))
    other_process_writes(location, store, rows)
    t0 = time.perf_counter()
    read = scanner.catch_up()
    out["catch_up"] = {"rows": read, "ms": round((time.perf_counter() - t0) * 1e3, 1)}
    return out


def scale(size: int, url: str, args: argparse.Namespace, tmp: Path) -> dict:
    """One pooled size: built in SQLite, copied to PostgreSQL, served from both."""
    path = tmp / f"scale-{size}.db"
    store = open_memory(path)
    t0 = time.perf_counter()
    copies = build(store, SHARED, size)
    out: dict = {"target_tokens": size, "build_sqlite_s": round(time.perf_counter() - t0, 1)}
    conn = store.db.translated()
    rows, _, tokens = index.totals(conn)
    uid = {i: r[0] for i in range(UNIT_USERS) if (r := conn.execute(
        "SELECT id FROM user WHERE key = ?", (f"bench:{i}",)).fetchone())}
    asked = [(q, uid[us[0]]) for q, us in ((q, [u for u in us if u in uid])
                                           for q, us in questions(SHARED)) if us][:args.queries]
    (messages,) = conn.execute("SELECT count(*) FROM message").fetchone()
    out.update(rows=rows, tokens=tokens, messages=messages, users=len(uid) * (copies + 1),
               queries=len(asked), sqlite_bytes=path.stat().st_size)
    print(f"[{size:,}] built {out}", file=sys.stderr)
    violations: list[str] = []
    out["check_sqlite_s"] = timed(lambda: violations.extend(check(store)))
    pg = postgres.fresh_database(url, f"scale{size}")
    with psycopg_connect(pg) as admin:
        admin.execute("CREATE EXTENSION pg_stat_statements")
    target = open_memory(pg)
    out["migrate_s"] = timed(lambda: copy_memory(store, target))
    store.close()
    target.close()
    target = open_memory(pg)  # reopened: the copied settings are read afresh
    out["check_postgresql_s"] = timed(lambda: violations.extend(check(target)))
    out["check_violations"] = violations
    (out["postgresql_bytes"],) = target.db.connection().execute(
        "SELECT pg_database_size(current_database())").fetchone()
    target.close()
    # A served memory has long been vacuumed by autovacuum; a fresh copy has not, and
    # autovacuum's first pass over it would compete with the timed searches for the cores.
    with psycopg_connect(pg) as admin:
        out["vacuum_s"] = timed(lambda: admin.execute("VACUUM (ANALYZE)"))
    print(f"[{size:,}] migrated and checked {out}", file=sys.stderr)
    for name, location in (("sqlite", str(path)), ("postgresql", pg)):
        store = open_memory(location)
        out[name] = serve(store, location, asked, args.rows)
        store.close()
        print(f"[{size:,}] {name} {out[name]}", file=sys.stderr)
    path.unlink()
    with psycopg_connect(url) as admin:
        admin.execute(f'DROP DATABASE "scale{size}"')
    return out


def psycopg_connect(url: str) -> psycopg.Connection:
    import psycopg

    return psycopg.connect(url, autocommit=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=1000, help="per writer process")
    ap.add_argument("--rows", type=int, default=10_000, help="written for the catch-up")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--sizes", help="pooled sizes in tokens (e.g. 10M,82M): the scale run")
    ap.add_argument("--pg-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a server setting for the scale run (e.g. shared_buffers=1GB)")
    ap.add_argument("--tmp", help="where the SQLite memories go (default: a temporary folder)")
    ap.add_argument("--out", help="also write the JSON here, after each size")
    args = ap.parse_args()
    if why := postgres.unavailable():
        print(f"bench_postgres: {why}", file=sys.stderr)
        return 1
    if args.sizes:
        if not SHARED.is_dir():
            print(f"bench_postgres: no benchmark data at {SHARED}", file=sys.stderr)
            return 1
        report: dict = {"server_settings": args.pg_setting, "sizes": {}}
        if args.tmp:
            Path(args.tmp).mkdir(parents=True, exist_ok=True)
        with (postgres.server("shared_preload_libraries=pg_stat_statements",
                              *args.pg_setting) as url,
              tempfile.TemporaryDirectory(dir=args.tmp) as tmp):
            for s in args.sizes.split(","):
                report["sizes"][s] = scale(parse_size(s), url, args, Path(tmp))
                if args.out:
                    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
        return 0
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
