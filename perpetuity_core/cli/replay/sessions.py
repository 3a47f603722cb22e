"""Claude Code's session files (`~/.claude/projects/**/<session>.jsonl`) back into API calls.

Claude Code records one line per content block. Rebuilding what it sent:

- an assistant message is every line sharing one `message.id`; parallel tool calls are several
  such lines with their results interleaved between them: one reply, then one user message of
  results;
- consecutive user lines form one message, tool results first (the API wants them first);
- an interrupted tool call leaves its `tool_result` and the text "[Request interrupted by user
  for tool use]" in the same user message as the next prompt, which this merging gives;
- `isMeta` lines (skill text, reminders) are content, not a person's prompt;
- `isCompactSummary` starts the history afresh with the summary;
- `isSidechain` lines are a subagent's and never in this conversation's requests;
- assistant lines of model `<synthetic>` (API errors, rate limits) were never sent;
- thinking blocks keep their signatures and images stay content, as recorded;
- a prompt whose `parentUuid` is an earlier block of the reply it follows (the person stopped
  the reply before its tool call ran) continues from that block: the later blocks were in the
  reply but never in a request (the API would have refused the unanswered call);
- a tool call whose result the file never recorded (an `ExitPlanMode` left unanswered) is
  answered before the request goes, as Claude Code's own client pairs them (its
  `[Tool result missing due to internal error]`, an error result, first in the next user
  message), and a result that answers no call of the reply before it is dropped.

A call whose rebuilt request would still be refused is Claude Code's record being incomplete:
the replay skips it, counts it and says why (`skipped_reasons`).

A line that is not a JSON object, or a user/assistant line without a message, is skipped and
counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from perpetuity_core.wire import conversation
from perpetuity_core.wire.protocols import anthropic

SYNTHETIC = "<synthetic>"
# What Claude Code's client sends for a tool call it holds no result for (2.1.x, its cli).
MISSING_RESULT = "[Tool result missing due to internal error]"


@dataclass(slots=True)
class Call:
    """One API call: the messages Claude Code sent (no cache marks) and the recorded reply."""

    messages: list[dict[str, Any]]
    reply: list[dict[str, Any]]  # the reply's content blocks
    model: str
    at: float  # when it was sent: the last record before the reply
    replied_at: float
    live_from: int  # the message holding the person's latest prompt: the live task starts there
    starts_task: bool = False  # the last message is a person's prompt (not tool results)


@dataclass(slots=True)
class Session:
    id: str
    path: Path
    version: str = ""
    cwd: str = ""
    calls: list[Call] = field(default_factory=list)
    prompts: int = 0
    skipped_lines: int = 0  # not JSON objects, or turns without a message


def find_sessions(paths: Iterable[Path]) -> list[Path]:
    """Session files under the given files and folders (folders searched recursively, as
    `~/.claude/projects` holds one folder per project)."""
    out: list[Path] = []
    for p in paths:
        out += sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    return list(dict.fromkeys(out))


def read_session(path: Path) -> Session:
    session = Session(path.stem, path)
    builder = _Builder(session)
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            session.skipped_lines += 1
            continue
        if not isinstance(record, dict):
            session.skipped_lines += 1
            continue
        builder.add(record)
    builder.flush()
    return session


def is_prompt(record: dict[str, Any], blocks: list[dict[str, Any]]) -> bool:
    """Text a person typed (`conversation.is_prompt`, as the proxy reads it), on a line that is
    not meta or reminder text."""
    if record.get("isMeta") or record.get("isCompactSummary"):
        return False
    message = anthropic.parse_request({"messages": [{"role": "user", "content": blocks}]})
    return conversation.is_prompt(message.messages[0])


def _time(record: dict[str, Any]) -> float | None:
    raw = record.get("timestamp")
    if not isinstance(raw, str):
        return None
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        return None


class _Builder:
    """Walks a session's lines in file order, emitting a Call at each new assistant message."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.messages: list[dict[str, Any]] = []
        self.prompt_flags: list[bool] = []
        self.results: list[Any] = []  # the pending user message: tool results first
        self.others: list[Any] = []
        self.pending_prompt = False
        self.current: dict[str, Any] | None = None  # the assistant message being read
        self.current_id = ""
        self.last_time = 0.0
        # uuid of a line of the reply being read -> how many of its blocks end at that line
        self.block_count: dict[str, int] = {}

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind not in ("user", "assistant") or record.get("isSidechain"):
            return
        message = record.get("message")
        if not isinstance(message, dict):
            self.session.skipped_lines += 1
            return
        self.session.version = str(record.get("version") or self.session.version)
        self.session.cwd = str(record.get("cwd") or self.session.cwd)
        if isinstance(record.get("sessionId"), str) and not self.session.calls:
            self.session.id = record["sessionId"]
        at = _time(record)
        if kind == "user":
            self._user(record, message)
        elif message.get("model") != SYNTHETIC:
            self._assistant(record, message, at if at is not None else self.last_time)
        if at is not None:
            self.last_time = at

    def _user(self, record: dict[str, Any], message: dict[str, Any]) -> None:
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else \
            [b for b in content or [] if isinstance(b, dict)]
        if record.get("isCompactSummary"):
            self.current = None
            self.messages, self.prompt_flags = [], []
            self.results, self.others, self.pending_prompt = [], [], False
        parent = self.block_count.get(str(record.get("parentUuid")))
        results = [b for b in blocks if b.get("type") == "tool_result"]
        if self.current is not None and parent is not None and not results \
                and parent < len(self.current["content"]):
            # a copy: the recorded reply keeps every block
            self.current = {**self.current, "content": self.current["content"][:parent]}
        if is_prompt(record, blocks):
            self.pending_prompt = True
            self.session.prompts += 1
        self.results += results
        self.others += [b for b in blocks if b.get("type") != "tool_result"]

    def _assistant(self, record: dict[str, Any], message: dict[str, Any], at: float) -> None:
        content = [b for b in message.get("content") or [] if isinstance(b, dict)]
        mid = str(message.get("id") or "")
        if self.current is not None and mid and mid == self.current_id:
            self.session.calls[-1].reply += content  # another block of the same reply
            self.session.calls[-1].replied_at = at
            self.block_count[str(record.get("uuid"))] = len(self.session.calls[-1].reply)
            return
        self.flush()
        prompts = [i for i, flag in enumerate(self.prompt_flags) if flag]
        self.current = {"role": "assistant", "content": content}
        self.current_id = mid
        self.block_count = {str(record.get("uuid")): len(content)}
        self.session.calls.append(Call(list(self.messages), self.current["content"],
                                       str(message.get("model") or ""), self.last_time or at, at,
                                       prompts[-1] if prompts else 0,
                                       bool(prompts) and prompts[-1] == len(self.messages) - 1))

    def flush(self) -> None:
        """Close the assistant message being read, then the user message after it, each of the
        reply's tool calls answered in it (see the module's docstring)."""
        if self.current is not None:
            self.messages.append(self.current)
            self.prompt_flags.append(False)
            calls = [b.get("id") for b in self.current["content"] if b.get("type") == "tool_use"]
            answered = {b.get("tool_use_id") for b in self.results}
            self.results = [*({"type": "tool_result", "tool_use_id": c, "content": MISSING_RESULT,
                               "is_error": True} for c in calls if c not in answered),
                            *(b for b in self.results if b.get("tool_use_id") in calls)]
            self.current = None
        if self.results or self.others:
            self.messages.append({"role": "user", "content": self.results + self.others})
            self.prompt_flags.append(self.pending_prompt)
            self.results, self.others, self.pending_prompt = [], [], False


