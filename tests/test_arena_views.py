"""The arena's views: readers scan without a lock while a catch-up appends (memory.view.View).

Every ranking a reader gets from a view equals the reference scan (tests/test_retrieval.py) of
the memory as it was committed when that view was published: the rows then stored, minus the
rows then purged.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core.memory.derived import arena, bm25, index, scan
from perpetuity_core.memory.derived.view import Frequencies, View, Visibility
from perpetuity_core.memory.storage.store import Store
from tests.test_retrieval import WORDS, add, fill, random_text, reference

QUERIES = ["support group guitar", "guitar", "painting sunrise camping", "dog the cat kids"]
ONE_SCAN = bm25.Params(feedback=0.0)


def test_readers_scan_views_while_the_writer_appends_and_purges(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "SEGMENT_ROWS", 29)  # catch-ups append, merge and regrow
    monkeypatch.setattr(Frequencies, "FOLD_AT", 7)  # frequencies fold often
    rng = random.Random(23)
    fill(sqlite_store, rng, 60)
    sc = scan.Scanner(sqlite_store, store_rows=0, threads=2)
    sc.catch_up()
    users = [sqlite_store.user_id(f"u{i}") for i in range(3)]
    asks = [(q, u) for q in QUERIES for u in [*users, None]]
    # Per published view (kept alive, so ids stay unique): what the reference says of it.
    want: dict[int, dict[tuple[str, int | None], list[tuple[int, float]]]] = {}
    views: list[View] = []
    item_of: dict[int, int] = {}  # seq -> item id (seqs are never reused)
    # The views themselves are kept too, so that no id is reused.
    got: list[tuple[View, str, int | None, list[tuple[float, int, bool]]]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def publish_reference() -> None:
        view = sc.arena.view
        views.append(view)
        item_of.update(sqlite_store.db.translated().execute("SELECT seq, item_id FROM retrieval"))
        # View.top is one scan: the scanner's feedback (a second one) is not in it.
        want[id(view)] = {(q, u): reference(sqlite_store, q, u, 10, params=ONE_SCAN)
                          for q, u in asks}

    def read(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not done.is_set():
                view = sc.arena.view
                q, u = r.choice(asks)
                got.append((view, q, u,
                            view.top(view.query(sqlite_store.db.dictionary, q, ONE_SCAN), 10, Visibility(u))))
                sc.search(r.choice(WORDS), u, 5)  # a search's own catch-up races the writer's
        except BaseException as e:  # noqa: BLE001 - the test reports every failure
            errors.append(e)

    publish_reference()
    readers = [threading.Thread(target=read, args=(i,)) for i in range(3)]
    for t in readers:
        t.start()
    try:
        for step in range(30):
            for _ in range(rng.choice([1, 2, 5, 13, 40])):
                user = f"u{rng.randrange(3)}"
                add(sqlite_store, user, f"{user}-c{rng.randrange(3)}", [random_text(rng)],
                    at=100.0 + step)
            if step % 7 == 3:
                live = [i for (i,) in sqlite_store.db.translated().execute("SELECT item_id FROM retrieval")]
                index.purge(sqlite_store, rng.sample(live, 5))
            sc.catch_up()
            publish_reference()
    finally:
        done.set()
        for t in readers:
            t.join()
    assert not errors, errors
    checked = 0
    for view, q, u, ranked in got:
        if id(view) not in want:  # published by a search's catch-up between two of ours
            continue
        expected = want[id(view)][(q, u)]
        assert [(item_of[s], score) for score, s, _ in ranked] == expected
        checked += 1
    assert checked >= len(got) // 2 and len({id(v) for v, *_ in got}) > 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 60), max_size=25), st.sampled_from([1, -1])),
                max_size=30),
       st.integers(2, 40))
def test_frequencies_count_as_a_plain_tally_and_never_change_once_made(
        batches: list[tuple[list[int], int]], fold_at: int) -> None:
    """Frequencies after any run of rows counted and uncounted, folded or not, hold what a
    plain tally holds, and every earlier Frequencies (a published view's) still holds what it
    held when made: the delta is merged, never written in place. Ids above the dense base go
    to the hashed table."""
    base = 40
    freq = Frequencies(base)
    freq.FOLD_AT = fold_at
    tally: Counter[int] = Counter()
    made: list[tuple[Frequencies, dict[int, int]]] = []
    probe = np.arange(0, 61, dtype=np.int64)
    for terms, sign in batches:
        freq = freq.rows(np.asarray(terms, np.int32), sign)
        freq.FOLD_AT = fold_at
        for t in set(terms):
            tally[t] += sign * terms.count(t)
        made.append((freq, dict(tally)))
        assert freq.get(probe).tolist() == [tally[t] for t in probe.tolist()]
    for f, then in made:
        assert f.get(probe).tolist() == [then.get(t, 0) for t in probe.tolist()]
