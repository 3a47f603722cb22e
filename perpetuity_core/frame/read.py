"""The frame's reads: everything a frame or an addendum is chosen from, read from the scan and
the store and returned as plain data. Every database read the frame makes is here;
frame_select and frame_render then work from these values alone.

A question is first searched (`retrieve`: its hits, the reheats they bring, the user's clock),
then the rows it may show are read (`for_frame`: the warm set and the conversation's latest
stretch; `for_addendum`: the hits alone), each with the other half of the top hit's exchange
and which of their messages follow one another in the store (for the labels).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from perpetuity_core.frame import dates, subject
from perpetuity_core.frame import lean as frame_lean
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.storage.reads import (
    Row,
    around,
    following,
    items_of,
    next_spoken,
    shown_rows,
)

# The ranked rows a question's retrieval reheats: a broad question's evidence lies deep in the
# ranking (470dd1a, with the fill by warmth per token: BEAM recall_all 0.530 -> 0.749 from 100
# to 200 hits, LoCoMo 0.834 -> 0.831).
HITS = 200
# The messages each side of a hit that warm with it, and the hits whose neighbours warm: the
# question and its answer travel together, and beyond the 20th hit a reheat is no hotter than
# a newborn row (heat.REHEAT_RANK_SCALE). Chosen with the first frame, not measured since.
NEIGHBOURS = 2
NEIGHBOUR_HITS = 20


@dataclass(slots=True)
class Found:
    """A question's retrieval: its hits best first, the peaks they reheat (heat.rank_reheats:
    the warm set is read with them) and the user's clock."""

    hits: list[Hit]
    reheats: dict[int, float]
    now: float


@dataclass(slots=True)
class Shelf:
    """The rows a frame or an addendum is chosen from, with what choosing and rendering them
    needs to know of the store."""

    rows: dict[int, Row]  # item id -> row, every row that may be shown, none excluded
    # Pairs of these rows' messages (ids ascending) with nothing stored between them.
    adjacent: frozenset[tuple[int, int]]
    half: list[int]  # the rows of the other half of the top hit's exchange, shown or not
    recent: list[int] = field(default_factory=list)  # the latest stretch's rows, store order


def search(scanner: Scanner, query: str, user_id: int, asked_at: float,
           excluded: Collection[int] = frozenset(), limit: int = HITS,
           chat: bool = True, lean: frame_lean.Lean = ()) -> list[Hit]:
    """A question's hits, best first, outside the `excluded` messages; when the question names
    a date, the rows said then come first, each part in the scan's order (LoCoMo recall_all,
    `perpetuity eval`: 0.830 without, 0.844 with, at the same mean frame; 200 of its 1,535
    questions name a date); within each part, for a `chat`, the rows said by whom the question
    is about rank higher (frame_subject; an agent's prompt is left as measured), a shared
    pool's own rows still first. A chat's `lean` (frame_lean) may name another conversation
    than the best row's to rank as its own memory would."""
    owner = user_id if scanner.share_pool and not scanner.one_person else None
    during = dates.window(query, asked_at)
    found: list[Hit] = []
    for span in ([during] if during else []) + [None]:
        seen = {h.item_id for h in found}
        # At least the hits the subject re-orders, so a shallower read orders its rows alike.
        depth = max(limit, subject.DEPTH) + len(excluded)
        hits = scanner.search(query, user_id, limit=depth, during=span)
        if lean and hits and (c := frame_lean.about(hits, lean)) != hits[0].conversation_id:
            hits = scanner.search(query, user_id, limit=depth, during=span, again=c)
        hits = [h for h in hits if h.message_id not in excluded]
        hits = subject.ranked(query, hits, owner) if chat else hits
        found += [h for h in hits if h.item_id not in seen]
    return found[:limit]


