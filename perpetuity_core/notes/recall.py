"""Recall and use: the notes a task's terms match (tags weighted), and marking the notes a reply
cited as used.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from perpetuity_core.notes.library import (
    index_lines,
    index_report,
    load_notes,
    save_note,
    write_index,
)
from perpetuity_core.notes.model import Note
from perpetuity_core.notes.similarity import body_terms, strength, tag_terms, terms

# Recall scores each distinct task term once, at its best weight: a tag term 3, a term of the
# name or description 2, a body term 1. A note loads in full at RECALL_MIN_SCORE or more, at
# most RECALL_MAX_NOTES of them, best first.
TAG_WEIGHT = 3
DESCRIPTION_WEIGHT = 2
BODY_WEIGHT = 1
RECALL_MIN_SCORE = 1
RECALL_MAX_NOTES = 5


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
        return index_report(self.root, self.index_lines, False).over_budget

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
    for note in sorted(notes, key=strength):
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
        found.values(), key=lambda f: (-f[1], [-x for x in strength(f[0])[:2]], f[0].name)
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
        write_index(root, load_notes(root))
    return updated

