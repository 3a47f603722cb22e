"""What a tenant may be shown (the credential a request carries; see identity): its notes
library, whether a lesson drawn from a conversation is only a lead, and how a row holding a
credential reads in another conversation's frame."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Kind, Message

TENANTS_DIR = "tenants"  # under the notes root: one library per tenant
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
# Tools whose results are someone else's text (a fetched page, search results): a lesson drawn
# from them is a lead to verify, never a fact.
_UNTRUSTED_TOOL = re.compile(r"(?i)web|fetch|brows|url|http|scrape|crawl")


def library(root: Path | None, tenant: str) -> Path | None:
    """The tenant's own notes library under the notes root."""
    if root is None:
        return None
    name = tenant if _SAFE_NAME.fullmatch(tenant) else \
        "t-" + hashlib.sha256(tenant.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return root / TENANTS_DIR / name


def quotes_untrusted(messages: Sequence[Message]) -> bool:
    """Did the conversation quote a result of a tool that reads the web?"""
    # Each tool's name matched once, and the results looked at only when a call read the web:
    # this walks all of the history, so it runs only when a note is captured.
    names = {p.call_id: p.name for m in messages for p in m.parts if p.kind == Kind.TOOL_CALL}
    web = {call_id for call_id, name in names.items() if _reads_web(name)}
    return bool(web) and any(p.kind == Kind.TOOL_RESULT and p.call_id in web
                             for m in messages for p in m.parts)


@functools.lru_cache(maxsize=1024)
def _reads_web(tool: str) -> bool:
    return bool(_UNTRUSTED_TOOL.search(tool))


def withheld(row: Row) -> str:
    """A row flagged at capture (the notes' credential scan, schema.m011) as another
    conversation sees it; the row stays stored verbatim: it is the user's data."""
    return f"[secret withheld: {row.secret}]"
