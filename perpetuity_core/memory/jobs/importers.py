"""Importers: existing histories into the store, through the same write path as capture.

Each source is read into `Thread`s (one conversation of one user: messages with their times
from the source), and `write` stores a thread with `capture.record`: one transaction per
message, retrieval rows and counts included, history already stored skipped. So a re-import
adds nothing, and an imported row is indistinguishable from a captured one.

Sources:
    claude-code   ~/.claude/projects/**/*.jsonl  (one session a file; Anthropic message JSON)
    locomo        locomo10.json                  (LoCoMo: two speakers, dated sessions)
    beam          a BEAM chats folder or one chat.json (batches of sessions of messages)
    longmemeval   longmemeval_s*.json            (haystack sessions of each question)
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part, as_context


@dataclass(slots=True)
class Thread:
    user_key: str
    conversation_key: str
    messages: list[Message] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # the source's id of each message
    provider: str = "import"
    model: str = ""
    title: str = ""  # what the source calls the conversation, if anything (names.py)
    folder: str = ""  # the project folder the conversation worked in


def write(store: Store, thread: Thread, source: str = "import") -> list[int]:
    """Store a thread through the capture write path; returns the new message ids."""
    from perpetuity_core.memory.storage import capture

    ids, turn = capture.record(store, user_key=thread.user_key,
                               conversation_key=thread.conversation_key, provider=thread.provider,
                               model=thread.model, messages=thread.messages, times=thread.times,
                               source=source, folder=thread.folder)
    store.name_conversation(turn.conversation_id, title=thread.title)
    return ids


# ------------------------------------------------------------------------------ sources


def locomo(path: str | Path, speaker_prefix: bool = True) -> Iterator[Thread]:
    """LoCoMo: one user per conversation; the first speaker is "user", the other "assistant".

    Each turn keeps its speaker's name in front of its text ("Caroline: ..."), as a transcript
    would, and a shared photo as its caption, which is how the dataset's questions refer to it.
    """
    for conv in json.loads(Path(path).read_text(encoding="utf-8")):
        c = conv["conversation"]
        a = c.get("speaker_a", "")
        sid = conv.get("sample_id", "")
        t = Thread(f"locomo:{sid}", f"locomo:{sid}", provider="locomo")
        n = 1
        while f"session_{n}" in c:
            start = _locomo_time(c.get(f"session_{n}_date_time", ""))
            for i, turn in enumerate(c[f"session_{n}"]):
                text = str(turn.get("text", ""))
                if turn.get("blip_caption"):
                    text += f" [shares a photo: {turn['blip_caption']}]"
                if speaker_prefix:
                    text = f"{turn.get('speaker', '')}: {text}"
                role = "user" if turn.get("speaker") == a else "assistant"
                t.messages.append(Message(role, (Part(Kind.TEXT, text),)))
                t.times.append(start + i)  # turns keep their order inside a dated session
                t.labels.append(str(turn.get("dia_id", "")))
            n += 1
        yield t


def _locomo_time(s: str) -> float:
    """LoCoMo dates look like "1:56 pm on 8 May, 2023"."""
    try:
        return datetime.strptime(s.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0


def beam(path: str | Path) -> Iterator[Thread]:
    """BEAM: one user per chat (a folder holding chat.json, or many such folders)."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.rglob("chat.json"), key=_natural)
    for f in files:
        chat = json.loads(f.read_text(encoding="utf-8"))
        name = f.parent.name
        t = Thread(f"beam:{name}", f"beam:{name}", provider="beam")
        anchor = 0.0
        for batch in chat:
            anchor = _beam_time(batch.get("time_anchor"), anchor)
            for session in batch.get("turns", []):
                for m in session if isinstance(session, list) else [session]:
                    anchor = _beam_time(m.get("time_anchor"), anchor)
                    t.messages.append(Message(str(m.get("role", "user")),
                                              (Part(Kind.TEXT, str(m.get("content", ""))),)))
                    t.times.append(anchor + len(t.times))
                    t.labels.append(str(m.get("id", "")))
        yield t


def _beam_time(s: Any, default: float) -> float:
    """BEAM anchors look like "March-15-2024"; messages without one keep the last."""
    if not isinstance(s, str):
        return default
    try:
        return datetime.strptime(s.strip(), "%B-%d-%Y").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return default


