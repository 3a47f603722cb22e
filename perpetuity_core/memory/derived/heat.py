"""Token-clock heat: how warm a row is, which decides whether the frame renders it.

Each user has a clock that advances only as their agent processes content: by the tokens of
what each exchange sends the model (the frame and the turns kept as sent; not the system prompt
or tool definitions, which are the same every time) and of the reply it receives. An idle
agent's clock stands still, so it forgets nothing; an imported history is born all at once.

Each row carries one activation: the clock position of its last activation, the peak it reached
then, and a half-life fixed when it was born. Its warmth at clock position `now` is

    peak * 2 ** (-(now - at) / half_life)

Nothing is ever written to cool a row. A row is born hot, in the transaction that stores it:
its birth (the clock position then, peak BIRTH_PEAK, its half-life) is written in its retrieval
row (index.derive_retrieval, m016), and harness context, which has none, is born cold. After
birth only retrieval writes activations, adopting a reheat only where its peak beats the row's
current trajectory (both decay at the row's own half-life, so the better one now stays better);
a row's activation, once written, overrides its birth. Heat never enters the relevance score.

Several proxies over one database (PostgreSQL): the process that stores a message writes its
rows' births, in that message's transaction (with its rows waiting in retrieval_pending,
which the warm set reads too); the process that serves a turn moves that user's clock
(`advance`: an increment in the database, never a value computed in the process; concurrent
moves add up) and writes that turn's reheats (`reheat`: reads the rows'
activations locked FOR UPDATE and writes the better ones in that transaction, so a reheat is
always judged against the last one committed by any process, and no update is lost when two
proxies reheat the same row; a row's first reheat is inserted, or judged against another
process's first when that came first). Both take the write lock shared: they run beside other
processes' writes (database.py). Readers (`warm_set`, `clock`) read committed values only.
scripts/bench_writers.py checks both with 2 and 4 processes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from perpetuity_core.memory.storage.dialect import SQL, Sql, marks
from perpetuity_core.memory.storage.kept import Counted, deletions, kept
from perpetuity_core.memory.storage.store import IN_CHUNK, Database, in_chunks
from perpetuity_core.wire.conversation import Kind

BIRTH_PEAK = 1.0
# Reheat peaks by rank: the best match burns hotter than a newborn row, the 20th about as hot.
REHEAT_TOP = 2.0
REHEAT_RANK_SCALE = 20.0
NEIGHBOUR_SHARE = 0.5  # turns around a hit warm with it: the question and its answer travel together
WARM_FLOOR = 0.05  # below this a row is cold: never rendered, only reachable by retrieval
# A chat's frame counts what earlier prompts left warm (and births) at this share of its warmth
# beside the prompt's own reheats, so that one question's reheated rows do not crowd out the
# next question's (docs/tuning.md). An agent's frame counts it whole (`warm_set`'s default).
CARRIED = 0.5

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
# Lower-case words one of which every _STANDING match holds, looked for first: substring
# searches in C, where the pattern's alternatives cost 12 us a row through the write path (and
# these words as one alternation 3 us a LoCoMo turn), and nearly no row is an instruction (51
# of LoCoMo's 5,882). Exact: none of these letters matches outside ASCII under IGNORECASE (s,
# i and k do), so a text the pattern matches holds one of them lowered.
_STANDING_WORDS = ("alway", "ever", "from now on", "prefer", "remember")
# The oldest activation that can still be warm: the SQL prefilters for the warm set.
WINDOW = max(HALF_LIFE.values()) * float(np.log2(REHEAT_TOP / WARM_FLOOR))
_STANDING_WINDOW = STANDING_HALF_LIFE * float(np.log2(REHEAT_TOP / WARM_FLOOR))


def warmth(at: np.ndarray, peak: np.ndarray, half_life: np.ndarray, now: float) -> np.ndarray:
    return peak * np.exp2(-(now - at) / half_life)


def reheat_peak(rank: int) -> float:
    return REHEAT_TOP / (1.0 + rank / REHEAT_RANK_SCALE)


def half_life(kind: str, role: str, text: str) -> float:
    """A row's half-life, fixed at birth by its kind (a Kind or its value), or by its wording
    for what a person said."""
    if kind == _TEXT and role == "user" and len(text) <= STANDING_MAX_CHARS:
        low = text.lower()
        if any(map(low.__contains__, _STANDING_WORDS)) and _STANDING.search(text):
            return STANDING_HALF_LIFE
    return _HALF_LIFE_OF[kind]


# By the kind's value, as rows store it: building a Kind from it cost a microsecond a row.
_HALF_LIFE_OF = {k.value: v for k, v in HALF_LIFE.items()}
_TEXT = Kind.TEXT.value


# The clock moves by an increment in the database (module docstring).
_ADVANCE = SQL.both("INSERT INTO clock (user_id, position) VALUES (?, ?) ON CONFLICT(user_id)"
                    " DO UPDATE SET position = clock.position + excluded.position")
_CLOCK = SQL.both("SELECT position FROM clock WHERE user_id = ?")
_STANDING_ONLY = f" AND half_life >= {STANDING_HALF_LIFE}"


def _warm(standing: str) -> SQL:
    """The rows of a user activated since a clock position: the activations, and the births
    none overrides (a reheat is always later than its birth), on PostgreSQL the births of rows
    not ordered yet too. One statement, so one snapshot: a first reheat or a row moving out of
    retrieval_pending committing meanwhile is seen once, never missed. `standing` narrows
    both, `{at}` standing for the column (at, born)."""
    activations = ("SELECT item_id, at, peak, half_life FROM activation WHERE user_id = ?"
                   f" AND at >= ?{standing.format(at='at')}")
    born = ("SELECT item_id, born, {0}, half_life FROM {1} r WHERE user_id = ? AND born >= ?"
            + standing.format(at="born")
            + " AND NOT EXISTS (SELECT 1 FROM activation a WHERE a.item_id = r.item_id)")
    sqlite = f"{activations} UNION ALL {born.format(BIRTH_PEAK, 'retrieval')}"
    return SQL(sqlite, f"{sqlite} UNION ALL {born.format(BIRTH_PEAK, 'retrieval_pending')}"
                       .replace("?", "%s"))


_WARM_WINDOW = _warm("")
_STANDING_WARM = _warm(_STANDING_ONLY)
# One conversation's rows activated before a clock position: those a chat left warm there.
_PAUSED_WARM = _warm(" AND {at} < ? AND conversation_id = ?")
_PARTS = {False: 2, True: 3}  # the statements' parts, each taking (user, since[, until, conv])
_REHEATED = SQL.both("UPDATE activation SET at = ?, peak = ? WHERE item_id = ?")
# A row's trajectory where no activation overrides its birth: born hot with its retrieval row,
# or cold (harness context, which has none) at its kind's half-life.
_BIRTH = SQL(
    "SELECT i.id, m.user_id, m.conversation_id, r.born, r.half_life FROM item i"
    " JOIN message m ON m.id = i.message_id LEFT JOIN retrieval r ON r.item_id = i.id"
    " WHERE i.id IN ({})",
    "SELECT i.id, m.user_id, m.conversation_id, coalesce(r.born, p.born),"
    " coalesce(r.half_life, p.half_life) FROM item i JOIN message m ON m.id = i.message_id"
    " LEFT JOIN retrieval r ON r.item_id = i.id LEFT JOIN retrieval_pending p"
    " ON p.item_id = i.id WHERE i.id IN ({})")


@dataclass(frozen=True, slots=True)
class Born:
    """A row's birth, as its retrieval row holds it (or its cold birth, without one)."""

    user_id: int
    conversation_id: int
    at: float
    peak: float
    half_life: float


