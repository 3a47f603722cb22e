"""The recall tools on a real store: each tool's rows, deduplication within a turn, paging,
exact counts against a brute-force count, chains in time order, elapsed times, argument errors,
and one user's rows never reaching another."""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perpetuity_core.errors import StoreError
from perpetuity_core.frame import cap
from perpetuity_core.memory.derived import bindings, chains, index
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture, names
from perpetuity_core.memory.storage.store import Database, Store
from perpetuity_core.recall import answers, queries, tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.recall.tools import run
from perpetuity_core.wire.conversation import Message, text_part

T0 = 1_700_000_000.0
DAY = 86_400.0
ASKED = T0 + 40 * DAY
LABEL = re.compile(r"\[#(\d+) · ([^·\]]+) · (\w+) · (\d{4}-\d\d-\d\d \d\d:\d\d) UTC")


def say(store: Store, conversation: str, turns: list[tuple[float, str]], user: str = "u") -> None:
    """Store alternating user/assistant turns said at the given times."""
    msgs = [Message("user" if i % 2 == 0 else "assistant", (text_part(t),))
            for i, (_, t) in enumerate(turns)]
    capture.record(store, user_key=user, conversation_key=conversation, provider="anthropic",
                   model="m", messages=msgs, times=[at for at, _ in turns], source="import")


def item(store: Store, text: str) -> int:
    (i,) = store.db.translated().execute("SELECT id FROM item WHERE text = ?", (text,)).fetchone()
    return i


def message_of(store: Store, text: str) -> int:
    (m,) = store.db.translated().execute("SELECT message_id FROM item WHERE text = ?", (text,)).fetchone()
    return m


def number(store: Store, key: str) -> str:
    """How the tools' answers number the conversation stored as `key` (what a filter takes)."""
    (c,) = store.db.translated().execute("SELECT id FROM conversation WHERE key = ?", (key,)).fetchone()
    return f"c{c}"


def ids(out: str) -> list[int]:
    return [int(m.group(1)) for m in LABEL.finditer(out)]


def rows_of(out: str) -> list[int]:
    """The ids of every row line, stubs included, in order."""
    return [int(x) for x in re.findall(r"^\[#(\d+)", out, re.MULTILINE)]


def user_items(store: Store, user: str) -> set[int]:
    return {i for (i,) in store.db.translated().execute(
        "SELECT i.id FROM item i JOIN message m ON m.id = i.message_id JOIN user u"
        " ON u.id = m.user_id WHERE u.key = ?", (user,))}


HIKE = "We went hiking near Oslo with my sister Ada."
OSLO = "Sounds lovely, Oslo has great trails."
BLUE = "My favourite colour is blue."
REX = "Our dog Rex loves hiking too."
GREEN = "Update: my favourite colour is green now."
RED = "Back then my favourite colour was red."
PURPLE = "I love hiking near Oslo, my favourite colour is purple."


@pytest.fixture
def memory(store: Store) -> Store:
    say(store, "trip", [(T0, HIKE), (T0 + 60, OSLO), (T0 + 3 * DAY, BLUE),
                        (T0 + 3 * DAY + 60, "Blue, noted.")])
    say(store, "pets", [(T0 + 10 * DAY, REX), (T0 + 10 * DAY + 60, "Rex sounds fun."),
                        (T0 + 33 * DAY, GREEN), (T0 + 33 * DAY + 60, "Green it is.")])
    # Stored last, said first: chains and timelines follow when things were said.
    say(store, "old", [(T0 - 5 * DAY, RED), (T0 - 5 * DAY + 60, "Red, noted.")])
    say(store, "trip", [(T0 + DAY, PURPLE), (T0 + DAY + 60, "Purple is nice.")], user="v")
    return store


def turn(store: Store, conversation: str | None = "trip", shown: set[int] | None = None,
         below_cap: list[int] | None = None) -> TurnMemory:
    uid = store.find_user("u")
    assert uid is not None
    conv = store.find_conversation(uid, conversation) if conversation else None
    return TurnMemory(uid, conv, ASKED, set(shown or ()), list(below_cap or ()))


