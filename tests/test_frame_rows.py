"""What the model reads, from rows alone: the frame's selection (frame_select) and rendering
(frame_render) on rows built in memory, no database. The reference cases spell out whole
selections and whole rendered frames: they fail if either changes."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core.frame import render as frame_render
from perpetuity_core.frame import select as frame_select
from perpetuity_core.frame import stretch as frame_stretch
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.derived import heat
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.derived.scan import Hit
from perpetuity_core.memory.storage.reads import Row
from perpetuity_core.wire.conversation import Kind, Message
from tests.test_frame import prefixes_of

ASKED = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
DAY = 86_400.0
CURRENT = 3  # the conversation the question is asked in


def row(item: int, message: int, conversation: int, role: str, at: float, text: str, *,
        kind: Kind = Kind.TEXT, name: str = "", secret: str = "", label: str = "") -> Row:
    return Row(item, message, conversation, label, role, at, kind.value, name, text, secret)


def hit(r: Row, score: float) -> Hit:
    return Hit(r.item_id, r.message_id, 1, r.conversation_id, r.role, r.at, score, r.text)


def said(messages: list[Message]) -> list[tuple[str, list[str]]]:
    return [(m.role, [p.text for p in m.parts]) for m in messages]


# A small memory: a trip planned three days before the question (a run of two turns, two left
# out, then one more that sitting), a tool call and a credential in an unnamed conversation 40
# days before, and the question's own conversation two minutes before it.
TRIP = '"We fly to Lisbon" in travel'
ROWS = {r.item_id: r for r in [
    row(1, 10, 1, "user", ASKED - 3 * DAY, "We fly to Lisbon on May 3rd.", label=TRIP),
    row(2, 11, 1, "assistant", ASKED - 3 * DAY + 60, "Lovely, enjoy Lisbon.", label=TRIP),
    row(3, 14, 1, "user", ASKED - 3 * DAY + 600, "Book the hotel near the river.", label=TRIP),
    row(4, 20, 2, "assistant", ASKED - 40 * DAY, "ls -la", kind=Kind.TOOL_CALL, name="bash"),
    row(5, 21, 2, "user", ASKED - 40 * DAY + 60, "my key is sk-0000", secret="API key"),
    row(6, 30, CURRENT, "user", ASKED - 120, "Where were we?"),
    row(7, 31, CURRENT, "assistant", ASKED - 60, "3 files", kind=Kind.TOOL_RESULT),
]}
# Messages 11 and 14 have two stored between them; 20 and 21, 30 and 31 follow one another.
ADJACENT = frozenset({(10, 11), (20, 21), (30, 31)})


def render(ids: list[int], recent: Collection[int] = ()) -> list[Message]:
    return frame_render.messages(ROWS, ids, recent, ADJACENT, ASKED, CURRENT)


def test_reference_frame_as_the_model_reads_it() -> None:
    """Groups by conversation (the current one last, others by when last said), oldest first;
    a label opens each run, [...] marks turns skipped within a sitting; a tool call is quoted;
    a credential is withheld from another conversation; the latest stretch comes last."""
    assert said(render([3, 1, 2, 5, 4, 7], recent={6, 7})) == [
        ("user", [frame_render.HEADER]),
        ("assistant", ["[another conversation, 2023-10-05 22:13 UTC, 1 month before]"
                       "\n[called bash: ls -la]"]),
        ("user", ["[secret withheld: API key]",
                  '[conversation "We fly to Lisbon" in travel, 2023-11-11 22:13 UTC, 3 days'
                  ' before]\nWe fly to Lisbon on May 3rd.']),
        ("assistant", ["Lovely, enjoy Lisbon."]),
        ("user", ["[...]\nBook the hotel near the river."]),
        ("assistant", ["[this conversation, 2023-11-14 22:12 UTC, earlier today]"
                       "\n[tool result: 3 files]",
                       "[End of quoted memory. Now: 2023-11-14 22:13 UTC.]"]),
    ]


def test_reference_frame_opening_with_the_users_words() -> None:
    """The header joins a first user turn; the closing joins a last assistant one. Two turns
    of one message are one turn; a message after a gap over RUN_GAP is labelled afresh."""
    later = row(8, 15, 1, "user", ASKED - 3 * DAY + 2 * frame_render.RUN_GAP,
                "And a table for two.", label=TRIP)
    rows = {**ROWS, 8: later, 9: row(9, 10, 1, "user", ASKED - 3 * DAY, "Window seats.")}
    out = frame_render.messages(rows, [1, 9, 2, 8], (), ADJACENT | {(14, 15)}, ASKED, None)
    assert said(out) == [
        ("user", [frame_render.HEADER + "\n\n" + '[conversation "We fly to Lisbon" in travel,'
                  ' 2023-11-11 22:13 UTC, 3 days before]\nWe fly to Lisbon on May 3rd.'
                  "\nWindow seats."]),
        ("assistant", ["Lovely, enjoy Lisbon."]),
        ("user", ["[2023-11-11 23:13 UTC, 3 days before]\nAnd a table for two."]),
        ("assistant", ["[End of quoted memory. Now: 2023-11-14 22:13 UTC.]"]),
    ]


def test_an_agents_frame_opens_with_its_header_alone() -> None:
    """An agent's frame (`apart`) opens with the header as a message of its own, the same in
    every frame, so the harness's standing messages can follow it in the cached prefix; a
    first turn of the user's comes after SKIPPED. Measured as written, prefix by prefix."""
    later = row(8, 15, 1, "user", ASKED - 3 * DAY + 2 * frame_render.RUN_GAP,
                "And a table for two.", label=TRIP)
    rows = {**ROWS, 8: later}
    for ids in ([1, 2, 8], [2, 8], [1], [3, 1, 2, 5, 4, 7]):
        laid = frame_render.lay(rows, ids, {6, 7}, ADJACENT | {(14, 15)}, ASKED, None)
        out = frame_render.written(laid, ASKED, apart=True)
        assert said(out)[0] == ("user", [frame_render.HEADER])
        assert said(out)[1][0] == "assistant"
        assert frame_render.tokens(laid, ASKED, apart=True) == messages_tokens(out)
        measure = frame_render.prefix_tokens(rows, [], ids, {6, 7}, ADJACENT | {(14, 15)},
                                             ASKED, None, apart=True)
        assert measure(len(ids)) == messages_tokens(out)
    laid = frame_render.lay(rows, [1, 2], (), ADJACENT, ASKED, None)
    assert said(frame_render.written(laid, ASKED, apart=True))[:2] == [
        ("user", [frame_render.HEADER]), ("assistant", [frame_render.SKIPPED])]


