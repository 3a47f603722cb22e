"""Questions in sequence, in detail: `perpetuity eval --sequence`'s run, with what it does not
report: the request's size (every message's text, chars / 4), the first question of each
conversation apart, and the questions the ranking holds but the request misses, by what the
request carried for them (a new frame, an addendum, nothing new).

    .venv/bin/python scripts/eval_sequence.py locomo ../shared/data/locomo/locomo10.json
    .venv/bin/python scripts/eval_sequence.py beam ../shared/data/beam-100k [--limit N]

Prints JSON. The loop is eval's own (cli/eval.py: feed, then each conversation's questions a
minute apart in one conversation, each answered "Noted." and stored).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core.cli import eval as ev
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider, Reply, Usage


def run(dataset: str, path: Path, limit: int) -> dict:
    cases = list(ev.DATASETS[dataset](path))[: limit or None]
    out: list[dict] = []
    limits = Cap()
    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(cases):
            store = open_memory(Path(tmp) / f"memory-{n}.db")
            pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                                limits=limits, trust_identity=True))
            ev.feed(pipeline, case.thread)
            user = case.thread.user_key
            history: list[dict[str, str]] = []
            for k, q in enumerate(case.questions):
                at = q.at + k * ev.SEQUENCE_GAP
                history.append({"role": "user", "content": q.text})
                d = pipeline.prepare(ev.chat_request(user, user + ":sequence", at, history))
                sent = json.loads(d.body)["messages"] if d.body is not None else history
                text = "\n".join(str(m.get("content", "")) for m in sent)
                laid = d.recall.plan if d.recall is not None and d.body is not None else None
                memory = laid.frame_tokens + laid.insert_tokens if laid else 0
                new = d.frame.tokens if d.frame else 0
                evidence = [case.thread.messages[i].text for i in q.evidence]
                out.append({
                    "k": k, "all": all(e in text for e in evidence),
                    "ranked": ev.ranked_holds(pipeline, user, q.text, at, memory, evidence),
                    "ranked_new": ev.ranked_holds(pipeline, user, q.text, at, new, evidence),
                    "memory": memory, "new": new,
                    "request": sum(token_estimate(str(m.get("content", ""))) for m in sent),
                    "made": d.recall.made if d.recall is not None and d.frame else "none"})
                if d.job is not None:
                    turn = pipeline.store_turn(d.job.pending)
                    pipeline.store_reply(turn, Reply(ev.noted(), Usage()), at, d.job.pending)
                history.append({"role": "assistant", "content": "Noted."})
            store.close()
            print(f"{dataset} {n + 1}/{len(cases)}", file=sys.stderr)
    return report(out)


def report(rs: list[dict]) -> dict:
    def share(key: str, sub: list[dict]) -> float:
        return round(sum(r[key] for r in sub) / len(sub), 4) if sub else 0.0

    def mean(key: str, sub: list[dict]) -> int:
        return round(sum(r[key] for r in sub) / len(sub)) if sub else 0

    first = [r for r in rs if r["k"] == 0]
    missed = [r for r in rs if r["ranked"] and not r["all"]]
    return {
        "questions": len(rs), "recall_all": share("all", rs),
        "ranking_within_memory_tokens": share("ranked", rs),
        "ranking_within_new_memory_tokens": share("ranked_new", rs),
        "memory_tokens_mean": mean("memory", rs), "new_memory_tokens_mean": mean("new", rs),
        "request_tokens_mean": mean("request", rs),
        "first": {"questions": len(first), "recall_all": share("all", first),
                  "ranking_within_memory_tokens": share("ranked", first),
                  "memory_tokens_mean": mean("memory", first)},
        "made": dict(Counter(r["made"] for r in rs)),
        "by_made": {m: {"questions": len(sub), "recall_all": share("all", sub),
                        "ranking_within_memory_tokens": share("ranked", sub),
                        "memory_tokens_mean": mean("memory", sub)}
                    for m in sorted({r["made"] for r in rs})
                    for sub in [[r for r in rs if r["made"] == m]]},
        "ranking_holds_request_misses": dict(Counter(r["made"] for r in missed)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", choices=sorted(ev.DATASETS))
    p.add_argument("path", type=Path)
    p.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    args = p.parse_args()
    print(json.dumps(run(args.dataset, args.path, args.limit), indent=2))


if __name__ == "__main__":
    main()