def test_search_never_gives_back_what_the_request_carries_as_sent(memory: Store) -> None:
    """The live history kept in front of the model is shown: its rows are never an answer."""
    scanner = Scanner(memory)
    alone = run("memory_search", {"query": "hiking Oslo"}, turn(memory), scanner)
    assert {item(memory, HIKE), item(memory, OSLO)} <= set(ids(alone))
    m = turn(memory)
    m.sent = [Message("user", (text_part(HIKE),)), Message("assistant", (text_part(OSLO),))]
    out = run("memory_search", {"query": "hiking Oslo"}, m, scanner)
    assert not {item(memory, HIKE), item(memory, OSLO)} & set(ids(out))
    assert {item(memory, HIKE), item(memory, OSLO)} <= m.shown and not m.sent


def test_search_names_each_conversation_once(memory: Store) -> None:
    out = run("memory_search", {"query": "favourite colour blue noted"}, turn(memory, None),
              Scanner(memory))
    trip = number(memory, "trip")
    labels = [lab for lab in LABEL.findall(out) if lab[1].split(" ", 1)[0] == trip]
    assert len(labels) >= 2  # BLUE and the reply to it, both of "trip"
    assert sum(1 for lab in labels if '"' in lab[1]) == 1 and '"' in labels[0][1]


def test_six_tools_with_schemas_and_instructions() -> None:
    names = {"memory_search", "memory_more", "memory_cooccur", "memory_count", "memory_chains",
             "memory_dates"}
    assert names == tools.TOOL_NAMES
    for t in tools.TOOLS:
        assert t.input_schema["type"] == "object"
        assert set(t.input_schema["required"]) <= set(t.input_schema["properties"])
        assert t.name in tools.INSTRUCTIONS


def test_the_definitions_are_read_on_every_call_so_kept_short() -> None:
    """Our tools ride along with every call of a conversation: 1,029 tokens at h-cost4, the
    search's row format (its answer shows it) and repeated words since cut."""
    spec = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
            for t in tools.TOOLS]
    assert token_estimate(json.dumps(spec)) <= 1_010


@pytest.mark.parametrize("store_rows", [2000, 0])  # scored from the store, and from the arena
def test_search_labels_rows_and_never_repeats_within_a_turn(memory: Store, store_rows: int) -> None:
    scanner = Scanner(memory, store_rows=store_rows)
    m = turn(memory, shown={item(memory, HIKE)})  # the frame showed this one
    first = run("memory_search", {"query": "hiking Oslo", "limit": 2}, m, scanner)
    got = ids(first)  # two matches, each with the other half of its exchange
    assert 2 <= len(got) <= 4 and item(memory, HIKE) not in got
    assert item(memory, OSLO) in got
    # The conversation by its number and its first prompt's opening words, never its key.
    named = f'{number(memory, "trip")} "{names.opening_words(HIKE)}"'
    assert f"[#{item(memory, OSLO)} · {named} · assistant · 2023-11-14 22:14 UTC] {OSLO}" in first
    second = run("memory_search", {"query": "hiking Oslo", "limit": 2}, m, scanner)
    assert not set(ids(second)) & set(got) and not set(ids(second)) & {item(memory, HIKE)}
    assert m.shown == {item(memory, HIKE), *got, *ids(second)}
    assert set(m.shown) <= user_items(memory, "u")
    # Exhausted: nothing is ever shown twice.
    while ids(out := run("memory_search", {"query": "hiking Oslo"}, m, scanner)):
        assert not set(ids(out)) & (m.shown - set(ids(out)))
    assert "nothing you have not seen" in out


