"""When two notes cover the same ground: their terms, Jaccard similarity over tags and terms, and
merging two notes' bodies line by line.

Terms are the memory's: memory.dictionary's words (runs of letters and digits) and its stemmer,
so a note is matched on the same words a memory search sees. Notes once had a tokeniser of their
own that also kept `node.js`, `docker-compose`, `c++` whole; on the tests' notes that moved no
decision (figures at SIMILARITY_THRESHOLD). What it costs: `c++` and `c#` are the single letter
`c`, left out, so such a note is found by its other words, as in the memory.
"""

from __future__ import annotations

import functools
import re

from perpetuity_core.memory.storage import dictionary
from perpetuity_core.notes.library import slugify
from perpetuity_core.notes.model import CONFIDENCE, Note, render_body, split_sections

# Two notes cover the same ground when similarity() >= SIMILARITY_THRESHOLD: TAG_SHARE * Jaccard
# of normalised tags + (1 - TAG_SHARE) * Jaccard of the terms of name, description and body. The
# same threshold decides whether capture patches a note, so capture never writes what curate
# would merge at once. It sits between two problems under identical tags and two wordings of one
# lesson: `pytest tests/test_notes.py` (the pairs' scores: docs/tuning.md).
TAG_SHARE = 0.3
SIMILARITY_THRESHOLD = 0.45

# When two notes merge, a line of the weaker one is left out if its terms overlap a line of the
# stronger one by this Jaccard or more ("Set --import-mode=importlib" vs "Use ..." scores 0.80).
LINE_DUPLICATE_THRESHOLD = 0.75


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
    return render_body(preamble, result)


# Words every task or every note says (generic verbs, "error", section headings), on top of the
# memory's own stop words, so that matching rests on tools, errors, frameworks and domain nouns.
_NOTE_WORDS = """
    etc via vs per ok yes please help need needs want wants try tried trying make makes made fix
    fixed fixes fixing use used uses using work works worked working run runs ran running thing
    things way new add added create update change changed look see show tell know like still issue
    issues problem problems bug bugs error errors fail fails failed failing failure wrong broken
    task code file files one two first next step steps sure good well today something anything
    everything procedure pitfalls pitfall verification verify note notes lesson
"""
STOP_WORDS = dictionary.STOP_WORDS | frozenset(_NOTE_WORDS.split())
# The notes' own words are compared after stemming too, so that every form of one is left out
# ("fixes" -> "fix"); the memory's stop words only as words, as the memory compares them.
_STOP_STEMS = frozenset(dictionary.stem(w) for w in _NOTE_WORDS.split())


def _keep(word: str, stem: str) -> bool:
    if word in STOP_WORDS or stem in _STOP_STEMS or len(stem) < 2:
        return False
    if stem.isdigit():
        return len(stem) >= 3  # status and exit codes (404, 137) are evidence; "1", "42" are not
    return any(c.isalpha() for c in stem)


def terms(text: str) -> frozenset[str]:
    """The stems of a text's words as the memory's dictionary splits and stems them (runs of
    letters and digits: `node.js` is `nod` and `js`, `docker-compose` is `docker` and `compos`),
    minus stop words, single letters and short numbers."""
    found: set[str] = set()
    for word in dictionary.shipped().words(text):
        stem = dictionary.stem(word)
        if _keep(word, stem):
            found.add(stem)
    return frozenset(found)


@functools.lru_cache(maxsize=4096)
def tag_terms(note: Note) -> frozenset[str]:
    """Terms of the tags, parts included, for recall: "collection" finds `test-collection`."""
    return terms(" ".join(note.tags))


@functools.lru_cache(maxsize=4096)
def tag_set(note: Note) -> frozenset[str]:
    """The tags themselves, normalised, for similarity: parts would inflate the union."""
    return frozenset(dictionary.stem(slugify(t)) for t in note.tags if slugify(t))


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


def strength(note: Note) -> tuple[int, int, str, str]:
    """Stronger first when sorted descending: confidence, then use, then the newer note."""
    return (CONFIDENCE.index(note.confidence), note.use_count, note.created or "", note.name)

