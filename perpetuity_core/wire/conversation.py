"""The neutral conversation model every protocol adapter translates to and from.

Nothing outside `perpetuity_core.wire.protocols` sees provider JSON: it sees these types.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, cast


class Protocol(StrEnum):
    ANTHROPIC = "anthropic-messages"
    CHAT = "openai-chat"
    RESPONSES = "openai-responses"
    GEMINI = "gemini-generate-content"


class Provider(StrEnum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"
    GOOGLE = "google"


class Kind(StrEnum):
    TEXT = "text"
    # Harness text inside the conversation (Claude Code's <system-reminder> blocks, its
    # mid-conversation system messages): stored with the turn, as sent, but not memory: no
    # retrieval row, never quoted.
    CONTEXT = "context"
    THINKING = "thinking"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    MEDIA = "media"


@dataclass(frozen=True, slots=True)
class Part:
    kind: Kind
    text: str = ""  # the text; a tool call's arguments as JSON; a tool result's content
    name: str = ""  # tool name for calls
    call_id: str = ""  # pairs a tool call with its result


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    parts: tuple[Part, ...]
    # The fingerprint, once taken: a message read once (wire.seen) is the same object on every
    # later call of its conversation, so it is digested once, however long the history.
    _digest: str = field(default="", init=False, compare=False, repr=False)
    # What an adapter made of it for the wire, once (Anthropic's frame message: one text block),
    # with the function that made it. It lives and dies with the message: a frame is the same
    # objects every tool round while its plan keeps it, and no cache's bound can drop them
    # between rounds (a 512-entry FIFO did, bench_latency's rotation re-rendering 4 of 5).
    _wire: tuple[Callable[[Message], Any], Any] | None = field(
        default=None, init=False, compare=False, repr=False)

    def fingerprint(self) -> str:
        """A digest that survives the ways harnesses re-send a message.

        Harnesses re-send earlier turns with cache markers added, string content turned into
        blocks, thinking stripped and whitespace changed, so only what identifies the turn counts:
        its role, its words with whitespace collapsed, and its tool call ids.
        """
        if not self._digest:
            object.__setattr__(self, "_digest", _fingerprint(self))
        return self._digest

    def wire_form[T](self, make: Callable[[Message], T]) -> T:
        """`make(self)`, made once for this message: the same object on every later call. Two
        threads making it at once each get an equal one; the one kept is the last made."""
        kept = self._wire
        if kept is not None and kept[0] is make:
            return cast(T, kept[1])
        made = make(self)
        object.__setattr__(self, "_wire", (make, made))
        return made

    @property
    def text(self) -> str:
        return "\n".join(p.text for p in self.parts if p.kind == Kind.TEXT)


@functools.lru_cache(maxsize=4096)
def _fingerprint(message: Message) -> str:
    # Every request re-sends the whole history: equal messages hash alike, so each is digested
    # once, not once per request. The cache holds the messages themselves, hence its bound.
    h = hashlib.blake2b(digest_size=16)
    h.update(message.role.encode())
    for p in message.parts:
        if p.kind in (Kind.TEXT, Kind.CONTEXT):
            h.update(b"\x00t" + " ".join(p.text.split()).encode())
        elif p.kind in (Kind.TOOL_CALL, Kind.TOOL_RESULT):
            h.update(b"\x00c" + p.kind.encode() + p.call_id.encode())
    return h.hexdigest()


# Text harnesses put inside a conversation that the person did not write: Claude Code's
# reminders, IDE notes, slash-command echoes, background-task notices, skill text (its isMeta
# lines) and interrupt markers; Codex's environment and instructions. Found in the harness
# captures (../shared/fixtures/harness) and six real Claude Code sessions.
_SCAFFOLD = re.compile(
    r"\s*<(system-reminder|environment_context|user_instructions|permissions instructions|"
    r"skills_instructions|local-command-caveat|local-command-stdout|command-name|command-message|"
    r"command-args|ide_opened_file|ide_selection|task-notification|session_context)\b"
    r"|\s*Base directory for this skill: "
    # Claude Code's compaction summary, re-sent as the first user turn of the compacted session.
    r"|\s*This session is being continued from a previous conversation that ran out of context"
    # Claude Code's mark of an interrupted reply or tool call, a block of its own.
    r"|\s*\[Request interrupted by user( for tool use)?\]\s*$"
)
# Claude Code appends reminders to tool results (the Read tool's, to every file it reads: 104
# of the six real sessions' tool results): the result is memory, the reminder is not.
_EMBEDDED = re.compile(r"\s*<system-reminder>.*?</system-reminder>\s*", re.DOTALL)


def prompt_text(message: Message) -> str:
    """What a person typed in this message, "" when nothing: the text of a user message, without
    its tool results, images, harness scaffolding (reminders, skill and command text, IDE
    notices, the compaction summary) or interrupt markers.

    A Claude Code interrupt sends one user message holding the interrupted call's tool_result,
    the marker and the new prompt: that message is a prompt, and these are its new words.
    """
    if message.role != "user":
        return ""
    return "\n".join(p.text for p in message.parts if p.kind == Kind.TEXT).strip()


def is_prompt(message: Message) -> bool:
    """The message is a person's prompt (a task starts at it), not a round of tool results or
    harness text."""
    return bool(prompt_text(message))


def text_part(text: str) -> Part:
    """A text part, marked as context when it is harness scaffolding rather than speech."""
    return Part(Kind.CONTEXT if _SCAFFOLD.match(text) else Kind.TEXT, text)


def as_context(parts: tuple[Part, ...]) -> tuple[Part, ...]:
    """The parts of a message the harness wrote (a mid-conversation system message, a line
    Claude Code records as meta): its text is context, not speech."""
    return tuple(Part(Kind.CONTEXT, p.text) if p.kind == Kind.TEXT else p for p in parts)


def without_scaffold(text: str) -> str:
    """A row's text as memory shows and indexes it: reminders the harness appended removed."""
    return _EMBEDDED.sub("\n", text).strip() if "<system-reminder>" in text else text


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


