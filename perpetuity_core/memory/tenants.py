"""What belongs to a tenant (the credential a request carries; see identity): its notes
library, the users it pools memory with, and what it may be shown of other conversations; and
the stored users as an operator names and lists them (`perpetuity memory purge/search --user`,
`perpetuity memory users`).

A deployment's tenancy (`tenancy`): a proxy reachable only from this machine serves one person
(`personal`: one memory, whatever the credential); one reachable beyond it keeps a tenant per
credential (`credential`). There an operator may join the tenants of one person (`join`):
recorded in the database as settings `person:<tenant>` = the person's first tenant, so
`perpetuity memory migrate` carries them and a running proxy honours them on its next search."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.dialect import SQL, Sql
from perpetuity_core.memory.rows import Row
from perpetuity_core.memory.store import Store
from perpetuity_core.wire.conversation import Kind, Message
from perpetuity_core.wire.identity import PERSONAL

TENANTS_DIR = "tenants"  # under the notes root: one library per tenant
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
# Tools whose results are someone else's text (a fetched page, search results): a lesson drawn
# from them is a lead to verify, never a fact.
_UNTRUSTED_TOOL = re.compile(r"(?i)web|fetch|brows|url|http|scrape|crawl")
CREDENTIAL = "credential"  # the shared proxy's tenancy; PERSONAL (identity's) the other
PERSON = "person:"  # the setting key's prefix recording a joined tenant's person


def tenancy(setting: str, hosts: Iterable[str]) -> str:
    """`personal` or `credential`: the setting when given, else `personal` only when every
    address the proxy listens on is loopback (whoever can reach the port reads the memory;
    an empty host is every interface). A ValueError names a setting that is neither."""
    if setting in (PERSONAL, CREDENTIAL):
        return setting
    if setting:
        raise ValueError(f"perpetuity_tenants is {PERSONAL!r} or {CREDENTIAL!r}, not {setting!r}")
    hosts = list(hosts)
    return PERSONAL if hosts and all(_loopback(h) for h in hosts) else CREDENTIAL


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve beyond this machine


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


def find_user(conn: Sql, spec: str) -> tuple[int, str]:
    """The one stored user `spec` names, as (id, key): by its full key, by its id, or by the
    name the harness sent (x-perpetuity-user: the part of a key after its tenant) when exactly
    one user has that name. Otherwise a ConfigError in one line: no such user, or the full keys
    the name could mean (an operator types one of them; nothing is changed)."""
    row = conn.execute("SELECT id, key FROM user WHERE key = ?", (spec,)).fetchone()
    if row is None and spec.isdigit():
        row = conn.execute("SELECT id, key FROM user WHERE id = ?", (int(spec),)).fetchone()
    if row is not None:
        return int(row[0]), str(row[1])
    named = conn.execute("SELECT id, key FROM user WHERE instr(key, '/') > 0"
                         " AND substr(key, instr(key, '/') + 1) = ? ORDER BY key",
                         (spec,)).fetchall()
    if len(named) == 1:
        return int(named[0][0]), str(named[0][1])
    if named:
        raise ConfigError(f"{spec!r} is the name of {len(named)} users, one per tenant:"
                          f" {', '.join(k for _, k in named)}; give the full key of one")
    raise ConfigError(f"no user {spec!r} in this memory (`perpetuity memory users` lists them)")


@dataclass(frozen=True, slots=True)
class UserSummary:
    """A stored user as `perpetuity memory users` shows it."""

    id: int
    key: str
    tenant: str
    conversations: int
    messages: int
    tokens: int  # of the user's retrieval rows (the words the memory can recall)
    last_seen: float | None  # the time of the user's latest message; None before any


@dataclass(frozen=True, slots=True)
class TenantSummary:
    """A tenant as `perpetuity memory tenants` shows it: its person, when joined, and users."""

    tenant: str
    person: str  # "" unless an operator joined it to others
    users: list[UserSummary]


def tenant_list(conn: Sql) -> list[TenantSummary]:
    """Every tenant with its users, the most recently seen first."""
    joined, out = persons(conn), dict[str, list[UserSummary]]()
    for u in users(conn):
        out.setdefault(u.tenant, []).append(u)
    return [TenantSummary(t, joined.get(t, ""), listed) for t, listed in out.items()]


def users(conn: Sql) -> list[UserSummary]:
    """Every stored user with their counts, the most recently seen first."""
    conversations = dict(conn.execute(
        "SELECT user_id, count(*) FROM conversation GROUP BY user_id").fetchall())
    messages = {u: (n, at) for u, n, at in conn.execute(
        "SELECT user_id, count(*), max(at) FROM message GROUP BY user_id").fetchall()}
    tokens = dict(conn.execute(
        "SELECT user_id, sum(tokens) FROM (SELECT user_id, tokens FROM retrieval UNION ALL"
        " SELECT user_id, tokens FROM retrieval_pending) r GROUP BY user_id").fetchall())
    out = [UserSummary(uid, key, tenant_of(key), int(conversations.get(uid, 0)),
                       int(messages.get(uid, (0, None))[0]), int(tokens.get(uid) or 0),
                       messages.get(uid, (0, None))[1])
           for uid, key in conn.execute("SELECT id, key FROM user").fetchall()]
    return sorted(out, key=lambda u: (-(u.last_seen or 0.0), u.key))


def pool_of(store: Store, user_id: int, pooled: frozenset[str]) -> frozenset[int]:
    """The users whose rows `user_id` may see besides its own: those of the operator-named
    tenant set, when the asker's tenant is in it, and those of every tenant joined to the
    asker's person; no one otherwise. Two small reads a search; the users only when pooled."""
    db = store.db
    conn = db.connection()
    row = conn.execute(db.pick(_KEY_OF), (user_id,)).fetchone()
    if row is None:
        return frozenset()
    mine = tenant_of(row[0])
    joined = dict(conn.execute(db.pick(_PERSONS)).fetchall())
    reach = set(pooled) if mine in pooled else set()
    if mine in joined:
        reach |= {t for t, p in joined.items() if p == joined[mine]}
    if not reach:
        return frozenset()
    return frozenset(uid for uid, key in conn.execute(db.pick(_USERS))
                     if tenant_of(key) in reach)