def test_search_filters(memory: Store) -> None:
    scanner = Scanner(memory)
    out = run("memory_search", {"query": "favourite colour", "role": "user"}, turn(memory), scanner)
    # Rows that hold the words first; rows beside them follow on their context's score.
    assert set(ids(out)[:3]) == {item(memory, BLUE), item(memory, GREEN), item(memory, RED)}
    assert {m.group(3) for m in LABEL.finditer(out)} == {"user"}
    out = run("memory_search", {"query": "favourite colour", "conversation": number(memory, "pets")},
              turn(memory), scanner)
    assert item(memory, GREEN) in ids(out)
    assert {m.group(2).split()[0] for m in LABEL.finditer(out)} == {number(memory, "pets")}
    out = run("memory_search", {"query": "favourite colour", "conversation": "current"},
              turn(memory, "old"), scanner)
    assert {m.group(2).split()[0] for m in LABEL.finditer(out)} == {number(memory, "old")}
    out = run("memory_search", {"query": "favourite colour", "after": "2023-11-14",
                                "before": "2023-12-01", "role": "user"}, turn(memory), scanner)
    got = ids(out)
    assert got[0] == item(memory, BLUE) and not {item(memory, GREEN), item(memory, RED)} & set(got)


def test_a_time_span_is_searched_whole_however_many_better_rows_lie_outside_it(
        memory: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queries, "MAX_SCAN", 8)
    say(memory, "log", [(T0 + (30 + i) * DAY, f"lighthouse keeper lamp number {i}") for i in range(20)]
        + [(T0 + 60 * DAY, "we passed a lighthouse on the way home")])
    day = datetime.fromtimestamp(T0 + 60 * DAY, UTC).date().isoformat()
    out = run("memory_search", {"query": "lighthouse keeper", "after": day}, turn(memory),
              Scanner(memory))
    assert "we passed a lighthouse" in out


def test_more_pages_through_below_cap_then_continues_a_cut_row(memory: Store) -> None:
    scanner = Scanner(memory)
    ranked = [item(memory, GREEN), item(memory, BLUE), item(memory, PURPLE), item(memory, RED), item(memory, REX), item(memory, OSLO)]
    m = turn(memory, shown={item(memory, BLUE)}, below_cap=ranked)
    page = run("memory_more", {"limit": 2}, m, scanner)
    assert ids(page) == [item(memory, GREEN), item(memory, RED)]  # BLUE was shown, PURPLE is not u's
    assert "page 1 of 2" in page
    assert ids(run("memory_more", {"limit": 2}, m, scanner)) == [item(memory, REX), item(memory, OSLO)]
    assert "nothing" in run("memory_more", {}, m, scanner)

    long = " ".join(f"word{i} about the lighthouse" for i in range(600))
    say(memory, "notes", [(T0 + 20 * DAY, long)])
    m = turn(memory)
    out = run("memory_search", {"query": "lighthouse"}, m, scanner)
    cut = re.search(r"memory_more\(item=(\d+), offset=(\d+)\)", out)
    assert cut and int(cut.group(1)) == item(memory, long) and len(out) <= answers.RESULT_CHARS
    offset = int(cut.group(2))
    assert long[:offset] in out and long[offset:offset + 50] not in out
    rest = run("memory_more", {"item": item(memory, long), "offset": offset}, m, scanner)
    assert rest.splitlines()[1].startswith(long[offset:offset + 200])


def test_answers_stay_within_the_size_cap_and_the_rest_comes_next(store: Store) -> None:
    say(store, "log", [(T0 + k * 60, f"lighthouse report {k}: " + "beam " * 600)
                       for k in range(25)])
    scanner, m = Scanner(store), turn(store, None)
    first = run("memory_search", {"query": "lighthouse", "limit": 50}, m, scanner)
    assert token_estimate(first) <= answers.ANSWER_CAP.ceiling and "left out for size" in first
    second = run("memory_search", {"query": "lighthouse", "limit": 50}, m, scanner)
    assert ids(second) and not set(ids(first)) & set(ids(second))


