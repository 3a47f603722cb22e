"""The question's subject (frame/subject.py): the rows said by whom a question is about rank
higher among its hits, a step of its own after the scan, whose top-k stays the fused score's
(tests/test_retrieval.py). `reference` is the rule written out plainly."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from perpetuity_core.frame import read as frame_read
from perpetuity_core.frame import select as frame_select
from perpetuity_core.frame import subject
from perpetuity_core.frame.render import cost
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, text_part


def hit(k: int, text: str, score: float, role: str = "user") -> Hit:
    return Hit(k, k, 1, 1, role, 0.0, score, text, seq=k)


def reference(query: str, hits: list[Hit], owner: int | None = None) -> list[Hit]:
    """The rule plainly: who the subject is, then a stable sort of the first DEPTH hits by
    score, the subject's times (1 + SUBJECT), an `owner`'s rows before the others'."""
    head = hits[:subject.DEPTH]
    question = set(query.replace("'s", "").replace("?", "").split())
    speakers = {h.text.split(": ")[0] for h in head if ": " in h.text and h.text[0].isupper()}
    named = {s for s in speakers if s in question}
    if len(named) == 1:
        def said(h: Hit) -> bool:
            return h.text.split(": ")[0] in named
    elif not named and {w.lower() for w in question} & {"i", "me", "my", "mine", "myself"}:
        def said(h: Hit) -> bool:
            return h.role == "user" and not (": " in h.text and h.text[0].isupper())
    else:
        return hits
    return sorted(head, key=lambda h: (owner is not None and h.user_id != owner,
                                       -h.score * (1 + subject.SUBJECT if said(h) else 1))
                  ) + hits[subject.DEPTH:]


TRANSCRIPT = [hit(1, "Caroline: Thanks, Melanie! Your family is lovely.", 9.0),
              hit(2, "Melanie: We went camping with the kids.", 6.0, "assistant"),
              hit(3, "Caroline: I joined a support group.", 5.0),
              hit(4, "Melanie: Pottery class was fun.", 4.0, "assistant")]
CHAT = [hit(1, "The sprint ends when the review is done; a sprint review closes it.", 9.0,
            "assistant"),
        hit(2, "I set my first sprint to end on Friday.", 5.0),
        hit(3, "Note: a reminder I pasted.", 4.0)]


@pytest.mark.parametrize(("query", "hits", "order"), [
    ("What has Melanie done with her family?", TRANSCRIPT, [2, 1, 4, 3]),
    ("What is Melanie's favourite activity?", TRANSCRIPT, [2, 1, 4, 3]),
    ("What did Caroline join?", TRANSCRIPT, [1, 3, 2, 4]),
    ("What have Caroline and Melanie both done?", TRANSCRIPT, [1, 2, 3, 4]),  # two: no subject
    ("What did they do?", TRANSCRIPT, [1, 2, 3, 4]),
    ("When does my first sprint end?", CHAT, [2, 1, 3]),  # the person's own turns
    ("When does the sprint end?", CHAT, [1, 2, 3]),
    ("What did the note say about my sprint?", CHAT, [2, 1, 3]),  # "Note:" is not named
])
def test_the_subjects_rows_rank_higher(query: str, hits: list[Hit], order: list[int]) -> None:
    got = subject.ranked(query, hits)
    assert [h.item_id for h in got] == order
    assert got == reference(query, hits)
    assert [h.score for h in sorted(got, key=lambda h: h.item_id)] == [h.score for h in hits]


def test_a_shared_pools_own_rows_stay_first() -> None:
    """A shared pool ranks the asker's own rows first (scan.Scanner, share_pool): the subject's
    re-order moves rows within the asker's and within the others', never one of theirs above
    one of the asker's."""
    def of(user: int, k: int, text: str, score: float) -> Hit:
        return Hit(k, k, user, user, "user", 0.0, score, text, seq=k, tokens=20)

    hits = [of(1, 1, "Bo: the budget, in detail.", 3.0), of(1, 2, "Ann: my budget is 40.", 2.0),
            of(2, 3, "Ann: the budget spreadsheet.", 9.0), of(2, 4, "Bo: the budget.", 8.0)]
    got = subject.ranked("What is Ann's budget?", hits, owner=1)
    assert [h.item_id for h in got] == [2, 1, 3, 4]
    assert got == reference("What is Ann's budget?", hits, owner=1)
    assert [h.item_id for h in subject.ranked("What is Ann's budget?", hits)] == [3, 4, 2, 1]


