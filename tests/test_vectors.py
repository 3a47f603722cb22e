"""The semantic half of the dictionary (memory/derived/vectors.py): the table shipped as data,
read with no network; each row's vector derived with the row, re-derived by a flip, removed by
a purge and carried by a migration, on both backends."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from perpetuity_core.cli import main as cli
from perpetuity_core.memory.derived import bm25, heat, index, scan, vectors
from perpetuity_core.memory.jobs import maintenance
from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import dictionary
from perpetuity_core.memory.storage.store import Store
from tests.test_retrieval import add, fill, ranked, reference, same

# Any socket the process opens raises: the table must come from the wheel's files alone.
OFFLINE = """
import socket, sys
def refuse(*a, **k):
    raise OSError("network blocked by the test")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from perpetuity_core.memory.derived import vectors
from perpetuity_core.memory.storage import dictionary
t = vectors.table()
assert t.embedding.shape == (32000, vectors.DIMS)
d = dictionary.shipped()
bag = d.packed("We went camping by the lake last summer")
v = t.row(d, bag.terms, bag.counts)
assert len(v) == vectors.DIMS and any(v)
print("loaded")
"""


def test_the_table_loads_with_the_network_blocked(tmp_path: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", OFFLINE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded"


TERMS = """
import hashlib
from perpetuity_core.memory.derived import vectors
from perpetuity_core.memory.storage import dictionary
print(hashlib.sha256(vectors.table().terms(dictionary.shipped()).tobytes()).hexdigest())
"""


def test_the_term_vectors_are_the_same_in_every_process() -> None:
    """A term's vector sums its surface forms in float32: in one order every time (the
    tokenizer's vocabulary is a hash map listed in another order in each process), so a score
    does not move between two runs of the same measure (issue 40)."""
    runs = {subprocess.run([sys.executable, "-c", TERMS], capture_output=True, text=True,
                           check=True, timeout=120).stdout for _ in range(3)}
    assert len(runs) == 1


def derived(store: Store, text: str) -> np.ndarray:
    """A row's vector, written out: its bag's terms' vectors summed by count (in float64),
    those of hashed terms left out, with the largest component at 127."""
    d = store.db.dictionary
    table = vectors.table().terms(d)
    bag = d.bag(text)
    v = np.zeros(vectors.DIMS)
    for t, c in zip(bag.terms.tolist(), bag.counts.tolist(), strict=True):
        if t < d.hash_base:
            v += c * table[t].astype(np.float64)
    top = float(np.abs(v).max())
    return v * (127.0 / top) if top else v


def near(got: bytes, want: np.ndarray) -> bool:
    """The stored int8 vector is `want` rounded (float32 sums: off by one at most)."""
    return bool(np.abs(np.frombuffer(got, np.int8) - want).max() <= 1.0)


def stored_vectors(store: Store) -> dict[int, bytes]:
    index.sequence(store.db)  # PostgreSQL: the rows waiting for their seq, moved in first
    return {i: bytes(v) for i, v in store.db.translated().execute(
        "SELECT item_id, vec FROM retrieval")}


def texts(store: Store) -> dict[int, str]:
    return {i: index.item_text(k, n, t) for i, k, n, t in store.db.translated().execute(
        "SELECT id, kind, name, text FROM item WHERE kind != 'context'")}


def test_each_row_is_written_with_its_vector(store: Store) -> None:
    ids = add(store, "u1", "c1", ["We went camping by the lake", "the a of",
                                  "camping " * 300 + "zqxjvbw"])
    got = stored_vectors(store)
    assert set(got) == set(ids)
    for i, text in texts(store).items():
        assert near(got[i], derived(store, text))
    assert got[ids[1]] == bytes(vectors.DIMS)  # stop words only: no topic


def test_a_question_reaches_a_row_that_shares_no_word_with_it(store: Store) -> None:
    add(store, "u1", "c1", ["I adopted a puppy from the shelter last week",
                            "The quarterly tax filing is due in April", "It rained all day",
                            "We cooked pasta for dinner", "The meeting moved to Friday",
                            "My neighbour planted a big garden"])
    add(store, "u1", "c2", ["Our family got a puppy and a kitten"])
    uid = store.user_id("u1")
    q = "Is there a dog in her garden?"
    for params in (bm25.Params(), bm25.Params(semantic=0.0)):
        hits = scan.Scanner(store, store_rows=0, params=params).search(q, uid, 10)
        same(ranked(hits), reference(store, q, uid, 10, params=params))
    # The cosine within the conversation the words found; elsewhere only what "dog" brings
    # ("puppy", bm25.expanded) finds a row, so the other conversation's puppy ranks below.
    found = [h.text for h in scan.Scanner(store, store_rows=0).search(q, uid, 10)]
    puppy = [i for i, t in enumerate(found) if "puppy" in t]
    assert len(puppy) == 2 and "kitten" in found[puppy[1]]
    lexical = scan.Scanner(store, store_rows=0, params=bm25.Params(semantic=0.0))
    assert not any("puppy" in h.text for h in lexical.search(q, uid, 10))


def test_a_question_term_brings_its_nearest_terms_in_every_conversation(store: Store) -> None:
    """No row says "dog": its nearest term the memory holds ("puppy", by the table) is searched
    for at a fraction of its weight, in every conversation, as the reference does."""
    add(store, "u1", "c1", ["We cooked pasta for dinner", "The meeting moved to Friday"])
    add(store, "u1", "c2", ["Our family got a puppy and a kitten"])
    uid = store.user_id("u1")
    q = "Where does the dog sleep?"
    hits = scan.Scanner(store, store_rows=0).search(q, uid, 10)
    assert [h.text for h in hits] == ["Our family got a puppy and a kitten"]
    for params in (bm25.Params(), bm25.Params(expand=0.5), bm25.Params(expand=0.0)):
        for store_rows in (0, 10**9):
            sc = scan.Scanner(store, store_rows=store_rows, params=params)
            same(ranked(sc.search(q, uid, 10)), reference(store, q, uid, 10, params=params))
    assert scan.Scanner(store, store_rows=0, params=bm25.Params(expand=0.0)).search(q, uid) == []


def test_a_terms_nearest_are_found_among_the_terms_held_as_they_come() -> None:
    """Table.near looks only among the terms `cover` named (those some row holds), and a term
    held later joins a list made before it: the ids, cosines and order of the list over every
    term, kept to those held, whether the product read a few rows or the whole table."""
    d = dictionary.shipped()
    whole, table = vectors.load(), vectors.load()
    whole.cover(d, None)
    asked = [t for t in d.id_list("dog house music travel doctor happy garden") if t < d.hash_base]
    rng = np.random.default_rng(7)
    few = rng.random(d.hash_base) < 0.05
    most = few | (rng.random(d.hash_base) < 0.6)
    for held in (few, most):
        table.cover(d, held)
        for t in asked:
            ids, cos = whole.near(d, t)
            got_ids, got_cos = table.near(d, t)
            assert got_ids.tolist() == ids[held[ids]].tolist()
            assert got_cos.tolist() == cos[held[ids]].tolist()
    assert any(whole.near(d, t)[0].size for t in asked)


def test_existing_rows_get_their_vectors_when_migrated(tmp_path: Path) -> None:
    s = open_memory(tmp_path / "old.db")
    fill(s, random.Random(3), 60)
    want = stored_vectors(s)
    conn = s.db.translated()
    with s.db.peewee.atomic():  # the database as it was before m019_vectors
        for table in ("retrieval", "retrieval_pending", "retrieval_next"):
            conn.execute(f"ALTER TABLE {table} DROP COLUMN vec")
        conn.execute("DELETE FROM migration WHERE name = 'm019_vectors'")
    s.close()
    s = open_memory(tmp_path / "old.db")
    try:
        assert stored_vectors(s) == want
        uid = s.user_id("u1")
        same(ranked(scan.Scanner(s, store_rows=0).search("garden violin", uid, 10)),
             reference(s, "garden violin", uid, 10))
        assert check(s) == []
    finally:
        s.close()


def test_a_flip_rederives_the_vectors_and_changes_no_heat(store: Store) -> None:
    fill(store, random.Random(9), 80)
    uid = store.user_id("u1")
    heat.advance(store.db, uid, 300)
    scanner = scan.Scanner(store, store_rows=0)
    scanner.search("garden violin", uid, 10)
    conn = store.db.translated()
    # Vectors gone wrong (a table of another release): the flip derives them again.
    conn.execute("UPDATE retrieval SET vec = ?", (bytes(vectors.DIMS),))
    heat_before = conn.execute("SELECT * FROM activation ORDER BY item_id").fetchall()
    births = conn.execute("SELECT item_id, born, half_life FROM retrieval ORDER BY item_id"
                          ).fetchall()
    version = store.db.dictionary.version
    maintenance.rederive(store, version, progress=False)
    maintenance.flip(store, version)
    got = stored_vectors(store)
    assert got.keys() == texts(store).keys()
    assert all(near(got[i], derived(store, t)) for i, t in texts(store).items())
    assert conn.execute("SELECT * FROM activation ORDER BY item_id").fetchall() == heat_before
    assert conn.execute("SELECT item_id, born, half_life FROM retrieval ORDER BY item_id"
                        ).fetchall() == births
    assert heat.clock(store.db, uid) == 300
    same(ranked(scanner.search("garden violin", uid, 10)),
         reference(store, "garden violin", uid, 10))
    assert check(store) == []


def test_a_purge_removes_the_users_vectors(store: Store) -> None:
    alice = add(store, "alice", "a1", ["we hiked up the mountain at dawn"])
    bob = add(store, "bob", "b1", ["a long walk in the hills"])
    scanner = scan.Scanner(store, store_rows=0)
    assert {h.item_id for h in scanner.search("trekking at dawn in the hills", None, 10)} == set(alice + bob)
    maintenance.purge_user(store, "alice")
    assert set(stored_vectors(store)) == set(bob)
    assert [h.item_id for h in scanner.search("trekking at dawn in the hills", None, 10)] == bob
    assert check(store) == []


def test_a_migration_carries_the_vectors(tmp_path: Path, postgres_url: str) -> None:
    path = tmp_path / "memory.db"
    s = open_memory(path)
    fill(s, random.Random(4), 50)
    want = stored_vectors(s)
    uid = s.user_id("u1")
    ranking = reference(s, "concert guitar", uid, 10)
    s.close()
    assert cli.main(["memory", "migrate", "--from", f"sqlite://{path}", "--to", postgres_url,
                     "--quiet"]) == 0
    t = open_memory(postgres_url)
    try:
        assert stored_vectors(t) == want
        same(ranked(scan.Scanner(t, store_rows=0).search("concert guitar", uid, 10)), ranking)
    finally:
        t.close()
