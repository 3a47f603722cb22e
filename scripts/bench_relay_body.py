"""What building the tool loop's first round (the request's JSON read, our tools added, written
again) costs: the event loop's time per relayed request before `pipeline._first_round` moved it
to the preparing thread (the relay now sends those bytes as they are). Over the shared Claude
Code captures' largest request bodies. Prints JSON.

    .venv/bin/python scripts/bench_relay_body.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core.recall import tools
from perpetuity_core.wire.protocols import anthropic

CAPTURES = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "harness" / "claude-code"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    files = sorted((f for f in CAPTURES.glob("*.json") if not f.name.endswith(".response.json")),
                   key=lambda f: -f.stat().st_size)[:3]
    specs = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
             for t in tools.TOOLS]
    out: dict[str, object] = {}
    for f in files:
        body = json.dumps(json.loads(f.read_text())["body"], ensure_ascii=False).encode()
        ms = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            json.dumps(anthropic.add_tools(json.loads(body), specs, False)).encode()
            ms.append((time.perf_counter() - t0) * 1000)
        out[f.name] = {"body_bytes": len(body), "first_round_ms_p50": round(statistics.median(ms), 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