def test_count_is_exact_against_a_brute_force_count(store: Store) -> None:
    rng = random.Random(7)
    words = ["apple", "apples", "pie", "baked", "garden", "ladder", "river", "cloud", "stone"]
    for c in range(3):
        turns = [(T0 + rng.randrange(30) * DAY + k, " ".join(rng.choices(words, k=5)))
                 for k in range(40)]
        say(store, f"c{c}", sorted(turns))
    say(store, "c0", [(T0, "apple pie apple pie")], user="v")
    scanner = Scanner(store)
    d = store.db.dictionary
    rows = store.db.translated().execute(
        "SELECT i.text, m.at, c.key FROM item i JOIN message m ON m.id = i.message_id"
        " JOIN conversation c ON c.id = m.conversation_id JOIN user u ON u.id = m.user_id"
        " WHERE u.key = 'u'").fetchall()
    for category, match, conversation in (("apple pie", "all", None), ("apple pie", "any", None),
                                          ("baked apples", "all", "c1"), ("ladder", "all", None)):
        want = set(d.ids(category).tolist())
        hits = [(at, key) for text, at, key in rows
                if (conversation is None or key == conversation)
                and (want <= set(d.ids(text).tolist()) if match == "all"
                     else want & set(d.ids(text).tolist()))]
        args = {"category": category, "match": match, "limit": 200}
        if conversation:
            args["conversation"] = number(store, conversation)
        out = run("memory_count", args, turn(store, None), scanner)
        assert f": {len(hits)} rows," in out.splitlines()[0], out
        days = Counter(datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d")
                       for at, _ in hits)
        by_date = next(ln for ln in out.splitlines() if ln.startswith("by date: "))
        assert by_date == "by date: " + ", ".join(f"{k} {n}" for k, n in sorted(days.items()))
        by_conv = next(ln for ln in out.splitlines() if ln.startswith("by conversation: "))
        for key, n in Counter(k for _, k in hits).items():
            assert re.search(rf'{number(store, key)} "[^"]*" {n} \(', by_conv), by_conv
        assert len(re.findall(r"^#\d+ ", out, re.MULTILINE)) == len(hits)  # every instance listed
    listed = run("memory_count", {"category": "apple", "limit": 3}, turn(store, None), scanner)
    assert len(re.findall(r"^#\d+ ", listed, re.MULTILINE)) == 3
    assert "more instances not listed" in listed
    # A long instance is quoted around the word that made it count.
    long = "filler words " * 40 + "then the apple pie"
    assert answers.snippet(long, ["appl"]).endswith("then the apple pie")
    assert len(answers.snippet(long, ["appl"])) <= answers.SNIPPET_CHARS + 2


def test_chains_follow_a_fact_to_its_latest_state_in_time_order(memory: Store) -> None:
    scanner = Scanner(memory)
    m = turn(memory, shown={item(memory, BLUE)})
    out = run("memory_chains", {"subject": "favourite colour"}, m, scanner)
    lines = out.splitlines()
    assert "3 rows about" in lines[0] and "latest state last" in lines[0]
    # Said in that order, whatever the storing order.
    assert rows_of(out) == [item(memory, RED), item(memory, BLUE), item(memory, GREEN)]
    assert lines[-1].endswith(GREEN) or GREEN in lines[-2]
    assert f"#{item(memory, BLUE)}" in out and f"{BLUE}" not in out  # already shown: a stub
    assert "+30 days" in out  # from blue to green
    assert PURPLE not in out
    assert item(memory, GREEN) in m.shown and item(memory, RED) in m.shown

    page = run("memory_chains", {"subject": "favourite colour", "limit": 2}, turn(memory), scanner)
    assert rows_of(page) == [item(memory, BLUE), item(memory, GREEN)]
    assert "1 earlier row: memory_chains page=2" in page
    older = run("memory_chains", {"subject": "favourite colour", "limit": 2, "page": 2},
                turn(memory), scanner)
    assert rows_of(older) == [item(memory, RED)]
    assert "no distinctive word" in run("memory_chains", {"subject": "the time"}, m, scanner)


