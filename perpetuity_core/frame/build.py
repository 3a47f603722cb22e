"""The frame: past turns, quoted verbatim from the store, that replace the re-sent history.

A frame is built in three steps, each its own module: read what it may show (frame_read: the
scan's hits, the warm set, the conversation's latest stretch, as plain data; every database
read is there), select what enters (frame_select: by heat, within the breadth-sized cap) and
render it as the model reads it (frame_render). Selection and rendering are pure: what the
model reads follows from the rows read alone.

An addendum is built the same way for a new prompt under a frame that stays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from perpetuity_core.frame import cap, subject
from perpetuity_core.frame import lean as frame_lean
from perpetuity_core.frame import read as frame_read
from perpetuity_core.frame import render as frame_render
from perpetuity_core.frame import select as frame_select
from perpetuity_core.frame import stretch as frame_stretch
from perpetuity_core.frame.read import NEIGHBOUR_HITS, NEIGHBOURS, search
from perpetuity_core.frame.render import CLOSING, HEADER, MORE_HEADER, NOW, with_note
from perpetuity_core.frame.render import messages as render
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Message

# What callers used from here before the split (serve, cli, scripts, tests).
__all__ = ["CLOSING", "HEADER", "MORE_HEADER", "NEIGHBOURS", "NEIGHBOUR_HITS", "NOW", "Frame",
           "addendum", "build", "search", "with_note"]


@dataclass(slots=True)
class Frame:
    messages: list[Message]
    item_ids: list[int]
    budget: int
    tokens: int
    left_out: int  # warm rows the cap left out
    now: float  # the user's clock
    reheats: dict[int, float] = field(default_factory=dict)  # own rows only; written unless probing
    below_cap: list[int] = field(default_factory=list)  # this turn's hits left out, best first
    hits: list[int] = field(default_factory=list)  # this turn's hits rendered, best first
    # For inspection (perpetuity_core.serve.inspection), references only, read after the reply: the
    # ranked hits with their scores, the rows considered, the warm set, and why each row that
    # could not be left out was in.
    ranked: list[Hit] = field(default_factory=list)
    rows: dict[int, Row] = field(default_factory=dict)
    warm: heat.Warm | None = None
    must: dict[int, str] = field(default_factory=dict)
    lean: frame_lean.Lean = ()  # a chat's leaning after this question (frame_lean.after)
    asked: frame_lean.Asked = frame_lean.FRESH  # a chat's, after this question (moved)


def build(scanner: Scanner, *, user_id: int, conversation_id: int | None, query: str,
          exclude_messages: Iterable[int], asked_at: float, limits: cap.Cap,
          recent_messages: Iterable[int] = (), kept_tokens: int = 0,
          narrow: bool = False, agent: bool = False,
          said: frame_render.Said | None = None, lean: frame_lean.Lean = (),
          asked: frame_lean.Asked = frame_lean.FRESH) -> Frame | None:
    """The frame for one question, or None when memory holds nothing to show. Reads only.

    Never trimmed: the question's top hit and the latest stretch of the conversation that the
    harness did not keep as sent (`recent_messages`, its rows newest first while they fit
    frame_stretch.RECENT_TOKENS, skipping bulk over RECENT_ROW). `kept_tokens`: the harness's
    earlier turns kept as sent in front of the prompt, which the breadth-sized budget pays for
    (frame_select.budget). A `narrow` frame is filled within a narrow question's budget: an
    agent's (a harness that sends tools of its own) in front of a conversation it keeps whole,
    other conversations' memory that every tool round re-reads and the recall tools, riding
    from the first call, reach anyway. A chat's frame that stands in for dropped history keeps
    the breadth-sized budget; an `agent`'s with a latest stretch is that stretch alone
    (frame_select.frame: what its fill added was re-read by every tool round and held little
    the next step used). Messages `said` before are the objects made then (frame_render.Said).
    A chat's `lean` is what its earlier questions were about, and `asked` when (frame_lean).
    """
    excluded = set(exclude_messages)
    found = frame_read.retrieve(scanner, query, user_id, asked_at, excluded, chat=not agent,
                                lean=lean)
    # A chat's fill counts its hits' neighbours at a share (frame_select.fill_reheats); the
    # reheats written (`_frame`) are the search's own.
    seen = found if agent else replace(found, reheats=frame_select.fill_reheats(found.reheats,
                                                                                found.hits))
    # A chat's rows of a conversation it comes back to did not cool while it was away.
    moved = asked if agent else frame_lean.moved(asked, frame_lean.about(found.hits, lean),
                                                 found.now)
    paused = () if agent else frame_lean.paused(moved, found.now, frame_lean.shares(found.hits))
    warm, shelf = frame_read.for_frame(scanner, seen, user_id, excluded, recent_messages,
                                       1.0 if agent else heat.CARRIED, paused)
    tokens = limits.floor if narrow else frame_select.budget(found.hits, limits, kept_tokens,
                                                                     chat=not agent)

    def measured(base: list[int], added: list[int], recent: Collection[int],
                 excerpts: Mapping[int, Row]) -> Callable[[int], int]:
        # Measured as rendered, never laid out: most measures are of frames the fill drops.
        rows = {**shelf.rows, **excerpts} if excerpts else shelf.rows
        return frame_render.prefix_tokens(rows, base, added, recent, shelf.adjacent, asked_at,
                                          conversation_id, apart=agent)

    # A chat's fill weighs its question's subject's rows higher, as its search ranks them.
    flags = None if agent else subject.said(query, [(r.text, r.role) for r in shelf.rows.values()])
    by_subject = set(itertools.compress(shelf.rows, flags)) if flags else set()
    chosen = frame_select.frame(shelf.rows, warm, found.hits, shelf.half, shelf.recent,
                                tokens, limits, measured, agent, by_subject, lean,
                                None if agent else _around(scanner, query))
    if not chosen.item_ids:
        return None
    rows = {**shelf.rows, **chosen.excerpts} if chosen.excerpts else shelf.rows
    laid = frame_render.lay(rows, chosen.item_ids, chosen.recent, shelf.adjacent, asked_at,
                            conversation_id)
    built = _frame(frame_render.written(laid, asked_at, said=said, apart=agent), chosen,
                   found, tokens, warm.foreign)
    built.warm = warm
    built.lean = () if agent else frame_lean.after(lean, found.hits)
    built.asked = moved
    return built


def _around(scanner: Scanner, query: str) -> Callable[[Row], Row]:
    """A row as the lines around the question's words (frame_stretch.around): a word is one
    when the dictionary folds it onto one of the question's terms (its stem)."""
    d = scanner.db.dictionary
    asked, known = set(d.id_list(query)), d.word_ids

    def one(word: str) -> bool:
        # A known word by one lookup; the rest (a plural, a number) as the index reads them.
        term = known.get(word)
        return term in asked if term is not None else bool(asked & set(d.id_list(word)))

    return lambda r: frame_stretch.around(r, one)


