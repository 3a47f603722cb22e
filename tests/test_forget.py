"""Forgetting on request (issue 41): `perpetuity memory purge --conversation ID` and
`--matching TEXT` preview what goes, remove it and everything derived from it on `--yes`, on
SQLite and PostgreSQL, so that search, the frame, the recall tools and `memory check` agree
(a running proxy's included)."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest

from perpetuity_core.cli.main import main
from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Kind, Message, Part
from tests.conftest import Proxy, owned, query, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall

TRIP = ["Book the harbour lantern tour for Saturday.", "Booked the harbour lantern tour.",
        "Add the ferry back at nine.", "Ferry added."]
WORK = ["Draft the invoice for the new client.", "Which client is it?",
        "Customer Zebracorn Ltd, card 4411 2233 9988 7766.", "Drafted for Zebracorn Ltd.",
        "Now the quarterly report.", "Report drafted."]


def _messages(texts: list[str]) -> list[Message]:
    return [Message("user" if i % 2 == 0 else "assistant", (Part(Kind.TEXT, t),))
            for i, t in enumerate(texts)]


def _remembered(store: Store) -> None:
    for key, texts in (("trip", TRIP), ("work", WORK)):
        capture.record(store, user_key="personal", conversation_key=key, provider="anthropic",
                       model="m", messages=_messages(texts), times=[1.0e9] * len(texts),
                       source="request")
    store.flush()  # the chains too, so that the purge has them to take


def _search(db: Path | str, words: str, capsys: pytest.CaptureFixture[str]) -> str:
    """The hits of a search, as JSON text."""
    assert main(["search", words, "--db", str(db), "--json"]) == 0
    return json.dumps(json.loads(capsys.readouterr().out)["hits"])


def _count(db: Path | str, sql: str) -> int:
    return int(query(db, sql)[0][0])


def test_a_conversation_previewed_then_forgotten(memory_at: Path | str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = open_memory(memory_at)
    try:
        _remembered(store)
    finally:
        store.close()
    (trip,) = query(memory_at, "SELECT id FROM conversation WHERE key = 'trip'")[0]
    before = [_count(memory_at, f"SELECT count(*) FROM {t}") for t in ("message", "item")]
    assert main(["memory", "purge", "--conversation", f"c{trip}", "--db", str(memory_at)]) == 0
    out, err = capsys.readouterr()
    assert "would purge 4 messages (4 rows) in 1 conversation; nothing changed" in err
    assert "harbour lantern" in out and len(out.splitlines()) == 4
    assert [_count(memory_at, f"SELECT count(*) FROM {t}") for t in ("message", "item")] == before
    assert "harbour" in _search(memory_at, "harbour lantern", capsys)

    assert main(["memory", "purge", "--conversation", "trip", "--yes", "--db",
                 str(memory_at)]) == 0
    assert "purged 4 messages (4 rows) in 1 conversation" in capsys.readouterr().err
    assert "harbour" not in _search(memory_at, "harbour lantern ferry", capsys)
    assert "Zebracorn" in _search(memory_at, "invoice client", capsys)  # the other stays
    for table in ("activation", "chain", "retrieval"):  # nothing derived from it is left
        assert _count(memory_at, f"SELECT count(*) FROM {table} WHERE conversation_id = {trip}"
                      if table != "chain" else "SELECT count(*) FROM chain c JOIN item i"
                      f" ON i.id = c.item_id JOIN message m ON m.id = i.message_id"
                      f" WHERE m.conversation_id = {trip}") == 0
    assert query(memory_at, f"SELECT opening FROM conversation WHERE id = {trip}") == [("",)]
    assert main(["memory", "check", "--db", str(memory_at)]) == 0


def test_messages_matching_a_text_forgotten(memory_at: Path | str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    store = open_memory(memory_at)
    try:
        _remembered(store)
        assert main(["memory", "purge", "--matching", "zebracorn", "--db", str(memory_at)]) == 0
        assert "would purge 2 messages (2 rows) in 1 conversation" in capsys.readouterr().err
        assert main(["memory", "purge", "--matching", "zebracorn", "--yes", "--db",
                     str(memory_at)]) == 0
        capsys.readouterr()
        assert check(store) == []
    finally:
        store.close()
    left = [t for (t,) in query(memory_at, "SELECT i.text FROM item i JOIN message m ON"
                                " m.id = i.message_id JOIN conversation c ON c.id ="
                                " m.conversation_id WHERE c.key = 'work' ORDER BY m.id")]
    assert left == [WORK[0], WORK[1], WORK[4], WORK[5]]
    assert "4411" not in _search(memory_at, "customer card 4411 Zebracorn", capsys)
    assert main(["memory", "purge", "--matching", "zebracorn", "--db", str(memory_at)]) == 0
    assert "would purge 0 messages" in capsys.readouterr().err


def test_purge_names_what_it_cannot_find(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    open_memory(tmp_path / "m.db").close()
    assert main(["memory", "purge", "--conversation", "c99", "--db", str(tmp_path / "m.db")]) == 1
    assert "no conversation 'c99'" in capsys.readouterr().err
    assert main(["memory", "purge", "--db", str(tmp_path / "m.db")]) == 1
    assert "name what to forget" in capsys.readouterr().err


def _ask(proxy: Proxy, fake: FakeProvider, conversation: str, text: str, *script: object) -> str:
    """A prompt in its own conversation; what went upstream (every round), as text."""
    fake.clear()
    fake.script(*script)
    c = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-me", max_retries=0))
    c.messages.create(model="claude-opus-4-8", max_tokens=50, messages=[
        {"role": "user", "content": text}], extra_headers={"x-perpetuity-conversation": conversation})
    return json.dumps([r.json for r in fake.requests])


def test_a_running_proxy_forgets_with_the_memory(fake: FakeProvider, tmp_path: Path) -> None:
    """Purged beside a serving proxy: its next frame and its recall tools no longer have it."""
    proxy = start_proxy(tmp_path, fake.url, tenants=None)
    try:
        secret = "The customer Zebracorn Ltd pays with card 4411 2233 9988 7766."
        _ask(proxy, fake, "pasted", secret, Text("Noted."))
        _ask(proxy, fake, "other", "The harbour lantern tour is on Saturday.", Text("Noted."))
        proxy.wait_messages("personal", 4)
        question = "Which card does customer Zebracorn pay with?"
        search = ToolCall("memory_search", {"query": "Zebracorn card"}, call_id="toolu_s")
        assert "4411 2233" in _ask(proxy, fake, "q1", question, search, Text("That card."))
        assert main(["memory", "purge", "--matching", "4411 2233", "--yes", "--db",
                     str(proxy.db)]) == 0
        # Not in the file's free pages nor its WAL either (secure_delete, the checkpoint).
        assert b"4411 2233" not in b"".join(f.read_bytes() for f in tmp_path.glob("memory.db*"))
        sent = _ask(proxy, fake, "q2", question, search, Text("I do not know."))
        assert "4411 2233" not in sent and len(fake.requests) == 2  # the frame, the tool's answer
        assert "harbour lantern" in _ask(proxy, fake, "q3", "When is the harbour lantern tour?",
                                         Text("Saturday."))
    finally:
        stop_proxy(proxy)
    assert main(["memory", "check", "--db", str(proxy.db)]) == 0


def test_a_purge_reaches_the_frame_a_conversation_carries(fake: FakeProvider,
                                                          tmp_path: Path) -> None:
    """An agent's frame is carried from prompt to prompt while the cache holds; after a purge
    its next prompt gets a frame without what went."""
    proxy = start_proxy(tmp_path, fake.url, tenants=None)
    c = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-me", max_retries=0))
    read = [{"name": "Read", "description": "Read a file.",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]

    def ask(*texts: str) -> str:
        fake.clear()
        fake.script(Text("Noted."))
        c.messages.create(model="claude-opus-4-8", max_tokens=50, tools=read,  # type: ignore[arg-type]
                          messages=[{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                    for i, t in enumerate(texts)],
                          extra_headers={"x-perpetuity-conversation": "agent"})
        return json.dumps([r.json for r in fake.requests])

    try:
        _ask(proxy, fake, "pasted", "Customer Zebracorn Ltd pays with card 4411 2233 9988 7766.",
             Text("Noted."))
        proxy.wait_messages("personal", 2)
        first = "Charge customer Zebracorn Ltd for the renewal."
        assert "4411 2233" in ask(first)
        assert main(["memory", "purge", "--matching", "4411 2233", "--yes", "--db",
                     str(proxy.db)]) == 0
        assert "4411 2233" not in ask(first, "Noted.", "Which card did Zebracorn Ltd give?")
    finally:
        stop_proxy(proxy)
