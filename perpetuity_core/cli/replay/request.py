"""Each rebuilt call as the HTTP request Claude Code would have sent.

The system prompt, tools and request fields come from a real Claude Code request (a capture such
as `../shared/fixtures/harness/claude-code/02-basic-messages-stream.json`, or any file of that
shape given with `--request-template`). Its cache marks are kept as Claude Code places them: on
the system blocks and on the last block of the last message. The harness's own context that
travels with every request (the reminder blocks before the first prompt, the mid-conversation
`system` message listing agent types) is taken from the capture too and put where Claude Code
puts it. Where no capture is at hand, a short built-in system prompt and no tools stand in: the
costs then leave out the ~15k tokens of tools every real request carries.
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
BUILT_IN_SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude. You are an "
                   "interactive agent that helps users with software engineering tasks.")
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
    source: str = "built-in (no Claude Code capture: a short system prompt and no tools)"

    def harness_text(self) -> list[str]:
        """What every request carries whatever the person did: the system prompt, tools and
        the harness's own context."""
        return ([b.get("text", "") for b in self.system]
                + [json.dumps(t, ensure_ascii=False) for t in self.tools]
                + [b.get("text", "") for b in self.preamble]
                + [str(m.get("content", "")) for m in self.extra])


def load_template(path: Path | None, default: Path = DEFAULT_TEMPLATE) -> Template:
    """The capture at `path`, else the default capture when ../shared is there, else the
    built-in stand-in."""
    if path is None and not default.exists():
        return Template([{"type": "text", "text": BUILT_IN_SYSTEM, "cache_control": MARK}],
                        fields={"max_tokens": 32000, "stream": True})
    path = path or default
    try:
        capture = json.loads(path.read_text(encoding="utf-8"))
        body = capture.get("body", capture)
        system, messages = body["system"], body["messages"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read a Claude Code request from {path}: {e}") from e
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
        source=str(path))


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
