"""The rendered frame: heat arithmetic, the cap, validity on every harness capture, and a real
SDK conversation whose second request upstream carries a frame instead of the history."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from perpetuity_core.frame import build as frame
from perpetuity_core.frame import cap
from perpetuity_core.frame import lean as frame_lean
from perpetuity_core.frame import read as frame_read
from perpetuity_core.frame import render as frame_render
from perpetuity_core.frame import select as frame_select
from perpetuity_core.frame import stretch as frame_stretch
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.bm25 import Params
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.reads import Row, adjacent_pairs, around, shown_rows
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import (
    Kind,
    Message,
    Protocol,
    Provider,
    Reply,
    Usage,
    text_part,
)
from perpetuity_core.wire.protocols import ADAPTERS
from tests.conftest import SHARED, Proxy, needs_fixtures, opened, opened_other, owned, query
from tests.fake_provider import FakeProvider, Text
from tests.test_fixtures import http_fixtures, replay, to_request
from tests.validity import CHECKS


def prefixes_of(measure: Callable[[list[int]], int]
                ) -> Callable[[list[int], list[int]], Callable[[int], int]]:
    """A fill's measure of prefixes (base, added) -> k -> tokens, from a measure of rows."""
    return lambda base, added: lambda k: measure(base + added[:k])


def say(store: Store, conversation: str, *texts: str, user: str = "u") -> list[int]:
    """Store alternating user/assistant turns; returns their message ids."""
    msgs = [Message("user" if i % 2 == 0 else "assistant", (text_part(t),))
            for i, t in enumerate(texts)]
    ids, _ = capture.record(store, user_key=user, conversation_key=conversation,
                            provider="anthropic", model="m", messages=msgs,
                            times=[1_700_000_000.0 + i * 60 for i in range(len(msgs))],
                            source="import")
    return ids


def activation(store: Store) -> list[tuple]:
    """Every row's (item id, at, peak, half-life): its activation, or the birth it overrides."""
    conn = store.db.connection()
    ids = [i for (i,) in conn.execute("SELECT id FROM item ORDER BY id")]
    trajectory = heat.trajectories(store.db, conn, ids)
    return [(i, *trajectory[i]) for i in ids]


def test_rows_are_born_hot_at_the_clock_and_only_exchanges_move_it(store: Store) -> None:
    say(store, "c", "first words", "first reply")
    uid = store.find_user("u")
    assert heat.clock(store.db, uid) == 0.0  # an imported history is born all at once
    heat.advance(store.db, uid, 1200)  # an exchange: what was sent and received
    say(store, "c", "first words", "first reply", "later words")
    rows = activation(store)
    assert [peak for _, _, peak, _ in rows] == [heat.BIRTH_PEAK] * 3
    assert [at for _, at, _, _ in rows] == [0.0, 0.0, 1200.0]


def test_an_exchange_advances_the_clock_by_what_it_sent_and_received(tmp_path: Path) -> None:
    store = open_memory(tmp_path / "m.db")
    pipeline = Pipeline(store, Settings(upstreams={Provider.ANTHROPIC: "https://a.test",
                                                   Provider.OPENAI: "https://o.test"}))
    body = {"model": "m", "messages": [{"role": "user", "content": "q" * 400}]}
    req = to_request({"method": "POST", "path": "/v1/chat/completions", "headers": [
        ["authorization", "Bearer k"], ["x-perpetuity-user", "ann"]], "body": body})
    turn = pipeline.store_turn(pipeline.prepare(req).job.pending)
    assert heat.clock(store.db, turn.user_id) == 100
    pipeline.store_reply(turn, Reply(Message("assistant", (text_part("r" * 80),)), Usage()), 1.0)
    assert heat.clock(store.db, turn.user_id) == 120
    store.close()


def test_reheat_adopts_only_a_better_trajectory_and_nothing_cools_by_writing(store: Store) -> None:
    say(store, "c", "alpha " * 100, "beta " * 100)
    (a, _, _, half), (b, *_) = activation(store)
    now = heat.clock(store.db, store.find_user("u"))
    before = activation(store)
    heat.warm_set(store.db, store.find_user("u"), now + 10 * half, {})  # reading never writes
    assert activation(store) == before
    current_b = heat.BIRTH_PEAK  # b was born at `now`: still at its peak
    assert heat.reheat(store.db, now, {a: 2.0, b: current_b * 0.5}) == 1  # only a's reheat beats its path
    after = dict((i, (at, peak)) for i, at, peak, _ in activation(store))
    assert after[a] == (now, 2.0) and after[b] == (before[1][1], before[1][2])


@pytest.mark.parametrize("ours, other", [(2.0, 1.5), (1.2, 1.5)])
def test_a_first_reheat_another_proxy_wrote_first_is_judged_as_any_other(
        postgres_url: str, monkeypatch: pytest.MonkeyPatch, ours: float, other: float) -> None:
    """PostgreSQL, proxies in parallel: a row never reheated has no activation to lock. When
    another proxy's first reheat of it commits between this one's read and its insert, this
    one's is judged against that one, not written over it nor lost."""
    store = open_memory(postgres_url)
    try:
        say(store, "c", "the lighthouse keeper's logbook", "noted")
        row = int(store.db.connection().execute("SELECT min(id) FROM item").fetchone()[0])
        births, other_proxy = heat.births, opened_other(postgres_url)

        def raced(db: Any, conn: Any, item_ids: Any) -> Any:
            found = births(db, conn, item_ids)
            if row in found:  # the other proxy's first reheat lands now
                b = found[row]
                other_proxy.execute("INSERT INTO activation (item_id, user_id, conversation_id,"
                                    " at, peak, half_life) VALUES (?, ?, ?, ?, ?, ?)",
                                    (row, b.user_id, b.conversation_id, 0.0, other, b.half_life))
            return found

        monkeypatch.setattr(heat, "births", raced)
        assert heat.reheat(store.db, 0.0, {row: ours}) == int(ours > other)
        monkeypatch.undo()
        assert dict((i, peak) for i, _, peak, _ in activation(store))[row] == max(ours, other)
    finally:
        store.close()


