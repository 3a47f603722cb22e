"""The frame: past turns, quoted verbatim from the store, that replace the re-sent history.

What enters is decided by heat; how much, by the breadth-sized cap. This turn's retrieval
reheats its hits (peaks by rank, neighbours warming with them), then the warm rows that give
the most warmth per token are rendered until the budget is spent, the top hit always among
them. Rows are grouped by conversation, the current one last, oldest first within each, and
labelled with a time resolved now: the absolute date and how many days before the live
question, whose own time closes the frame.

The result is neutral messages that alternate user and assistant, all plain text (a tool call
from memory is quoted, not replayed), so any protocol accepts them before the turns the harness
keeps as it sent them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np

from perpetuity_core.memory import cap, dates, heat
from perpetuity_core.memory.index import messages_tokens, token_estimate
from perpetuity_core.memory.rows import (
    Row,
    adjacent_pairs,
    around,
    items_of,
    next_spoken,
    quoted,
    shown_rows,
    time_label,
)
from perpetuity_core.memory.scan import Hit, Scanner
from perpetuity_core.memory.store import Database
from perpetuity_core.memory.tenants import withheld
from perpetuity_core.wire.conversation import Kind, Message, Part

HITS = 200  # the ranked rows this turn's retrieval reheats
NEIGHBOURS = 2  # messages each side of a hit that warm with it
NEIGHBOUR_HITS = 20  # the hits whose neighbours warm
HEADER = ("[Memory: turns quoted verbatim from earlier conversations, grouped by conversation "
          "with this one last, labelled with when they were said; [...] marks turns left out.]")
MORE_HEADER = ("[Memory for the next message: more turns quoted verbatim from earlier"
               " conversations, labelled with when they were said.]")
CLOSING = "[End of quoted memory.]"
NOW = "[End of quoted memory. Now: {:%Y-%m-%d %H:%M} UTC.]"


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
    # For inspection (perpetuity_core.inspection), references only, read after the reply: the
    # ranked hits with their scores, the rows considered, the warm set, and why each row that
    # could not be left out was in.
    ranked: list[Hit] = field(default_factory=list)
    rows: dict[int, Row] = field(default_factory=dict)
    warm: heat.Warm | None = None
    must: dict[int, str] = field(default_factory=dict)


def build(scanner: Scanner, *, user_id: int, conversation_id: int | None, query: str,
          exclude_messages: Iterable[int], asked_at: float, limits: cap.Cap,
          recent_messages: Iterable[int] = ()) -> Frame | None:
    """The frame for one question, or None when memory holds nothing to show. Reads only.

    Never trimmed: the question's top hit and the latest stretch of the conversation that the
    harness did not keep as sent (`recent_messages`, its rows newest first while they fit
    RECENT_TOKENS, skipping bulk over RECENT_ROW).
    """
    db = scanner.db
    excluded = set(exclude_messages)
    recent = set(recent_messages) - excluded
    found = _retrieve(scanner, query, user_id, asked_at, excluded, limits)
    hits, warm = found.hits, heat.warm_set(db, user_id, found.now, found.reheats)
    recent_items = items_of(db, recent)
    warm_ids = warm.item_ids.tolist()
    seen = set(warm_ids)
    rows = _rows(db, warm_ids + [i for i in recent_items if i not in seen], excluded)
    recent_set = _latest(rows, recent_items)
    other = _companion(db, hits, excluded, rows, limits)
    must = ({hits[0].item_id} if hits else set()) | set(other) | recent_set

    def render_ids(new: list[int]) -> list[Message]:
        return _assemble(_turns(db, rows, new, recent_set, asked_at, conversation_id), asked_at)

    new = _fill(rows, warm, must, found.budget, render_ids)
    if not new:
        return None
    built = _frame(render_ids(new), new, rows, found, warm.foreign)
    built.warm = warm
    built.must = {**dict.fromkeys(recent_set, MUST_RECENT), **dict.fromkeys(other, MUST_HALF),
                  **({hits[0].item_id: MUST_TOP} if hits else {})}
    return built


MUST_TOP, MUST_HALF, MUST_RECENT = ("the top hit", "the other half of the top hit's exchange",
                                    "the conversation's latest stretch")


def addendum(scanner: Scanner, *, user_id: int, conversation_id: int | None, query: str,
             exclude_messages: Iterable[int], shown: Collection[int], asked_at: float,
             limits: cap.Cap) -> Frame | None:
    """Memory from other conversations for a new prompt in a conversation whose frame stays as
    it was: the question's hits there in rank order, not already in front of the model
    (`shown`, or in the messages the harness sent as they were), within its breadth-sized
    budget; None when the best of them is already in front of the model.

    It is rendered like a frame and goes just before the prompt, so the request still only
    grows at its end (the provider's cached prefix holds). Rank order, not warmth: what earlier
    prompts made warm is already in front, and an addendum serves this prompt alone. This
    conversation's own earlier turns are left to the next frame (and the recall tools): on the
    shared Claude Code sessions, addenda of them cost 0.04 of direct and kept fewer of the
    identifiers a next reply used.
    """
    db = scanner.db
    excluded = set(exclude_messages)
    found = _retrieve(scanner, query, user_id, asked_at, excluded, limits)
    hits = [h for h in found.hits if h.conversation_id != conversation_id]
    if not hits or hits[0].item_id in shown:
        return None
    rows = _rows(db, [h.item_id for h in hits], excluded)
    other = _companion(db, hits, excluded, rows | _rows(db, _other_half(db, hits[0], excluded), excluded),
                       limits)
    rows |= _rows(db, other, excluded)
    order = list(dict.fromkeys(i for i in [hits[0].item_id, *other, *(h.item_id for h in hits)]
                               if i in rows and i not in shown))
    new: list[int] = []
    used = 0
    # A narrow question's frame at most: an addendum is written at 1.25 the input price and
    # re-read on every call until the next frame (shared Claude Code sessions: addenda within
    # the whole breadth-sized budget cost 0.85 of direct, within a fifth of it 0.75, none
    # 0.70, the identifiers kept 0.84 each way).
    budget = min(found.budget, limits.floor)
    for i in order:
        cost = token_estimate(_quote(rows[i]))
        if new and used + cost > budget:
            continue
        new.append(i)
        used += cost
    if not new:
        return None

    def render_ids(ids: list[int]) -> list[Message]:
        return _assemble(_turns(db, rows, ids, set(), asked_at, conversation_id), asked_at,
                         header=MORE_HEADER)

    more = _frame(render_ids(new), new, rows, found, frozenset())
    more.must = {hits[0].item_id: MUST_TOP, **dict.fromkeys(other, MUST_HALF)}
    return more


@dataclass(slots=True)
class _Found:
    hits: list[Hit]
    reheats: dict[int, float]
    now: float
    budget: int


def _retrieve(scanner: Scanner, query: str, user_id: int, asked_at: float, excluded: set[int],
              limits: cap.Cap) -> _Found:
    """A question's hits, the reheats they bring (peaks by rank, neighbours warming with
    them), the user's clock and the breadth-sized budget."""
    db = scanner.db
    hits = search(scanner, query, user_id, asked_at, excluded)
    reheats = heat.rank_reheats([h.item_id for h in hits],
                                _neighbours(db, hits[:NEIGHBOUR_HITS], excluded))
    return _Found(hits, reheats, heat.clock(db, user_id),
                  cap.budget(np.asarray([h.score for h in hits]), limits))


