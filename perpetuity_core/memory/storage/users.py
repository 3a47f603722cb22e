"""The stored users as an operator names and lists them (`perpetuity memory purge/search
--user`, `perpetuity memory users`, `perpetuity memory tenants`), and whom a user's searches
reach besides their own rows (`pool_of`).

An operator may join the tenants of one person (`join`): recorded in the database as settings
`person:<tenant>` = the person's first tenant, so `perpetuity memory migrate` carries them and
a running proxy honours them on its next search."""

from __future__ import annotations

from dataclasses import dataclass

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.storage.dialect import SQL, Sql
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.identity import tenant_of_key

PERSON = "person:"  # the setting key's prefix recording a joined tenant's person


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
    out = [UserSummary(uid, key, tenant_of_key(key), int(conversations.get(uid, 0)),
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
    mine = tenant_of_key(row[0])
    joined = dict(conn.execute(db.pick(_PERSONS)).fetchall())
    reach = set(pooled) if mine in pooled else set()
    if mine in joined:
        reach |= {t for t, p in joined.items() if p == joined[mine]}
    if not reach:
        return frozenset()
    return frozenset(uid for uid, key in conn.execute(db.pick(_USERS))
                     if tenant_of_key(key) in reach)


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
    known = {tenant_of_key(u.key) for u in users(conn)}
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
