"""Where a dataset's evidence turns stand in the chat's ranking, counted. Prints JSON.

Each conversation is fed as `perpetuity eval` feeds it (its own memory), then every question
is asked alone as a chat's frame searches it (frame.read.search), its top rows taken while
they fit 4,000 tokens (as `perpetuity eval` measures the ranking). Each evidence turn is
counted by who said it, its length, whether it shares a dictionary term (a stemmed word) with
the question, and whether it was within those tokens; questions by the dataset's category.
The counts behind docs/tuning.md's "A chat's hits per token".

    .venv/bin/python scripts/evidence_counts.py beam ../shared/data/beam-100k [--limit N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from perpetuity_core.cli import eval as ev
from perpetuity_core.frame import read as frame_read
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider

BUDGET = ev.RANKING_TOKENS
LENGTHS = (50, 150, 400, 800)  # the length buckets' upper bounds, in tokens


def bucket(tokens: int) -> str:
    low = 0
    for high in LENGTHS:
        if tokens < high:
            return f"{low}-{high}"
        low = high
    return f"{low}+"


def share(turns: list[dict[str, Any]]) -> dict[str, Any]:
    return {"turns": len(turns),
            "within": round(sum(t["within"] for t in turns) / max(len(turns), 1), 3),
            "median_tokens": statistics.median(t["tokens"] for t in turns) if turns else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset", choices=sorted(ev.DATASETS))
    ap.add_argument("path", type=Path)
    ap.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    args = ap.parse_args()
    cases = list(ev.DATASETS[args.dataset](args.path))[: args.limit or None]
    turns: list[dict[str, Any]] = []
    questions: dict[str, list[bool]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for n, case in enumerate(cases):
            store = open_memory(Path(tmp) / f"memory-{n}.db")
            pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                                trust_identity=True))
            ev.feed(pipeline, case.thread)
            uid = store.find_user(case.thread.user_key)
            d = store.db.dictionary
            for q in case.questions:
                hits = frame_read.search(pipeline.scanner, q.text, uid or 0, q.at,
                                         limit=ev.RANKING_DEPTH)
                taken, used = [], 0
                for h in hits:
                    if used + (cost := token_estimate(h.text)) <= BUDGET:
                        taken.append(h.text)
                        used += cost
                text = "\n".join(taken)
                asked = set(d.id_list(q.text))
                mine = []
                for i in q.evidence:
                    m = case.thread.messages[i]
                    mine.append({"role": m.role, "tokens": token_estimate(m.text),
                                 "shared": bool(asked & set(d.id_list(m.text))),
                                 "within": m.text in text, "category": q.category})
                turns += mine
                questions[q.category].append(all(t["within"] for t in mine))
            store.close()

    def split(key: str) -> dict[str, Any]:
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for t in turns:
            groups[str(t[key])].append(t)
        return {k: share(v) for k, v in sorted(groups.items())}

    for t in turns:
        t["length"] = bucket(t["tokens"])
    held = [x for v in questions.values() for x in v]
    print(json.dumps({
        "questions": len(held), f"recall_all_within_{BUDGET}": round(sum(held) / len(held), 4),
        "by_category": {c: {"questions": len(v), "recall_all": round(sum(v) / len(v), 3)}
                        | share([t for t in turns if t["category"] == c])
                        for c, v in sorted(questions.items())},
        "evidence": share(turns), "by_role": split("role"),
        "by_shared_word": split("shared"), "by_length": split("length")}, indent=1))


if __name__ == "__main__":
    main()
