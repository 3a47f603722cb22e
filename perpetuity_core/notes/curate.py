"""Curate: snapshot, age, consolidate, reindex. Never deletes, never touches a pinned or
hand-authored note.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path

from perpetuity_core.notes.library import (
    IndexReport,
    index_lines,
    index_report,
    load_notes,
    render_index,
    save_note,
    write_index,
)
from perpetuity_core.notes.model import ARCHIVE_DIR, INDEX_FILE, NOTES_DIR, Note, render_note
from perpetuity_core.notes.similarity import SIMILARITY_THRESHOLD, similarity, strength
from perpetuity_core.notes.write import fold_notes

# Ageing, counted in whole days from last_used (or created, if the note was never used):
# 30 or more days unused -> state: stale; 90 or more -> moved to .archive/ with state: archived.
STALE_AFTER_DAYS = 30
ARCHIVE_AFTER_DAYS = 90


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
        stronger, weaker = (x, y) if strength(x) >= strength(y) else (y, x)
        # `supersedes` holds one name: the latest fold. The weaker keeps its own link in
        # .archive/, so the chain of what was folded stays readable there and in the snapshot.
        folded = dataclasses.replace(fold_notes(stronger, weaker), supersedes=weaker.name)
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
        summary.index = index_report(root, index_lines(survivors), False)
        return summary

    summary.snapshot = _snapshot(root, clock().strftime("%Y%m%dT%H%M%SZ"))
    for note in changed:
        save_note(note)
    for note in to_archive:
        assert note.path is not None
        save_note(note)
        os.replace(note.path, _unique(root / ARCHIVE_DIR / note.path.name))
    summary.index = write_index(root, load_notes(root))
    return summary