def test_an_idle_agent_forgets_nothing(store: Store) -> None:
    say(store, "c", "remember the blue door", "noted")
    uid = store.find_user("u")
    now = heat.clock(store.db, uid)
    first = heat.warm_set(store.db, uid, now, {})
    time.sleep(0.05)  # wall time passes; the clock does not
    again = heat.warm_set(store.db, uid, heat.clock(store.db, uid), {})
    assert np.array_equal(first.warmth, again.warmth) and len(first.item_ids) == 2
    # Only processing content moves the clock, and only then does memory cool.
    heat.advance(store.db, uid, 3_000)
    later = heat.warm_set(store.db, uid, heat.clock(store.db, uid), {})
    assert dict(zip(later.item_ids.tolist(), later.warmth))[int(first.item_ids[0])] < first.warmth[0]


@pytest.mark.parametrize("text, standing", [
    ("Always answer me in French, please.", True),
    ("Thanks. From now on use pnpm, not npm.", True),
    ("I'd prefer short answers with code first.", True),
    ("Never commit straight to main.", True),
    ("We always went camping in July as kids.", False),
    ("The build failed again this morning.", False),
    ("Here is the log:\n" + "Never mind the warnings below. " * 40, False),
])
def test_a_standing_instruction_is_born_to_stay_warm(store: Store, text: str, standing: bool) -> None:
    say(store, "c", text, "Understood. Always happy to help.")
    (_, _, _, said), (_, _, _, replied) = activation(store)
    assert (said == heat.STANDING_HALF_LIFE) == standing
    assert replied == heat.HALF_LIFE[Kind.TEXT]  # the model's words are no one's instruction


def test_the_standing_words_looked_for_first_change_no_half_life() -> None:
    """heat's prefilter (_STANDING_WORD) is exact: the same half-life as the pattern alone,
    whatever the case, on every LoCoMo turn and on the instructions above."""
    texts = ["ALWAYS use tabs.", "dON'T EVER push on Fridays", "I Would Prefer YAML",
             "Make sure you always run the linter", "Please remember to rebase.",
             "from NOW on, reply in haiku", "Remember That the door sticks", "Nevermore."]
    if (locomo := SHARED / "data" / "locomo" / "locomo10.json").is_file():
        texts += [p.text for t in importers.locomo(locomo)
                  for m in t.messages for p in m.parts]
    for text in texts:
        alone = heat.STANDING_HALF_LIFE if (len(text) <= heat.STANDING_MAX_CHARS
                                            and heat._STANDING.search(text)) else 4_000.0
        assert heat.half_life(Kind.TEXT, "user", text) == alone, text


def test_standing_instructions_outlast_the_warm_window_and_reach_the_frame(store: Store) -> None:
    say(store, "setup", "Always show timings in milliseconds.", "Will do.",
        "The staging server is called kestrel.", "Noted.")
    uid = store.find_user("u")
    heat.advance(store.db, uid, 1_000_000)  # a long working life later: ordinary turns are cold
    warm = heat.warm_set(store.db, uid, heat.clock(store.db, uid), {})
    texts = {r.text for r in shown_rows(store.db, warm.item_ids.tolist()).values()}
    assert texts == {"Always show timings in milliseconds."}
    # A question that retrieves nothing (words alone: in meaning, "deploy" is near the staging
    # server's turn): the standing instruction comes by its warmth.
    built = frame.build(Scanner(store, params=Params(semantic=0.0)), user_id=uid,
                        conversation_id=None, query="how fast is the deploy", exclude_messages=[],
                        asked_at=time.time(), limits=cap.Cap())
    text = "\n".join(p.text for m in built.messages for p in m.parts)
    assert "Always show timings in milliseconds." in text and "kestrel" not in text
    if isinstance(store.path, Path):  # SQLite's plan; PostgreSQL's planner goes by table size
        plan = str(query(store.path, f"EXPLAIN QUERY PLAN {heat._STANDING_WARM.sqlite}",
                         uid, 0.0, uid, 0.0))
        # Reheats and births each read through their own index, not a scan.
        assert "activation_standing" in plan and "retrieval_standing" in plan


def test_a_chats_addendum_brings_the_hits_after_a_top_hit_in_front(store: Store) -> None:
    """Under a kept frame that already shows a question's top hit, a chat's addendum still
    brings the hits after it, within the budget a new frame would have (before: none, and one
    long chat's questions held 0.80 of their evidence against 0.91 in chats of their own)."""
    say(store, "garden", "When do the tomato seedlings go out? After the last frost in May.",
        "Noted.", "Tomato blight showed up on the lower leaves in July.", "Spray copper.",
        "The tomato beds get compost every March.", "Right.")
    say(store, "chat", "How are the tomatoes doing?")
    uid = store.find_user("u")
    chat = store.find_conversation(uid, "chat")
    scanner = Scanner(store, params=Params(semantic=0.0))
    query = "tomato blight, seedlings and compost"
    hits = [h for h in frame.search(scanner, query, uid, time.time()) if h.conversation_id != chat]
    assert len(hits) >= 3
    more = frame.addendum(scanner, user_id=uid, conversation_id=chat, query=query,
                          exclude_messages=[], shown={hits[0].item_id}, asked_at=time.time(),
                          limits=cap.Cap())
    assert more is not None and hits[0].item_id not in more.item_ids
    assert {h.item_id for h in hits[1:3]} <= set(more.item_ids)
    assert frame.addendum(scanner, user_id=uid, conversation_id=chat, query=query,
                          exclude_messages=[], shown={h.item_id for h in hits} | set(more.item_ids),
                          asked_at=time.time(), limits=cap.Cap()) is None  # all in front


