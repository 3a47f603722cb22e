"""When two notes cover the same ground: their terms (a small stemmer and stop list of their own),
Jaccard similarity over tags and terms, and merging two notes' bodies line by line.
"""

from __future__ import annotations

import functools
import re

from perpetuity_core.notes.library import slugify
from perpetuity_core.notes.model import CONFIDENCE, Note, _render_body, split_sections

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

