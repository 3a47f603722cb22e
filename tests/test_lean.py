"""Which conversation a chat's question is about (frame/lean.py): its own hits, tipped by what
the chat asked before, carried in the chat's plan from question to question."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from perpetuity_core.cli.eval import chat_request
from perpetuity_core.frame import lean as frame_lean
from perpetuity_core.frame import read as frame_read
from perpetuity_core.frame import subject
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Kind, Message, Provider, Reply, Usage, text_part
from perpetuity_core.wire.identity import PERSONAL


def hit(k: int, conversation: int) -> Hit:
    return Hit(k, k, 1, conversation, "user", 0.0, 1.0 / (k + 1), "", seq=k)


def test_an_ambiguous_question_goes_where_the_chat_was() -> None:
    """Most of the hits in conversation 2, the rest in 1: alone the question is about 2; a
    chat that was asking about 1 keeps it there, unless its leaning was mostly 2's too."""
    hits = [hit(k, 2) for k in range(6)] + [hit(k, 1) for k in range(6, 10)]
    assert frame_lean.about(hits, ()) == 2
    assert frame_lean.about(hits, ((1, 1.0),)) == 1
    assert frame_lean.about(hits, ((1, 0.2), (2, 1.0))) == 2
    assert frame_lean.about(hits, ((3, 1.0),)) == 2  # a conversation no hit is in: not chosen
    assert frame_lean.about([], ((1, 1.0),)) is None


def test_the_leaning_keeps_earlier_questions_at_a_falling_part() -> None:
    shares = frame_lean.shares([hit(0, 2), hit(1, 2), hit(2, 3)])
    assert sum(shares.values()) == pytest.approx(1.0) and shares[2] > 2 * shares[3]
    lean = frame_lean.after(((1, 1.0), (4, 0.011)), [hit(0, 2)])
    assert lean == ((1, frame_lean.KEPT), (2, 1.0))  # 4's part fell below FORGOTTEN


def test_the_fill_weighs_each_conversation_by_its_warmth_tipped_by_the_leaning() -> None:
    """A chat's fill: each conversation's share of the warm rows' warmth, plus PRIOR times
    its share of the leaning; as it was without a leaning."""
    assert frame_lean.weighed({1: 3.0, 2: 1.0}, ()) == {1: 3.0, 2: 1.0}
    assert frame_lean.weighed({1: 3.0, 2: 1.0}, ((2, 2.0), (5, 2.0))) == pytest.approx(
        {1: 0.75, 2: 0.25 + 0.5 * frame_lean.PRIOR})


def two_conversations(store: Store, user: str = "u") -> tuple[int, int, int]:
    """One person's two conversations, both about a John: in the first, the turn about his
    cooking is one of many naming him; the second names him less and cooks more."""
    first = ["John: I cooked a mushroom risotto for my sister", *(
        f"John: John here, John again about the {w}" for w in ("car", "rent", "dog", "trip"))]
    second = ["John: we cook together on Sundays", "John: cook the pasta first",
              "Tim: did you cook the fish?", "Tim: cook it slowly"]
    for key, turns in (("a", first), ("b", second)):
        capture.record(store, user_key=user, conversation_key=key, provider="anthropic",
                       model="m", messages=[Message("user", (text_part(t),)) for t in turns],
                       times=[1_700_000_000.0 + i for i in range(len(turns))], source="import")
    uid = store.find_user(user)
    assert uid is not None
    return uid, store.conversation_id(uid, "a", "anthropic"), store.conversation_id(
        uid, "b", "anthropic")


def test_the_frames_search_ranks_the_leaning_conversation_as_its_own(store: Store) -> None:
    """The best row is the second conversation's: it is the one ranked again by its own
    counts. A chat leaning to the first gets the first ranked so instead, its cooking turn
    first among its rows (the scan's `again`)."""
    uid, a, b = two_conversations(store)
    scanner = Scanner(store, one_person=True)
    query = "What did John cook?"
    plain = frame_read.search(scanner, query, uid, time.time())
    assert plain[0].conversation_id == b
    leaning = frame_read.search(scanner, query, uid, time.time(), lean=((a, 1.0),))
    want = subject.ranked(query, scanner.search(query, uid, limit=subject.DEPTH, again=a))
    assert [h.item_id for h in leaning] == [h.item_id for h in want]
    assert [h.text for h in leaning if h.conversation_id == a][0].startswith("John: I cooked")


def test_a_chats_plan_carries_its_leaning(tmp_path: Path) -> None:
    """Each question's frame adds its hits' shares to the chat's leaning, which its plan
    hands to the next question's frame."""
    store = open_memory(tmp_path / "memory.db")
    try:
        two_conversations(store)
        pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                            trust_identity=True, personal=True))
        history: list[dict[str, str]] = []
        leans: list[frame_lean.Lean] = []
        for k, question in enumerate(["Who had the mushroom risotto?", "What did John cook?"]):
            history.append({"role": "user", "content": question})
            d = pipeline.prepare(chat_request("u", "chat", 1_700_100_000.0 + 60 * k, history))
            assert d.recall is not None and d.frame is not None and d.recall.plan is not None
            assert d.recall.plan.lean == frame_lean.after(leans[-1] if leans else (),
                                                          d.frame.ranked)
            leans.append(d.recall.plan.lean)
            history.append({"role": "assistant", "content": "Noted."})
    finally:
        store.close()


