"""The saving, live: the proxy's tally of what each call cost as the harness sent it and as it
went upstream, checked against the replay's billing of the same requests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from perpetuity_core.cli.main import main
from perpetuity_core.frame.billing import AnthropicCache
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import savings
from perpetuity_core.memory.storage.savings import Saved
from perpetuity_core.serve.tally import reported_bill
from perpetuity_core.wire.conversation import Message, Protocol, Reply, Usage
from tests import postgres
from tests.conftest import Proxy, owned, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall

MODEL = "claude-sonnet-4-6"  # $3 per million input tokens
MARK = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are a careful coding agent. " * 200, "cache_control": MARK}]
T0 = 1_780_000_000.0


@pytest.fixture(params=["relay", "mitmproxy-stream", "relay-postgresql"])
def live(request: pytest.FixtureRequest, fake: FakeProvider, tmp_path: Path) -> Iterator[Proxy]:
    """A proxy of the test's own (its tally starts empty): the recall tools on (through the
    relay), off (mitmproxy's own stream), and on with the memory on PostgreSQL."""
    extra = ("--set", "perpetuity_tools=false") if request.param == "mitmproxy-stream" else ()
    db = None
    if request.param.endswith("postgresql"):
        db = postgres.fresh_database(request.getfixturevalue("postgres_server"), "savings")
    p = start_proxy(tmp_path, fake.url, *extra, db=db)
    yield p
    stop_proxy(p)
    assert b"perpetuity_core" not in p.log.read_bytes(), p.log.read_text()


def _body(history: list[dict], stream: bool) -> dict:
    """A Claude Code-like request: the mark on the system prompt and on the last block."""
    messages = [dict(m) for m in history]
    messages[-1] = {**messages[-1], "content": [
        {"type": "text", "text": messages[-1]["content"], "cache_control": MARK}]}
    return {"model": MODEL, "max_tokens": 64, "system": SYSTEM, "messages": messages,
            "stream": stream}


def test_the_live_tally_is_the_replays_bill_of_the_same_requests(
        live: Proxy, fake: FakeProvider) -> None:
    fake.clear()
    http = owned(httpx.Client(base_url=live.url, timeout=30))
    headers = {"x-api-key": "sk-ant-savings", "anthropic-version": "2023-06-01",
               "x-perpetuity-user": "saver"}
    # An earlier conversation, stored: memory for the recall tools to reach.
    fake.script(Text("The vault code is 4471."))
    http.post("/v1/messages", json={"model": MODEL, "max_tokens": 64, "messages": [
        {"role": "user", "content": "Remember the vault code, 4471."}]},
        headers={**headers, "x-perpetuity-conversation": "c0",
                 "x-perpetuity-time": datetime.fromtimestamp(T0 - 2 * 86400, UTC).isoformat()})
    live.wait_messages("saver", 2)
    sent: list[tuple[float, dict, list[dict], int]] = []  # (at, direct, upstream bodies, usage)
    history: list[dict] = []
    said = ["Fix the date parser in src/dates/parse_util.py, please. " * 30,
            "Now the tests in tests/test_dates.py. " * 30,
            "And what did we decide about the vault? " * 30,
            "Thanks, one more pass over parse_util. " * 30]
    for n, text in enumerate(said):
        at = T0 + 90 * n  # within the cache's five minutes: each call reads what the last wrote
        history.append({"role": "user", "content": text})
        if n == 2:  # the model asks our recall tool first, where it rides along
            fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_v"),
                        Text("The vault stays shut."))
        else:
            fake.script(Text(f"Done, step {n}." + " ok" * 40))
        before = len(fake.requests)
        body = _body(history, stream=n % 2 == 1)
        r = http.post("/v1/messages", json=body, headers={
            **headers, "x-perpetuity-conversation": "c1",
            "x-perpetuity-time": datetime.fromtimestamp(at, UTC).isoformat()})
        assert r.status_code == 200
        reply = _reply_text(r)
        history.append({"role": "assistant", "content": reply})
        upstream = [q.json for q in fake.requests[before:]]
        sent.append((at, body, upstream, _input_tokens(r)))
    day = time.strftime("%Y-%m-%d", time.localtime(T0))
    deadline = time.monotonic() + 10
    while not (rows := live.rows("SELECT * FROM saving WHERE day = ?", day)) or \
            rows[0][3] < len(said):
        assert time.monotonic() < deadline, rows
        time.sleep(0.05)
    assert [r[:3] for r in rows] == [(day, "anthropic", MODEL)]
    tally = Saved(*rows[0][3:])

    # The replay's billing of the same requests: the client's as sent, each upstream round as
    # the provider received it, each side in its own prompt cache, at the calls' times.
    direct_cache, upstream_cache = AnthropicCache(), AnthropicCache()
    direct = [direct_cache.bill(body, at) for at, body, _, _ in sent]
    upstream = [upstream_cache.bill(b, at) for at, _, bodies, _ in sent for b in bodies]
    assert tally.calls == tally.priced == tally.reported == len(said)
    assert tally.direct_tokens == sum(b.tokens for b in direct)
    assert tally.sent_tokens == sum(b.tokens for b in upstream)
    assert tally.direct_cost == pytest.approx(sum(b.cost for b in direct))
    assert tally.sent_cost == pytest.approx(sum(b.cost for b in upstream))
    assert tally.direct_usd == pytest.approx(tally.direct_cost * 3 / 1e6)
    assert tally.sent_usd == pytest.approx(tally.sent_cost * 3 / 1e6)
    # The provider's own figures (the fake's: no cache, its input counted from the body).
    assert tally.reported_cost == sum(u for *_, u in sent)
    assert sum(b.read for b in direct) > 0  # the cache worked: a call read what one wrote
    if "perpetuity_tools=false" not in live.process.args:
        assert len(sent[2][2]) == 2  # the recall tool's hidden round, billed too

    # `perpetuity memory stats`: per day and in total, money and the percent saved.
    out = _stats(live.db)["saving"]
    assert out["days"][day]["calls"] == len(said) and out["total"]["calls"] == len(said) + 1
    assert out["days"][day]["direct_usd"] == pytest.approx(round(tally.direct_usd, 4))
    assert out["days"][day]["saved"] == round(1 - tally.sent_usd / tally.direct_usd, 4)


