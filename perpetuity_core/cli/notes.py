"""`perpetuity notes ...`: list, show, recall, reindex, curate, capture and used, over the notes package."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from perpetuity_core import notes
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame import tenants
from perpetuity_core.wire.identity import PERSONAL


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "notes",
        help="the curated library of notes: recall, capture, curate",
        description="The curated library of Markdown notes: lessons recalled into frames, captured"
        " by the model, curated by `/perpetuity-curate` or `perpetuity notes curate`.",
    )
    sub = parser.add_subparsers(dest="notes_command", required=True)

    def command(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=func.__doc__)
        p.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="a notes library (default: the one a personal proxy reads and writes, "
            "tenants/personal/ under the notes root: $PERPETUITY_NOTES_DIR, else ./.perpetuity/ "
            "if it exists, else ~/.claude/perpetuity/)",
        )
        p.add_argument("--tenant", help="the library of this tenant (as `perpetuity memory "
                       "tenants` lists it) under the notes root, or under --dir")
        p.set_defaults(func=func)
        return p

    p = command("list", cmd_list, "list the notes")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("show", cmd_show, "print one note")
    p.add_argument("name")

    p = command("recall", cmd_recall, "what recall would load for a task")
    p.add_argument("task", help="the task text")
    p.add_argument("--json", action="store_true", help="print JSON")

    command("reindex", cmd_reindex, "regenerate INDEX.md from the notes' frontmatter")

    p = command("curate", cmd_curate, "snapshot, age, consolidate and reindex the notes")
    p.add_argument("--today", help="the date to curate as, YYYY-MM-DD (default: today, UTC)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("capture", cmd_capture, "write or patch one note")
    p.add_argument("--name", help="kebab-case slug")
    p.add_argument("--description", help="one line: what it fixes and when to reach for it")
    p.add_argument("--tag", action="append", dest="tags", help="a tag (repeat for more)")
    p.add_argument("--source-task", dest="source_task")
    p.add_argument("--confidence", choices=notes.CONFIDENCE)
    for section in notes.SECTIONS:
        p.add_argument(f"--{section.lower()}", help=f"the {section} section")
    p.add_argument("--stdin", action="store_true", help="read the fields as a JSON object")
    p.add_argument("--today", help="the date to record, YYYY-MM-DD (default: today, UTC)")

    p = command("used", cmd_used, "record that notes were used (use_count + 1, last_used)")
    p.add_argument("names", nargs="+")
    p.add_argument("--today", help="the date to record, YYYY-MM-DD (default: today, UTC)")


def _root(args: argparse.Namespace) -> Path:
    """The library a command works on: the proxy keeps one per tenant under the notes root
    (frame/tenants.py), and a personal proxy's one tenant is `personal`."""
    if args.dir is not None and not args.tenant:
        return Path(args.dir)
    library = tenants.library(args.dir or notes.notes_root(), args.tenant or PERSONAL)
    assert library is not None  # a root was given
    return library


def _today(args: argparse.Namespace) -> Any:
    if args.today:
        return notes.parse_day(args.today)
    return datetime.now(UTC).date()


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _note_json(note: notes.Note) -> dict[str, Any]:
    data = {key: _jsonable(getattr(note, key)) for key in notes.FIELDS}
    data["path"] = str(note.path) if note.path else None
    return data


def cmd_list(args: argparse.Namespace) -> int:
    """List the notes: name, state, confidence, use count, last use."""
    found = notes.load_notes(_root(args))
    if args.json:
        print(json.dumps([_note_json(n) for n in found], indent=2))
        return 0
    if not found:
        print(f"No notes in {_root(args)}.")
    for n in found:
        flags = " pinned" if n.pinned else ""
        flags += " hand-authored" if n.origin == "hand-authored" else ""
        print(
            f"{n.name}  {n.state}  {n.confidence}  used {n.use_count}x"
            f"  last {n.last_used or 'never'}{flags}"
        )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print one note exactly as it is on disk."""
    sys.stdout.write(notes.find_note(_root(args), args.name).text)
    return 0


def cmd_recall(args: argparse.Namespace) -> int:
    """Show what recall would load for a task: the index lines and the matching notes in full."""
    result = notes.recall(_root(args), args.task)
    if args.json:
        data = {
            "terms": list(result.terms),
            "index_lines": list(result.index_lines),
            "over_budget": result.over_budget,
            "notes": [
                {
                    "name": r.note.name,
                    "score": r.score,
                    "matched": list(r.matched),
                    "lead": r.lead,
                    "replaces": list(r.replaces),
                    "text": r.note.text,
                }
                for r in result.notes
            ],
        }
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(result.text)
    return 0


def cmd_reindex(args: argparse.Namespace) -> int:
    """Regenerate INDEX.md from the notes' frontmatter and report it against its budget."""
    print(notes.reindex(_root(args)).text)
    return 0


def cmd_curate(args: argparse.Namespace) -> int:
    """Curate the notes: snapshot, age, consolidate overlaps, reindex; print what changed.
    Pinned and hand-authored notes are never touched; nothing is deleted."""
    summary = notes.curate(_root(args), _today(args))
    if args.json:
        data = _jsonable(summary)
        data["text"] = summary.text
        print(json.dumps(data, indent=2))
    else:
        print(summary.text)
    return 0


def cmd_capture(args: argparse.Namespace) -> int:
    """Write or patch one note. Fields come as a JSON object on stdin (--stdin, or when no field
    flag is given) and/or as flags, flags winning; see notes.CAPTURE_TOOL_SCHEMA."""
    flag_fields = {
        key: getattr(args, key)
        for key in ("name", "description", "tags", "source_task", "confidence")
        + tuple(s.lower() for s in notes.SECTIONS)
        if getattr(args, key) is not None
    }
    fields: dict[str, Any] = {}
    if args.stdin or not flag_fields:
        try:
            loaded = json.loads(sys.stdin.read())
        except json.JSONDecodeError as e:
            raise ConfigError(f"capture: stdin is not a JSON object ({e.msg})") from e
        if not isinstance(loaded, dict):
            raise ConfigError("capture: stdin must hold a JSON object of note fields")
        fields.update(loaded)
    fields.update(flag_fields)
    print(notes.capture(_root(args), fields, _today(args)).text)
    return 0


def cmd_used(args: argparse.Namespace) -> int:
    """Record that notes were used in this task (read or cited): use_count + 1, last_used."""
    updated = notes.mark_used(_root(args), args.names, _today(args))
    missing = [n for n in args.names if n not in updated]
    if updated:
        print(f"Marked used: {', '.join(updated)}.")
    if missing:
        print(f"No such note: {', '.join(missing)}.")
    return 0
