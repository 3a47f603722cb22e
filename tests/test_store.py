"""Store guarantees under concurrency and faults: one write path, nothing lost, ids never
reused, a user purged as a unit, the dictionary swapped as data, and the check that proves it.
Real SQLite files, real second processes."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from perpetuity_core.cli import main as cli
from perpetuity_core.errors import StoreError
from perpetuity_core.memory.derived import heat, index, scan
from perpetuity_core.memory.jobs import maintenance
from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture, dictionary, savings
from perpetuity_core.memory.storage.savings import Saved
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part
from tests.conftest import opened_other, query
from tests.test_retrieval import WORDS, add, fill, ranked, reference, same

ROOT = Path(__file__).resolve().parent.parent


def test_two_processes_writing_one_file_lose_nothing() -> None:
    """scripts/bench_writers.py: two real processes store 400 turns each into one file."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_writers.py"),
                          "--messages", "400"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["failures"] == [0, 0] and r["stored"] == r["expected"] == 800
    assert r["check_violations"] == []


def test_searches_never_fail_while_the_writer_stores_and_purges(store: Store) -> None:
    fill(store, random.Random(3), 200)
    scanner = scan.Scanner(store, store_rows=0)
    uid = store.user_id("u1")
    errors: list[BaseException] = []
    done = threading.Event()

    def search() -> None:
        while not done.is_set():
            try:
                scanner.search("garden violin support", uid, 10)
            except BaseException as e:  # noqa: BLE001 - every failure counts
                errors.append(e)

    reader = threading.Thread(target=search)
    reader.start()
    try:
        for i in range(60):
            items = add(store, "u1", "u1-c0", [f"garden violin {i} | support group"])
            if i % 3 == 0:
                index.purge(store, items[:1])
    finally:
        done.set()
        reader.join()
    assert errors == []
    assert check(store) == []
    # The reader never settled anything: only the writer wrote.
    same(ranked(scanner.search("garden violin support", uid, 10)),
         reference(store, "garden violin support", uid, 10))


def test_ids_are_never_reused(store: Store) -> None:
    items = add(store, "u", "c", ["first", "second | part"])
    newest_message = store.db.translated().execute("SELECT max(id) FROM message").fetchone()[0]
    with opened_other(store.path) as other:  # deleted behind the store's back, newest first
        other.execute("DELETE FROM activation WHERE item_id IN (SELECT id FROM item"
                      " WHERE message_id = ?)", (newest_message,))
        other.execute("DELETE FROM item WHERE message_id = ?", (newest_message,))
        other.execute("DELETE FROM message WHERE id = ?", (newest_message,))
    again = add(store, "u", "c", ["third"])
    assert again[0] > max(items)
    assert store.db.translated().execute("SELECT max(id) FROM message").fetchone()[0] > newest_message
    store.flush()  # the writer settles what was deleted behind its back
    assert check(store) == []


def test_sqlite_errors_become_store_errors_and_the_turn_is_stored_once_space_returns(
        tmp_path: Path) -> None:
    """Disk full, by SQLite's own page limit: the write fails as StoreError (what the proxy
    logs and fails open on); the harness re-sends the history, which is stored exactly once."""
    store = open_memory(tmp_path / "memory.db")
    history = [Message("user", (Part(Kind.TEXT, f"message {i} " + " ".join(WORDS)),))
               if i % 2 == 0 else Message("assistant", (Part(Kind.TEXT, f"reply {i}"),))
               for i in range(40)]

    def record(n: int) -> None:
        capture.record(store, user_key="u", conversation_key="c", provider="anthropic",
                       model="m", messages=history[:n], times=[0.0] * n, source="request")

    record(10)
    conn = store.db.translated()
    (pages,) = conn.execute("PRAGMA page_count").fetchone()
    conn.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(StoreError, match="database or disk is full"):
        record(40)
    conn.execute("PRAGMA max_page_count = 1073741823")
    record(40)
    texts = [t for (t,) in conn.execute("SELECT text FROM item ORDER BY id")]
    assert texts == [m.parts[0].text for m in history]
    assert check(store) == []
    store.close()