def longmemeval(path: str | Path) -> Iterator[Thread]:
    """LongMemEval: each question's haystack is its own user, one conversation per session."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for q in data if isinstance(data, list) else [data]:
        qid = q.get("question_id", "")
        for sid, date, session in zip(q["haystack_session_ids"], q["haystack_dates"],
                                      q["haystack_sessions"], strict=True):
            t = Thread(f"longmemeval:{qid}", f"longmemeval:{qid}:{sid}", provider="longmemeval")
            start = _lme_time(date)
            for i, m in enumerate(session):
                t.messages.append(Message(str(m.get("role", "user")),
                                          (Part(Kind.TEXT, str(m.get("content", ""))),)))
                t.times.append(start + i)
                t.labels.append(f"{sid}:{i}")
            yield t


def _lme_time(s: str) -> float:
    """LongMemEval dates look like "2023/05/20 (Sat) 02:21"."""
    try:
        day, _, clock = s.split(" ")
        return datetime.strptime(f"{day} {clock}", "%Y/%m/%d %H:%M").replace(
            tzinfo=UTC).timestamp()
    except ValueError:
        return 0.0


def claude_code(path: str | Path, user_key: str = "claude-code:local") -> Iterator[Thread]:
    """Claude Code session files: one conversation per session, Anthropic message blocks.

    An assistant reply is written as one line per content block with the same message id;
    those lines are folded back into one message. Sidechain (subagent) lines are skipped. Meta
    lines (skill text, command caveats) are the harness's: stored as context. The session's
    title (its `ai-title` line) and working directory (`cwd`) name the conversation.
    """
    from perpetuity_core.wire.protocols.anthropic import message_from

    p = Path(path).expanduser()
    files = [p] if p.is_file() else sorted(p.rglob("*.jsonl"))
    for f in files:
        t = Thread(user_key, f"claude-code:{f.stem}", provider="anthropic")
        last_id = None
        with f.open(encoding="utf-8", errors="replace") as records:
            for line in records:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(rec, dict):
                    continue
                if rec.get("type") == "ai-title" and isinstance(rec.get("aiTitle"), str):
                    t.title = t.title or rec["aiTitle"]
                msg = rec.get("message")
                if rec.get("type") not in ("user", "assistant") or not isinstance(msg, dict):
                    continue
                if rec.get("isSidechain"):
                    continue
                t.folder = t.folder or str(rec.get("cwd") or "")
                m = message_from(msg)
                if rec.get("isMeta"):
                    m = Message(m.role, as_context(m.parts))
                if not m.parts:
                    continue
                t.model = str(msg.get("model", t.model) or t.model)
                mid = msg.get("id")
                if mid and mid == last_id and t.messages and t.messages[-1].role == m.role:
                    t.messages[-1] = Message(m.role, t.messages[-1].parts + m.parts)
                    continue
                last_id = mid
                t.messages.append(m)
                t.times.append(_iso_time(rec.get("timestamp")))
                t.labels.append(str(rec.get("uuid", "")))
        if t.messages:
            yield t


def _iso_time(s: Any) -> float:
    try:
        return datetime.fromisoformat(str(s).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


def _natural(p: Path) -> list[Any]:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", str(p))]


SOURCES: dict[str, Callable[..., Iterator[Thread]]] = {
    "claude-code": claude_code,
    "locomo": locomo,
    "beam": beam,
    "longmemeval": longmemeval,
}


# ------------------------------------------------------------------------------ running one


@dataclass(slots=True)
class Imported:
    threads: int = 0
    messages: int = 0  # written (re-sent history skipped)
    seen: int = 0  # read from the source
    seconds: float = 0.0


def run(store: Store, source: str, path: str | Path, *, progress: bool = True,
        **options: Any) -> Imported:
    """Import every thread of a source, with a progress bar on stderr."""
    if source not in SOURCES:
        raise ConfigError(f"unknown import source {source!r} (one of {', '.join(SOURCES)})")
    if not Path(path).expanduser().exists():
        raise ConfigError(f"nothing to import at {path}")
    threads = list(SOURCES[source](path, **options))
    total = sum(len(t.messages) for t in threads)
    bar = tqdm(total=total, desc=f"import {source}", unit="message", disable=not progress)
    out = Imported()
    t0 = time.perf_counter()
    for t in threads:
        out.messages += len(write(store, t))
        out.seen += len(t.messages)
        out.threads += 1
        bar.update(len(t.messages))
    out.seconds = time.perf_counter() - t0
    bar.close()
    return out