# The latest stretch of the conversation, in tokens, and the largest row it takes. What a coding
# task's next reply uses from before its prompt lies mostly in the task just before it (262 of
# 458 identifiers on the six shared Claude Code sessions), and mostly in small rows: tool calls,
# the assistant's own words (250 in a row under 200 tokens, 383 under 1,000). Measured with
# `perpetuity replay` on them (cost of direct, identifiers kept): no stretch 0.71 / 0.71;
# 4,000 tokens of rows up to 200: 0.76 / 0.84; 6,000 of up to 300: 0.78 / 0.86; 8,000 of up to
# 250: 0.78 / 0.87; 8,000 of up to 300: 0.80 / 0.88.
RECENT_TOKENS = 8_000
RECENT_ROW = 250


def _latest(rows: dict[int, Row], items: list[int]) -> set[int]:
    """The conversation's latest rows, newest first, while they fit RECENT_TOKENS."""
    out: set[int] = set()
    used = 0
    for i in sorted((i for i in items if i in rows), reverse=True):
        cost = token_estimate(_quote(rows[i]))
        if cost > RECENT_ROW:
            continue
        if used + cost > RECENT_TOKENS:
            break
        out.add(i)
        used += cost
    return out


def _companion(db: Database, hits: list[Hit], excluded: set[int], rows: dict[int, Row],
               limits: cap.Cap) -> list[int]:
    """The top hit comes with the other half of its exchange, unless that is a bulk (a long
    tool output) over half the largest frame."""
    other = [i for i in (_other_half(db, hits[0], excluded) if hits else []) if i in rows]
    if sum(token_estimate(_quote(rows[i])) for i in other) > limits.ceiling // 2:
        return []
    return other


def _turns(db: Database, rows: dict[int, Row], ids: list[int], recent: set[int], asked_at: float,
           conversation_id: int | None) -> list[tuple[str, str]]:
    """The chosen rows as turns: the rows found, then the conversation's latest stretch."""
    return (_section(db, [rows[i] for i in ids if i not in recent], asked_at, conversation_id)
            + _section(db, [rows[i] for i in ids if i in recent], asked_at, conversation_id))