def test_a_credential_is_quoted_in_its_own_conversation() -> None:
    mine = frame_render.messages(ROWS, [5], (), ADJACENT, ASKED, 2)
    assert "my key is sk-0000" in mine[0].parts[0].text
    theirs = frame_render.messages(ROWS, [5], (), ADJACENT, ASKED, CURRENT)
    assert "sk-0000" not in theirs[0].parts[0].text


@pytest.mark.parametrize("days, said", [
    (0.0, "earlier today"), (1.0, "yesterday"), (6.0, "6 days before"), (7.0, "1 week before"),
    (29.0, "4 weeks before"), (30.0, "1 month before"), (400.0, "1 year before"),
    (800.0, "2 years before"),
])
def test_labels_count_calendar_days(days: float, said: str) -> None:
    out = frame_render.messages({1: row(1, 1, 1, "user", ASKED - days * DAY, "x")}, [1], (),
                                (), ASKED, None)
    assert out[0].parts[0].text.endswith(f" UTC, {said}]\nx")


def test_nothing_chosen_renders_nothing() -> None:
    assert render([]) == []


def frame_prefixes(measure: Callable[[list[int], Collection[int], Mapping[int, Row]], int]
                   ) -> frame_select.Measure:
    """The frame's measure of prefixes (base, added, recent, excerpts) -> k -> tokens, from a
    measure of rows."""
    return lambda base, added, recent, excerpts: lambda k: measure(base + added[:k], recent,
                                                                   excerpts)


