#!/usr/bin/env python3
"""LoCoMo retrieval quality: recall of the labelled evidence turns, per ranking variant.

    scripts/eval_retrieval.py [--data ../shared/data] [--variants a,b] [--out FILE]

Every LoCoMo conversation is imported through the real write path (one user per conversation)
and each question (categories 1-4; category 5 is adversarial and has no evidence to find) ranks
the turns of its own conversation. Reported per variant, as JSON:
  recall@k          mean fraction of a question's evidence turns in the top k (k = 5, 10, 20, 50)
  recall_all@k      fraction of questions with every evidence turn in the top k
  recall@2k/4k/8k   the same with a budget of tokens instead of a count of turns: turns are taken
  recall_all@...    in rank order while their tokens (4 characters a token) fit in the budget
Variants: the scan with its BM25 parameters (k1, b) and conversational-context weights (see
bm25.Params), with and without the speaker's name in the row text, and with a date the question
names ranking the turns said then first (frame.search, as the frame ranks); SQLite FTS5 (porter
unicode61, OR query ranked by bm25()) and bm25s (Lucene BM25, English stop words) on the same
turns (speaker names included) and questions.

Also reported, once: how many questions have an evidence turn that shares no indexed word
with the question (stems, stop words and the speakers' names left out). No lexical score
ranks such a turn; it reaches a frame only beside a turn that does.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.frame import build as frame  # noqa: E402
from perpetuity_core.memory.derived import bm25, index, scan  # noqa: E402
from perpetuity_core.memory.jobs import importers  # noqa: E402
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import dictionary  # noqa: E402
from perpetuity_core.memory.storage.store import Store  # noqa: E402

KS = (5, 10, 20, 50)
BUDGETS = (2000, 4000, 8000)


class Conv:
    """One LoCoMo conversation as the evaluation sees it."""

    def __init__(self, sample: dict, thread: importers.Thread, ids: list[int],
                 user_id: int) -> None:
        self.sample = sample
        self.labels = thread.labels  # dia_id per turn, in order
        self.texts = [m.parts[0].text for m in thread.messages]
        self.item_of = dict(zip(thread.labels, ids, strict=True))  # one item per turn
        self.turn_of_item = {i: n for n, i in enumerate(ids)}
        self.tokens = np.array([index.token_estimate(t) for t in self.texts])
        self.user_id = user_id
        self.asked_at = max(thread.times) + 86400  # as `perpetuity eval` asks: a day later
        self.questions = []
        for qa in sample["qa"]:
            if qa.get("category") == 5:
                continue
            ev = [e for x in qa.get("evidence", []) for e in re.split(r"[;,\s]+", x) if e]
            ev = sorted({self.labels.index(e) for e in ev if e in self.item_of})
            if ev:
                self.questions.append((qa["question"], ev))


def load(data: Path, speaker_prefix: bool, db_dir: Path) -> tuple[Store, list[Conv]]:
    samples = json.loads((data / "locomo" / "locomo10.json").read_text())
    # A fresh file every time: re-importing into an old one would skip every message.
    store = open_memory(Path(tempfile.mkstemp(".db", f"locomo-{int(speaker_prefix)}-", db_dir)[1]))
    convs = []
    for sample, thread in zip(samples, importers.locomo(data / "locomo" / "locomo10.json",
                                                        speaker_prefix=speaker_prefix),
                              strict=True):
        msg_ids = importers.write(store, thread)
        conn = sqlite3.connect(store.path)
        item_ids = [r[0] for r in conn.execute(
            f"SELECT id FROM item WHERE message_id IN ({','.join('?' * len(msg_ids))})"
            " ORDER BY message_id", msg_ids)]
        (uid,) = conn.execute("SELECT id FROM user WHERE key = ?", (thread.user_key,)).fetchone()
        conn.close()
        convs.append(Conv(sample, thread, item_ids, uid))
    return store, convs


def metrics(rankings: list[tuple[Conv, list[int], list[int]]]) -> dict:
    """rankings: (conversation, ranked turn indexes, evidence turn indexes) per question."""
    out: dict[str, float] = {}
    rec = {k: [] for k in KS}
    rec_all = {k: [] for k in KS}
    brec = {b: [] for b in BUDGETS}
    brec_all = {b: [] for b in BUDGETS}
    for conv, ranked, ev in rankings:
        pos = {t: r for r, t in enumerate(ranked)}
        rank = np.array([pos.get(e, 10**9) for e in ev])
        for k in KS:
            rec[k].append(np.mean(rank < k))
            rec_all[k].append(np.all(rank < k))
        cum = np.cumsum(conv.tokens[ranked]) if ranked else np.zeros(0)
        for b in BUDGETS:
            fits = int(np.searchsorted(cum, b, side="right"))  # turns fitting in the budget
            brec[b].append(np.mean(rank < fits))
            brec_all[b].append(np.all(rank < fits))
    for k in KS:
        out[f"recall@{k}"] = round(float(np.mean(rec[k])), 4)
        out[f"recall_all@{k}"] = round(float(np.mean(rec_all[k])), 4)
    for b in BUDGETS:
        out[f"recall@{b // 1000}k"] = round(float(np.mean(brec[b])), 4)
        out[f"recall_all@{b // 1000}k"] = round(float(np.mean(brec_all[b])), 4)
    out["questions"] = len(rankings)
    return out


def scan_rankings(store: Store, convs: list[Conv], params: bm25.Params) -> list:
    sc = scan.Scanner(store, params=params, store_rows=0)
    out = []
    for conv in convs:
        for q, ev in conv.questions:
            hits = sc.search(q, conv.user_id, limit=len(conv.labels))
            turns = [conv.turn_of_item[h.item_id] for h in hits]
            out.append((conv, _complete(turns, len(conv.labels)), ev))
    return out


def dated_rankings(store: Store, convs: list[Conv]) -> list:
    """The shipped scan, with the turns said on a date the question names ranked first."""
    sc = scan.Scanner(store, store_rows=0)
    out = []
    for conv in convs:
        for q, ev in conv.questions:
            hits = frame.search(sc, q, conv.user_id, conv.asked_at, limit=len(conv.labels))
            turns = [conv.turn_of_item[h.item_id] for h in hits]
            out.append((conv, _complete(turns, len(conv.labels)), ev))
    return out


def unreachable(convs: list[Conv]) -> dict[str, int]:
    """Questions with an evidence turn sharing no indexed word with the question."""
    d = dictionary.shipped()
    n = 0
    for conv in convs:
        names = set(d.id_list(" ".join({t.split(":", 1)[0] for t in conv.texts})))
        for q, ev in conv.questions:
            words = set(d.id_list(q)) - names
            n += any(not words & set(d.id_list(conv.texts[e].split(":", 1)[-1])) for e in ev)
    return {"questions": sum(len(c.questions) for c in convs),
            "with_an_evidence_turn_sharing_no_word_with_the_question": n}


def phrase_rankings(store: Store, convs: list[Conv], weight: float) -> list:
    """Experiment (not in the engine): the shipped score plus `weight` times a BM25 over the
    pairs of adjacent indexed words (a phrase bonus), with the same conversational context."""
    from collections import Counter

    d = store.db.dictionary
    p = bm25.Params()

    def pairs(text: str) -> Counter:
        ids = d.id_list(text)
        return Counter(zip(ids, ids[1:], strict=False))

    bags = [[pairs(t) for t in conv.texts] for conv in convs]
    df: Counter = Counter()
    for bb in bags:
        for b in bb:
            df.update(b.keys())
    n = sum(len(bb) for bb in bags)
    avgdl = sum(sum(b.values()) for bb in bags for b in bb) / n
    sc = scan.Scanner(store, store_rows=0)
    out = []
    for conv, bb in zip(convs, bags, strict=True):
        lengths = np.array([sum(b.values()) for b in bb], float)
        for q, ev in conv.questions:
            s = np.zeros(len(conv.labels))
            hits = sc.search(q, conv.user_id, limit=len(conv.labels))
            s[[conv.turn_of_item[h.item_id] for h in hits]] = [h.score for h in hits]
            bonus = np.zeros_like(s)
            for t in pairs(q):
                tf = np.array([b.get(t, 0) for b in bb], float)
                if df[t]:
                    w = np.log1p((n - df[t] + 0.5) / (df[t] + 0.5)) * (p.k1 + 1)
                    bonus += w * tf / (tf + p.k1 * (1 - p.b + p.b * lengths / avgdl))
            ctx = bonus.copy()
            for i, w in enumerate(p.before, 1):
                ctx[i:] += w * bonus[:-i]
            for i, w in enumerate(p.after, 1):
                ctx[:-i] += w * bonus[i:]
            s2 = s + weight * ctx
            turns = [int(t) for t in np.lexsort((np.arange(s2.size), -s2)) if s2[t] > 0]
            out.append((conv, _complete(turns, len(conv.labels)), ev))
    return out


def _complete(turns: list[int], n: int) -> list[int]:
    """Turns that scored zero follow in conversation order, as for every ranking here."""
    seen = set(turns)
    return turns + [t for t in range(n) if t not in seen]


def fts5_rankings(convs: list[Conv]) -> list:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(text, conv UNINDEXED, turn UNINDEXED,"
                 " tokenize = 'porter unicode61')")
    for c, conv in enumerate(convs):
        conn.executemany("INSERT INTO t (text, conv, turn) VALUES (?, ?, ?)",
                         [(t, c, i) for i, t in enumerate(conv.texts)])
    out = []
    for c, conv in enumerate(convs):
        for q, ev in conv.questions:
            words = re.findall(r"\w+", q)
            if not words:
                out.append((conv, _complete([], len(conv.labels)), ev))
                continue
            match = " OR ".join(f'"{w}"' for w in words)
            rows = conn.execute("SELECT turn FROM t WHERE t MATCH ? AND conv = ?"
                                " ORDER BY bm25(t), rowid", (match, c)).fetchall()
            out.append((conv, _complete([r[0] for r in rows], len(conv.labels)), ev))
    return out


def bm25s_rankings(convs: list[Conv]) -> list:
    import bm25s

    out = []
    for conv in convs:
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize(conv.texts, stopwords="en", show_progress=False),
                        show_progress=False)
        for q, ev in conv.questions:
            qt = bm25s.tokenize([q], stopwords="en", show_progress=False)
            try:
                docs, scores = retriever.retrieve(qt, k=len(conv.texts), show_progress=False)
            except ValueError:  # a question made only of stop words
                out.append((conv, _complete([], len(conv.labels)), ev))
                continue
            turns = [int(d) for d, s in zip(docs[0], scores[0], strict=True) if s > 0]
            out.append((conv, _complete(turns, len(conv.labels)), ev))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    data = Path(args.data)
    if not (data / "locomo" / "locomo10.json").is_file():
        print(f"no LoCoMo data at {data}/locomo/locomo10.json", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="perpetuity-eval-"))
    stores: dict[bool, tuple[Store, list[Conv]]] = {}

    def memory(prefix: bool) -> tuple[Store, list[Conv]]:
        if prefix not in stores:
            if stores:  # the store's database is process-global: one open at a time
                next(iter(stores.values()))[0].close()
                stores.clear()
            stores[prefix] = load(data, prefix, tmp)
        return stores[prefix]

    def ranked_by(params: bm25.Params, prefix: bool = True) -> Callable:
        return lambda: scan_rankings(*memory(prefix), params)

    P = bm25.Params
    variants: dict[str, Callable[[], list]] = {
        "scan shipped: bm25 k1=0.9 b=0.4 + context before .5/.3/.2 after .3/.2/.1":
            ranked_by(P()),
        "scan bm25 k1=1.2 b=0.75 + context": ranked_by(P(1.2, 0.75)),
        "scan plain bm25 k1=1.2 b=0.75": ranked_by(P(1.2, 0.75, (), ())),
        "scan plain bm25 k1=1.2 b=0.75, no speaker name in rows":
            ranked_by(P(1.2, 0.75, (), ()), False),
        "scan shipped, no speaker name in rows": ranked_by(P(), False),
        "scan shipped + a named date's turns first": lambda: dated_rankings(*memory(True)),
        "scan plain bm25 k1=1.2 b=0.3": ranked_by(P(1.2, 0.3, (), ())),
        "scan plain bm25 k1=2.0 b=0.75": ranked_by(P(2.0, 0.75, (), ())),
        "scan bm25 k1=0.9 b=0.4 plain": ranked_by(P(before=(), after=())),
        "scan bm25 k1=0.9 b=0.4 + context 1 turn each side .3/.3":
            ranked_by(P(before=(0.3,), after=(0.3,))),
        "scan bm25 k1=0.9 b=0.4 + context .4/.2 each side":
            ranked_by(P(before=(0.4, 0.2), after=(0.4, 0.2))),
        "scan bm25 k1=0.9 b=0.4 + context before .5/.3/.2 only": ranked_by(P(after=())),
        "scan bm25 k1=0.9 b=0.4 + context before .6/.4/.3/.2 after .3/.2/.1":
            ranked_by(P(before=(0.6, 0.4, 0.3, 0.2))),
        "experiment: shipped + phrase bonus (adjacent word pairs) x0.6":
            lambda: phrase_rankings(*memory(True), 0.6),
        "sqlite fts5 porter unicode61, OR, bm25()": lambda: fts5_rankings(memory(True)[1]),
        "bm25s (lucene, en stop words)": lambda: bm25s_rankings(memory(True)[1]),
    }
    wanted = [v for v in args.variants.split(",") if v] or list(variants)
    report: dict[str, dict] = {"lexical reach": unreachable(memory(True)[1])}
    for name in variants:
        if not any(w in name for w in wanted):
            continue
        t0 = time.perf_counter()
        report[name] = metrics(variants[name]())
        report[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"{name}: {report[name]}", file=sys.stderr)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
