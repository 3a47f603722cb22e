"""Tool-round overhead: from the model's call to one of our tools to the next upstream request.

Builds a memory of about --tokens tokens (the BEAM chats in ../shared/data, replicated with
distinct users, through the real write path), then for --calls real BEAM questions times what
the proxy does between a tool call and the next upstream request: run the tool, then build the
next round's body (the call and its result appended, our tools added). Prints JSON: p50/p99 per
tool and over all.

    .venv/bin/python scripts/bench_tools.py [--tokens 10000000] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.recall import answers, tools
from perpetuity_core.wire.protocols import anthropic

CALLS = ("memory_search", "memory_dates", "memory_count", "memory_cooccur", "memory_chains")


def build(store: Store, beam: Path, tokens: int) -> tuple[int, list[int], float]:
    """Fill the store to `tokens`; returns the tokens stored, the user ids, the seconds taken."""
    threads = list(importers.beam(beam))
    stored, users, started, copy = 0, [], time.monotonic(), 0
    while stored < tokens:
        for t in threads:
            t.user_key = f"{t.user_key}#{copy}"
            t.conversation_key = f"{t.conversation_key}#{copy}"
            importers.write(store, t)
            users.append(store.find_user(t.user_key))
            stored += sum(token_estimate(m.text) for m in t.messages)
            print(f"\r{stored / 1e6:.1f}M tokens", end="", file=sys.stderr, flush=True)
            t.user_key, t.conversation_key = t.user_key.rsplit("#", 1)[0], t.conversation_key.rsplit("#", 1)[0]
            if stored >= tokens:
                break
        copy += 1
    print(file=sys.stderr)
    return stored, users, time.monotonic() - started


def questions(beam: Path) -> list[str]:
    out = []
    for f in sorted(beam.rglob("probing_questions.json")):
        for items in json.loads(f.read_text()).values():
            out += [str(q["question"]) for q in items]
    return out


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=here.parent / "shared/data/beam-100k")
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        store = open_memory(Path(tmp) / "memory.db")
        stored, users, seconds = build(store, args.data, args.tokens)
        scanner = Scanner(store)
        qs = questions(args.data)
        body = {"model": "claude-opus-4-8", "max_tokens": 1000,
                "messages": [{"role": "user", "content": "question"}]}
        specs = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
                 for t in tools.TOOLS]
        start = time.monotonic()
        scanner.search("warm up the arena", users[0], 1)
        catch_up = time.monotonic() - start
        timings: dict[str, list[float]] = {name: [] for name in CALLS}
        for n in range(args.calls):
            name = CALLS[n % len(CALLS)]
            q = rng.choice(qs)
            memory = answers.TurnMemory(rng.choice(users), None, time.time())
            arguments = {"query": q} if name not in ("memory_cooccur", "memory_chains") else (
                {"topic": q} if name == "memory_cooccur" else {"subject": q})
            if name == "memory_count":
                arguments = {"category": q}
            t0 = time.perf_counter()
            result = tools.run(name, arguments, memory, scanner)
            nxt = anthropic.continue_body(body, [{"type": "tool_use", "id": "t", "name": name,
                                                  "input": arguments}], [("t", result)])
            json.dumps(anthropic.add_tools(nxt, specs, False))
            timings[name].append((time.perf_counter() - t0) * 1000)
        store.close()
    every = np.concatenate([np.asarray(v) for v in timings.values()])
    print(json.dumps({
        "memory_tokens": stored, "users": len(users), "ingest_seconds": round(seconds, 1),
        "first_search_catch_up_s": round(catch_up, 2), "calls": int(every.size),
        "all_ms": {"p50": round(float(np.median(every)), 2),
                   "p99": round(float(np.percentile(every, 99)), 2)},
        "per_tool_ms": {k: {"p50": round(float(np.median(v)), 2),
                            "p99": round(float(np.percentile(v, 99)), 2)}
                        for k, v in timings.items() if v},
    }, indent=2))


if __name__ == "__main__":
    main()
