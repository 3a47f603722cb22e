"""Notes: a small, curated Markdown library of how hard problems got solved.

A notes root holds::

    <root>/notes/<slug>.md     one note per file, frontmatter + When/Procedure/Pitfalls/Verification
    <root>/INDEX.md            one line per active note, regenerated from frontmatter, with a budget
    <root>/.archive/           archived notes and curate snapshots; nothing is ever deleted

People edit these files by hand, so a note is kept as the text it was read from: a note nobody
changed is written back byte-identical, and a changed note has only the frontmatter lines of the
changed keys rewritten (its body is re-rendered only when the body itself changed). Files whose
names start with `_` (such as the shipped `_example.md`) are templates and are never loaded.

Four jobs, all deterministic and free of model calls:

- recall(root, task)      terms from the task, matched against tags (weighted) and bodies;
- capture(root, fields)   writes or patches exactly one note, after a credential scan;
- curate(root, today)     snapshot, age, consolidate, reindex; never deletes, never touches a
                          pinned or hand-authored note;
- reindex(root)           INDEX.md from frontmatter, reporting (never widening) the budget.

Errors are `NoteError` (a `PerpetuityError`); a note that looks like it holds a secret is refused
with `CredentialError`, which names the kind of secret and where, never the secret itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path

import yaml

from .errors import ConfigError, PerpetuityError

# libyaml's loader when present: parsing frontmatter dominates reading a library of notes.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class NoteError(PerpetuityError):
    """A note or the notes root is not what the contract says it should be."""


class CredentialError(NoteError):
    """A note was refused because it looks like it contains a credential."""


# --- The schema ---------------------------------------------------------------------------------

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

# --- Documented thresholds ----------------------------------------------------------------------

# INDEX.md is loaded at the start of every task, so it must stay small: 40 lines of at most
# 4,000 characters (about 1,000 tokens) for the note lines. Going over is reported as the signal
# to curate; the budget is never widened and the index is never silently truncated.
INDEX_MAX_LINES = 40
INDEX_MAX_CHARS = 4000

# Ageing, counted in whole days from last_used (or created, if the note was never used):
# 30 or more days unused -> state: stale; 90 or more -> moved to .archive/ with state: archived.
STALE_AFTER_DAYS = 30
ARCHIVE_AFTER_DAYS = 90

# Two notes cover the same ground when similarity() >= SIMILARITY_THRESHOLD. similarity() is
# TAG_SHARE * Jaccard(normalised tags) + (1 - TAG_SHARE) * Jaccard(terms of name, description and
# body). The same threshold decides whether capture patches an existing note, so capture never
# writes what curate would merge straight away. Measured on the tests' notes: two wordings of one
# lesson score 0.55; two different pytest problems under identical tags 0.40 (the threshold sits
# above this, so shared tags alone never merge: identical tags still need 0.22 of body overlap);
# unrelated notes under 0.05.
TAG_SHARE = 0.3
SIMILARITY_THRESHOLD = 0.45

# When two notes merge, a line of the weaker one is left out if its terms overlap a line of the
# stronger one by this Jaccard or more ("Set --import-mode=importlib" vs "Use ..." scores 0.83).
LINE_DUPLICATE_THRESHOLD = 0.75

# Recall scores each distinct task term once, at its best weight: a tag term 3, a term of the
# name or description 2, a body term 1. A note loads in full at RECALL_MIN_SCORE or more, at
# most RECALL_MAX_NOTES of them, best first.
TAG_WEIGHT = 3
DESCRIPTION_WEIGHT = 2
BODY_WEIGHT = 1
RECALL_MIN_SCORE = 1
RECALL_MAX_NOTES = 5


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


# --- Parsing and writing ------------------------------------------------------------------------

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


def _render_body(preamble: str, sections: Sequence[tuple[str, str]]) -> str:
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


_LIST_MARK = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


def _merge_text(old: str, new: str) -> str:
    """Old text plus the lines of new that say something old does not: a line is dropped when it
    is the same (list markers, case and spacing aside) or a near-duplicate of an old line (see
    LINE_DUPLICATE_THRESHOLD), so the stronger note's wording wins."""
    kept = [line for line in old.splitlines() if line.strip()]
    seen = {_LIST_MARK.sub("", line).strip().lower() for line in kept}
    seen_terms = [t for t in (terms(line) for line in kept) if t]
    added: list[str] = []
    for line in new.splitlines():
        key = _LIST_MARK.sub("", line).strip().lower()
        line_terms = terms(line)
        if not key or key in seen:
            continue
        if line_terms and any(
            jaccard(line_terms, t) >= LINE_DUPLICATE_THRESHOLD for t in seen_terms
        ):
            continue
        seen.add(key)
        if line_terms:
            seen_terms.append(line_terms)
        added.append(line.rstrip())
    if not added:
        return old.strip("\n")
    return "\n".join(part for part in (old.strip("\n"), "\n".join(added)) if part)


