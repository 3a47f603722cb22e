"""The store: users, conversations, messages and their immutable rows, in SQLite (the embedded
default) or PostgreSQL (`--db postgresql://user@host:port/dbname`, location.py) via peewee.
Each statement is written for both backends, by peewee's query builder or side by side per
backend (dialect.SQL); only the migrations' DDL is translated (dialect.translate_ddl).

Every message is written in one transaction, as one `Message` row plus one `Item` row per part,
and nothing is updated in place afterwards. Structures derived from the rows (retrieval rows,
counts, activations) are written by derivers registered on the store, inside that same
transaction, so a reader never sees a row without what is derived from it. The store imports
none of them: memory/schema.py's `open_memory` wires them in (and lists the migrations, each
owned by its structure). Structures no
retrieval needs at once (the chains) are written by the same writer a batch of messages at a
time, one transaction per batch (`Store.flush`), each with a cursor: their readers add the rows
past the cursor themselves, so they too never see a row without what is derived from it.

The store owns its database, `store.db` (database.Database, the handle): every read and write
of the memory goes through it, every write through `store.db.writing`, reads that must agree
through `store.db.snapshot`, and the database's errors leave the store as StoreError. Ids are
never handed out twice (m010).

Credentials never reach this module: identity arrives already hashed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import peewee as pw

from perpetuity_core.errors import StoreError
from perpetuity_core.memory.storage.database import IN_CHUNK as IN_CHUNK
from perpetuity_core.memory.storage.database import Database as Database
from perpetuity_core.memory.storage.database import failing_as as failing_as
from perpetuity_core.memory.storage.database import in_chunks as in_chunks
from perpetuity_core.memory.storage.dialect import SQL, Sql, marks
from perpetuity_core.memory.storage.location import shown, where
from perpetuity_core.memory.storage.secrets import secret_kind
from perpetuity_core.wire.conversation import Message, Usage

log = logging.getLogger("perpetuity")


class BaseModel(pw.Model):
    """Unbound: a query names the store's database (`.bind(store.db.peewee)`), never a class
    attribute two stores would share."""


class Setting(BaseModel):
    key = pw.TextField(primary_key=True)
    value = pw.TextField()


class Migration(BaseModel):
    name = pw.TextField(primary_key=True)
    applied_at = pw.FloatField()


class User(BaseModel):
    id = pw.AutoField()  # peewee's implicit key, named for the queries that read it
    key = pw.TextField(unique=True)
    created_at = pw.FloatField()


class Conversation(BaseModel):
    id = pw.AutoField()  # peewee's implicit key, named for the queries that read it
    user = pw.ForeignKeyField(User, backref="conversations")
    key = pw.TextField()
    provider = pw.TextField()
    created_at = pw.FloatField()

    class Meta:
        indexes = ((("user", "key"), True),)


class StoredMessage(BaseModel):
    # Indexed by the migrations (m007, with id): lookups need the conversation in store order.
    conversation = pw.ForeignKeyField(Conversation, backref="messages", index=False)
    # No index: nothing looks messages up by user, and every index is one more page written
    # in each message's commit.
    user = pw.ForeignKeyField(User, index=False)
    role = pw.TextField()
    provider = pw.TextField()
    model = pw.TextField()
    at = pw.FloatField()  # when the turn happened (epoch seconds; x-perpetuity-time can set it)
    stored_at = pw.FloatField()
    # Recognises re-sent history: digest of (previous message, this message), see capture.py.
    pair_key = pw.TextField()
    fingerprint = pw.TextField()  # Message.fingerprint(): recognises replies re-sent elsewhere
    source = pw.TextField()  # "request" | "reply" | "import"
    complete = pw.BooleanField(default=True)
    stop_reason = pw.TextField(default="")
    usage = pw.TextField(default="")  # JSON of the provider's usage figures, replies only

    class Meta:
        table_name = "message"
        # m001's; m014 replaced them with one, (conversation_id, fingerprint, pair_key).
        indexes = ((("conversation", "pair_key"), False), (("conversation", "fingerprint"), False))


class Item(BaseModel):
    """One immutable row: a part of a message (text, tool call, tool result, thinking...)."""

    message = pw.ForeignKeyField(StoredMessage, backref="items")
    seq = pw.IntegerField()
    kind = pw.TextField()
    name = pw.TextField(default="")
    call_id = pw.TextField(default="")
    text = pw.TextField()


def create_tables(db: Database, models: Sequence[type[pw.Model]]) -> None:
    """peewee's create_tables, on this database (the models are unbound): `models` in the
    order their foreign keys need."""
    for model in models:
        pw.SchemaManager(model, db.peewee).create_all()


def m001_initial(db: Database) -> None:
    """The spine: users, conversations, messages and their rows."""
    create_tables(db, [Setting, User, Conversation, StoredMessage, Item])


# The next id of a table whose rows can be deleted: past its newest row and past every id a
# deletion ever freed (m010); on SQLite the writer reads it when its count may be stale
# (Store._insert_numbered). On PostgreSQL, its sequence: writers store in parallel there
# (database.py), and a sequence never hands out a number twice (m013_id_sequences).
_NEXT_ID = ("max((SELECT coalesce(max(id), 0) FROM {0}),"
            " (SELECT id FROM high_water WHERE name = '{0}')) + 1")


class StoredItem(NamedTuple):
    """A row just written, with its message's fields, as the derivers read it (a tuple: a
    frozen dataclass cost 4 us more to build, once per stored part)."""

    id: int
    message_id: int
    user_id: int
    conversation_id: int
    role: str
    at: float  # wall time the turn was said
    seq: int  # the part's place in its message
    kind: str
    name: str
    call_id: str
    text: str


# Called inside each message's transaction with the rows just written; one writer per structure.
Deriver = Callable[[Database, list[StoredItem]], None]
# Called by a purge (memory/jobs/forget.py), inside its transaction, with the ids of the items
# about to be deleted: a derived table keyed by item that no foreign key cascades from
# item(id) removes its rows here (memory/schema.py lists them, FORGET).
Forget = Callable[[Sql, list[int]], None]
# Called by Store.flush, inside the batch's transaction, for the rows with after < seq <= upto.
BatchDeriver = Callable[[Database, int, int], None]
# Takes the counts of deleted retrieval rows back out, or orders the rows stored in parallel
# (PostgreSQL, database.py), inside the flush's transaction; returns the rows it touched.
Settle = Callable[[Database, Sql], int]
Migrate = Callable[[Database], None]
# Rows stored before the batched structures are written: larger batches dirty fewer pages per
# message, and a reader derives at most this many rows itself (see chains.chain_of).
BATCH_ROWS = 256


@dataclass(frozen=True, slots=True)
class AddedMessage:
    message_id: int
    item_ids: tuple[int, ...]


def default_db_path() -> str | Path:
    """Where memory lives: $PERPETUITY_DB (a path or URL, see location.py), else
    ~/.perpetuity/memory.db."""
    return os.environ.get("PERPETUITY_DB") or Path.home() / ".perpetuity" / "memory.db"


class Store:
    """One memory: its database (`db`, which it owns and closes) and the one writer of it.

    Threads. Writes (`user_id`, `conversation_id`, `name_conversation`, `add_message`, `flush`,
    and heat's, bindings' and maintenance's writes through `db`) come from one thread at a
    time: the proxy's writer thread, or the command that opened the store. The caches below
    are filled by that writer only. Other threads only read: the request thread
    (`find_user`, `find_conversation`, `message_ids`, `latest_messages`, the frame's reads),
    the scanner's catch-ups and the recall tools. That is safe because peewee gives each
    thread its own connection, each read sees committed rows only (WAL on SQLite, MVCC on
    PostgreSQL), and a reader only looks the caches up (a dict read under the GIL), where a
    missing entry costs one query."""

    def __init__(self, path: str | Path, *, migrations: Sequence[Migrate],
                 derivers: Iterable[Deriver], batched: Mapping[str, BatchDeriver],
                 settle: Settle, sequence: Settle) -> None:
        """Open through memory.schema.open_memory, which wires the derivers."""
        self.path = where(path)
        self._users: dict[str, int] = {}
        self._conversations: dict[tuple[int, str], int] = {}
        self._named: set[tuple[int, str]] = set()  # (conversation, name part) already stored
        self.migrations = list(migrations)
        self.derivers = list(derivers)
        self.batched = dict(batched)
        self._settle = settle
        self._sequence = sequence
        try:
            if isinstance(self.path, Path):
                _create_private(self.path)
            self.db = Database(self.path)
            with failing_as(f"open the memory database {self.shown}"):
                self.db.peewee.connect(reuse_if_open=True)
                self._migrate()
                self.salt = self._setting("identity_salt", lambda: secrets.token_hex(16))
                # Rows left behind by a process that stopped before its batch: the next flush
                # writes them (opening does not: a reader may open the store too).
                conn = self.db.connection()
                (self._behind,) = conn.execute(
                    "SELECT count(*) FROM retrieval WHERE seq > (SELECT min(seq) FROM derived)"
                ).fetchone()
                self.db.live.follow(conn)
                self.notice = self.db.live.notice(conn)
        except OSError as e:
            raise StoreError(f"cannot open the memory database {self.path}: {e}") from e
        if self.notice:
            log.warning("perpetuity: %s", self.notice)

    @property
    def shown(self) -> str:
        """Where the memory is, as messages show it (a URL without its password)."""
        return shown(str(self.path))

    def size_bytes(self) -> int:
        """The database's size on disk."""
        if isinstance(self.path, Path):
            return self.path.stat().st_size
        return int(self.db.connection().execute(
            "SELECT pg_database_size(current_database())").fetchone()[0])

    def close(self) -> None:
        """Close the database's connections, every thread's; other stores keep theirs."""
        self.db.close()

    def _migrate(self) -> None:
        database = self.db.peewee
        with self.db.writing("migrate the memory database"):
            create_tables(self.db, [Migration])
            done = {m.name for m in Migration.select(Migration.name).bind(database)}
            for migration in self.migrations:
                if migration.__name__ not in done:
                    migration(self.db)
                    Migration.insert(name=migration.__name__,
                                     applied_at=time.time()).bind(database).execute()

    def _setting(self, key: str, make: Callable[[], str]) -> str:
        database = self.db.peewee
        with self.db.writing(f"write the setting {key}"):
            row = Setting.select(Setting.value).where(Setting.key == key).bind(database).scalar()
            if row is None:
                row = make()
                Setting.insert(key=key, value=row).bind(database).execute()
        return str(row)

    # The per-request path below is raw SQL, written per backend: peewee's query building cost
    # more than SQLite's work here (measured: 1.3 ms of a 1.5 ms store_turn), and this runs on
    # every model call. A user or conversation is written once; peewee's builder does that.

    def user_id(self, key: str) -> int:
        if (cached := self._users.get(key)) is not None:
            return cached
        with self.db.writing("store a user", ordered=False):
            User.insert(key=key, created_at=time.time()).on_conflict_ignore().bind(
                self.db.peewee).execute()
            uid = User.select(User.id).where(User.key == key).bind(self.db.peewee).scalar()
        self._users[key] = uid
        return int(uid)

    def conversation_id(self, user_id: int, key: str, provider: str) -> int:
        if (cached := self._conversations.get((user_id, key))) is not None:
            return cached
        with self.db.writing("store a conversation", ordered=False):
            Conversation.insert(user=user_id, key=key, provider=provider,
                                created_at=time.time()).on_conflict_ignore().bind(
                self.db.peewee).execute()
            cid = Conversation.select(Conversation.id).where(
                (Conversation.user == user_id) & (Conversation.key == key)).bind(
                self.db.peewee).scalar()
        self._conversations[(user_id, key)] = cid
        return int(cid)

    def name_conversation(self, conversation_id: int, *, title: str = "", opening: str = "",
                          folder: str = "") -> None:
        """Give a conversation the parts of its name (names.py) it does not have yet. The first
        of each is kept, so its label changes at most once (when the title comes)."""
        wanted = [(column, value) for column, value in
                  (("title", title), ("opening", opening), ("folder", folder))
                  if value and (conversation_id, column) not in self._named]
        if not wanted:
            return
        with self.db.writing(f"name conversation {conversation_id}", ordered=False) as conn:
            for column, value in wanted:
                conn.execute(self.db.pick(_NAME[column]), (value, conversation_id))
        self._named.update((conversation_id, column) for column, _ in wanted)

    def find_user(self, key: str) -> int | None:
        """Read only: the user's id, or None if the store has never seen them."""
        if (cached := self._users.get(key)) is not None:
            return cached
        with failing_as("read a user"):
            row = self.db.connection().execute(self.db.pick(_FIND_USER), (key,)).fetchone()
        return row[0] if row else None

    def find_conversation(self, user_id: int, key: str) -> int | None:
        """Read only: the conversation's id, or None if the store has never seen it."""
        if (cached := self._conversations.get((user_id, key))) is not None:
            return cached
        with failing_as("read a conversation"):
            row = self.db.connection().execute(self.db.pick(_FIND_CONVERSATION),
                                               (user_id, key)).fetchone()
        return row[0] if row else None

    def latest_messages(self, conversation_id: int, n: int) -> list[int]:
        """The ids of the conversation's last `n` stored messages."""
        with failing_as("read the latest messages"):
            return [i for (i,) in self.db.connection().execute(
                self.db.pick(_LATEST), (conversation_id, n))]

    def message_ids(self, conversation_id: int, fingerprints: list[str]) -> list[int]:
        """The stored messages of a conversation with these fingerprints."""
        with failing_as("read messages"):
            return [i for (i,) in _in_query(
                self.db, self.db.connection(),
                "SELECT id FROM message WHERE conversation_id = {} AND fingerprint IN",
                conversation_id, fingerprints)]

    def result_items(self, conversation_id: int, call_ids: list[str]) -> dict[str, int]:
        """The stored row of each of these tool calls' results in a conversation, by call id
        (a result not stored yet is not there)."""
        with failing_as("read tool results"):
            return {c: i for c, i in _in_query(
                self.db, self.db.connection(),
                "SELECT i.call_id, i.id FROM item i JOIN message m ON m.id = i.message_id"
                " WHERE m.conversation_id = {} AND i.kind = 'tool_result' AND i.call_id IN",
                conversation_id, call_ids)}

    def known(self, conversation_id: int, messages: list[tuple[str, str]],
              reply_fingerprints: list[str]) -> tuple[Counter[str], Counter[str]]:
        """How many rows of this conversation hold each of these (fingerprint, pair key)
        messages' pair keys, and how many assistant messages each of these fingerprints: a
        pair said twice in a history is stored twice, so capture matches occurrences.

        One lookup by fingerprint (m014_message_lookup): a stored pair key digests its own
        message's fingerprint (capture.pair_key), so a message holding one of these keys has
        one of these fingerprints, and the index holds its pair key."""
        keys = {k for _, k in messages}
        replies = set(reply_fingerprints)
        with failing_as("read what a conversation holds"):
            rows = _in_query(
                self.db, self.db.connection(),
                "SELECT fingerprint, pair_key, role FROM message WHERE conversation_id = {}"
                " AND fingerprint IN", conversation_id, sorted({f for f, _ in messages} | replies))
        return (Counter(k for _, k, _ in rows if k in keys),
                Counter(f for f, _, role in rows if role == "assistant" and f in replies))

    def copies(self, conversation_id: int, fingerprint: str, pair_key: str) -> int:
        """How many messages of this conversation hold this content at this place."""
        with failing_as("read a message's copies"):
            return int(self.db.connection().execute(
                self.db.pick(_COPIES), (conversation_id, fingerprint, pair_key)).fetchone()[0])

    def add_message(
        self,
        *,
        conversation_id: int,
        user_id: int,
        message: Message,
        provider: str,
        model: str,
        at: float,
        pair_key: str,
        source: str,
        usage: Usage | None = None,
        stop_reason: str = "",
        complete: bool = True,
    ) -> AddedMessage:
        """Write one message and its rows, and everything derived from them, in one transaction."""
        db = self.db
        fields = (conversation_id, user_id, message.role, provider, model, at, time.time(),
                  pair_key, message.fingerprint(), source, complete, stop_reason,
                  json.dumps(dataclasses.asdict(usage)) if usage else "")
        parts = [(i, p.kind.value, p.name, p.call_id, p.text, secret_kind(p.text))
                 for i, p in enumerate(message.parts)]
        with db.writing(f"store a {message.role} message", ordered=False, numbered=True) as conn:
            message_id, item_ids = (_insert_returning(conn, fields, parts) if db.postgres
                                    else self._insert_numbered(conn, fields, parts))
            items = [StoredItem(item_id, message_id, user_id, conversation_id, message.role, at,
                                i, kind, name, call_id, text)
                     for item_id, (i, kind, name, call_id, text, _) in zip(item_ids, parts,
                                                                           strict=True)]
            for derive in self.derivers:
                derive(db, items)
        self._behind += len(items)
        if self._behind >= BATCH_ROWS:
            self.flush()
        return AddedMessage(message_id, tuple(item_ids))

    def _insert_numbered(self, conn: Sql, fields: tuple, parts: list[tuple]) -> tuple[int, range]:
        """SQLite: insert a message and its rows under the ids the writer counts (m010's: past
        the newest and past every id a deletion freed), read from the tables again whenever
        database.Numbering says the count may be stale; returns the ids."""
        counted = self.db.numbering.counted
        message_id, item_id = counted.get("message") or conn.execute(_NEXT_IDS).fetchone()
        item_ids = range(item_id, item_id + len(parts))
        conn.execute(_INSERT_MESSAGE.sqlite, (message_id, *fields))
        if len(parts) == 1:  # most messages: executemany's own cost is not paid for one row
            conn.execute(_INSERT_ITEM.sqlite, (item_id, message_id, *parts[0]))
        elif parts:
            conn.executemany(_INSERT_ITEM.sqlite, [(i, message_id, *p)
                                                   for i, p in zip(item_ids, parts, strict=True)])
        counted["message"] = (message_id + 1, item_ids.stop)  # only once both went in
        return message_id, item_ids

    def flush(self) -> None:
        """Write the batched structures up to the last stored row, with their cursors, in one
        transaction. Only the store's writer calls this (add_message, every BATCH_ROWS rows)."""
        db = self.db
        with db.writing("write the batched derivations") as conn:
            # Rows other writers stored are ordered first, so the batch covers them too, and
            # deletions made behind the writer's back (another process, a cascade) are settled:
            # the writer is the only one who settles (readers account for the rest).
            self._sequence(db, conn)
            self._settle(db, conn)
            (upto,) = conn.execute("SELECT coalesce(max(seq), 0) FROM retrieval").fetchone()
            for name, derive in self.batched.items():
                (after,) = conn.execute(db.pick(_DERIVED), (name,)).fetchone()
                if upto > after:
                    derive(db, after, upto)
                    conn.execute(db.pick(_DERIVED_TO), (upto, name))
        self._behind = 0


_NAME = {column: SQL.both(f"UPDATE conversation SET {column} = ? WHERE id = ?"
                          f" AND {column} = ''") for column in ("title", "opening", "folder")}
_FIND_USER = SQL('SELECT id FROM user WHERE key = ?', 'SELECT id FROM "user" WHERE key = %s')
_FIND_CONVERSATION = SQL.both("SELECT id FROM conversation WHERE user_id = ? AND key = ?")
_LATEST = SQL.both("SELECT id FROM message WHERE conversation_id = ? ORDER BY id DESC LIMIT ?")
_COPIES = SQL.both("SELECT count(*) FROM message WHERE conversation_id = ? AND fingerprint = ?"
                   " AND pair_key = ?")
_DERIVED = SQL.both("SELECT seq FROM derived WHERE name = ?")
_DERIVED_TO = SQL.both("UPDATE derived SET seq = ? WHERE name = ?")
# SQLite numbers the rows itself, past every id a deletion freed (m010), as the writer counts
# them (Store._insert_numbered); PostgreSQL takes them from the sequences (m013), and returns
# the id (RETURNING: no round trip of its own).
_MESSAGE_COLUMNS = ("conversation_id, user_id, role, provider, model, at, stored_at, pair_key,"
                    " fingerprint, source, complete, stop_reason, usage")
_INSERT_MESSAGE = SQL(
    f"INSERT INTO message (id, {_MESSAGE_COLUMNS}) VALUES ({','.join('?' * 14)})",
    f"INSERT INTO message ({_MESSAGE_COLUMNS}) VALUES ({','.join(['%s'] * 13)}) RETURNING id")
_ITEM_COLUMNS = "message_id, seq, kind, name, call_id, text, secret"
_INSERT_ITEM = SQL(
    f"INSERT INTO item (id, {_ITEM_COLUMNS}) VALUES ({','.join('?' * 8)})",
    f"INSERT INTO item ({_ITEM_COLUMNS}) VALUES ({','.join(['%s'] * 7)}) RETURNING id")
_NEXT_IDS = f"SELECT {_NEXT_ID.format('message')}, {_NEXT_ID.format('item')}"


def _insert_returning(conn: Sql, fields: tuple, parts: list[tuple]) -> tuple[int, list[int]]:
    """PostgreSQL: insert a message and its rows, each id from its sequence; returns them."""
    message_id = int(conn.execute(_INSERT_MESSAGE.postgres, fields).fetchone()[0])
    return message_id, [int(conn.execute(_INSERT_ITEM.postgres, (message_id, *p)).fetchone()[0])
                        for p in parts]


def _in_query(db: Database, conn: Sql, sql: str, conversation_id: int,
              values: list[str]) -> list[tuple]:
    """`sql` (its one placeholder written `{}`) with an IN-list of `values` appended."""
    if not values:
        return []
    mark = "%s" if db.postgres else "?"
    return conn.execute(f"{sql.format(mark)} ({marks(db.postgres, len(values))})",
                        (conversation_id, *values)).fetchall()


def _create_private(path: Path) -> None:
    """Create the database file readable by its owner only, before SQLite opens it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)