def births(db: Database, conn: Sql, item_ids: Sequence[int]) -> dict[int, Born]:
    """The births of these items (those that exist), whether an activation overrides them or
    not."""
    out: dict[int, Born] = {}
    for chunk in in_chunks(item_ids):
        for i, user, conversation, born, half in conn.execute(
                db.pick(_BIRTH).format(marks(db.postgres, len(chunk))), chunk):
            out[i] = (Born(user, conversation, born, BIRTH_PEAK, half) if born is not None
                      else Born(user, conversation, 0.0, 0.0, HALF_LIFE[Kind.CONTEXT]))
    return out


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


@dataclass(frozen=True, slots=True)
class Paused:
    """A conversation whose rows activated before clock position `left` did not cool from
    `left` to `back`: a chat was about other conversations then (frame.lean.Asked). Rows
    activated meanwhile (another subject's hits) cool as any."""

    conversation_id: int
    left: float
    back: float


def warm_set(db: Database, user_id: int, now: float, reheats: dict[int, float],
             carried: float = 1.0, paused: Sequence[Paused] = ()) -> Warm:
    """Every row of `user_id` at least WARM_FLOOR warm at `now`, with `reheats` (item -> peak
    reached now) applied where they beat the current trajectory (which counts `carried` of its
    warmth), and other users' rows among `reheats` at their reheat peak; the rows a chat left
    warm in a `paused` conversation not cooled by its pause. Reads only."""
    conn = db.connection()
    parts = _PARTS[db.postgres]
    rows = conn.execute(db.pick(_WARM_WINDOW), (user_id, now - WINDOW) * parts).fetchall()
    spans: dict[int, Paused] = {}
    left_warm = []
    for p in paused:
        # The rows activated before the chat left it, read again: at most WINDOW of its clock.
        read = conn.execute(db.pick(_PAUSED_WARM), (user_id, p.left - WINDOW, p.left,
                                                    p.conversation_id) * parts).fetchall()
        spans |= dict.fromkeys((r[0] for r in read), p)
        left_warm += read
    rows = [r for r in rows if r[0] not in spans] + left_warm
    # Standing rows stay warm far longer than the window: read through their own small indexes.
    seen = {r[0] for r in rows}
    for r in conn.execute(db.pick(_STANDING_WARM), (user_id, now - _STANDING_WINDOW) * parts):
        if r[0] not in seen:
            rows.append(r)
            seen.add(r[0])
    foreign: frozenset[int] = frozenset()
    if reheats:
        missing = [i for i in reheats if i not in seen]
        if missing:
            own = [(i, *trajectory) for i, trajectory in
                   trajectories(db, conn, missing, user_id).items()]
            foreign = frozenset(missing) - {r[0] for r in own}
            # A foreign row's own trajectory is on another clock: only the reheat counts.
            rows += own + [(i, now, 0.0, 1.0) for i in sorted(foreign)]
    if not rows:
        return Warm(np.zeros(0, np.int64), np.zeros(0))
    n = len(rows)
    columns = zip(*rows)  # typed as read: no guessing each column's dtype from its values
    ids = np.fromiter(next(columns), np.int64, n)
    at, peak, half = (np.fromiter(c, np.float64, n) for c in columns)
    if spans:
        # Counted as activated later by the pause: no clock spent away from the conversation
        # cools the rows the chat left warm there (0 for the other rows).
        pause = np.fromiter((spans[i].back - spans[i].left if i in spans else 0.0
                             for i in ids.tolist()), np.float64, n)
        at = at + pause
    w = warmth(at, peak, half, now)
    if reheats:
        w = np.maximum(w * carried, reheat_peaks(reheats, ids))
    keep = w >= WARM_FLOOR
    ids, w = ids[keep], w[keep]
    order = np.lexsort((ids, -w))  # warmest first; ties by store order, deterministic
    return Warm(ids[order], w[order], foreign)