def merge_bodies(stronger: str, weaker: str) -> str:
    """The stronger body, with what the weaker one adds appended to the matching sections."""
    preamble, sections = split_sections(stronger)
    _, extra = split_sections(weaker)
    merged = dict(sections)
    order = [h for h, _ in sections]
    for heading, content in extra:
        match = next((h for h in order if h.lower() == heading.lower()), None)
        if match is None:
            order.append(heading)
            merged[heading] = content
        else:
            merged[match] = _merge_text(merged[match], content)
    result = [(h, merged[h]) for h in order]
    if result == sections:
        return stronger
    return _render_body(preamble, result)


# --- Where notes live ---------------------------------------------------------------------------


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


def _write(path: Path, text: str) -> None:
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
        _write(note.path, text)
    return dataclasses.replace(note, text=text)


# --- Terms and similarity -----------------------------------------------------------------------

# Function words, and words every task or every note says (section headings, generic verbs and
# "error"), so that matching rests on tools, errors, frameworks and domain nouns.
_STOP_WORDS_TEXT = """
    a about above after again against all also am an and any are as at be because been before
    being below between both but by can could did do does doing done down during each else etc
    for from further get gets getting got had has have having he her here hers him his how i if
    in into is it its itself just let me more most my no nor not now of off on once only or other
    our out over own same she should so some such than that the their them then there these they
    this those through to too under until up us very was we were what when where which while who
    whom why will with would you your yours e.g i.e via vs per ok yes

    please help need needs want wants try tried trying make makes made fix fixed fixes fixing use
    used uses using work works worked working run runs ran running thing things way new add added
    create update change changed look see show tell know like still again issue issues problem
    problems bug bugs error errors fail fails failed failing failure wrong broken task code file
    files one two first next step steps sure good well today something anything everything
    procedure pitfalls pitfall verification verify note notes lesson
"""
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())

_WORD = re.compile(r"[a-z0-9][a-z0-9_.+#/-]*")
_PARTS = re.compile(r"[._/-]+")


def _stem(term: str) -> str:
    """Fold a plain English plural onto its singular, the same way on both sides of a match."""
    if (
        term.isalpha()
        and len(term) > 4
        and term.endswith("s")
        and not term.endswith(("ss", "us", "is"))
    ):
        return term[:-1]
    return term


def _keep(term: str) -> bool:
    if term in STOP_WORDS or len(term) < 2:
        return False
    if term.isdigit():
        return len(term) >= 3  # status and exit codes (404, 137) are evidence; "1", "42" are not
    return any(c.isalpha() for c in term)


def terms(text: str) -> frozenset[str]:
    """The deterministic term set of a text: lowercase words (keeping `node.js`, `c++`, `k8s`),
    plus their parts split at `._/-`, minus stop words, with plurals folded."""
    found: set[str] = set()
    for raw in _WORD.findall(text.lower()):
        raw = raw.rstrip("._/-")
        for term in {raw, *_PARTS.split(raw)}:
            if term not in STOP_WORDS:
                term = _stem(term)  # after the stop check, so "fixes" is not kept as "fixe"
                if _keep(term):
                    found.add(term)
    return frozenset(found)


@functools.lru_cache(maxsize=4096)
def tag_terms(note: Note) -> frozenset[str]:
    """Terms of the tags, parts included, for recall: "collection" finds `test-collection`."""
    return terms(" ".join(note.tags))


@functools.lru_cache(maxsize=4096)
def tag_set(note: Note) -> frozenset[str]:
    """The tags themselves, normalised, for similarity: parts would inflate the union."""
    return frozenset(_stem(slugify(t)) for t in note.tags if slugify(t))


