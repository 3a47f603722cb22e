"""The frame's fill (frame_select.fill): the rows it chooses fit the budget as rendered, labels
and all, and are as many as their order allows; mandatory rows are never dropped."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core.frame import build as frame
from perpetuity_core.frame import cap
from perpetuity_core.frame import render as frame_render
from perpetuity_core.frame import select as frame_select
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.bm25 import Params
from perpetuity_core.memory.derived.scan import Hit, Scanner
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind
from tests.test_frame import prefixes_of, say

ASKED = 1_700_100_000.0


def test_a_memory_of_many_small_conversations_fills_its_frame(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each short exchange is its own conversation, so each row comes with a label of its own
    and the frame as rendered is twice its rows' estimate: the fill once dropped every row but
    the mandatory ones. Now it is filled to within frame_select.FULL of its budget, never over,
    in one layout, the frame's (a layout is most of a first prompt's selection, issue 24: the
    search measured up to 1 + SEARCHES of them)."""
    for n in range(300):
        say(store, f"chat-{n}", f"what about the parcel number {n}?", f"parcel {n} is on its way")
    layouts = []
    real = frame_render.lay

    def counted(rows: dict[int, Row], ids: list[int], *args: Any) -> list[frame_render.Run]:
        layouts.append(len(ids))
        return real(rows, ids, *args)

    monkeypatch.setattr(frame_render, "lay", counted)
    uid = store.find_user("u")
    assert uid is not None
    built = frame.build(Scanner(store), user_id=uid, conversation_id=None,
                        query="parcel 7", exclude_messages=[], asked_at=time.time(),
                        limits=cap.Cap())
    assert built is not None
    assert len(built.item_ids) > 10 * len(built.must)
    assert built.tokens <= built.budget
    assert built.tokens * 100 >= built.budget * frame_select.FULL
    assert layouts == [len(built.item_ids)]


def _row(i: int, conversation: int, message: int, words: int) -> Row:
    return Row(i, message, conversation, f"chat {conversation}", "user" if message % 2 else
               "assistant", ASKED - 86_400 * conversation - 60 * message, Kind.TEXT.value, "",
               "word " * words)


# (conversation, message within it, words) of each row; each message one row.
_ROWS = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 20), st.integers(0, 400)),
                 min_size=1, max_size=120, unique_by=lambda r: (r[0], r[1]))


@settings(max_examples=200, deadline=None)
@given(rows=_ROWS, warmth=st.lists(st.floats(0.01, 1.0), min_size=120, max_size=120),
       must=st.sets(st.integers(0, 119), max_size=6), tokens=st.integers(0, 6000))
def test_the_fill_fits_its_budget_as_rendered_and_keeps_every_mandatory_row(
        rows: list[tuple[int, int, int]], warmth: list[float], must: set[int],
        tokens: int) -> None:
    shown = {i: _row(i, c, 1_000 * c + m, w) for i, (c, m, w) in enumerate(rows)}
    must = {i for i in must if i in shown}
    adjacent = {(r.message_id, r.message_id + 1) for r in shown.values()}
    warm = heat.Warm(np.array(sorted(shown), dtype=np.int64),
                     np.array(warmth[:len(shown)], dtype=np.float64))

    def measure(ids: list[int]) -> int:
        laid = frame_render.lay(shown, ids, (), adjacent, ASKED, None)
        return frame_render.tokens(laid, ASKED)

    new = frame_select.fill(shown, warm, must, tokens, prefixes_of(measure))
    assert len(new) == len(set(new)) and set(new) <= set(shown)
    assert must <= set(new)
    if set(new) - must:
        assert measure(new) <= tokens


def test_a_chats_fill_counts_its_hits_neighbours_at_a_share(store: Store) -> None:
    """The turn beside a hit warms with it, and that reheat is written whole (the next
    question's heat), but a chat's fill counts it at FILL_NEIGHBOUR: a hit is evidence more
    often than the turn beside one. An agent's frame counts it whole."""
    say(store, "c", "one", "two", "how was the weekend", "we went to the coast",
        "the heron nested on the pier", "lovely, what else", "nothing much", "three", "four")
    uid = store.find_user("u")
    assert uid is not None
    # Words alone: the table's cosine would make every turn of the conversation a hit.
    scanner = Scanner(store, params=Params(semantic=0.0))
    chat, agent = (frame.build(scanner, user_id=uid, conversation_id=None, query="heron pier",
                               exclude_messages=[], asked_at=ASKED, limits=cap.Cap(), agent=a)
                   for a in (False, True))
    assert chat is not None and chat.warm is not None
    assert agent is not None and agent.warm is not None
    hits = {h.item_id for h in chat.ranked}
    beside = [i for i in chat.reheats if i not in hits]  # "one" and "four"
    assert len(beside) == 2
    seen = dict(zip(chat.warm.item_ids.tolist(), chat.warm.warmth.tolist(), strict=True))
    whole = dict(zip(agent.warm.item_ids.tolist(), agent.warm.warmth.tolist(), strict=True))
    for i in beside:  # written whole, counted at a share
        assert chat.reheats[i] == agent.reheats[i] > 0
        assert whole[i] >= chat.reheats[i] > seen[i]
    assert all(seen[i] == whole[i] == chat.reheats[i] for i in hits)


def test_fill_reheats_keeps_the_hits_and_shares_the_rest() -> None:
    hits = [Hit(1, 1, 1, 1, "user", 0.0, 3.0, "a", seq=1)]
    got = frame_select.fill_reheats({1: 2.0, 2: 1.0}, hits)
    assert got == {1: 2.0, 2: frame_select.FILL_NEIGHBOUR}
