"""The `perpetuity eval` command: the evidence in the frame (eval.py), in the frame and a scripted
reader's recall rounds (eval_reader.py), or a real model's answers graded by a judge
(eval_online.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from perpetuity_core.cli import eval as frame_eval
from perpetuity_core.cli import eval_reader
from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.cap import Cap


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="is the evidence in the frame? (LoCoMo, BEAM, LongMemEval)",
                       description=f"{frame_eval.__doc__}\n{eval_reader.__doc__}",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", choices=sorted(frame_eval.DATASETS))
    p.add_argument("path", type=Path,
                   help="locomo10.json, a BEAM chats folder, a LongMemEval file")
    p.add_argument("--pooled", action="store_true", help="one memory of every conversation")
    p.add_argument("--floor", type=int, default=Cap().floor, help="smallest frame, in tokens")
    p.add_argument("--ceiling", type=int, default=Cap().ceiling, help="largest frame, in tokens")
    p.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    p.add_argument("--frames", type=Path,
                   help="write every rendered request to this folder")
    p.add_argument("--sequence", action="store_true",
                   help="ask each conversation's questions one after another in one conversation")
    p.add_argument("--reader", choices=["search"],
                   help="a scripted reader in the model's place, through the relay's tool loop:"
                        " recall after the frame, one and two tool rounds (in sequence)")
    p.add_argument("--second", choices=eval_reader.SECOND_MOVES, default="more",
                   help="the scripted reader's second round")
    p.add_argument("--json", action="store_true", help="the reader's report as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.path.exists():
        raise ConfigError(f"no such dataset path: {args.path}")
    limits = Cap(args.floor, args.ceiling)
    if args.reader:
        found = eval_reader.evaluate(args.dataset, args.path, second=args.second,
                                     pooled=args.pooled, limits=limits, limit=args.limit)
        print(json.dumps(found, indent=2) if args.json else eval_reader.table(found))
        return 0
    report = frame_eval.evaluate(args.dataset, args.path, pooled=args.pooled, limits=limits,
                                 frames=args.frames, limit=args.limit, sequence=args.sequence)
    print(json.dumps(report, indent=2))
    return 0
