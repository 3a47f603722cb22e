"""The note: its frontmatter schema, parsing and rendering, byte-faithful to hand edits.

People edit these files by hand, so a note is kept as the text it was read from: a note nobody
changed is written back byte-identical, and a changed note has only the frontmatter lines of the
changed keys rewritten (its body is re-rendered only when the body itself changed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path

import yaml

from perpetuity_core.errors import PerpetuityError

# libyaml's loader when present: parsing frontmatter dominates reading a library of notes.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class NoteError(PerpetuityError):
    """A note or the notes root is not what the contract says it should be."""


class CredentialError(NoteError):
    """A note was refused because it looks like it contains a credential."""


FIELDS = (
    "name",
    "description",
    "tags",
    "created",
    "source_task",
    "confidence",
    "state",
    "use_count",
    "last_used",
    "supersedes",
    "pinned",
    "origin",
)
CONFIDENCE = ("tentative", "medium", "high")  # weakest first: the index is the rank
STATES = ("active", "stale", "archived")
ORIGINS = ("agent-created", "hand-authored")
SECTIONS = ("When", "Procedure", "Pitfalls", "Verification")

NOTES_DIR = "notes"
INDEX_FILE = "INDEX.md"
ARCHIVE_DIR = ".archive"


@dataclass(frozen=True)
class Note:
    """One note. `text` is the file exactly as read ("" for a note not yet on disk)."""

    name: str
    description: str
    tags: tuple[str, ...] = ()
    created: str | None = None
    source_task: str = ""
    confidence: str = "medium"
    state: str = "active"
    use_count: int = 0
    last_used: str | None = None
    supersedes: str | None = None
    pinned: bool = False
    origin: str = "hand-authored"  # a note with no origin line was written by a person
    body: str = ""
    path: Path | None = None
    text: str = ""

    @property
    def protected(self) -> bool:
        """Curate never touches a pinned or hand-authored note."""
        return self.pinned or self.origin == "hand-authored"


_FENCE = "---"


def _split_frontmatter(text: str, where: str) -> tuple[list[str], int]:
    """The file's lines (with their endings) and the index of the closing `---` line."""
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].rstrip() != _FENCE:
        raise NoteError(f"{where}: a note must start with a '---' frontmatter line")
    for i in range(1, len(lines)):
        if lines[i].rstrip() == _FENCE:
            return lines, i
    raise NoteError(f"{where}: the frontmatter has no closing '---' line")


def _plain(value: object) -> object:
    """YAML values as the schema sees them: dates become YYYY-MM-DD strings."""
    if isinstance(value, datetime):
        return value.date().isoformat()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _day_field(raw: object, key: str, where: str) -> str | None:
    if raw is None or raw == "":
        return None
    try:
        return date.fromisoformat(str(raw)).isoformat()
    except ValueError:
        raise NoteError(f"{where}: {key} must be a YYYY-MM-DD date, not {raw!r}") from None


def _choice(raw: object, key: str, allowed: Sequence[str], default: str, where: str) -> str:
    if raw is None:
        return default
    if raw not in allowed:
        raise NoteError(f"{where}: {key} must be one of {', '.join(allowed)}, not {raw!r}")
    return str(raw)


def _tags(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):  # a hand-written "tags: a, b" is read as the list it means
        return tuple(t.strip() for t in raw.split(",") if t.strip())
    if isinstance(raw, list):
        return tuple(str(t).strip() for t in raw if str(t).strip())
    return (str(raw),)


