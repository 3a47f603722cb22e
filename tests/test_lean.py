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
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Message, Provider, text_part


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


def two_conversations(store: Store) -> tuple[int, int, int]:
    """One person's two conversations, both about a John: in the first, the turn about his
    cooking is one of many naming him; the second names him less and cooks more."""
    first = ["John: I cooked a mushroom risotto for my sister", *(
        f"John: John here, John again about the {w}" for w in ("car", "rent", "dog", "trip"))]
    second = ["John: we cook together on Sundays", "John: cook the pasta first",
              "Tim: did you cook the fish?", "Tim: cook it slowly"]
    for key, turns in (("a", first), ("b", second)):
        capture.record(store, user_key="u", conversation_key=key, provider="anthropic",
                       model="m", messages=[Message("user", (text_part(t),)) for t in turns],
                       times=[1_700_000_000.0 + i for i in range(len(turns))], source="import")
    uid = store.find_user("u")
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