def _frame(messages: list[Message], chosen: list[int], rows: dict[int, Row], found: _Found,
           foreign: frozenset[int]) -> Frame:
    shown = set(chosen)
    own_reheats = {i: peak for i, peak in found.reheats.items() if i not in foreign}
    return Frame(messages, chosen, found.budget, messages_tokens(messages), len(rows) - len(chosen),
                 found.now, own_reheats,
                 [h.item_id for h in found.hits if h.item_id not in shown],
                 [h.item_id for h in found.hits if h.item_id in shown], found.hits, rows)


def search(scanner: Scanner, query: str, user_id: int, asked_at: float,
           excluded: Collection[int] = frozenset(), limit: int = HITS) -> list[Hit]:
    """A question's hits, best first, outside the `excluded` messages; when the question names
    a date, the rows said then come first, each part in the scan's order (LoCoMo recall_all,
    `perpetuity eval`: 0.830 without, 0.844 with, at the same mean frame; 200 of its 1,535
    questions name a date)."""
    during = dates.window(query, asked_at)
    found: list[Hit] = []
    for span in ([during] if during else []) + [None]:
        seen = {h.item_id for h in found}
        hits = scanner.search(query, user_id, limit=limit + len(excluded), during=span)
        found += [h for h in hits if h.message_id not in excluded and h.item_id not in seen]
    return found[:limit]


def _neighbours(db: Database, hits: list[Hit], excluded: set[int]) -> list[tuple[int, int]]:
    """(rank, item_id) of the rows in the messages around each hit, in its conversation."""
    return [(rank, item) for rank, item, message in
            around(db, [(h.conversation_id, h.message_id) for h in hits], NEIGHBOURS)
            if message not in excluded]


def _other_half(db: Database, hit: Hit, excluded: set[int]) -> list[int]:
    """The rows of the other half of a hit's exchange: the reply to it, or the question it
    answers. The two travel together; either alone is often not the answer."""
    row = next_spoken(db, hit.conversation_id, hit.message_id, after=hit.role == "user")
    other = row[0] if row and row[1] != hit.role and row[0] not in excluded else None
    return items_of(db, {other} if other else set())


def _rows(db: Database, item_ids: list[int], excluded: set[int]) -> dict[int, Row]:
    # No owner filter: in a shared pool the reheated hits may be another user's rows.
    return {i: r for i, r in shown_rows(db, item_ids).items() if r.message_id not in excluded}


def _fill(rows: dict[int, Row], warm: heat.Warm, must: set[int], budget: int,
          render_ids: Callable[[list[int]], list[Message]]) -> list[int]:
    """The rows to render: the rows with the most warmth per token while their estimated size
    fits, then render and measure, dropping the last added rows until the rendered frame
    fits. `must` is never dropped."""
    costs = {i: token_estimate(_quote(r)) for i, r in rows.items()}
    # A budget is filled best by the most warmth per token (the greedy knapsack): one long
    # reply must earn its place against the several short turns it would push out.
    warmth = dict(zip(warm.item_ids.tolist(), warm.warmth.tolist()))
    order = sorted((i for i in warmth if i in rows), key=lambda i: -warmth[i] / (costs[i] + ROW_FLOOR))
    ordered = set(order)
    order += [i for i in rows if i not in ordered]  # mandatory rows gone cold still come
    new = [i for i in order if i in must]
    used = sum(costs[i] for i in new)
    for i in order:
        if i not in must and used + costs[i] <= budget:
            new.append(i)
            used += costs[i]
    droppable = [i for i in new if i not in must]
    while droppable:
        over = messages_tokens(render_ids(new)) - budget
        if over <= 0:
            break
        # Drop the last added rows worth the overshoot, then measure again: labels make
        # the estimate low, so this converges in a few renders, not one per row.
        while over > 0 and droppable:
            i = droppable.pop()
            new.remove(i)
            over -= costs[i]
    return new


# What every row costs on top of its words when the fill weighs warmth per token, so that an
# "ok" or a "thanks" does not outrank a turn with substance. Measured with HITS 200 (LoCoMo /
# BEAM recall_all, `perpetuity eval`): warmth order 0.834 / 0.530; warmth per token 0.798 /
# 0.758; per (tokens + 50) 0.827 / 0.766; per (tokens + 100) 0.831 / 0.749; per sqrt(tokens)
# 0.824 / 0.704.
ROW_FLOOR = 100