def test_a_pooled_hit_warms_on_the_askers_clock_only(store: Store) -> None:
    """Each user's rows run on their own clock: another user's row that this retrieval finds
    is as warm as its reheat, never warmer, and this user's reheats never write it."""
    say(store, "mine", "notes on the lighthouse renovation budget", "ok", user="ann")
    say(store, "theirs", "lighthouse renovation budget spreadsheet from Bo", "ok", user="bo")
    ann, bo = store.find_user("ann"), store.find_user("bo")
    heat.advance(store.db, bo, 5_000_000)  # Bo's agent has worked far longer than Ann's
    say(store, "theirs", "a later lighthouse renovation budget question", user="bo")
    before = activation(store)
    built = frame.build(Scanner(store, share_pool=True), user_id=ann, conversation_id=None,
                        query="lighthouse renovation budget", exclude_messages=[],
                        asked_at=time.time(), limits=cap.Cap())
    warm = heat.warm_set(store.db, ann, heat.clock(store.db, ann), heat.rank_reheats(built.hits + built.below_cap, []))
    assert warm.foreign and max(warm.warmth) <= heat.REHEAT_TOP
    assert warm.item_ids[0] not in warm.foreign  # Ann's own row ranked first stays first
    assert not set(built.reheats) & warm.foreign
    assert activation(store) == before  # building reads only


def test_lookups_around_a_message_read_its_conversation_in_store_order(store: Store) -> None:
    """The latest stretch, a hit's neighbours, the other half of an exchange: each reads a few
    index entries, never the whole conversation sorted (a long coding session)."""
    if not isinstance(store.path, Path):
        pytest.skip("SQLite's query plan (PostgreSQL's planner goes by table size)")
    conn = opened(store.path)
    for sql in ("SELECT id FROM message WHERE conversation_id = ? ORDER BY id DESC LIMIT ?",
                "SELECT id FROM message WHERE conversation_id = ? AND id < ? ORDER BY id DESC"
                " LIMIT ?"):
        plan = str(conn.execute("EXPLAIN QUERY PLAN " + sql, (1,) * sql.count("?")).fetchall())
        assert "message_conversation_order" in plan and "TEMP B-TREE" not in plan, plan


def test_the_neighbours_of_hits_are_the_messages_beside_each_in_its_conversation(
        store: Store) -> None:
    """Each hit's n messages before and after it in its own conversation, for any number of
    hits at once (one statement), conversations interleaved in the store, a hit twice."""
    say(store, "a", *[f"alpha {i}" for i in range(7)])
    say(store, "b", "beta 0", "beta 1", "beta 2")
    say(store, "a", *[f"alpha {i}" for i in range(9)])  # two more, stored after b's
    conv = dict(query(store.path, "SELECT id, conversation_id FROM message"))
    items: dict[int, list[int]] = {}
    for item, message in query(store.path, "SELECT id, message_id FROM item"):
        items.setdefault(message, []).append(item)
    order = {c: sorted(m for m in conv if conv[m] == c) for c in set(conv.values())}
    a, b = sorted(order.values(), key=len, reverse=True)
    assert len(a) == 9 and len(b) == 3

    def beside(m: int, n: int) -> list[int]:
        ids = order[conv[m]]
        i = ids.index(m)
        return ids[max(0, i - n):i] + ids[i + 1:i + 1 + n]

    hits = [a[0], a[4], b[1], a[-1], a[4], b[2]]
    for n in (1, 2):
        want = [(k, item, m) for k, h in enumerate(hits) for m in beside(h, n)
                for item in items[m]]
        got = around(store.db, [(conv[h], h) for h in hits], n)
        # In hit order, then store order on SQLite, where the reheats read them in this order;
        # PostgreSQL's lateral join names none.
        assert (sorted(got) == sorted(want)) if store.db.postgres else got == want
    assert around(store.db, [], 2) == []


def test_adjacency_read_once_for_every_row_holds_for_any_rows_chosen(store: Store) -> None:
    """The frame reads which of its candidate rows' messages follow one another once
    (frame_read); a run of any subset rendered is then what the store says of that subset."""
    say(store, "a", *[f"alpha {i}" for i in range(8)])
    say(store, "b", "beta 0", "beta 1", "beta 2")
    say(store, "a", *[f"alpha {i}" for i in range(12)])  # four more, stored after b's
    items = [i for (i,) in query(store.path, "SELECT id FROM item ORDER BY id")]
    rows = shown_rows(store.db, items)
    adjacent = frame_read._adjacent(Scanner(store), rows)
    by_conversation: dict[int, list[int]] = {}
    for r in rows.values():
        by_conversation.setdefault(r.conversation_id, []).append(r.message_id)
    for messages in by_conversation.values():
        for picked in itertools.chain.from_iterable(
                itertools.combinations(sorted(messages), k) for k in (2, 3)):
            here = {p for p in itertools.pairwise(picked) if p in adjacent}
            assert here == set(adjacent_pairs(store.db, picked)), picked


def test_budget_grows_with_the_spread_of_good_matches() -> None:
    limits = cap.Cap(floor=1000, ceiling=8000)
    one_clear = cap.budget(np.array([10.0, 2.0, 1.5, 1.0]), limits)
    budgets = [cap.budget(np.array([10.0] * k + [1.0] * 5), limits) for k in range(1, 20)]
    assert one_clear == limits.floor
    assert budgets == sorted(budgets) and budgets[0] == limits.floor and budgets[-1] == limits.ceiling
    closer = [cap.budget(np.array([10.0, s, s, s]), limits) for s in (5.0, 7.0, 9.0, 10.0)]
    assert closer == sorted(closer)
    assert cap.budget(np.array([]), limits) == limits.floor


def test_the_live_history_kept_as_sent_pays_from_the_budget() -> None:
    """A short conversation keeps its turns as sent; the cap is on what the model reads, so its
    frame shrinks by them, never below a narrow question's budget."""
    limits = cap.Cap(floor=1000, ceiling=8000)
    assert frame_select.budget([], limits, 500) == limits.floor
    broad = [Hit(i, i, 1, 1, "user", 0.0, 10.0, "t") for i in range(20)]
    assert frame_select.budget(broad, limits) == limits.ceiling
    assert frame_select.budget(broad, limits, 3000) == limits.ceiling - 3000
    assert frame_select.budget(broad, limits, 20_000) == limits.floor


