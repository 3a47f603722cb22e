"""The `perpetuity eval` command: the evidence in the frame (eval.py), in the frame and a scripted
reader's recall rounds (eval_reader.py), or a real model's answers graded by a judge
(eval_online.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from perpetuity_core.cli import eval as frame_eval
from perpetuity_core.cli import eval_online, eval_reader
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.cap import Cap


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="is the evidence in the frame? (LoCoMo, BEAM, LongMemEval)",
                       description=f"{frame_eval.__doc__}\n{eval_reader.__doc__}\n"
                                   f"{eval_online.__doc__}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", choices=sorted(frame_eval.DATASETS))
    p.add_argument("path", type=Path,
                   help="locomo10.json, a BEAM chats folder, a LongMemEval file")
    p.add_argument("--pooled", action="store_true", help="one memory of every conversation")
    p.add_argument("--personal", action="store_true",
                   help="one memory of every conversation, all one person's (the loopback"
                        " default, --tenants personal)")
    p.add_argument("--floor", type=int, default=Cap().floor, help="smallest frame, in tokens")
    p.add_argument("--ceiling", type=int, default=Cap().ceiling, help="largest frame, in tokens")
    p.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    p.add_argument("--frames", type=Path,
                   help="write every rendered request to this folder")
    p.add_argument("--sequence", action="store_true",
                   help="ask each conversation's questions one after another in one conversation")
    p.add_argument("--switch", type=int, default=0, metavar="N",
                   help="with --sequence --personal: one chat asks every conversation's"
                        " questions, N of each in turn")
    p.add_argument("--reader", choices=["search"],
                   help="a scripted reader in the model's place, through the relay's tool loop:"
                        " recall after the frame, one and two tool rounds (in sequence)")
    p.add_argument("--second", choices=eval_reader.SECOND_MOVES, default="rare",
                   help="the scripted reader's second round")
    p.add_argument("--json", action="store_true", help="the reader's report as JSON")
    p.add_argument("--semantic", choices=["on", "off", "both"], default="on",
                   help="the scan's semantic half (docs/semantic.md); both: the report with it"
                        " and without, side by side")
    online = p.add_argument_group("online", "a real model answers, a judge model grades")
    online.add_argument("--online", action="store_true",
                        help="answer each question with --model through memory, graded by --judge")
    online.add_argument("--model", help="the model that answers (e.g. gpt-4o-mini)")
    online.add_argument("--judge", help="the model that grades (e.g. gpt-4o)")
    online.add_argument("--base-url", default=eval_online.BASE_URL,
                        help="an OpenAI-compatible endpoint, without /v1")
    online.add_argument("--key-env", default="OPENAI_API_KEY",
                        help="the environment variable holding the key")
    online.add_argument("--cache", type=Path,
                        help="answers and verdicts kept here, read back to resume"
                             " (default perpetuity-eval-DATASET-MODEL.jsonl)")
    online.add_argument("--price", type=float, nargs=2, metavar=("IN", "OUT"),
                        help="the model's dollars a million input and output tokens")
    online.add_argument("--judge-price", type=float, nargs=2, metavar=("IN", "OUT"),
                        help="the judge's dollars a million input and output tokens")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.path.exists():
        raise ConfigError(f"no such dataset path: {args.path}")
    limits = Cap(args.floor, args.ceiling)
    if args.online:
        if not args.model or not args.judge:
            raise ConfigError("--online needs --model and --judge")
        found = eval_online.evaluate(
            args.dataset, args.path, model=args.model, judge=args.judge,
            key=eval_online.api_key(args.key_env), base_url=args.base_url, cache=args.cache,
            limits=limits, limit=args.limit, price=tuple(args.price) if args.price else None,
            judge_price=tuple(args.judge_price) if args.judge_price else None)
        print(json.dumps(found, indent=2))
        return 0
    sides = {"on": [True], "off": [False], "both": [True, False]}[args.semantic]
    if args.reader:
        for semantic in sides:
            found = eval_reader.evaluate(args.dataset, args.path, second=args.second,
                                         pooled=args.pooled, limits=limits, limit=args.limit,
                                         semantic=semantic)
            if len(sides) > 1 and not args.json:
                print(f"semantic half {'on' if semantic else 'off'}:")
            print(json.dumps(found, indent=2) if args.json else eval_reader.table(found))
        return 0
    reports = [frame_eval.evaluate(args.dataset, args.path, pooled=args.pooled, limits=limits,
                                   frames=args.frames, limit=args.limit,
                                   sequence=args.sequence, personal=args.personal,
                                   semantic=semantic, switch=args.switch)
               for semantic in sides]
    print(json.dumps(reports[0] if len(reports) == 1 else side_by_side(*reports), indent=2))
    return 0


def side_by_side(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """Two reports, the semantic half on and off, with each headline figure as [on, off]."""
    def pair(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in a.items():
            if isinstance(value, dict) and isinstance(b.get(key), dict):
                out[key] = pair(value, b[key])
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = [value, b.get(key)]
        return out

    return {"semantic [on, off]": pair(on, off), "semantic on": on, "semantic off": off}
