"""The ingest timer bench_ingest.py and bench_retrieval.py share: named data sets, and the
write path against SQLite FTS5 on the same texts, interleaved, by wall and by CPU time.

Data sets (`data_set`):
  locomo              LoCoMo's 10 conversations, one user each (5,882 messages, ~125
                      characters each).
  beam+locomo         bench_retrieval.py's unit: 20 users, user i holding BEAM chat i (long
                      turns) and LoCoMo conversation i mod 10 (~4M tokens).
  beam+locomo-SIZE    that unit's first SIZE tokens (4 characters a token), its last thread
                      cut to fit: bench_retrieval.py's ingest below one unit (`-1M`: 4,863
                      messages, ~820 characters each).

Each round writes the set through the real write path (importers.write -> capture.record ->
Store.add_message and its derivers, one transaction per message, then the writer's batched
work, so nothing is left owed) into a fresh database, then gives FTS5 (porter unicode61, WAL,
synchronous NORMAL, a user column) the same texts, one transaction per message, into another:
a noisy machine slows both sides of a round alike. Wall time is what a user waits; CPU time
(the process's, `time.process_time`) leaves out the I/O waits both sides pay, which pull the
wall ratio toward 1, and the other processes of a shared machine.
"""

from __future__ import annotations

import re
import sqlite3
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from perpetuity_core.memory.derived import index
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.store import Store

UNIT_USERS = 20
DERIVERS = {"retrieval": index.derive_retrieval}
BATCHED = {"chains": "chain"}


@dataclass(frozen=True)
class DataSet:
    name: str
    threads: list[tuple[int, importers.Thread]]  # (the FTS5 peer's user, thread), write order

    @property
    def texts(self) -> list[tuple[int, str]]:
        return [(u, p.text) for u, t in self.threads for m in t.messages for p in m.parts]

    @property
    def messages(self) -> int:
        return sum(len(t.messages) for _, t in self.threads)

    @property
    def tokens(self) -> int:
        return sum(tokens_of(t) for _, t in self.threads)


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmM]?)", s.strip())
    if not m:
        raise SystemExit(f"bad size {s!r}")
    return int(float(m[1]) * {"": 1, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6}[m[2]])


def tokens_of(thread: importers.Thread) -> int:
    return sum(index.token_estimate(p.text) for m in thread.messages for p in m.parts)


def unit_threads(data: Path) -> list[list[importers.Thread]]:
    """The unit's users, each as its threads (BEAM chat i, LoCoMo conversation i mod 10)."""
    beam = list(importers.beam(data / "beam-100k"))
    locomo = list(importers.locomo(data / "locomo" / "locomo10.json"))
    users = []
    for i in range(UNIT_USERS):
        b, lo = beam[i % len(beam)], locomo[i % len(locomo)]
        key = f"bench:{i}"
        users.append([importers.Thread(key, b.conversation_key, b.messages, b.times, b.labels,
                                       b.provider),
                      importers.Thread(key, lo.conversation_key, lo.messages, lo.times,
                                       lo.labels, lo.provider)])
    return users


def cut(users: list[list[importers.Thread]], budget: int) -> list[tuple[int, importers.Thread]]:
    """The users' threads, in order, until `budget` tokens are in (the last one cut to fit)."""
    out, toks = [], 0
    for u, threads in enumerate(users):
        for t in threads:
            if toks >= budget:
                return out
            if toks + tokens_of(t) > budget:
                keep, acc = 0, toks
                for m in t.messages:
                    acc += index.token_estimate(m.parts[0].text)
                    keep += 1
                    if acc >= budget:
                        break
                t = importers.Thread(t.user_key, t.conversation_key, t.messages[:keep],
                                     t.times[:keep], t.labels[:keep], t.provider)
            out.append((u, t))
            toks += tokens_of(t)
    return out