def test_the_budget_goes_to_the_most_warmth_per_token() -> None:
    def row(i: int, words: int) -> Row:
        return Row(i, i, 1, "c", "user", 0.0, Kind.TEXT.value, "", "word " * words)

    rows = {1: row(1, 800), 2: row(2, 40), 3: row(3, 40), 4: row(4, 40), 5: row(5, 2)}
    warm = heat.Warm(np.array([1, 2, 3, 4, 5]), np.array([1.0, 0.9, 0.9, 0.9, 0.9]))

    def measure(new: list[int]) -> int:
        return messages_tokens([Message("user", (text_part(rows[i].text),)) for i in new])

    new = frame_select.fill(rows, warm, set(), 400, prefixes_of(measure))
    # The warmest row alone would spend the whole budget; three substantive turns and a
    # two-word one give more warmth for it.
    assert sorted(new) == [2, 3, 4, 5]
    new = frame_select.fill(rows, warm, {1}, 400, prefixes_of(measure))
    assert new[0] == 1  # a mandatory row is never traded away


def test_the_order_by_warmth_per_token_is_the_plain_sorts() -> None:
    def reference(warm: heat.Warm, costs: dict[int, int]) -> list[int]:
        warmth = dict(zip(warm.item_ids.tolist(), warm.warmth.tolist(), strict=True))
        return sorted((i for i in warmth if i in costs),
                      key=lambda i: -warmth[i] / (costs[i] + frame_render.ROW_FLOOR))

    rng = np.random.default_rng(24)
    for n in (0, 1, 5, 400, 2000):
        ids = rng.permutation(3 * n + 1)[:n].astype(np.int64)
        # Ties on purpose: repeated warmths and costs, where only a stable order agrees.
        warmth = rng.choice([0.5, 0.25, 1.0, 0.125], n) if n % 2 else rng.random(n)
        warm = heat.Warm(ids, warmth.astype(np.float64))
        costs = {int(i): int(rng.choice([0, 1, 7, 100, 1500])) for i in ids if rng.random() < 0.8}
        costs |= {10_000_000 + k: 5 for k in range(3)}  # rows gone cold: not in the order
        assert frame_select.by_warmth_per_token(warm, costs) == reference(warm, costs)


def test_cap_never_trims_the_top_hit(store: Store) -> None:
    say(store, "old", "the lighthouse keeper's name was Ingrid " + "filler " * 600, "ok")
    say(store, "new", *[f"unrelated chatter number {i} " * 20 for i in range(20)])
    uid = store.find_user("u")
    tiny = cap.Cap(floor=10, ceiling=10)
    built = frame.build(Scanner(store), user_id=uid, conversation_id=None,
                        query="lighthouse keeper name", exclude_messages=[], asked_at=time.time(),
                        limits=tiny)
    assert built is not None
    text = "\n".join(p.text for m in built.messages for p in m.parts)
    assert "Ingrid" in text  # over budget, still there: it is the question's own top match
    assert built.left_out > 0


def test_a_named_date_ranks_what_was_said_that_day_first(store: Store) -> None:
    for conversation, day, text in (
            ("march", datetime(2023, 3, 13, 15, tzinfo=UTC), "Jolene: can you help me, Deb?"),
            ("june", datetime(2023, 6, 1, 15, tzinfo=UTC),
             "Jolene: I asked Deb to help with the garden, and Deb helped me plant it.")):
        capture.record(store, user_key="u", conversation_key=conversation, provider="anthropic",
                       model="m", messages=[Message("user", (text_part(text),))],
                       times=[day.timestamp()], source="import")
    uid = store.find_user("u")

    def top(query: str) -> str:
        built = frame.build(Scanner(store), user_id=uid, conversation_id=None, query=query,
                            exclude_messages=[], asked_at=time.time(), limits=cap.Cap(10, 10))
        return shown_rows(store.db, built.hits[:1])[built.hits[0]].text

    assert "garden" in top("What did Jolene ask Deb to help with?")
    assert "can you help me" in top("What did Jolene ask Deb to help with on 13 March, 2023?")
    assert "garden" in top("What did Jolene ask Deb to help with in June 2023?")


def test_the_top_hit_brings_the_other_half_of_its_exchange(store: Store) -> None:
    answer = "Your degree: " + "a long and careful answer about paperwork " * 40
    ids = say(store, "old", "I graduated with a degree in Business Administration.", answer,
              "Unrelated question about dinner plans?", "Pasta, then.")
    # The person's turns the question's words find before the reply (a half among the first
    # frame_select.HALF_RANK hits is the question's own match, and comes whole).
    say(store, "old", *[t for n in range(6) for t in (f"I went to graduation party {n}.", "Nice.")])
    uid = store.find_user("u")

    def text(limits: cap.Cap, agent: bool = False, query: str = "what degree did I graduate with"
             ) -> str:
        built = frame.build(Scanner(store), user_id=uid, conversation_id=None, query=query,
                            exclude_messages=[], asked_at=time.time(), limits=limits, agent=agent)
        return "\n".join(p.text for m in built.messages for p in m.parts)

    # Over the budget, still there: the reply travels with the question it answers...
    assert answer in text(cap.Cap(floor=50, ceiling=2000), agent=True)
    # ...unless it is a bulk over half the largest frame.
    assert answer not in text(cap.Cap(floor=50, ceiling=500), agent=True)
    # A chat's, over HALF_WHOLE tokens, as the lines around the question's words, which
    # memory_more reads whole; a short one whole.
    chat = text(cap.Cap(floor=50, ceiling=2000))
    item = capture_items(store, ids[1])
    assert answer not in chat and answer[:100] in chat
    assert frame_render.cost(shown_rows(store.db, [item])[item]) > frame_select.HALF_WHOLE
    assert f"memory_more(item={item})" in chat and "Business Administration" in chat
    assert answer in tools.run("memory_more", {"item": item}, TurnMemory(uid, None, time.time()),
                               Scanner(store))
    assert "Pasta, then." in text(cap.Cap(floor=50, ceiling=2000), query="dinner plans")
    # So in a long chat's addendum, under a frame it keeps.
    say(store, "asking", "Hello again.")
    more = frame.addendum(Scanner(store), user_id=uid,
                          conversation_id=store.find_conversation(uid, "asking"),
                          query="what degree did I graduate with", exclude_messages=[],
                          shown=set(), asked_at=time.time(), limits=cap.Cap(floor=50, ceiling=2000))
    assert more is not None and item in more.item_ids
    added = "\n".join(p.text for m in more.messages for p in m.parts)
    assert answer not in added and f"memory_more(item={item})" in added


