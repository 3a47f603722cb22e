"""Token-clock heat: how warm a row is, which decides whether the frame renders it.

Each user has a clock that advances only as their agent processes content: by the tokens of
what each exchange sends the model (the frame and the turns kept as sent; not the system prompt
or tool definitions, which are the same every time) and of the reply it receives. An idle
agent's clock stands still, so it forgets nothing; an imported history is born all at once.

Each row carries one activation: the clock position of its last activation, the peak it reached
then, and a half-life fixed when it was born. Its warmth at clock position `now` is

    peak * 2 ** (-(now - at) / half_life)

Nothing is ever written to cool a row. A row is born hot, in the transaction that stores it;
after birth only retrieval writes activations, adopting a reheat only where its peak beats the
row's current trajectory (both decay at the row's own half-life, so the better one now stays
better). Heat never enters the relevance score.

Several proxies over one database (PostgreSQL): the process that stores a message writes its
rows' birth activations, in that message's transaction; the process that serves a turn moves
that user's clock (`advance`: an increment in the database, never a value computed in the
process; concurrent moves add up) and writes that turn's reheats (`reheat`: reads the rows'
activations locked FOR UPDATE and writes the better ones in that transaction, so a reheat is
always judged against the last one committed by any process, and no update is lost when two
proxies reheat the same row). Both take the write lock shared: they run beside other
processes' writes (database.py). Readers (`warm_set`, `clock`) read committed values only.
scripts/bench_writers.py checks both with 2 and 4 processes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from perpetuity_core.memory.storage.dialect import SQL, marks
from perpetuity_core.memory.storage.store import Database, StoredItem
from perpetuity_core.wire.conversation import Kind

BIRTH_PEAK = 1.0
# Reheat peaks by rank: the best match burns hotter than a newborn row, the 20th about as hot.
REHEAT_TOP = 2.0
REHEAT_RANK_SCALE = 20.0
NEIGHBOUR_SHARE = 0.5  # turns around a hit warm with it: the question and its answer travel together
WARM_FLOOR = 0.05  # below this a row is cold: never rendered, only reachable by retrieval

# Half-lives in clock tokens, by kind: what a person said stays warm longest; bulky tool output
# and thinking cool fast; harness scaffolding is born cold.
HALF_LIFE = {
    Kind.TEXT: 4_000.0,
    Kind.TOOL_CALL: 2_000.0,
    Kind.TOOL_RESULT: 1_500.0,
    Kind.THINKING: 1_000.0,
    Kind.MEDIA: 1_500.0,
    Kind.CONTEXT: 1.0,
}
# A person's standing instruction or preference ("always ...", "never ...", "I prefer ...") is
# meant for every later turn, not the next few: it cools over millions of clock tokens, not
# thousands. Recognised by its wording when it is born; nothing else about a row is guessed.
STANDING_HALF_LIFE = 20_000_000.0
STANDING_MAX_CHARS = 1_000  # an instruction is a sentence or two; a pasted log is not one
_STANDING = re.compile(
    r"(?:^|[.!?:]\s+)(?:please\s+)?(?:always|never|from now on|do not ever|don't ever)\b"
    r"|\bI(?: would|'d)? prefer\b|\bmake sure (?:to|you) always\b|\bremember (?:that|to)\b",
    re.IGNORECASE)
# A lower-case word every _STANDING match holds, looked for first: one search in C, where the
# pattern's alternatives cost 12 us a row through the write path, and nearly no row is an
# instruction (51 of LoCoMo's 5,882). Exact: none of these letters matches outside ASCII
# under IGNORECASE (s, i and k do), so a text the pattern matches holds one of them lowered.
_STANDING_WORD = re.compile("alway|ever|from now on|prefer|remember")
# The oldest activation that can still be warm: the SQL prefilters for the warm set.
_WINDOW = max(HALF_LIFE.values()) * float(np.log2(REHEAT_TOP / WARM_FLOOR))
_STANDING_WINDOW = STANDING_HALF_LIFE * float(np.log2(REHEAT_TOP / WARM_FLOOR))


def warmth(at: np.ndarray, peak: np.ndarray, half_life: np.ndarray, now: float) -> np.ndarray:
    return peak * np.exp2(-(now - at) / half_life)


def reheat_peak(rank: int) -> float:
    return REHEAT_TOP / (1.0 + rank / REHEAT_RANK_SCALE)


def half_life(kind: Kind, role: str, text: str) -> float:
    """A row's half-life, fixed at birth by its kind, or by its wording for what a person said."""
    if (kind == Kind.TEXT and role == "user" and len(text) <= STANDING_MAX_CHARS
            and _STANDING_WORD.search(text.lower()) and _STANDING.search(text)):
        return STANDING_HALF_LIFE
    return HALF_LIFE[kind]


