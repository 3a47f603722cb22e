"""The recall tools: what the model can ask its memory mid-reply, and the answers.

The frame is what the model remembers at the start of a turn; these tools reach the rest. The
proxy runs them inside the streamed reply (relay.py). Here they are neutral: a name, a
description and a JSON schema each (`TOOLS`), the paragraph that tells the model how to use them
(`INSTRUCTIONS`), and `run`, which executes one call and returns the text the model reads.

Every answer is for one user (another user's rows never appear, pooled or not) and one turn:
`TurnMemory.shown` holds the rows the model has seen this turn (the frame's, then every row a
call returned), and no call shows a row's text twice. Answers are compact: LIMIT rows by
default, each cut to its share of RESULT_CHARS (2,000 tokens at four characters a token) with a
note how to read on. Ties are broken by item id, so the same memory gives the same answer.

Two structures are derived for the tools, each with one writer:
- the binding log (`binding`): the rows that came up together in one turn, what the turn
  retrieved and what it stored. `record_bindings` writes it from the store's writer after each
  turn; memory_cooccur reads it.
- the chains (`chain`): every text row joins the chains of its subjects (`subjects`: its
  rarest non-trivial words, at most SUBJECTS a row), ordered by when it was said. `derive_chains`
  writes them from the store's writer a batch of messages at a time (Store.flush), up to a
  cursor; memory_chains reads them and derives the rows past the cursor itself, so a row is in
  its chains from the moment it is stored, and a fact and its later updates are one chain with
  the latest state last.

How it fails: `run` never raises. Bad arguments and unknown names get a one-line error the
model can read and correct; a failure inside a tool is logged and reported the same way.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from . import dictionary
from .conversation import Kind
from .names import label
from .scan import Hit, Scanner
from .store import SHOWN_KINDS, Row, db, shown_rows, snapshot, writing
from .tenants import withheld

log = logging.getLogger("perpetuity")

LIMIT = 8  # rows an answer shows unless asked for more
MAX_LIMIT = 50
RESULT_CHARS = 8_000  # 2,000 tokens at four characters a token (scan.token_estimate's rule)
MIN_ROW_CHARS = 400  # a row is never cut shorter than this, whatever the limit
# Room a row's label takes, kept out of its text's share: the conversation's name is most
# of it (a title of up to names.TITLE_CHARS, and the project folder).
LABEL_CHARS = 160
MAX_SCAN = 4_096  # the most ranked rows a filtered search reads through before giving up
SNIPPET_CHARS = 100  # memory_count lists instances, not their whole text
COUNT_LIST = 20  # instances memory_count lists unless asked for more
DAYS_LISTED = 40  # dates memory_count spells out in its by-date tally
ANCHORS = 10  # a topic's top matches that memory_cooccur follows through the binding log
COOCCUR_ROWS = 200  # co-bound rows whose words are counted for memory_cooccur's terms
COOCCUR_TERMS = 8
LINKED = 5  # other subjects memory_chains points to from a chain

# Chains. A row's subjects are its words that are neither stop words nor among the commonest
# stems of the dictionary's corpus (ids are numbered by falling corpus frequency: "time",
# "make", "use", "work" say nothing about what a row is about), nor numbers or two-letter
# fragments; of those, the most repeated, then the rarest, at most SUBJECTS a row, so a chain
# row costs a few dozen bytes and a long text joins only the chains of what it is most about.
SUBJECTS = 6
COMMON_STEMS = 50
SUBJECT_CHARS = 4_000  # a long text's subject is in its opening: the rest is not read



@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]  # JSON schema of the arguments


@dataclass
class TurnMemory:
    """One client request's view of memory, created by the proxy, updated by every call."""

    user_id: int
    conversation_id: int | None
    asked_at: float  # wall time of the question, for "how long ago"
    shown: set[int] = field(default_factory=set)  # item ids the model has seen this turn
    below_cap: list[int] = field(default_factory=list)  # ranked retrieval the cap left out
    library: Path | None = None  # the asking tenant's notes library, when note_capture rides
    untrusted: bool = False  # the conversation quoted untrusted content (a fetched page)


# --------------------------------------------------------------------------- definitions

# The definitions ride along with every request that carries the tools: kept short.
_FILTERS: dict[str, dict[str, Any]] = {
    "conversation": {"type": "string", "description":
                     "A conversation's number from the results (c12), or 'current'."},
    "role": {"type": "string", "enum": ["user", "assistant", "tool"]},
    "after": {"type": "string", "description": "From this ISO date or time on (UTC)."},
    "before": {"type": "string", "description": "Before this ISO date or time (UTC)."},
}


def _limit(default: int = LIMIT, most: int = MAX_LIMIT) -> dict[str, Any]:
    return {"type": "integer", "minimum": 1, "maximum": most, "default": default}


