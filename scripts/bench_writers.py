#!/usr/bin/env python3
"""Several writer processes on one memory file: failures, throughput, and the check after.

    scripts/bench_writers.py [--processes 2] [--messages 3000]

Each process opens its own Store on the same file and stores `messages` user turns through
the write path (Store.add_message, one transaction per message, its own user and
conversation), counting the writes that fail; all start together. Afterwards the file is
checked (`memory check`) and its messages counted. Prints one JSON object.
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


def write(path: str, user: str, n: int) -> None:
    """One writer process: `n` turns, then the number of failed writes on stdout."""
    from perpetuity_core.errors import StoreError
    from perpetuity_core.wire.conversation import Kind, Message, Part

    s = open_memory(path)
    uid = s.user_id(user)
    cid = s.conversation_id(uid, "c", "anthropic")
    failed = 0
    for i in range(n):
        text = f"{user} turn {i} about the garden, the violin and the harbour lantern"
        try:
            s.add_message(conversation_id=cid, user_id=uid,
                          message=Message("user", (Part(Kind.TEXT, text),)),
                          provider="anthropic", model="m", at=1.7e9 + i,
                          pair_key=f"{user}-{i}", source="import")
        except StoreError:
            failed += 1
    s.flush()
    s.close()
    print(failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--db", help="the file (default: a fresh one in a temporary folder)")
    ap.add_argument("--write", nargs=2, metavar=("USER", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.db or Path(tmp) / "memory.db")
        if args.write:
            write(str(path), args.write[0], int(args.write[1]))
            return 0
        from perpetuity_core.memory.integrity import check
        from perpetuity_core.memory.store import db

        open_memory(path).close()  # migrated once, so every writer starts on the same schema
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "--db", str(path), "--write",
                                   f"writer-{i}", str(args.messages)], stdout=subprocess.PIPE,
                                  text=True) for i in range(args.processes)]
        failures = [int(p.communicate()[0]) for p in procs]
        seconds = time.perf_counter() - t0
        store = open_memory(path)
        (stored,) = db.connection().execute("SELECT count(*) FROM message").fetchone()
        violations = check(store)
        store.close()
    print(json.dumps({"processes": args.processes, "messages_each": args.messages,
                      "failures": failures, "stored": stored,
                      "expected": args.processes * args.messages, "seconds": round(seconds, 2),
                      "messages_per_s": round(stored / seconds), "check_violations": violations}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
