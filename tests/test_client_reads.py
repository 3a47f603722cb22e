"""A client's bytes read in large pieces (serve/client_reads.py): a reader made larger returns up
to CHUNK per read however little is asked, every byte in order, on real loopback sockets; a
request body's pieces go on as read and are joined once, in mitmproxy's own HTTP/1 server. The
proxy reads with both on every test that goes through mitmdump (tests/test_hostile_bodies.py
sends it 32 MB)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from mitmproxy.proxy import events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import HttpStream, RequestData, RequestEndOfMessage
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.test import taddons, tflow

from perpetuity_core.serve.client_reads import CHUNK, Pieces, larger, pieces_kept


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


def _served(pieces: list[bytes]) -> list[Any]:
    """mitmproxy's HTTP/1 server fed `pieces` as one client connection's reads: what it passes
    on to the HTTP layer (headers, body pieces, the end)."""
    with taddons.context() as tctx:
        client = tflow.tclient_conn()
        server = Http1Server(Context(client, tctx.options))
        list(server.handle_event(events.Start()))
        return [c.event for p in pieces
                for c in server.handle_event(events.DataReceived(client, p))
                if isinstance(c, ReceiveHttp)]


def test_a_body_piece_short_of_its_end_is_passed_on_as_read_not_copied() -> None:
    pieces_kept()
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 30\r\n\r\n"
    middle = b"abcdefghij"
    # The last piece ends the body and holds the next request's first bytes (pipelined).
    got = _served([head + b"0123456789", middle, b"ABCDEFGHIJGET / HTTP/1.1\r\n"])
    data = [e.data for e in got if isinstance(e, RequestData)]
    assert b"".join(data) == b"0123456789abcdefghijABCDEFGHIJ"
    assert any(d is middle for d in data)  # the same object: no copy on the way
    assert isinstance(got[-1], RequestEndOfMessage)


def test_a_chunked_body_is_read_as_mitmproxy_reads_it() -> None:
    pieces_kept()
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    got = _served([head + b"10\r\n0123456789abcdef\r\n", b"4\r\nwxyz\r\n0\r\n\r\n"])
    assert b"".join(e.data for e in got if isinstance(e, RequestData)) == (
        b"0123456789abcdefwxyz")
    assert isinstance(got[-1], RequestEndOfMessage)


def test_a_body_kept_in_pieces_is_joined_once() -> None:
    pieces_kept()
    with taddons.context() as tctx:
        stream = HttpStream(Context(tflow.tclient_conn(), tctx.options), 1)
    body = stream.request_body_buf
    assert isinstance(body, Pieces) and not body
    one = b"x" * 1000
    body += one
    assert bytes(body) is one  # a body of one piece is that piece
    body += bytearray(b"yz")
    assert len(body) == 1002 and bytes(body) == one + b"yz" and bytes(body) is bytes(body)
    body.clear()
    assert not body and bytes(body) == b""
