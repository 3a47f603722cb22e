"""Why a dataset's questions in sequence miss their evidence: each missed question's evidence
turns and what its frame spent its tokens on instead, counted. Prints JSON.

The questions are asked as `perpetuity eval DATASET PATH --sequence [--personal]` asks them (the
same in-process path, each question's frame recorded by wrapping `frame_select.frame`). For each
question: does the request hold every evidence turn (the frame), does the ranking within 4,000
tokens; per BEAM / LoCoMo category. For the questions the frame missed: how many evidence turns
they need, each turn's speaker, tokens and rank in the question's ranking (`frame.search`, read to
`eval.RANKING_DEPTH`), whether it shares a dictionary term (a stemmed word) with the question, and
the frame's tokens by what held them (the top hit and its other half, the latest stretch, hits
ranked above the first evidence turn missed, hits below it, the hits' neighbours, rows carried
warm from earlier questions; long replies among them). The counts behind docs/tuning.md's
"BEAM's misses, one by one".

    .venv/bin/python scripts/frame_misses.py beam ../shared/data/beam-100k [--personal] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from perpetuity_core.cli import eval as ev
from perpetuity_core.frame import build as frame
from perpetuity_core.frame import select as frame_select
from perpetuity_core.frame.render import cost
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.storage.reads import shown_rows
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.wire.identity import PERSONAL

OPENING = 300  # the characters of a reply's opening looked at for the question's words
LONG = 400  # a reply this long or longer is "long" (BEAM's assistant evidence: a median of 906)
_state: dict[str, Any] = {}
records: list[dict[str, Any]] = []


def _record_reheats(reheats: Any, hits: Any) -> Any:
    _state["reheats"], _state["hits"] = dict(reheats), [h.item_id for h in hits]
    return _fill_reheats(reheats, hits)


def _record_frame(rows: Any, warm: Any, hits: Any, *a: Any, **k: Any) -> Any:
    chosen = _frame(rows, warm, hits, *a, **k)
    _state["frame"] = (rows, set(warm.item_ids.tolist()), chosen)
    return chosen


def _record_prepare(self: Pipeline, req: Any) -> Any:
    d = _prepare(self, req)
    if d.body is not None:
        body = json.loads(d.body)
        _state["request"] = "\n".join(str(m.get("content", "")) for m in body["messages"])
    return d


def _record_ranking(pipeline: Pipeline, user: str, query: str, at: float,
                    budgets: tuple[int, ...], evidence: list[str]) -> tuple[bool, ...]:
    held = _ranking_holds(pipeline, user, query, at, budgets, evidence)
    user_id = pipeline.store.find_user(PERSONAL if pipeline.settings.personal else user) or 0
    hits = frame.search(pipeline.scanner, query, user_id, at, limit=ev.RANKING_DEPTH)
    ranked = shown_rows(pipeline.store.db, [h.item_id for h in hits])
    by_text = {}
    for n, h in enumerate(hits):
        if (r := ranked.get(h.item_id)) is not None:
            by_text.setdefault(r.text, (n + 1, h.item_id))
    d = pipeline.store.db.dictionary
    asked = set(d.id_list(query))
    request = _state.pop("request", "")
    rows, warm, chosen = _state.pop("frame", ({}, set(), None))
    reheats, hit_ids = _state.pop("reheats", {}), _state.pop("hits", [])
    turns = []
    for e in evidence:
        rank, item = by_text.get(e, (None, None))
        r = ranked.get(item) if item is not None else None
        turns.append({"rank": rank, "tokens": token_estimate(e), "in_request": e in request,
                      "role": r.role if r is not None else "?",
                      "shared": bool(asked & set(d.id_list(e)))})
    rec: dict[str, Any] = {"query": query, "user": user, "frame_all": all(t["in_request"] for t in turns),
                           "ranking_all": held[-1], "turns": turns}
    if chosen is not None:
        # The top hit's other half, always whole: its tokens and whether it is evidence.
        half = [i for i, why in chosen.must.items() if why == frame_select.MUST_HALF]
        rec["half_tokens"] = sum(cost(rows[i]) for i in half)
        rec["half_evidence"] = any(rows[i].text in evidence for i in half)
        rec["half_role"] = rows[half[0]].role if half else ""
        opening = " ".join(rows[i].text[:OPENING] for i in half)
        rec["half_opening_shares"] = bool(asked & set(d.id_list(opening)))
        ranks = [hit_ids.index(i) + 1 for i in half if i in hit_ids]
        rec["half_rank"] = min(ranks) if ranks else None
    if chosen is not None and not rec["frame_all"]:
        missed = [t["rank"] for t in turns if not t["in_request"] and t["rank"] is not None]
        cut = min(missed) if missed else 10**9
        hit_rank = {i: n + 1 for n, i in enumerate(hit_ids)}
        spent: Counter[str] = Counter()
        long_replies = 0
        for i in chosen.item_ids:
            row = chosen.excerpts.get(i) or rows[i]
            c = cost(row)
            if row.text in evidence:
                kind = "evidence"
            elif i in chosen.must:
                kind = "top hit and its other half" if i not in chosen.recent else "latest stretch"
            elif i in hit_rank:
                kind = "hits ranked above the missed turn" if hit_rank[i] < cut else \
                    "hits ranked below the missed turn"
            elif i in reheats:
                kind = "neighbours"
            elif i in warm:
                kind = "carried"
            else:
                kind = "other"
            spent[kind] += c
            if row.role == "assistant" and c >= LONG and kind != "evidence":
                spent["long replies (any kind above)"] += c
                long_replies += 1
        rec["spent"] = dict(spent)
        rec["long_replies"] = long_replies
        rec["frame_tokens"] = sum(cost(chosen.excerpts.get(i) or rows[i]) for i in chosen.item_ids)
    records.append(rec)
    return held


_fill_reheats, _frame = frame_select.fill_reheats, frame_select.frame
_prepare, _ranking_holds = Pipeline.prepare, ev.ranking_holds


def classify(rec: dict[str, Any]) -> str:
    """The miss's class, by its evidence turns the request did not hold."""
    out = [t for t in rec["turns"] if not t["in_request"]]
    if any(t["rank"] is None for t in out):
        return "a missed turn not in the ranking's 2,000 rows"
    if any(t["role"] == "assistant" and t["tokens"] >= LONG for t in out):
        return "a missed turn is a long reply"
    if sum(t["tokens"] for t in rec["turns"]) > 4_000:
        return "the evidence alone passes 4,000 tokens"
    deepest = max(t["rank"] for t in out)
    if deepest <= 60:
        return "every missed turn ranked in the top 60"
    if deepest <= 200:
        return "a missed turn ranked 61st to 200th"
    return "a missed turn ranked below the 200th"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dataset", choices=sorted(ev.DATASETS))
    ap.add_argument("path", type=Path)
    ap.add_argument("--personal", action="store_true")
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args()
    frame_select.fill_reheats = _record_reheats
    frame_select.frame = _record_frame
    Pipeline.prepare = _record_prepare  # type: ignore[method-assign]
    ev.ranking_holds = _record_ranking
    cases = list(ev.DATASETS[args.dataset](args.path))[: args.limit or None]
    category = {(c.thread.user_key, q.text): q.category for c in cases for q in c.questions}
    report = ev.evaluate(args.dataset, args.path, limit=args.limit, sequence=True,
                         personal=args.personal, progress=False)
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        by_cat[category.get((rec["user"], rec["query"]), "")].append(rec)
    missed = [r for r in records if not r["frame_all"]]
    turns = [t for r in missed for t in r["turns"]]
    lost = [t for t in turns if not t["in_request"]]

    def turn_counts(ts: list[dict[str, Any]]) -> dict[str, Any]:
        ranks = [t["rank"] for t in ts if t["rank"] is not None]
        return {"turns": len(ts),
                "user": sum(t["role"] == "user" for t in ts),
                "assistant": sum(t["role"] == "assistant" for t in ts),
                "median_tokens_user": statistics.median([t["tokens"] for t in ts
                                                         if t["role"] == "user"] or [0]),
                "median_tokens_assistant": statistics.median([t["tokens"] for t in ts
                                                              if t["role"] == "assistant"] or [0]),
                "sharing_a_stem": sum(t["shared"] for t in ts),
                "median_rank": statistics.median(ranks) if ranks else None,
                "rank_top60": sum(r <= 60 for r in ranks),
                "rank_61_200": sum(60 < r <= 200 for r in ranks),
                "rank_below_200": sum(r > 200 for r in ranks),
                "not_ranked": sum(t["rank"] is None for t in ts)}

    spent: Counter[str] = Counter()
    for r in missed:
        spent.update(r.get("spent", {}))
    print(json.dumps({
        "recall_all": report["sequence"]["recall_all"],
        "request_tokens_mean": report["sequence"]["request_tokens_mean"],
        "by_category": {c: {"questions": len(rs),
                            "frame": round(sum(r["frame_all"] for r in rs) / len(rs), 4),
                            "ranking_4000": round(sum(r["ranking_all"] for r in rs) / len(rs), 4),
                            "missed": sum(not r["frame_all"] for r in rs),
                            "evidence_a_question": round(statistics.mean(
                                len(r["turns"]) for r in rs), 2)}
                        for c, rs in sorted(by_cat.items())},
        "missed_questions": len(missed),
        "missed_evidence_a_question": round(statistics.mean([len(r["turns"]) for r in missed]
                                                            or [0]), 2),
        "evidence_of_missed": turn_counts(turns),
        "evidence_missed": turn_counts(lost),
        "frame_tokens_of_missed_mean": round(statistics.mean(
            [r.get("frame_tokens", 0) for r in missed] or [0])),
        "spent_of_missed_mean": {k: round(v / max(len(missed), 1)) for k, v in spent.most_common()},
        "long_replies_a_missed_frame": round(statistics.mean(
            [r.get("long_replies", 0) for r in missed] or [0]), 2),
        "top_hits_other_half": {
            "frames": sum("half_tokens" in r for r in records),
            "long": sum(r.get("half_tokens", 0) >= LONG for r in records),
            "long_tokens_mean": round(statistics.mean([r["half_tokens"] for r in records
                                                       if r.get("half_tokens", 0) >= LONG] or [0])),
            "long_and_evidence": sum(r.get("half_tokens", 0) >= LONG and r["half_evidence"]
                                     for r in records),
            "long_in_missed_frames": sum(r.get("half_tokens", 0) >= LONG for r in missed),
            "long_opening_shares_a_stem": sum(r.get("half_tokens", 0) >= LONG
                                              and r["half_opening_shares"] for r in records),
            "long_evidence_opening_shares_a_stem": sum(
                r.get("half_tokens", 0) >= LONG and r["half_evidence"]
                and r["half_opening_shares"] for r in records)},
        "classes": dict(Counter(map(classify, missed)).most_common()),
    }, indent=1))


if __name__ == "__main__":
    main()