def test_purge_removes_a_user_as_a_unit(store: Store) -> None:
    alice = add(store, "alice", "a1", ["garden violin", "violin lessons | on tuesday"])
    bob = add(store, "bob", "b1", ["garden tomatoes", "violin concert"])
    scanner = scan.Scanner(store, store_rows=0)
    bob_id = store.user_id("bob")
    before = ranked(scanner.search("garden violin", None, 10))
    assert set(alice) <= {i for i, _ in before}
    heat.advance(store.db, store.user_id("alice"), 100)
    out = maintenance.purge_user(store, "alice")
    assert (out.messages, out.items) == (2, 3)
    got = ranked(scanner.search("garden violin", None, 10))
    assert {i for i, _ in got} == set(bob)  # the arena caught up on the deletions
    same(got, reference(store, "garden violin", None, 10))
    same(ranked(scanner.search("violin", bob_id, 10)), reference(store, "violin", bob_id, 10))
    conn = store.db.translated()
    for table in ("activation", "clock", "chain"):
        assert conn.execute(f"SELECT count(*) FROM {table} WHERE user_id = ?",
                            (store.user_id("alice"),)).fetchone() == (0,)
    assert check(store) == []
    # Nobody's new rows take the purged ids.
    assert min(add(store, "alice", "a1", ["again"])) > max(alice + bob)


def small_dictionary(path: Path) -> str:
    """Another version: a dictionary built from a few words only."""
    data = dictionary.build({w: 5 for w in WORDS})
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    return data["version"]


