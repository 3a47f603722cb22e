"""An agent's frame: the conversation's latest stretch, the newest rows and then the latest
mention of each name the conversation touched, whole or as the lines around it (`latest`).
What a coding task's next reply takes from before its prompt lies mostly there. Pure: no reads.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace

from perpetuity_core.frame.render import ROW_FLOOR, cost
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Kind

# The conversation's latest stretch (tokens, largest row): what a coding task's next reply uses
# from before its prompt lies mostly there, in small rows. Cost and identifiers kept:
# `perpetuity replay claude-code ../shared/data/claude-code` (trials: docs/tuning.md).
RECENT_TOKENS = 4_750
RECENT_ROW = 1_000
# Of the stretch, the percent that is the newest rows; the rest holds the latest mention of each
# name the conversation touched, older than those. The same replay (trials: docs/tuning.md).
NEWEST_SHARE = 60
# A name a coding task touches: a word of four characters or more with a letter that holds a
# slash, a dot or an underscore (a path, a file, module.attr, snake_case) or is camelCase. One
# pass of a plain character class, then a look at each word: a pattern of alternatives tried at
# every character took 1 s over 200 messages' rows.
_WORD = re.compile(r"[\w./~-]{4,}")
_CAMEL = re.compile(r"[a-z][A-Z]")
# A name's latest mention in a row too long to quote whole comes as an excerpt: the characters
# either side, widened to whole lines that end within LINE_SLACK more, and the row's id, which
# memory_more reads whole. The same replay (trials: docs/tuning.md).
EXCERPT_CHARS = 90
LINE_SLACK = 80
# What an excerpt costs beside its text: its mark (render.EXCERPT) and the marks of what it left
# out (it was 8 against a mark of 15 tokens; the mark is 4 now).
EXCERPT_TOKENS = 8
LEFT_OUT = "[…]"
NAMED_ROWS = 4_096  # row texts whose names are kept: a few conversations' latest stretches
# A newest row over BULK_ROW tokens comes as the lines around the names it holds when those are
# under BULK_SHARE percent of it: a file read or a long edit is mostly text the next step does
# not take up, and memory_more reads it whole. The same replay (docs/savings.md).
BULK_ROW = 150
BULK_SHARE = 67
_TOOL_RESULT = Kind.TOOL_RESULT.value  # hot: once, not per row
# A chat's long other half of its top hit's exchange (frame_select.HALF_WHOLE) comes as the
# lines around the first mentions of HALF_SPANS of the question's words (`around`).
HALF_SPANS = 1
_WORDS = re.compile(r"\w+")


def latest(rows: dict[int, Row], items: list[int], most: int = RECENT_TOKENS,
           agent: bool = False) -> tuple[set[int], dict[int, Row]]:
    """The conversation's latest rows within `most` tokens, and of them those quoted as
    excerpts (item id -> the row as excerpted). The newest rows up to RECENT_ROW first, while
    they fit NEWEST_SHARE of it: whole, or in an `agent`'s a bulk as the lines around its
    names (`bulk`); then the latest mention of each name the conversation touched more than
    once (`latest_mentions`, bulk rows too) that the chosen rows do not hold: a row whose
    mentions are most of it whole, else the lines around each mention (`excerpt`), the most
    names per token first, in an agent's weighed by how often each was named. A chat's long
    message is what its person said, whole: a name in it (a link) is not what it is about."""
    newest_first = sorted((i for i in items if i in rows), reverse=True)
    out: set[int] = set()
    chosen: dict[int, list[tuple[int, int]]] = {}
    used = 0
    newest = most * NEWEST_SHARE // 100
    for i in newest_first:
        r, c = rows[i], cost(rows[i])
        if c > RECENT_ROW:
            continue
        where = bulk(r, c) if agent else None
        c = c if where is None else _spans_tokens(where)
        if used + c > newest:
            break
        if where is None:
            out.add(i)
        else:
            chosen[i] = where
        used += c
    quoted = set(chosen)  # every name these hold comes with its lines already
    # The names touched more than once first; the rest of the stretch goes to those touched once
    # (a new conversation's first frames, where nothing was named twice yet), then to those only
    # tool output named.
    *tiers, times = latest_mentions([rows[i] for i in newest_first])
    if not agent:
        times = Counter(dict.fromkeys(times, 1))
    for mentions in tiers:
        left = {name: i for name, i in mentions.items() if i not in quoted}
        used = _mentions(rows, left, times, most, used, out, chosen)
    excerpts = {i: excerpt(rows[i], where) for i, where in chosen.items() if i not in out}
    return out | set(excerpts), excerpts


def bulk(r: Row, tokens: int) -> list[tuple[int, int]] | None:
    """The spans of a newest row of `tokens` over BULK_ROW to quote instead of it whole: the
    lines around the last mention of each name it holds (`span`), when they come to under
    BULK_SHARE percent of it; None to quote it whole."""
    if tokens <= BULK_ROW:
        return None
    found = [span(r.text, r.text.rfind(name), len(name)) for name in names(r.text)]
    if not found or _spans_tokens(found) * 100 >= tokens * BULK_SHARE:
        return None
    return found


def _spans_tokens(spans: list[tuple[int, int]]) -> int:
    """What an excerpt of `spans` costs, by token_estimate's rule with its marks."""
    return sum((e - s + 3) // 4 + EXCERPT_TOKENS for s, e, _ in merge(spans))


def _mentions(rows: dict[int, Row], mentions: dict[str, int], times: Mapping[str, int],
              most: int, used: int, out: set[int],
              chosen: dict[int, list[tuple[int, int]]]) -> int:
    """Add to the stretch (`out`, rows whole; `chosen`, excerpts' spans by row) the latest
    mention of each of `mentions` (name -> its row) that `out` does not hold, within `most`
    tokens, the most worth per token first: a name is worth the `times` the conversation named
    it (in how many rows), as what a task keeps coming back to is what its next step uses
    (the replay: of the names named once 0.5% were used, of those named in ten rows or more
    16%). The tokens used after."""
    named: dict[int, list[str]] = {}
    for name, i in mentions.items():
        if i not in out:
            named.setdefault(i, []).append(name)
    room = most - used
    spans: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}
    for i, these in named.items():
        r, whole = rows[i], cost(rows[i])
        # A row none of whose candidates could fit is not searched: an excerpt holds its name
        # and EXCERPT_CHARS on one side at least (or the whole text), and the row whole costs
        # its cost. The last tier, names only tool output held, is some 300 a rebuilt coding
        # frame, seldom with room left (the six shared sessions' 44 frames: this step 0.92 ms
        # a frame, 0.41 so; the stretch chosen the same).
        excerpt = (min(len(r.text), min(map(len, these)) + EXCERPT_CHARS) + 3) // 4
        if excerpt + EXCERPT_TOKENS > room and (whole > RECENT_ROW or whole > room):
            continue
        spans[i] = ([span(r.text, r.text.rfind(name), len(name)) for name in these],
                    [times[name] for name in these])
    # (worth, tokens, item id, the span; None: the row whole)
    candidates: list[tuple[int, int, int, tuple[int, int] | None]] = []
    for i, (found, worth) in spans.items():
        r, merged = rows[i], merge(found, worth)
        if cost(r) <= RECENT_ROW and 2 * sum(e - s for s, e, _ in merged) >= len(r.text):
            candidates.append((sum(worth), cost(r), i, None))
        else:  # an excerpt's tokens by token_estimate's rule, without copying its text
            candidates += [(w, (e - s + 3) // 4 + EXCERPT_TOKENS, i, (s, e))
                           for s, e, w in merged]
    for _, c, i, where in sorted(candidates, key=lambda k: (-k[0] / (k[1] + ROW_FLOOR), -k[2])):
        if used + c > most or i in out:
            continue
        if where is None:
            out.add(i)
        else:
            chosen.setdefault(i, []).append(where)
        used += c
    return used


def span(text: str, at: int, length: int) -> tuple[int, int]:
    """Where an excerpt of `text` around the mention at `at` starts and ends: EXCERPT_CHARS
    either side, widened to whole lines where the line ends within LINE_SLACK more."""
    start, end = max(0, at - EXCERPT_CHARS), min(len(text), at + length + EXCERPT_CHARS)
    line_start = text.rfind("\n", 0, start) + 1
    if start - line_start <= LINE_SLACK:
        start = line_start
    line_end = text.find("\n", end)
    line_end = len(text) if line_end < 0 else line_end
    if line_end - end <= LINE_SLACK:
        end = line_end
    return start, end


def merge(spans: list[tuple[int, int]],
          worth: list[int] | None = None) -> list[tuple[int, int, int]]:
    """Overlapping or touching spans as one, in text order, each with the sum of the `worth`
    of those it merged (1 each unless given: how many)."""
    out: list[tuple[int, int, int]] = []
    for (s, e), w in sorted(zip(spans, worth or [1] * len(spans), strict=True)):
        if out and s <= out[-1][1] + 1:
            ps, pe, n = out[-1]
            out[-1] = (ps, max(pe, e), n + w)
        else:
            out.append((s, e, w))
    return out


def excerpt(r: Row, spans: list[tuple[int, int]]) -> Row:
    """`r` quoting only `spans` of its text, verbatim, LEFT_OUT where text is left out between
    and around them; rendered with its id, which memory_more reads whole."""
    spans = [(s, e) for s, e, _ in merge(spans)]
    parts = [LEFT_OUT] if spans[0][0] > 0 else []
    for k, (s, e) in enumerate(spans):
        if k:
            parts.append(LEFT_OUT)
        parts.append(r.text[s:e])
    if spans[-1][1] < len(r.text):
        parts.append(LEFT_OUT)
    return replace(r, text="\n".join(parts), excerpt=True)


def around(r: Row, asked: Callable[[str], bool]) -> Row:
    """`r` as the lines around the first mentions of HALF_SPANS distinct words the question
    `asked` (a word of the text -> whether it is one of the question's terms), the text's
    opening where it mentions none (`excerpt`)."""
    first: dict[str, int] = {}
    for m in _WORDS.finditer(r.text):
        word = m.group().lower()
        if word not in first and asked(word):
            first[word] = m.start()
            if len(first) == HALF_SPANS:
                break
    spans = [span(r.text, at, len(word)) for word, at in first.items()] or [span(r.text, 0, 0)]
    return excerpt(r, spans)


def latest_mentions(newest_first: list[Row]) -> tuple[dict[str, int], dict[str, int],
                                                    dict[str, int], Counter[str]]:
    """The names (`names`) the conversation touched (said in words or a tool call's arguments,
    not only seen in a tool's output) in more than one of these rows, those it touched in one,
    and those only tool output held, each with the row of its latest mention (what a listing or
    a log names and the task never took up is what its next reply uses least); then how many
    of the rows named each."""
    last: dict[str, int] = {}
    seen: Counter[str] = Counter()
    touched: set[str] = set()
    for r in newest_first:
        found = names(r.text)
        for name in found:
            seen[name] += 1
            last.setdefault(name, r.item_id)
        if r.kind != _TOOL_RESULT:
            touched |= found
    return ({name: row for name, row in last.items() if name in touched and seen[name] > 1},
            {name: row for name, row in last.items() if name in touched and seen[name] == 1},
            {name: row for name, row in last.items() if name not in touched}, seen)


@functools.lru_cache(maxsize=NAMED_ROWS)
def names(text: str) -> frozenset[str]:
    """The paths and code names in a text (see _WORD). Kept for the latest NAMED_ROWS texts:
    a conversation's next frame reads the same rows again, and only the new ones cost. Each
    word looked at once, and one of letters and digits alone (most words) only for camelCase:
    the 1,306 texts of the six shared sessions' frames 61-89 ms against 49-52 for every word
    in full."""
    out = set()
    for word in set(_WORD.findall(text)):
        if word.isalnum():  # none of "./~-_": nothing to strip, a name only if camelCase
            if not (word.islower() or word.isupper()) and _CAMEL.search(word):
                out.add(word)  # (a camelCase word holds a letter: never digits alone)
            continue
        word = word.strip("./~-")
        if (len(word) >= 4 and ("/" in word or "." in word or "_" in word.strip("_")
                                or _CAMEL.search(word)) and not word.replace(".", "").isdigit()):
            out.add(word)
    return frozenset(out)