@dataclass(slots=True)
class ParsedRequest:
    """What a provider request says, in neutral terms."""

    protocol: Protocol
    model: str
    stream: bool
    messages: list[Message]
    system: str = ""
    tool_names: list[str] = field(default_factory=list)
    # Identity hints the body carries (metadata.user_id, user, prompt_cache_key, ...), by name.
    hints: dict[str, str] = field(default_factory=dict)
    # Request features that mark harness side requests (title generation, prewarm, ...).
    structured_output: bool = False
    generate: bool = True
    compaction: bool = False  # the harness asks for its history to be summarised
    # For each message, the index in the body's own list where it starts (adapters map back).
    raw_index: list[int] = field(default_factory=list)
    # The indexes in the body's own list of what is no turn and stays in front when the
    # history is replaced (system and developer messages; Responses' items the neutral model
    # cannot read), found as the body is read: a late call need not walk its history for them.
    raw_standing: list[int] = field(default_factory=list)
    # Characters of what the request carries besides its messages (system prompt, tool
    # definitions): what a bound on the whole request counts beside them.
    fixed_chars: int = 0



def read_before(known: ParsedRequest | None,
                raw: int) -> tuple[list[int], list[Message], list[int]]:
    """New lists of what `known` read of its body's own list before index `raw`: the messages'
    starts, the messages and the standing indexes (wire.seen: a later body sharing that prefix
    takes them as read and reads only the rest); empty ones without `known`."""
    if known is None:
        return [], [], []
    upto = bisect.bisect_left(known.raw_index, raw)
    return (known.raw_index[:upto], known.messages[:upto],
            known.raw_standing[:bisect.bisect_left(known.raw_standing, raw)])


@dataclass(slots=True)
class Reply:
    """The assistant turn a provider sent back, assembled from its stream or body."""

    message: Message
    usage: Usage
    stop_reason: str = ""
    complete: bool = True