@functools.lru_cache(maxsize=4096)
def body_terms(note: Note) -> frozenset[str]:
    """Terms of everything but the tags: name, description and body."""
    return terms(f"{note.name} {note.description}\n{note.body}")


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def similarity(a: Note, b: Note) -> float:
    """How much two notes cover the same ground, from 0 to 1 (see SIMILARITY_THRESHOLD)."""
    return TAG_SHARE * jaccard(tag_set(a), tag_set(b)) + (1 - TAG_SHARE) * jaccard(
        body_terms(a), body_terms(b)
    )


def _strength(note: Note) -> tuple[int, int, str, str]:
    """Stronger first when sorted descending: confidence, then use, then the newer note."""
    return (CONFIDENCE.index(note.confidence), note.use_count, note.created or "", note.name)


# --- The index ----------------------------------------------------------------------------------

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


def _index_report(root: Path, lines: Sequence[str], written: bool) -> IndexReport:
    return IndexReport(
        path=root / INDEX_FILE,
        lines=len(lines),
        chars=sum(len(line) + 1 for line in lines),
        written=written,
    )


def _write_index(root: Path, notes: Sequence[Note]) -> IndexReport:
    """Write INDEX.md if its content would change; report its size against the budget."""
    text = render_index(notes)
    path = root / INDEX_FILE
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current != text:
        _write(path, text)
    return _index_report(root, index_lines(notes), current != text)


def reindex(root: Path) -> IndexReport:
    """Regenerate <root>/INDEX.md from the notes' frontmatter and report it against the budget."""
    if not root.is_dir():
        raise NoteError(f"no notes library at {root}")
    return _write_index(root, load_notes(root))


# --- Recall -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecalledNote:
    note: Note
    score: int
    matched: tuple[str, ...]
    lead: bool  # a tentative note: a lead to check, not an answer
    replaces: tuple[str, ...] = ()  # superseded notes that matched and yielded to this one


@dataclass(frozen=True)
class RecallResult:
    root: Path
    terms: tuple[str, ...]
    index_lines: tuple[str, ...]
    notes: tuple[RecalledNote, ...]

    @property
    def names(self) -> list[str]:
        return [r.note.name for r in self.notes]

    @property
    def over_budget(self) -> bool:
        return _index_report(self.root, self.index_lines, False).over_budget

    @property
    def text(self) -> str:
        """What recall loads: the index, then each matching note in full."""
        out = ["Perpetuity notes index:"]
        out += list(self.index_lines) or ["(no active notes)"]
        if not self.notes:
            out.append("\nNo note matches this task.")
        for r in self.notes:
            marks = []
            if r.lead:
                marks.append("LEAD: tentative, verify before relying on it")
            if r.note.state == "stale":
                marks.append("stale: unused for a while")
            if r.replaces:
                marks.append(f"supersedes {', '.join(r.replaces)}")
            suffix = f" ({'; '.join(marks)})" if marks else ""
            out.append(f"\n=== note {r.note.name}{suffix} ===\n{r.note.text.rstrip()}")
        return "\n".join(out) + "\n"


@functools.lru_cache(maxsize=4096)
def _described_terms(note: Note) -> frozenset[str]:
    return terms(f"{note.name} {note.description}")


def _score(note: Note, task: frozenset[str]) -> tuple[int, tuple[str, ...]]:
    tags = tag_terms(note) & task
    described = _described_terms(note) & task
    body = body_terms(note) & task
    score = (
        TAG_WEIGHT * len(tags)
        + DESCRIPTION_WEIGHT * len(described - tags)
        + BODY_WEIGHT * len(body - tags - described)
    )
    return score, tuple(sorted(tags | described | body))


def _successors(notes: Sequence[Note]) -> dict[str, Note]:
    """For each superseded name, the strongest live note that supersedes it."""
    out: dict[str, Note] = {}
    for note in sorted(notes, key=_strength):
        if note.supersedes and note.supersedes != note.name:
            out[note.supersedes] = note
    return out


