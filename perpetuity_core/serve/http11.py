"""The relay's side of one HTTP/1.1 connection from mitmproxy, framed by h11: requests read
whole (Content-Length or chunked), replies sent chunked so the store can take a reply before
the client sees its end. A reply's head goes out with its first chunk when that is at hand (a
provider's head and first events come in one read): mitmproxy then reads both at once, where
two writes cost it a turn of the event loop between them, before the client's first byte."""

from __future__ import annotations

import asyncio

import h11

READ = 64 * 1024


class Http11:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._conn = h11.Connection(h11.SERVER)
        self._head = b""  # a reply's head not yet written

    async def request(self, name: bytes) -> str | None:
        """The next request's header `name` (lower-case; "" when it has none), its body read
        and dropped (the relay's job carries it, and the rest of the headers); None when
        mitmproxy closed the connection or it cannot be reused."""
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        elif conn.our_state is not h11.IDLE:
            return None
        value = ""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self.reader.read(READ))  # b"" is the peer's close
            elif isinstance(event, h11.Request):
                value = next((v.decode("latin-1") for k, v in event.headers if k == name), "")
            elif isinstance(event, h11.EndOfMessage):
                return value
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    def start(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        """The reply's head, its headers text as mitmproxy reads them (UTF-8, surrogate
        escapes); its body follows chunked."""
        self._head = self._conn.send(h11.Response(
            status_code=status, reason=reason.encode("latin-1"),
            headers=[*[(k.encode("ascii"), v.encode("utf-8", "surrogateescape"))
                       for k, v in headers],
                     (b"transfer-encoding", b"chunked")]))
        # Alone on the loop's next turn if no chunk comes with it (the relay awaits upstream).
        asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._head and not self.writer.is_closing():
            self.writer.write(self._head)
        self._head = b""

    def send(self, data: bytes) -> None:
        if data:  # an empty chunk would end the body
            chunk = self._conn.send(h11.Data(data=data))
            if self._head:  # (joined: 3.13.0's writelines writes on a transport that was lost)
                chunk, self._head = self._head + chunk, b""
            self.writer.write(chunk)

    async def end(self) -> None:
        self._flush()
        self.writer.write(self._conn.send(h11.EndOfMessage()))
        await self.writer.drain()

    async def drain(self) -> None:
        await self.writer.drain()

    async def respond(self, status: int, body: bytes) -> None:
        """A whole reply of our own (the relay's errors)."""
        self.writer.write(self._conn.send(h11.Response(
            status_code=status, reason=b"Bad Gateway",
            headers=[("content-type", "text/plain"), ("content-length", str(len(body)))])))
        self.writer.write(self._conn.send(h11.Data(data=body)))
        await self.end()

    def hung_up(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def abort(self) -> None:
        self._head = b""
        self.writer.transport.abort()