def warm(warmth: dict[int, float]) -> heat.Warm:
    ids = sorted(warmth, key=lambda i: (-warmth[i], i))
    return heat.Warm(np.array(ids, np.int64), np.array([warmth[i] for i in ids]))


def words(n: int) -> str:
    return " ".join(["word"] * n)


def test_reference_selection() -> None:
    """A frame's rows: the top hit, the other half of its exchange and the latest stretch
    whatever their warmth, then the most warmth per token that fits as rendered."""
    rows = {r.item_id: r for r in [
        row(1, 1, 1, "user", ASKED - DAY, "What was the ferry's name? " + words(20)),  # top hit
        row(2, 2, 1, "assistant", ASKED - DAY + 60, "The Tagus Star. " + words(30)),  # its answer
        row(3, 3, 1, "user", ASKED - DAY + 120, words(600)),  # warm but long
        row(4, 4, 1, "assistant", ASKED - DAY + 180, words(40)),
        row(5, 5, 1, "user", ASKED - DAY + 240, words(40)),
        row(6, 6, 1, "assistant", ASKED - DAY + 300, "ok"),
        row(7, 7, CURRENT, "user", ASKED - 120, words(50)),  # the latest stretch
        # bulk: not in the stretch (a word is 1.25 tokens)
        row(8, 8, CURRENT, "assistant", ASKED - 60, words(frame_stretch.RECENT_ROW)),
    ]}
    hot = warm({1: 2.0, 3: 1.9, 4: 1.0, 5: 0.9, 6: 0.9, 2: 0.05})
    hits = [hit(rows[1], 9.0), hit(rows[3], 8.0), hit(rows[4], 1.0)]
    tokens = frame_select.budget(hits, Cap(floor=400, ceiling=2_000))
    assert tokens == 544  # two good matches of three: a little over the floor

    def render(ids: list[int], recent: Collection[int],
               excerpts: Mapping[int, Row] | None = None) -> list[Message]:
        return frame_render.messages({**rows, **(excerpts or {})}, ids, recent, frozenset(),
                                     ASKED, CURRENT)

    def measure(ids: list[int], recent: Collection[int],
                excerpts: Mapping[int, Row] | None = None) -> int:
        return messages_tokens(render(ids, recent, excerpts))

    chosen = frame_select.frame(rows, hot, hits, [2], [7, 8], tokens, Cap(400, 2_000),
                                frame_prefixes(measure))
    assert chosen.item_ids == [1, 2, 7, 6, 4, 5]
    assert chosen.recent == {7}
    assert chosen.must == {7: frame_select.MUST_RECENT, 2: frame_select.MUST_HALF,
                           1: frame_select.MUST_TOP}
    assert measure(chosen.item_ids, chosen.recent) <= tokens
    # All six fit 300 tokens by their estimate (238), not as rendered (327): the last added
    # goes. The long warm row never fits.
    smaller = frame_select.frame(rows, hot, hits, [2], [7, 8], 300, Cap(400, 2_000),
                                     frame_prefixes(measure))
    assert smaller.item_ids == [1, 2, 7, 6, 4]