def all_chains(store: Store) -> list[tuple]:
    return store.db.translated().execute(
        "SELECT * FROM chain ORDER BY user_id, term, at, item_id").fetchall()


def backfilled(store: Store) -> list[tuple]:
    """The chains every stored text row should have, derived from scratch (then put back)."""
    conn = store.db.translated()
    with store.db.peewee.atomic() as tx:
        conn.execute("DELETE FROM chain")
        chains.backfill_chains(store.db, store.db.connection())
        out = all_chains(store)
        tx.rollback()
    return out


def chain_answer(store: Store, subject: str, user: str = "u") -> list[int]:
    uid = store.find_user(user)
    assert uid is not None
    return rows_of(run("memory_chains", {"subject": subject},
                       TurnMemory(uid, None, ASKED, set(), []), Scanner(store)))


def test_chains_are_written_in_batches_and_backfill_gives_the_same(memory: Store) -> None:
    # Fewer rows than a batch: nothing is in the table yet, and memory_chains sees every row.
    assert all_chains(memory) == []
    assert chain_answer(memory, "favourite colour") == [item(memory, RED), item(memory, BLUE), item(memory, GREEN)]
    memory.flush()
    before = all_chains(memory)
    assert ("oslo" in {t for _, t, _, _ in before}) and len(before) > 10
    assert before == backfilled(memory)
    assert chain_answer(memory, "favourite colour") == [item(memory, RED), item(memory, BLUE), item(memory, GREEN)]
    # A purged row leaves its chains (and the binding log) with it.
    conn = memory.db.translated()
    bindings.record_bindings(memory.db, message_of(memory, GREEN), [item(memory, BLUE)])
    index.purge(memory, [item(memory, GREEN)])
    assert not conn.execute("SELECT 1 FROM chain WHERE item_id NOT IN (SELECT id FROM item)"
                            " UNION ALL SELECT 1 FROM binding WHERE item_id NOT IN"
                            " (SELECT id FROM item)").fetchall()
    out = run("memory_chains", {"subject": "favourite colour"}, turn(memory), Scanner(memory))
    assert "2 rows about" in out and GREEN not in out


def test_a_reader_on_its_own_thread_sees_the_chains_of_a_row_stored_just_before(
        store: Store) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # The proxy's recall tools run on another thread (their own connection) than its writer.
    with ThreadPoolExecutor(1) as reader:
        for i in range(5):
            say(store, "c", [(T0 + i, f"The kayak number {i} is orange.")])
            got = reader.submit(chain_answer, store, "kayak").result()
            assert got == [item(store, f"The kayak number {k} is orange.") for k in range(i + 1)]
        reader.submit(store.db.peewee.close).result()
    assert all_chains(store) == []  # all of it from the pending rows: no batch was written yet


