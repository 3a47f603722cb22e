"""Which conversation a chat's question is about: its own hits, and what the chat asked before.

In a person's memory a question's words often match another conversation better than the one
it is about ("John" in three of LoCoMo's ten). The chat asking keeps asking about the same
one: on LoCoMo `--personal` the conversation most of a question's hits were in was another
one for 68 of 1,535 questions, and the chat's earlier questions pointed to the right one for
63 of them, and to a wrong one for none where the hits were right (docs/tuning.md).

So a chat carries its leaning from question to question (in its plan): each question's
`shares` (its hits' reheat peaks by rank, heat.reheat_peak, per conversation, summing to 1),
the earlier ones at KEPT per question since. A question is about the conversation its hits
reach with the most share plus PRIOR times the leaning's (`about`), and that conversation is
ranked as its own memory would rank it (scan.Scanner.search's `again`); the fill weighs each
conversation's warm rows by its share of their warmth, tipped so too (`weighed`).

A chat also keeps when it was away from each conversation it asked about (`Asked`): a
conversation's rows cool only while the chat is about it, so the rows its earlier questions
left warm are as warm when the chat comes back to it as when it left (heat.Paused).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.scan import Hit

# An earlier question's part of the leaning, kept per question since; the leaning's weight
# against this question's own shares. LoCoMo `--personal` (docs/tuning.md).
KEPT = 0.8
PRIOR = 1.0
FORGOTTEN = 0.01  # a part below this is dropped: a plan holds a few conversations, not all

# (conversation id, its part), conversations ascending: a plan's field, so immutable.
Lean = tuple[tuple[int, float], ...]


def shares(hits: Sequence[Hit]) -> dict[int, float]:
    """Each conversation's share of the hits' reheat peaks by rank (summing to 1)."""
    mass: dict[int, float] = {}
    for h, peak in zip(hits, heat.rank_peaks(len(hits)), strict=False):
        mass[h.conversation_id] = mass.get(h.conversation_id, 0.0) + peak
    total = sum(mass.values())
    return {c: m / total for c, m in mass.items()} if total > 0 else {}


def about(hits: Sequence[Hit], lean: Lean) -> int | None:
    """The conversation of the hits with the most share plus PRIOR times its share of the
    chat's leaning (ties to the lower id); None without hits."""
    own = shares(hits)
    return min(own, key=lambda c: (-tipped(own, lean, c), c), default=None)


def tipped(own: Mapping[int, float], lean: Lean, c: int) -> float:
    """Conversation `c`'s part of `own` (shares summing to 1) plus PRIOR times its share of
    the chat's leaning."""
    total = sum(part for _, part in lean)
    prior = dict(lean).get(c, 0.0) / total if total > 0 else 0.0
    return own.get(c, 0.0) + PRIOR * prior


def weighed(mass: Mapping[int, float], lean: Lean) -> dict[int, float]:
    """Each conversation's `mass` (a chat's fill: its warm rows' warmth, frame_select.focus)
    as its share, tipped by the chat's leaning."""
    total = sum(mass.values())
    if not lean or total <= 0:
        return dict(mass)
    own = {c: m / total for c, m in mass.items()}
    return {c: tipped(own, lean, c) for c in own}


def after(lean: Lean, hits: Sequence[Hit]) -> Lean:
    """The chat's leaning once a question found `hits`."""
    out = {c: KEPT * part for c, part in lean}
    for c, share in shares(hits).items():
        out[c] = out.get(c, 0.0) + share
    return tuple(sorted((c, part) for c, part in out.items() if part >= FORGOTTEN))


AWAY = float("inf")  # a span's end while the chat is still away
SPANS = 100  # the conversations a chat keeps its time away from, the latest left first
# A conversation the chat left whose rows this question's hits reach with this share: its
# pause counts too, as the one it is about (`about` names another when the chat's leaning
# lags a change of subject). BEAM's switching chat (docs/tuning.md).
REACH = 0.05


@dataclass(frozen=True, slots=True)
class Asked:
    """What a chat's latest question was about, and its time away from the conversations it
    asked about before: (conversation id, the clock when the chat left it, the clock when it
    came back or AWAY), the latest left first."""

    subject: int | None = None
    spans: tuple[tuple[int, float, float], ...] = ()


FRESH = Asked()  # a chat's first question, or one whose plan was forgotten


def moved(asked: Asked, subject: int | None, now: float) -> Asked:
    """The chat's `asked` once a question about `subject` came at clock position `now`: the
    conversation it leaves is left now, the one it comes back to came back now. A span whose
    end is past heat.WINDOW holds nothing warm: it goes."""
    spans = {c: (left, back) for c, left, back in asked.spans}
    if asked.subject is not None and asked.subject != subject:
        spans[asked.subject] = (now, AWAY)
    if subject in spans and spans[subject][1] == AWAY:
        spans[subject] = (spans[subject][0], now)
    kept = sorted(((c, left, back) for c, (left, back) in spans.items()
                   if now - back <= heat.WINDOW), key=lambda s: (-s[1], s[0]))
    return Asked(subject, tuple(kept[:SPANS]))


def paused(asked: Asked, now: float, reach: Mapping[int, float]) -> tuple[heat.Paused, ...]:
    """The pauses to count at clock position `now` (after `moved`): the conversation the chat
    is now about, and each other one it left that the question's hits `reach` (their shares)
    with at least REACH."""
    return tuple(heat.Paused(c, left, min(back, now)) for c, left, back in asked.spans
                 if c == asked.subject or reach.get(c, 0.0) >= REACH)