def trajectories(db: Database, conn: Sql, item_ids: Sequence[int],
                 user_id: int | None = None) -> dict[int, tuple[float, float, float]]:
    """(at, peak, half_life) of each of these rows (of `user_id`'s only, when given): its
    activation, or its birth where none overrides it."""
    found: dict[int, tuple[float, float, float]] = {}
    for chunk in in_chunks(item_ids):
        found.update((r[0], r[1:]) for r in conn.execute(
            "SELECT item_id, at, peak, half_life FROM activation WHERE"
            f" item_id IN ({marks(db.postgres, len(chunk))})", chunk))
    born = _births_kept(db, conn, item_ids)
    return {i: found.get(i, (b.at, b.peak, b.half_life))
            for i, b in born.items() if user_id is None or b.user_id == user_id}


def _births_kept(db: Database, conn: Sql, item_ids: Sequence[int]) -> dict[int, Born]:
    """`births`, in ascending ids, each read once and kept while nothing is deleted: a row's
    birth is written with it and never changes (a flip carries it over), and a first prompt's
    reheats ask for the births of the ~50 hits and neighbours outside the warm window (the
    three-table read was 0.5M of LoCoMo's 26M instructions a prepare)."""
    cache = kept(db, "births", Counted[Born])
    count = deletions(conn)  # counted before anything is read
    known = cache.get(count, item_ids)
    if missing := [i for i in dict.fromkeys(item_ids) if i not in known]:
        read = births(db, conn, missing)
        cache.put(count, read)
        known |= read
    return {i: known[i] for i in sorted(known)}


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
        # reheats of the same rows cannot deadlock. A row never reheated has no activation to
        # lock: its first is inserted unless another process's came first, and that one is
        # then judged as any other (the second pass).
        better = 0
        for _ in range(2):
            lock = " ORDER BY item_id FOR UPDATE" if db.postgres else ""
            rows = conn.execute("SELECT item_id, at, peak, half_life FROM activation WHERE"
                                f" item_id IN ({marks(db.postgres, len(ids))}){lock}",
                                ids).fetchall()
            updated = [(now, reheats[i], i) for i, at, peak, half in rows
                       if reheats[i] > peak * 2.0 ** (-(now - at) / half)]
            conn.executemany(db.pick(_REHEATED), updated)
            better += len(updated)
            first = [(i, b.user_id, b.conversation_id, now, reheats[i], b.half_life)
                     for i, b in births(db, conn, sorted(set(ids) - {r[0] for r in rows})).items()
                     if reheats[i] > b.peak * 2.0 ** (-(now - b.at) / b.half_life)]
            ids = sorted(set(r[0] for r in first) - _first_reheats(db, conn, first))
            better += len(first) - len(ids)
            if not ids:
                break
    return better