def _schema(required: Sequence[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "memory_search",
        "Search everything stored from earlier conversations with this user, best match first."
        " Returns only rows you have not seen this turn, each as [#id · conversation number and"
        " name · role · time] text.",
        _schema(["query"], query={"type": "string", "description": "Words said before."},
                **_FILTERS, limit=_limit())),
    ToolSpec(
        "memory_more",
        "More of what this turn's retrieval found but the frame left out, best first, one page"
        " per call. With `item`, the rest of a row that an answer cut short.",
        _schema([], page={"type": "integer", "minimum": 1, "default": 1},
                limit=_limit(),
                item={"type": "integer", "minimum": 1, "description": "A cut row's #id."},
                offset={"type": "integer", "minimum": 0, "default": 0,
                        "description": "As the cut note says."})),
    ToolSpec(
        "memory_cooccur",
        "What came up together with a topic in earlier turns: the rows retrieved or said in the"
        " same turns as the topic's best matches, and the words most frequent among them.",
        _schema(["topic"], topic={"type": "string"}, limit=_limit())),
    ToolSpec(
        "memory_count",
        "Count exactly every stored row that mentions something (every row is read), grouped"
        " by conversation and date, instances listed compactly. A row counts when it holds every"
        " word of `category` (word forms fold: hike, hiking), or any of them with match='any'."
        " Use the words an instance would use.",
        _schema(["category"], category={"type": "string"},
                match={"type": "string", "enum": ["all", "any"], "default": "all"},
                **_FILTERS, limit=_limit(COUNT_LIST, 200) | {
                    "description": "Instances to list; the count is always complete."})),
    ToolSpec(
        "memory_chains",
        "Follow a subject through time: every row about it (a name, a place, a thing), oldest"
        " first, so a fact that changed can be followed to its latest state, which comes last."
        " Also names the subjects linked to it.",
        _schema(["subject"], subject={"type": "string", "description":
                                      "One or two distinctive words (e.g. 'Oslo', 'vault code')."},
                limit=_limit(),
                page={"type": "integer", "minimum": 1, "default": 1,
                      "description": "1 is the latest rows, 2 the ones before."})),
    ToolSpec(
        "memory_dates",
        "When something happened: the stored rows that mention it, oldest first, with their"
        " dates, the time elapsed between consecutive ones, from the first to the last, and"
        " before now.",
        _schema(["query"], query={"type": "string", "description": "What happened."},
                **_FILTERS, limit=_limit())),
)
TOOL_NAMES = frozenset(t.name for t in TOOLS)
_SPECS = {t.name: t for t in TOOLS}

INSTRUCTIONS = (
    "The quoted turns are what you remember of earlier conversations with this user, not all"
    " of it; the memory tools reach the rest. memory_search finds stored turns by their words"
    " (filter by conversation, role or dates); memory_more continues what this frame left out,"
    " or a row that was cut short; memory_count counts every mention exactly; memory_dates tells"
    " when things happened and how long apart; memory_chains follows a subject through time to"
    " its latest state; memory_cooccur shows what came up together with a topic before. Use"
    " them when the answer needs something the quoted turns do not show, before saying you do"
    " not know; never for what is already in front of you. Each call returns only what you have"
    " not seen this turn."
)


# --------------------------------------------------------------------------- running a call


class BadArguments(ValueError):
    """The call's arguments do not fit its schema: the message tells the model what does."""


def run(call_name: str, arguments: dict | str, memory: TurnMemory, scanner: Scanner) -> str:
    """Execute one call and return the text the model reads. Never raises."""
    spec = _SPECS.get(call_name)
    if spec is None:
        return f"Unknown tool {call_name!r}: the memory tools are {', '.join(sorted(TOOL_NAMES))}."
    try:
        args = parse_arguments(spec, arguments)
        return _RUNNERS[call_name](args, memory, scanner)
    except BadArguments as e:
        return f"{call_name}: {e}. It takes {_signature(spec)}."
    except Exception as e:  # the reply goes on: the model reads that the call failed
        log.exception("perpetuity: %s failed", call_name)
        return f"{call_name} failed ({type(e).__name__}); answer without it or try another call."


