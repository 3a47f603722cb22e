"""Which conversation a chat's question is about (frame/lean.py): its own hits, tipped by what
the chat asked before, carried in the chat's plan from question to question."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from perpetuity_core.cli.eval import chat_request
from perpetuity_core.frame import build as frame
from perpetuity_core.frame import lean as frame_lean
from perpetuity_core.frame import read as frame_read
from perpetuity_core.frame import subject
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.derived import bm25, heat, view
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
    first among its rows (the scan's `again`), in its own hits and in the weighed ones."""
    uid, a, b = two_conversations(store)
    scanner = Scanner(store, one_person=True)
    query = "What did John cook?"
    plain = frame_read.search(scanner, query, uid, time.time())
    assert plain[0].conversation_id == b
    lean = ((a, 1.0),)
    own, leaning = frame_read.searched(scanner, query, uid, time.time(), lean=lean)
    plain_again, weighed = scanner.weighed(
        query, uid, lambda convs, held: frame_lean.prior(lean, None, convs, held),
        limit=subject.DEPTH, again=a)
    assert [h.item_id for h in own] == [h.item_id for h in subject.ranked(query, plain_again)]
    assert [h.item_id for h in leaning] == [h.item_id for h in subject.ranked(query, weighed)]
    assert [h.text for h in own if h.conversation_id == a][0].startswith("John: I cooked")


def test_the_leaning_weighs_each_conversations_rows_in_the_scan(store: Store) -> None:
    """The second conversation's turns match the question best. A chat leaning to the first
    weighs the other's scores by LEAN_FLOOR ** LEAN_POWER (frame_lean.prior): the first's
    cooking turn comes first. Words alone, every row scores its own score times its
    conversation's weight; the plain ranking beside it is the scan's without one."""
    uid, a, b = two_conversations(store)
    query = "What did John cook?"
    lean = ((a, 1.0), (b, 0.01))
    leaning = frame_read.search(Scanner(store, one_person=True), query, uid, time.time(),
                                lean=lean)
    assert leaning[0].text.startswith("John: I cooked")
    words = Scanner(store, one_person=True, params=bm25.Params(semantic=0.0, feedback=0.0))
    rest = frame_lean.LEAN_FLOOR ** frame_lean.LEAN_POWER
    weight = {a: 1.0, b: rest}
    plain, weighed = words.weighed(query, uid, lambda convs, held: frame_lean.prior(
        lean, None, convs, held), 20)
    assert ranks(plain) == ranks(words.search(query, uid, 20))
    assert {h.item_id: h.score for h in weighed} == {
        h.item_id: h.score * weight[h.conversation_id] for h in plain}
    assert frame_lean.prior((), None, [a], everything) is None
    assert frame_lean.prior(((a, 2.0), (b, 0.5)), None, [a], everything) == view.Prior(
        (a, b), (1.0, 0.25 ** frame_lean.LEAN_POWER), rest)
    # The asking chat's own rows weigh whole, the others against the largest of theirs; one
    # memory per conversation (the data's and the chat's) every weight is 1: as without one.
    assert frame_lean.prior(((a, 0.5), (b, 2.0), (7, 0.25)), b, [b], everything) == view.Prior(
        (a, b, 7), (1.0, 1.0, 0.5 ** frame_lean.LEAN_POWER), rest)
    assert frame_lean.prior(((b, 2.0),), b, [b], everything) is None


def everything(conv: int) -> float:
    return 1.0


