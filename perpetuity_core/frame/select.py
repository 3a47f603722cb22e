"""The frame's selection: from the rows read (frame_read) and this question's scores to the rows
that enter. Pure: no reads.

How much, by the breadth-sized cap (cap.py). What, for a frame, by heat: this turn's retrieval
has reheated its hits, and the warm rows that give the most warmth per token enter until the
budget is spent, measured as rendered (frame_render). Never left out: the question's top hit,
the other half of its exchange (unless that is a bulk), and the conversation's latest stretch
(frame_stretch), the whole of an agent's frame (`frame`). An addendum takes its hits in rank order
instead, within its question's budget, those already in front counted.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from perpetuity_core.frame import cap
from perpetuity_core.frame import lean as frame_lean
from perpetuity_core.frame.render import ROW_FLOOR, cost
from perpetuity_core.frame.stretch import RECENT_TOKENS, latest
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.scan import Hit
from perpetuity_core.memory.storage.reads import Row

# The stretch takes at most this share of the request's bound (cap.Cap.bound): a request rebuilt
# or trimmed to stay within it must not take back as quoted memory the tool results it dropped.
STRETCH_SHARE = 10
# Conversation-level evidence: a warm row's warmth weighed by its conversation's share of the
# warm set (`focus`: this question's reheats and what the person's earlier questions left warm).
# `perpetuity eval locomo --sequence --personal` (docs/tuning.md).
FOCUS = 1.0  # the weight's power: 0 weighs every conversation alike
FOCUS_FLOOR = 0.05  # the weight of a conversation no warm row is in
# A chat's fill weighs its question's subject's rows at (1 + FILL_SUBJECT) times their warmth,
# above the ranking's own re-order (subject.SUBJECT), and counts the rows warm only as its hits'
# neighbours at FILL_NEIGHBOUR of that warmth (`fill_reheats`; the reheats written are whole):
# what its ranking held in the same tokens and the frame did not, the fill's neighbours and
# shorter, deeper hits had taken. `perpetuity eval locomo|beam --sequence` (docs/tuning.md).
FILL_SUBJECT = 1.5
FILL_NEIGHBOUR = 0.5
# A chat's top hit comes with the other half of its exchange; over HALF_WHOLE tokens that half
# comes in part (frame_stretch.around), which memory_more reads whole, unless its own words rank
# it among the question's first HALF_RANK hits. BEAM 100K in sequence: 325 of 355 frames' halves
# were 400 tokens or more (999 on average, a quarter of the frame), 12 of them evidence.
HALF_WHOLE = 300
HALF_RANK = 5
# A chat's request is its frame, its latest exchanges kept as sent (plan.chat_keep) and its
# prompt: its budget is the room those leave under CHAT_REQUEST percent of the ceiling, a narrow
# question's CHAT_NARROW percent of that room and a broad one's all of it (`budget`). What it
# does not keep comes back as any stored row does, when warm: no latest stretch of its own.
CHAT_REQUEST = 88
CHAT_NARROW = 60
# A frame over its budget is searched for the longest prefix of its added rows that fits: done
# within FULL percent of the budget, or after SEARCHES more layouts. Layouts a frame and its fill:
# `scripts/bench_prepare.py`, recall_all `perpetuity eval locomo` (trials: docs/tuning.md).
FULL = 97
SEARCHES = 4

# Why a row that could not be left out is in (inspection shows it).
MUST_TOP, MUST_HALF, MUST_RECENT = ("the top hit", "the other half of the top hit's exchange",
                                    "the conversation's latest stretch")

# (base, added, recent, excerpts) -> k -> the tokens as rendered of the frame of base and
# added[:k] (frame_render.prefix_tokens)
Measure = Callable[[list[int], list[int], Collection[int], Mapping[int, Row]],
                   Callable[[int], int]]


@dataclass(slots=True)
class Selection:
    """The rows that enter, in the order they were chosen, and why the mandatory ones are."""

    item_ids: list[int]
    considered: dict[int, Row]  # the rows it was chosen from
    recent: set[int] = field(default_factory=set)  # of them, the latest stretch (rendered last)
    must: dict[int, str] = field(default_factory=dict)
    excerpts: dict[int, Row] = field(default_factory=dict)  # rows quoted in part (`excerpt`)


def budget(hits: list[Hit], limits: cap.Cap, kept_tokens: int = 0, chat: bool = False,
           shares: Mapping[int, float] | None = None) -> int:
    """The breadth-sized budget of a question whose retrieval found `hits`, never below a
    narrow question's. An agent's pays for the turns the harness keeps as sent in front of its
    prompt (`kept_tokens`: a short conversation's whole history): the cap is on what the model
    reads, memory and live history together, and the live history is never cut. A `chat`'s is
    sized within the room its request has, CHAT_REQUEST percent of the ceiling less what it
    keeps as sent (`kept_tokens`, its prompt too), and its question is measured within the
    conversation most of its hits are in (`about`): in a memory of many, the words that tell
    that conversation from the others (a name) score in most of its rows, and made them all
    good matches (docs/tuning.md). `shares`: the hits' (frame_lean.shares), when made."""
    inside = about(frame_lean.shares(hits) if shares is None else shares) if chat else None
    scores = np.asarray([h.score for h in hits if inside is None or h.conversation_id == inside])
    if not chat:
        return max(limits.floor, cap.budget(scores, limits) - kept_tokens)
    room = min(limits.ceiling, limits.ceiling * CHAT_REQUEST // 100 - kept_tokens)
    if room <= limits.floor:
        return limits.floor
    narrow = max(limits.floor, room * CHAT_NARROW // 100)
    return cap.budget(scores, replace(limits, floor=narrow, ceiling=room))


def frame(rows: dict[int, Row], warm: heat.Warm, hits: list[Hit], half: list[int],
          recent_items: list[int], tokens: int, limits: cap.Cap, measure: Measure,
          agent: bool = False, said: Collection[int] = frozenset(),
          lean: frame_lean.Lean = (), cut: Callable[[Row], Row] | None = None) -> Selection:
    """A frame's rows: the mandatory ones, then the most warmth per token within `tokens` as
    rendered. `half` is the rows of the top hit's other half, `recent_items` the rows of the
    conversation's latest stretch (store order). An `agent`'s frame (a harness that sends
    tools of its own) with a latest stretch is that stretch alone. With `cut` (a chat's), the
    half's rows over HALF_WHOLE tokens, not among the first HALF_RANK hits, come as `cut`
    quotes them, in part."""
    recent, excerpts = latest(rows, recent_items,
                              min(RECENT_TOKENS, limits.bound // STRETCH_SHARE), agent)
    # An agent's frame that stands in for its dropped history is its stretch: a coding prompt's
    # words seldom name what its task needs, which the stretch holds, and every tool round
    # re-reads what the fill adds (the replay: its warm rows held 10 of 465 identifiers for 340
    # tokens a frame; docs/savings.md). A chat's question is what its frame is for.
    if agent and recent:
        hits, half, tokens = [], [], 0
    other = companion(half, rows, limits)
    whole = ({hits[0].item_id} if hits else set()) | set(other)
    excerpts = {i: r for i, r in excerpts.items() if i not in whole}  # those come whole
    long = in_part(other, hits, rows, cut)
    whole -= long.keys()
    excerpts |= long
    shown = {**rows, **excerpts} if excerpts else rows
    must = whole | recent | excerpts.keys()
    # A chat's fill goes to the conversations its warm rows point to (this question's hits and
    # earlier questions'); an agent's is left as the shared Claude Code sessions measured it
    # (its latest stretch holds its task).
    new = fill(shown, warm, must, tokens,
               lambda base, added: measure(base, added, recent, excerpts),
               None if agent else focus(warm, rows, lean), said)
    why = {**dict.fromkeys(recent, MUST_RECENT), **dict.fromkeys(other, MUST_HALF),
           **({hits[0].item_id: MUST_TOP} if hits else {})}
    return Selection(new, rows, recent, why, excerpts)


def addendum(rows: dict[int, Row], hits: list[Hit], half: list[int], shown: Collection[int],
             tokens: int, limits: cap.Cap, cut: Callable[[Row], Row] | None = None
             ) -> Selection:
    """An addendum's rows: the ranking's, from the top hit and its other half on, while they
    fit in `tokens` (a chat's budget for its question, `budget`), those already `shown` counted
    but not added: the request then holds at least the ranking's top rows within a frame's
    budget, in front or added. The top hit comes however long; its long other half in part, as
    in a frame (`in_part`)."""
    other = companion(half, rows, limits)
    hit_ids = {h.item_id for h in hits}
    considered = {i: r for i, r in rows.items() if i in hit_ids or i in other}
    considered |= in_part(other, hits, rows, cut)
    order = list(dict.fromkeys(i for i in [hits[0].item_id, *other, *(h.item_id for h in hits)]
                               if i in considered))
    new: list[int] = []
    used = 0
    # One long chat (`perpetuity eval --switch 3`): within the floor, 1,000 tokens, and none
    # when the top hit was in front, its questions that kept a frame held 0.80 of their
    # evidence where the same questions in a chat of their own held 0.91 (docs/tuning.md).
    for n, i in enumerate(order):
        c = cost(considered[i])
        if n and used + c > tokens:
            continue
        used += c
        if i not in shown:
            new.append(i)
    return Selection(new, considered, set(), {i: why for i, why in [
        (hits[0].item_id, MUST_TOP), *((i, MUST_HALF) for i in other)] if i in new})


def in_part(other: list[int], hits: list[Hit], rows: dict[int, Row],
            cut: Callable[[Row], Row] | None) -> dict[int, Row]:
    """With `cut` (a chat's), the top hit's other half's rows over HALF_WHOLE tokens, not among
    the first HALF_RANK hits, as `cut` quotes them: a long reply beside the top hit was seldom
    what the question asked for (BEAM: 12 of 325), and in part it leaves the room to the turns
    that were."""
    if cut is None:
        return {}
    found = {h.item_id for h in hits[:HALF_RANK]}
    return {i: cut(rows[i]) for i in other if i not in found and cost(rows[i]) > HALF_WHOLE}


def companion(half: list[int], rows: dict[int, Row], limits: cap.Cap) -> list[int]:
    """The top hit comes with the other half of its exchange (`half`, those of its rows that
    may be shown), unless that is a bulk (a long tool output) over half the largest frame."""
    other = [i for i in half if i in rows]
    if sum(cost(rows[i]) for i in other) > limits.ceiling // 2:
        return []
    return other


def about(shares: Mapping[int, float]) -> int | None:
    """The conversation most of this question's retrieval is in: the most reheat peaks of its
    hits (their `shares`, frame_lean.shares; the first such on a tie). None without hits."""
    return max(shares, key=shares.__getitem__) if shares else None


def fill_reheats(reheats: Mapping[int, float], hits: list[Hit]) -> dict[int, float]:
    """A chat's frame's view of its question's `reheats`: its hits' peaks whole, the rows
    reheated only as a hit's neighbour at FILL_NEIGHBOUR of theirs. A hit is a row its words
    (or the table) found; a neighbour is the turn beside one, evidence less often (LoCoMo in
    sequence: 0.06% of such rows against 0.3% of the hits ranked 40th to 60th)."""
    found = {h.item_id for h in hits}
    return {i: p if i in found else p * FILL_NEIGHBOUR for i, p in reheats.items()}


def focus(warm: heat.Warm, rows: Mapping[int, Row], lean: frame_lean.Lean = ()
          ) -> dict[int, float]:
    """Each conversation's weight in a chat's fill: its share of the warmth of the warm rows
    among `rows` against the warmest conversation's, to the power FOCUS. The warm set holds
    this question's reheats (its hits by rank, their neighbours) and what the person's earlier
    questions left warm (heat.CARRIED): a question whose words match several conversations
    leans to the one the conversation's earlier questions found, and further to what the
    chat's `lean` says they were about (frame_lean.weighed). Empty when none is warm."""
    mass: dict[int, float] = {}
    for i, w in zip(warm.item_ids.tolist(), warm.warmth.tolist(), strict=True):
        if (r := rows.get(i)) is not None:
            mass[r.conversation_id] = mass.get(r.conversation_id, 0.0) + w
    mass = frame_lean.weighed(mass, lean)
    top = max(mass.values(), default=0.0)
    return {c: (m / top) ** FOCUS for c, m in mass.items()} if top > 0 else {}


def by_warmth_per_token(warm: heat.Warm, costs: Mapping[int, int],
                        weights: Mapping[int, float] | None = None) -> list[int]:
    """The warm rows among `costs` (item id -> tokens), the most warmth per token first (each
    row's warmth times its `weights`, when given), ties in the warm set's order. A budget is
    filled best so (the greedy knapsack): one long reply must earn its place against the
    several short turns it would push out. One stable sort of an array, not a Python key per
    row (~400 a first prompt)."""
    inside = np.array([i in costs for i in warm.item_ids.tolist()], bool)
    chosen = warm.item_ids[inside]
    tokens = np.array([costs[i] for i in chosen.tolist()], np.float64)
    # The same float64 division as -w / (c + ROW_FLOOR) in Python: the same order exactly.
    w = warm.warmth[inside]
    if weights is not None:
        w = w * np.fromiter((weights[i] for i in chosen.tolist()), np.float64, chosen.size)
    order = np.argsort(-w / (tokens + ROW_FLOOR), kind="stable")
    return chosen[order].tolist()  # type: ignore[no-any-return]


def fill(rows: dict[int, Row], warm: heat.Warm, must: set[int], tokens: int,
         measure: Callable[[list[int], list[int]], Callable[[int], int]],
         focused: Mapping[int, float] | None = None,
         said: Collection[int] = frozenset()) -> list[int]:
    """The rows to render: the mandatory ones (`must`, never dropped), then the rows with the
    most warmth per token while their estimated size fits (each row's warmth weighed by its
    conversation's weight in `focused`, FOCUS_FLOOR where none of its rows is warm, and by
    (1 + FILL_SUBJECT) when the question's subject `said` it, when given); measured as
    rendered (`measure`: (mandatory, added) -> k -> the tokens of their frame with the first k
    added), and when labels make that frame larger than `tokens`, the most of those added
    rows, in the order they were added, whose frame fits (`fitting`)."""
    costs = {i: cost(r) for i, r in rows.items()}
    weights = ({i: max(focused.get(r.conversation_id, 0.0), FOCUS_FLOOR)
                * (1.0 + FILL_SUBJECT if i in said else 1.0)
                for i, r in rows.items()} if focused else None)
    order = by_warmth_per_token(warm, costs, weights)
    ordered = set(order)
    order += [i for i in rows if i not in ordered]  # mandatory rows gone cold still come
    new = [i for i in order if i in must]
    used = sum(costs[i] for i in new)
    added = []
    for i in order:
        if i not in must and used + costs[i] <= tokens:
            added.append(i)
            used += costs[i]
    if not added:
        return new
    return new + added[:fitting(new, added, costs, tokens, measure(new, added))]


def fitting(base: list[int], added: list[int], costs: Mapping[int, int], tokens: int,
            measure: Callable[[int], int]) -> int:
    """How many of `added` enter after `base` (`costs`: each row's estimate; `measure`: k ->
    the tokens of the frame of `base` and the first k added): all when their frame measures
    within `tokens`, else the longest prefix the search measured to fit, in at most SEARCHES
    more measures: one within FULL percent of `tokens`, or one row short of a prefix
    measured over.

    A row's estimate leaves out its label (the conversation's name and time when it opens a
    group, a time or SKIPPED when it opens a run): a memory of many short conversations
    measured twice its estimate (bench_latency's, 520 rows: 10,800 tokens for 5,000), and
    dropping rows worth the overshoot as estimated dropped every one. The measure is close to
    linear in the estimate over a prefix, so the guesses after the first are interpolated
    between the longest prefix known to fit and the shortest known not to, aimed at the
    budget, and just inside it once a guess went over: only a prefix measured to fit is
    returned, or none."""
    # before[k]: the estimate of `base` and the first k added rows.
    before = list(itertools.accumulate((costs[i] for i in added),
                                       initial=sum(costs[i] for i in base)))
    hi, over = len(added), measure(len(added))
    if over <= tokens:
        return hi
    # Nothing measured fits yet: `base` alone is modelled at the same tokens per estimate.
    lo, under, measured = 0, before[0] * over / max(before[hi], 1), False
    aim: float = tokens
    # The first guess drops the rows worth the overshoot as estimated, where some are left: a
    # frame whose labels are few then fits at once, as full as the drop loop before left it.
    at: float = before[hi] - (over - tokens)
    if at < before[1]:
        at = _between(before, lo, under, hi, over, aim)
    for _ in range(SEARCHES):
        if hi - lo <= 1 or (measured and under * 100 >= tokens * FULL):
            break
        k = min(max(bisect.bisect_right(before, at) - 1, lo + 1), hi - 1)
        size = measure(k)
        if size <= tokens:
            lo, under, measured = k, size, True
        else:
            # Past it, the next guesses aim inside: from above alone the search would creep.
            hi, over, aim = k, size, tokens * (100 + FULL) / 200
        at = _between(before, lo, under, hi, over, aim)
    return lo


def _between(before: list[int], lo: int, under: float, hi: int, over: float,
             aim: float) -> float:
    """The estimate at which a frame would measure `aim`, on the line between the prefixes
    `lo` (measuring `under`) and `hi` (`over`); before[k] is the estimate of prefix k."""
    return before[lo] + (aim - under) * (before[hi] - before[lo]) / max(over - under, 1e-9)