def test_a_new_dictionary_is_rederived_dark_and_flipped_in_one_step(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(maintenance, "DROP_BATCH", 40)  # the old tables go in several batches
    monkeypatch.setattr(maintenance, "REDERIVE_PAUSE", 0)
    rng = random.Random(5)
    fill(store, rng, 150)
    uid = store.user_id("u1")
    scanner = scan.Scanner(store, store_rows=0)
    q = "support guitar concert zorblax"
    served = ranked(scanner.search(q, uid, 10))
    version = small_dictionary(tmp_path / "next.json.gz")
    assert maintenance.upload(store, tmp_path / "next.json.gz") == version
    assert maintenance.target(store) == version
    # A re-derivation stopped after its first batch (killed) resumes where it stopped.
    (items,) = store.db.translated().execute(
        "SELECT count(*) FROM item WHERE kind != 'context'").fetchone()
    assert maintenance._rederive_batch(store.db, maintenance._dictionary(store.db, version), 10) == 10
    assert maintenance.rederive(store, version, progress=False) == items - 10
    # Dark: the proxy keeps serving (and storing) on the live version meanwhile.
    new = add(store, "u1", "u1-c0", ["zorblax concert guitar"])
    assert {v for (v,) in store.db.translated().execute("SELECT version FROM retrieval")} == {
        dictionary.shipped().version}
    assert set(new) <= {i for i, _ in ranked(scanner.search(q, uid, 10))}
    assert served  # (answered before the upload)
    # Purged after their rows were staged: the flip takes them out of the staged counts.
    staged = [i for (i,) in store.db.translated().execute("SELECT item_id FROM retrieval_next"
                                                 " ORDER BY item_id LIMIT 7")]
    index.purge(store, staged)
    heat_before = store.db.translated().execute("SELECT * FROM activation ORDER BY item_id").fetchall()
    (old_seq,) = store.db.translated().execute("SELECT max(seq) FROM retrieval").fetchone()
    rows = maintenance.flip(store, version)
    # New seqs: none handed out twice.
    assert store.db.translated().execute("SELECT min(seq) FROM retrieval").fetchone()[0] > old_seq
    if not store.db.postgres:  # the staged structures were swapped in, and nothing is left behind
        assert not store.db.translated().execute(
            "SELECT name FROM sqlite_master WHERE name LIKE '%\\_old' ESCAPE '\\'"
            " OR name LIKE '%staged%'").fetchall()
    assert rows == store.db.translated().execute("SELECT count(*) FROM item WHERE kind != 'context'"
                                           ).fetchone()[0]
    assert store.db.dictionary.version == version
    assert {v for (v,) in store.db.translated().execute("SELECT version FROM retrieval")} == {version}
    got = ranked(scanner.search(q, uid, 10))  # the arena rebuilds on the flip
    same(got, reference(store, q, uid, 10))
    assert set(new) <= {i for i, _ in got}
    # Heat untouched: activations are keyed by item, and no item changed.
    assert store.db.translated().execute(
        "SELECT * FROM activation ORDER BY item_id").fetchall() == heat_before
    assert check(store) == []
    add(store, "u1", "u1-c1", ["written under the new version"])
    assert check(store) == []


def test_a_writer_follows_a_flip_made_by_another_process_with_its_next_message(
        memory_at: Path | str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer derives a message's rows with the dictionary it last followed, inserted only
    while that one is live: after a flip elsewhere its next message is derived again, under
    the new version, and the counts still add up."""
    monkeypatch.setattr(maintenance, "REDERIVE_PAUSE", 0)
    writer = open_memory(memory_at)
    fill(writer, random.Random(6), 30)
    other = open_memory(memory_at)
    version = small_dictionary(tmp_path / "next.json.gz")
    maintenance.upload(other, tmp_path / "next.json.gz")
    maintenance.rederive(other, version, progress=False)
    maintenance.flip(other, version)
    other.close()
    assert writer.db.dictionary.version != version  # not followed yet
    new = add(writer, "u1", "u1-c0", ["zorblax concert guitar", "two rows | of one message"])
    index.sequence(writer.db)
    got = dict(writer.db.translated().execute(
        f"SELECT item_id, version FROM retrieval WHERE item_id IN ({','.join('?' * len(new))})",
        new).fetchall())
    assert writer.db.dictionary.version == version and got == dict.fromkeys(new, version)
    assert check(writer) == []
    writer.close()


def test_a_memory_on_another_dictionary_says_so_on_start(memory_at: Path | str) -> None:
    path = memory_at
    open_memory(path).close()
    with opened_other(path) as conn:
        conn.execute("UPDATE setting SET value = 'v-old' WHERE key = 'dictionary'")
    s = open_memory(path)
    try:
        assert s.notice is not None and "v-old" in s.notice and "rederive" in s.notice
        add(s, "u", "c", ["stored meanwhile"])
        version = maintenance.target(s)
        assert version == dictionary.shipped().version
        maintenance.rederive(s, version, progress=False)
        maintenance.flip(s, version)
        assert check(s) == []
    finally:
        s.close()
    s = open_memory(path)
    s.close()
    assert s.notice is None


def test_memory_check_cli_reports_each_violation(memory_at: Path | str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = memory_at
    s = open_memory(path)
    fill(s, random.Random(9), 40)
    with s.db.peewee.atomic():
        index.sequence_in(s.db, s.db.connection())
        index.fold(s.db, s.db.connection())
    (first,) = s.db.connection().execute("SELECT min(id) FROM item").fetchone()
    assert heat.reheat(s.db, 0.0, {first: 2.0}) == 1  # its first reheat: an activation row
    s.close()
    assert cli.main(["memory", "check", "--db", str(path)]) == 0
    with opened_other(path) as conn:  # break two invariants behind the store's back
        conn.execute("UPDATE activation SET user_id = user_id + 1000")  # a reheat's row
        conn.execute("UPDATE retrieval_term SET df = df + 1 WHERE term ="
                     " (SELECT min(term) FROM retrieval_term)")
    capsys.readouterr()
    assert cli.main(["memory", "check", "--db", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("activations disagreeing with their message: 1")
    assert lines[1].startswith("document frequencies != recount: 1 terms")
    assert cli.main(["memory", "purge", "--user", "u1", "--db", str(path)]) == 0
    assert cli.main(["memory", "purge", "--user", "nobody", "--db", str(path)]) == 1
    assert cli.main(["memory", "dictionary", "list", "--db", str(path)]) == 0
    assert "live" in capsys.readouterr().out


# Another process stores one message and stops, before any batch: its rows are committed but,
# on PostgreSQL, still waiting for their seq (index.sequence).
_OTHER_WRITER = """
import sys
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.wire.conversation import Kind, Message, Part
s = open_memory(sys.argv[1])
uid = s.user_id("u0")
s.add_message(conversation_id=s.conversation_id(uid, "elsewhere", "anthropic"), user_id=uid,
              message=Message("user", (Part(Kind.TEXT, "the quokka is called Wendell"),)),
              provider="anthropic", model="m", at=1.7e9, pair_key="quokka", source="import")
s.close()
"""


@pytest.mark.parametrize("store_rows", [0, 2000])
def test_a_search_finds_a_row_another_process_committed_before_any_batch(
        memory_at: Path | str, store_rows: int) -> None:
    """Through the arena (store_rows 0) and the small-memory path alike."""
    store = open_memory(memory_at)
    fill(store, random.Random(5), 20)
    scanner = scan.Scanner(store, store_rows=store_rows)
    # Caught up before the other writes (rows near in meaning may rank; no quokka yet).
    assert all("quokka" not in h.text for h in scanner.search("quokka Wendell", None, 5))
    subprocess.run([sys.executable, "-c", _OTHER_WRITER, str(memory_at)], cwd=ROOT, check=True,
                   timeout=120)
    hits = scanner.search("quokka Wendell", None, 5)
    assert [h.text for h in hits][:1] == ["the quokka is called Wendell"]
    store.close()


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_writing_at_once_lose_nothing_and_an_arena_follows_them(
        memory_at: Path | str, processes: int) -> None:
    """scripts/bench_writers.py's processes write at once (turns, clock moves and reheats of
    one shared row) while this process's arena catches up again and again: nothing lost, the
    clock the sum of every move, the row's peak the highest written, and the arena the same
    as one built afresh afterwards (no committed row missed, none read twice)."""
    store = open_memory(memory_at)
    scanner = scan.Scanner(store, store_rows=0)
    bench = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_writers.py"),
                              "--db", str(memory_at), "--processes", str(processes),
                              "--messages", "150"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    catch_ups = 0
    while bench.poll() is None:
        scanner.catch_up()
        catch_ups += 1
    r = json.loads(bench.communicate(timeout=600)[0])
    assert r["failures"] == [0] * processes and r["stored"] == r["expected"] == processes * 150
    assert (r["clock"], r["peak"]) == (r["expected_clock"], r["expected_peak"])
    assert r["check_violations"] == []
    scanner.catch_up()
    fresh = scan.Scanner(store, store_rows=0)
    fresh.catch_up()
    assert catch_ups > 1
    assert scanner.arena.n_rows == fresh.arena.n_rows == processes * 150 + 1
    assert np.array_equal(scanner.arena.seq, fresh.arena.seq)
    store.close()


def test_a_sqlite_memory_migrates_to_postgresql_and_checks_on_both_sides(
        tmp_path: Path, postgres_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "memory.db"
    s = open_memory(path)
    fill(s, random.Random(41), 300)  # past BATCH_ROWS and a fold: cursors and counts copied
    index.purge(s, add(s, "u1", "u1-c0", ["purged before the copy"]))
    add(s, "u1", "u1-c0", ["unsettled | stored after the purge"])
    heat.advance(s.db, s.user_id("u1"), 500)
    tallied = Saved(calls=2, priced=2, direct_cost=10.0, sent_cost=4.0, direct_usd=0.5)
    savings.add(s.db, "2026-12-06", "anthropic", "claude-sonnet-4-6", tallied)
    salt = s.salt
    uid = s.user_id("u1")
    q = "garden violin support"
    want = reference(s, q, uid, 10)
    s.close()
    url = postgres_url
    assert cli.main(["memory", "migrate", "--from", f"sqlite://{path}", "--to", url,
                     "--quiet"]) == 0
    assert cli.main(["memory", "check", "--db", str(path)]) == 0
    assert cli.main(["memory", "check", "--db", url]) == 0
    assert "every invariant holds" in capsys.readouterr().err
    t = open_memory(url)
    try:
        assert t.salt == salt and t.user_id("u1") == uid and heat.clock(t.db, uid) == 500
        assert savings.by_day(t.db.translated()) == [("2026-12-06", tallied)]  # the tally too
        same(ranked(scan.Scanner(t, store_rows=0).search(q, uid, 10)), want)
        new = add(t, "u1", "u1-c0", ["written after the move"])
        assert min(new) > max(i for i, _ in want) and check(t) == []
    finally:
        t.close()
    # Into a memory that is not empty: refused, nothing written.
    assert cli.main(["memory", "migrate", "--from", str(path), "--to", url, "--quiet"]) == 1
    assert "already holds a memory" in capsys.readouterr().err


def test_a_turn_said_late_in_a_second_keeps_its_whole_second_through_a_flip(
        store: Store) -> None:
    """Retrieval rows keep whole seconds, truncated (int()); PostgreSQL's cast rounds, so the
    flip's and the check's SQL truncate there too."""
    add(store, "u", "c", ["said at three quarters past"], at=1_700_000_000.75)
    assert check(store) == []
    version = store.db.dictionary.version
    maintenance.rederive(store, version, progress=False)
    maintenance.flip(store, version)
    assert store.db.translated().execute("SELECT at FROM retrieval").fetchall() == [(1_700_000_000,)]
    assert check(store) == []



def test_memory_check_reports_a_message_of_a_history_stored_twice(store: Store) -> None:
    """Issue 20: a message of the harness's history stored twice, at the same place of the
    same conversation with the same content, is a violation: as the old capture stored a turn
    sent again after its unanswered copy (keyed as following itself), or twice under one pair
    key. The same words said again later, after a reply, are not."""
    def m(role: str, text: str) -> Message:
        return Message(role, (Part(Kind.TEXT, text),))

    history = [m("user", "again"), m("assistant", "Done."), m("user", "again")]
    capture.record(store, user_key="u", conversation_key="c", provider="anthropic", model="m",
                   messages=history, times=[1.0] * 3, source="request")
    assert check(store) == []
    uid = store.user_id("u")
    cid = store.conversation_id(uid, "c", "anthropic")
    again = history[2]

    def stored_with(key: str) -> int:
        return store.add_message(conversation_id=cid, user_id=uid, message=again,
                                 provider="anthropic", model="m", at=2.0, pair_key=key,
                                 source="request").message_id

    after_itself = stored_with(capture.pair_key(again.fingerprint(), again))
    same_place = stored_with(capture.pair_key(history[1].fingerprint(), again))
    assert check(store) == [f"messages of a harness's history stored twice (same conversation,"
                            f" same place, same content): 2 ({after_itself}, {same_place})"]


def _three_users(memory_at: Path | str) -> list[str]:
    """Two tenants' users, one name shared (key-<hash>/<name>, as identity stores them)."""
    s = open_memory(memory_at)
    try:
        for key, text in (("key-aaa/store-user", "the harbour lantern"),
                          ("key-aaa/shared", "copper meadow"), ("key-bbb/shared", "copper orbit")):
            capture.record(s, user_key=key, conversation_key="c", provider="anthropic",
                           model="m", messages=[Message("user", (Part(Kind.TEXT, text),))],
                           times=[1_700_000_000.0], source="request")
    finally:
        s.close()
    return ["--db", str(memory_at)]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_purge_and_search_take_the_name_the_harness_sent(memory_at: Path | str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20: `memory purge` and `search` take the name the harness sent (x-perpetuity-user,
    stored after the tenant) when one user has it; a name several tenants' users share is
    answered in one line with their full keys, and nothing changes."""
    at = _three_users(memory_at)
    code, out, _ = _run(capsys, "memory", "search", "lantern", "--user", "store-user", "--json",
                        *at)
    assert code == 0 and [h["text"] for h in json.loads(out)["hits"]] == ["the harbour lantern"]
    for verb in (("memory", "search", "copper"), ("memory", "purge")):
        code, _, err = _run(capsys, *verb, "--user", "shared", *at)
        assert code == 1
        assert err.splitlines() == ["perpetuity: 'shared' is the name of 2 users, one per tenant:"
                                    " key-aaa/shared, key-bbb/shared; give the full key of one"]
    code, _, err = _run(capsys, "memory", "purge", "--user", "nobody", *at)
    assert code == 1 and "memory users" in err
    assert query(memory_at, "SELECT count(*) FROM message")[0][0] == 3  # nothing purged yet
    code, _, err = _run(capsys, "memory", "purge", "--user", "store-user", *at)
    assert code == 0 and err.startswith("purged key-aaa/store-user: 1 message, 1 row")
    assert _run(capsys, "memory", "purge", "--user", "key-bbb/shared", *at)[0] == 0
    assert query(memory_at, "SELECT count(*) FROM message")[0][0] == 1


def test_memory_users_lists_every_user_with_their_counts(memory_at: Path | str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 20: `memory stats` gave counts but no users; `memory users` lists each with tenant,
    conversations, messages, tokens and last seen."""
    at = _three_users(memory_at)
    code, out, _ = _run(capsys, "memory", "users", *at)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["key", "tenant", "conversations", "messages", "tokens", "last",
                                "seen"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {"key-aaa/store-user", "key-aaa/shared", "key-bbb/shared"}
    assert rows["key-aaa/store-user"][1:4] == ["key-aaa", "1", "1"]
    assert int(rows["key-aaa/store-user"][4]) > 0 and rows["key-aaa/store-user"][5] == "2023-11-14"
    code, out, _ = _run(capsys, "memory", "users", "--json", *at)
    listed = {u["key"]: u for u in map(json.loads, out.splitlines())}
    assert listed["key-bbb/shared"]["tenant"] == "key-bbb"
    assert listed["key-bbb/shared"]["last_seen"] == 1_700_000_000.0
