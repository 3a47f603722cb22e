#!/usr/bin/env python3
"""Several writer processes on one memory (a SQLite file or a PostgreSQL database): failures,
throughput, heat and clock, and the check after.

    scripts/bench_writers.py [--processes 2] [--messages 3000] [--db PATH_OR_URL]

Each process opens its own Store on the same memory and stores `messages` messages through
the write path (Store.add_message, one transaction per message, its own user and
conversation), counting the writes that fail. A turn is two messages (the prompt and the
reply); with each turn it also moves one shared user's clock by one token and reheats one
shared row (at clock 0, so the peak alone decides), as a proxy serving that turn does:
afterwards the clock must be the sum of every move and the row's peak the highest any process
wrote, or an update was lost. Throughput is timed from the moment every process has opened its
store (they wait for each other) to the last one's end, so starting Python is not counted.
Then the memory is checked (`memory check`) and its messages counted. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perpetuity_core.memory.schema import open_memory

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


SHARED = "shared-user"


def peak(writer: int, i: int) -> float:
    """The peak writer `writer` reheats the shared row to with its turn `i`."""
    return 1.0 + (i * 31 + writer * 17) % 1000 / 1000


def write(path: str, user: str, n: int) -> None:
    """One writer process: `n` turns, then the number of failed writes on stdout."""
    from perpetuity_core.errors import StoreError
    from perpetuity_core.memory.derived import heat
    from perpetuity_core.wire.conversation import Kind, Message, Part

    s = open_memory(path)
    uid = s.user_id(user)
    cid = s.conversation_id(uid, "c", "anthropic")
    shared = s.user_id(SHARED)
    (row,) = s.db.translated().execute("SELECT i.id FROM item i JOIN message m ON m.id = i.message_id"
                                  " WHERE m.user_id = ?", (shared,)).fetchone()
    writer = int(user.rsplit("-", 1)[1])
    failed = 0
    print("ready", flush=True)
    sys.stdin.readline()  # every writer has opened its store: go
    start = time.time()
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        text = f"{user} turn {i} about the garden, the violin and the harbour lantern"
        try:
            s.add_message(conversation_id=cid, user_id=uid,
                          message=Message(role, (Part(Kind.TEXT, text),)),
                          provider="anthropic", model="m", at=1.7e9 + i,
                          pair_key=f"{user}-{i}", source="import")
            if role == "assistant":
                heat.advance(s.db, shared, 1)
                heat.reheat(s.db, 0.0, {row: peak(writer, i)})
        except StoreError:
            failed += 1
    s.flush()
    end = time.time()
    s.close()
    print(json.dumps({"failed": failed, "start": start, "end": end}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--db", help="the file (default: a fresh one in a temporary folder)")
    ap.add_argument("--write", nargs=2, metavar=("USER", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.db or str(Path(tmp) / "memory.db")
        if args.write:
            write(str(path), args.write[0], int(args.write[1]))
            return 0
        from perpetuity_core.memory.derived import heat
        from perpetuity_core.memory.jobs.integrity import check
        from perpetuity_core.wire.conversation import Kind, Message, Part

        store = open_memory(path)  # migrated once, so every writer starts on the same schema
        shared = store.user_id(SHARED)
        (item,) = store.add_message(
            conversation_id=store.conversation_id(shared, "c", "anthropic"), user_id=shared,
            message=Message("user", (Part(Kind.TEXT, "the shared row"),)), provider="anthropic",
            model="m", at=1.7e9, pair_key="shared", source="import").item_ids
        store.close()
        procs = [subprocess.Popen([sys.executable, __file__, "--db", str(path), "--write",
                                   f"writer-{i}", str(args.messages)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
                 for i in range(args.processes)]
        for p in procs:
            assert p.stdout and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin
            p.stdin.write("go\n")
            p.stdin.flush()
        done = [json.loads(p.communicate()[0]) for p in procs]
        failures = [d["failed"] for d in done]
        seconds = max(d["end"] for d in done) - min(d["start"] for d in done)
        store = open_memory(path)
        conn = store.db.translated()
        (stored,) = conn.execute("SELECT count(*) - 1 FROM message").fetchone()
        (top,) = conn.execute("SELECT peak FROM activation WHERE item_id = ?", (item,)).fetchone()
        clock = heat.clock(store.db, shared)
        violations = check(store)
        store.close()
    print(json.dumps({"processes": args.processes, "messages_each": args.messages,
                      "failures": failures, "stored": stored,
                      "expected": args.processes * args.messages, "seconds": round(seconds, 2),
                      "messages_per_s": round(stored / seconds), "clock": clock,
                      "expected_clock": float(args.processes * (args.messages // 2)),
                      "peak": top, "expected_peak": max(peak(w, i) for w in range(args.processes)
                                                        for i in range(1, args.messages, 2)),
                      "check_violations": violations}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