def _reply_text(r: httpx.Response) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        return "".join(json.loads(line[6:])["delta"].get("text", "") for line in
                       r.text.splitlines() if line.startswith("data: ")
                       and '"content_block_delta"' in line)
    return "".join(b.get("text", "") for b in r.json()["content"])


def _input_tokens(r: httpx.Response) -> int:
    """The input tokens the reply reported (a stream's in its message_start)."""
    if r.headers["content-type"].startswith("text/event-stream"):
        start = next(json.loads(line[6:]) for line in r.text.splitlines()
                     if line.startswith("data: ") and '"message_start"' in line)
        return int(start["message"]["usage"]["input_tokens"])
    return int(r.json()["usage"]["input_tokens"])


def _stats(db: Path | str) -> dict:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["memory", "stats", "--db", str(db), "--json"]) == 0
    return json.loads(buf.getvalue())


def test_a_days_calls_add_up_on_either_backend(memory_at: Path | str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    store = open_memory(memory_at)
    try:
        one = Saved(calls=1, priced=1, direct_tokens=100, sent_tokens=40, direct_cost=100.0,
                    sent_cost=40.0, direct_usd=0.0003, sent_usd=0.00012, reported=1,
                    reported_cost=45.0, reported_usd=0.000135)
        for day in ("2026-12-05", "2026-12-06", "2026-12-06"):
            savings.add(store.db, day, "anthropic", MODEL, one)
        savings.add(store.db, "2026-12-06", "openai", "gpt-6.2-sol",
                    Saved(calls=1, direct_cost=10.0, sent_cost=10.0))
        days = savings.by_day(store.db.translated())
    finally:
        store.close()
    assert [d for d, _ in days] == ["2026-12-05", "2026-12-06"]
    assert (days[1][1].calls, days[1][1].priced, days[1][1].direct_cost) == (3, 2, 210.0)
    assert main(["memory", "stats", "--db", str(memory_at)]) == 0
    printed = capsys.readouterr().out
    lines = printed[printed.index("saving:"):].splitlines()
    assert lines[3].split() == ["2026-12-05", "1", "0.00", "0.00", "60%", "0.00"]
    assert lines[5].split()[:2] == ["total", "4"] and "60%" in lines[5]
    assert "1 calls of models without a list price" in printed


@pytest.mark.parametrize(("protocol", "model", "usage", "want"), [
    # Anthropic counts its uncached input apart from what the cache read and wrote.
    (Protocol.ANTHROPIC, MODEL, Usage(100, 5, 1000, 200), (100, 1000, 200, 100 + 100 + 250)),
    # OpenAI and Gemini count the cached tokens inside the input.
    (Protocol.RESPONSES, "gpt-5", Usage(1100, 5, 1000), (100, 1000, 0, 100 + 100)),
    (Protocol.CHAT, "gpt-4o", Usage(1100, 5, 1000), (100, 1000, 0, 100 + 500)),
    (Protocol.GEMINI, "gemini-2.5-pro", Usage(1100, 5, 1000), (100, 1000, 0, 100 + 100)),
])
def test_the_providers_usage_is_billed_as_it_counts_it(
        protocol: Protocol, model: str, usage: Usage, want: tuple[int, int, int, float]) -> None:
    bill = reported_bill(protocol, Reply(Message("assistant", ()), usage), model)
    assert bill is not None
    assert (bill.uncached, bill.read, bill.written) == want[:3]
    assert bill.cost == pytest.approx(want[3])
    assert reported_bill(protocol, Reply(Message("assistant", ()), Usage(0, 7)), model) is None