# OR REPLACE: a purged item leaves its activation, and SQLite gives its id to the next item.
# The clock is read by the insert itself: one statement, one round trip on PostgreSQL.
_BIRTH = SQL(
    "INSERT OR REPLACE INTO activation (item_id, user_id, conversation_id, at, peak, half_life)"
    " VALUES (?,?,?,coalesce((SELECT position FROM clock WHERE user_id = ?), 0.0),?,?)",
    "INSERT INTO activation (item_id, user_id, conversation_id, at, peak, half_life)"
    " VALUES (%s,%s,%s,coalesce((SELECT position FROM clock WHERE user_id = %s), 0.0),%s,%s)"
    " ON CONFLICT (item_id) DO UPDATE SET user_id = excluded.user_id,"
    " conversation_id = excluded.conversation_id, at = excluded.at, peak = excluded.peak,"
    " half_life = excluded.half_life")
# The clock moves by an increment in the database (module docstring).
_ADVANCE = SQL.both("INSERT INTO clock (user_id, position) VALUES (?, ?) ON CONFLICT(user_id)"
                    " DO UPDATE SET position = clock.position + excluded.position")
_CLOCK = SQL.both("SELECT position FROM clock WHERE user_id = ?")
_WARM = ("SELECT item_id, at, peak, half_life FROM activation WHERE user_id = ? AND at >= ?")
_WARM_WINDOW = SQL.both(_WARM)
_STANDING_WARM = SQL.both(_WARM + f" AND half_life >= {STANDING_HALF_LIFE}")
_REHEATED = SQL.both("UPDATE activation SET at = ?, peak = ? WHERE item_id = ?")


def derive_activation(db: Database, items: list[StoredItem]) -> None:
    """Rows are born hot at their user's clock position, in the transaction that stores them."""
    if not items:
        return
    m = items[0]
    db.connection().executemany(
        db.pick(_BIRTH),
        [(it.id, m.user_id, m.conversation_id, m.user_id,
          0.0 if it.kind == Kind.CONTEXT else BIRTH_PEAK,
          half_life(Kind(it.kind), m.role, it.text))
         for it in items])


def advance(db: Database, user_id: int, tokens: float) -> None:
    """Move the user's clock by the tokens an exchange sent or received (the store's writer)."""
    if tokens <= 0:
        return
    with db.writing("move the clock", ordered=False) as conn:
        conn.execute(db.pick(_ADVANCE), (user_id, float(tokens)))


def clock(db: Database, user_id: int) -> float:
    row = db.connection().execute(db.pick(_CLOCK), (user_id,)).fetchone()
    return float(row[0]) if row else 0.0


@dataclass(frozen=True, slots=True)
class Warm:
    """The warm rows of one user at one clock position, warmest first."""

    item_ids: np.ndarray  # int64
    warmth: np.ndarray  # float64
    # Other users' rows (a shared pool) warm only through this turn's retrieval: their
    # activations run on their owners' clocks, which this user's reheats never write.
    foreign: frozenset[int] = frozenset()