def test_an_agents_frame_with_a_stretch_is_its_stretch() -> None:
    """An agent's frame standing in for its dropped history is its latest stretch: no top hit,
    no other half, no warm row, though the short answer would fit the budget (every tool round
    re-reads what comes). A chat's frame, or an agent's with no stretch, takes them whole
    whatever the budget."""
    rows = {r.item_id: r for r in [
        row(1, 1, 1, "user", ASKED - DAY, "The deploy script " + words(300)),  # the top hit
        row(2, 2, 1, "assistant", ASKED - DAY + 60, "Run make deploy."),  # its other half
        row(7, 7, CURRENT, "user", ASKED - 120, "Edit src/app/deploy.py"),  # the stretch
    ]}
    hot = warm({1: 2.0, 2: 0.05})
    hits = [hit(rows[1], 9.0)]

    def measure(ids: list[int], recent: Collection[int],
                excerpts: Mapping[int, Row] | None = None) -> int:
        return messages_tokens(frame_render.messages({**rows, **(excerpts or {})}, ids, recent,
                                                     frozenset(), ASKED, CURRENT))

    def chosen(agent: bool, stretch: list[int]) -> frame_select.Selection:
        return frame_select.frame(rows, hot, hits, [2], stretch, 120, Cap(40, 2_000),
                                  frame_prefixes(measure),
                                  agent=agent)

    agents = chosen(True, [7])
    assert agents.item_ids == [7]
    assert frame_render.cost(agents.considered[2]) < 120  # it would have fit
    assert agents.must == {7: frame_select.MUST_RECENT}
    assert chosen(False, [7]).must == {7: frame_select.MUST_RECENT, 1: frame_select.MUST_TOP,
                                       2: frame_select.MUST_HALF}
    assert chosen(True, []).must == {1: frame_select.MUST_TOP, 2: frame_select.MUST_HALF}


def test_the_fill_drops_what_labels_push_over_the_budget() -> None:
    """The estimate leaves out labels; the rendered frame is measured and the last rows added
    go until it fits, no more of them than that."""
    rows = {i: row(i, i, i, "user", ASKED - i * DAY, words(40)) for i in range(1, 6)}
    hot = warm(dict.fromkeys(rows, 1.0))

    def measure(ids: list[int]) -> int:
        return messages_tokens(frame_render.messages(rows, ids, (), frozenset(), ASKED, None))

    new = frame_select.fill(rows, hot, {1}, 250, prefixes_of(measure))
    # Five fit by the estimate (5 x 50 tokens), rendered they take 379: dropping the last
    # added by their estimated size against the 129 over would take 5, 4 and 3, but [1, 2, 3]
    # renders to 249, so only 5 and 4 go.
    assert new == [1, 2, 3]
    assert measure(new) <= 250