def recall(root: Path, task_text: str) -> RecallResult:
    """What a task should start with: the index lines, and the notes (active or stale) whose
    tags or bodies share terms with the task, in full. Tentative notes are marked as leads; a
    superseded note yields to the note that supersedes it. Nothing matching is a normal result.
    A malformed note raises NoteError naming its file; a caller on the request path should fail
    open (send the request without notes) rather than guess."""
    notes = load_notes(root)
    task = terms(task_text)
    live = [n for n in notes if n.state in ("active", "stale")]
    successors = _successors(live)
    found: dict[str, tuple[Note, int, set[str], set[str]]] = {}
    for note in live:
        score, matched = _score(note, task)
        if score < RECALL_MIN_SCORE:
            continue
        final, seen = note, {note.name}
        while final.name in successors and successors[final.name].name not in seen:
            final = successors[final.name]
            seen.add(final.name)
        prior = found.get(final.name, (final, 0, set(), set()))
        replaced = prior[3] | ({note.name} if final is not note else set())
        found[final.name] = (final, max(prior[1], score), prior[2] | set(matched), replaced)
    ranked = sorted(
        found.values(), key=lambda f: (-f[1], [-x for x in _strength(f[0])[:2]], f[0].name)
    )
    recalled = tuple(
        RecalledNote(
            note=n,
            score=score,
            matched=tuple(sorted(matched)),
            lead=n.confidence == "tentative",
            replaces=tuple(sorted(replaced)),
        )
        for n, score, matched, replaced in ranked[:RECALL_MAX_NOTES]
    )
    return RecallResult(root, tuple(sorted(task)), tuple(index_lines(notes)), recalled)


# --- Use ----------------------------------------------------------------------------------------


def cited_notes(reply_text: str, names: Iterable[str]) -> list[str]:
    """The names, in the order given, that the reply cites: the name appears as a whole word
    (case-insensitive, not inside a longer kebab-case name)."""
    lowered = reply_text.lower()
    cited = []
    for name in names:
        pattern = rf"(?<![a-z0-9_-]){re.escape(name.lower())}(?![a-z0-9_]|-[a-z0-9])"
        if name and name not in cited and re.search(pattern, lowered):
            cited.append(name)
    return cited


def mark_used(root: Path, names: Iterable[str], today: date) -> list[str]:
    """Record that notes were used: use_count + 1 and last_used = today (a stale note is active
    again). Returns the names updated; unknown names are ignored.

    "Used" is deterministic: within one task, a note the model was shown by recall counts as used
    if (a) the model read it through a tool (`note_recall`, `perpetuity notes show NAME`), or
    (b) the model's reply cites its name (`cited_notes(reply_text, recalled_names)`). Without
    the proxy, the skill records the same through `perpetuity notes used NAME`. Each note counts
    once per task. Being loaded by recall alone is not use. Every note can be marked used,
    pinned and hand-authored ones included: only its use_count, last_used and state lines change.
    """
    wanted = set(names)
    updated: list[str] = []
    notes = load_notes(root)
    for note in notes:
        if note.name not in wanted:
            continue
        state = "active" if note.state == "stale" else note.state
        save_note(
            dataclasses.replace(
                note, use_count=note.use_count + 1, last_used=today.isoformat(), state=state
            )
        )
        updated.append(note.name)
    if updated:
        _write_index(root, load_notes(root))
    return updated


# --- Credential scan ----------------------------------------------------------------------------

# Shapes of real credentials. A match refuses the whole note: a lesson never needs the secret.
_SECRET_KEY = r"(?:password|passwd|passphrase|secret|api[_-]?key|auth[_-]?token|access[_-]?token)\b"
_LITERAL = r"(?![$<{*%]|[A-Za-z_][A-Za-z0-9_]*[.(\[])[^\s\"'`,;]{6,}"
CREDENTIAL_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an Anthropic API key", re.compile(r"\bsk-ant-[A-Za-z0-9_-]{20,}")),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-|svcacct-)?[A-Za-z0-9_-]{20,}")),
    ("a Stripe secret key", re.compile(r"\b[rs]k_live_[A-Za-z0-9]{16,}")),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    (
        "a GitHub token",
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})"),
    ),
    ("a Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    (
        "a JSON Web Token",
        re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{24,}=*")),
    # A literal value after password=, secret: "...", api_key: ... and the like. References pass:
    # $VAR, ${VAR}, <placeholder>, ***, %s, and code such as os.environ["X"] or getpass().
    (
        "a password or secret assignment",
        re.compile(rf"(?i){_SECRET_KEY}[\"']?\s*=\s*[\"']?{_LITERAL}"),
    ),
    (
        "a password or secret assignment",
        # After a colon, prose is common ("password: ask the admin"), so only a quoted value or
        # one with a digit or symbol in it counts.
        re.compile(
            rf"(?i){_SECRET_KEY}[\"']?\s*:\s*"
            rf"(?:[\"']{_LITERAL}|(?=[^\s\"'`,;]*[0-9!@#%^&*+~?]){_LITERAL})"
        ),
    ),
)