def test_no_chain_is_lost_across_batches_a_crash_and_a_purged_newest_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from perpetuity_core.memory.storage import store as store_module

    monkeypatch.setattr(store_module, "BATCH_ROWS", 3)
    rng = random.Random(7)
    words = ["oslo", "hiking", "colour", "violin", "garden", "tomato", "sister", "kayak"]
    texts = [" ".join(rng.choices(words, k=5)) + f" note{i}" for i in range(20)]
    s = open_memory(tmp_path / "m.db")
    say(s, "a", [(T0 + i, t) for i, t in enumerate(texts[:8])])
    (cursor,) = s.db.translated().execute("SELECT seq FROM derived").fetchone()
    assert 0 < cursor < 8  # batches were written, the last rows are still pending
    want = chain_answer(s, "violin garden")
    # The disk fails mid-batch: the batch leaves no chain and no cursor behind.
    def failing(db: Database, after: int, upto: int) -> None:
        chains.derive_chains(db, after, upto)
        assert all_chains(s)
        raise sqlite3.OperationalError("disk I/O error")  # what raw SQL raises, not peewee's

    s.batched["chain"] = failing
    with pytest.raises(StoreError):
        s.flush()
    assert all_chains(s) and len(all_chains(s)) < len(backfilled(s))
    assert s.db.translated().execute("SELECT seq FROM derived").fetchone() == (cursor,)
    s.close()
    s = open_memory(tmp_path / "m.db")
    try:
        assert chain_answer(s, "violin garden") == want  # read before any batch is written
        say(s, "a", [(T0 + i, t) for i, t in enumerate(texts)])  # the rest of the thread
        # The newest row is purged after its batch; its item id is never given out again.
        s.flush()
        last = max(item(s, t) for t in texts)
        index.purge(s, [last])
        say(s, "b", [(T0 + 99, "violin garden again")])
        assert item(s, "violin garden again") == last + 1
        assert chain_answer(s, "violin garden")[-1] == last + 1
        s.flush()
        assert all_chains(s) == backfilled(s) and last not in {r[3] for r in all_chains(s)}
    finally:
        s.close()


def test_dates_give_elapsed_times_between_events(memory: Store) -> None:
    out = run("memory_dates", {"query": "hiking"}, turn(memory), Scanner(memory))
    assert ids(out) == [item(memory, HIKE), item(memory, REX)]
    head = out.splitlines()[0]
    assert "first to last 10 days" in head and "the latest 30 days" in head
    assert "+10 days" in out.splitlines()[2]
    assert answers.span(90) == "1 minute" and answers.span(3 * DAY + 7200) == "3 days 2 hours"
    assert answers.span(400 * DAY).startswith("400 days (about 1.1 years)")


def test_cooccur_reads_the_binding_log(memory: Store) -> None:
    scanner = Scanner(memory)
    m = turn(memory)
    assert "not come up in a recorded turn" in run("memory_cooccur", {"topic": "Rex"}, m, scanner)
    # A turn about Rex retrieved the hiking rows; another turn about colours.
    assert bindings.record_bindings(memory.db, message_of(memory, "Rex sounds fun."),
                                 [item(memory, REX), item(memory, HIKE), item(memory, OSLO), item(memory, PURPLE)]) == 4
    bindings.record_bindings(memory.db, message_of(memory, GREEN), [item(memory, BLUE), item(memory, RED)])
    out = run("memory_cooccur", {"topic": "Rex"}, m, scanner)
    got = ids(out)
    assert set(got) == {item(memory, HIKE), item(memory, OSLO)}  # Rex's own rows are the topic, not its company
    assert "oslo (2)" in out and "rex" not in out.splitlines()[1]
    again = run("memory_cooccur", {"topic": "Rex"}, m, scanner)
    assert not ids(again) and "has been shown" in again


def test_bad_arguments_give_an_error_text(memory: Store) -> None:
    scanner = Scanner(memory)
    m = turn(memory)
    cases: list[tuple[str, Any, str]] = [
        ("memory_search", "{not json", "not valid JSON"),
        ("memory_search", {}, "'query' is required"),
        ("memory_search", {"query": "  "}, "'query' is required"),
        ("memory_search", {"query": 5}, "must be a string"),
        ("memory_search", {"query": "x", "limit": 0}, "between 1 and 50"),
        ("memory_search", {"query": "x", "limit": "many"}, "whole number"),
        ("memory_search", {"query": "x", "bogus": 1}, "unknown argument 'bogus'"),
        ("memory_search", {"query": "x", "after": "yesterday"}, "ISO date"),
        ("memory_search", {"query": "x", "conversation": "nope"}, "no conversation 'nope'"),
        ("memory_search", {"query": "x", "role": "robot"}, "one of user, assistant, tool"),
        ("memory_count", {"category": "the and of"}, "no searchable word"),
        ("memory_more", [1, 2], "JSON object"),
        ("memory_forget", {}, "Unknown tool"),
    ]
    for name, args, says in cases:
        out = run(name, args, m, scanner)
        assert says in out and "\n" not in out, (name, args, out)
    assert m.shown == set()
    got = ids(run("memory_search", '{"query": "Rex", "limit": "1"}', m, scanner))
    # One match, with the other half of its exchange.
    assert got and set(got) <= {item(memory, REX), item(memory, "Rex sounds fun.")}
    assert "failed" in run("memory_search", {"query": "x"}, m, None)  # type: ignore[arg-type]