def _first_reheats(db: Database, conn: Sql, rows: list[tuple]) -> set[int]:
    """Insert the activations of rows reheated for the first time; returns the ones inserted
    (on PostgreSQL another process may have inserted some first)."""
    if not rows:
        return set()
    if not db.postgres:
        conn.executemany(_FIRST_SQLITE, rows)
        return {r[0] for r in rows}
    done: set[int] = set()
    for start in range(0, len(rows), IN_CHUNK):
        chunk = rows[start:start + IN_CHUNK]
        done.update(i for (i,) in conn.execute(
            _FIRST_POSTGRES.format(", ".join([f"({marks(True, 6)})"] * len(chunk))),
            [v for r in chunk for v in r]).fetchall())
    return done


_FIRST_SQLITE = ("INSERT INTO activation (item_id, user_id, conversation_id, at, peak, half_life)"
                 f" VALUES ({marks(False, 6)})")
_FIRST_POSTGRES = ("INSERT INTO activation (item_id, user_id, conversation_id, at, peak,"
                   " half_life) VALUES {} ON CONFLICT (item_id) DO NOTHING RETURNING item_id")


def rank_peaks(n: int) -> Sequence[float]:
    """reheat_peak of ranks 0 to n - 1, made once for the first 1,024."""
    return _PEAKS if n <= len(_PEAKS) else [reheat_peak(rank) for rank in range(n)]


def rank_reheats(ranked_items: Sequence[int], neighbours: Iterable[tuple[int, int]]) -> dict[int, float]:
    """Peaks for this turn's retrieval: by rank, and a share of it for each hit's neighbours.

    `neighbours` pairs (rank, item_id) for the rows beside each hit.
    """
    out: dict[int, float] = {}
    peaks = rank_peaks(len(ranked_items))
    for item, peak in zip(ranked_items, peaks, strict=False):
        if item not in out:  # peaks fall with rank: a row ranked twice keeps its first
            out[item] = peak
    for rank, item in neighbours:
        share = NEIGHBOUR_SHARE * (peaks[rank] if rank < len(peaks) else reheat_peak(rank))
        if out.get(item, 0.0) < share:
            out[item] = share
    return out


# reheat_peak of the first ranks, made once: a search ranks ~200 (frame.read.HITS).
_PEAKS = tuple(reheat_peak(rank) for rank in range(1024))


def forget(conn: Sql, item_ids: list[int]) -> None:
    """A purge's hook (store.Forget): activations are keyed by item, not linked to it."""
    conn.executemany("DELETE FROM activation WHERE item_id = ?", [(i,) for i in item_ids])


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
