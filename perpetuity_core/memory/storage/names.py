"""Conversation names a person recognises, never a session id.

A conversation is named by what the harness calls it: the title it asks the model for in a
side request (Claude Code, opencode), which arrives on the conversation's own session id; else
by its first prompt's opening words (a person's words: reminders and other harness text are
context, not speech). The project folder is added where the harness states it (Claude Code's
and opencode's environment block, Codex's environment_context).

Each part is stored once and kept (the first title, the first prompt, the first folder), so a
conversation's label changes at most once, when its title arrives after its first turn:
providers cache by exact prefix, and a label that changed from turn to turn would bust it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import PurePosixPath, PureWindowsPath

from perpetuity_core.wire.conversation import Kind, Message, ParsedRequest, Reply, prompt_text

OPENING_WORDS = 8
OPENING_CHARS = 60
TITLE_CHARS = 80

# Where harnesses state the working directory: Claude Code's system prompt ("Primary working
# directory: /path"), opencode's <env> block ("Working directory: /path"), Codex's
# environment_context ("<cwd>/path</cwd>").
_FOLDER = re.compile(r"^[ \t-]*(?:Primary )?[Ww]orking directory: *(\S[^\n]*?)[ \t]*$"
                     r"|<cwd>([^<\n]+)</cwd>", re.MULTILINE)


def opening(messages: Sequence[Message]) -> str:
    """The opening words of the first thing a person typed in `messages`, or ""."""
    return next((opening_words(said) for m in messages if (said := prompt_text(m))), "")


def opening_words(text: str) -> str:
    """A prompt's first words, cut at a word, with an ellipsis where it goes on (a pasted
    document's heading marks left out)."""
    words = text.lstrip("#> \t\n").split()
    cut = " ".join(words[:OPENING_WORDS])
    short = cut if len(cut) <= OPENING_CHARS else cut[:OPENING_CHARS].rsplit(" ", 1)[0]
    return short + ("…" if len(words) > OPENING_WORDS or short != cut else "")


def folder(req: ParsedRequest) -> str:
    """The working directory the request's harness states, or ""."""
    stated = stated_folder(req.system)
    return stated if stated is not None else messages_folder(req.messages)[0]


def stated_folder(text: str) -> str | None:
    """The working directory this text states (None: it states none)."""
    match = _FOLDER.search(text)
    return (match.group(1) or match.group(2)).strip() if match else None


def messages_folder(messages: Sequence[Message], start: int = 0) -> tuple[str, int]:
    """The working directory the harness's text among `messages[start:]` first states, and the
    index of the message stating it; ("", len(messages)) when none does."""
    for i in range(start, len(messages)):
        if messages[i].role in ("user", "system"):
            for p in messages[i].parts:
                if p.kind == Kind.CONTEXT and (stated := stated_folder(p.text)) is not None:
                    return stated, i
    return "", len(messages)


def title(reply: Reply, structured: bool) -> str:
    """The title in a title side request's reply: Claude Code asks for JSON with a "title"
    field (`structured`), opencode for the bare title. "" when the reply holds none (a refusal,
    an error, text where JSON was asked for)."""
    text = reply.message.text.strip()
    if not text or not reply.complete:
        return ""
    if structured:
        try:
            data = json.loads(text)
        except ValueError:
            return ""
        text = data.get("title", "") if isinstance(data, dict) else ""
        if not isinstance(text, str):
            return ""
    line = " ".join(text.split()).strip("\"'`*# ")
    # A title is one short line: anything longer is not one.
    return line if 0 < len(line) <= TITLE_CHARS and "\n" not in text.strip() else ""


def label(titled: str, first_words: str, path: str) -> str:
    """How a conversation is named to the model: its title (else its opening words) in quotes,
    with the project folder's name where known; "" when nobody has said anything in it."""
    said = titled or first_words
    if not said:
        return ""
    base = _base(path)
    return f'"{said}" in {base}' if base else f'"{said}"'


def _base(path: str) -> str:
    """A folder's own name: what a person calls the project. A Claude Code worktree
    (<repository>/.claude/worktrees/<generated name>) is its repository's."""
    if not path:
        return ""
    pure = PureWindowsPath(path) if re.match(r"[A-Za-z]:\\", path) else PurePosixPath(path)
    parts = pure.parts
    for i in range(1, len(parts) - 2):
        if parts[i:i + 2] == (".claude", "worktrees"):
            return parts[i - 1]
    return pure.name or str(pure)