def test_only_the_first_hits_are_reordered() -> None:
    head = [hit(k, f"Caroline: talk {k}", 100.0 - k * 0.01) for k in range(subject.DEPTH - 1)]
    hits = [*head, hit(500, "Melanie: inside the depth", 60.0, "assistant"),
            hit(999, "Melanie: past the depth", 50.0, "assistant"), hit(1000, "Caroline: x", 0.5)]
    got = subject.ranked("What did Melanie say?", hits)
    assert got[0].item_id == 500  # 60 as 120, before 100
    assert [h.item_id for h in got[-2:]] == [999, 1000]  # past DEPTH: as they were
    assert got == reference("What did Melanie say?", hits)


def test_the_frames_search_ranks_the_named_speakers_turns_first(store: Store) -> None:
    """Through the store and the scan: the other speaker's turns that name Melanie score
    higher; the frame's search puts hers first, the scan's order stays the score's."""
    turns = ["Caroline: Melanie, your family sounds great, Melanie!",
             "Melanie: We went camping with the kids last weekend.",
             "Caroline: Melanie, family matters most, Melanie.",
             "Melanie: I signed up for a pottery class."]
    capture.record(store, user_key="u", conversation_key="c", provider="anthropic", model="m",
                   messages=[Message("user" if i % 2 == 0 else "assistant", (text_part(t),))
                             for i, t in enumerate(turns)],
                   times=[1_700_000_000.0 + i for i in range(len(turns))], source="import")
    uid = store.find_user("u")
    assert uid is not None
    scanner = Scanner(store)
    query = "What activities has Melanie done with her family?"
    scanned = scanner.search(query, uid, limit=10)
    assert scanned[0].text.startswith("Caroline:")  # the score alone: the one naming her
    found = frame_read.search(scanner, query, uid, time.time())
    assert found[0].text.startswith("Melanie:")
    assert [h.item_id for h in found] == [h.item_id for h in subject.ranked(query, scanned)]
    # An agent's prompt is left in the scan's order.
    agent = frame_read.search(scanner, query, uid, time.time(), chat=False)
    assert [h.item_id for h in agent] == [h.item_id for h in scanned]


def test_the_fill_weighs_the_subjects_rows_higher() -> None:
    """Equally warm rows of one conversation, room for two: the subject's go in."""
    def row(i: int, text: str, role: str) -> Row:
        return Row(i, i, 1, "c", role, 0.0, Kind.TEXT.value, "", text)

    rows = {1: row(1, "Caroline: Melanie, you look well.", "user"),
            2: row(2, "Caroline: Melanie, thanks again.", "user"),
            3: row(3, "Melanie: We went camping.", "assistant"),
            4: row(4, "Melanie: Pottery was fun.", "assistant")}
    warm = heat.Warm(np.array([1, 2, 3, 4], np.int64), np.array([1.0, 1.0, 0.8, 0.8]))
    flags = subject.said("What has Melanie done?", [(r.text, r.role) for r in rows.values()])
    assert flags == [False, False, True, True]
    said = {i for i, f in zip(rows, flags, strict=True) if f}

    def measure(base: list[int], added: list[int]) -> Callable[[int], int]:
        return lambda k: sum(cost(rows[i]) for i in base + added[:k])

    room = cost(rows[1]) + cost(rows[2])
    assert sorted(frame_select.fill(rows, warm, set(), room, measure, {1: 1.0})) == [1, 2]
    assert sorted(frame_select.fill(rows, warm, set(), room, measure, {1: 1.0}, said)) == [3, 4]


def test_the_fill_weighs_the_subjects_rows_above_their_ranks_weight() -> None:
    """The subject's row at 0.45 of the other's warmth (its rank already counts the subject
    once), the same length, room for one: at (1 + FILL_SUBJECT) it goes in, where at the
    ranking's own (1 + SUBJECT) the other speaker's row took the room. LoCoMo in sequence:
    docs/tuning.md."""
    rows = {1: Row(1, 1, 1, "c", "user", 0.0, Kind.TEXT.value, "", "Caroline: Melanie, hi!"),
            2: Row(2, 2, 1, "c", "assistant", 0.0, Kind.TEXT.value, "", "Melanie: We camped out.")}
    assert cost(rows[1]) == cost(rows[2])
    warm = heat.Warm(np.array([1, 2], np.int64), np.array([1.0, 0.45]))
    said = {2}
    assert (1 + subject.SUBJECT) * 0.45 < 1.0 < (1 + frame_select.FILL_SUBJECT) * 0.45

    def measure(base: list[int], added: list[int]) -> Callable[[int], int]:
        return lambda k: sum(cost(rows[i]) for i in base + added[:k])

    assert frame_select.fill(rows, warm, set(), cost(rows[1]), measure, {1: 1.0}, said) == [2]
