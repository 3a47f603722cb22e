"""The question's subject: whom it asks about, and the rows that person said, ranked higher.

A question about a person is answered by what that person said. On LoCoMo 95% of the evidence
turns of the multi-hop and open-domain questions the ranking missed within 4,000 tokens were
said by the person the question names, sharing little but the name with it, while 41% of the
rows taken before them were another speaker's ("Caroline: Thanks, Melanie!").
So among a question's first DEPTH hits, a row said by its subject ranks as if it scored
(1 + SUBJECT) times its score; the hits keep their scores (the cap reads their spread, and the
scan's top-k stays the fused score's). Who the subject is:

- a speaker a transcript labels ("Melanie: ...", as the LoCoMo importer writes a turn) whom
  the question names, when it names exactly one of the hits' speakers;
- else, a question in the first person ("my sprint") is about the person using the memory:
  their own turns (the user's, unlabelled).

Trials and figures: docs/tuning.md.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from perpetuity_core.memory.derived.scan import Hit

# A subject's row ranks as if (1 + SUBJECT) times as good (a chat's fill weighs it by its own
# frame_select.FILL_SUBJECT): 0.5 to 3 measured on LoCoMo, per conversation and pooled
# (docs/tuning.md).
SUBJECT = 1.0
# The hits re-ordered: the frame's own (frame_read.HITS), so the frame and the ranking measured
# beside it (`perpetuity eval`, read deeper) order their first rows alike.
DEPTH = 200
# A transcript's speaker label: one to three capitalised words and a colon opening the row.
_LABEL = re.compile(r"([A-Z][\w'.-]*(?: [A-Z][\w'.-]*){0,2}): ")
_FIRST_PERSON = re.compile(r"\b(?:i|me|my|mine|myself)\b", re.IGNORECASE)
_WORD = re.compile(r"\w+")


@functools.lru_cache(maxsize=4096)
def label(text: str) -> str | None:
    """The speaker a transcript's row is labelled with, or None. Kept for the latest texts, as
    frame_stretch.names: the next question reads most of the same rows (0.14 ms for 500 rows
    afresh, 0.02 kept)."""
    m = _LABEL.match(text)
    return m.group(1) if m else None


def _words(text: str) -> str:
    return " ".join(_WORD.findall(text))


def said(query: str, spoken: list[tuple[str, str]]) -> list[bool] | None:
    """Which of the rows `spoken` ((text, role) each) the question's subject said, or None
    when it has none."""
    labels = [label(text) for text, _ in spoken]
    # As written: "Melanie's" names Melanie; "the update" names no "Update: ..." label.
    words = f" {_words(query)} "
    named = {s for s in set(labels) if s is not None and f" {_words(s)} " in words}
    if len(named) == 1:
        return [s in named for s in labels]
    if not named and _FIRST_PERSON.search(query):
        return [s is None and role == "user" for s, (_, role) in zip(labels, spoken, strict=True)]
    return None


def ranked(query: str, hits: list[Hit], owner: int | None = None) -> list[Hit]:
    """`hits` (best first) with the first DEPTH re-ordered: the subject's rows at (1 + SUBJECT)
    times their score, ties in their order; the rest after them as they were. As they were when
    the question has no subject. With `owner` (a shared pool, which ranks the asker's own rows
    first), that user's rows stay before the others'."""
    head = hits[:DEPTH]
    flags = said(query, [(h.text, h.role) for h in head])
    if flags is None:
        return hits
    scores = np.fromiter((h.score for h in head), np.float64, len(head))
    scores *= np.where(flags, 1.0 + SUBJECT, 1.0)
    # One stable sort of arrays, not a Python key per hit: ties keep the scan's order.
    if owner is None:
        order = np.argsort(-scores, kind="stable")
    else:
        others = np.fromiter((h.user_id != owner for h in head), bool, len(head))
        order = np.lexsort((np.arange(len(head)), -scores, others))
    return [head[k] for k in order.tolist()] + hits[DEPTH:]