def retrieve(scanner: Scanner, query: str, user_id: int, asked_at: float,
             excluded: set[int], chat: bool = True, lean: frame_lean.Lean = ()) -> Found:
    """A question's hits (`search`), the reheats they bring (peaks by rank, neighbours warming
    with them) and the user's clock."""
    hits = search(scanner, query, user_id, asked_at, excluded, chat=chat, lean=lean)
    reheats = heat.rank_reheats([h.item_id for h in hits],
                                _neighbours(scanner, hits[:NEIGHBOUR_HITS], excluded))
    return Found(hits, reheats, heat.clock(scanner.db, user_id))


def for_frame(scanner: Scanner, found: Found, user_id: int, excluded: set[int],
              recent_messages: Iterable[int], carried: float,
              paused: Sequence[heat.Paused] = ()) -> tuple[heat.Warm, Shelf]:
    """What a frame is chosen from: the warm set (with this question's reheats, earlier warmth
    counted at `carried`, what a chat left warm in `paused` conversations not cooled by their
    pauses: heat.warm_set), and the warm rows, the rows of `recent_messages` (the latest stretch of
    the conversation) and the top hit's other half."""
    db, recent = scanner.db, set(recent_messages) - excluded
    warm = heat.warm_set(db, user_id, found.now, found.reheats, carried, paused)
    recent_items = items_of(db, recent)
    warm_ids = warm.item_ids.tolist()
    seen = set(warm_ids)
    rows = _rows(scanner, warm_ids + [i for i in recent_items if i not in seen], excluded)
    half = _other_half(scanner, found.hits[0], excluded) if found.hits else []
    return warm, Shelf(rows, _adjacent(scanner, rows), half, recent_items)


def for_addendum(scanner: Scanner, hits: list[Hit], excluded: set[int]) -> Shelf:
    """What an addendum is chosen from: the rows of `hits` (best first, at least one) and of
    the top hit's other half."""
    half = _other_half(scanner, hits[0], excluded)
    rows = _rows(scanner, [h.item_id for h in hits], excluded) | _rows(scanner, half, excluded)
    return Shelf(rows, _adjacent(scanner, rows), half)


def _neighbours(scanner: Scanner, hits: list[Hit], excluded: set[int]) -> list[tuple[int, int]]:
    """(rank, item_id) of the rows in the messages around each hit, in its conversation."""
    return [(rank, item) for rank, item, message in
            around(scanner.db, [(h.conversation_id, h.message_id) for h in hits], NEIGHBOURS)
            if message not in excluded]


def _other_half(scanner: Scanner, hit: Hit, excluded: set[int]) -> list[int]:
    """The rows of the other half of a hit's exchange: the reply to it, or the question it
    answers. The two travel together; either alone is often not the answer."""
    row = next_spoken(scanner.db, hit.conversation_id, hit.message_id, after=hit.role == "user")
    other = row[0] if row and row[1] != hit.role and row[0] not in excluded else None
    return items_of(scanner.db, {other} if other else set())


def _rows(scanner: Scanner, item_ids: list[int], excluded: set[int]) -> dict[int, Row]:
    # No owner filter: in a shared pool the reheated hits may be another user's rows.
    return {i: r for i, r in shown_rows(scanner.db, item_ids).items()
            if r.message_id not in excluded}


def _adjacent(scanner: Scanner, rows: dict[int, Row]) -> frozenset[tuple[int, int]]:
    """Pairs of the rows' messages with nothing stored between them, per conversation. What
    any subset of the rows renders follows from these: two of its messages follow one another
    in the store exactly when nothing stored lies between them, so no row read here either,
    which makes them a pair here too."""
    # Each shown message's predecessor among the shown ones of its conversation, in one walk
    # of their ids ascending.
    conversation_of = {r.message_id: r.conversation_id for r in rows.values()}
    last: dict[int, int] = {}
    pairs = []
    for message in sorted(conversation_of):
        conversation = conversation_of[message]
        if (before := last.get(conversation)) is not None:
            pairs.append((before, message))
        last[conversation] = message
    return following(scanner.db, pairs)
