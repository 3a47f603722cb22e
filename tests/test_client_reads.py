"""A client's bytes read in large pieces (serve/client_reads.py): a reader made larger returns up
to CHUNK per read however little is asked, every byte in order, on real loopback sockets. The
proxy reads with it on every test that goes through mitmdump (tests/test_hostile_bodies.py sends
it 32 MB)."""

from __future__ import annotations

import asyncio
import os

from perpetuity_core.serve.client_reads import CHUNK, larger


def test_a_larger_reader_returns_a_chunk_a_read_and_every_byte_in_order() -> None:
    sent = os.urandom(4 * CHUNK)

    async def run() -> tuple[int, bytes]:
        got: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            larger(reader, writer.transport)
            await asyncio.sleep(0.3)  # the client's bytes arrive meanwhile
            first = await reader.read(65535)  # what mitmproxy's handler asks for
            rest = b""
            while data := await reader.read(65535):
                rest += data
            got.put_nowait((len(first), first + rest))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(sent)
            await writer.drain()
            writer.write_eof()
            out = await asyncio.wait_for(got.get(), 10)
            writer.close()
            return out

    first, received = asyncio.run(run())
    assert first == CHUNK and received == sent