def warm_set(db: Database, user_id: int, now: float, reheats: dict[int, float]) -> Warm:
    """Every row of `user_id` at least WARM_FLOOR warm at `now`, with `reheats` (item -> peak
    reached now) applied where they beat the current trajectory, and other users' rows among
    `reheats` at their reheat peak. Reads only."""
    conn = db.connection()
    rows = conn.execute(db.pick(_WARM_WINDOW), (user_id, now - _WINDOW)).fetchall()
    # Standing rows stay warm far longer than the window: read through their own small index.
    seen = {r[0] for r in rows}
    for r in conn.execute(db.pick(_STANDING_WARM), (user_id, now - _STANDING_WINDOW)):
        if r[0] not in seen:
            rows.append(r)
            seen.add(r[0])
    foreign: frozenset[int] = frozenset()
    if reheats:
        missing = [i for i in reheats if i not in seen]
        if missing:
            mark = "%s" if db.postgres else "?"
            own = conn.execute("SELECT item_id, at, peak, half_life FROM activation WHERE"
                               f" item_id IN ({marks(db.postgres, len(missing))})"
                               f" AND user_id = {mark}", (*missing, user_id)).fetchall()
            foreign = frozenset(missing) - {r[0] for r in own}
            # A foreign row's own trajectory is on another clock: only the reheat counts.
            rows += own + [(i, now, 0.0, 1.0) for i in sorted(foreign)]
    if not rows:
        return Warm(np.zeros(0, np.int64), np.zeros(0))
    ids, at, peak, half = (np.asarray(c) for c in zip(*rows))
    w = warmth(at.astype(float), peak.astype(float), half.astype(float), now)
    if reheats:
        w = np.maximum(w, reheat_peaks(reheats, ids))
    keep = w >= WARM_FLOOR
    ids, w = ids[keep].astype(np.int64), w[keep]
    order = np.lexsort((ids, -w))  # warmest first; ties by store order, deterministic
    return Warm(ids[order], w[order], foreign)


def reheat_peaks(reheats: dict[int, float], ids: np.ndarray) -> np.ndarray:
    """Each row's peak among `reheats`, 0.0 where it has none: the reheats sorted once and
    looked up together, not a dict lookup per warm row (hundreds a first prompt)."""
    keys = np.fromiter(reheats, np.int64, len(reheats))
    peaks = np.fromiter(reheats.values(), np.float64, len(reheats))
    order = np.argsort(keys)
    keys, peaks = keys[order], peaks[order]
    at = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
    return np.where(keys[at] == ids, peaks[at], 0.0)


def reheat(db: Database, now: float, reheats: dict[int, float]) -> int:
    """Write reheats that beat each row's current trajectory; the store's writer calls this."""
    if not reheats:
        return 0
    ids = sorted(reheats)
    with db.writing("reheat rows", ordered=False) as conn:
        # Read and written in one transaction, under SQLite's one writer or, on PostgreSQL
        # (writers in parallel), under the rows' own locks, taken in id order so that two
        # reheats of the same rows cannot deadlock.
        lock = " ORDER BY item_id FOR UPDATE" if db.postgres else ""
        rows = conn.execute("SELECT item_id, at, peak, half_life FROM activation WHERE"
                            f" item_id IN ({marks(db.postgres, len(ids))}){lock}", ids).fetchall()
        better = [(now, reheats[i], i) for i, at, peak, half in rows
                  if reheats[i] > peak * 2.0 ** (-(now - at) / half)]
        conn.executemany(db.pick(_REHEATED), better)
    return len(better)


def rank_reheats(ranked_items: Sequence[int], neighbours: Iterable[tuple[int, int]]) -> dict[int, float]:
    """Peaks for this turn's retrieval: by rank, and a share of it for each hit's neighbours.

    `neighbours` pairs (rank, item_id) for the rows beside each hit.
    """
    out: dict[int, float] = {}
    for rank, item in enumerate(ranked_items):
        out[item] = max(out.get(item, 0.0), reheat_peak(rank))
    for rank, item in neighbours:
        out[item] = max(out.get(item, 0.0), NEIGHBOUR_SHARE * reheat_peak(rank))
    return out


def m003_heat(db: Database) -> None:
    """Heat (see heat.py): each user's token clock and each row's activation."""
    for sql in (
        "CREATE TABLE clock (user_id INTEGER PRIMARY KEY, position REAL NOT NULL)",
        "CREATE TABLE activation (item_id INTEGER PRIMARY KEY, user_id INTEGER NOT NULL,"
        " conversation_id INTEGER NOT NULL, at REAL NOT NULL, peak REAL NOT NULL,"
        " half_life REAL NOT NULL)",
        "CREATE INDEX activation_warm ON activation (user_id, at)",
    ):
        db.connection().execute(db.legacy(sql))


def m005_standing(db: Database) -> None:
    """Standing instructions and preferences (heat.STANDING_HALF_LIFE) stay warm beyond the
    warm set's window: a partial index finds them without reading every activation."""
    db.connection().execute(db.legacy("CREATE INDEX activation_standing ON activation"
                                      f" (user_id, at) WHERE half_life >= {STANDING_HALF_LIFE}"))