def test_a_long_half_is_quoted_around_the_first_mentions_of_the_questions_words() -> None:
    text = ("Sure.\n" + "filler line of nothing much here\n" * 20 + "Your sprint ends on Friday.\n"
            + "filler line of nothing much here\n" * 20 + "The sprint review is Monday.\n"
            + "more filler to close with\n" * 20)
    r = Row(1, 1, 1, "", "assistant", 0.0, "text", "", text)
    asked = {"sprint", "end", "ends"}.__contains__
    quoted = frame_stretch.around(r, asked)
    assert quoted.excerpt and "Your sprint ends on Friday." in quoted.text
    assert "The sprint review" not in quoted.text  # a word's first mention only
    assert len(quoted.text) < len(text) // 3 and quoted.text.startswith(frame_stretch.LEFT_OUT)
    none = frame_stretch.around(r, lambda word: False)  # no word of the question: its opening
    assert none.text.startswith("Sure.") and none.excerpt


def test_cap_never_trims_the_recent_stretch(store: Store) -> None:
    ids = say(store, "chat", *[f"turn {i} about gardening " * 30 for i in range(8)])
    uid = store.find_user("u")
    conv = store.find_conversation(uid, "chat")
    heat.advance(store.db, uid, 100_000)  # long ago: everything has gone cold
    recent = store.latest_messages(conv, 3)
    assert recent == ids[-3:][::-1]
    built = frame.build(Scanner(store), user_id=uid, conversation_id=conv, query="unrelated words",
                        exclude_messages=[], asked_at=time.time(), limits=cap.Cap(10, 10),
                        recent_messages=recent)
    text = "\n".join(p.text for m in built.messages for p in m.parts)
    assert all(f"turn {i} about" in text for i in (5, 6, 7))
    assert "turn 4 about" not in text and "this conversation" in text


def test_a_names_latest_mention_in_a_long_row_comes_as_an_excerpt_memory_more_reads_whole(
        store: Store) -> None:
    """The latest mention of a name the conversation touched, in a row too long for the
    stretch, comes as the lines around it, verbatim and bounded, with the row's id; memory_more
    gives the row back whole."""
    listing = "\n".join(f"{n:4d}  value {n} = compute({n})  # an unrelated line of the file"
                         for n in range(120))
    mention = "  from app.config_loader import load_settings  # the settings loader, read once"
    long_row = listing + "\n" + mention + "\n" + listing.replace("value ", "other ")
    ids = say(store, "code", "Where is app.config_loader used?", long_row, "ok, next",
              *[f"short turn {i}" for i in range(6)])
    uid = store.find_user("u")
    conv = store.find_conversation(uid, "code")
    built = frame.build(Scanner(store), user_id=uid, conversation_id=conv, query="deploy",
                        exclude_messages=[], asked_at=time.time(), limits=cap.Cap(100, 100),
                        recent_messages=store.latest_messages(conv, 50))
    assert built is not None
    text = "\n".join(p.text for m in built.messages for p in m.parts)
    item = capture_items(store, ids[1])
    at = long_row.rfind("app.config_loader")
    assert long_row[at - 60:at + len("app.config_loader") + 60] in text  # verbatim around it
    assert mention in text  # the whole line
    assert f"memory_more(item={item})" in text
    assert "value 0 =" not in text and "other 119 =" not in text  # not the whole row
    quoted = text[text.index(frame_render.EXCERPT.format(item)):]
    assert len(quoted.split("[End of quoted memory")[0]) < 2 * (
        frame_stretch.EXCERPT_CHARS + frame_stretch.LINE_SLACK) + 200
    memory = TurnMemory(uid, conv, time.time())
    back = tools.run("memory_more", {"item": item}, memory, Scanner(store))
    assert "value 0 = compute(0)" in back and mention in back  # the row, from its start


def capture_items(store: Store, message_id: int) -> int:
    """The one row of a stored message."""
    ((item,),) = query(store.path, f"select id from item where message_id = {message_id}")
    return int(item)


def test_frame_alternates_and_labels(store: Store) -> None:
    say(store, "trip", "We fly to Lisbon on May 3rd.", "Lovely, enjoy Lisbon.")
    uid = store.find_user("u")
    built = frame.build(Scanner(store), user_id=uid, conversation_id=None,
                        query="when do we fly to Lisbon", exclude_messages=[],
                        asked_at=1_700_000_000.0 + 3 * 86400, limits=cap.Cap())
    roles = [m.role for m in built.messages]
    assert roles[0] == "user" and roles[-1] == "assistant"
    assert all(a != b for a, b in zip(roles, roles[1:]))
    first = built.messages[0].parts[0].text
    # Another conversation by its first prompt's opening words, never its key.
    assert first.startswith(frame.HEADER)
    assert '[conversation "We fly to Lisbon on May 3rd."' in first
    assert "2023-11-14" in first and "3 days before" in first


def test_labels_count_calendar_days_and_the_closing_tells_the_time(store: Store) -> None:
    say(store, "trip", "We fly to Lisbon on May 3rd.", "Lovely, enjoy Lisbon.")  # 22:13 UTC
    uid = store.find_user("u")

    def texts(minutes_later: int) -> list[str]:
        built = frame.build(Scanner(store), user_id=uid, conversation_id=None,
                            query="when do we fly to Lisbon", exclude_messages=[],
                            asked_at=1_700_000_000.0 + 60 * minutes_later, limits=cap.Cap())
        return [p.text for m in built.messages for p in m.parts]

    soon, later, tomorrow = texts(10), texts(40), texts(120)
    assert soon[:-1] == later[:-1]  # the labels do not move with the clock: the prefix holds
    assert "2023-11-14 22:13 UTC, earlier today]" in soon[0]
    assert soon[-1] == "[End of quoted memory. Now: 2023-11-14 22:23 UTC.]"
    assert later[-1] == "[End of quoted memory. Now: 2023-11-14 22:53 UTC.]"
    assert "2023-11-14 22:13 UTC, yesterday]" in tomorrow[0]  # past midnight