def test_another_users_rows_never_appear(memory: Store) -> None:
    scanner = Scanner(memory, share_pool=True)  # even from a pooled scanner
    theirs = user_items(memory, "v")
    m = turn(memory, below_cap=sorted(theirs))
    for name, args in (("memory_search", {"query": "purple hiking Oslo", "limit": 50}),
                       ("memory_dates", {"query": "purple"}),
                       ("memory_chains", {"subject": "purple"}),
                       ("memory_count", {"category": "purple"}),
                       ("memory_more", {}),
                       ("memory_more", {"item": item(memory, PURPLE)})):
        out = run(name, args, m, scanner)
        assert not set(ids(out)) & theirs and PURPLE not in out, out
    assert ": 0 rows." in run("memory_count", {"category": "purple"}, m, scanner)
    assert not m.shown & theirs


def test_a_memory_stored_before_chains_gets_them_when_migrated(tmp_path: Path) -> None:
    s = open_memory(tmp_path / "old.db")
    say(s, "trip", [(T0, HIKE), (T0 + 60, OSLO)])
    s.flush()
    conn = s.db.translated()
    chained = conn.execute("SELECT * FROM chain ORDER BY term, item_id").fetchall()
    with s.db.peewee.atomic():  # the database as it was before m004_recall
        conn.execute("DROP TABLE chain")
        conn.execute("DROP TABLE binding")
        conn.execute("DELETE FROM migration WHERE name = 'm004_recall'")
    s.close()
    s = open_memory(tmp_path / "old.db")
    try:
        assert s.db.translated().execute(
            "SELECT * FROM chain ORDER BY term, item_id").fetchall() == chained
    finally:
        s.close()


def test_a_search_answer_stays_within_the_budget_its_scores_spread_sets(store: Store) -> None:
    """Many equally good matches: the ceiling, rows whole; one clear match: about the floor."""
    say(store, "log", [(T0 + k * 60, f"lighthouse report {k}: " + "beam " * 60) for k in range(40)]
        + [(T0 + DAY, "the albatross circled the mast once")])
    scanner, m = Scanner(store), turn(store, None)
    out = run("memory_search", {"query": "lighthouse"}, m, scanner)
    hits = scanner.search("lighthouse", m.user_id, limit=50)
    budget = cap.budget(np.asarray([h.score for h in hits]), answers.ANSWER_CAP)
    assert budget == answers.ANSWER_CAP.ceiling
    assert token_estimate(out) <= budget and "left out for size" in out
    assert all(f"] lighthouse report {k}: " + "beam " * 59 + "beam" in out
               for k in range(40) if f"] lighthouse report {k}:" in out)  # whole rows
    narrow = run("memory_search", {"query": "albatross"}, turn(store, None), scanner)
    assert "albatross circled" in narrow
    assert token_estimate(narrow) <= answers.ANSWER_CAP.floor


def test_a_search_never_repeats_a_row_the_frame_showed_but_gives_its_other_half(
        memory: Store) -> None:
    m = turn(memory, shown={item(memory, HIKE), item(memory, BLUE)})
    out = run("memory_search", {"query": "hiking Oslo sister"}, m, Scanner(memory))
    assert item(memory, HIKE) not in rows_of(out) and HIKE not in out
    assert item(memory, OSLO) in ids(out)  # the reply to the row the frame showed
    assert item(memory, BLUE) not in rows_of(out)
