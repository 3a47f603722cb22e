"""The six recall tools, each a function of its checked arguments, the turn's memory and the
scanner, returning the text the model reads (recall.tools dispatches to them).

Ties are broken by item id, so the same memory gives the same answer.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from perpetuity_core.errors import BadArguments
from perpetuity_core.frame import cap
from perpetuity_core.memory.derived.chains import chain_of, stem_rank, subject_words
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.storage import dictionary, reads
from perpetuity_core.memory.storage.dictionary import Dictionary
from perpetuity_core.memory.storage.reads import SHOWN_KINDS, Row, next_spoken
from perpetuity_core.recall.answers import (
    ANSWER_CAP,
    LABEL_CHARS,
    RESULT_CHARS,
    TurnMemory,
    clip,
    conversation_name,
    day_of,
    days_span,
    event_line,
    fetch_rows,
    fill,
    instance_line,
    plural,
    render_answer,
    row_body,
    row_chars,
    row_label,
    row_line,
    span,
)

MAX_ROWS = 50  # the most rows memory_search gives, however small
MAX_SCAN = 4_096  # the most ranked rows a filtered search reads through before giving up
COUNT_LIST = 20  # instances memory_count lists unless asked for more
DAYS_LISTED = 40  # dates memory_count spells out in its by-date tally
ANCHORS = 10  # a topic's top matches that memory_cooccur follows through the binding log
COOCCUR_ROWS = 200  # co-bound rows whose words are counted for memory_cooccur's terms
COOCCUR_TERMS = 8
LINKED = 5  # other subjects memory_chains points to from a chain


@dataclass(frozen=True, slots=True)
class Filters:
    conversation_id: int | None = None
    role: str | None = None
    after: float | None = None  # inclusive
    before: float | None = None  # exclusive
    said: str = ""  # how the header describes them

    def admits(self, r: Row) -> bool:
        return ((self.role is None or r.role == self.role)
                and (self.after is None or r.at >= self.after)
                and (self.before is None or r.at < self.before)
                and (self.conversation_id is None or r.conversation_id == self.conversation_id))

    def during(self) -> tuple[float, float] | None:
        """The time span for the scan itself, which then ranks only rows said in it."""
        if self.after is None and self.before is None:
            return None
        return (-math.inf if self.after is None else self.after,
                math.inf if self.before is None else self.before)


def _filters(scanner: Scanner, args: dict[str, Any], memory: TurnMemory) -> Filters:
    conv = None
    key = args.get("conversation")
    if key:
        conv = (memory.conversation_id if key == "current"
                else _own_conversation(scanner, memory, key))
        if conv is None:
            raise BadArguments(f"there is no conversation {key!r}")
    said = ", ".join(f"{k} {args[k]}" for k in ("conversation", "role", "after", "before")
                     if args.get(k))
    return Filters(conv, args.get("role"), _instant(args, "after"), _instant(args, "before"),
                   f" ({said})" if said else "")


def _own_conversation(scanner: Scanner, memory: TurnMemory, number: str) -> int | None:
    """The id of the user's conversation an answer numbered `number` (c12), else None."""
    digits = number.strip().removeprefix("c")
    if not digits.isdigit():
        return None
    return reads.conversation_of(scanner.db, int(digits), memory.owner)


def _instant(args: dict[str, Any], key: str) -> float | None:
    value = args.get(key)
    if not value:
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError as e:
        raise BadArguments(f"{key!r} must be an ISO date like 2024-05-01 or 2024-05-01T14:30,"
                           f" not {value!r}") from e
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def _search(scanner: Scanner, memory: TurnMemory, query: str, f: Filters, want: int,
            exclude: Iterable[int], holding: np.ndarray | None = None) -> list[tuple[Hit, Row]]:
    """The `want` best rows for `query` that pass the filters, best first. The scan itself
    keeps to the conversation and time span; for the other filters it reads deeper (up to
    MAX_SCAN rows) while they reject."""
    exclude = frozenset(exclude)
    k = want
    while True:
        hits = scanner.search(query, memory.user_id, limit=k, exclude=exclude,
                              conversation_id=f.conversation_id, during=f.during())
        rows = fetch_rows(scanner, memory.owner, [h.item_id for h in hits])
        keep = [(h, rows[h.item_id]) for h in hits if h.item_id in rows
                and f.admits(rows[h.item_id])]
        if holding is not None:
            held = reads.holding(scanner.db, [h.item_id for h, _ in keep], holding)
            keep = [(h, r) for h, r in keep if h.item_id in held]
        if len(keep) >= want or len(hits) < k or k >= MAX_SCAN:
            return keep[:want]
        k = min(k * 4, MAX_SCAN)