def addendum(scanner: Scanner, *, user_id: int, conversation_id: int | None, query: str,
             exclude_messages: Iterable[int], shown: Collection[int], asked_at: float,
             limits: cap.Cap, kept_tokens: int = 0,
             said: frame_render.Said | None = None) -> Frame | None:
    """Memory from other conversations for a chat's new prompt in a conversation whose frame
    stays as it was: the question's hits there in rank order while they fit in the budget a
    new frame would have (frame_select.budget, `kept_tokens` what a new frame's request would
    keep as sent), those already in front of the model (`shown`) counted but not sent again;
    None when every such hit is in front.

    It is rendered like a frame and goes just before the prompt, so the request still only
    grows at its end (the provider's cached prefix holds). Rank order, not warmth: what earlier
    prompts made warm is already in front, and an addendum serves this prompt alone. This
    conversation's own earlier turns are left to the next frame (and the recall tools): on the
    shared Claude Code sessions, addenda of them cost 0.04 of direct and kept fewer of the
    identifiers a next reply used.
    """
    excluded = set(exclude_messages)
    found = frame_read.retrieve(scanner, query, user_id, asked_at, excluded)
    hits = [h for h in found.hits if h.conversation_id != conversation_id]
    if not hits:
        return None
    shelf = frame_read.for_addendum(scanner, hits, excluded)
    tokens = frame_select.budget(hits, limits, kept_tokens, chat=True)
    chosen = frame_select.addendum(shelf.rows, hits, shelf.half, shown, tokens, limits,
                                   _around(scanner, query))
    if not chosen.item_ids:
        return None
    more = render(chosen.considered, chosen.item_ids, (), shelf.adjacent, asked_at,
                  conversation_id, header=MORE_HEADER, said=said)
    return _frame(more, chosen, found, tokens, frozenset())


def _frame(messages: list[Message], chosen: frame_select.Selection, found: frame_read.Found,
           tokens: int, foreign: frozenset[int]) -> Frame:
    shown = set(chosen.item_ids)
    own_reheats = {i: peak for i, peak in found.reheats.items() if i not in foreign}
    return Frame(messages, chosen.item_ids, tokens, messages_tokens(messages),
                 len(chosen.considered) - len(chosen.item_ids), found.now, own_reheats,
                 [h.item_id for h in found.hits if h.item_id not in shown],
                 [h.item_id for h in found.hits if h.item_id in shown], found.hits,
                 chosen.considered, must=chosen.must)
