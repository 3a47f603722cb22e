"""The latest request shape a harness sent through the proxy, kept for `perpetuity replay`.

A replay bills a person's recorded sessions as their harness sent them, and their session files
hold the messages but not the system prompt and tools that went with every call (Claude Code's:
some 17k tokens, most of a call's cost). So the proxy keeps the shape of the latest request each
harness sent (its system prompt, tools, the harness's own context before the first prompt and
its system-role messages, its request fields and the headers that say which features it asked
for), one setting per harness (`template:<harness>`), written again only when it changed. The
shape is the one a capture file has (`{"headers": [...], "body": {...}}`), so the replay reads
either alike.

Never a credential: only the headers named in KEPT_HEADERS are kept, and no metadata (Claude
Code's holds its device and account ids). The person's messages are not in it beyond the
harness's own context blocks (they are stored as memory anyway).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from perpetuity_core.memory.storage.dialect import Sql
from perpetuity_core.wire.conversation import Kind, text_part

PREFIX = "template:"
# Headers that say which API features the harness asked for; every other one is left out.
KEPT_HEADERS = frozenset({"accept", "anthropic-beta", "anthropic-version",
                          "anthropic-dangerous-direct-browser-access", "user-agent", "x-app"})
_LEFT_OUT_FIELDS = ("messages", "metadata")


def shape(body: dict[str, Any], headers: list[tuple[str, str]]) -> dict[str, Any] | None:
    """What is kept of an Anthropic request `body` sent with `headers`, or None when it has no
    system prompt to keep."""
    if not body.get("system"):
        return None
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    first = next((m for m in messages if m.get("role") == "user"), None)
    content = first.get("content") if first else None
    preamble = []
    for b in content if isinstance(content, list) else []:  # the harness's blocks, not the person's
        if (not isinstance(b, dict) or b.get("type") != "text"
                or text_part(str(b.get("text", ""))).kind != Kind.CONTEXT):
            break
        preamble.append(b)
    kept = [{"role": "user", "content": preamble}] if preamble else []
    kept += [m for m in messages if m.get("role") == "system"]
    return {"headers": [[k, v] for k, v in headers if k.lower() in KEPT_HEADERS
                        or k.lower().startswith("x-stainless-")],
            "body": {**{k: v for k, v in body.items() if k not in _LEFT_OUT_FIELDS},
                     "messages": kept}}


def digest(kept: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def keep(conn: Sql, harness: str, kept: dict[str, Any]) -> None:
    """Record `kept` as the harness's latest shape. Run inside a write."""
    conn.execute("INSERT OR REPLACE INTO setting (key, value) VALUES (?, ?)",
                 (PREFIX + harness, json.dumps(kept, ensure_ascii=False)))


def kept(conn: Sql, harness: str) -> dict[str, Any] | None:
    """The harness's latest kept shape, or None when none was kept."""
    row = conn.execute("SELECT value FROM setting WHERE key = ?", (PREFIX + harness,)).fetchone()
    return json.loads(row[0]) if row else None
