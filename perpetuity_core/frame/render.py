"""The frame's rendering: from the chosen rows to the messages the model reads. Pure: no reads.

Rows are grouped by conversation, the current one last, oldest first within each, and
labelled with a time resolved now: the absolute date and how many days before the live
question, whose own time closes the frame. The result is neutral messages that alternate user
and assistant, all plain text (a tool call from memory is quoted, not replayed), so any
protocol accepts them before the turns the harness keeps as it sent them.

Which rendered messages follow one another in the store (`adjacent`) is read beforehand
(frame_read): given the rows and those pairs, the same selection always renders the same text.
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, date, datetime

import numpy as np

from perpetuity_core.frame.rows import quoted, time_label
from perpetuity_core.frame.tenants import withheld
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Kind, Message, Part

# The lines the model reads around the quoted turns. They say what the turns are (quoted, not
# said now), how they are ordered and what [...] means, and the closing line gives the time of
# the question, since labels give only the day's distance. Changing any of them changes every
# frame, and so every cached prefix.
HEADER = ("[Memory: turns quoted verbatim from earlier conversations, grouped by conversation "
          "with this one last, labelled with when they were said; [...] marks turns left out.]")
MORE_HEADER = ("[Memory for the next message: more turns quoted verbatim from earlier"
               " conversations, labelled with when they were said.]")
CLOSING = "[End of quoted memory.]"
NOW = "[End of quoted memory. Now: {:%Y-%m-%d %H:%M} UTC.]"
# What opens a row quoted in part (frame_stretch.excerpt): which row, and how to read it whole
# (in the excerpt, not the header: a frame with the tools off never names them).
EXCERPT = "[excerpt #{0}: memory_more(item={0}) reads it whole]\n"
# Turns further apart than this in time are labelled afresh: half an hour's silence is another
# sitting to a reader (chosen with the labels, not measured).
RUN_GAP = 30 * 60
SKIPPED = "[...]"  # the same sitting resumes after turns the frame leaves out
STAMPS = 65_536  # rows whose time label is kept (_when)
# The frame's messages kept by their text (`Said`), and the characters they may hold in all.
SAID_MESSAGES = 4096
SAID_CHARS = 4_000_000

_TOOLS = (Kind.TOOL_CALL.value, Kind.TOOL_RESULT.value)  # hot: once, not per row

Turn = tuple[str, str]  # (role, text)


class Said:
    """The frame's messages made before, by their role and parts' text: a message written
    again is the same object, and with it what the wire made of it (`Message.wire_form`: the
    Anthropic block or the Chat message, then its JSON in wire.written), so a first prompt
    whose frame shows runs that an earlier one showed writes only what changed (bench_prepare's
    bench memory: most of a frame's ~120 messages, each made, rendered and encoded afresh
    every call).

    Keyed on the whole text, so never stale: a changed row, label, asking day or header is
    another key. Least recently used go first past SAID_MESSAGES or SAID_CHARS. One thread
    uses it (the one that prepares requests: the Layout's)."""

    def __init__(self, messages: int = SAID_MESSAGES, chars: int = SAID_CHARS) -> None:
        self._kept: OrderedDict[tuple[str, ...], Message] = OrderedDict()
        self._chars = 0
        self._bounds = messages, chars

    def message(self, role: str, texts: list[str]) -> Message:
        """Message(role, the texts as text parts), the one made before when there is one."""
        key = (role, *texts)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        made = self._kept[key] = _message(role, texts)
        self._chars += sum(map(len, texts))
        most, chars = self._bounds
        while len(self._kept) > most or self._chars > chars:
            old, _ = self._kept.popitem(last=False)
            self._chars -= sum(map(len, old[1:]))
        return made


def _message(role: str, texts: list[str]) -> Message:
    return Message(role, tuple([Part(Kind.TEXT, t) for t in texts]))


def messages(rows: dict[int, Row], ids: Iterable[int], recent: Collection[int],
             adjacent: Collection[tuple[int, int]], asked_at: float,
             conversation_id: int | None, header: str = HEADER,
             said: Said | None = None) -> list[Message]:
    """The rows `ids` as the model reads them: the rows found, then the conversation's latest
    stretch (`recent`), under `header`."""
    return written(lay(rows, list(ids), recent, adjacent, asked_at, conversation_id), asked_at,
                   header, said)


# What every row costs beyond its words when the fill weighs warmth per token (frame_select),
# or the stretch a name's worth (frame_stretch), so that an "ok" does not outrank a turn with
# substance. recall_all of `perpetuity eval locomo|beam` (docs/tuning.md).
ROW_FLOOR = 100


def cost(r: Row) -> int:
    """A row's estimated tokens as quoted, without its label (token_estimate's rule)."""
    return ((_quoted_length(r) if r.excerpt or r.kind in _TOOLS else len(r.text)) + 3) // 4


def quote(r: Row) -> str:
    text = f"[{quoted(r)}]" if r.kind in _TOOLS else r.text
    return EXCERPT.format(r.item_id) + text if r.excerpt else text


def _quoted_length(r: Row) -> int:
    # Most rows are quoted as their text: its length without writing a copy.
    return len(quote(r)) if r.excerpt or r.kind in _TOOLS else len(r.text)


# One message's rows as a turn: its role, its label ("" for none), its rows, and whether they
# are shown to their own conversation (a credential is withheld from every other).
Run = tuple[str, str, list[Row], bool]


def lay(rows: dict[int, Row], ids: list[int], recent: Collection[int],
        adjacent: Collection[tuple[int, int]], asked_at: float,
        conversation_id: int | None) -> list[Run]:
    """The chosen rows as runs, turn by turn: the rows found, then the conversation's latest
    stretch. Their text is not written yet: `tokens` measures them as `written` would write
    them, so the fill measures a frame it may drop without writing it."""
    return (runs([rows[i] for i in ids if i not in recent], adjacent, asked_at, conversation_id)
            + runs([rows[i] for i in ids if i in recent], adjacent, asked_at, conversation_id))


def written(laid: list[Run], asked_at: float, header: str = HEADER,
            said: Said | None = None, apart: bool = False) -> list[Message]:
    """Runs (`lay`) as the messages the model reads; those `said` before, as they were
    (`apart`: the header a message of its own, `assemble`)."""
    return assemble([(role, _text(label, parts, current)) for role, label, parts, current
                     in laid], asked_at, header, said, apart)


def tokens(laid: list[Run], asked_at: float, header: str = HEADER, apart: bool = False) -> int:
    """messages_tokens of what `written` makes of these runs, without writing it: each part's
    tokens by token_estimate's rule, the header joined to the first turn when that is the
    user's (`assemble`), and the closing line."""
    if not laid:
        return 0
    sizes = []
    for _, label, parts, current in laid:
        n = len(label) + len(parts) if label else len(parts) - 1  # the label's line, the joins
        for p in parts:
            n += len(withheld(p)) if p.secret and not current else _quoted_length(p)
        sizes.append(n)
    heading = (len(header) + 3) // 4
    if laid[0][0] == "user" and apart:
        heading += (len(SKIPPED) + 3) // 4
    elif laid[0][0] == "user":
        sizes[0] += len(header) + 2
        heading = 0
    closing = len(NOW.format(datetime.fromtimestamp(asked_at, UTC)))
    return heading + sum((n + 3) // 4 for n in sizes) + (closing + 3) // 4


def prefix_tokens(rows: dict[int, Row], base: list[int], added: list[int],
                  recent: Collection[int], adjacent: Collection[tuple[int, int]],
                  asked_at: float, conversation_id: int | None,
                  header: str = HEADER, apart: bool = False) -> Callable[[int], int]:
    """k -> `tokens` of `lay(rows, base + added[:k], recent, ...)`, without laying any out.

    What the fill's search measures (frame_select.fitting): it measured 2 to 4 layouts a first
    prompt, the first of every row it might add (bench_prepare's bench memory: 226 rows laid
    out for the 191 that entered, then 168, 207 and 191; issue 24), and a layout is Python work
    per row. Here the rows are read once into arrays in store order and a prefix is a mask on
    them: its runs, their labels and sizes follow by array operations, a measure costs tens of
    microseconds whatever its rows, and the frame is laid out once, to be written."""
    order = base + added
    entered = np.zeros(len(order), np.int64)  # the prefix each row enters at
    entered[len(base):] = np.arange(1, len(added) + 1)
    latest = np.fromiter((i in recent for i in order), bool, len(order))
    found = _Prefixes([rows[i] for i, r in zip(order, latest) if not r], entered[~latest],
                      asked_at, conversation_id)
    stretch = _Prefixes([rows[i] for i, r in zip(order, latest) if r], entered[latest],
                        asked_at, conversation_id)
    closing = (len(NOW.format(datetime.fromtimestamp(asked_at, UTC))) + 3) // 4

    def measure(k: int) -> int:
        total, first, user = found.runs(k, adjacent)
        more, first_latest, user_latest = stretch.runs(k, adjacent)
        if first < 0:  # no row found: the stretch's first turn opens the frame
            first, user = first_latest, user_latest
        if first < 0:
            return 0
        total += more
        if user and not apart:  # the header joins the first turn (`assemble`)
            total += (first + len(header) + 2 + 3) // 4 - (first + 3) // 4
        else:
            total += (len(header) + 3) // 4 + (len(SKIPPED) + 3) // 4 * user
        return total + closing

    return measure


class _Prefixes:
    """One section's rows (the input of `runs`) as arrays in store order within their
    conversations, each with the prefix it enters at: `runs` of any prefix measured without
    laying it out."""

    def __init__(self, rows: list[Row], entered: np.ndarray, asked_at: float,
                 conversation_id: int | None) -> None:
        asked = datetime.fromtimestamp(asked_at, UTC).date()
        # Columns by list comprehensions: numpy.fromiter over a generator or a map cost more
        # a row (callgrind: ~600 instructions against ~500).
        conversation = np.array([r.conversation_id for r in rows], np.int64)
        message = np.array([r.message_id for r in rows], np.int64)
        order = np.lexsort((np.array([r.item_id for r in rows], np.int64), message, conversation))
        rows = [rows[j] for j in order.tolist()]
        self.entered = entered[order]
        self.conversation, self.message = conversation[order], message[order]
        at = [r.at for r in rows]
        self.at = np.array(at, np.float64)
        self.user = np.array([r.role != "assistant" for r in rows], bool)
        current = self.conversation == (-1 if conversation_id is None else conversation_id)
        self.current = current
        self.text = np.array([_quoted_length(r) if r.excerpt or r.kind in _TOOLS else len(r.text)
                              for r in rows], np.int64)
        if any(map(_SECRET, rows)):
            for j in (np.array([bool(r.secret) for r in rows], bool) & ~current).nonzero()[0]:
                self.text[j] = len(withheld(rows[j]))
        self.when = np.array([len(_when(a, asked)) for a in at], np.int64)
        # A run opening its group: `_label`'s length, each conversation's name measured once.
        named = list(zip(map(_NAME, rows), current.tolist()))
        where = {key: len(_where(*key)) for key in set(named)}
        self.opens = self.when + 2 + np.array([where[key] for key in named], np.int64)
        # Every prefix past the last row to enter measures the same (the latest stretch's rows
        # are all mandatory): measured once.
        self.whole = int(entered.max()) if rows else 0
        self.measured: dict[int, tuple[int, int, bool]] = {}

    def runs(self, k: int, adjacent: Collection[tuple[int, int]]) -> tuple[int, int, bool]:
        """The tokens of the runs of the rows entered by prefix k (`tokens`, each run's part),
        and the size and speaker of the run that opens the section; -1 for none."""
        k = min(k, self.whole)
        if (known := self.measured.get(k)) is None:
            known = self.measured[k] = self._runs(k, adjacent)
        return known

    def _runs(self, k: int, adjacent: Collection[tuple[int, int]]) -> tuple[int, int, bool]:
        # Array methods, not numpy's Python-level helpers (flatnonzero, diff, roll, append):
        # those cost more than the arithmetic on a frame's few hundred rows.
        rows = (self.entered <= k).nonzero()[0]
        n = len(rows)
        if not n:
            return 0, -1, False
        conversation, message = self.conversation[rows], self.message[rows]
        opens = np.empty(n + 1, bool)  # where a group opens, and the end
        opens[0] = opens[n] = True
        np.not_equal(conversation[1:], conversation[:-1], out=opens[1:n])
        starts = opens.copy()  # where a run opens, and the end
        starts[1:n] |= message[1:] != message[:-1]
        at = starts.nonzero()[0]
        first = rows[at[:-1]]  # each run's first row
        size = np.add.reduceat(self.text[rows], at[:-1])
        group = opens[at[:-1]]
        label = np.where(group, self.opens[first], 0)
        # A run within its group: labelled by its time after a gap, SKIPPED after turns left
        # out, nothing when said together with the run before it (`runs`).
        before = np.empty_like(first)
        before[0], before[1:] = first[0], first[:-1]
        inner = ~group
        gap = inner & (self.at[first] - self.at[before] > RUN_GAP)
        label[gap] = self.when[first[gap]]
        said = (inner & ~gap).nonzero()[0]
        if len(said):
            pairs = zip(self.message[before[said]].tolist(), self.message[first[said]].tolist())
            label[said] = np.fromiter((p not in adjacent for p in pairs), bool,
                                      len(said)) * len(SKIPPED)
        parts = at[1:] - at[:-1]
        size += np.where(label > 0, label + parts, parts - 1)
        # The section opens with the conversation said last longest ago, the current one last.
        groups = opens.nonzero()[0]
        lead = 0
        if len(groups) > 2:
            last = rows[groups[1:] - 1]
            lead = int(np.lexsort((self.conversation[last], self.at[last],
                                   self.current[last]))[0])
        opening = int(at.searchsorted(groups[lead]))
        return (int(((size + 3) // 4).sum()), int(size[opening]),
                bool(self.user[rows[groups[lead]]]))


def _text(label: str, parts: list[Row], current: bool) -> str:
    if len(parts) == 1:  # most messages are one row: no join
        p = parts[0]
        text = withheld(p) if p.secret and not current else quote(p)
    else:
        text = "\n".join([withheld(p) if p.secret and not current else quote(p) for p in parts])
    return f"{label}\n{text}" if label else text


def assemble(turns: list[Turn], asked_at: float, header: str = HEADER,
             said: Said | None = None, apart: bool = False) -> list[Message]:
    """(role, text) turns, section after section, as alternating user and assistant messages
    under the header; within a section they are grouped by conversation (the current one
    last), oldest first (`section`). The closing line tells the time of the question: labels
    give only the day's distance. Messages `said` before are the objects made then. `apart`:
    the header is a message of its own, the same in every frame (an agent's: the harness's
    standing messages follow it in the cached prefix, wire.protocols.anthropic), a first
    turn of the user's after SKIPPED."""
    if not turns:
        return []
    # Each message's texts gathered first and the message made once: a run of one role's
    # turns (conversations that end as they begin) was a new message and tuple per turn.
    texts: list[tuple[str, list[str]]] = []
    if turns[0][0] != "user":
        texts.append(("user", [header]))
    elif apart:
        texts += [("user", [header]), ("assistant", [SKIPPED])]
    else:
        turns[0] = ("user", header + "\n\n" + turns[0][1])
    for role, text in turns:
        if texts and texts[-1][0] == role:
            texts[-1][1].append(text)
        else:
            texts.append((role, [text]))
    closing = NOW.format(datetime.fromtimestamp(asked_at, UTC))
    if texts[-1][0] == "user":
        texts.append(("assistant", [closing]))
    else:
        texts[-1][1].append(closing)
    make = said.message if said is not None else _message
    return [make(role, parts) for role, parts in texts]


def section(rows: list[Row], adjacent: Collection[tuple[int, int]], asked_at: float,
            conversation_id: int | None) -> list[Turn]:
    """Rows as turns, grouped by conversation, oldest first. `adjacent` holds the pairs of
    these rows' messages with nothing stored between them (a run said together)."""
    return [(role, _text(label, parts, current)) for role, label, parts, current
            in runs(rows, adjacent, asked_at, conversation_id)]


def runs(rows: list[Row], adjacent: Collection[tuple[int, int]], asked_at: float,
         conversation_id: int | None) -> list[Run]:
    """`section`'s turns as runs, their text not written yet."""
    groups: dict[int, list[Row]] = {}
    for r in sorted(rows, key=_STORE_ORDER):
        groups.setdefault(r.conversation_id, []).append(r)
    # Other conversations by when they were last said, then the current one.
    order = sorted(groups, key=lambda c: (c == conversation_id, groups[c][-1].at, c))
    asked = datetime.fromtimestamp(asked_at, UTC).date()
    out: list[Run] = []
    for c in order:
        group = groups[c]
        current = c == conversation_id
        previous: Row | None = None
        start, n = 0, len(group)
        while start < n:
            # One message's rows: the group is in store order, so they follow one another.
            first = group[start]
            message = first.message_id
            end = start + 1
            while end < n and group[end].message_id == message:
                end += 1
            # A label opens each run of turns said together; within a run the alternation
            # itself tells the speakers apart, and a label per turn would cost a row's worth.
            # Labels are a tenth of a frame: the conversation is named once per group, and a
            # run resuming the same sitting after skipped turns is marked by SKIPPED alone.
            if previous is None:
                label = _label(first, asked, current)
            elif first.at - previous.at > RUN_GAP:
                label = _when(first.at, asked)
            elif (previous.message_id, message) not in adjacent:  # not said together
                label = SKIPPED
            else:
                label = ""
            # A row flagged at capture as holding a credential (store.m011) is withheld
            # from every other conversation's frame (`_text`).
            out.append(("assistant" if first.role == "assistant" else "user", label,
                        group[start:end], current))
            previous = first
            start = end
    return out


# A row's place in the store, (message_id, item_id): read in C, not a call per row.
_STORE_ORDER = operator.attrgetter("message_id", "item_id")
_SECRET, _NAME = operator.attrgetter("secret"), operator.attrgetter("conversation")


def _label(r: Row, asked: date, current: bool) -> str:
    # Its length is len(_where) + len(_when) + 2, which `_Prefixes` measures by.
    return f"[{_where(r.conversation, current)}, {_when(r.at, asked)[1:]}"


def _where(name: str, current: bool) -> str:
    # Another conversation by the name a person knows it by (names.py), never its session id.
    return ("this conversation" if current else
            f"conversation {name}" if name else "another conversation")


@functools.lru_cache(maxsize=STAMPS)
def _when(at: float, asked: date) -> str:
    """A row's time label and how long before the question's day it was: the same for every
    frame that shows the row that day, made once (a first prompt's frame labels ~100 runs, a
    frame of many short conversations ~200)."""
    return f"[{time_label(at)}, {ago((asked - datetime.fromtimestamp(at, UTC).date()).days)}]"


def ago(days: int) -> str:
    """How long before the question, `days` counted in calendar days (UTC): a label then changes
    only at midnight, all labels at once, and the frame in front stays the prefix a provider
    has cached. "3 minutes before" would change with every turn (measured with bench_prefix,
    turns a minute apart: Anthropic's cost per request 3,044 units against 2,278 for the same
    turns a second apart)."""
    if days <= 0:
        return "earlier today"
    if days == 1:
        return "yesterday"
    unit, size = next((u, s) for u, s in (("year", 365), ("month", 30), ("week", 7), ("day", 1))
                       if days >= s)
    n = days // size
    return f"{n} {unit}{'s' if n > 1 else ''} before"


def stub(item_id: int, tokens: int) -> str:
    """What a live task's tool result is sent as when the request would pass its bound
    (frame/plan.py): the stored row that gives it back whole."""
    return (f"[This tool result ({tokens:,} tokens) was cleared to keep the request small;"
            f" it is stored: memory_more(item={item_id}) reads it.]")


def with_note(messages: list[Message], note: str) -> list[Message]:
    """The frame with a note at its end (after the stable part, so the cached prefix holds);
    a note alone when memory had no frame to give."""
    if not messages:
        return [Message("user", (Part(Kind.TEXT, note),)),
                Message("assistant", (Part(Kind.TEXT, CLOSING),))]
    last = messages[-1]
    return messages[:-1] + [Message(last.role, last.parts + (Part(Kind.TEXT, note),))]
