"""How much of an agent's rebuilt frames repeats text shown elsewhere, as JSON.

    .venv/bin/python scripts/frame_repeats.py ../shared/data/claude-code

Replays the Claude Code sessions as `perpetuity replay` does (scripts/replay_misses.py's
hooks) and reads every frame a rebuild chose: its stretch's rows as quoted (excerpts as
excerpted), line by line. A line is the same as another when it reads the same without a
Read result's line-number prefix ("12\\t"), its JSON escapes or the whitespace around it.

- `repeats`: lines shown in an earlier row of the same frame, by the kinds of the two rows
  (the same file read twice, a read and a later edit's strings, a command's output twice...);
  `in_runs` counts only those in runs of RUN_CHARS or more, what a pointer could stand for;
- `live_task`: the frame's lines that the live task of its rebuilding call shows again (known
  when the frame is built), or only a later call's live task under the same frame;
- `waste`: Read results' line-number prefixes, whitespace past the first of a run, a tool
  call's JSON escapes past their first character.

Each class is its characters (four to a token, as the replay counts) as a share of the
frames' quoted characters, summed over the frames as built and weighted by the calls that
read each (a tool round re-reads its frame); `all` is their union, each character once.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from perpetuity_core.cli.replay import drive
from perpetuity_core.cli.replay.measure import parts_text
from perpetuity_core.cli.replay.request import build
from perpetuity_core.frame import select
from perpetuity_core.frame.render import quote
from perpetuity_core.frame.stretch import LEFT_OUT
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Kind

RUN_CHARS = 160  # a run of repeated lines a pointer (~10 tokens) would stand for with profit
CUT_WHOLE = 90  # a row this much of whose lines a later row shows is shown again (`shown_later`)
SHORT = 4  # a line shorter than this ("}", "---") is the same as many others by chance
_LINE = re.compile(r"\n")
# A tool call's arguments are JSON: its lines are split by the escape, and by the keys.
_CALL_LINE = re.compile(r'\\n|\n|", "[A-Za-z_]+": "?|^\{"[A-Za-z_]+": "?')
_NUMBERED = re.compile(r"[ \t]*\d+\t")  # Claude Code's Read: "12\tline"
_SPACES = re.compile(r"[ \t]{2,}")
_ESCAPE = re.compile(r'\\[n"\\t/r]')
_UNESCAPE = {r"\"": '"', r"\\": "\\", r"\t": "\t", r"\/": "/", r"\r": ""}

_frame = select.frame
_replay_call = drive._replay_call
captured: list[tuple[dict[int, Row], Any]] = []
frames: list[dict[str, Any]] = []  # per frame built: its rows as quoted, the calls that read it
current: dict[str, dict[str, Any]] = {}  # session -> the frame its calls read


def frame(rows: Any, warm: Any, hits: Any, half: Any, recent_items: Any, *a: Any,
          **k: Any) -> Any:
    chosen = _frame(rows, warm, hits, half, recent_items, *a, **k)
    captured.append((rows, chosen))
    return chosen


def replay_call(side: Any, session: Any, call: Any, shape: Any, tally: Any, *rest: Any) -> None:
    captured.clear()
    before = tally.calls
    _replay_call(side, session, call, shape, tally, *rest)
    if tally.calls == before:
        return
    built = build(call, shape, session)
    live = parts_text(built.body["messages"][built.live_from:])
    if captured and side.made == "frame":
        rows, chosen = captured[-1]
        shown = [chosen.excerpts.get(i, rows[i]) for i in sorted(chosen.recent)]
        current[session.id] = {"rows": shown, "reads": 0, "live_at_build": live, "live": []}
        frames.append(current[session.id])
    if (f := current.get(session.id)) is not None:
        f["reads"] += 1
        f["live"] += live


def lines(r: Row) -> list[tuple[int, int, str]]:
    """(start, end, key) of each line of the row's text; `key` reads the same for the same
    line as another row shows it, "" for a blank one."""
    call = r.kind == Kind.TOOL_CALL.value
    out, at = [], 0
    for m in [*(_CALL_LINE if call else _LINE).finditer(r.text), None]:
        end = len(r.text) if m is None else m.start()
        out.append((at, end, key(r.text[at:end], call)))
        at = end if m is None else m.end()
    return out


def key(line: str, call: bool) -> str:
    if call:
        line = re.sub(r'\\[\\"t/r]', lambda m: _UNESCAPE[m.group()], line)
    line = _NUMBERED.sub("", line, count=1)
    return " ".join(line.split())


def kind_of(r: Row) -> str:
    """A row's kind for the classes: a tool's name for its call or result (Claude Code's
    results are stored without it, so by the shape of their text), else its role's words."""
    if r.kind == Kind.TOOL_CALL.value:
        return "call:" + (r.name if r.name in ("Edit", "Write", "MultiEdit", "Bash") else "other")
    if r.kind == Kind.TOOL_RESULT.value:
        return "result:read" if _NUMBERED.match(r.text) else "result:other"
    return "words"


CLASSES = ("repeat", "in_runs", "live_now", "live_later", "numbers", "spaces", "escapes")


def live_keys(texts: list[str]) -> set[str]:
    """The keys of the lines of a live task's block texts, read either way (JSON or not)."""
    return ({key(x, True) for t in texts for x in _CALL_LINE.split(t)}
            | {key(x, False) for t in texts for x in t.split("\n")})