@dataclass(frozen=True)
class CredentialFinding:
    kind: str
    field: str
    line: int


def scan_credentials(text: str, field_name: str = "text") -> list[CredentialFinding]:
    """Where a text looks like it holds a credential (kind, field and line, never the value)."""
    findings = []
    for number, line in enumerate(text.splitlines() or [text], start=1):
        for kind, pattern in CREDENTIAL_PATTERNS:
            if pattern.search(line):
                findings.append(CredentialFinding(kind, field_name, number))
                break  # one finding per line: an sk-ant- key is not also reported as sk-
    return findings


# Lower-case literals at least one of which every CREDENTIAL_PATTERNS match contains: a text
# holding none is clean without running the patterns (a substring test is C speed; the patterns
# cost about 50 us a short row and a millisecond per 4 KB).
_TRIGGERS = ("sk-", "k_live_", "akia", "asia", "ghp_", "gho_", "ghu_", "ghs_", "ghr_",
             "github_pat_", "xox", "aiza", "-----begin", "eyj", "bearer", "pass", "secret",
             "api", "auth", "access")


def secret_kind(text: str) -> str:
    """The kind of the first credential the scan finds in `text`, else ""."""
    low = text.lower()
    if not any(t in low for t in _TRIGGERS):
        return ""
    findings = scan_credentials(text)
    return findings[0].kind if findings else ""


def _refuse_credentials(fields: Mapping[str, object]) -> None:
    findings = []
    for key, value in fields.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, str):
                findings += scan_credentials(item, key)
    if findings:
        where = "; ".join(f"{f.kind} in {f.field!r}, line {f.line}" for f in findings)
        raise CredentialError(
            f"refused to write the note: it looks like it contains a credential ({where}). "
            "Remove the secret (describe where it comes from instead) and capture again."
        )


# --- Capture ------------------------------------------------------------------------------------

CAPTURE_TOOL_NAME = "note_capture"

CAPTURE_RULES = """\
Capture a note (one call, one note) at the end of a task only when it taught something worth
keeping:
- a workflow of 5 or more steps that worked;
- a recovery from a non-obvious error;
- a correction from the user;
- a quirk of the environment (a tool, version, path or setting that behaves unexpectedly).
Skip trivial tasks, facts cheaper to re-derive than to read, session ephemera (this session's
file names, branch names, temporary state), and anything containing secrets: never put API keys,
tokens, private keys or passwords in a note; say where the secret comes from instead.
If the lesson refines a note you were shown, reuse that note's name: it is patched, not
duplicated. Write the name as a kebab-case slug; the description is one line saying what it
fixes and when to reach for it (it drives recall); tags name the tools, errors, frameworks and
domain nouns someone would mention. Use confidence: tentative for a lead you have not verified.
"""

_CAPTURE_REQUIRED = ("name", "description", "tags", "when", "procedure", "pitfalls", "verification")

CAPTURE_TOOL_SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "name": {
            "type": "string",
            "description": "Kebab-case slug naming the lesson, e.g. 'pytest-import-mismatch'. "
            "Reuse an existing note's name to refine it.",
        },
        "description": {
            "type": "string",
            "description": "One line: what it fixes and when to reach for it. Drives recall.",
        },
        "tags": {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
            "description": "Tools, error names, frameworks and domain nouns.",
        },
        "source_task": {"type": "string", "description": "The task this was learned on, briefly."},
        "confidence": {"type": "string", "enum": list(CONFIDENCE), "default": "medium"},
        "when": {"type": "string", "description": "The situation in which this applies."},
        "procedure": {"type": "string", "description": "The steps that worked, in order."},
        "pitfalls": {"type": "string", "description": "What went wrong or misleads."},
        "verification": {"type": "string", "description": "How to tell that it worked."},
    },
    "required": list(_CAPTURE_REQUIRED),
    "additionalProperties": False,
}

