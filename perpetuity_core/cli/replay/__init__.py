"""`perpetuity replay`: what would Perpetuity have saved me?

Recorded conversations go through the real request pipeline, one memory for all of them, in
time order, each call answered with its recorded reply and billed twice under the provider's
prompt-cache rules: as the harness sent it (direct) and as it reached the provider.

    perpetuity replay claude-code PATH... [--chain [--passes N]] [--db DB] [--calls N] [--json] [--plot FILE.png]
    perpetuity replay chat locomo PATH [--db DB] [--limit N] [--json] [--plot FILE.png]

PATH may be session files or folders (such as ~/.claude/projects, searched for *.jsonl).
Costs are in units of one uncached input token, under the provider's cache prices. The system prompt
and tools are a real Claude Code request's: --request-template FILE, else ../shared's capture
(in a checkout beside it), else the one your own Claude Code last sent through the proxy (kept
in its memory: --proxy-db, default $PERPETUITY_DB or ~/.perpetuity/memory.db); without any,
stand-ins of their size take their place and the report says so.

From Python: `replay.claude_code(paths, ...)` and `replay.chat_locomo(path, ...)` return a
`Report` (`.sessions`, `.total`, `.as_dict()`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from perpetuity_core.cli.replay.drive import Report, chat_locomo, claude_code
from perpetuity_core.cli.replay.report import plot, table
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.storage.location import sqlite_path

__all__ = ["Report", "chat_locomo", "claude_code", "register"]


def register(sub: Any) -> None:
    p = sub.add_parser("replay", help="what would Perpetuity have saved? recorded sessions, "
                       "billed direct and through the proxy", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = p.add_subparsers(dest="kind", required=True)
    cc = kinds.add_parser(
        "claude-code", help="Claude Code session files (~/.claude/projects)",
        description="Replay recorded Claude Code sessions through the real pipeline into one"
        " memory, each call answered with its recorded reply, and bill every call twice under"
        " Anthropic's prompt-cache rules: as Claude Code sent it (direct) and as it reached the"
        " provider. Reports cost and tokens each way, where the cost went, invalid requests,"
        " and what each reply used from older history.")
    cc.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                    help="session files (*.jsonl) or folders searched for them")
    cc.add_argument("--calls", type=int, help="only each session's first N calls")
    cc.add_argument("--chain", action="store_true",
                    help="the sessions as one conversation that never ends, each after the whole "
                    "history of those before it; each call's sizes, request-path time and RSS "
                    "reported")
    cc.add_argument("--passes", type=int, default=1, metavar="N",
                    help="with --chain: the sessions N times over, for a history longer than "
                    "they hold")
    cc.add_argument("--request-template", type=Path, metavar="FILE",
                    help="a captured Claude Code request giving the system prompt and tools")
    cc.add_argument("--proxy-db", metavar="DB",
                    help="the proxy's memory, whose latest Claude Code request gives them "
                         "otherwise (default: $PERPETUITY_DB or ~/.perpetuity/memory.db)")
    chat = kinds.add_parser("chat", help="a chat dataset re-sent turn by turn (LoCoMo)",
                            description="Re-send LoCoMo's conversations turn by turn as a chat"
                            " client would, billed direct and through the proxy.")
    chat.add_argument("dataset", choices=["locomo"])
    chat.add_argument("path", type=Path, help="locomo10.json")
    chat.add_argument("--limit", type=int, default=0, help="only the first N conversations")
    chat.add_argument("--turns", type=int, default=0, help="only each conversation's first N turns")
    for q in (cc, chat):
        q.add_argument("--db", help="the memory to fill (a new file; default temporary)")
        q.add_argument("--json", action="store_true", help="print JSON instead of a table")
        q.add_argument("--plot", type=Path, metavar="FILE.png", help="cumulative cost plot")
        q.add_argument("--ceiling", type=int, default=Cap().ceiling, help="largest frame, tokens")
        q.add_argument("--no-tools", action="store_true", help="without the recall tools")
        q.set_defaults(func=_run)


def _new_file(db: str | None) -> Path | None:
    return sqlite_path(db) if db else None


def _run(args: argparse.Namespace) -> int:
    limits = Cap(Cap().floor, args.ceiling)
    if args.kind == "claude-code":
        if missing := [str(p) for p in args.paths if not p.exists()]:
            raise ConfigError(f"no such path: {', '.join(missing)}")
        report = claude_code(args.paths, db=_new_file(args.db), calls=args.calls,
                             template=args.request_template, proxy_db=args.proxy_db,
                             limits=limits, tools=not args.no_tools, progress=True,
                             chain=args.passes if args.chain else 0)
    else:
        report = chat_locomo(args.path, db=_new_file(args.db), limit=args.limit, turns=args.turns,
                             limits=limits, tools=not args.no_tools, progress=True)
    data = report.as_dict()
    print(json.dumps(data, indent=2) if args.json else table(data))
    if args.plot:
        plot(report.sessions, args.plot)
    return 0
