"""Writing a note: the note_capture tool's rules and schema, and writing or patching exactly
one note from its fields, after a credential scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from perpetuity_core.memory.storage.secrets import scan_credentials
from perpetuity_core.notes.library import (
    IndexReport,
    load_notes,
    save_note,
    slugify,
    write_atomic,
    write_index,
)
from perpetuity_core.notes.model import (
    CONFIDENCE,
    NOTES_DIR,
    SECTIONS,
    CredentialError,
    Note,
    NoteError,
    render_body,
    render_note,
)
from perpetuity_core.notes.similarity import SIMILARITY_THRESHOLD, merge_bodies, similarity


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


CAPTURE_TOOL_NAME = "note_capture"

# The definition rides along with every request that carries our tools and is read on every
# call of a conversation (its rules and schema were 529 tokens, a third of our definitions):
# each rule said once, in few words.
CAPTURE_RULES = """\
At the end of a task, capture one note only when it taught something worth keeping: a \
workflow of 5 or more steps that worked, a recovery from a non-obvious error, a correction \
from the user, a quirk of the environment. Skip trivial tasks, facts cheaper to re-derive, \
session ephemera and secrets (say where a secret comes from instead). Reusing the name of a \
note you were shown patches it.\
"""

_CAPTURE_REQUIRED = ("name", "description", "tags", "when", "procedure", "pitfalls", "verification")

CAPTURE_TOOL_SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "Kebab-case slug, e.g. 'pytest-import-mismatch'."},
        "description": {"type": "string",
                        "description": "One line: what it fixes, when to reach for it."},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                 "description": "Tools, errors, frameworks, domain nouns."},
        "source_task": {"type": "string"},
        "confidence": {"type": "string", "enum": list(CONFIDENCE), "default": "medium",
                       "description": "tentative: a lead not verified."},
        "when": {"type": "string", "description": "When it applies."},
        "procedure": {"type": "string", "description": "The steps that worked, in order."},
        "pitfalls": {"type": "string"},
        "verification": {"type": "string", "description": "How to tell it worked."},
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
        body=render_body("", [(h, c) for h, c in sections if c]),
    )


def fold_notes(stronger: Note, weaker: Note) -> Note:
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
        write_atomic(path, text)
        action = "created"
    else:
        merged = fold_notes(target, candidate)
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
    index = write_index(root, load_notes(root))
    assert note.path is not None
    return CaptureResult(action, note.name, note.path, index, score)