_KEY_OF = SQL("SELECT key FROM user WHERE id = ?", 'SELECT key FROM "user" WHERE id = %s')
_USERS = SQL("SELECT id, key FROM user", 'SELECT id, key FROM "user"')
_PERSONS = SQL.both(f"SELECT substr(key, {len(PERSON) + 1}), value FROM setting"
                    f" WHERE key LIKE '{PERSON}%'")


def persons(conn: Sql) -> dict[str, str]:
    """Every joined tenant and the person (their first joined tenant) it belongs to."""
    return dict(conn.execute(_PERSONS.sqlite).fetchall())


def join(conn: Sql, named: list[str]) -> str:
    """Join the named tenants (and every tenant already joined to any of them) into one
    person; returns the person's name. Run inside a write on a translated connection. A
    ConfigError names a tenant this memory has never seen: a typo would join no one."""
    known = {tenant_of(u.key) for u in users(conn)}
    if unknown := [t for t in named if t not in known]:
        raise ConfigError(f"no tenant {unknown[0]!r} in this memory"
                          " (`perpetuity memory tenants` lists them)")
    joined = persons(conn)
    person = next((joined[t] for t in named if t in joined), named[0])
    members = set(named) | {t for t, p in joined.items() if p in {joined.get(n) for n in named}}
    conn.executemany("INSERT OR REPLACE INTO setting (key, value) VALUES (?, ?)",
                     [(PERSON + t, person) for t in sorted(members)])
    return person


def part(conn: Sql, tenant: str) -> bool:
    """Take a tenant out of its person (its memory is its own again); False if not joined."""
    return conn.execute("DELETE FROM setting WHERE key = ?", (PERSON + tenant,)).rowcount > 0


def quotes_untrusted(messages: list[Message]) -> bool:
    """Did the conversation quote a result of a tool that reads the web?"""
    names = {p.call_id: p.name for m in messages for p in m.parts if p.kind == Kind.TOOL_CALL}
    return any(p.kind == Kind.TOOL_RESULT and _UNTRUSTED_TOOL.search(names.get(p.call_id, ""))
               for m in messages for p in m.parts)


def withheld(row: Row) -> str:
    """A row flagged at capture (the notes' credential scan, schema.m011) as another
    conversation sees it; the row stays stored verbatim: it is the user's data."""
    return f"[secret withheld: {row.secret}]"
