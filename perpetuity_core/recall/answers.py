"""How the recall tools' answers read: one turn's view of memory (`TurnMemory`), a row's label and
body, clipping to the answer's size, and the words for times and counts.

Every answer is for one user and one turn: `TurnMemory.shown` holds the rows the model has
seen this turn (the frame's, then every row a call returned), and no call shows a row's text
twice. Answers are compact: each row cut to its share of RESULT_CHARS (2,000 tokens at four
characters a token) with a note how to read on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from perpetuity_core.frame.cap import Cap
from perpetuity_core.frame.rows import quoted, time_label
from perpetuity_core.frame.tenants import withheld
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.storage.reads import Row, items_of, shown_rows
from perpetuity_core.wire.conversation import Message

SNIPPET_CHARS = 100  # memory_count lists instances, not their whole text
RESULT_CHARS = 8_000  # 2,000 tokens at four characters a token (index.token_estimate's rule)
MIN_ROW_CHARS = 400  # a row is never cut shorter than this, whatever the limit
# A search's answer is sized as the frame is (memory.cap): by how its scores are spread, from
# the floor for one clear match to the ceiling for many close ones, in tokens.
ANSWER_CAP = Cap(floor=400, ceiling=1_500)
# Room a row's label takes, kept out of its text's share: the conversation's name is most
# of it (a title of up to names.TITLE_CHARS, and the project folder).
LABEL_CHARS = 160


@dataclass
class TurnMemory:
    """One client request's view of memory, created by the proxy, updated by every call."""

    user_id: int
    conversation_id: int | None
    asked_at: float  # wall time of the question, for "how long ago"
    shown: set[int] = field(default_factory=set)  # item ids the model has seen this turn
    below_cap: list[int] = field(default_factory=list)  # ranked retrieval the cap left out
    library: Path | None = None  # the asking tenant's notes library, when note_capture rides
    # The request's messages, for whether the conversation quoted untrusted content (a fetched
    # page): looked at only when a note is captured, not on every call of a long session.
    history: Sequence[Message] = ()
    # A personal proxy: every stored row is the asker's, as in its frames (older tenants',
    # imports'), so the tools read the whole file; otherwise only the asking user's rows.
    everyone: bool = False
    # The harness's messages in front of the model as it sent them (the live history kept):
    # their rows are read into `shown` at the first call (`see_sent`), so a tool never gives
    # back what the request already carries. Read lazily: most turns call no tool.
    sent: Sequence[Message] = ()

    @property
    def owner(self) -> int | None:
        """Whose rows alone the tools may read: the asking user's, or no one's (everyone)."""
        return None if self.everyone else self.user_id


def see_sent(memory: TurnMemory, scanner: Scanner) -> None:
    """Count the rows of the messages the request carries as sent among those shown."""
    if memory.sent and memory.conversation_id is not None:
        ids = scanner.store.message_ids(memory.conversation_id,
                                        [m.fingerprint() for m in memory.sent])
        memory.shown.update(items_of(scanner.db, set(ids)))
    memory.sent = ()


def fetch_rows(scanner: Scanner, user_id: int | None,
               item_ids: Iterable[int]) -> dict[int, Row]:
    """The rows among `item_ids` (of `user_id` only, when given) that the model may be shown."""
    return shown_rows(scanner.db, item_ids, user_id)


def row_label(r: Row, *extra: str, named: bool = False) -> str:
    """A row's label: its id, its conversation, role and time; `named`, its conversation was
    named at an earlier row of this answer, so its number stands alone (LoCoMo's turns are some
    30 tokens, a label with the conversation's name 25 of its own)."""
    conversation = (f"c{r.conversation_id}" if named
                    else conversation_name(r.conversation_id, r.conversation))
    return "[" + " · ".join((f"#{r.item_id}", conversation, r.role, time_label(r.at),
                             *extra)) + "]"


def conversation_name(conversation_id: int, name: str) -> str:
    """A conversation as an answer names it: the number a filter takes, and the name a person
    knows it by (names.py), never its session id."""
    return f"c{conversation_id} {name}" if name else f"c{conversation_id}"


def row_body(r: Row) -> str:
    """A row as the model reads it; a row holding a credential is withheld (an answer can
    carry it into any conversation)."""
    if r.secret:
        return withheld(r)
    return quoted(r)


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


def row_chars(limit: int) -> int:
    """A row's share of the answer, so `limit` rows fit in RESULT_CHARS."""
    return max(MIN_ROW_CHARS, RESULT_CHARS // max(limit, 1) - LABEL_CHARS)


def row_line(r: Row, chars: int, *extra: str, named: bool = False) -> str:
    body = row_body(r)
    return f"{row_label(r, *extra, named=named)} {clip(body, r.item_id, 0, chars)}"


def _stub(r: Row, *extra: str) -> str:
    """A row the model has already seen this turn: where it sits, never its text again."""
    return f"{row_label(r, *extra)} (already shown)"


def render_answer(memory: TurnMemory, header: str, lines: Sequence[tuple[int | None, str]]) -> str:
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


def fill(memory: TurnMemory, header: str, rows: Sequence[Row], budget: int) -> str:
    """Header, then whole rows in the order given while they fit in `budget` tokens; a row that
    does not fit is passed over for a smaller one after it, and the first row, when it fits
    nowhere, is cut to the budget. Rows already shown this turn are never given again; the
    rows given join `shown`."""
    out = [header]
    used = token_estimate(header)
    given: list[int] = []
    passed = 0
    named: set[int] = set()  # the conversations named at a row given
    for r in rows:
        if r.item_id in memory.shown or r.item_id in given:
            continue
        short = r.conversation_id in named
        line = f"{row_label(r, named=short)} {row_body(r)}"
        cost = token_estimate(line) + 1
        if used + cost > budget:
            if given or passed:
                passed += 1
                continue
            line = row_line(r, max(MIN_ROW_CHARS, (budget - used) * 4 - LABEL_CHARS),
                            named=short)
            cost = token_estimate(line) + 1
        out.append(line)
        used += cost
        given.append(r.item_id)
        named.add(r.conversation_id)
    if passed:
        out.append(f"[{passed} more rows left out for size: call again for them]")
    memory.shown.update(given)
    return "\n".join(out)


def day_of(at: float) -> str:
    return time_label(at)[:10]


def days_span(at: np.ndarray) -> str:
    first, last = day_of(float(at.min())), day_of(float(at.max()))
    return first if first == last else f"{first} to {last}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def instance_line(r: Row, marks: list[str], memory: TurnMemory) -> tuple[int | None, str]:
    """One counted row, compactly: a snippet around the first of `marks` (the category's
    stems) it holds. Its id joins `shown` only when the snippet is the whole row: a row seen
    in part stays reachable in full by memory_search."""
    # By number only: the tally above names each conversation once.
    head = f"#{r.item_id} {time_label(r.at)[:16]} c{r.conversation_id} {r.role}"
    if r.item_id in memory.shown:
        return None, f"{head} (already shown)"
    body = " ".join(row_body(r).split())
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


def event_line(r: Row, chars: int, memory: TurnMemory, *extra: str) -> tuple[int | None, str]:
    if r.item_id in memory.shown:
        return None, _stub(r, *extra)
    return r.item_id, row_line(r, chars, *extra)


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