def data_set(name: str, data: Path) -> DataSet:
    """A data set by its name (the module docstring lists them)."""
    if name == "locomo":
        return DataSet(name, list(enumerate(importers.locomo(data / "locomo" / "locomo10.json"))))
    if name == "beam+locomo":
        return DataSet(name, cut(unit_threads(data), 10**12))
    if name.startswith("beam+locomo-"):
        return DataSet(name, cut(unit_threads(data), parse_size(name.removeprefix("beam+locomo-"))))
    raise SystemExit(f"unknown data set {name!r}: locomo, beam+locomo, beam+locomo-SIZE")


def write(store: Store, ds: DataSet) -> None:
    """The set through the write path, then the batched work: nothing is left owed."""
    for _, t in ds.threads:
        importers.write(store, t)
    store.flush()


def ours(path: Path, ds: DataSet, without: set[str] = frozenset()) -> tuple[float, float]:
    """Wall and CPU seconds of writing the set into a fresh memory at `path`, without the
    derivers named (the ablation: no longer a memory the product could serve)."""
    store = open_memory(path)
    dropped = {DERIVERS[name] for name in without & DERIVERS.keys()}
    store.derivers = [d for d in store.derivers if d not in dropped]
    for name in without & BATCHED.keys():
        del store.batched[BATCHED[name]]
    w0, c0 = time.perf_counter(), time.process_time()
    write(store, ds)
    seconds = time.perf_counter() - w0, time.process_time() - c0
    store.close()
    return seconds


def fts5_open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    for k, v in {"journal_mode": "wal", "synchronous": "normal"}.items():
        conn.execute(f"PRAGMA {k} = {v}")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(text, user UNINDEXED,"
                 " tokenize = 'porter unicode61')")
    return conn


def fts5(path: Path, texts: list[tuple[int, str]]) -> tuple[float, float]:
    """Wall and CPU seconds of the FTS5 peer: (user, text) rows inserted one transaction
    each, as the write path stores messages, into a fresh database at `path`."""
    conn = fts5_open(path)
    w0, c0 = time.perf_counter(), time.process_time()
    for u, text in texts:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t (text, user) VALUES (?, ?)", (text, u))
        conn.execute("COMMIT")
    seconds = time.perf_counter() - w0, time.process_time() - c0
    conn.close()
    return seconds


def interleaved(ds: DataSet, rounds: int, tmp: Path, without: set[str] = frozenset()) -> dict:
    """`rounds` rounds of ours then FTS5 on the set, each into fresh files in `tmp` (the last
    round's are kept: `tmp`/ours.db and `tmp`/fts5.db); per round and median rates, and the
    ratios of the medians by wall and by CPU time."""
    texts = ds.texts
    runs: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []}
                                               for s in ("ours", "fts5")}
    for _ in range(rounds):
        for side in ("ours", "fts5"):
            path = tmp / f"{side}.db"
            for f in tmp.glob(f"{side}.db*"):
                f.unlink()
            wall, cpu = ours(path, ds, without) if side == "ours" else fts5(path, texts)
            runs[side]["wall"].append(ds.messages / wall)
            runs[side]["cpu"].append(ds.messages / cpu)
    med = {s: {k: statistics.median(v) for k, v in by.items()} for s, by in runs.items()}
    return {
        "data_set": ds.name, "messages": ds.messages, "tokens": ds.tokens,
        "chars_per_message": round(sum(len(t) for _, t in texts) / ds.messages),
        "without": sorted(without), "rounds": rounds,
        "messages_per_s": {s: {k: [round(x) for x in v] for k, v in by.items()}
                           for s, by in runs.items()},
        "median_messages_per_s": {s: {k: round(v) for k, v in by.items()}
                                  for s, by in med.items()},
        "median_tokens_per_s": {s: round(by["wall"] * ds.tokens / ds.messages)
                                for s, by in med.items()},
        "ratio_wall": round(med["ours"]["wall"] / med["fts5"]["wall"], 3),
        "ratio_cpu": round(med["ours"]["cpu"] / med["fts5"]["cpu"], 3),
        "ratio_wall_by_round": [round(a / b, 3) for a, b in
                                zip(runs["ours"]["wall"], runs["fts5"]["wall"], strict=True)],
    }