def sessions_in_order(paths: Iterable[Path]) -> Iterator[Session]:
    """Every session under the paths, earliest first call first."""
    sessions = [read_session(p) for p in find_sessions(paths)]
    yield from sorted(sessions, key=lambda s: (s.calls[0].at if s.calls else float("inf"), s.id))


CHAIN_GAP = 60.0  # seconds from one chained session's last reply to the next one's first call
_CLOSING = {"type": "text", "text": "[the task ended here]"}


def chained(sessions: list[Session], gap: float = CHAIN_GAP) -> Session:
    """The sessions as one conversation that never ends, as a person who never starts a new
    session would have sent them through the proxy: each session's calls after the whole
    history of those before it, its times moved to follow them `gap` seconds after the last
    reply. Nor does it ever compact (through the proxy Claude Code does not): a call whose
    history is shorter than the one before it (a compaction summary) keeps what came before.
    The history carried on ends with a reply's text only: a tool call there was never answered
    (a prompt follows), and a reply of none but calls is a stand-in line."""
    live = [s for s in sessions if s.calls]
    if not live:
        return Session("chain", Path("chain"))
    out = Session(live[0].id, live[0].path, live[0].version, live[0].cwd,
                  skipped_lines=sum(s.skipped_lines for s in sessions))
    prefix: list[dict[str, Any]] = []
    end: float | None = None
    for s in live:
        shift = 0.0 if end is None else end + gap - s.calls[0].at
        previous: Call | None = None
        for c in s.calls:
            if previous is not None and len(c.messages) < len(previous.messages):
                prefix = _closed(prefix, previous)
            out.calls.append(Call(prefix + c.messages, c.reply, c.model, c.at + shift,
                                  c.replied_at + shift, c.live_from + len(prefix),
                                  c.starts_task))
            previous = c
        out.prompts += s.prompts
        prefix = _closed(prefix, s.calls[-1])
        end = s.calls[-1].replied_at + shift
    return out


def _closed(prefix: list[dict[str, Any]], call: Call) -> list[dict[str, Any]]:
    """The history carried on after `call`: its messages and its reply's text."""
    said = [b for b in call.reply if b.get("type") == "text"] or [_CLOSING]
    return prefix + call.messages + [{"role": "assistant", "content": said}]