def parse_arguments(spec: ToolSpec, arguments: dict | str) -> dict[str, Any]:
    """The arguments checked against the spec's schema (types, bounds, enums, required)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise BadArguments(f"the arguments are not valid JSON ({e.msg})") from e
    if not isinstance(arguments, dict):
        raise BadArguments("the arguments must be a JSON object")
    props = spec.input_schema["properties"]
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if key not in props:
            raise BadArguments(f"unknown argument {key!r}")
        if value is not None:
            out[key] = _check(key, value, props[key])
    for key in spec.input_schema["required"]:
        if key not in out or out[key] == "":
            raise BadArguments(f"{key!r} is required")
    for key, prop in props.items():
        if key not in out and "default" in prop:
            out[key] = prop["default"]
    return out


def _check(key: str, value: Any, prop: dict[str, Any]) -> Any:
    if prop["type"] == "integer":
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)  # models sometimes quote numbers
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadArguments(f"{key!r} must be a whole number, not {value!r}")
        lo, hi = prop.get("minimum"), prop.get("maximum")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            most = hi if hi is not None else "any"
            raise BadArguments(f"{key!r} must be between {lo} and {most}")
        return value
    if not isinstance(value, str):
        raise BadArguments(f"{key!r} must be a string, not {value!r}")
    value = value.strip()
    if "enum" in prop and value not in prop["enum"]:
        raise BadArguments(f"{key!r} must be one of {', '.join(prop['enum'])}")
    return value


def _signature(spec: ToolSpec) -> str:
    required = spec.input_schema["required"]
    names = [k if k in required else k + "?" for k in spec.input_schema["properties"]]
    return f"{spec.name}({', '.join(names)})"


# --------------------------------------------------------------------------- rows


def fetch_rows(user_id: int, item_ids: Iterable[int]) -> dict[int, Row]:
    """The rows of `user_id` among `item_ids` that the model may be shown."""
    return shown_rows(item_ids, user_id)


def _when(at: float) -> str:
    return f"{datetime.fromtimestamp(at, UTC):%Y-%m-%d %H:%M} UTC"


def _label(r: Row, *extra: str) -> str:
    return "[" + " · ".join((f"#{r.item_id}", _conversation(r.conversation_id, r.conversation),
                             r.role, _when(r.at), *extra)) + "]"


def _conversation(conversation_id: int, name: str) -> str:
    """A conversation as an answer names it: the number a filter takes, and the name a person
    knows it by (names.py), never its session id."""
    return f"c{conversation_id} {name}" if name else f"c{conversation_id}"


def _body(r: Row) -> str:
    """A row as the model reads it; a row holding a credential is withheld (an answer can
    carry it into any conversation)."""
    if r.secret:
        return withheld(r)
    if r.kind == Kind.TOOL_CALL.value:
        return f"called {r.name}: {r.text}"
    if r.kind == Kind.TOOL_RESULT.value:
        return f"tool result: {r.text}"
    return r.text


def clip(text: str, item_id: int, start: int, chars: int) -> str:
    """`text` from `start`, at most about `chars` of it, cut at a space when one is near the
    end, with a note saying how to read on."""
    end = start + chars
    if end >= len(text):
        return text[start:]
    space = max(text.rfind(" ", start + chars * 4 // 5, end),
                text.rfind("\n", start + chars * 4 // 5, end))
    if space > start:
        end = space
    return (f"{text[start:end]} [… {len(text) - end:,} more characters:"
            f" memory_more(item={item_id}, offset={end})]")


def _row_chars(limit: int) -> int:
    """A row's share of the answer, so `limit` rows fit in RESULT_CHARS."""
    return max(MIN_ROW_CHARS, RESULT_CHARS // max(limit, 1) - LABEL_CHARS)


def _line(r: Row, chars: int, *extra: str) -> str:
    body = _body(r)
    return f"{_label(r, *extra)} {clip(body, r.item_id, 0, chars)}"


def _stub(r: Row, *extra: str) -> str:
    """A row the model has already seen this turn: where it sits, never its text again."""
    return f"{_label(r, *extra)} (already shown)"


def _answer(memory: TurnMemory, header: str, lines: Sequence[tuple[int | None, str]]) -> str:
    """Header, then lines while they fit in RESULT_CHARS. Rows whose text went out (an id
    beside the line) join `shown`; a line that did not fit is left for the next call."""
    out = [header]
    size = len(header)
    given: list[int] = []
    for n, (item_id, line) in enumerate(lines):
        if size + len(line) + 1 > RESULT_CHARS:
            out.append(f"[{len(lines) - n} more left out for size: call again for them]")
            break
        out.append(line)
        size += len(line) + 1
        if item_id is not None:
            given.append(item_id)
    memory.shown.update(given)
    return "\n".join(out)


# --------------------------------------------------------------------------- filters


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


def _filters(args: dict[str, Any], memory: TurnMemory) -> Filters:
    conv = None
    key = args.get("conversation")
    if key:
        conv = memory.conversation_id if key == "current" else _own_conversation(memory, key)
        if conv is None:
            raise BadArguments(f"there is no conversation {key!r}")
    said = ", ".join(f"{k} {args[k]}" for k in ("conversation", "role", "after", "before")
                     if args.get(k))
    return Filters(conv, args.get("role"), _instant(args, "after"), _instant(args, "before"),
                   f" ({said})" if said else "")


def _own_conversation(memory: TurnMemory, number: str) -> int | None:
    """The id of the user's conversation an answer numbered `number` (c12), else None."""
    digits = number.strip().removeprefix("c")
    if not digits.isdigit():
        return None
    row = db.connection().execute("SELECT id FROM conversation WHERE id = ? AND user_id = ?",
                                  (int(digits), memory.user_id)).fetchone()
    return row[0] if row else None


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
        rows = fetch_rows(memory.user_id, [h.item_id for h in hits])
        keep = [(h, rows[h.item_id]) for h in hits if h.item_id in rows
                and f.admits(rows[h.item_id])]
        if holding is not None:
            held = _holding([h.item_id for h, _ in keep], holding)
            keep = [(h, r) for h, r in keep if h.item_id in held]
        if len(keep) >= want or len(hits) < k or k >= MAX_SCAN:
            return keep[:want]
        k = min(k * 4, MAX_SCAN)


def _holding(item_ids: list[int], terms: np.ndarray) -> set[int]:
    """Which of the rows hold at least one of `terms` themselves (not only their context)."""
    if not item_ids or terms.size == 0:
        return set()
    rows = db.connection().execute(
        f"SELECT item_id, terms FROM retrieval WHERE item_id IN ({','.join('?' * len(item_ids))})",
        item_ids).fetchall()
    return {i for i, blob in rows if np.isin(np.frombuffer(blob, "<i4"), terms).any()}


def _query_terms(text: str) -> np.ndarray:
    """The distinct term ids of a tool's query; a query of common words only is bad input."""
    terms = np.unique(dictionary.load().ids(text))
    if terms.size == 0:
        raise BadArguments(f"{text!r} holds no searchable word (only common words)")
    return terms


# --------------------------------------------------------------------------- the tools


def memory_search(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    f = _filters(args, memory)
    query, limit = args["query"], args["limit"]
    found = _search(scanner, memory, query, f, limit, memory.shown)
    if not found:
        return f"memory_search {query!r}{f.said}: nothing you have not seen this turn matches."
    chars = _row_chars(limit)
    return _answer(memory, f"memory_search {query!r}{f.said}: {_n(len(found), 'row')}, best first",
                   [(r.item_id, _line(r, chars)) for _, r in found])


def memory_more(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    if "item" in args:
        return _continue_row(args["item"], args["offset"], memory)
    limit, page = args["limit"], args["page"]
    rows = fetch_rows(memory.user_id, [i for i in memory.below_cap if i not in memory.shown])
    left = [rows[i] for i in dict.fromkeys(memory.below_cap) if i in rows]
    if not left:
        return "memory_more: nothing this turn's retrieval found is left unseen; try memory_search."
    pages = -(-len(left) // limit)
    if page > pages:
        return f"memory_more: there are {_n(pages, 'page')} ({_n(len(left), 'row')} not seen yet)."
    chars = _row_chars(limit)
    part = left[(page - 1) * limit:page * limit]
    return _answer(memory, f"memory_more: page {page} of {pages} ({_n(len(left), 'row')} found"
                           " this turn and not seen yet), best first",
                   [(r.item_id, _line(r, chars)) for r in part])


def _continue_row(item_id: int, offset: int, memory: TurnMemory) -> str:
    r = fetch_rows(memory.user_id, [item_id]).get(item_id)
    if r is None:
        return f"memory_more: there is no row #{item_id} in your memory."
    body = _body(r)
    if offset >= len(body):
        return f"memory_more: row #{item_id} has {len(body):,} characters; nothing after {offset}."
    header = f"{_label(r)} from character {offset:,} of {len(body):,}:"
    memory.shown.add(item_id)
    return header + "\n" + clip(body, item_id, offset, RESULT_CHARS - len(header) - LABEL_CHARS)


def memory_count(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    category, match = args["category"], args["match"]
    terms = _query_terms(category)
    f = _filters(args, memory)
    ids, at, conv = count_rows(memory.user_id, terms, match == "all", f)
    what = f"memory_count {category!r}{f.said}, rows holding {match} of its words"
    if ids.size == 0:
        return f"{what}: 0 rows."
    listed = ids[np.lexsort((ids, at))[:args["limit"]]].tolist()  # oldest first
    rows = fetch_rows(memory.user_id, listed)
    keys = _conversation_names(np.unique(conv).tolist())
    days = np.datetime_as_string((at // 86_400).astype(np.int64).astype("datetime64[D]"))
    header = (f"{what}: {_n(ids.size, 'row')}, in {_n(np.unique(conv).size, 'conversation')},"
              f" on {_n(np.unique(days).size, 'day')}.")
    by_conv = sorted(_tally(conv), key=lambda cn: (-cn[1], keys.get(cn[0], "")))
    by_day = _tally(days)
    entries: list[tuple[int | None, str]] = [
        (None, "by conversation: " + "; ".join(
            f"{keys.get(c, str(c))} {n} ({_days(at[conv == c])})" for c, n in by_conv)),
        (None, "by date: " + ", ".join(f"{d} {n}" for d, n in by_day[:DAYS_LISTED])
         + (f", and {len(by_day) - DAYS_LISTED} more days" if len(by_day) > DAYS_LISTED else "")),
    ]
    marks = [dictionary.stem(w) for w in dictionary.load().words(category)
             if w not in dictionary.STOP_WORDS]
    entries += [_instance(rows[i], marks, memory) for i in listed if i in rows]
    if ids.size > len(listed):
        entries.append((None, (f"[{ids.size - len(listed)} more instances not listed: raise"
                               " limit, or narrow by conversation, role or dates]")))
    return _answer(memory, header, entries)


def _day(at: float) -> str:
    return _when(at)[:10]


def _days(at: np.ndarray) -> str:
    first, last = _day(float(at.min())), _day(float(at.max()))
    return first if first == last else f"{first} to {last}"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _instance(r: Row, marks: list[str], memory: TurnMemory) -> tuple[int | None, str]:
    """One counted row, compactly: a snippet around the first of `marks` (the category's
    stems) it holds. Its id joins `shown` only when the snippet is the whole row: a row seen
    in part stays reachable in full by memory_search."""
    # By number only: the tally above names each conversation once.
    head = f"#{r.item_id} {_when(r.at)[:16]} c{r.conversation_id} {r.role}"
    if r.item_id in memory.shown:
        return None, f"{head} (already shown)"
    body = " ".join(_body(r).split())
    if len(body) <= SNIPPET_CHARS:
        return r.item_id, f"{head}: {body}"
    return None, f"{head}: {snippet(body, marks)}"


def snippet(body: str, marks: list[str]) -> str:
    """SNIPPET_CHARS of `body` from a little before the first of `marks` it holds (the
    opening when it holds none as written), with an ellipsis where it was cut."""
    lower = body.lower()
    found = [i for i in (lower.find(m) for m in marks) if i >= 0]
    # A little context before the mark, and a full snippet even when the mark is near the end.
    start = min(max(0, min(found) - SNIPPET_CHARS // 4), len(body) - SNIPPET_CHARS) if found else 0
    if start:
        space = body.find(" ", start)
        start = space + 1 if 0 <= space < min(found) else start
    end = start + SNIPPET_CHARS
    return ("…" if start else "") + body[start:end] + ("…" if end < len(body) else "")


def _tally(values: np.ndarray) -> list[tuple[Any, int]]:
    """Distinct values in ascending order, each with how often it occurs."""
    u, n = np.unique(values, return_counts=True)
    return list(zip(u.tolist(), n.tolist(), strict=True))


def _conversation_names(conversation_ids: list[int]) -> dict[int, str]:
    if not conversation_ids:
        return {}
    return {c: _conversation(c, label(title, opening, folder)) for c, title, opening, folder
            in db.connection().execute(
                "SELECT id, title, opening, folder FROM conversation WHERE id IN"
                f" ({','.join('?' * len(conversation_ids))})", conversation_ids)}


def count_rows(user_id: int, terms: np.ndarray, every: bool,
               f: Filters) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every row of `user_id` passing the filters that holds every one of `terms` (or, unless
    `every`, any of them): (item ids, times, conversation ids), by item id. Exact: every
    retrieval row of the user is read and matched in numpy over its term blob; only the
    matches are then joined to their messages for the other filters."""
    sql, params = "SELECT item_id, terms FROM retrieval WHERE user_id = ?", [user_id]
    if f.conversation_id is not None:
        sql, params = sql + " AND conversation_id = ?", [user_id, f.conversation_id]
    conn = db.connection()
    rows = conn.execute(sql, params).fetchall()
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
    kept: list[tuple[int, float, int]] = []
    for start in range(0, len(matched), 500):
        chunk = matched[start:start + 500]
        kept += [(i, at, conv) for i, at, conv, role, kind in conn.execute(
            "SELECT i.id, m.at, m.conversation_id, m.role, i.kind FROM item i JOIN message m"
            f" ON m.id = i.message_id WHERE i.id IN ({','.join('?' * len(chunk))}) ORDER BY i.id",
            chunk) if kind in SHOWN_KINDS and (f.role is None or role == f.role)
            and (f.after is None or at >= f.after) and (f.before is None or at < f.before)]
    if not kept:
        return empty
    i, at, conv = zip(*kept, strict=True)
    return np.asarray(i, np.int64), np.asarray(at, np.float64), np.asarray(conv, np.int64)


def memory_dates(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    query, limit = args["query"], args["limit"]
    terms = _query_terms(query)
    f = _filters(args, memory)
    # Rows already shown are still events on the timeline: they come back as stubs.
    found = _search(scanner, memory, query, f, limit, (), holding=terms)
    if not found:
        return f"memory_dates {query!r}{f.said}: no stored row mentions it."
    rows = sorted((r for _, r in found), key=lambda r: (r.at, r.item_id))
    header = (f"memory_dates {query!r}{f.said}: {_n(len(rows), 'row')}, oldest first; first to last"
              f" {span(rows[-1].at - rows[0].at)}; the latest {span(memory.asked_at - rows[-1].at)}"
              " before this question")
    chars = _row_chars(limit)
    entries = [_event(r, chars, memory, *([f"+{span(r.at - p.at)}"] if p else []))
               for p, r in zip([None, *rows[:-1]], rows, strict=True)]
    return _answer(memory, header, entries)


def _event(r: Row, chars: int, memory: TurnMemory, *extra: str) -> tuple[int | None, str]:
    if r.item_id in memory.shown:
        return None, _stub(r, *extra)
    return r.item_id, _line(r, chars, *extra)


def span(seconds: float) -> str:
    """An elapsed time, exact to the unit that matters: whole days are always spelled out,
    so a question about days between two events needs no calendar arithmetic."""
    s = int(max(0.0, seconds))
    days, rest = divmod(s, 86_400)
    hours, minutes = rest // 3600, rest % 3600 // 60
    if days == 0:
        if hours == 0:
            return f"{minutes} minute{'s' * (minutes != 1)}"
        return f"{hours} hour{'s' * (hours != 1)}" + (f" {minutes} min" if minutes else "")
    text = f"{days} day{'s' * (days != 1)}"
    if days < 7 and hours:
        return f"{text} {hours} hour{'s' * (hours != 1)}"
    if days >= 365:
        return f"{text} (about {days / 365.25:.1f} years)"
    if days >= 60:
        return f"{text} (about {days / 30.44:.0f} months)"
    if days >= 14:
        return f"{text} ({days / 7:.1f} weeks)".replace(".0 weeks", " weeks")
    return text


def memory_cooccur(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    topic, limit = args["topic"], args["limit"]
    terms = _query_terms(topic)
    # The topic's matches are rows that mention it, not rows that only sit beside one.
    anchors = [h.item_id for h, _ in _search(scanner, memory, topic, Filters(), ANCHORS, (),
                                             holding=terms)]
    if not anchors:
        return f"memory_cooccur {topic!r}: nothing stored matches it."
    turns, bound, together = cooccurring(anchors)
    rows = fetch_rows(memory.user_id, bound[:COOCCUR_ROWS].tolist())
    near = [i for i in bound[:COOCCUR_ROWS].tolist() if i in rows]
    if not near:
        return (f"memory_cooccur {topic!r}: its matches have not come up in a recorded turn with"
                " anything else yet; memory_search finds them.")
    times = dict(zip(bound.tolist(), together.tolist(), strict=True))
    topic_stems = set(_subject_words(topic)[0])
    words = frequent_words([rows[i].text for i in near], topic_stems)
    new = [rows[i] for i in near if i not in memory.shown][:limit]
    header = (f"memory_cooccur {topic!r}: its best matches came up in {_n(turns, 'recorded turn')},"
              f" with {_n(len(near), 'other row')}; the most often first")
    said = ", ".join(f"{w} ({n})" for w, n in words)
    entries: list[tuple[int | None, str]] = [(None, f"words most frequent among them: {said}")]
    chars = _row_chars(limit)
    entries += [(r.item_id, _line(r, chars, f"together in {_n(times[r.item_id], 'turn')}"))
                for r in new]
    if not new:
        entries.append((None, "(every one of those rows has been shown this turn)"))
    return _answer(memory, header, entries)


def cooccurring(anchors: list[int]) -> tuple[int, np.ndarray, np.ndarray]:
    """From the binding log: how many turns bound any of `anchors` (a topic's matches, best
    first), and the other rows bound in those turns, most strongly first, with how many of
    those turns each shares. A turn weighs 1 / (1 + rank) of the best anchor it holds, a row
    the sum of its turns' weights; ties by item id."""
    conn = db.connection()
    pairs = conn.execute(
        f"SELECT turn_message_id, item_id FROM binding WHERE item_id IN"
        f" ({','.join('?' * len(anchors))})", anchors).fetchall()
    empty = np.zeros(0, np.int64)
    if not pairs:
        return 0, empty, empty
    rank = {a: r for r, a in enumerate(anchors)}
    weight: dict[int, float] = {}
    for t, i in pairs:
        weight[t] = max(weight.get(t, 0.0), 1.0 / (1 + rank[i]))
    turns = sorted(weight)
    bound: list[tuple[int, int]] = []
    for start in range(0, len(turns), 500):
        chunk = turns[start:start + 500]
        bound += conn.execute(
            "SELECT turn_message_id, item_id FROM binding WHERE turn_message_id IN"
            f" ({','.join('?' * len(chunk))}) ORDER BY turn_message_id, item_id", chunk).fetchall()
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


def frequent_words(texts: Iterable[str], leave_out: set[str]) -> list[tuple[str, int]]:
    """The subject words found in most of `texts` (each text counts a word once), with how
    many texts hold them; ties go to the rarer word, which tells more, then by stem."""
    rows: Counter[str] = Counter()
    surface: dict[str, str] = {}
    for text in texts:
        counts, forms = _subject_words(text)
        rows.update(s for s in counts if s not in leave_out)
        for s, w in forms.items():
            surface.setdefault(s, w)
    best = sorted(rows.items(), key=lambda sn: (-sn[1], -_rank(sn[0]), sn[0]))[:COOCCUR_TERMS]
    return [(surface[s], n) for s, n in best]


def memory_chains(args: dict[str, Any], memory: TurnMemory, scanner: Scanner) -> str:
    subject, limit, page = args["subject"], args["limit"], args["page"]
    counts, forms = _subject_words(subject)
    stems = sorted(counts)
    if not stems:
        raise BadArguments(f"{subject!r} has no distinctive word to follow (common words are"
                           " not chained; memory_search finds them)")
    ids, covered = chain_of(memory.user_id, stems)
    words = " and ".join(forms[s] for s in stems)
    rows = fetch_rows(memory.user_id, ids)
    chain = [rows[i] for i in ids if i in rows]
    if not chain:
        return f"memory_chains {subject!r}: no stored row is about {words}."
    pages = -(-len(chain) // limit)
    if page > pages:
        return (f"memory_chains {subject!r}: the chain has {_n(len(chain), 'row')},"
                f" {_n(pages, 'page')}.")
    end = len(chain) - (page - 1) * limit
    start = max(0, end - limit)
    partial = (f" (no row mentions all of {words}; these mention {covered} of them)"
               if covered < len(stems) else "")
    header = (f"memory_chains {subject!r}: {_n(len(chain), 'row')} about {words}{partial},"
              f" {_day(chain[0].at)} to {_day(chain[-1].at)}; oldest first, the latest state last")
    entries: list[tuple[int | None, str]] = []
    if start > 0:
        entries.append((None, f"[{_n(start, 'earlier row')}: memory_chains page={page + 1}]"))
    chars = _row_chars(limit)
    for k in range(start, end):
        gap = [f"+{span(chain[k].at - chain[k - 1].at)}"] if k > 0 else []
        entries.append(_event(chain[k], chars, memory, *gap))
    # Linked subjects of the rows on this page: a long chain's whole would cost a read per row.
    linked = frequent_words((r.text for r in chain[start:end]), set(stems))
    if linked := [(w, n) for w, n in linked if n > 1][:LINKED]:
        entries.append((None, "linked subjects: " + ", ".join(f"{w} ({n})" for w, n in linked)))
    return _answer(memory, header, entries)


def chain_of(user_id: int, stems: list[str]) -> tuple[list[int], int]:
    """The chain of rows about `stems`: the rows in the most of their chains (in all of them
    when any row is), ordered by when they were said, then by item id; and how many they
    share. Rows past the chains' cursor (at most a batch, see Store.flush) are chained here,
    in the same snapshot as the table, so none is missed while its batch is pending."""
    with snapshot("read the chains") as conn:
        rows = conn.execute(
            "SELECT item_id, at, count(*) FROM chain WHERE user_id = ? AND term IN"
            f" ({','.join('?' * len(stems))}) GROUP BY item_id", (user_id, *stems)).fetchall()
        (after,) = conn.execute("SELECT seq FROM derived WHERE name = 'chain'").fetchone()
        pending = _text_rows(conn, after, None, user_id)
    found = {i: (at, n) for i, at, n in rows}
    wanted = set(stems)
    for i, _, at, text in pending:
        if n := len(wanted.intersection(subjects(text))):
            found[i] = (at, n)  # a row re-derived since it was chained has the same subjects
    if not found:
        return [], 0
    best = max(n for _, n in found.values())
    return [i for i, (_, n) in sorted(found.items(), key=lambda r: (r[1][0], r[0]))
            if n == best], best


# --------------------------------------------------------------------------- the writers


def _subject_words(text: str) -> tuple[dict[str, int], dict[str, str]]:
    """The words of `text` that can be subjects, by stem: occurrences, and the first form seen."""
    text = text[:SUBJECT_CHARS]
    # ASCII text is split as Dictionary.id_list splits it (the same words as the tokenizer's
    # pipeline, several times faster); anything else goes through the pipeline.
    words: Iterable[bytes | str] = (
        text.encode("ascii").translate(dictionary._ASCII_FOLD).split() if text.isascii()
        else dictionary.load().words(text))
    counts: dict[str, int] = {}
    forms: dict[str, str] = {}
    cache = _SUBJECT_STEM.setdefault(dictionary.load().version, {})
    # Counter counts in C, in order of first occurrence; stems are then looked up per distinct
    # word only (a text repeats most of its words).
    for w, n in Counter(words).items():
        if w in cache:
            known = cache[w]
        else:
            known = cache[w] = _subject_stem(w.decode() if isinstance(w, bytes) else w)
        if known is not None:
            stem, form = known
            if stem in counts:
                counts[stem] += n
            else:
                counts[stem] = n
                forms[stem] = form
    if len(cache) > 1_000_000:  # bound the cache in a long-lived process
        cache.clear()
    return counts, forms


# Per dictionary version (a stem's rank decides), word -> (its stem, the word) when the word can
# be a subject, None when it cannot: stemming every word of every stored row was most of the
# chains' write cost.
_SUBJECT_STEM: dict[str, dict[bytes | str, tuple[str, str] | None]] = {}


def _subject_stem(word: str) -> tuple[str, str] | None:
    if len(word) < 3 or word.isdigit() or word in dictionary.STOP_WORDS:
        return None
    s = dictionary.stem(word)
    return None if _rank(s) < dictionary.FIRST_STEM_ID + COMMON_STEMS else (s, word)


def subjects(text: str) -> list[str]:
    """The stems of the chains a text row joins: its most repeated subject words, then the
    rarest (a stem the corpus never saw counts rarest), at most SUBJECTS; ties by stem."""
    counts, _ = _subject_words(text)
    d = dictionary.load()
    rank, unseen = d.stem_ids, d.hash_base
    return heapq.nsmallest(SUBJECTS, counts, key=lambda s: (-counts[s], -rank.get(s, unseen), s))


def _rank(stem: str) -> int:
    """A stem's place in the dictionary's corpus by falling frequency; unseen ones rank last."""
    d = dictionary.load()
    return d.stem_ids.get(stem, d.hash_base)


_INSERT_CHAIN = "INSERT OR IGNORE INTO chain (user_id, term, at, item_id) VALUES (?, ?, ?, ?)"


def derive_chains(after: int, upto: int) -> None:
    """Join the text rows stored with after < retrieval.seq <= upto to their subjects' chains
    (Store.flush calls this in the batch's transaction: the chains' only writer)."""
    conn = db.connection()
    conn.executemany(_INSERT_CHAIN, [(user, s, at, i) for i, user, at, text
                                     in _text_rows(conn, after, upto, None)
                                     for s in subjects(text)])


def _text_rows(conn: sqlite3.Connection, after: int, upto: int | None,
               user_id: int | None) -> list[tuple[int, int, float, str]]:
    """(item id, user id, when said, text) of the non-blank text rows past retrieval.seq
    `after` (up to `upto`; of `user_id` only, when given)."""
    where, args = "", [Kind.TEXT.value, after]
    if upto is not None:
        where, args = where + " AND r.seq <= ?", [*args, upto]
    if user_id is not None:
        where, args = where + " AND r.user_id = ?", [*args, user_id]
    return [r for r in conn.execute(
        "SELECT r.item_id, r.user_id, m.at, i.text FROM retrieval r"
        " JOIN item i ON i.id = r.item_id JOIN message m ON m.id = r.message_id"
        f" WHERE i.kind = ? AND r.seq > ?{where} ORDER BY r.seq", args) if r[3].strip()]


def backfill_chains(conn: sqlite3.Connection) -> int:
    """Chains for the text rows stored before chains existed (their migration calls this, so
    no row is ever without its chains). Returns the rows read."""
    last = done = 0
    while rows := conn.execute(
            "SELECT i.id, i.text, m.user_id, m.at FROM item i JOIN message m ON m.id = i.message_id"
            " WHERE i.kind = ? AND i.id > ? ORDER BY i.id LIMIT 1000",
            (Kind.TEXT.value, last)).fetchall():
        conn.executemany(_INSERT_CHAIN, [(user, s, at, i) for i, text, user, at in rows
                                         if text.strip() for s in subjects(text)])
        last, done = rows[-1][0], done + len(rows)
    return done


def record_bindings(message_id: int, item_ids: Iterable[int]) -> int:
    """Log that `item_ids` (what a turn retrieved and showed the model: frame rows, tool
    results) came up together with the rows of `message_id` (what the turn stored, usually the
    reply), under that message. The store's writer calls this after each turn: it is the
    binding log's only writer. A row of another user than the message's is never bound.
    Returns how many rows the turn binds."""
    with writing("log the turn's bindings") as conn:
        row = conn.execute("SELECT user_id FROM message WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            return 0
        ids = {i for (i,) in conn.execute("SELECT id FROM item WHERE message_id = ?",
                                          (message_id,))}
        wanted = sorted(set(item_ids) - ids)
        for start in range(0, len(wanted), 500):
            chunk = wanted[start:start + 500]
            ids.update(i for (i,) in conn.execute(
                "SELECT i.id FROM item i JOIN message m ON m.id = i.message_id WHERE m.user_id = ?"
                f" AND i.id IN ({','.join('?' * len(chunk))})", (row[0], *chunk)))
        conn.executemany("INSERT OR IGNORE INTO binding (turn_message_id, item_id) VALUES (?, ?)",
                         [(message_id, i) for i in sorted(ids)])
    return len(ids)


_RUNNERS: dict[str, Callable[[dict[str, Any], TurnMemory, Scanner], str]] = {
    "memory_search": memory_search,
    "memory_more": memory_more,
    "memory_cooccur": memory_cooccur,
    "memory_count": memory_count,
    "memory_chains": memory_chains,
    "memory_dates": memory_dates,
}