@needs_fixtures
def test_every_capture_yields_a_valid_request(tmp_path: Path) -> None:
    """Fill memory from every harness's session, then replay every request through the frame
    builder: each request upstream must still be one the provider accepts."""
    store = open_memory(tmp_path / "m.db")
    pipeline = Pipeline(store, Settings(upstreams={Provider.ANTHROPIC: "https://a.test",
                                                   Provider.OPENAI: "https://o.test"},
                                        trust_identity=True))
    for harness in ("claude-code", "codex", "opencode", "anthropic-python", "openai-python"):
        replay(pipeline, harness)
    framed = 0
    for harness in ("claude-code", "codex", "opencode", "anthropic-python", "openai-python"):
        for f in http_fixtures(harness):
            raw = json.loads(f.read_text())
            check = CHECKS.get(raw["path"])
            if check is None:
                continue
            assert not check(raw["body"]), f"the capture itself is invalid: {f}"
            d = pipeline.prepare(to_request(raw))
            if d.body is None:
                continue
            framed += 1
            sent = json.loads(d.body)
            assert not check(sent), (f, check(sent))
            # System prompt and tools are never touched; the live turn is kept as sent.
            for key in ("system", "tools", "instructions"):
                assert sent.get(key) == raw["body"].get(key), (f, key)
            history = raw["body"].get("messages") or raw["body"].get("input")
            kept = sent.get("messages") or sent.get("input")
            if isinstance(history, list):
                assert kept[-1] == history[-1], f
    store.close()
    assert framed >= 20, framed


