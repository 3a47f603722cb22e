"""Recognising re-sent history: what is new in a request, and nothing stored twice."""

from __future__ import annotations

from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part, Reply, Usage, text_part
from perpetuity_core.wire.sse import SSEDecoder


def msg(role: str, text: str) -> Message:
    return Message(role, (text_part(text),))


def record(store: Store, messages: list[Message]) -> tuple[list[int], capture.TurnContext]:
    return capture.record(store, user_key="u", conversation_key="c", provider="anthropic",
                          model="m", messages=messages, times=[0.0] * len(messages),
                          source="request")


def test_resent_history_is_not_stored_again(store: Store) -> None:
    ids, turn = record(store, [msg("user", "Is it raining?")])
    assert len(ids) == 1
    capture.record_reply(store, turn, Reply(msg("assistant", "Yes."), Usage()), 1.0)
    # The harness re-sends the reply as blocks with different whitespace and a cache marker.
    resent = Message("assistant", (Part(Kind.TEXT, "Yes.  "),))
    ids, _ = record(store, [msg("user", "Is it raining?"), resent, msg("user", "Umbrella?")])
    assert len(ids) == 1


def test_same_words_after_a_different_turn_are_a_new_turn(store: Store) -> None:
    history = [msg("user", "Shall we go?"), msg("assistant", "Now?"), msg("user", "yes")]
    assert len(record(store, history)[0]) == 3
    history += [msg("assistant", "Coffee too?"), msg("user", "yes")]
    assert len(record(store, history)[0]) == 2


def test_rewritten_prefix_keeps_only_the_new_tail(store: Store) -> None:
    record(store, [msg("user", "first"), msg("assistant", "one"), msg("user", "second")])
    # Resume with an edited first turn: only what follows the last recognised message is new.
    ids, _ = record(store, [msg("user", "first, edited"), msg("assistant", "one"),
                            msg("user", "second"), msg("assistant", "two"), msg("user", "third")])
    assert len(ids) == 2


def test_empty_reply_is_not_a_turn(store: Store) -> None:
    _, turn = record(store, [msg("user", "hello")])
    assert capture.record_reply(store, turn, Reply(Message("assistant", ()), Usage()), 1.0) is None


def test_sse_decoder_handles_arbitrary_splits() -> None:
    stream = b"event: a\ndata: {\"x\": 1}\n\n: comment\ndata: line1\r\ndata: line2\n\nevent: \xc3\xa9\ndata: z\n\n"
    for size in (1, 2, 3, 7, len(stream)):
        d = SSEDecoder()
        events = [e for i in range(0, len(stream), size) for e in d.feed(stream[i:i + size])]
        assert [(e.event, e.data) for e in events] == [
            ("a", '{"x": 1}'), ("message", "line1\nline2"), ("é", "z")]


def test_long_histories_are_checked_from_their_tail(store: Store) -> None:
    history = [msg("user" if i % 2 == 0 else "assistant", f"turn {i}") for i in range(30)]
    assert len(record(store, history)[0]) == 30  # first contact: all of it
    history += [msg("assistant", "turn 30"), msg("user", "turn 31")]
    assert len(record(store, history)[0]) == 2
    # Only an early turn is recognisable (the harness rewrote everything after it).
    rewritten = history[:5] + [msg("user" if i % 2 else "assistant", f"edited {i}") for i in range(25)]
    assert len(record(store, rewritten)[0]) == 25


def test_a_turn_sent_again_after_its_unanswered_copy_is_stored_once(store: Store) -> None:
    """Issue 20: the proxy died before the reply; the harness kept the unanswered turn and sent
    the same text again as the next message. Stored once whether its copy was stored before the
    kill (the plain stream stores the request at its first byte) or not (the tool loop, after
    its first round): a message keyed by its copy looked new, "after itself"."""
    opened = [msg("user", "Plan the garden"), msg("assistant", "Beds first.")]
    record(store, opened)
    ask = msg("user", "And the lantern?")
    record(store, [*opened, ask])  # stored, then the proxy died before the reply
    ids, turn = record(store, [*opened, ask, ask])  # sent again after its unanswered copy
    assert ids == []
    capture.record_reply(store, turn, Reply(msg("assistant", "By the door."), Usage()), 1.0)
    ids, _ = record(store, [*opened, ask, ask, msg("assistant", "By the door."),
                            msg("user", "Thanks")])
    assert len(ids) == 1
    # Neither copy stored before (the request died before it was written): one row, not two,
    # and a third copy (sent again twice) changes nothing.
    fresh = [msg("user", "What about copper?")]
    ids, _ = record(store, [*opened, ask, msg("assistant", "By the door."), msg("user", "Thanks"),
                            *fresh, *fresh, *fresh])
    assert len(ids) == 1
    texts = [t for (t,) in store_texts(store)]
    assert texts == ["Plan the garden", "Beds first.", "And the lantern?", "By the door.",
                     "Thanks", "What about copper?"]


def test_the_same_words_after_a_reply_are_a_new_turn(store: Store) -> None:
    """Only a message right after its copy is a copy: "again" after an answer is said twice."""
    history = [msg("user", "again"), msg("assistant", "Done."), msg("user", "again")]
    assert len(record(store, history)[0]) == 3


def store_texts(store: Store) -> list[tuple[str]]:
    return store.db.translated().execute("SELECT i.text FROM message m JOIN item i"
                                        " ON i.message_id = m.id ORDER BY m.id, i.seq").fetchall()
