"""`memory check` flags only true faults (issue 41): ordinary traffic through a real mitmdump
(a client's retry, two chats opening with the same words, a prompt and its answer said again
and again) and real Claude Code sessions imported leave it clean, and every turn is stored
once; a message of a history stored twice is still flagged."""

from __future__ import annotations

from pathlib import Path

import anthropic
import pytest

from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part
from tests.conftest import SHARED, Proxy, owned
from tests.fake_provider import FakeProvider, Text

SESSIONS = SHARED / "data" / "claude-code"


def _checked(db: Path | str) -> list[str]:
    store = open_memory(db)
    try:
        return check(store)
    finally:
        store.close()


def _ask(proxy: Proxy, fake: FakeProvider, user: str, reply: str, *texts: str) -> None:
    """One request of alternating user and assistant texts, answered `reply`."""
    c = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-faults", max_retries=0))
    fake.script(Text(reply))
    c.messages.create(model="claude-opus-4-8", max_tokens=20, metadata={"user_id": user},
                      messages=[{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                for i, t in enumerate(texts)])


def test_a_client_retry_is_stored_once_and_checks_clean(proxy: Proxy, fake: FakeProvider) -> None:
    for _ in range(2):  # the same request sent again, as a client retries after a timeout
        _ask(proxy, fake, "retry", "The tide turns at six.", "When does the tide turn?")
    _ask(proxy, fake, "retry", "Noted.", "When does the tide turn?", "The tide turns at six.",
         "Thanks.")
    got = proxy.wait_messages("retry", 4)
    assert [t for _, _, t, _ in got] == ["When does the tide turn?", "The tide turns at six.",
                                         "Thanks.", "Noted."]
    assert _checked(proxy.db) == []


def test_two_chats_opening_alike_check_clean(proxy: Proxy, fake: FakeProvider) -> None:
    greeting = "Hello! How can I help you today?"
    # Two new chats without a session id: one conversation, named by its first turn.
    _ask(proxy, fake, "twins", greeting, "hello there")
    _ask(proxy, fake, "twins", greeting, "hello there")
    _ask(proxy, fake, "twins", "Lisbon.", "hello there", greeting, "Where should I go in May?")
    _ask(proxy, fake, "twins", "Porto.", "hello there", greeting, "Where should I go in June?")
    got = [t for _, _, t, _ in proxy.wait_messages("twins", 6)]
    assert got == ["hello there", greeting, "Where should I go in May?", "Lisbon.",
                   "Where should I go in June?", "Porto."]
    assert _checked(proxy.db) == []


def test_a_prompt_and_its_answer_said_again_are_each_stored(proxy: Proxy,
                                                           fake: FakeProvider) -> None:
    """Claude Code's "Continue from where you left off." answered "No response requested."
    three times over: each is another message, stored in its place (before, the third prompt
    was taken for the second, already stored, and lost; the check flagged the second answer)."""
    go, done = "Continue from where you left off.", "No response requested."
    history: list[str] = []
    for _ in range(3):
        history.append(go)
        _ask(proxy, fake, "again", done, *history)
        history.append(done)
    _ask(proxy, fake, "again", "Ok.", *history, "Now the tests.")
    got = [t for _, _, t, _ in proxy.wait_messages("again", 8)]
    assert got == [go, done] * 3 + ["Now the tests.", "Ok."]
    assert _checked(proxy.db) == []


@pytest.mark.skipif(not SESSIONS.is_dir(), reason=f"Claude Code sessions not present at {SESSIONS}")
def test_real_claude_code_sessions_imported_check_clean(tmp_path: Path) -> None:
    """The shared sessions hold the same prompt answered the same way more than once."""
    store = open_memory(tmp_path / "m.db")
    try:
        out = importers.run(store, "claude-code", SESSIONS, progress=False)
        assert out.messages > 0
        assert check(store) == []
    finally:
        store.close()


def _text(role: str, text: str) -> Message:
    return Message(role, (Part(Kind.TEXT, text),))


def test_a_history_stored_twice_is_still_flagged(store: Store) -> None:
    """A re-sent history taken for new (stored again after where it was first stored) is a
    true fault, and so is a turn keyed as following a copy of itself."""
    history = [_text("user", "Plan the release."), _text("assistant", "Step one: tag it."),
               _text("user", "And then?")]
    capture.record(store, user_key="u", conversation_key="c", provider="anthropic", model="m",
                   messages=history, times=[1.0] * 3, source="request")
    assert check(store) == []
    uid = store.user_id("u")
    cid = store.conversation_id(uid, "c", "anthropic")
    again = [store.add_message(conversation_id=cid, user_id=uid, message=m, provider="anthropic",
                               model="m", at=2.0, pair_key=key, source="request").message_id
             for m, key in zip(history[1:], capture._keys(history)[1:], strict=True)]
    assert check(store) == [f"messages of a harness's history stored twice (same conversation,"
                            f" same place, same content): 2 ({again[0]}, {again[1]})"]
