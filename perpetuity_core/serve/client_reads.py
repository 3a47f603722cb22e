"""A client's bytes read in large pieces. mitmproxy's connection handler reads a client 64 KB at
a time (`reader.read(65535)`, its StreamReader pausing past 128 KB), and hands each piece
through every layer of its stack: a request's body is read at a CPU cost per byte several times
the bytes' own. A coding session that never ends sends its whole history on every call, 21 MB
by 1.2M tokens, so that cost grew with the history: 26.6 ms of the event loop's CPU for a 21 MB
body (a bare mitmdump answering at once, p50 of 30), 3.4 ms for a 2.3 MB one.

Each client connection is read in pieces of up to CHUNK instead (the socket's `recv`, the
reader's buffer and its reads): 18.3 ms and 2.9 ms the same way. The handler's reads are still
its own (the same loop, the same events, fewer of them); only the size asked for changes.

How it fails: where the handler or its transport is not the one this knows (another
mitmproxy, a WireGuard or local-mode stream), the connection is read as mitmproxy reads it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mitmproxy import ctx

CHUNK = 1 << 20  # bytes a read may return (and buffer before the socket is paused)


class LargeReads:
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
