"""`perpetuity memory {import,search,stats,users,tenants,check,purge,migrate,dictionary}`:
load and query a memory, list its users and tenants (and join one person's),
keep it whole beside a serving proxy, and move it to another store."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from perpetuity_core.cli import search
from perpetuity_core.cli.search import DB_HELP, opened
from perpetuity_core.cli.words import counted
from perpetuity_core.errors import ConfigError

PREVIEWED = 50  # messages a purge lists


def register(sub: argparse._SubParsersAction) -> None:
    memory = sub.add_parser("memory", help="import, search, stats, users, check, purge, and the"
                            " retrieval dictionary", description=__doc__)
    verbs = memory.add_subparsers(dest="verb", required=True)
    search.add_verbs(verbs)
    p = verbs.add_parser("users", help=cmd_users.__doc__, description=cmd_users.__doc__)
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_users)
    t = verbs.add_parser("tenants", help=cmd_tenants.__doc__, description=cmd_tenants.__doc__)
    t.add_argument("--db", help=DB_HELP)
    t.set_defaults(func=cmd_tenants)
    tv = t.add_subparsers(dest="action")
    p = tv.add_parser("join", help=cmd_join.__doc__, description=cmd_join.__doc__)
    p.add_argument("tenant", nargs="+", help="tenants as `perpetuity memory tenants` lists them"
                   " (key-<hash>, anonymous)")
    # SUPPRESS: a --db given before the action (to `tenants`) is not reset by the action's.
    p.add_argument("--db", help=DB_HELP, default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_join)
    p = tv.add_parser("part", help=cmd_part.__doc__, description=cmd_part.__doc__)
    p.add_argument("tenant")
    p.add_argument("--db", help=DB_HELP, default=argparse.SUPPRESS)
    p.set_defaults(func=cmd_part)
    p = verbs.add_parser("check", help=cmd_check.__doc__, description=cmd_check.__doc__)
    p.add_argument("--db", help=DB_HELP)
    p.set_defaults(func=cmd_check)
    p = verbs.add_parser("purge", help=cmd_purge.__doc__, description=cmd_purge.__doc__)
    p.add_argument("--user", help="a user's key, id, or the name the harness sent when one user"
                   " has it; alone, the whole user goes at once")
    p.add_argument("--conversation", help="a conversation's id (as `perpetuity search` shows it:"
                   " c12) or its key: every message of it")
    p.add_argument("--matching", metavar="TEXT", help="every message holding TEXT (any case)")
    p.add_argument("--yes", action="store_true", help="remove what --conversation and"
                   " --matching preview")
    p.add_argument("--db", help=DB_HELP)
    p.set_defaults(func=cmd_purge)

    p = verbs.add_parser("migrate", help=cmd_migrate.__doc__, description=cmd_migrate.__doc__)
    p.add_argument("--from", dest="source", required=True,
                   help="the SQLite memory to copy (a path or sqlite:///path)")
    p.add_argument("--to", dest="target", required=True,
                   help="an empty store to copy it into (postgresql://user@host:port/dbname)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_migrate)

    d = verbs.add_parser("dictionary", help="the retrieval dictionary as data",
                         description="Upload a version dark, re-derive every row under it in the "
                         "background, flip it live in one transaction.")
    dv = d.add_subparsers(dest="action", required=True)
    p = dv.add_parser("list", help=cmd_list.__doc__, description=cmd_list.__doc__)
    p.add_argument("--db", help=DB_HELP)
    p.set_defaults(func=cmd_list)
    p = dv.add_parser("upload", help=cmd_upload.__doc__, description=cmd_upload.__doc__)
    p.add_argument("file", type=Path)
    p.add_argument("--db", help=DB_HELP)
    p.set_defaults(func=cmd_upload)
    for name, func in (("rederive", cmd_rederive), ("flip", cmd_flip)):
        p = dv.add_parser(name, help=func.__doc__, description=func.__doc__)
        p.add_argument("--version", help="default: the newest uploaded version not live, else"
                       " the shipped one")
        p.add_argument("--db", help=DB_HELP)
        if name == "rederive":
            p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(func=func)


def cmd_check(args: argparse.Namespace) -> int:
    """Recompute every invariant; one line per violation, exit status 1 when any."""
    from perpetuity_core.memory.jobs.integrity import check

    with opened(args.db) as store:
        problems = check(store)
    for p in problems:
        print(p)
    if not problems:
        print(f"memory {store.shown}: every invariant holds", file=sys.stderr)
    return 1 if problems else 0


def cmd_users(args: argparse.Namespace) -> int:
    """Every stored user: key, tenant, conversations, messages, tokens, last seen (latest
    first). The key is what --user takes; the name after the tenant does when it is unique."""
    import json

    from perpetuity_core.memory.storage import users

    with opened(args.db) as store:
        listed = users.users(store.db.translated())  # a command's statements: written once
    if args.json:
        for u in listed:
            print(json.dumps({"id": u.id, "key": u.key, "tenant": u.tenant,
                              "conversations": u.conversations, "messages": u.messages,
                              "tokens": u.tokens, "last_seen": u.last_seen}))
        return 0
    width = max((len(u.key) for u in listed), default=3)
    print(f"{'key':<{width}}  {'tenant':<28} {'conversations':>13} {'messages':>9}"
          f" {'tokens':>10}  last seen")
    for u in listed:
        seen = (datetime.fromtimestamp(u.last_seen, UTC).strftime("%Y-%m-%d %H:%M")
                if u.last_seen is not None else "never")
        print(f"{u.key:<{width}}  {u.tenant:<28} {u.conversations:>13} {u.messages:>9}"
              f" {u.tokens:>10}  {seen}")
    print(f"{counted(len(listed), 'user')} in {store.shown}", file=sys.stderr)
    return 0


def cmd_tenants(args: argparse.Namespace) -> int:
    """Every tenant (a credential's memory), the person it is joined to, and its users. A
    personal proxy (loopback) serves all of them as one memory; a shared one keeps them apart
    unless joined."""
    from perpetuity_core.memory.storage import users

    with opened(args.db) as store:
        listed = users.tenant_list(store.db.translated())
    for t in listed:
        joined = f"  joined as {t.person}" if t.person and t.person != t.tenant else (
            "  joined (its person)" if t.person else "")
        print(f"{t.tenant}{joined}")
        for u in t.users:
            print(f"  {u.key}  {counted(u.conversations, 'conversation')},"
                  f" {counted(u.messages, 'message')}")
    print(f"{counted(len(listed), 'tenant')} in {store.shown}", file=sys.stderr)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    """Join tenants as one person's: their users search each other's memory (a shared proxy
    honours it on its next search; a personal one already serves everyone as one)."""
    from perpetuity_core.memory.storage import users

    if len(set(args.tenant)) < 2:
        raise ConfigError("name at least two tenants to join")
    with opened(args.db) as store, store.db.writing("join tenants") as raw:
        person = users.join(store.db.translated(raw), args.tenant)
    print(f"joined {', '.join(args.tenant)} as {person}", file=sys.stderr)
    return 0


def cmd_part(args: argparse.Namespace) -> int:
    """Take a tenant out of the person it was joined to: its memory is its own again."""
    from perpetuity_core.memory.storage import users

    with opened(args.db) as store, store.db.writing("part a tenant") as raw:
        parted = users.part(store.db.translated(raw), args.tenant)
    if not parted:
        raise ConfigError(f"{args.tenant!r} is not joined to anyone")
    print(f"parted {args.tenant}", file=sys.stderr)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    """Copy a SQLite memory, row for row, into an empty store (PostgreSQL), then check both."""
    from perpetuity_core.memory.jobs.integrity import check
    from perpetuity_core.memory.jobs.transfer import copy_memory
    from perpetuity_core.memory.storage.location import shown, sqlite_path

    source = sqlite_path(args.source)
    if not source.is_file():
        raise ConfigError(f"no memory at {source}")
    with opened(str(source)) as origin:  # brought to the current schema before it is copied
        before = check(origin)
        with opened(args.target, create=True) as store:
            copied = copy_memory(origin, store, progress=not args.quiet)
    # Reopened: the copied settings (identity salt) are read afresh.
    with opened(args.target) as store:
        after = check(store)
    print(f"copied {counted(copied.get('message', 0), 'message')},"
          f" {counted(copied.get('item', 0), 'row')} from"
          f" {source} to {shown(args.target)}", file=sys.stderr)
    for side, problems in (("source", before), ("target", after)):
        for problem in problems:
            print(f"{side}: {problem}")
    return 1 if before or after else 0


def cmd_purge(args: argparse.Namespace) -> int:
    """Forget: a user's memory as a unit (--user alone; notes are untouched), or a conversation
    (--conversation) or every message holding a text (--matching), previewed until --yes, with
    everything derived from them (docs/forgetting.md: what that covers, and the file's free
    pages and WAL)."""
    from perpetuity_core.memory.jobs import forget
    from perpetuity_core.memory.jobs.maintenance import purge_user

    if not args.conversation and not args.matching:
        if not args.user:
            raise ConfigError("name what to forget: --user, --conversation or --matching")
        with opened(args.db) as store:
            out = purge_user(store, args.user)
        print(f"purged {out.key}: {counted(out.messages, 'message')}, {counted(out.items, 'row')}",
              file=sys.stderr)
        return 0
    scope = {"conversation": args.conversation, "matching": args.matching, "user": args.user}
    with opened(args.db) as store:
        chosen = forget.forget(store, **scope) if args.yes else forget.select(store, **scope)
    for m in chosen.messages[:PREVIEWED]:
        when = datetime.fromtimestamp(m.at, UTC).strftime("%Y-%m-%d %H:%M")
        print(f"{m.id:>8} c{m.conversation_id:<5} {m.role:<9} {when}  {m.excerpt}")
    if len(chosen.messages) > PREVIEWED:
        print(f"... and {len(chosen.messages) - PREVIEWED} more")
    conversations = len({m.conversation_id for m in chosen.messages})
    what = (f"{counted(len(chosen.messages), 'message')} ({counted(chosen.items, 'row')}) in"
            f" {counted(conversations, 'conversation')}"
            + (f", {counted(len(chosen.shapes), 'kept request shape')}" if chosen.shapes else ""))
    if not args.yes:
        print(f"would purge {what}; nothing changed: add --yes to remove them", file=sys.stderr)
    elif chosen.wal_cleared is False:
        print(f"purged {what}; the WAL still holds older pages while a reader (a proxy) is"
              " mid-read: run `perpetuity memory purge` again, or see docs/forgetting.md",
              file=sys.stderr)
    else:
        print(f"purged {what}; what else may hold it: docs/forgetting.md", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """The dictionary versions this memory holds: which is live, how far each is re-derived."""
    from perpetuity_core.memory.jobs.maintenance import versions

    with opened(args.db) as store:
        for v in versions(store):
            when = datetime.fromtimestamp(v.uploaded_at, UTC).strftime("%Y-%m-%d %H:%M")
            state = "live" if v.live else f"dark, {counted(v.rederived, 'row')} re-derived"
            print(f"{v.version}  uploaded {when}  {state}")
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    """Store a dictionary file dark (nothing changes until it is re-derived and flipped)."""
    from perpetuity_core.memory.jobs.maintenance import upload

    with opened(args.db) as store:
        print(upload(store, args.file))
    return 0


def cmd_rederive(args: argparse.Namespace) -> int:
    """Re-derive every row under a dark version (resumable; the proxy keeps serving)."""
    from perpetuity_core.memory.jobs.maintenance import rederive, target

    with opened(args.db) as store:
        version = target(store, args.version)
        n = rederive(store, version, progress=not args.quiet)
    print(f"re-derived {counted(n, 'row')} under {version}; `perpetuity memory dictionary flip` makes it"
          " live", file=sys.stderr)
    return 0


def cmd_flip(args: argparse.Namespace) -> int:
    """Make the re-derived version live, in one transaction (heat and novelty untouched)."""
    from perpetuity_core.memory.jobs.maintenance import flip, target

    with opened(args.db) as store:
        version = target(store, args.version)
        rows = flip(store, version)
    print(f"dictionary {version} is live: {counted(rows, 'row')}", file=sys.stderr)
    return 0
