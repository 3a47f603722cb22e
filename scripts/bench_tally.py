#!/usr/bin/env python3
"""What the live tally (serve/tally.py) costs the store's writer thread per call, early and
late in a session that never ends: the six shared Claude Code sessions chained as `perpetuity
replay claude-code --chain` chains them, each call through `Pipeline.prepare` and stored as
the replay does, then billed both ways as the proxy bills it (its bodies the objects prepare
read: wire.seen) and added to the day's row.

    .venv/bin/python scripts/bench_tally.py [--passes 1] [--calls N]

Prints JSON: per tenth of the calls, the median ms of the billing (`bill_ms`) and of the
write (`write_ms`), and the history's messages.

What it found (h-code43, 678 calls, histories to 1,356 messages and 7.3 MB, load 9 on 2 cores):
billing 0.53-0.94 ms a call (median per tenth; 0.6-0.95 ms of CPU, p99 3-5.6), the write
0.05-0.08 ms. The one call over 11 ms of CPU (50 ms, at 878 messages) is a body that does not
continue the one before: every block made anew, as the pipeline parses it anew. Billing each
body from scratch, as the replay did, took 0.8 s a call at 2,712 messages (14.5 MB).
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

from perpetuity_core.cli.replay.request import build, load_template  # noqa: E402
from perpetuity_core.cli.replay.sessions import chained, sessions_in_order  # noqa: E402
from perpetuity_core.memory.schema import open_memory  # noqa: E402
from perpetuity_core.memory.storage import savings  # noqa: E402
from perpetuity_core.serve.exchange import HttpRequest  # noqa: E402
from perpetuity_core.serve.pipeline import Pipeline, Settings  # noqa: E402
from perpetuity_core.serve.tally import Savings  # noqa: E402
from perpetuity_core.wire.conversation import Provider  # noqa: E402
from perpetuity_core.wire.protocols import ADAPTERS  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "claude-code"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--calls", type=int, default=0, help="only the chain's first N calls")
    args = ap.parse_args()
    if not DATA.is_dir():
        sys.exit(f"bench_tally: needs the shared sessions at {DATA}")
    session = chained(list(sessions_in_order([DATA])) * args.passes)
    shape = load_template(None)
    calls = session.calls[:args.calls or None]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = open_memory(Path(tmp) / "m.db")
        pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                            notes_root=Path(tmp) / "notes"))
        tally = Savings()
        for call in calls:
            built = build(call, shape, session)
            req = HttpRequest("POST", "127.0.0.1", "/v1/messages?beta=true", built.headers,
                              json.dumps(built.body).encode(), True)
            job = pipeline.prepare(req).job
            if job is None:
                continue
            reply = ADAPTERS[job.protocol].reply_from_body({"content": call.reply})
            pipeline.store_reply(pipeline.store_turn(job.pending), reply, call.replied_at,
                                 job.pending)
            started = time.perf_counter()
            saved = tally.bill(job, reply, call.at)
            billed = time.perf_counter()
            savings.add(store.db, "2026-01-01", "anthropic", job.pending.model, saved)
            rows.append((len(built.body["messages"]), (billed - started) * 1e3,
                         (time.perf_counter() - billed) * 1e3))
        store.close()
    tenth = max(1, len(rows) // 10)
    print(json.dumps({"calls": len(rows), "tenths": [
        {"messages": rows[i][0], "bill_ms": round(statistics.median(r[1] for r in part), 3),
         "write_ms": round(statistics.median(r[2] for r in part), 3),
         "bill_ms_max": round(max(r[1] for r in part), 2)}
        for i in range(0, len(rows), tenth) if (part := rows[i:i + tenth])]}, indent=1))


if __name__ == "__main__":
    main()
