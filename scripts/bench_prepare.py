"""The CPU of `Pipeline.prepare` on a first prompt (issue 24): identity, store reads, retrieval,
selection and rendering of its frame, the recall tools riding along. Prints JSON.

No proxy and no network: the pipeline is driven directly, on one thread, so the figure is the
process's CPU over the call (time.process_time: the scan's worker threads with it), which the
machine's load changes far less than wall time. Memories:
- `bench`: what bench_latency.py's run leaves behind: its Anthropic sides' first prompts and
  coding tasks (a prompt, four tool rounds), each stored with its reply, in rotation; the
  first prompt measured is its relay side's, a new conversation each, stored after it as
  there.
- `locomo`: one LoCoMo conversation fed as a chat (`perpetuity eval`'s feed, ~600 turns); each
  question asked as a first prompt with the tools riding along, nothing stored after it.
- `pooled`: every LoCoMo conversation pooled in one memory (5,882 turns), asked the same way.

`--profile FILE` writes a cProfile of the measured prepares (pstats).

What it found (issue 24; a 2-core machine at load 6-15, so instruction counts beside the CPU
times: callgrind collecting inside the measured prepares only, through a client-request
toggle). Before: a first prompt's prepare on LoCoMo went to the frame's reads (rows' text read
again every call: 2.8 ms; the warm set 1.2; a small memory's scan from the store, every row
re-read: 1.4; the hits' text 1.1), the fill's renders (2-3 ms, a quarter of it labels made
afresh) and thread hand-offs of a three-segment scan. After the rows and hits kept once read
(memory.storage.kept), the arena from the first row, the scan on the calling thread below
view.POOL_ROWS, labels' times made once: instructions a prepare 64.2M -> 39.2M (0.61) on one
LoCoMo conversation (30 questions), 58.0M -> 43.6M (0.75) on all ten pooled (20 questions),
70.9M -> 49.8M (0.70) on the bench memory (60 rounds); CPU p50 10.2 -> 6.5 ms (LoCoMo, three
runs each, alternating), 13.3 -> 10.3 ms on the bench memory (medians of four pairs, 8.8
to 12.1 as the load went). Still above 5 ms: what is left is Python work per warm row (~350
a frame: the warm set's read, which rows are there, their costs and order) and the fill's two
renders of the rows it chose.
Since (h-first3): the fill measures a frame laid out but not written (frame.render.lay and
tokens), and the frame is written once from its last layout; labels made once a day.
Instructions a prepare, callgrind, fresh first prompts on a saved memory (nothing stored
between): bench 41.5M -> 35.2M (0.85), LoCoMo 39.2M -> 37.1M (0.95), pooled 44.2M -> 41.9M
(0.95); this script's bench run (60 rounds, stored between): 41.9M -> 39.3M (0.94). Still
about 9 ms of CPU at load: what is left is per row and per hit (SQLite steps and their GIL
hand-offs, 200 Hit objects a search, the warm set's and the rows' reads).
Since (h-first4): a Hit is no longer a frozen dataclass (whose __init__ set each field through
object.__setattr__: 3.8 us against 0.6 a hit, 200 a search; callgrind's slot_tp_init 76.6M ->
16.2M over 20 prepares) and the fill orders its rows by one stable numpy sort. Instructions a
prepare, 20 fresh first prompts on a saved memory after 5 unmeasured, PYTHONHASHSEED=0: bench
38.5M -> 35.0M (0.91), LoCoMo 39.4M -> 35.9M (0.91), pooled 45.0M -> 41.5M (0.92). Where the
rest goes (bench memory, inclusive): SQLite's fetchall 20% (the rows there, the warm window,
the hits' neighbours: 400-id IN-lists cost ~6k instructions a row, binding and the IN table
with the step), sorted() 6%, the GIL's release and retake around every step 6%. Tried and
dropped: render.runs grouping by itertools.groupby (+1.6%: a frame's messages are mostly one
row) and SQLite's json_group_array for id-only reads (+16% on a 400-row read).
A task's tool rounds (`--side task_relay`: the frame its prompt chose, 160-190 small messages
here, carried): most of their prepare was the frame rendered, checked block by block and
written one piece at a time anew each round. After it was rendered once while its plan keeps
it, read past by `anthropic.check` and what is new written in one encoding: instructions a tool
round's prepare 14.6M -> 4.3M (0.29, 32 rounds; task_stream 8.0M -> 2.8M), a first prompt's
35.1M -> 31.3M; CPU p50 2.19 -> 1.26 ms (medians of three alternating runs, load 10-14).
Since (h-first5): where a first prompt's instructions went, by callgrind dumps at the frame's
reads (bench memory, 20 prepares): the shown rows 7.5M of 35M (which rows are there 3.0M, their
conversations' names 2.4M, ~400 rows' Python), the warm set 4.9M (its SQL 3.4M), the fill's
layouts 4.6M and its work before them 3.1M, the adjacency of the shelf's messages 2.8M, the
hits' fetch 2.4M, the scan 2.0M, the neighbours' read 1.9M. The adjacency is now which message
follows each, read once and kept per database (one lookup a pair, not the shelf's ~200
conversations' tuples hashed and their pair sets united every call), the reheat peaks made
once, the written frame's messages made once each: instructions a prepare bench 34.93M ->
33.17M (0.95), LoCoMo 34.92M -> 32.00M (0.92), pooled 39.96M -> 36.76M (0.92), this memory
set built afresh by base code, PYTHONHASHSEED=0.
Since (h-first7): the fill's search measures its prefixes without laying any out
(frame.render.prefix_tokens: the rows as arrays in store order, a prefix a mask; on this
memory it laid out 226, 168, 207 and 191 rows for the 191 that entered), and the frame is laid
out once, to be written; a piece of the body written without ASCII escapes that is ASCII
through is kept as the relay's first round's too (wire.written: JSON encoding 4.4M -> 2.3M
instructions a prepare). Instructions a prepare, callgrind, 20 fresh first prompts on a saved
memory after 5 unmeasured (the memories built by base code, PYTHONHASHSEED=0): bench 45.21M ->
38.06M (0.84), LoCoMo 32.17M -> 31.90M (0.99: two measures of ~110 rows there, which the arrays
cost about as much as the layouts did), pooled 36.91M -> 36.17M (0.98). Where the bench
memory's go now (cProfile, inclusive): the frame's reads 25% (the rows there and their
conversations' names, the warm set, the hits' fetch and neighbours: SQLite's steps and
fetches are 13% of all instructions), the body's check and Anthropic render 17%, its encoding
15%, the fill 16% (the prefix arrays' columns are most of it), the frame laid out and written
15% (its Parts and Messages are frozen dataclasses, each field set by object.__setattr__).
Since (h-first9): the frame's messages are kept by their text (frame.render.Said, the Layout's),
so a frame re-showing what an earlier one showed hands on the same messages, whose wire form
(Anthropic's and now Chat Completions') and JSON are made already; which rows and hits are
there is read by the item's and the retrieval row's key alone (their foreign keys stand for
the joins); a hit's neighbours are a range of its conversation's index, not `IN` the n nearest
(a temporary index a branch, pages allocated and zeroed). Instructions a prepare, measured by
scripts/count_prepare.py (20 fresh first prompts after 5 on memories built once by base code,
PYTHONHASHSEED=0): bench 36.98M -> 28.59M (0.77), LoCoMo 32.00M -> 28.60M (0.89), pooled
36.64M -> 31.33M (0.86). What is left (cProfile, bench memory): the scan and the hits'
fetch 20%, the frame's reads 19% (the rows there 9%, the warm set 6%), the fill 18%, the
body's check and render 10%, the layout and its texts 13%, the encoding 6%.
Since (h-first10): every message and item deleted is counted by trigger (m017), so which of
the frame's rows are there is asked only of ids not found before while the count stands
(kept.There), and so are the hits' seqs while no retrieval row went (retrieval_gone's last
seq and the flips); a row's birth is read once (kept.Counted). Instructions a prepare, count_prepare.py as
above: bench 28.59M -> 26.63M (0.93), LoCoMo 28.60M -> 25.10M (0.88), pooled 31.33M -> 27.91M
(0.89). Tried and left out: a covering activation_warm (user_id, at, peak, half_life), LoCoMo
26.43M -> 26.51M (its rows are small, the lookup by rowid cheap); a hit's neighbours kept
while nothing is deleted, read for the others only (26.43M -> 26.96M; likely because the
UNION's text then changes with the number of hits not kept, a statement prepared afresh). Where
LoCoMo's go now (callgrind, per function, inclusive, before these): the warm set 5.4M, the
scan 1.9M and the hits' fetch 2.3M, the fill 4.4M (its prefix arrays 1.5M), the neighbours
1.5M, adjacency 1.9M, the layout written 1.6M, the body's JSON 2.3M.

    .venv/bin/python scripts/bench_prepare.py [--memory bench|locomo|pooled] [--requests 100]
        [--side task_relay]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_latency import ROUNDS, messages  # the same requests, that script's rotation

from perpetuity_core.cli import eval as evaluation
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire.conversation import Kind, Message, Part, Provider, Reply, Usage

LOCOMO = Path(__file__).resolve().parent.parent.parent / "shared/data/locomo/locomo10.json"
REPLY = "A reply of a few words, streamed in pieces."
# bench_latency.py's Anthropic sides that store a turn, in its rotation.
SIDES = {"frame_and_tools_relay": {}, "frame_stream": {"x-perpetuity-tools": "off"},
         "capture_stream": {"x-perpetuity-recall": "off"}, "task_relay": {},
         "task_stream": {"x-perpetuity-tools": "off"}}


def anthropic_request(side: str, n: int) -> HttpRequest:
    body = {"model": "claude-opus-4-8", "max_tokens": 100, "stream": True,
            "metadata": {"user_id": "bench"}, "messages": messages(side, n)}
    headers = (("x-api-key", "sk-ant-bench"), ("content-type", "application/json"),
               *SIDES[side].items())
    return HttpRequest("POST", "127.0.0.1", "/v1/messages", headers, json.dumps(body).encode(),
                       direct=True)


def stored(pipeline: Pipeline, req: HttpRequest) -> float:
    """Prepare a request (its CPU, seconds) and store it with its reply, as the proxy
    would."""
    start = time.process_time()
    d = pipeline.prepare(req)
    cpu = time.process_time() - start
    if d.job is not None:
        turn = pipeline.store_turn(d.job.pending)
        pipeline.store_reply(turn, Reply(Message("assistant", (Part(Kind.TEXT, REPLY),)),
                                         Usage()), time.time(), d.job.pending)
    return cpu


def run_bench(pipeline: Pipeline, requests: int, prof: cProfile.Profile | None,
              measure: str) -> list[float]:
    cpu = []
    for i in range(requests + 5):
        for side in SIDES:
            req = anthropic_request(side, i)
            # A task side's prompts are first prompts: its tool rounds are measured.
            measured = side == measure and i >= 5 and not (side.startswith("task")
                                                            and i % ROUNDS == 0)
            if measured and prof:
                prof.enable()
            took = stored(pipeline, req)
            if measured and prof:
                prof.disable()
            if measured:
                cpu.append(took)
    return cpu


def run_locomo(pipeline: Pipeline, pooled: bool, requests: int,
               prof: cProfile.Profile | None) -> list[float]:
    cases = list(evaluation.locomo(LOCOMO))
    for case in cases if pooled else cases[:1]:
        evaluation.feed(pipeline, case.thread)
    case = cases[0]
    cpu = []
    for k, q in enumerate((case.questions * (requests // len(case.questions) + 1))[:requests + 5]):
        req = evaluation.chat_request(case.thread.user_key, f"bench-{k}", q.at,
                                      [{"role": "user", "content": q.text}])
        if prof and k >= 5:
            prof.enable()
        start = time.process_time()
        pipeline.prepare(req)
        took = time.process_time() - start
        if prof and k >= 5:
            prof.disable()
        if k >= 5:
            cpu.append(took)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--memory", choices=["bench", "locomo", "pooled"], default="bench")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--side", choices=list(SIDES), default="frame_and_tools_relay",
                    help="the side measured on the bench memory (a task side: its tool rounds)")
    args = ap.parse_args()
    prof = cProfile.Profile(time.process_time) if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        store = open_memory(Path(tmp) / "memory.db")
        upstreams = {p: "http://127.0.0.1:9" for p in Provider}
        if args.memory == "bench":
            pipeline = Pipeline(store, Settings(upstreams=upstreams, share_pool=frozenset()))
            cpu = run_bench(pipeline, args.requests, prof, args.side)
        else:
            pipeline = Pipeline(store, Settings(upstreams=upstreams,
                                                share_pool=args.memory == "pooled",
                                                trust_identity=True))
            cpu = run_locomo(pipeline, args.memory == "pooled", args.requests, prof)
        store.close()
    if prof and args.profile:
        prof.dump_stats(str(args.profile))
    ms = sorted(c * 1000 for c in cpu)
    print(json.dumps({"memory": args.memory, "requests": len(ms),
                      "prepare_cpu_ms_p50": round(statistics.median(ms), 3),
                      "prepare_cpu_ms_p90": round(ms[int(0.9 * len(ms))], 3),
                      "prepare_cpu_ms_mean": round(statistics.fmean(ms), 3)}, indent=2))


if __name__ == "__main__":
    main()
