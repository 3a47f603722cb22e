"""What the request path keeps between calls is never stale where it matters: rows and hits
kept after a read (memory.storage.kept) are never shown once purged, never reach another user
or another database, and carry a conversation's name as it is now. And the fast paths of a
first prompt's frame give what the obvious code gave, on random input."""

from __future__ import annotations

import random
from collections.abc import Collection
from datetime import UTC, datetime

import numpy as np
import pytest

from perpetuity_core.frame import build as frame
from perpetuity_core.frame import cap
from perpetuity_core.frame import render as frame_render
from perpetuity_core.frame.rows import quoted, time_label
from perpetuity_core.frame.tenants import withheld
from perpetuity_core.memory.derived import heat, index, scan
from perpetuity_core.memory.derived.view import Visibility
from perpetuity_core.memory.jobs import maintenance
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.reads import Row, following, shown_rows
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind
from tests.test_frame import say
from tests.test_retrieval import add


def items_of(store: Store, message_ids: list[int]) -> list[int]:
    marks = ",".join("?" * len(message_ids))
    return [i for (i,) in store.db.translated().execute(
        f"SELECT id FROM item WHERE message_id IN ({marks}) ORDER BY id", message_ids)]


def test_a_purged_row_is_never_shown_from_what_was_kept(store: Store) -> None:
    msgs = say(store, "c", "the harbour master is called Ines", "noted, Ines",
               "the ferry leaves at noon")
    items = items_of(store, msgs)
    assert [r.text for r in shown_rows(store.db, items).values()] == [
        "the harbour master is called Ines", "noted, Ines", "the ferry leaves at noon"]
    index.purge(store, items[:1])
    assert list(shown_rows(store.db, items)) == items[1:]
    # Nor through the frame: the warm set and the hits still name ids the cache held.
    scanner = scan.Scanner(store, store_rows=0)
    uid = store.find_user("u")
    for _ in range(2):  # a first frame fills what is kept, the second reads through it
        built = frame.build(scanner, user_id=uid, conversation_id=None,
                            query="harbour master Ines", exclude_messages=[],
                            asked_at=1_700_100_000.0, limits=cap.Cap())
        assert built is not None
        assert items[0] not in built.rows and items[0] not in built.item_ids
        assert "noted, Ines" in "".join(p.text for m in built.messages for p in m.parts)


def test_a_purged_hit_is_never_found_from_what_was_kept(store: Store) -> None:
    alice = add(store, "alice", "a1", ["garden violin", "violin lessons"])
    add(store, "bob", "b1", ["garden tomatoes"])
    scanner = scan.Scanner(store, store_rows=0)
    assert {h.item_id for h in scanner.search("garden violin", None, 10)} >= set(alice)
    view = scanner.arena.view
    ranked = view.top(view.query(store.db.dictionary, "garden violin", scanner.params), 10,
                      Visibility(None))
    maintenance.purge_user(store, "alice")
    # A ranking made before the purge (a search the purge overtook) reads none of its rows.
    assert not {h.item_id for h in scan.fetch_hits(store.db, ranked)} & set(alice)
    assert not {h.item_id for h in scanner.search("garden violin", None, 10)} & set(alice)
    assert [h.text for h in scanner.search("garden", None, 10)] == ["garden tomatoes"]


def test_two_users_never_share_what_was_kept(store: Store) -> None:
    mine = items_of(store, say(store, "c", "my locker code is 4471", user="ann"))
    assert [r.text for r in shown_rows(store.db, mine).values()] == ["my locker code is 4471"]
    bob = store.user_id("bob")
    assert shown_rows(store.db, mine, bob) == {}  # kept for ann, still not bob's
    ann = store.find_user("ann")
    assert [r.text for r in shown_rows(store.db, mine, ann).values()] == [
        "my locker code is 4471"]


def test_two_databases_never_share_what_was_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b = open_memory(tmp_path / "a.db"), open_memory(tmp_path / "b.db")
    try:
        in_a = items_of(a, say(a, "c", "written to the first file"))
        in_b = items_of(b, say(b, "c", "written to the second file"))
        assert in_a == in_b  # the same ids in each file
        assert [r.text for r in shown_rows(a.db, in_a).values()] == ["written to the first file"]
        assert [r.text for r in shown_rows(b.db, in_b).values()] == ["written to the second file"]
    finally:
        a.close()
        b.close()