def parse_note(text: str, path: Path | None = None) -> Note:
    """Read a note's text; the text itself is kept so an unchanged note writes back as it was."""
    where = str(path) if path else "note"
    lines, close = _split_frontmatter(text, where)
    try:
        meta = yaml.load("".join(lines[1:close]), Loader=_YAML_LOADER) or {}
    except yaml.YAMLError as e:
        detail = " ".join(str(e).split())  # one line: the CLI prints errors as one line
        raise NoteError(f"{where}: the frontmatter is not valid YAML ({detail})") from e
    if not isinstance(meta, dict):
        raise NoteError(f"{where}: the frontmatter must be a mapping of keys to values")
    meta = {k: _plain(v) for k, v in meta.items()}
    for key in ("name", "description"):
        if not isinstance(meta.get(key), str) or not meta[key].strip():
            raise NoteError(f"{where}: the frontmatter needs a non-empty '{key}'")
    use_count = meta.get("use_count", 0)
    if use_count is None:
        use_count = 0
    if isinstance(use_count, bool) or not isinstance(use_count, int) or use_count < 0:
        raise NoteError(f"{where}: use_count must be a whole number, not {use_count!r}")
    pinned = meta.get("pinned", False)
    if pinned is None:
        pinned = False
    if not isinstance(pinned, bool):
        raise NoteError(f"{where}: pinned must be true or false, not {pinned!r}")
    supersedes = meta.get("supersedes")
    return Note(
        name=meta["name"].strip(),
        description=meta["description"].strip(),
        tags=_tags(meta.get("tags")),
        created=_day_field(meta.get("created"), "created", where),
        source_task="" if meta.get("source_task") is None else str(meta["source_task"]),
        confidence=_choice(meta.get("confidence"), "confidence", CONFIDENCE, "medium", where),
        state=_choice(meta.get("state"), "state", STATES, "active", where),
        use_count=use_count,
        last_used=_day_field(meta.get("last_used"), "last_used", where),
        supersedes=None if supersedes in (None, "") else str(supersedes),
        pinned=pinned,
        origin=_choice(meta.get("origin"), "origin", ORIGINS, "hand-authored", where),
        body="".join(lines[close + 1 :]),
        path=path,
        text=text,
    )


def _scalar(value: object, flow: bool = False) -> str:
    """One YAML scalar, plain when YAML reads it back as the same value, else double-quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    text = str(value)
    probe = f"k: [{text}]" if flow else f"k: {text}"
    expect: object = [text] if flow else text
    if text and text == text.strip() and "\n" not in text:
        try:
            if _plain(yaml.load(probe, Loader=_YAML_LOADER)["k"]) == expect:
                return text
        except (yaml.YAMLError, TypeError, KeyError):
            pass
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a valid YAML double-quoted one


def _yaml_value(key: str, value: object) -> str:
    if key == "tags" and isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(t, flow=True) for t in value) + "]"
    return _scalar(value)


def _key_extent(lines: list[str], key: str) -> tuple[int, int] | None:
    """The frontmatter lines [start, end) that hold `key`, including a block list below it."""
    pattern = re.compile(rf"^{re.escape(key)}\s*:(\s|$)")
    for i, line in enumerate(lines):
        if pattern.match(line):
            end = i + 1
            while end < len(lines) and (
                lines[end][:1] in (" ", "\t")
                or lines[end].startswith("- ")
                or lines[end].rstrip() == "-"
            ):
                end += 1
            return i, end
    return None


def render_body(preamble: str, sections: Sequence[tuple[str, str]]) -> str:
    parts = [preamble.strip()] if preamble.strip() else []
    parts += [f"## {heading}\n\n{content.strip()}".rstrip() for heading, content in sections]
    return "\n" + "\n\n".join(parts) + "\n"


def render_note(note: Note) -> str:
    """The note's file text: its original text with only the changed lines rewritten."""
    if not note.text:
        keys = "".join(f"{key}: {_yaml_value(key, getattr(note, key))}\n" for key in FIELDS)
        text = f"{_FENCE}\n{keys}{_FENCE}\n{note.body}"
        _check_rendered(text, note)
        return text
    original = parse_note(note.text, note.path)
    lines, close = _split_frontmatter(note.text, str(note.path or "note"))
    newline = "\r\n" if lines[0].endswith("\r\n") else "\n"
    front = lines[1:close]
    for key in FIELDS:
        value = getattr(note, key)
        if value == getattr(original, key):
            continue
        line = f"{key}: {_yaml_value(key, value)}{newline}"
        extent = _key_extent(front, key)
        if extent is None:
            front.append(line)
        else:
            front[extent[0] : extent[1]] = [line]
    text = lines[0] + "".join(front) + lines[close] + note.body
    _check_rendered(text, note)
    return text


def _check_rendered(text: str, note: Note) -> None:
    """Read the text back: hand-written YAML we could not patch safely must not reach disk."""
    check = parse_note(text, note.path)
    if any(getattr(check, key) != getattr(note, key) for key in FIELDS):
        raise NoteError(f"{note.path or note.name}: could not write the frontmatter safely")


def split_sections(body: str) -> tuple[str, list[tuple[str, str]]]:
    """A body as (text before the first `## ` heading, [(heading, content), ...])."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        match = re.match(r"^##\s+(.+?)\s*#*\s*$", line)
        if match and not line.startswith("###"):
            sections.append((match.group(1), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return "\n".join(preamble), [(h, "\n".join(c).strip("\n")) for h, c in sections]