_SECTION_FIELDS = {heading.lower(): heading for heading in SECTIONS}
_CAPTURE_FIELDS = ("name", "description", "tags", "source_task", "confidence", *_SECTION_FIELDS)


@dataclass(frozen=True)
class CaptureResult:
    action: str  # "created" or "patched"
    name: str
    path: Path
    index: IndexReport
    similarity: float | None = None  # set when a different-named note was patched

    @property
    def text(self) -> str:
        how = "Created" if self.action == "created" else "Patched"
        why = f" (similar ground, {self.similarity:.2f})" if self.similarity is not None else ""
        return f"{how} note {self.name}{why}: {self.path}\n{self.index.text}"


def _text_field(fields: Mapping[str, object], key: str, required: bool) -> str:
    value = fields.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise NoteError(f"capture needs a non-empty '{key}'")
        return ""
    if not isinstance(value, str):
        raise NoteError(f"capture: '{key}' must be text")
    return value.strip()


def note_from_fields(fields: Mapping[str, object], today: date) -> Note:
    """A new agent-created note from capture fields (see CAPTURE_TOOL_SCHEMA)."""
    unknown = set(fields) - set(_CAPTURE_FIELDS)
    if unknown:
        raise NoteError(f"capture: unknown field(s) {', '.join(sorted(unknown))}")
    name = slugify(_text_field(fields, "name", True))
    if not name:
        raise NoteError("capture: the name has no letters or digits to make a slug from")
    description = " ".join(_text_field(fields, "description", True).split())
    raw_tags = fields.get("tags")
    if isinstance(raw_tags, str):
        raw_tags = raw_tags.split(",")
    if not isinstance(raw_tags, list) or not all(isinstance(t, str) for t in raw_tags):
        raise NoteError("capture: 'tags' must be a list of strings")
    tags = tuple(dict.fromkeys(t.strip() for t in raw_tags if t.strip()))
    if not tags:
        raise NoteError("capture needs at least one tag")
    confidence = _text_field(fields, "confidence", False) or "medium"
    if confidence not in CONFIDENCE:
        raise NoteError(f"capture: confidence must be one of {', '.join(CONFIDENCE)}")
    sections = [
        (heading, _text_field(fields, key, key in _CAPTURE_REQUIRED))
        for key, heading in _SECTION_FIELDS.items()
    ]
    return Note(
        name=name,
        description=description,
        tags=tags,
        created=today.isoformat(),
        source_task=" ".join(_text_field(fields, "source_task", False).split()),
        confidence=confidence,
        state="active",
        use_count=0,
        last_used=None,
        supersedes=None,
        pinned=False,
        origin="agent-created",
        body=_render_body("", [(h, c) for h, c in sections if c]),
    )


def _fold(stronger: Note, weaker: Note) -> Note:
    """The stronger note, refined by the weaker: tags united, sections extended, confidence the
    higher of the two, use counted together, last use the later."""
    used = [d for d in (stronger.last_used, weaker.last_used) if d]
    return dataclasses.replace(
        stronger,
        tags=tuple(dict.fromkeys(stronger.tags + weaker.tags)),
        body=merge_bodies(stronger.body, weaker.body),
        confidence=max(stronger.confidence, weaker.confidence, key=CONFIDENCE.index),
        use_count=stronger.use_count + weaker.use_count,
        last_used=max(used) if used else None,
    )


