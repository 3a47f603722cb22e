"""A client's bytes read in large pieces. mitmproxy's connection handler reads a client 64 KB at
a time (`reader.read(65535)`, its StreamReader pausing past 128 KB), and hands each piece
through every layer of its stack: a request's body is read at a CPU cost per byte several times
the bytes' own. A coding session that never ends sends its whole history on every call, 21 MB
by 1.2M tokens, so that cost grew with the history: 26.6 ms of the event loop's CPU for a 21 MB
body (a bare mitmdump answering at once, p50 of 30), 3.4 ms for a 2.3 MB one.

Each client connection is read in pieces of up to CHUNK instead (the socket's `recv`, the
reader's buffer and its reads): 18.3 ms and 2.9 ms the same way. The handler's reads are still
its own (the same loop, the same events, fewer of them); only the size asked for changes.

A request body's pieces are then handed on as read, not copied on the way: mitmproxy's HTTP/1
server copied each piece into its buffer, twice out of it (h11's `maybe_extract_at_most`), once
more into bytes, then into a growing buffer of the body, and joined that (`bytes(...)`): six
copies of every byte besides the socket's and the reader's. A piece short of a Content-Length
body's end now goes to the body's list of pieces as it is (`_handle_event`), and the list is
joined once (`Pieces`). A bare mitmdump answering at once, beside one without this (p50 of 40
each, load 8-9): a 21 MB body took 11.6-13.5 ms of CPU against 14.7-17.2, and 35-40 ms from
the client's send to the answer against 41-47; a 2.3 MB one 2.8 ms against 3.1.

How it fails: where the handler or its transport is not the one this knows (another
mitmproxy, a WireGuard or local-mode stream), the connection is read as mitmproxy reads it;
where mitmproxy's HTTP/1 server or h11's reader is not the one this knows, bodies are read as
mitmproxy reads them. The end of a body (its last piece, chunked bodies) always goes
mitmproxy's way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from h11._readers import ContentLengthReader
from mitmproxy import ctx
from mitmproxy.proxy import events
from mitmproxy.proxy.layers import http as http_layers
from mitmproxy.proxy.layers.http import _http1

CHUNK = 1 << 20  # bytes a read may return (and buffer before the socket is paused)


class LargeReads:
    def load(self, loader: Any) -> None:
        pieces_kept()

    def client_connected(self, client: Any) -> None:
        """Before the handler's first read (mitmproxy runs this hook, then reads)."""
        proxy = ctx.master.addons.get("proxyserver")
        handler = getattr(proxy, "connections", {}).get(client.id)
        io = getattr(handler, "transports", {}).get(client)
        reader, writer = getattr(io, "reader", None), getattr(io, "writer", None)
        if isinstance(reader, asyncio.StreamReader) and isinstance(writer, asyncio.StreamWriter):
            larger(reader, writer.transport)


def larger(reader: asyncio.StreamReader, transport: asyncio.BaseTransport) -> None:
    """`reader` asked for up to CHUNK at a time however little its caller asks, buffering as
    much, fed by `recv`s of as much; left as it is where the transport reads otherwise."""
    if not isinstance(getattr(transport, "max_size", None), int) or not hasattr(reader, "_limit"):
        return
    transport.max_size = CHUNK  # type: ignore[attr-defined]  # (asyncio's selector transport)
    reader._limit = CHUNK  # type: ignore[attr-defined]  # (its pause above twice this)
    read = reader.read

    async def read_larger(n: int = -1) -> bytes:
        return await read(max(n, CHUNK) if n > 0 else n)

    reader.read = read_larger  # type: ignore[method-assign]


class Pieces:
    """A request body as mitmproxy's HTTP layer buffers it (`+=`, `len`, `bytes`, `clear`):
    its pieces kept as they came and joined once, where a bytearray copied each in and the
    whole out again."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def __iadd__(self, data: bytes | bytearray) -> Pieces:
        if data:
            self._parts.append(data if type(data) is bytes else bytes(data))
            self._size += len(data)
        return self

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __bytes__(self) -> bytes:
        if len(self._parts) > 1:
            self._parts = [b"".join(self._parts)]
        return self._parts[0] if self._parts else b""

    def clear(self) -> None:
        self._parts, self._size = [], 0


def pieces_kept() -> bool:
    """mitmproxy's HTTP/1 server taught to pass a Content-Length body's pieces on as read, and
    its HTTP streams to keep them as `Pieces`; once, and False (nothing changed) where either
    is not the code this knows."""
    server, stream = getattr(_http1, "Http1Server", None), getattr(http_layers, "HttpStream", None)
    if stream is not None and getattr(stream.__init__, "_pieces", False):
        return True
    if server is None or stream is None or not hasattr(server, "read_body"):
        return False
    handle, init = server._handle_event, stream.__init__

    def handle_event(self: Any, event: events.Event) -> Generator[Any, Any, None]:
        reader = getattr(self, "body_reader", None)
        if (type(event) is events.DataReceived and type(reader) is ContentLengthReader
                and self.state == self.read_body and not self.buf
                and len(event.data) < reader._remaining):
            reader._remaining -= len(event.data)  # (the last piece goes h11's way: its end)
            yield _http1.ReceiveHttp(self.ReceiveData(self.stream_id, event.data))
            return
        yield from handle(self, event)

    def init_stream(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.request_body_buf = Pieces()

    init_stream._pieces = True  # type: ignore[attr-defined]
    server._handle_event = handle_event
    stream.__init__ = init_stream
    return True
