"""Each rebuilt call as the HTTP request Claude Code would have sent.

The system prompt, tools and request fields come from a real Claude Code request: a file of a
capture's shape given with `--request-template`, else the repository's capture
(`../shared/fixtures/harness/claude-code/02-basic-messages-stream.json`) in a checkout beside
`../shared`, else the one this person's own Claude Code last sent through the proxy (kept in
the proxy's memory: memory.storage.templates). Its cache marks are kept as Claude Code places
them: on the system blocks and on the last block of the last message. The harness's own context
that travels with every request (the reminder blocks before the first prompt, the
mid-conversation `system` message listing agent types) is taken from it too and put where
Claude Code puts it. Where there is none of them, stand-ins of a real request's size take their
place (STAND_IN): the ~17k tokens of system prompt and tools every call carries are most of a
call's cost, so a short prompt instead would misstate it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from perpetuity_core.cli.replay.sessions import Call, Session
from perpetuity_core.errors import ConfigError
from perpetuity_core.wire.conversation import Kind, text_part

DEFAULT_TEMPLATE = (Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "harness"
                    / "claude-code" / "02-basic-messages-stream.json")
MARK = {"type": "ephemeral"}
# The sizes, in characters, of Claude Code 2.1's request (../shared's capture): its three system
# blocks (the last two marked), its preamble's reminder, and its 24 tools as JSON.
STAND_IN_SYSTEM = (74, 62, 5_965)
STAND_IN_PREAMBLE = 306
STAND_IN_TOOLS = (2_571, 2_757, 4_123, 445, 289, 1_006, 3_797, 2_546, 1_679, 1_687, 1_923, 3_797,
                  1_206, 2_135, 2_855, 1_036, 1_201, 1_599, 558, 3_598, 776, 879, 21_341, 663)
STAND_IN_SOURCE = ("stand-ins of Claude Code's size (no captured request, and none kept by the"
                   " proxy: give --request-template, or run Claude Code through the proxy once)")
# Request headers Claude Code sends that say nothing about this call (the rest are rebuilt).
_OWN_HEADERS = {"host", "content-length", "connection", "accept-encoding", "x-api-key",
                "x-claude-code-session-id", "user-agent"}


@dataclass(slots=True)
class Template:
    system: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    preamble: list[dict[str, Any]] = field(default_factory=list)  # before the first prompt
    extra: list[dict[str, Any]] = field(default_factory=list)  # system-role messages
    fields: dict[str, Any] = field(default_factory=dict)  # max_tokens, thinking, stream...
    headers: list[tuple[str, str]] = field(default_factory=list)
    source: str = STAND_IN_SOURCE

    def harness_text(self) -> list[str]:
        """What every request carries whatever the person did: the system prompt, tools and
        the harness's own context."""
        return ([b.get("text", "") for b in self.system]
                + [json.dumps(t, ensure_ascii=False) for t in self.tools]
                + [b.get("text", "") for b in self.preamble]
                + [str(m.get("content", "")) for m in self.extra])


def load_template(path: Path | None, default: Path = DEFAULT_TEMPLATE,
                  kept: tuple[dict[str, Any], str] | None = None) -> Template:
    """The capture at `path`, else the default capture when ../shared is there, else the
    request shape the proxy `kept` (with where it was kept), else stand-ins of its size."""
    if path is None and not default.exists():
        return from_capture(*kept) if kept else stand_in()
    path = path or default
    try:
        capture = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read a Claude Code request from {path}: {e}") from e
    return from_capture(capture, str(path))


def from_capture(capture: Any, source: str) -> Template:
    """The template of a captured request (`{"headers": [...], "body": {...}}`, or the body)."""
    try:
        body = capture.get("body", capture)
        system, messages = body["system"], body["messages"]
    except (AttributeError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read a Claude Code request from {source}: {e!r}") from e
    first: dict[str, Any] = next((m for m in messages if m.get("role") == "user"),
                                 {"content": []})
    content = first["content"] if isinstance(first["content"], list) else []
    preamble = []
    for b in content:  # the harness's blocks before the person's words
        if b.get("type") != "text" or text_part(str(b.get("text", ""))).kind != Kind.CONTEXT:
            break
        preamble.append({k: v for k, v in b.items() if k != "cache_control"})
    return Template(
        system=system if isinstance(system, list) else [{"type": "text", "text": system}],
        tools=list(body.get("tools") or []), preamble=preamble,
        extra=[m for m in messages if m.get("role") == "system"],
        fields={k: v for k, v in body.items()
                if k not in ("model", "messages", "system", "tools", "metadata")},
        headers=[(k, v) for k, v in capture.get("headers", []) if k.lower() not in _OWN_HEADERS],
        source=source)


def stand_in() -> Template:
    """A system prompt, a preamble and tools of a real Claude Code request's sizes, their text
    a filler that names nothing (the measures of what a reply used leave no name out by it)."""
    def filler(n: int) -> str:
        return ("Stand-in text of a Claude Code request. " * (n // 40 + 1))[:n]

    system = [{"type": "text", "text": filler(n), **({"cache_control": MARK} if i else {})}
              for i, n in enumerate(STAND_IN_SYSTEM)]
    tools = []
    for i, n in enumerate(STAND_IN_TOOLS):
        tool: dict[str, Any] = {"name": f"Tool{i}", "description": "",
                                "input_schema": {"type": "object", "properties": {}}}
        tool["description"] = filler(max(0, n - len(json.dumps(tool))))
        tools.append(tool)
    reminder = "<system-reminder>\n"
    return Template(system, tools, preamble=[{"type": "text", "text": reminder + filler(
        STAND_IN_PREAMBLE - len(reminder))}], fields={"max_tokens": 32000, "stream": True})


@dataclass(slots=True)
class Built:
    body: dict[str, Any]
    live_from: int  # where the live task starts in body["messages"]
    headers: tuple[tuple[str, str], ...]


def build(call: Call, template: Template, session: Session) -> Built:
    messages = list(call.messages)  # shared with later calls: the two changed ones are copied
    live = call.live_from
    if messages and messages[0].get("role") == "user" and template.preamble:
        messages[0] = {**messages[0], "content": template.preamble + _blocks(messages[0])}
    if messages and template.extra:
        messages[1:1] = template.extra
        live += len(template.extra) if live >= 1 else 0
    # The mark goes on the last turn's last block (the system message is not a turn).
    turns = [i for i, m in enumerate(messages) if m.get("role") != "system"]
    if turns and (blocks := _blocks(messages[turns[-1]])):
        messages[turns[-1]] = {**messages[turns[-1]],
                               "content": blocks[:-1] + [{**blocks[-1], "cache_control": MARK}]}
    device = hashlib.sha256(b"perpetuity-replay").hexdigest()
    body = {"model": call.model, "messages": messages, "system": template.system,
            "tools": template.tools,
            "metadata": {"user_id": json.dumps({"device_id": device, "account_uuid": "",
                                                "session_id": session.id})},
            **template.fields}
    agent = f"claude-cli/{session.version or '2.1.0'} (external, cli)"
    headers = tuple(template.headers) + (
        ("user-agent", agent), ("x-claude-code-session-id", session.id),
        ("x-api-key", "sk-ant-replay"), ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
        ("x-perpetuity-time", datetime.fromtimestamp(call.at, UTC).isoformat()))
    return Built(body, live, tuple({k.lower(): (k, v) for k, v in headers}.values()))


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]