def _query_terms(d: Dictionary, text: str) -> np.ndarray:
    """The distinct term ids of a tool's query; a query of common words only is bad input."""
    terms = np.unique(d.ids(text))
    if terms.size == 0:
        raise BadArguments(f"{text!r} holds no searchable word (only common words)")
    return terms


SEARCH_DEPTH = 40  # ranked rows past those already shown that memory_search reads through


def memory_search(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    """The best rows for the query in rank order, each with the other half of its exchange (the
    reply to it, or the question it answers), whole, in a budget set by the spread of their
    scores as the frame's is. A row the model was shown is not shown again, but the other half
    of its exchange can be: either alone is often not the answer."""
    f = _filters(scanner, args, memory)
    query, limit = args["query"], args.get("limit") or MAX_ROWS
    found = _search(scanner, memory, query, f, SEARCH_DEPTH + len(memory.shown), ())
    unseen = [(h, r) for h, r in found if r.item_id not in memory.shown][:limit]
    if not unseen and not found:
        return f"memory_search {query!r}{f.said}: nothing you have not seen this turn matches."
    depth = found.index(unseen[-1]) + 1 if unseen else len(found)
    hits = found[:depth]
    halves = other_halves(scanner, memory.user_id, [r for _, r in hits])
    order: list[Row] = []
    for _, r in hits:
        pair = [r, *(x for x in halves.get(r.item_id, []) if f.admits(x))]
        order += sorted(pair, key=lambda x: (x.at, x.message_id, x.item_id))
    if all(r.item_id in memory.shown for r in order):
        return f"memory_search {query!r}{f.said}: nothing you have not seen this turn matches."
    budget = cap.budget(np.asarray([h.score for h, _ in unseen or hits], np.float64), ANSWER_CAP)
    return fill(memory, f"memory_search {query!r}{f.said}: best first, each row with the other"
                        " half of its exchange", order, budget)


def other_halves(scanner: Scanner, user_id: int, rows: list[Row]) -> dict[int, list[Row]]:
    """Each row's other half of its exchange: the rows of the reply to a user's turn, or of the
    question an assistant's turn answers, in its conversation."""
    partner: dict[int, int] = {}
    for r in rows:
        if r.role not in ("user", "assistant"):
            continue
        spoken = next_spoken(scanner.db, r.conversation_id, r.message_id, after=r.role == "user")
        if spoken and spoken[1] != r.role:
            partner[r.item_id] = spoken[0]
    if not partner:
        return {}
    by_message = reads.messages_items(scanner.db, list(partner.values()))
    shown = fetch_rows(scanner, user_id, [i for ids in by_message.values() for i in ids])
    return {item: [shown[i] for i in by_message.get(message, []) if i in shown]
            for item, message in partner.items()}


def memory_more(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    if "item" in args:
        return _continue_row(scanner, args["item"], args["offset"], memory)
    limit, page = args["limit"], args["page"]
    rows = fetch_rows(scanner, memory.owner,
                      [i for i in memory.below_cap if i not in memory.shown])
    left = [rows[i] for i in dict.fromkeys(memory.below_cap) if i in rows]
    if not left:
        return "memory_more: nothing this turn's retrieval found is left unseen; try memory_search."
    pages = -(-len(left) // limit)
    if page > pages:
        return f"memory_more: there are {plural(pages, 'page')} ({plural(len(left), 'row')} not seen yet)."
    chars = row_chars(limit)
    part = left[(page - 1) * limit:page * limit]
    return render_answer(memory, f"memory_more: page {page} of {pages} ({plural(len(left), 'row')} found"
                           " this turn and not seen yet), best first",
                   [(r.item_id, row_line(r, chars)) for r in part])


def _continue_row(scanner: Scanner, item_id: int, offset: int, memory: TurnMemory) -> str:
    r = fetch_rows(scanner, memory.owner, [item_id]).get(item_id)
    if r is None:
        return f"memory_more: there is no row #{item_id} in your memory."
    body = row_body(r)
    if offset >= len(body):
        return f"memory_more: row #{item_id} has {len(body):,} characters; nothing after {offset}."
    header = f"{row_label(r)} from character {offset:,} of {len(body):,}:"
    memory.shown.add(item_id)
    return header + "\n" + clip(body, item_id, offset, RESULT_CHARS - len(header) - LABEL_CHARS)


def memory_count(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    category, match = args["category"], args["match"]
    db = scanner.db
    terms = _query_terms(db.dictionary, category)
    f = _filters(scanner, args, memory)
    ids, at, conv = count_rows(scanner, memory.owner, terms, match == "all", f)
    what = f"memory_count {category!r}{f.said}, rows holding {match} of its words"
    if ids.size == 0:
        return f"{what}: 0 rows."
    listed = ids[np.lexsort((ids, at))[:args["limit"]]].tolist()  # oldest first
    rows = fetch_rows(scanner, memory.owner, listed)
    keys = {c: conversation_name(c, name) for c, name in
            reads.conversation_labels(db, np.unique(conv).tolist()).items()}
    days = np.datetime_as_string((at // 86_400).astype(np.int64).astype("datetime64[D]"))
    header = (f"{what}: {plural(ids.size, 'row')}, in {plural(np.unique(conv).size, 'conversation')},"
              f" on {plural(np.unique(days).size, 'day')}.")
    by_conv = sorted(_tally(conv), key=lambda cn: (-cn[1], keys.get(cn[0], "")))
    by_day = _tally(days)
    entries: list[tuple[int | None, str]] = [
        (None, "by conversation: " + "; ".join(
            f"{keys.get(c, str(c))} {n} ({days_span(at[conv == c])})" for c, n in by_conv)),
        (None, "by date: " + ", ".join(f"{d} {n}" for d, n in by_day[:DAYS_LISTED])
         + (f", and {len(by_day) - DAYS_LISTED} more days" if len(by_day) > DAYS_LISTED else "")),
    ]
    stems = [dictionary.stem(w) for w in db.dictionary.words(category)
             if w not in dictionary.STOP_WORDS]
    entries += [instance_line(rows[i], stems, memory) for i in listed if i in rows]
    if ids.size > len(listed):
        entries.append((None, (f"[{ids.size - len(listed)} more instances not listed: raise"
                               " limit, or narrow by conversation, role or dates]")))
    return render_answer(memory, header, entries)


def _tally(values: np.ndarray) -> list[tuple[Any, int]]:
    """Distinct values in ascending order, each with how often it occurs."""
    u, n = np.unique(values, return_counts=True)
    return list(zip(u.tolist(), n.tolist(), strict=True))


def count_rows(scanner: Scanner, user_id: int | None, terms: np.ndarray, every: bool,
               f: Filters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of `user_id` (of everyone, for None) passing the filters that holds every one of `terms` (or, unless
    `every`, any of them): (item ids, times, conversation ids), by item id. Exact: every
    retrieval row of the user is read and matched in numpy over its term blob; only the
    matches are then joined to their messages for the other filters."""
    rows = reads.retrieval_terms(scanner.db, user_id, f.conversation_id)
    empty = np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)
    if not rows:
        return empty
    ids, blobs = zip(*rows, strict=True)
    lengths = np.fromiter((len(b) // 4 for b in blobs), np.int64, len(blobs))
    held_terms = np.frombuffer(b"".join(blobs), "<i4")
    owner = np.repeat(np.arange(len(rows)), lengths)
    # A row's terms are distinct, so the matches per row are the query terms it holds.
    held = np.bincount(owner[np.isin(held_terms, terms)], minlength=len(rows))
    matched = np.sort(np.asarray(ids, np.int64)[held >= (terms.size if every else 1)]).tolist()
    kept = [(i, at, conv) for i, at, conv, role, kind in reads.said(scanner.db, matched)
            if kind in SHOWN_KINDS and (f.role is None or role == f.role)
            and (f.after is None or at >= f.after) and (f.before is None or at < f.before)]
    if not kept:
        return empty
    i, at, conv = zip(*kept, strict=True)
    return np.asarray(i, np.int64), np.asarray(at, np.float64), np.asarray(conv, np.int64)


def memory_dates(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    query, limit = args["query"], args["limit"]
    terms = _query_terms(scanner.db.dictionary, query)
    f = _filters(scanner, args, memory)
    # Rows already shown are still events on the timeline: they come back as stubs.
    found = _search(scanner, memory, query, f, limit, (), holding=terms)
    if not found:
        return f"memory_dates {query!r}{f.said}: no stored row mentions it."
    rows = sorted((r for _, r in found), key=lambda r: (r.at, r.item_id))
    header = (f"memory_dates {query!r}{f.said}: {plural(len(rows), 'row')}, oldest first; first to last"
              f" {span(rows[-1].at - rows[0].at)}; the latest {span(memory.asked_at - rows[-1].at)}"
              " before this question")
    chars = row_chars(limit)
    entries = [event_line(r, chars, memory, *([f"+{span(r.at - p.at)}"] if p else []))
               for p, r in zip([None, *rows[:-1]], rows, strict=True)]
    return render_answer(memory, header, entries)


def memory_cooccur(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    topic, limit = args["topic"], args["limit"]
    db = scanner.db
    terms = _query_terms(db.dictionary, topic)
    # The topic's matches are rows that mention it, not rows that only sit beside one.
    anchors = [h.item_id for h, _ in _search(scanner, memory, topic, Filters(), ANCHORS, (),
                                             holding=terms)]
    if not anchors:
        return f"memory_cooccur {topic!r}: nothing stored matches it."
    turns, bound, together = cooccurring(scanner, anchors)
    rows = fetch_rows(scanner, memory.owner, bound[:COOCCUR_ROWS].tolist())
    near = [i for i in bound[:COOCCUR_ROWS].tolist() if i in rows]
    if not near:
        return (f"memory_cooccur {topic!r}: its matches have not come up in a recorded turn with"
                " anything else yet; memory_search finds them.")
    times = dict(zip(bound.tolist(), together.tolist(), strict=True))
    topic_stems = set(subject_words(db.dictionary, topic)[0])
    words = frequent_words(db.dictionary, [rows[i].text for i in near], topic_stems)
    new = [rows[i] for i in near if i not in memory.shown][:limit]
    header = (f"memory_cooccur {topic!r}: its best matches came up in {plural(turns, 'recorded turn')},"
              f" with {plural(len(near), 'other row')}; the most often first")
    said = ", ".join(f"{w} ({n})" for w, n in words)
    entries: list[tuple[int | None, str]] = [(None, f"words most frequent among them: {said}")]
    chars = row_chars(limit)
    entries += [(r.item_id, row_line(r, chars, f"together in {plural(times[r.item_id], 'turn')}"))
                for r in new]
    if not new:
        entries.append((None, "(every one of those rows has been shown this turn)"))
    return render_answer(memory, header, entries)


def cooccurring(scanner: Scanner, anchors: list[int]) -> tuple[int, np.ndarray, np.ndarray]:
    """From the binding log: how many turns bound any of `anchors` (a topic's matches, best
    first), and the other rows bound in those turns, most strongly first, with how many of
    those turns each shares. A turn weighs 1 / (1 + rank) of the best anchor it holds, a row
    the sum of its turns' weights; ties by item id."""
    pairs = reads.bound_turns(scanner.db, anchors)
    empty = np.zeros(0, np.int64)
    if not pairs:
        return 0, empty, empty
    rank = {a: r for r, a in enumerate(anchors)}
    weight: dict[int, float] = {}
    for t, i in pairs:
        weight[t] = max(weight.get(t, 0.0), 1.0 / (1 + rank[i]))
    turns = sorted(weight)
    bound = reads.bound_in(scanner.db, turns)
    turn = np.asarray([b[0] for b in bound], np.int64)
    item = np.asarray([b[1] for b in bound], np.int64)
    w = np.asarray([weight[t] for t in turns])[np.searchsorted(turns, turn)]
    other = ~np.isin(item, anchors)
    ids, inverse = np.unique(item[other], return_inverse=True)
    # bincount adds in input order (turn, then item): the same sums on every run.
    score = np.bincount(inverse, weights=w[other], minlength=ids.size)
    together = np.bincount(inverse, minlength=ids.size)
    order = np.lexsort((ids, -score))
    return len(turns), ids[order], together[order]


def frequent_words(d: Dictionary, texts: Iterable[str],
                   leave_out: set[str]) -> list[tuple[str, int]]:
    """The subject words found in most of `texts` (each text counts a word once), with how
    many texts hold them; ties go to the rarer word, which tells more, then by stem."""
    rows: Counter[str] = Counter()
    surface: dict[str, str] = {}
    for text in texts:
        counts, forms = subject_words(d, text)
        rows.update(s for s in counts if s not in leave_out)
        for s, w in forms.items():
            surface.setdefault(s, w)
    best = sorted(rows.items(), key=lambda sn: (-sn[1], -stem_rank(d, sn[0]), sn[0]))[:COOCCUR_TERMS]
    return [(surface[s], n) for s, n in best]


def memory_chains(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    subject, limit, page = args["subject"], args["limit"], args["page"]
    db = scanner.db
    counts, forms = subject_words(db.dictionary, subject)
    stems = sorted(counts)
    if not stems:
        raise BadArguments(f"{subject!r} has no distinctive word to follow (common words are"
                           " not chained; memory_search finds them)")
    ids, covered = chain_of(db, memory.owner, stems)
    words = " and ".join(forms[s] for s in stems)
    rows = fetch_rows(scanner, memory.owner, ids)
    chain = [rows[i] for i in ids if i in rows]
    if not chain:
        return f"memory_chains {subject!r}: no stored row is about {words}."
    pages = -(-len(chain) // limit)
    if page > pages:
        return (f"memory_chains {subject!r}: the chain has {plural(len(chain), 'row')},"
                f" {plural(pages, 'page')}.")
    end = len(chain) - (page - 1) * limit
    start = max(0, end - limit)
    partial = (f" (no row mentions all of {words}; these mention {covered} of them)"
               if covered < len(stems) else "")
    header = (f"memory_chains {subject!r}: {plural(len(chain), 'row')} about {words}{partial},"
              f" {day_of(chain[0].at)} to {day_of(chain[-1].at)}; oldest first, the latest state last")
    entries: list[tuple[int | None, str]] = []
    if start > 0:
        entries.append((None, f"[{plural(start, 'earlier row')}: memory_chains page={page + 1}]"))
    chars = row_chars(limit)
    for k in range(start, end):
        gap = [f"+{span(chain[k].at - chain[k - 1].at)}"] if k > 0 else []
        entries.append(event_line(chain[k], chars, memory, *gap))
    # Linked subjects of the rows on this page: a long chain's whole would cost a read per row.
    linked = frequent_words(db.dictionary, (r.text for r in chain[start:end]), set(stems))
    if linked := [(w, n) for w, n in linked if n > 1][:LINKED]:
        entries.append((None, "linked subjects: " + ", ".join(f"{w} ({n})" for w, n in linked)))
    return render_answer(memory, header, entries)


RUNNERS: dict[str, Callable[[dict[str, Any], TurnMemory, Scanner], str]] = {
    "memory_search": memory_search,
    "memory_more": memory_more,
    "memory_cooccur": memory_cooccur,
    "memory_count": memory_count,
    "memory_chains": memory_chains,
    "memory_dates": memory_dates,
}