def test_a_chat_keeps_when_it_was_away_from_each_conversation() -> None:
    """About 1, then 2 from clock 100 (1 is left then), back to 1 at 900: 1's pause is 100 to
    900, and stays so while the chat is about 1; it goes once it ended heat.WINDOW ago."""
    asked = frame_lean.moved(frame_lean.FRESH, 1, 0.0)
    assert asked == frame_lean.Asked(1, ()) and frame_lean.paused(asked, 0.0, {1: 1.0}) == ()
    asked = frame_lean.moved(asked, 2, 100.0)
    assert asked.spans == ((1, 100.0, frame_lean.AWAY),)
    assert frame_lean.paused(asked, 100.0, {}) == ()
    asked = frame_lean.moved(asked, 1, 900.0)
    assert frame_lean.paused(asked, 900.0, {}) == (heat.Paused(1, 100.0, 900.0),)
    later = frame_lean.moved(asked, 1, 1_000.0)
    assert frame_lean.paused(later, 1_000.0, {}) == (heat.Paused(1, 100.0, 900.0),)
    # About 3 now: 1 is left again; 2, left at 900 and still away, is paused too where the
    # question's hits reach it with REACH of their shares.
    elsewhere = frame_lean.moved(later, 3, 1_200.0)
    assert frame_lean.paused(elsewhere, 1_200.0, {2: frame_lean.REACH, 1: 0.01}) == (
        heat.Paused(2, 900.0, 1_200.0),)
    assert frame_lean.moved(asked, 1, 901.0 + heat.WINDOW).spans == ((2, 900.0, frame_lean.AWAY),)


def test_a_paused_conversations_rows_cool_only_outside_the_pause(store: Store) -> None:
    """Rows a chat left warm in a conversation are as warm when it comes back as when it left;
    the other conversation's rows, and the rows reheated while it was away, cool on the
    person's clock."""
    uid, a, b = two_conversations(store)
    of = store.db.connection().execute("SELECT i.id, m.conversation_id FROM item i JOIN message m"
                                       " ON m.id = i.message_id ORDER BY i.id").fetchall()
    first, second = [i for i, c in of if c == a][:2]
    other = next(i for i, c in of if c == b)
    start = heat.clock(store.db, uid)
    half = heat.HALF_LIFE[Kind.TEXT]
    heat.reheat(store.db, start, {first: 2.0, other: 2.0})
    heat.reheat(store.db, start + 20 * half, {second: 2.0})  # another subject's hit, meanwhile
    now = start + 41 * half
    assert heat.warm_set(store.db, uid, now, {}).item_ids.size == 0
    pause = heat.Paused(a, start + half, start + 40 * half)
    warm = heat.warm_set(store.db, uid, now, {}, paused=[pause])
    # 39 half-lives paused of 41: the first's reheat and the others' births are 2 old.
    want = {i: heat.BIRTH_PEAK / 4 for i, c in of if c == a and i != second} | {first: 2.0 / 4}
    got = dict(zip(warm.item_ids.tolist(), warm.warmth.tolist(), strict=True))
    assert got == pytest.approx(want)


def test_a_chats_plan_carries_when_it_left_each_conversation(tmp_path: Path) -> None:
    """A chat asks about the first conversation, then the second, then the first again: its
    plan keeps when it left the first, and the frame that comes back to it reads the rows the
    first question left warm there with that pause (heat.Paused)."""
    store = open_memory(tmp_path / "memory.db")
    try:
        uid, a, b = two_conversations(store, PERSONAL)
        pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                            trust_identity=True, personal=True))
        history: list[dict[str, str]] = []
        clocks, asked = [], []
        # The second question's words are in the second conversation alone.
        for k, question in enumerate(["Who had the mushroom risotto?", "Which fish?",
                                      "What did John cook for his sister?"]):
            history.append({"role": "user", "content": question})
            clocks.append(heat.clock(store.db, uid))
            d = pipeline.prepare(chat_request("u", "chat", 1_700_100_000.0 + 60 * k, history))
            assert d.recall is not None and d.recall.plan is not None and d.job is not None
            asked.append(d.recall.plan.asked)
            turn = pipeline.store_turn(d.job.pending)
            pipeline.store_reply(turn, Reply(Message("assistant", (text_part("Noted."),)),
                                             Usage()), 1_700_100_001.0 + 60 * k, d.job.pending)
            history.append({"role": "assistant", "content": "Noted."})
        assert [x.subject for x in asked] == [a, b, a]
        assert asked[1].spans == ((a, clocks[1], frame_lean.AWAY),)
        assert asked[2].spans[0] == (b, clocks[2], frame_lean.AWAY)
        assert (a, clocks[1], clocks[2]) in asked[2].spans
    finally:
        store.close()
