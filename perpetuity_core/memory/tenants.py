"""What belongs to a tenant (the credential a request carries; see identity): its notes
library, the users it pools memory with, and what it may be shown of other conversations."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from perpetuity_core.memory.dialect import SQL
from perpetuity_core.memory.rows import Row
from perpetuity_core.memory.store import Store
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


def tenant_of(user_key: str) -> str:
    """A stored user's tenant: the part of its key before the claimed name."""
    return user_key.split("/", 1)[0]


def pool_of(store: Store, user_id: int, pooled: frozenset[str]) -> frozenset[int]:
    """The users whose rows `user_id` may see besides its own: those of the operator-named
    tenant set, when the asker's tenant is in it; no one otherwise."""
    db = store.db
    conn = db.connection()
    row = conn.execute(db.pick(_KEY_OF), (user_id,)).fetchone()
    if row is None or tenant_of(row[0]) not in pooled:
        return frozenset()
    return frozenset(uid for uid, key in conn.execute(db.pick(_USERS))
                     if tenant_of(key) in pooled)


_KEY_OF = SQL("SELECT key FROM user WHERE id = ?", 'SELECT key FROM "user" WHERE id = %s')
_USERS = SQL("SELECT id, key FROM user", 'SELECT id, key FROM "user"')


def quotes_untrusted(messages: list[Message]) -> bool:
    """Did the conversation quote a result of a tool that reads the web?"""
    names = {p.call_id: p.name for m in messages for p in m.parts if p.kind == Kind.TOOL_CALL}
    return any(p.kind == Kind.TOOL_RESULT and _UNTRUSTED_TOOL.search(names.get(p.call_id, ""))
               for m in messages for p in m.parts)


def withheld(row: Row) -> str:
    """A row flagged at capture (the notes' credential scan, schema.m011) as another
    conversation sees it; the row stays stored verbatim: it is the user's data."""
    return f"[secret withheld: {row.secret}]"