def test_the_latest_stretch_is_the_newest_small_rows_within_its_tokens() -> None:
    small, bulky = words(frame_stretch.RECENT_ROW * 4 // 5 - 1), words(frame_stretch.RECENT_ROW)
    rows = {i: row(i, i, CURRENT, "user", float(i), bulky if i == 99 else small)
            for i in range(1, 100)}
    # Nothing touched twice (no names): the newest rows alone, within their share.
    fits = (frame_stretch.RECENT_TOKENS * frame_stretch.NEWEST_SHARE // 100
            // frame_render.cost(rows[1]))
    got, excerpts = frame_stretch.latest(rows, list(rows))
    assert not excerpts
    assert 99 not in got  # over RECENT_ROW: skipped, not an end to the stretch
    assert got == set(range(98 - fits + 1, 99))


def test_the_stretch_takes_the_latest_mention_of_what_the_conversation_touched() -> None:
    """Past the newest rows, the row holding a touched name's latest mention comes before
    newer rows that hold none; a name's older mention is not its latest; a name mentioned once
    comes with the room left."""
    filler = words(frame_stretch.RECENT_ROW * 4 // 5 - 1)
    texts = {1: "Read src/app/config.py", 2: "src/app/config.py: load_settings() -> dict",
             3: "Edit src/app/config.py: load_settings reads the env", 4: "parse_once here",
             **{i: filler for i in range(5, 40)}}
    rows = {i: row(i, i, CURRENT, "user", float(i), t) for i, t in texts.items()}
    got, _ = frame_stretch.latest(rows, list(rows))
    assert 3 in got  # the latest mention of src/app/config.py and load_settings
    assert not {1, 2} & got  # older mentions
    assert 4 in got  # named once: room was left
    newest = {i for i in range(5, 40) if i in got}
    assert 5 not in newest and len(newest) < 35  # the old row came before newer filler


def test_a_bulky_other_half_does_not_come() -> None:
    rows = {1: row(1, 1, 1, "user", 0.0, "q"), 2: row(2, 2, 1, "assistant", 0.0, words(500))}
    assert frame_select.companion([2], rows, Cap(100, 2_000)) == [2]
    assert frame_select.companion([2], rows, Cap(100, 1_000)) == []
    assert frame_select.companion([3], rows, Cap(100, 2_000)) == []  # not shown: not there


def test_reference_addendum_selection() -> None:
    """The ranking from the top hit and its other half on, while it fits in the question's
    budget, the rows already in front counted but not sent again; the top hit comes however
    long. Before, a chat's addendum stopped at the floor and was none when its top hit was in
    front: one long chat's questions held 0.80 of their evidence (docs/tuning.md)."""
    rows = {r.item_id: r for r in [
        row(1, 1, 1, "user", 0.0, words(100)),
        row(2, 2, 1, "assistant", 60.0, words(30)),
        row(3, 3, 2, "user", 0.0, words(90)),
        row(4, 4, 2, "user", 0.0, words(30)),
        row(5, 5, 2, "user", 0.0, words(30)),
        row(6, 6, 2, "user", 0.0, words(30)),
    ]}
    hits = [hit(rows[i], 10.0 - i) for i in (1, 3, 4, 5, 6)]
    # 125 + 38 + 38 tokens sent, 5 (38) in front and counted: 239 of 240; 3 (113) and 6 do
    # not fit. The floor (100) is not the bound.
    chosen = frame_select.addendum(rows, hits, [2], {5}, 240, Cap(100, 2_000))
    assert chosen.item_ids == [1, 2, 4]
    assert set(chosen.considered) == {1, 2, 3, 4, 5, 6}
    assert chosen.must == {1: frame_select.MUST_TOP, 2: frame_select.MUST_HALF}
    # The top hit in front: the rows after it still come, within what it leaves.
    after = frame_select.addendum(rows, hits, [2], {1}, 240, Cap(100, 2_000))
    assert after.item_ids == [2, 4, 5] and after.must == {2: frame_select.MUST_HALF}
    assert frame_select.addendum(rows, hits, [2], {1, 2, 4, 5}, 240, Cap(100, 2_000)).item_ids == []
    alone = frame_select.addendum(rows, hits, [2], (), 10, Cap(10, 2_000))
    assert alone.item_ids == [1]
    # The other half is considered only when it comes.
    rows[2] = row(2, 2, 1, "assistant", 60.0, words(1_200))
    assert 2 not in frame_select.addendum(rows, hits, [2], (), 5_000, Cap(240, 2_000)).considered


def test_names_touched_more_than_once_come_before_those_named_once() -> None:
    long = words(frame_stretch.RECENT_ROW)  # bulk: never among the newest rows
    texts = {1: f"{long}\nlib/once_only.py\n{long}\nsrc/twice.py\n{long}",
             2: f"{long}\nsrc/twice.py is read\n{long}", 3: "short"}
    rows = {i: row(i, i, CURRENT, "user", float(i), t) for i, t in texts.items()}
    one = frame_render.cost(frame_stretch.excerpt(rows[2], [frame_stretch.span(
        texts[2], texts[2].index("src/twice.py"), len("src/twice.py"))]))
    _, tight = frame_stretch.latest(rows, list(rows), most=one + 10)
    assert set(tight) == {2} and "src/twice.py is read" in tight[2].text
    _, roomy = frame_stretch.latest(rows, list(rows), most=4 * one)
    assert set(roomy) == {1, 2} and "lib/once_only.py" in roomy[1].text
    assert "src/twice.py" not in roomy[1].text  # its latest mention is row 2's


def test_names_only_tool_output_held_come_after_those_the_task_touched() -> None:
    """A name the conversation said itself or called a tool with comes before one that only a
    tool's output held, however many rows listed that one and however densely."""
    long = words(frame_stretch.RECENT_ROW)  # bulk: never among the newest rows
    listing = "\n".join(f"lib/listed_{n}.py" for n in range(8))
    texts = {1: "Edit src/app/edited.py: the fix", 2: f"{long}\n{listing}\n{long}",
             3: f"{long}\nsrc/app/edited.py and lib/listed_0.py\n{long}",
             4: f"{long}\n{listing}\n{long}", 5: "short"}
    kinds = {1: Kind.TOOL_CALL, 2: Kind.TOOL_RESULT, 3: Kind.TOOL_RESULT, 4: Kind.TOOL_RESULT}
    rows = {i: row(i, i, CURRENT, "user", float(i), t, kind=kinds.get(i, Kind.TEXT))
            for i, t in texts.items()}
    twice, once, seen_only, times = frame_stretch.latest_mentions(
        [rows[i] for i in (5, 4, 3, 2, 1)])
    assert twice == {"src/app/edited.py": 3} and not once
    assert times["src/app/edited.py"] == 2 and times["lib/listed_0.py"] == 3
    assert seen_only == {f"lib/listed_{n}.py": 4 for n in range(8)}
    # Room for one excerpt: the touched name's latest mention, not the denser listing.
    def cost(i: int, name: str) -> int:
        return frame_render.cost(frame_stretch.excerpt(rows[i], [frame_stretch.span(
            texts[i], texts[i].rindex(name), len(name))]))
    edited, listed = cost(3, "src/app/edited.py"), cost(4, listing)
    most = max(edited, listed) + frame_render.cost(rows[1]) + frame_render.cost(rows[5]) + 10
    assert edited + listed > most
    _, excerpts = frame_stretch.latest(rows, list(rows), most=most)
    assert set(excerpts) == {3} and "src/app/edited.py" in excerpts[3].text


def test_a_bulk_among_an_agents_newest_rows_comes_as_the_lines_around_its_names() -> None:
    """A coding task's last steps: the file it read is a bulk among the newest rows; in an
    agent's stretch it comes as the lines around the names it holds, verbatim, the rest of the
    dump left out (memory_more reads it whole), and the rows around it whole."""
    dump = [f"{n:4d}\t    total = total + {n}  # accumulate the running sum of the batch"
            for n in range(1, 56)]
    dump[39] = "  40\tdef load_settings(path):"
    dump[40] = "  41\t    return read_env(path)"
    texts = {1: "Why does the loader ignore the env?", 2: "Read src/app/loader.py",
             3: "\n".join(dump), 4: "load_settings never calls read_env on the override."}
    kinds = {2: Kind.TOOL_CALL, 3: Kind.TOOL_RESULT}
    rows = {i: row(i, i, CURRENT, "user", float(i), t, kind=kinds.get(i, Kind.TEXT))
            for i, t in texts.items()}
    assert frame_render.cost(rows[3]) <= frame_stretch.RECENT_ROW  # not skipped as too long
    got, excerpts = frame_stretch.latest(rows, list(rows), agent=True)
    assert got == {1, 2, 3, 4} and set(excerpts) == {3}
    quoted = excerpts[3].text
    assert dump[39] in quoted and dump[40] in quoted  # the identifier stays, with its lines
    assert dump[10] not in quoted and dump[50] not in quoted  # the elided bulk is gone
    assert frame_render.cost(excerpts[3]) < frame_render.cost(rows[3]) // 4
    assert not frame_stretch.latest(rows, list(rows))[1]  # a chat's: what its person said, whole


def test_the_names_an_agents_conversation_named_most_come_first() -> None:
    """Of two latest mentions with room for one, in an agent's stretch: the name the
    conversation came back to in five rows comes before a denser excerpt holding two names
    named twice each."""
    long = words(frame_stretch.RECENT_ROW)  # bulk: never among the newest rows
    texts = {**{i: f"{long}\nsrc/core/engine.py\n{long}" for i in range(1, 5)},
             5: f"{long}\nsrc/core/engine.py runs\n{long}",
             6: f"{long}\nlib/b_one.py\n{long}", 7: f"{long}\nlib/b_two.py\n{long}",
             8: f"{long}\nlib/b_one.py lib/b_two.py\n{long}"}
    rows = {i: row(i, i, CURRENT, "user", float(i), t) for i, t in texts.items()}

    def cost(i: int, name: str) -> int:
        return frame_render.cost(frame_stretch.excerpt(rows[i], [frame_stretch.span(
            texts[i], texts[i].rindex(name), len(name))]))

    room = max(cost(5, "src/core/engine.py"), cost(8, "lib/b_one.py lib/b_two.py")) + 10
    _, excerpts = frame_stretch.latest(rows, list(rows), most=room, agent=True)
    assert set(excerpts) == {5} and "src/core/engine.py" in excerpts[5].text


def test_an_excerpt_is_whole_lines_around_each_latest_mention_verbatim() -> None:
    """A bulk row holding the latest mentions of two touched names comes as the lines around
    them (one excerpt where they are close), verbatim, what it leaves out marked; a line too
    long to take whole is cut at EXCERPT_CHARS around the name."""
    lines = [f"{n:3d}  filler {n} = {n}  # nothing to see on this line at all" for n in range(200)]
    lines[50] = " 50  from app.loader import load_settings"
    lines[52] = " 52  settings = load_settings(app.loader.PATH)"
    lines[150] = "x" * 400 + " cfg/deploy.yaml " + "y" * 400
    bulk = "\n".join(lines)
    texts = {1: "Read app.loader and cfg/deploy.yaml", 2: bulk, 3: "short"}
    rows = {i: row(i, i, CURRENT, "user", float(i), t) for i, t in texts.items()}
    got, excerpts = frame_stretch.latest(rows, list(rows))
    assert got == {1, 2, 3} and set(excerpts) == {2}  # the small rows whole, the bulk one not
    quoted = excerpts[2].text
    assert quoted.startswith(frame_stretch.LEFT_OUT) and quoted.endswith(frame_stretch.LEFT_OUT)
    parts = [p.strip("\n") for p in quoted.split(frame_stretch.LEFT_OUT) if p]
    assert all(p in bulk for p in parts)  # verbatim
    near = [p for p in parts if "load_settings" in p]
    assert len(near) == 1
    assert lines[50] in near[0] and lines[52] in near[0]  # whole lines, one excerpt
    cut = next(p for p in parts if "cfg/deploy.yaml" in p)
    assert len(cut) <= 2 * frame_stretch.EXCERPT_CHARS + len("cfg/deploy.yaml")
    assert frame_render.quote(excerpts[2]).startswith(frame_render.EXCERPT.format(2))
    assert frame_render.cost(excerpts[2]) < frame_render.cost(rows[2]) // 10


def test_an_excerpts_mark_is_short_and_the_header_names_no_tool() -> None:
    """An excerpt's mark names its row and how to read it whole, shortly; the header names no
    tool, since a frame with the tools off must never mention them."""
    assert "memory_more" not in frame_render.HEADER  # the tools may be off
    assert len(frame_render.EXCERPT.format(12345)) <= 60  # 66 before


def reference_names(text: str) -> frozenset[str]:
    """frame_stretch.names as first written: every word looked at, each in full."""
    out = set()
    for word in frame_stretch._WORD.findall(text):
        word = word.strip("./~-")
        if (len(word) >= 4 and ("/" in word or "." in word or "_" in word.strip("_")
                                or frame_stretch._CAMEL.search(word))
                and not word.replace(".", "").isdigit()):
            out.add(word)
    return frozenset(out)


_PIECES = ["src/app/main.py", "parseRequest", "HTTPServer", "snake_case", "__init__", "_x_",
           "v1.2.3", "1234", "12.5", "./run", "~/.cache/", "--flag", "Ünïcode_name", "naïveCase",
           "word", "Words", "UPPER", "a.b", "x", "end.", "…", "²³⁴⁵", "fooBAR9", "９９９９", "\n",
           " ", "\t", "(", ")", ",", "-", "/", "."]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40), st.text(max_size=60))
def test_names_are_the_plain_loop_s(pieces: list[str], noise: str) -> None:
    """names() looks at each word once and at a word of letters and digits only for camelCase;
    it finds what the plain loop over every word finds."""
    text = "".join(pieces) + noise + " ".join(pieces)
    assert frame_stretch.names.__wrapped__(text) == reference_names(text)


def reference_mentions(rows: dict[int, Row], mentions: dict[str, int], times: Mapping[str, int],
                       most: int, used: int, out: set[int],
                       chosen: dict[int, list[tuple[int, int]]]) -> int:
    """frame_stretch._mentions as first written: every row searched, every excerpt's text cut,
    a span worth the times its names were named."""
    spans: dict[int, list[tuple[int, int]]] = {}
    worth: dict[int, list[int]] = {}
    for name, i in mentions.items():
        if i not in out:
            text = rows[i].text
            spans.setdefault(i, []).append(frame_stretch.span(text, text.rfind(name), len(name)))
            worth.setdefault(i, []).append(times[name])
    candidates: list[tuple[int, int, int, tuple[int, int] | None]] = []
    for i, found in spans.items():
        r, merged = rows[i], frame_stretch.merge(found, worth[i])
        if (frame_render.cost(r) <= frame_stretch.RECENT_ROW
                and 2 * sum(e - s for s, e, _ in merged) >= len(r.text)):
            candidates.append((sum(worth[i]), frame_render.cost(r), i, None))
        else:
            candidates += [(n, (len(r.text[s:e]) + 3) // 4 + frame_stretch.EXCERPT_TOKENS, i,
                            (s, e)) for s, e, n in merged]
    for _, c, i, where in sorted(candidates, key=lambda k: (-k[0] / (k[1] + 100), -k[2])):
        if used + c > most or i in out:
            continue
        if where is None:
            out.add(i)
        else:
            chosen.setdefault(i, []).append(where)
        used += c
    return used


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(["src/a_b.py", "lib/x.py", "fooBar", "word",
                                                    "tests/t_1.py", "\n", "filler " * 30]),
                                   min_size=1, max_size=30),
                          st.sampled_from([Kind.TEXT, Kind.TOOL_CALL, Kind.TOOL_RESULT])),
                min_size=1, max_size=12),
       st.integers(0, 3000))
