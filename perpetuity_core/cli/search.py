"""`perpetuity memory import`, `search` and `stats`: memory from the command line (also
`perpetuity import`, `search` and `stats`, as before the nouns)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from perpetuity_core.errors import ConfigError

DB_HELP = "memory database (default: $PERPETUITY_DB or ~/.perpetuity/memory.db)"

if TYPE_CHECKING:  # imported by the commands that use them: the CLI starts light
    from perpetuity_core.memory.derived.scan import Hit
    from perpetuity_core.memory.storage.store import Store


def register(sub: argparse._SubParsersAction) -> None:
    """Today's top-level commands, kept as aliases of `perpetuity memory <verb>`."""
    add_verbs(sub, alias=True)


def add_verbs(sub: argparse._SubParsersAction, alias: bool = False) -> None:
    """import, search and stats, as `perpetuity memory`'s verbs (or, `alias`, top-level)."""
    def said(func: object) -> str:
        doc = str(getattr(func, "__doc__", ""))
        return f"same as `perpetuity memory {getattr(func, '__name__', '')[4:]}`" if alias else doc

    p = sub.add_parser("import", help=said(cmd_import), description=cmd_import.__doc__)
    p.add_argument("source", choices=["claude-code", "locomo", "beam", "longmemeval"])
    p.add_argument("path", nargs="?", help="default for claude-code: ~/.claude/projects")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--user", help="user key for claude-code sessions (default: claude-code:local, which"
                   " a personal proxy reaches; a shared one once joined: `memory tenants join`)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("search", help=said(cmd_search), description=cmd_search.__doc__)
    p.add_argument("query", nargs="?", help="without it: one query per line of standard input")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--user", help="whose rows to search: a user's key, id, or the name the"
                   " harness sent when one user has it (default: every row)")
    p.add_argument("--share-pool", action="store_true",
                   help="let the user see the pool's rows too (their own rank first)")
    p.add_argument("--limit", type=int, default=10, help="rows per query (default 10)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("stats", help=said(cmd_stats), description=cmd_stats.__doc__)
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--json", action="store_true", help="the figures as one JSON object")
    p.set_defaults(func=cmd_stats)


@contextmanager
def opened(db: str | None, *, create: bool = False) -> Iterator[Store]:
    """The memory at `db` (the default one when None), closed when the command is done. Only a
    command that writes a memory of its own (`create`: import, a migration's target) makes one
    where none is: a mistyped --db must not answer zeros from an empty memory it just made."""
    from perpetuity_core.memory.schema import open_memory
    from perpetuity_core.memory.storage.location import where
    from perpetuity_core.memory.storage.store import default_db_path

    at = where(db or default_db_path())
    if not create and isinstance(at, Path) and not at.is_file():
        raise ConfigError(f"no memory at {at} (nothing created; check --db or $PERPETUITY_DB)")
    store = open_memory(at)
    try:
        yield store
    finally:
        store.close()


def cmd_import(args: argparse.Namespace) -> int:
    """Import existing histories (one transaction per message, times from the source)."""
    from perpetuity_core.memory.jobs import importers

    path = args.path or ("~/.claude/projects" if args.source == "claude-code" else None)
    if path is None:
        raise ConfigError(f"import {args.source} needs a PATH")
    options = {"user_key": args.user} if args.source == "claude-code" and args.user else {}
    with opened(args.db, create=True) as store:
        out = importers.run(store, args.source, Path(path).expanduser(),
                            progress=not args.quiet, **options)
    print(f"imported {out.messages} new messages ({out.seen} read) in {out.threads} "
          f"conversations, {out.seconds:.1f}s", file=sys.stderr)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    """Rank the stored rows against a query: id, user, conversation, role, time, score, text."""
    from perpetuity_core.memory.derived import scan

    with opened(args.db) as store:
        user_id = _user(store, args.user)
        scanner = scan.Scanner(store, share_pool=args.share_pool)
        if args.query is not None:
            hits = scanner.search(args.query, user_id, args.limit)
            if args.json:
                print(json.dumps({"query": args.query, "hits": [_hit(h) for h in hits]}))
            else:
                _table(hits)
            return 0
        for line in sys.stdin:  # one process, many queries: the arena is built once
            q = line.rstrip("\n")
            t0 = time.perf_counter()
            hits = scanner.search(q, user_id, args.limit)
            print(json.dumps({"query": q, "ms": round((time.perf_counter() - t0) * 1e3, 3),
                              "hits": [_hit(h) for h in hits]}), flush=True)
    return 0


def _user(store: Store, spec: str | None) -> int | None:
    from perpetuity_core.memory.storage import users

    # A command's statements, written once: through the translating connection.
    return None if spec is None else users.find_user(store.db.translated(), spec)[0]


def _hit(h: Hit) -> dict:
    return {"id": h.item_id, "message": h.message_id, "user": h.user_id,
            "conversation": h.conversation_id, "role": h.role, "at": h.at,
            "score": round(h.score, 6), "text": h.text}


def _table(hits: list) -> None:
    for h in hits:
        when = datetime.fromtimestamp(h.at, UTC).strftime("%Y-%m-%d %H:%M")
        text = " ".join(h.text.split())
        text = text if len(text) <= 100 else text[:99] + "…"
        print(f"{h.item_id:>8} u{h.user_id:<4} c{h.conversation_id:<5} {h.role:<9} {when} "
              f"{h.score:7.3f}  {text}")


def cmd_stats(args: argparse.Namespace) -> int:
    """Users, conversations, messages, rows, tokens, dictionary version, arena size; and what
    the calls through the proxy cost against sending them direct, per day and in total."""
    from perpetuity_core.cli import saved
    from perpetuity_core.memory.derived.arena import Arena
    from perpetuity_core.memory.storage.savings import by_day

    with opened(args.db) as store:
        conn = store.db.translated()  # a command's statements: written once

        def one(sql: str) -> int:
            return conn.execute(sql).fetchone()[0]

        arena = Arena(store.db)
        arena.catch_up()
        stats = {
            "db": store.shown,
            "users": one("SELECT count(*) FROM user"),
            "conversations": one("SELECT count(*) FROM conversation"),
            "messages": one("SELECT count(*) FROM message"),
            "rows": one("SELECT count(*) FROM retrieval"),
            "tokens": one("SELECT coalesce(sum(tokens), 0) FROM retrieval"),
            "indexed_words": one("SELECT coalesce(sum(length), 0) FROM retrieval"),
            "dictionary": store.db.dictionary.version,
            "row_versions": dict(conn.execute(
                "SELECT version, count(*) FROM retrieval GROUP BY version").fetchall()),
            "arena_bytes": arena.nbytes(),
            "arena_postings_bytes": sum(s.nbytes() for s in arena.segments),
            "db_bytes": store.size_bytes(),
        }
        days = by_day(conn)
    if args.json:
        print(json.dumps({**stats, "saving": saved.summary(days)}))
    else:
        for k, v in stats.items():
            print(f"{k:>22}  {v}")
        print("\n" + saved.table(days))
    return 0
