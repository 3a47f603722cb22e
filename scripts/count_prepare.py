"""Instructions a first prompt's `Pipeline.prepare` takes (issue 24), counted by callgrind inside
the measured prepares only. Wall and CPU time on this 2-core machine move with its load; an
instruction count does not, so a change to the default path is judged by this.

Two steps, so that before and after are measured on the same memory, built once:

    .venv/bin/python scripts/count_prepare.py build DIR       # bench.db, locomo.db, pooled.db
    valgrind --tool=callgrind --collect-atstart=no --callgrind-out-file=/dev/null \\
        .venv/bin/python scripts/count_prepare.py count DIR/bench.db [--requests 20]

`count` works on a copy of the memory: after 5 unmeasured first prompts (caches warmed, as in a
running proxy), it asks `--requests` fresh ones, nothing stored between, and collection is
toggled on and off around each prepare by callgrind's client request (a two-function C library
built here with valgrind's callgrind.h; outside valgrind the requests are no-ops). Callgrind
prints the total collected; divide by the requests. `--profile FILE` (outside valgrind) writes
a cProfile of the same prepares. Run with PYTHONHASHSEED=0 for repeatable
counts. Memories: `bench` (bench_prepare.py's: its Anthropic sides in rotation, each stored with
its reply), `locomo` (one LoCoMo conversation) and `pooled` (all ten in one memory).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_prepare import LOCOMO, SIDES, anthropic_request, stored

from perpetuity_core.cli import eval as evaluation
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire.conversation import Provider

BENCH_ROUNDS = 60
WARM = 5
TOGGLE_C = """#include <valgrind/callgrind.h>
void collect_on(void) { CALLGRIND_TOGGLE_COLLECT; }
void collect_off(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def pipeline_for(store_path: Path, memory: str) -> Pipeline:
    upstreams = {p: "http://127.0.0.1:9" for p in Provider}
    store = open_memory(store_path)
    if memory == "bench":
        return Pipeline(store, Settings(upstreams=upstreams, share_pool=frozenset()))
    return Pipeline(store, Settings(upstreams=upstreams, share_pool=memory == "pooled",
                                    trust_identity=True))


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pipeline = pipeline_for(out / "bench.db", "bench")
    for i in range(BENCH_ROUNDS):
        for side in SIDES:
            stored(pipeline, anthropic_request(side, i))
    pipeline.store.close()
    cases = list(evaluation.locomo(LOCOMO))
    for memory, fed in (("locomo", cases[:1]), ("pooled", cases)):
        pipeline = pipeline_for(out / f"{memory}.db", memory)
        for case in fed:
            evaluation.feed(pipeline, case.thread)
        pipeline.store.close()


def first_prompts(memory: str, n: int) -> list[HttpRequest]:
    """Fresh first prompts: the bench relay side's next ones, or LoCoMo's questions."""
    if memory == "bench":
        return [anthropic_request("frame_and_tools_relay", BENCH_ROUNDS + k) for k in range(n)]
    case = next(iter(evaluation.locomo(LOCOMO)))
    questions = (case.questions * (n // len(case.questions) + 1))[:n]
    return [evaluation.chat_request(case.thread.user_key, f"count-{k}", q.at,
                                    [{"role": "user", "content": q.text}])
            for k, q in enumerate(questions)]


def toggles(tmp: Path) -> ctypes.CDLL:
    src = tmp / "toggle.c"
    src.write_text(TOGGLE_C)
    lib = tmp / "toggle.so"
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return ctypes.CDLL(str(lib))


def count(saved: Path, requests: int, profile: Path | None) -> None:
    memory = saved.stem
    with tempfile.TemporaryDirectory() as tmp:
        lib = toggles(Path(tmp))
        for suffix in ("", "-wal", "-shm"):
            if saved.with_name(saved.name + suffix).exists():
                shutil.copy(saved.with_name(saved.name + suffix), Path(tmp) / f"m.db{suffix}")
        pipeline = pipeline_for(Path(tmp) / "m.db", memory)
        reqs = first_prompts(memory, WARM + requests)
        for req in reqs[:WARM]:
            pipeline.prepare(req)
        prof = cProfile.Profile() if profile else None
        for req in reqs[WARM:]:
            lib.collect_on()
            if prof:
                prof.enable()
            pipeline.prepare(req)
            if prof:
                prof.disable()
            lib.collect_off()
        pipeline.store.close()
    if prof and profile:
        prof.dump_stats(str(profile))
    print(f"{memory}: {requests} prepares counted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    sub.add_parser("build").add_argument("dir", type=Path)
    c = sub.add_parser("count")
    c.add_argument("memory", type=Path)
    c.add_argument("--requests", type=int, default=20)
    c.add_argument("--profile", type=Path, help="also write a cProfile of the counted prepares")
    args = ap.parse_args()
    if args.step == "build":
        build(args.dir)
    else:
        count(args.memory, args.requests, args.profile)


if __name__ == "__main__":
    main()
