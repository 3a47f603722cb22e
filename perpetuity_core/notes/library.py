"""Where notes live and the index: a notes root, loading and saving notes, and INDEX.md.

INDEX.md is regenerated from frontmatter, one line per active note, within a budget that is
reported, never widened.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from perpetuity_core.errors import ConfigError
from perpetuity_core.notes.model import (
    INDEX_FILE,
    NOTES_DIR,
    Note,
    NoteError,
    parse_note,
    render_note,
)

# INDEX.md is loaded at the start of every task, so it must stay small: 40 lines of at most
# 4,000 characters (about 1,000 tokens) for the note lines. Going over is reported as the signal
# to curate; the budget is never widened and the index is never silently truncated.
INDEX_MAX_LINES = 40
INDEX_MAX_CHARS = 4000


def notes_root(
    env: Mapping[str, str] | None = None, cwd: Path | None = None, home: Path | None = None
) -> Path:
    """The notes root: $PERPETUITY_NOTES_DIR, else ./.perpetuity/ if it exists (a memory for this
    repository, worth committing), else ~/.claude/perpetuity/ (global)."""
    env = os.environ if env is None else env
    if env.get("PERPETUITY_NOTES_DIR"):
        return Path(env["PERPETUITY_NOTES_DIR"]).expanduser()
    local = (cwd or Path.cwd()) / ".perpetuity"
    if local.is_dir():
        return local
    return (home or Path.home()) / ".claude" / "perpetuity"


def parse_day(text: str) -> date:
    """A YYYY-MM-DD argument as a date."""
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"expected a date as YYYY-MM-DD, not {text!r}") from None


def slugify(text: str) -> str:
    """A kebab-case slug: lowercase ASCII letters and digits joined by single hyphens."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def load_notes(root: Path) -> list[Note]:
    """The notes under <root>/notes/, by name; templates (`_*.md`) are skipped."""
    folder = root / NOTES_DIR
    if not folder.is_dir():
        return []
    notes: dict[str, Note] = {}
    for path in sorted(folder.glob("*.md")):
        if path.name.startswith("_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise NoteError(f"{path}: cannot read the note ({e})") from e
        note = _parse_cached(text, path)
        if note.name in notes:
            raise NoteError(
                f"{path}: the name {note.name!r} is also used by {notes[note.name].path}"
            )
        notes[note.name] = note
    return sorted(notes.values(), key=lambda n: n.name)


# Recall reads the whole library at the start of every task; a note is parsed once per distinct
# text (the key is the full text, so an edited file is always parsed afresh). Notes are frozen.
_parse_cached = functools.lru_cache(maxsize=4096)(parse_note)


def find_note(root: Path, name: str) -> Note:
    """The note called `name` (or whose file is `<slug of name>.md`)."""
    for note in load_notes(root):
        if note.name == name or (note.path and note.path.stem == slugify(name)):
            return note
    raise NoteError(f"no note named {name!r} in {root / NOTES_DIR}")


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a note."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8", newline="")
    os.replace(tmp, path)


def save_note(note: Note) -> Note:
    """Write a changed note (an unchanged one is left alone) and return it as now on disk."""
    if note.path is None:
        raise NoteError(f"note {note.name!r} has no file to write")
    text = render_note(note)
    if text != note.text:
        write_atomic(note.path, text)
    return dataclasses.replace(note, text=text)


INDEX_HEADER = (
    "# Perpetuity notes\n"
    "\n"
    "<!-- Regenerated from the notes' frontmatter by `perpetuity notes reindex`; edits here are\n"
    "     overwritten. One line per active note: `- name — description [tags]`.\n"
    f"     Budget: {INDEX_MAX_LINES} lines, {INDEX_MAX_CHARS} characters of note lines.\n"
    "     Over budget is the signal to run `perpetuity notes curate`; it is never widened. -->\n"
    "\n"
)


@dataclass(frozen=True)
class IndexReport:
    path: Path
    lines: int
    chars: int
    written: bool

    @property
    def over_budget(self) -> bool:
        return self.lines > INDEX_MAX_LINES or self.chars > INDEX_MAX_CHARS

    @property
    def text(self) -> str:
        usage = f"{self.lines}/{INDEX_MAX_LINES} lines, {self.chars}/{INDEX_MAX_CHARS} characters"
        if self.over_budget:
            return f"INDEX.md is over budget ({usage}): run `perpetuity notes curate`."
        return f"INDEX.md: {usage}."


def index_line(note: Note) -> str:
    description = " ".join(note.description.split())
    return f"- {note.name} — {description} [{', '.join(note.tags)}]"


def index_lines(notes: Iterable[Note]) -> list[str]:
    return [index_line(n) for n in sorted(notes, key=lambda n: n.name) if n.state == "active"]


def render_index(notes: Iterable[Note]) -> str:
    lines = index_lines(notes)
    return INDEX_HEADER + "".join(f"{line}\n" for line in lines)


def index_report(root: Path, lines: Sequence[str], written: bool) -> IndexReport:
    return IndexReport(
        path=root / INDEX_FILE,
        lines=len(lines),
        chars=sum(len(line) + 1 for line in lines),
        written=written,
    )


def write_index(root: Path, notes: Sequence[Note]) -> IndexReport:
    """Write INDEX.md if its content would change; report its size against the budget."""
    text = render_index(notes)
    path = root / INDEX_FILE
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current != text:
        write_atomic(path, text)
    return index_report(root, index_lines(notes), current != text)


def reindex(root: Path) -> IndexReport:
    """Regenerate <root>/INDEX.md from the notes' frontmatter and report it against the budget."""
    if not root.is_dir():
        raise NoteError(f"no notes library at {root}")
    return write_index(root, load_notes(root))

