"""Each identifier the Claude Code replay counts as missed, one by one, as JSON lines.

    .venv/bin/python scripts/replay_misses.py ../shared/data/claude-code > misses.jsonl

A miss is a name the recorded reply took from older history (cli/replay/measure.py) that the
upstream request did not hold ("request"), or held without the text around its latest mention
("context"). Each line says which call, where that latest mention was (messages and tokens
before the live task, in what kind of block, how many blocks named it), where it stands to the
frame that call read (the conversation's latest frame, frame_select.frame: whether the row was
among those the stretch is chosen from, whole or quoted in part, the name's tier and how often
it was named), what the stretch held instead, and what of the name the request did hold.

Found on the six shared sessions (docs/savings.md, "The misses one by one"): of 55 misses, 14
were the measure's (the names of the tools a reply calls and of their arguments, the harness's
text), and 5 names were the tails of hyphenated file names; of the 41 left (of 419), 11 lie in
the model's thinking, 12 are one vault's other spellings of a path, 7 are written from what the
model knows, 2 are older than the stretch's 200 messages and 9 were left out by the stretch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from perpetuity_core.cli.replay import drive
from perpetuity_core.cli.replay.measure import (
    CONTEXT,
    older_names,
    parts_text,
    reply_text,
    request_text,
    with_context,
)
from perpetuity_core.cli.replay.request import build
from perpetuity_core.frame import select, stretch
from perpetuity_core.frame.render import cost
from perpetuity_core.wire.protocols import anthropic

_frame = select.frame
_send = drive._Side.send
_replay_call = drive._replay_call
frames: dict[str, tuple[Any, ...]] = {}  # session -> (rows, recent items, selection) of its frame
captured: list[tuple[Any, ...]] = []
sent_last: list[dict[str, Any]] = []
out: list[dict[str, Any]] = []


def frame(rows: Any, warm: Any, hits: Any, half: Any, recent_items: Any, *a: Any,
          **k: Any) -> Any:
    chosen = _frame(rows, warm, hits, half, recent_items, *a, **k)
    captured.append((rows, list(recent_items), chosen))
    return chosen


def send(self: Any, *a: Any, **k: Any) -> Any:
    got = _send(self, *a, **k)
    sent_last[:] = [got[0]]
    return got


def blocks(messages: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    """(message index, part) for every part of `messages`, oldest first."""
    return [(n, p) for n, m in enumerate(messages) if isinstance(m, dict)
            for p in anthropic.message_from(m).parts]


def where(name: str, messages: list[dict[str, Any]], live_from: int) -> dict[str, Any]:
    older = blocks(messages[:live_from])
    tools = {p.call_id: p.name for _, p in older if p.kind.value == "tool_call"}
    hits = [(k, n, p) for k, (n, p) in enumerate(older) if name in p.text]
    if not hits:  # only in a block's wire text (request_text), not as the proxy reads it
        raw = [n for n, m in enumerate(messages[:live_from]) if name in json.dumps(m)]
        return {"kind": "not in the parts read", "messages_before": live_from - raw[-1],
                "raw": _around(json.dumps(messages[raw[-1]]), name)}
    k, n, p = hits[-1]
    after = sum(len(q.text) for _, q in older[k + 1:]) // 4
    kind = p.kind.value
    if kind == "tool_result":
        kind += ":" + tools.get(p.call_id, "?")
    elif kind == "tool_call":
        kind += ":" + p.name
    else:
        kind += ":" + (messages[n].get("role") or "?")
    at = p.text.rfind(name)
    return {"kind": kind, "messages_before": live_from - n, "tokens_before": after,
            "blocks_naming": len(hits), "mention": p.text[max(0, at - CONTEXT):at + len(name)
                                                          + CONTEXT]}


def in_frame(name: str, session: str) -> dict[str, Any]:
    if session not in frames:
        return {"frame": None}
    rows, recent_items, chosen = frames[session]
    holding = [i for i in recent_items if i in rows and name in rows[i].text]
    if not holding:
        return {"frame": "not in the rows it is chosen from"}
    i = max(holding)
    state = ("excerpt" if i in chosen.excerpts else "whole" if i in chosen.recent else "left out")
    newest = sorted((j for j in recent_items if j in rows), reverse=True)
    tiers = stretch.latest_mentions([rows[j] for j in newest])
    tier = next((t for t, m in zip(("touched>1", "touched once", "tool output only"), tiers[:3],
                                   strict=True) if name in m), "not a frame name")
    rendered = (chosen.excerpts[i].text if i in chosen.excerpts else rows[i].text)
    run = next((k for k, j in enumerate(newest) if j not in chosen.recent), len(newest))
    older = [j for j in newest[run:] if j in chosen.recent]
    held = {j: chosen.excerpts.get(j, rows[j]) for j in chosen.recent}
    return {"frame": state, "rows_naming": len(holding), "tier": tier,
            "times": tiers[3].get(name, 0), "row_kind": rows[i].kind,
            "row_tokens": cost(rows[i]), "rows_newer": sum(1 for j in newest if j > i),
            "excerpt_holds_name": name in rendered,
            # what the stretch held instead: its newest run of rows, and the older latest
            # mentions it quoted (rows, tokens as held)
            "stretch_newest_rows": run,
            "stretch_newest_tokens": sum(cost(held[j]) for j in newest[:run]),
            "stretch_older_rows": len(older),
            "stretch_older_tokens": sum(cost(held[j]) for j in older)}


def replay_call(side: Any, session: Any, call: Any, shape: Any, tally: Any,
                harness_ids: set[str], *caches: Any) -> None:
    captured.clear()
    before = tally.calls
    _replay_call(side, session, call, shape, tally, harness_ids, *caches)
    if captured:
        frames[session.id] = captured[-1]
    if tally.calls == before:
        return
    built = build(call, shape, session)
    messages, live = built.body["messages"], built.live_from
    sent = sent_last[0]
    older = older_names(call.reply, messages, live, harness_ids)
    text, quoted = request_text(sent), "\n".join(parts_text(sent.get("messages") or []))
    for name in sorted(older):
        kept = name in text
        if kept and with_context({name}, parts_text(messages[:live]), quoted):
            continue
        row = {"session": session.id[:8], "call": tally.calls, "name": name,
               "miss": "context" if kept else "request", "cause": drive.cause(call, side.made,
                                                                            tally),
               "reply": _around(reply_text(call.reply), name)}
        row |= where(name, messages, live) | in_frame(name, session.id)
        shown = [p.text for _, p in blocks(messages[:live]) if p.kind.value != "thinking"]
        row["context_outside_thinking"] = bool(with_context({name}, shown, quoted))
        row["as_tool_name"] = any(p.kind.value == "tool_call" and p.name == name
                                  for _, p in blocks(messages[:live]))
        if kept:
            row["held_as"] = _around(quoted, name)
        else:
            row["parts_held"] = [p for p in _parts(name) if p in text]
        out.append(row)


def _around(text: str, name: str) -> str:
    at = text.find(name)
    return text[max(0, at - 60):at + len(name) + 60]


def _parts(name: str) -> list[str]:
    """The pieces of a name a request could hold it by: a path's directory and file name."""
    if "/" in name:
        head, _, tail = name.rpartition("/")
        return [p for p in (head, tail) if len(p) >= 4]
    return [p for p in name.replace("_", ".").split(".") if len(p) >= 4]


def main(path: str) -> None:
    select.frame = frame  # type: ignore[assignment]
    drive._Side.send = send  # type: ignore[method-assign]
    drive._replay_call = replay_call
    report = drive.claude_code([Path(path)])
    for row in out:
        print(json.dumps(row, ensure_ascii=False))
    total = report.total.as_dict()["older_history"]
    print(json.dumps(total), file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: replay_misses.py SESSIONS (a folder of Claude Code session files)")
    main(sys.argv[1])