def row_marks(r: Row, seen: dict[str, str], live_now: set[str], live_later: set[str],
              pairs: Counter[str]) -> dict[str, np.ndarray]:
    """Which characters of the row's text are in each class; its lines' keys added to
    `seen`, its repeats' characters to `pairs` (by the kinds of the first row and this)."""
    n, kind = len(r.text), kind_of(r)
    mine = {c: np.zeros(n, bool) for c in CLASSES}
    run: list[tuple[int, int]] = []
    new: dict[str, str] = {}
    for s, e, k in lines(r) + [(n, n, LEFT_OUT)]:
        if kind == "result:read" and (m := _NUMBERED.match(r.text, s)):
            mine["numbers"][m.start():m.end()] = True
        if len(k) < SHORT:  # a blank line, a brace: within a run, never one alone
            continue
        if k != LEFT_OUT and (first := seen.get(k)) is not None:
            pairs[f"{first} > {kind}"] += e - s + 1
            mine["repeat"][s:e + 1] = True
            run.append((s, e))
        else:  # an excerpt's gap or a new line ends a run
            if run and run[-1][1] + 1 - run[0][0] >= RUN_CHARS:
                mine["in_runs"][run[0][0]:run[-1][1] + 1] = True
            run = []
        if k != LEFT_OUT:
            new.setdefault(k, kind)
            if k in live_now:
                mine["live_now"][s:e + 1] = True
            elif k in live_later:
                mine["live_later"][s:e + 1] = True
    for m in _SPACES.finditer(r.text):
        mine["spaces"][m.start() + 1:m.end()] = True
    if r.kind == Kind.TOOL_CALL.value:
        for m in _ESCAPE.finditer(r.text):
            mine["escapes"][m.start() + 1] = True
    for k, first_kind in new.items():
        seen.setdefault(k, first_kind)
    return mine


def shown_later(rows: list[Row]) -> int:
    """The quoted characters of the rows CUT_WHOLE percent of whose lines a later row of the
    frame shows: an earlier copy the frame could leave out whole, with no pointer."""
    keys = [[(e - s, k) for s, e, k in lines(r) if len(k) >= SHORT and k != LEFT_OUT]
            for r in rows]
    later: set[str] = set()
    out = 0
    for r, mine in zip(reversed(rows), reversed(keys), strict=True):
        size = sum(n for n, _ in mine)
        if size and sum(n for n, k in mine if k in later) * 100 >= size * CUT_WHOLE:
            out += len(quote(r))
        later |= {k for _, k in mine}
    return out


def measure(f: dict[str, Any]) -> dict[str, Any]:
    """One frame's characters by class (a line's characters, its break included), in all and
    by the kind of row that holds them."""
    rows: list[Row] = f["rows"]
    live_now, live_later = live_keys(f["live_at_build"]), live_keys(f["live"])
    seen: dict[str, str] = {}  # a line's key -> the kind of the first row that showed it
    pairs: Counter[str] = Counter()
    marks: dict[str, list[np.ndarray]] = {c: [] for c in CLASSES}
    by_kind: Counter[str] = Counter()
    for r in rows:
        mine = row_marks(r, seen, live_now, live_later, pairs)
        for c in CLASSES:
            marks[c].append(mine[c])
            by_kind[f"{c} in {kind_of(r)}"] += int(mine[c].sum())
    flat = {c: np.concatenate(v) if v else np.zeros(0, bool) for c, v in marks.items()}
    union = flat["repeat"] | flat["live_now"] | flat["numbers"] | flat["spaces"] | flat["escapes"]
    return {"chars": sum(len(quote(r)) for r in rows), "reads": f["reads"], "pairs": pairs,
            "by_kind": by_kind, **{c: int(v.sum()) for c, v in flat.items()},
            "shown_later": shown_later(rows), "all": int(union.sum()),
            "all_and_later": int((union | flat["live_later"]).sum())}


def report(measured: list[dict[str, Any]]) -> dict[str, Any]:
    classes = (*CLASSES, "shown_later", "all", "all_and_later")

    def shares(weight: str | None) -> dict[str, float]:
        w = [1 if weight is None else m[weight] for m in measured]
        total = sum(m["chars"] * x for m, x in zip(measured, w, strict=True))
        return {c: round(sum(m[c] * x for m, x in zip(measured, w, strict=True)) / total, 4)
                for c in classes}

    pairs: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    for m in measured:
        pairs.update(m["pairs"])
        by_kind.update({k: v * m["reads"] for k, v in m["by_kind"].items()})
    total = sum(m["chars"] for m in measured)
    read = sum(m["chars"] * m["reads"] for m in measured)
    return {"frames": len(measured), "reads": sum(m["reads"] for m in measured),
            "tokens_per_frame": round(total / 4 / max(1, len(measured))),
            "share_as_built": shares(None), "share_as_read": shares("reads"),
            "repeats_by_rows_as_built": {p: round(c / total, 4) for p, c in pairs.most_common()
                                         if c * 1000 >= total},
            "as_read_by_kind": {k: round(c / read, 4) for k, c in sorted(by_kind.items())
                                if c * 1000 >= read}}


def main(path: str) -> None:
    select.frame = frame  # type: ignore[assignment]
    drive._replay_call = replay_call  # type: ignore[assignment]
    drive.claude_code([Path(path)])
    print(json.dumps(report([measure(f) for f in frames]), indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: frame_repeats.py SESSIONS (a folder of Claude Code session files)")
    main(sys.argv[1])