def _assemble(turns: list[tuple[str, str]], asked_at: float,
              header: str = HEADER) -> list[Message]:
    """(role, text) turns, section after section, as alternating user and assistant messages
    under the header; within a section they are grouped by conversation (the current one
    last), oldest first (`_section`). The closing line tells the time of the question: labels
    give only the day's distance."""
    if not turns:
        return []
    messages: list[Message] = []
    if turns[0][0] != "user":
        messages.append(Message("user", (Part(Kind.TEXT, header),)))
    else:
        turns[0] = ("user", header + "\n\n" + turns[0][1])
    for role, text in turns:
        part = Part(Kind.TEXT, text)
        if messages and messages[-1].role == role:
            messages[-1] = Message(role, messages[-1].parts + (part,))
        else:
            messages.append(Message(role, (part,)))
    closing = Part(Kind.TEXT, NOW.format(datetime.fromtimestamp(asked_at, UTC)))
    if messages[-1].role == "user":
        messages.append(Message("assistant", (closing,)))
    else:
        messages[-1] = Message("assistant", messages[-1].parts + (closing,))
    return messages


def _section(db: Database, rows: list[Row], asked_at: float, conversation_id: int | None) -> list[tuple[str, str]]:
    groups: dict[int, list[Row]] = {}
    for r in sorted(rows, key=lambda r: (r.message_id, r.item_id)):
        groups.setdefault(r.conversation_id, []).append(r)
    # Other conversations by when they were last said, then the current one.
    order = sorted(groups, key=lambda c: (c == conversation_id, groups[c][-1].at, c))
    turns: list[tuple[str, str]] = []
    for c in order:
        adjacent = adjacent_pairs(db, tuple(sorted({r.message_id for r in groups[c]})))
        by_message: dict[int, list[Row]] = {}
        for r in groups[c]:
            by_message.setdefault(r.message_id, []).append(r)
        previous: Row | None = None
        for parts in by_message.values():
            first = parts[0]
            # A row flagged at capture as holding a credential (schema.m011) is withheld
            # from every other conversation's frame.
            text = "\n".join(withheld(p) if p.secret and c != conversation_id else _quote(p)
                             for p in parts)
            # A label opens each run of turns said together; within a run the alternation
            # itself tells the speakers apart, and a label per turn would cost a row's worth.
            # Labels are a tenth of a frame: the conversation is named once per group, and a
            # run resuming the same sitting after skipped turns is marked by SKIPPED alone.
            if previous is None:
                label = _label(first, asked_at, c == conversation_id)
            elif not _same_run(previous, first, adjacent):
                label = SKIPPED if first.at - previous.at <= RUN_GAP else _when(first, asked_at)
            else:
                label = ""
            turns.append(("assistant" if first.role == "assistant" else "user",
                          f"{label}\n{text}" if label else text))
            previous = first
    return turns


RUN_GAP = 30 * 60  # turns further apart than this in time are labelled afresh
SKIPPED = "[...]"  # the same sitting resumes after turns the frame leaves out


def _same_run(previous: Row, row: Row, adjacent: frozenset[tuple[int, int]]) -> bool:
    return (previous.message_id, row.message_id) in adjacent and row.at - previous.at <= RUN_GAP


_TOOLS = (Kind.TOOL_CALL.value, Kind.TOOL_RESULT.value)  # hot: once, not per row


def _quote(r: Row) -> str:
    return f"[{quoted(r)}]" if r.kind in _TOOLS else r.text


def _label(r: Row, asked_at: float, current: bool) -> str:
    # Another conversation by the name a person knows it by (names.py), never its session id.
    where = ("this conversation" if current else
             f"conversation {r.conversation}" if r.conversation else "another conversation")
    return f"[{where}, {_when(r, asked_at)[1:]}"


def _when(r: Row, asked_at: float) -> str:
    when = datetime.fromtimestamp(r.at, UTC)
    return f"[{time_label(r.at)}, {_ago(when, datetime.fromtimestamp(asked_at, UTC))}]"


def _ago(when: datetime, asked: datetime) -> str:
    """How long before the question, counted in calendar days (UTC): a label then changes
    only at midnight, all labels at once, and the frame in front stays the prefix a provider
    has cached. "3 minutes before" would change with every turn (measured with bench_prefix,
    turns a minute apart: Anthropic's cost per request 3,044 units against 2,278 for the same
    turns a second apart)."""
    days = (asked.date() - when.date()).days
    if days <= 0:
        return "earlier today"
    if days == 1:
        return "yesterday"
    unit, size = next((u, s) for u, s in (("year", 365), ("month", 30), ("week", 7), ("day", 1))
                       if days >= s)
    n = days // size
    return f"{n} {unit}{'s' if n > 1 else ''} before"


def with_note(messages: list[Message], note: str) -> list[Message]:
    """The frame with a note at its end (after the stable part, so the cached prefix holds);
    a note alone when memory had no frame to give."""
    if not messages:
        return [Message("user", (Part(Kind.TEXT, note),)),
                Message("assistant", (Part(Kind.TEXT, CLOSING),))]
    last = messages[-1]
    return messages[:-1] + [Message(last.role, last.parts + (Part(Kind.TEXT, note),))]
