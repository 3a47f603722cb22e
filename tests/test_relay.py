"""The relay on its own, in-process: keep-alive pings while a slow tool runs."""

from __future__ import annotations

import asyncio
import json

from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.exchange import Job, PendingTurn
from perpetuity_core.serve.relay import JOB_HEADER, Relay
from perpetuity_core.wire.conversation import Protocol
from tests.fake_provider import FakeProvider, Text, ToolCall


async def _exchange(fake: FakeProvider) -> bytes:
    # The tool returns once the client has seen two pings. The round with our call is hidden
    # and the provider pings once a reply, so at least one of the two is the relay's own.
    pinged = asyncio.Event()

    async def slow_tool(name: str, arguments: object, memory: TurnMemory) -> str:
        await asyncio.wait_for(pinged.wait(), 20)
        return "nothing found"

    relay = Relay(lambda job: None, lambda job, reply, at: None, slow_tool)
    await relay.start()
    body = {"model": "claude-opus-4-8", "max_tokens": 20, "stream": True,
            "messages": [{"role": "user", "content": "what did I say?"}]}
    specs = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
             for t in tools.TOOLS]
    job = Job("POST", fake.url + "/v1/messages", [("x-api-key", "k")], json.dumps(body).encode(),
              Protocol.ANTHROPIC, True, PendingTurn("u", "c", "anthropic", "m", [], 0.0),
              memory=TurnMemory(1, None, 0.0), tool_specs=specs)
    token = relay.submit(job)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    # The relay keeps its connection to mitmproxy alive: read to the body's last chunk.
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        chunk = await asyncio.wait_for(reader.read(65536), 20)
        assert chunk, raw
        raw += chunk
        if raw.count(b"event: ping") >= 2:
            pinged.set()
    writer.close()
    await writer.wait_closed()
    await relay.stop()
    return raw


def test_pings_keep_the_stream_alive_while_a_tool_runs() -> None:
    with FakeProvider() as fake:
        fake.script(ToolCall("memory_search", {"query": "x"}, call_id="toolu_slow"), Text("Done."))
        raw = asyncio.run(_exchange(fake))
    # Pings while the tool ran, before the next round's first block; then the provider's own.
    second_ping = raw.index(b"event: ping", raw.index(b"event: ping") + 1)
    assert raw.index(b"event: content_block_start") > second_ping
    assert raw.count(b"event: ping", raw.index(b"event: content_block_start")) == 1
    assert raw.count(b"event: message_start") == 1 and raw.count(b"event: message_stop") == 1
    assert b"memory_search" not in raw


async def _after_a_chunked_request(fake: FakeProvider) -> tuple[bytes, bytes]:
    relay = Relay(lambda job: None, lambda job, reply, at: None, None)  # type: ignore[arg-type]
    await relay.start()
    body = {"model": "claude-opus-4-8", "max_tokens": 20,
            "messages": [{"role": "user", "content": "hello"}]}
    job = Job("POST", fake.url + "/v1/messages", [("x-api-key", "k")], json.dumps(body).encode(),
              Protocol.ANTHROPIC, False, PendingTurn("u", "c", "anthropic", "m", [], 0.0))
    token = relay.submit(job)
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    # Two requests on one connection, as mitmproxy reuses it: the first one's body chunked
    # (its job unknown), the second a real job.
    writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-perpetuity-job: nothing\r\n"
                 b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"unknown relay job"), 20)
    second = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
    writer.close()
    await writer.wait_closed()
    await relay.stop()
    return first, second


def test_a_chunked_request_body_is_read_whole() -> None:
    with FakeProvider() as fake:
        fake.script(Text("Hi there."))
        first, second = asyncio.run(_after_a_chunked_request(fake))
    assert first.startswith(b"HTTP/1.1 502 ")
    # The second request reached its job: the chunked body was not read as a request.
    assert second.lstrip().startswith(b"HTTP/1.1 200 "), second[:200]
    assert b"Hi there." in second