def test_the_stretch_never_searches_a_row_too_large_for_what_is_left(
        texts: list[tuple[list[str], Kind]], most: int) -> None:
    """_mentions passes over a row none of whose excerpts (nor the row whole) could fit the
    room left: the stretch it chooses is the one searching every row chooses, whatever the
    rows, their names and the room."""
    rows = {i: row(i, i, CURRENT, "user", float(i), "".join(words), kind=kind)
            for i, (words, kind) in enumerate(texts, 1)}
    newest = [rows[i] for i in sorted(rows, reverse=True)]
    # Rooms at each row's least candidate's cost, and one token either side, beside any.
    edges = {c + d for r in rows.values() for name in frame_stretch.names(r.text)
             for c in ((min(len(r.text), len(name) + frame_stretch.EXCERPT_CHARS) + 3) // 4
                       + frame_stretch.EXCERPT_TOKENS, frame_render.cost(r)) for d in (-1, 0, 1)}
    *tiers, times = frame_stretch.latest_mentions(newest)
    for mentions in tiers:
        for used in {0, most // 2, most} | {most - e for e in edges if 0 <= e <= most}:
            got: tuple[set[int], dict[int, list[tuple[int, int]]]] = (set(), {})
            want: tuple[set[int], dict[int, list[tuple[int, int]]]] = (set(), {})
            assert (frame_stretch._mentions(rows, mentions, times, most, used, *got)
                    == reference_mentions(rows, mentions, times, most, used, *want))
            assert got == want