def capture(root: Path, fields: Mapping[str, object], today: date) -> CaptureResult:
    """Write or patch exactly one note from capture fields, then update INDEX.md.

    The note is patched when it refines an existing one: the same name (or file slug), or the
    most similar live note at SIMILARITY_THRESHOLD or above; otherwise it is new. A pinned or
    hand-authored note is never patched: its name is refused, and it is never chosen by
    similarity. A patch keeps the existing name and description, unites the tags, appends the
    lines the sections lack, keeps the higher confidence and sets last_used to today (refining a
    note is using its ground). Every field is scanned for credentials first; any finding refuses
    the whole capture with CredentialError. An over-budget index is reported, not fixed.
    """
    _refuse_credentials(fields)
    candidate = note_from_fields(fields, today)
    notes = load_notes(root)
    target = next(
        (
            n
            for n in notes
            if n.name == candidate.name or (n.path and n.path.stem == candidate.name)
        ),
        None,
    )
    score: float | None = None
    if target is not None and target.protected:
        raise NoteError(
            f"note {target.name!r} is pinned or hand-authored; capture refines it only by hand. "
            "Capture under a different name."
        )
    if target is None:
        scored = [
            (similarity(candidate, n), n)
            for n in notes
            if not n.protected and n.state in ("active", "stale")
        ]
        scored = [(s, n) for s, n in scored if s >= SIMILARITY_THRESHOLD]
        if scored:
            score, target = max(scored, key=lambda sn: (sn[0], sn[1].name))
    if target is None:
        path = root / NOTES_DIR / f"{candidate.name}.md"
        note = dataclasses.replace(candidate, path=path)
        text = render_note(note)
        _refuse_credentials({"note": text})
        _write(path, text)
        action = "created"
    else:
        merged = _fold(target, candidate)
        note = dataclasses.replace(
            merged,
            confidence=max(target.confidence, candidate.confidence, key=CONFIDENCE.index),
            use_count=target.use_count,
            last_used=today.isoformat(),
            state="active",
        )
        _refuse_credentials({"note": render_note(note)})
        note = save_note(note)
        action = "patched"
    index = _write_index(root, load_notes(root))
    assert note.path is not None
    return CaptureResult(action, note.name, note.path, index, score)


# --- Curate -------------------------------------------------------------------------------------


@dataclass
class CurateSummary:
    root: Path
    snapshot: Path | None = None
    staled: list[str] = field(default_factory=list)
    revived: list[str] = field(default_factory=list)
    archived: list[str] = field(default_factory=list)
    merged: list[tuple[str, str]] = field(default_factory=list)  # (weaker, into stronger)
    protected: list[str] = field(default_factory=list)
    index: IndexReport | None = None

    @property
    def changed(self) -> bool:
        return self.snapshot is not None

    @property
    def text(self) -> str:
        """A short plain-language account of what curate did."""
        if not self.changed:
            out = [f"Nothing to change in {self.root}."]
        else:
            out = [f"Curated {self.root} (snapshot before changes: {self.snapshot})."]
        if self.staled:
            out.append(f"Marked stale, unused {STALE_AFTER_DAYS}+ days: {', '.join(self.staled)}.")
        if self.revived:
            out.append(f"Active again, used recently: {', '.join(self.revived)}.")
        if self.archived:
            out.append(
                f"Moved to {ARCHIVE_DIR}/, unused {ARCHIVE_AFTER_DAYS}+ days (or already marked "
                f"archived): {', '.join(self.archived)}."
            )
        for weaker, stronger in self.merged:
            out.append(f"Merged {weaker} into {stronger} (same ground); {weaker} archived.")
        if self.protected:
            out.append(f"Left alone (pinned or hand-authored): {', '.join(self.protected)}.")
        if self.index is not None:
            out.append(self.index.text)
        return "\n".join(out)


def _aged_state(note: Note, today: date) -> str:
    """The state ageing gives a note: from the days since it was last used (or created)."""
    if note.state == "archived":
        return "archived"
    since = note.last_used or note.created
    if since is None:
        return note.state  # an undated note cannot age
    days = (today - date.fromisoformat(since)).days
    if days >= ARCHIVE_AFTER_DAYS:
        return "archived"
    if days >= STALE_AFTER_DAYS:
        return "stale"
    return "active"


def _unique(path: Path) -> Path:
    """`path`, or the first `path-N` beside it that does not exist: nothing is overwritten."""
    candidate, n = path, 2
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1
    return candidate


def _snapshot(root: Path, stamp: str) -> Path:
    target = _unique(root / ARCHIVE_DIR / f"snapshot-{stamp}")
    target.mkdir(parents=True)
    if (root / NOTES_DIR).is_dir():
        shutil.copytree(root / NOTES_DIR, target / NOTES_DIR)
    if (root / INDEX_FILE).is_file():
        shutil.copy2(root / INDEX_FILE, target / INDEX_FILE)
    return target