def test_a_new_conversation_gets_a_frame_and_a_short_one_stays_as_sent(
        proxy: Proxy, fake: FakeProvider) -> None:
    c = owned(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0))
    history = [{"role": "user", "content": "My cat is called Miso."}]
    fake.script(Text("Miso is a lovely name."), Text("Your cat is Miso."), Text("Tabby."))
    r = c.chat.completions.create(model="gpt-4o", messages=history, user="frame-user")
    proxy.wait_messages("frame-user", 2)
    asked = [{"role": "user", "content": "What is my cat called?"}]
    c.chat.completions.create(model="gpt-4o", messages=asked, user="frame-user")
    sent = fake.requests[-1].json["messages"]
    assert sent[-1] == {"role": "user", "content": "What is my cat called?"}
    assert sent[0]["content"].startswith(frame.HEADER)
    assert "My cat is called Miso." in sent[0]["content"]
    assert "Miso is a lovely name." in sent[1]["content"] and sent[1]["role"] == "assistant"
    # The first conversation goes on: its history is shorter than a frame, so it is sent as
    # it is, with nothing in front (its own turns are all there).
    proxy.wait_messages("frame-user", 4)
    history += [{"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "What colour is it?"}]
    c.chat.completions.create(model="gpt-4o", messages=history, user="frame-user")
    assert fake.requests[-1].json["messages"][-3:] == history


def test_probe_mode_has_no_side_effects(proxy: Proxy, fake: FakeProvider) -> None:
    with openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0) as c:
        c.chat.completions.create(model="gpt-4o", user="probe-user",
                                  messages=[{"role": "user", "content": "The vault code is 4471."}])
        proxy.wait_messages("probe-user", 2)
        user = ("user_id in (select id from user where key = ? "
                "or substr(key, instr(key, '/') + 1) = ?)")

        def state() -> list:
            return [proxy.rows(f"select * from {t} where {user} order by 1", "probe-user",
                               "probe-user")
                    for t in ("message", "activation", "clock", "retrieval")]

        before = state()
        for _ in range(2):
            c.chat.completions.create(model="gpt-4o", user="probe-user",
                                      messages=[{"role": "user", "content": "What is the vault code?"}],
                                      extra_headers={"x-perpetuity-probe": "on"})
        # The proxy stores on one thread, in order: once another user's turn after the probes is
        # stored, whatever the probes had stored would be too.
        c.chat.completions.create(model="gpt-4o", user="probe-after",
                                  messages=[{"role": "user", "content": "Hello."}])
        proxy.wait_messages("probe-after", 2)
    assert state() == before
    sent = fake.requests[-2].json["messages"]
    assert "4471" in sent[0]["content"] and sent[-1]["content"] == "What is the vault code?"
    assert fake.requests[-2].json == fake.requests[-3].json  # same question, same frame


def cook_turns(tmp_path: Path, questions: tuple[str, ...],
               request: Callable[[list[dict[str, str]]], dict]) -> list[dict]:
    """The bodies sent upstream for a chat about recipes kept in memory, one per question;
    `request` makes the client's request from the history so far."""
    store = open_memory(tmp_path / "m.db")
    say(store, "older", *[f"The {w} recipe needs {w} and salt." for w in
                          ("lemon", "garlic", "basil", "ginger", "fennel", "thyme")], user="cook")
    pipeline = Pipeline(store, Settings(upstreams={Provider.ANTHROPIC: "https://a.test",
                                                   Provider.OPENAI: "https://o.test"},
                                        trust_identity=True))
    history: list[dict[str, str]] = []
    sent = []
    for question in questions:
        history.append({"role": "user", "content": question})
        d = pipeline.prepare(to_request(request(history)))
        sent.append(json.loads(d.body))
        turn = pipeline.store_turn(d.job.pending)
        pipeline.store_reply(turn, Reply(Message("assistant", (text_part("Noted."),)), Usage()), 0)
        history.append({"role": "assistant", "content": "Noted."})
    store.close()
    return sent


COOK = [["x-perpetuity-user", "cook"], ["x-perpetuity-conversation", "kitchen"]]


def test_consecutive_turns_only_grow_at_the_end(tmp_path: Path) -> None:
    """Providers cache by exact prefix: each request starts with the whole previous one."""
    sent = [b["messages"] for b in cook_turns(
        tmp_path, ("Which recipe needs lemon?", "And which one needs basil?", "What about thyme?"),
        lambda history: {"method": "POST", "path": "/v1/chat/completions",
                         "headers": [["authorization", "Bearer k"], *COOK],
                         "body": {"model": "m", "messages": history}})]
    for before, after in itertools.pairwise(sent):
        assert after[:len(before)] == before
    assert "The basil recipe" in "".join(m["content"] for m in sent[1][:-1])


def marked_prefixes(messages: list[dict]) -> set[str]:
    """The request's prefixes that end at a cache marker: what Anthropic writes to its cache."""
    blocks = [(m["role"], b) for m in messages for b in
              (m["content"] if isinstance(m["content"], list) else [{"text": m["content"]}])]
    return {json.dumps([(r, b["text"]) for r, b in blocks[:n + 1]])
            for n, (_, b) in enumerate(blocks) if "cache_control" in b}


def test_anthropic_markers_let_the_next_turn_read_what_this_one_kept(tmp_path: Path) -> None:
    """Anthropic caches only at marked blocks: the frame's end is marked, and the next turn
    reads it there, within the limit of four markers."""
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    bodies = cook_turns(
        tmp_path, ("Which recipe needs lemon?", "And which one needs basil?", "What about thyme?",
                   "And ginger?"),
        lambda history: {"method": "POST", "path": "/v1/messages",
                         "headers": [["x-api-key", "k"], *COOK],
                         "body": {"model": "m", "max_tokens": 100, "system": system,
                                  "messages": history}})
    assert all(json.dumps(b).count("cache_control") <= 4 for b in bodies)
    for before, after in itertools.pairwise(b["messages"] for b in bodies):
        assert marked_prefixes(before) & marked_prefixes(after)  # a read hit at a marker


def test_markers_yield_to_the_harness_own() -> None:
    frame_messages = frame_render.assemble([("user", "a"), ("assistant", "b")], 0.0)
    closing = frame.NOW.format(datetime.fromtimestamp(0.0, UTC))
    live = {"role": "user", "content": [{"type": "text", "text": "live", "cache_control": {}}]}
    body = {"model": "m", "system": [{"type": "text", "text": "s", "cache_control": {}}] * 3,
            "messages": [{"role": "user", "content": "old", "cache_control": {}}, live]}

    def marked() -> list[str]:
        out = ADAPTERS[Protocol.ANTHROPIC].replace_history(body, frame_messages, 1)
        return [b["text"] for m in out["messages"] if isinstance(m["content"], list)
                for b in m["content"] if "cache_control" in b]

    assert marked() == ["live"]  # the harness's four (the stripped history's went with it)
    body["system"] = body["system"][:2]
    assert marked() == ["b\n\n" + closing, "live"]  # one to spare: the frame's end


def test_the_frame_is_its_one_layout_written(store: Store,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout is most of a frame's selection time (issue 24): the fill measures its
    prefixes without laying any out (render.prefix_tokens), and the frame is written from the
    one layout of the rows it chose; the frame's tokens are the written frame's."""
    say(store, "trip", *[f"turn {i} about the Lisbon trip " * (5 + 20 * (i % 3)) for i in range(12)])
    uid = store.find_user("u")
    calls: list[tuple[list[int], tuple[object, ...]]] = []
    real = frame_render.lay

    def counted(rows: dict[int, Row], ids: list[int], *args: Any) -> list[frame_render.Run]:
        calls.append((list(ids), (rows, list(ids), *args)))
        return real(rows, ids, *args)

    monkeypatch.setattr(frame_render, "lay", counted)
    for limits in (cap.Cap(), cap.Cap(floor=60, ceiling=60)):
        calls.clear()
        asked = time.time()
        built = frame.build(Scanner(store), user_id=uid, conversation_id=None,
                            query="the Lisbon trip", exclude_messages=[], asked_at=asked,
                            limits=limits)
        assert built is not None
        assert [ids for ids, _ in calls] == [built.item_ids]  # one layout (2-4 before)
        laid = real(*calls[0][1])  # type: ignore[arg-type]
        assert built.messages == frame_render.written(laid, asked)
        assert frame_render.tokens(laid, asked) == messages_tokens(built.messages)


def _count_markers_reference(value: object) -> int:
    """The obvious recursive count, to prove the walk exact."""
    if isinstance(value, dict):
        return (value.get("cache_control") is not None) + sum(
            _count_markers_reference(v) for v in value.values())
    if isinstance(value, list):
        return sum(_count_markers_reference(v) for v in value)
    return 0


@needs_fixtures
def test_cache_markers_are_counted_anywhere_as_the_reference_counts_them() -> None:
    from perpetuity_core.wire.protocols.cache_marks import markers

    nested = {"tools": [{"name": "t", "cache_control": {"type": "ephemeral"},
                         "input_schema": {"properties": {"cache_control": None}}}],
              "system": [{"type": "text", "text": "s", "cache_control": {}}],
              "messages": [{"role": "user", "content": [
                  {"type": "tool_result", "content": [{"type": "text", "text": "x",
                                                       "cache_control": {}}]}]}],
              "metadata": "cache_control"}
    bodies = [nested] + [json.loads(f.read_text())["body"]
                         for harness in ("claude-code", "anthropic-python")
                         for f in http_fixtures(harness)]
    assert len(bodies) > 5
    for body in bodies:
        assert len(markers(body)) == _count_markers_reference(body)
    assert len(markers(nested)) == 3


def test_the_fill_goes_to_the_conversation_the_question_finds() -> None:
    """One person's memory of many conversations: a row an earlier question left warm in
    another conversation does not crowd out this question's rows in the conversation its hits
    point to (frame_select.focus)."""
    def row(i: int, conversation: int) -> Row:
        return Row(i, i, conversation, f"c{conversation}", "user", 0.0, Kind.TEXT.value, "",
                   "word " * 30)

    rows = {1: row(1, 1), 2: row(2, 2), 3: row(3, 1)}
    # Row 2 was reheated by the previous question (conversation 2); rows 1 and 3 by this one.
    warm = heat.Warm(np.array([2, 1, 3]), np.array([1.2, 2.0, 0.8]))
    hits = [Hit(i, i, 1, 1, "user", 0.0, 5.0 - k, "t") for k, i in enumerate([1, 3, 7, 8, 9])]

    def measure(new: list[int]) -> int:
        return messages_tokens([Message("user", (text_part(rows[i].text),)) for i in new])

    new = frame_select.fill(rows, warm, {1}, 80, prefixes_of(measure),
                            frame_select.focus(warm, rows))
    assert new == [1, 3]
    assert frame_select.focus(heat.Warm(np.zeros(0, np.int64), np.zeros(0)), rows) == {}
    assert frame_select.about(frame_lean.shares(hits)) == 1 and frame_select.about({}) is None


def test_a_chats_fill_leans_to_the_conversation_its_earlier_questions_found() -> None:
    """One person's memory of many conversations: where this question's words match two
    conversations about alike, the fill leans to the one the person's earlier questions left
    warm (frame_select.focus over the warm set), not to the one its own hits lean to."""
    def row(i: int, conversation: int) -> Row:
        return Row(i, i, conversation, f"c{conversation}", "user", 0.0, Kind.TEXT.value, "",
                   "word " * 30)

    rows = {1: row(1, 1), 2: row(2, 2), 3: row(3, 1), 4: row(4, 2), 5: row(5, 1), 6: row(6, 1)}
    # This question's hits: 2 and 4 in conversation 2, 1 in conversation 1; rows 3, 5 and 6 of
    # conversation 1 an earlier question left warm.
    hits = [Hit(i, i, 1, rows[i].conversation_id, "user", 0.0, 5.0 - k, "t")
            for k, i in enumerate([2, 1, 4])]
    warm = heat.Warm(np.array([2, 1, 4, 3, 5, 6]), np.array([2.0, 1.95, 1.9, 1.0, 1.0, 1.0]))

    def measure(base: list[int], added: list[int], recent: object, excerpts: object
                ) -> Callable[[int], int]:
        return lambda k: messages_tokens([Message("user", (text_part(rows[i].text),))
                                          for i in base + added[:k]])

    chosen = frame_select.frame(rows, warm, hits, [], [], 80, cap.Cap(), measure)
    assert chosen.item_ids == [2, 1]  # the top hit, then conversation 1's hit
    assert frame_select.focus(warm, rows)[1] == 1.0


def test_a_chats_budget_is_the_breadth_of_its_question_within_its_conversation() -> None:
    """In a memory of many conversations, a chat's budget is measured over the hits of the
    conversation most of them are in (frame_select.about): another conversation's matches do
    not make a narrow question broad. One conversation, or an agent's frame: as before."""
    scores = [(1, 10.0), (2, 6.0), (2, 6.0), (2, 6.0)] + [(1, 3.0)] * 20
    hits = [Hit(k, k, 1, c, "user", 0.0, s, "t") for k, (c, s) in enumerate(scores)]
    limits = cap.Cap()
    narrow = limits.ceiling * frame_select.CHAT_REQUEST * frame_select.CHAT_NARROW // 10_000
    assert frame_select.about(frame_lean.shares(hits)) == 1
    assert frame_select.budget(hits, limits, chat=True) == narrow
    assert frame_select.budget(hits, limits) > limits.floor + 900  # (an agent's)
    alone = [h for h in hits if h.conversation_id == 1]
    assert frame_select.budget(alone, limits, chat=True) == narrow


def test_a_chats_budget_is_the_room_its_request_has_left() -> None:
    """A chat's frame is sized to CHAT_REQUEST percent of the ceiling less what it keeps as
    sent (its latest exchanges and its prompt): a broad question takes all of that room, a
    narrow one CHAT_NARROW percent of it; never under the floor."""
    limits = cap.Cap(floor=1000, ceiling=5000)
    room = limits.ceiling * frame_select.CHAT_REQUEST // 100
    broad = [Hit(i, i, 1, 1, "user", 0.0, 10.0, "t") for i in range(20)]
    narrow = [Hit(0, 0, 1, 1, "user", 0.0, 10.0, "t")]
    assert frame_select.budget(broad, limits, 600, chat=True) == room - 600
    assert frame_select.budget(narrow, limits, 600, chat=True) == \
        (room - 600) * frame_select.CHAT_NARROW // 100
    assert frame_select.budget(broad, limits, room - 200, chat=True) == limits.floor


def test_what_an_earlier_question_left_warm_counts_less_in_a_chats_next_frame(
        store: Store) -> None:
    """A previous question's reheated rows do not crowd out the next question's: a chat's frame
    counts them at heat.CARRIED beside its own reheats (an agent's whole), and the activation
    written stays as it was."""
    say(store, "old", "the lighthouse keeper was named Ingrid", "noted")
    say(store, "new", "the parcel went to Oslo on Monday", "thanks")
    uid = store.find_user("u")
    assert uid is not None
    now = heat.clock(store.db, uid)
    lighthouse = int(store.db.connection().execute("SELECT min(id) FROM item").fetchone()[0])
    heat.reheat(store.db, now, {lighthouse: heat.REHEAT_TOP})  # the previous question's top hit
    before = activation(store)
    warmth = {}
    for agent in (False, True):
        built = frame.build(Scanner(store), user_id=uid, conversation_id=None,
                            query="where did the parcel go", exclude_messages=[],
                            asked_at=time.time(), limits=cap.Cap(), agent=agent)
        assert built is not None and built.warm is not None
        warmth[agent] = dict(zip(built.warm.item_ids.tolist(), built.warm.warmth.tolist()))
    assert warmth[True][lighthouse] == pytest.approx(heat.REHEAT_TOP)
    assert warmth[False][lighthouse] == pytest.approx(heat.REHEAT_TOP * heat.CARRIED)
    assert activation(store) == before