@pytest.mark.parametrize(("hits", "held", "weighs"), [
    ([2, 2, 1], {1: 0.6, 2: 0.9}, False),  # its own hits point to 2, whose rows hold more
    ([2, 2, 1], {1: 0.9, 2: 0.9}, True),  # 1 holds as much of its words: misleading words
    ([2, 2, 1], {1: 0.95, 2: 0.9}, True),
    ([2] * 40 + [1], {1: 0.9, 2: 0.9}, False),  # as many of its words, but its hits hardly reach 1
    ([1, 2, 2], {1: 0.6, 2: 0.9}, False),  # most share by rank peaks is still 2's
    ([1, 1, 2], {1: 0.6, 2: 0.9}, True),  # they point to the leaning's: nothing to gate
    ([3, 3, 2, 1], {1: 0.6, 2: 0.9, 3: 0.0}, False),  # the asking chat's own hits skipped
    ([], {1: 0.0}, True),  # no hits: the leaning alone
])
def test_the_weight_holds_only_where_the_questions_words_do_not_point_away(
        hits: list[int], held: dict[int, float], weighs: bool) -> None:
    """A chat leaning to conversation 1 (asking in 3): its scan is weighed unless the
    conversation its own hits reach most is another, and either holds more of the question's
    words by weight than 1 does (a change of subject names what only the new conversation
    says) or its hits reach 1 with less than REACH of their shares."""
    got = frame_lean.prior(((1, 1.0), (2, 0.3), (3, 5.0)), 3, hits, held.__getitem__)
    assert (got is not None) == weighs
    if weighs:
        assert got == frame_lean.prior(((1, 1.0), (2, 0.3), (3, 5.0)), 3, hits, everything)


def test_a_question_naming_what_only_another_conversation_holds_is_not_weighed(
        store: Store) -> None:
    """Leaning to the first conversation, "What did Tim cook?" names Tim, whom only the
    second holds: the frame reads the question's own hits. "What did John cook?" names what
    both hold: the weighed ones, the first's cooking turn on top (scan.held's shares)."""
    uid, a, b = two_conversations(store)
    scanner = Scanner(store, one_person=True)
    lean = ((a, 1.0),)
    own, read = frame_read.searched(scanner, "What did Tim cook?", uid, time.time(), lean=lean)
    assert own[0].conversation_id == b and ranks(read) == ranks(own)
    own, read = frame_read.searched(scanner, "What did John cook?", uid, time.time(), lean=lean)
    assert own[0].conversation_id == b and read[0].text.startswith("John: I cooked")


def test_the_leaning_learns_from_the_questions_own_hits(store: Store) -> None:
    """A chat leaning to the first conversation asks what the second one's turns answer: its
    frame reads the weighed ranking, the first's cooking turn on top, but the leaning it
    hands on grows by the question's own hits, the second's, as without the weight. Fed by
    the weighed hits, a leaning weighs the next scan by what it weighed itself, and a chat
    that changes its subject stays locked in (docs/tuning.md)."""
    uid, a, b = two_conversations(store)
    scanner = Scanner(store, one_person=True)
    query, at, lean = "What did John cook?", time.time(), ((a, 1.0),)
    built = frame.build(scanner, user_id=uid, conversation_id=None, query=query,
                        exclude_messages=(), asked_at=at, limits=Cap(), lean=lean)
    assert built is not None
    assert built.ranked[0].conversation_id == a  # the weighed ranking
    own = frame_read.searched(scanner, query, uid, at, lean=lean)[0]
    assert own[0].conversation_id == b
    assert built.lean == frame_lean.after(lean, own) != frame_lean.after(lean, built.ranked)
    assert dict(built.lean)[b] > dict(frame_lean.after(lean, built.ranked))[b]


def ranks(hits: list[Hit]) -> list[tuple[int, float]]:
    return [(h.item_id, h.score) for h in hits]


def test_a_chats_plan_carries_its_leaning(tmp_path: Path) -> None:
    """Each question's frame adds its own hits' shares to the chat's leaning, which its plan
    hands to the next question's frame (what the shares are: the test above)."""
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
            assert d.recall.plan.lean == d.frame.lean
            if not leans:  # no leaning yet: its own hits are the frame's (no weight)
                assert d.frame.lean == frame_lean.after((), d.frame.ranked)
            else:
                assert d.frame.lean != leans[-1] and dict(d.frame.lean).keys() >= dict(
                    leans[-1]).keys()
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