def _consolidate(live: dict[str, Note]) -> list[tuple[Note, Note]]:
    """Merge overlapping notes until no pair reaches SIMILARITY_THRESHOLD; returns (weaker,
    stronger-after-merge) pairs and updates `live` in place. The closest pair merges first (ties:
    the alphabetically first pair); after a merge only the merged note's pairs are rescored."""

    def score_pairs(a: str, others: Iterable[str]) -> None:
        for b in others:
            if b != a:
                pair = (a, b) if a < b else (b, a)
                score = similarity(live[a], live[b])
                if score >= SIMILARITY_THRESHOLD:
                    candidates[pair] = score

    candidates: dict[tuple[str, str], float] = {}
    names = sorted(live)
    for i, a in enumerate(names):
        score_pairs(a, names[i + 1 :])
    merges: list[tuple[Note, Note]] = []
    while candidates:
        (a, b), _ = min(candidates.items(), key=lambda kv: (-kv[1], kv[0]))
        x, y = live[a], live[b]
        stronger, weaker = (x, y) if _strength(x) >= _strength(y) else (y, x)
        # `supersedes` holds one name: the latest fold. The weaker keeps its own link in
        # .archive/, so the chain of what was folded stays readable there and in the snapshot.
        folded = dataclasses.replace(_fold(stronger, weaker), supersedes=weaker.name)
        del live[weaker.name]
        live[stronger.name] = folded
        merges.append((weaker, folded))
        candidates = {p: v for p, v in candidates.items() if not {a, b} & set(p)}
        score_pairs(stronger.name, sorted(live))
    return merges


def curate(
    root: Path,
    today: date,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> CurateSummary:
    """Curate the notes root; only files inside it change, and none is deleted.

    Pinned and hand-authored notes are never touched. In order: (1) plan every change; if there
    is any, snapshot notes/ and INDEX.md to .archive/snapshot-<UTC timestamp>/ first; (2) age:
    unused 30+ days -> stale, 90+ -> moved to .archive/ as archived (a stale note used again is
    active); (3) consolidate: while two live notes reach SIMILARITY_THRESHOLD, fold the weaker
    (lower confidence, then use_count, then older) into the stronger, whose `supersedes` names the
    weaker, and move the weaker to .archive/ as archived; (4) regenerate INDEX.md.

    Idempotent: a second run with the same `today` finds nothing to change and, because a
    snapshot is taken only when something will change, writes nothing at all.
    """
    summary = CurateSummary(root=root)
    if not (root / NOTES_DIR).is_dir():
        return summary
    notes = load_notes(root)
    summary.protected = [n.name for n in notes if n.protected]
    live: dict[str, Note] = {}
    to_archive: list[Note] = []
    for note in notes:
        if note.protected:
            continue
        state = _aged_state(note, today)
        if state == "archived":
            to_archive.append(dataclasses.replace(note, state="archived"))
            summary.archived.append(note.name)
            continue
        live[note.name] = dataclasses.replace(note, state=state)
    for weaker, stronger in _consolidate(live):
        to_archive.append(dataclasses.replace(weaker, state="archived"))
        summary.merged.append((weaker.name, stronger.name))
    before = {n.name: n.state for n in notes}
    for name, note in sorted(live.items()):  # a merged note takes the age of its latest use
        live[name] = note = dataclasses.replace(note, state=_aged_state(note, today))
        if note.state != before[name]:
            (summary.staled if note.state == "stale" else summary.revived).append(name)
    survivors = [n for n in notes if n.protected] + list(live.values())
    changed = [n for n in live.values() if render_note(n) != n.text]
    index_path = root / INDEX_FILE
    index_current = index_path.read_text(encoding="utf-8") if index_path.is_file() else None
    if not changed and not to_archive and index_current == render_index(survivors):
        summary.index = _index_report(root, index_lines(survivors), False)
        return summary

    summary.snapshot = _snapshot(root, clock().strftime("%Y%m%dT%H%M%SZ"))
    for note in changed:
        save_note(note)
    for note in to_archive:
        assert note.path is not None
        save_note(note)
        os.replace(note.path, _unique(root / ARCHIVE_DIR / note.path.name))
    summary.index = _write_index(root, load_notes(root))
    return summary
