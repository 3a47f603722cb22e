"""What the question's subject (frame/subject.py) costs a question. Prints JSON.

One LoCoMo conversation is fed as a chat (`perpetuity eval`'s feed) and each of its questions
is searched as the frame searches it (frame.read.search, HITS deep), once to read its hits,
then alternately with the subject's re-order and without it (main's order: the scan's), each
first in turn; and the re-order alone timed on that question's hits. CPU time (time.process_time) per call, p50 and p90 in milliseconds.

    .venv/bin/python scripts/bench_subject.py [--conversation 0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from perpetuity_core.cli import eval as ev
from perpetuity_core.frame import read as frame_read
from perpetuity_core.frame import subject
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider

LOCOMO = Path(__file__).resolve().parent.parent.parent / "shared/data/locomo/locomo10.json"


def cpu_ms(call: Callable[[], object], repeat: int) -> float:
    start = time.process_time()
    for _ in range(repeat):
        call()
    return (time.process_time() - start) * 1000 / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversation", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    case = list(ev.locomo(LOCOMO))[args.conversation]
    ranked = subject.ranked
    times: dict[str, list[float]] = {"search_with": [], "search_without": [], "reorder": []}
    with tempfile.TemporaryDirectory() as tmp:
        store = open_memory(Path(tmp) / "memory.db")
        pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                            trust_identity=True))
        ev.feed(pipeline, case.thread)
        uid = store.find_user(case.thread.user_key)
        assert uid is not None
        for q in case.questions:
            def search(q: ev.Question = q) -> object:
                return frame_read.search(pipeline.scanner, q.text, uid, q.at)
            search()  # the hits' rows read once and kept (scan.fetch_hits), for both alike
            for r in range(args.rounds):
                for way in (("with", "without") if r % 2 else ("without", "with")):
                    # without: main's order, the scan's
                    subject.ranked = ranked if way == "with" else lambda query, hits: hits
                    times[f"search_{way}"].append(cpu_ms(search, 1))
            subject.ranked = ranked
            hits = pipeline.scanner.search(q.text, uid, limit=frame_read.HITS)
            times["reorder"].append(cpu_ms(lambda q=q, hits=hits: ranked(q.text, hits), 20))
        store.close()
    print(json.dumps({"questions": len(case.questions), "rounds": args.rounds,
                      **{f"{k}_ms": {"p50": round(float(np.percentile(v, 50)), 3),
                                     "p90": round(float(np.percentile(v, 90)), 3)}
                         for k, v in times.items()}}, indent=1))


if __name__ == "__main__":
    main()