def test_a_new_file_at_an_old_path_never_reads_what_was_kept_of_the_old(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Which message follows which is kept per database, never per path: a new file there
    numbers its messages from 1 again, in other conversations."""
    path = tmp_path / "m.db"
    old = open_memory(path)
    a = say(old, "a", "one", "two", "three")
    assert following(old.db, [(a[0], a[1]), (a[0], a[2])]) == {(a[0], a[1])}
    old.close()
    path.unlink()
    new = open_memory(path)
    try:
        first, = say(new, "a", "one")
        say(new, "b", "elsewhere")
        third, = say(new, "a", "three")
        assert (first, third) == (a[0], a[2])  # the same ids, a message of b between them
        assert following(new.db, [(first, third)]) == {(first, third)}
    finally:
        new.close()


def test_a_kept_row_carries_its_conversation_name_as_it_is_now(store: Store) -> None:
    items = items_of(store, say(store, "c", "we planned the garden shed"))
    before = shown_rows(store.db, items)[items[0]]
    uid = store.find_user("u")
    conv = store.find_conversation(uid, "c")
    assert conv is not None
    store.name_conversation(conv, title="Garden shed plans")
    after = shown_rows(store.db, items)[items[0]]
    assert after.conversation != before.conversation
    assert after.conversation.startswith('"Garden shed plans"')
    assert after.text == before.text


def frame_texts(store: Store, query: str, asked_at: float,
                said: frame_render.Said | None) -> list[tuple[str, tuple[str, ...]]]:
    built = frame.build(scan.Scanner(store, store_rows=0), user_id=store.find_user("u"),
                        conversation_id=None, query=query, exclude_messages=[],
                        asked_at=asked_at, limits=cap.Cap(), said=said)
    assert built is not None
    return [(m.role, tuple(p.text for p in m.parts)) for m in built.messages]


def test_a_frame_said_before_is_never_stale(store: Store) -> None:
    """Messages kept by their text (render.Said) are handed on only where the text is the
    same: a frame built through what was kept is the frame built afresh, after a row is
    purged, a conversation renamed, new rows stored or the asking day moved on."""
    items = items_of(store, say(store, "c", "the harbour master is called Ines", "noted, Ines",
                                "the ferry leaves at noon", "and returns at six"))
    said = frame_render.Said()
    day = shown_rows(store.db, items)[items[0]].at + 60  # asked the day the rows were said
    query = "harbour master Ines ferry"
    first = frame_texts(store, query, day, said)
    assert first == frame_texts(store, query, day, None)
    again = frame.build(scan.Scanner(store, store_rows=0), user_id=store.find_user("u"),
                        conversation_id=None, query=query, exclude_messages=[], asked_at=day,
                        limits=cap.Cap(), said=said)
    assert again is not None and all(  # the same text: the same objects
        m is said.message(m.role, [p.text for p in m.parts]) for m in again.messages)

    def changed(asked_at: float, must: str, gone: str) -> None:
        got = frame_texts(store, query, asked_at, said)
        assert got == frame_texts(store, query, asked_at, None)
        text = "\n".join(t for _, parts in got for t in parts)
        assert must in text and gone not in text, text

    changed(day + 86_400, "yesterday", "earlier today")  # the asking day moved on
    changed(day + 3 * 86_400, "3 days before", "yesterday")
    index.purge(store, items[1:2])
    changed(day, "the ferry leaves at noon", "noted, Ines")
    conv = store.find_conversation(store.find_user("u"), "c")
    assert conv is not None
    store.name_conversation(conv, title="Harbour notes")
    changed(day, '"Harbour notes"', "noted, Ines")
    say(store, "c", "the harbour master retires in May")
    changed(day, "retires in May", "noted, Ines")


def test_what_was_said_is_kept_within_its_bounds() -> None:
    """Least recently used go first, past the count or the characters; the role is of the
    key, and so is where the text is parted."""
    said = frame_render.Said(messages=2, chars=100)
    a, b = said.message("user", ["aaaa"]), said.message("assistant", ["bbbb"])
    assert said.message("user", ["aaaa"]) is a  # now the most recent
    said.message("user", ["cc"])  # past the count: b goes
    assert said.message("user", ["aaaa"]) is a and said.message("assistant", ["bbbb"]) is not b
    said = frame_render.Said(messages=10, chars=10)
    a, b = said.message("user", ["aaaa"]), said.message("user", ["bbbb"])
    said.message("user", ["cc"])  # 10 characters: all kept
    assert said.message("user", ["aaaa"]) is a  # b is now the least recent
    said.message("user", ["d"])  # 11: b goes
    assert said.message("user", ["aaaa"]) is a and said.message("user", ["bbbb"]) is not b
    apart = said.message("assistant", ["aaaa"])
    assert apart.role == "assistant" and apart is not said.message("user", ["aaaa"])
    split = said.message("user", ["a", "aaa"])
    assert [p.text for p in split.parts] == ["a", "aaa"]


# --------------------------------------------------------------------------- reference checks


def reference_peaks(reheats: dict[int, float], ids: np.ndarray) -> np.ndarray:
    """heat.warm_set's reheat peaks as they were looked up: one dict lookup a row."""
    return np.fromiter((reheats.get(int(i), 0.0) for i in ids), float, len(ids))


@pytest.mark.parametrize("seed", range(20))
def test_reheat_peaks_are_the_dict_lookup(seed: int) -> None:
    rng = random.Random(seed)
    ids = np.array(sorted(rng.sample(range(1, 5_000), rng.randint(1, 400))), np.int64)
    rng.shuffle(ids)
    reheats = {rng.choice([int(i) for i in ids] + list(range(5_000, 5_100))): rng.random() * 2
               for _ in range(rng.randint(1, 250))}
    got = heat.reheat_peaks(reheats, ids)
    assert got.dtype == np.float64
    assert np.array_equal(got, reference_peaks(reheats, ids))


def reference_section(rows: list[Row], adjacent: Collection[tuple[int, int]], asked_at: float,
                      conversation_id: int | None) -> list[tuple[str, str]]:
    """frame.render.section as it was: a dict of each conversation's messages, and labels made
    afresh for every run."""
    def when(r: Row) -> str:
        days = (datetime.fromtimestamp(asked_at, UTC).date()
                - datetime.fromtimestamp(r.at, UTC).date()).days
        return f"[{time_label(r.at)}, {frame_render.ago(days)}]"

    def quote(r: Row) -> str:
        text = f"[{quoted(r)}]" if r.kind in (Kind.TOOL_CALL.value, Kind.TOOL_RESULT.value) \
            else r.text
        return frame_render.EXCERPT.format(r.item_id) + text if r.excerpt else text

    groups: dict[int, list[Row]] = {}
    for r in sorted(rows, key=lambda r: (r.message_id, r.item_id)):
        groups.setdefault(r.conversation_id, []).append(r)
    order = sorted(groups, key=lambda c: (c == conversation_id, groups[c][-1].at, c))
    out = []
    for c in order:
        by_message: dict[int, list[Row]] = {}
        for r in groups[c]:
            by_message.setdefault(r.message_id, []).append(r)
        previous: Row | None = None
        for parts in by_message.values():
            first = parts[0]
            text = "\n".join(withheld(p) if p.secret and c != conversation_id else quote(p)
                             for p in parts)
            if previous is None:
                where = ("this conversation" if c == conversation_id else
                         f"conversation {first.conversation}" if first.conversation
                         else "another conversation")
                label = f"[{where}, {when(first)[1:]}"
            elif not ((previous.message_id, first.message_id) in adjacent
                      and first.at - previous.at <= frame_render.RUN_GAP):
                label = (frame_render.SKIPPED if first.at - previous.at <= frame_render.RUN_GAP
                         else when(first))
            else:
                label = ""
            out.append(("assistant" if first.role == "assistant" else "user",
                        f"{label}\n{text}" if label else text))
            previous = first
    return out


def random_rows(rng: random.Random, asked: float) -> list[Row]:
    """Rows of a few conversations, shuffled: runs of messages near and far in time, text and
    tool rows, some flagged as holding a credential, text of any length."""
    rows, item, message = [], 0, 0
    for _ in range(rng.randint(1, 60)):
        message += rng.randint(1, 3)
        conv = rng.randint(1, 5)
        at = asked - rng.choice([0, 60, 1_500, 2_000, 86_400, 86_400 * 9, 86_400 * 400]) \
            * rng.random()
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            item += 1
            kind = rng.choice([Kind.TEXT, Kind.TEXT, Kind.TOOL_CALL, Kind.TOOL_RESULT])
            rows.append(Row(item, message, conv, rng.choice(["", '"Trip"', '"Shed" in home']),
                            rng.choice(["user", "assistant"]), at, kind.value,
                            "Read" if kind == Kind.TOOL_CALL else "",
                            f"said {item}" + "x" * rng.choice([0, 1, 2, 3, 7, 40]),
                            rng.choice(["", "", "", "api key"]), excerpt=rng.random() < 0.1))
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("seed", range(30))
def test_a_section_renders_as_the_obvious_code_did(seed: int) -> None:
    rng = random.Random(seed)
    asked = 1_700_000_000.0 + rng.random() * 86_400 * 400
    rows = random_rows(rng, asked)
    ids = sorted({r.message_id for r in rows})
    adjacent = {(a, b) for a, b in zip(ids, ids[1:], strict=False) if rng.random() < 0.6}
    current = rng.choice([None, 1, 2, 6])
    assert frame_render.section(rows, adjacent, asked, current) == \
        reference_section(rows, adjacent, asked, current)


@pytest.mark.parametrize("seed", range(40))
def test_a_frame_measured_unwritten_is_what_writing_it_measured(seed: int) -> None:
    """The fill measures frames by `render.tokens`, without writing their text: the tokens of
    the frame as written, which is the frame the obvious code wrote (its sections, then the
    messages under the header)."""
    rng = random.Random(seed)
    asked = 1_700_000_000.0 + rng.random() * 86_400 * 400
    rows = {r.item_id: r for r in random_rows(rng, asked)}
    ids = rng.sample(sorted(rows), rng.randint(1, len(rows)))
    recent = set(rng.sample(ids, rng.randint(0, len(ids))))
    messages = sorted({r.message_id for r in rows.values()})
    adjacent = {(a, b) for a, b in zip(messages, messages[1:], strict=False)
                if rng.random() < 0.6}
    current = rng.choice([None, 1, 2, 6])
    header = rng.choice([frame_render.HEADER, frame_render.MORE_HEADER])
    laid = frame_render.lay(rows, ids, recent, adjacent, asked, current)
    written = frame_render.written(laid, asked, header)
    assert written == frame_render.assemble(
        reference_section([rows[i] for i in ids if i not in recent], adjacent, asked, current)
        + reference_section([rows[i] for i in ids if i in recent], adjacent, asked, current),
        asked, header)
    assert frame_render.tokens(laid, asked, header) == index.messages_tokens(written)
    assert frame_render.tokens([], asked) == index.messages_tokens(
        frame_render.written([], asked)) == 0


@pytest.mark.parametrize("seed", range(60))
def test_a_prefix_measured_without_a_layout_is_its_layout_measured(seed: int) -> None:
    """The fill's search measures prefixes of its rows by `render.prefix_tokens`, laying none
    out: for every prefix, the tokens of its layout measured (`render.tokens` of `render.lay`),
    whatever rows are mandatory, in the latest stretch, adjacent or withheld."""
    rng = random.Random(seed)
    asked = 1_700_000_000.0 + rng.random() * 86_400 * 400
    rows = {r.item_id: r for r in random_rows(rng, asked)}
    ids = rng.sample(sorted(rows), rng.randint(1, len(rows)))
    cut = rng.randint(0, len(ids))
    base, added = ids[:cut], ids[cut:]
    recent = set(rng.sample(ids, rng.randint(0, len(ids)))) if rng.random() < 0.5 else \
        set(rng.sample(base, rng.randint(0, len(base))))
    messages = sorted({r.message_id for r in rows.values()})
    adjacent = {(a, b) for a, b in zip(messages, messages[1:], strict=False)
                if rng.random() < 0.6}
    current = rng.choice([None, 1, 2, 6])
    header = rng.choice([frame_render.HEADER, frame_render.MORE_HEADER])
    measure = frame_render.prefix_tokens(rows, base, added, recent, adjacent, asked, current,
                                         header)
    for k in range(len(added) + 1):
        laid = frame_render.lay(rows, base + added[:k], recent, adjacent, asked, current)
        assert measure(k) == frame_render.tokens(laid, asked, header), k


def reference_rank_reheats(ranked: list[int], neighbours: list[tuple[int, int]]) -> dict[int, float]:
    """heat.rank_reheats as it was: each rank's peak computed afresh, the larger kept."""
    out: dict[int, float] = {}
    for rank, item in enumerate(ranked):
        out[item] = max(out.get(item, 0.0), heat.reheat_peak(rank))
    for rank, item in neighbours:
        out[item] = max(out.get(item, 0.0), heat.NEIGHBOUR_SHARE * heat.reheat_peak(rank))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_rank_reheats_are_the_obvious_loop(seed: int) -> None:
    """The same peaks in the same order (the warm set reads them in it), rows ranked twice and
    neighbours that are hits too included, past the table of peaks made once as well."""
    rng = random.Random(seed)
    pool = range(1, rng.choice([50, 400, 3_000]))
    ranked = [rng.choice(pool) for _ in range(rng.choice([0, 1, 20, 200, 1_500]))]
    neighbours = [(rng.randrange(max(len(ranked), 1) + 3), rng.choice(pool))
                  for _ in range(rng.randint(0, 80))]
    got = heat.rank_reheats(ranked, neighbours)
    assert list(got.items()) == list(reference_rank_reheats(ranked, neighbours).items())
