"""The relay's client to the providers: HTTP/1.1 over asyncio streams, framed by h11 (the
relay's side toward mitmproxy is serve/http11.py), with a keep-alive pool per (scheme, host,
port).

Why its own: httpx's layers (its request and URL models, httpcore's pool, anyio's streams, the
trace hooks) took ~2.5 ms CPU of a relayed request's 13.6 (perf; issue 24) for what these few
steps do, and it sent a user-agent of its own when the client sent none. What the relay asks
of it, each as httpx gave it:
- idle connections kept KEEP_ALIVE seconds, MAX_IDLE of them at most; one the provider closed
  is seen closed when taken, and replaced; a request that fails on a reused connection before
  any byte of its reply is sent once more on a new one (the provider closed it while idle);
- TLS verified against certifi's CAs (httpx's default), the host name checked;
- nothing carried between requests (no cookie jar), no proxy from the environment, and no
  header of its own but Host, Content-Length and the encodings ReplyTee reads;
- a call cancelled, or its response closed before its end, closes its connection: the
  provider stops generating what it bills.

Errors: whatever keeps the provider from being reached or read is an UpstreamError, its cause
kept, never an OSError: the relay tells the provider's failures from its client's
(ConnectionError) by type.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi
import h11

from perpetuity_core.errors import UpstreamError
from perpetuity_core.serve.tee import READABLE_ENCODINGS

# How long an idle connection to a provider is kept (httpx's default is 5 s): a harness pauses
# longer between calls (a tool running, its user reading), and each new connection costs a TCP
# and TLS handshake before the request (issue 24).
KEEP_ALIVE = 120.0
MAX_IDLE = 20  # idle connections kept, over every provider
MAX_BUSY = 100  # connections carrying a call at once
CONNECT_TIMEOUT = 30.0  # seconds for the TCP and TLS handshakes
WRITE_TIMEOUT = 60.0  # seconds for the request's bytes to leave
POOL_TIMEOUT = 30.0  # seconds a call waits for one of MAX_BUSY
READ = 64 * 1024
# Set here whatever the caller's headers say: the framing is ours, and so is the offer of
# encodings (a reply in one ReplyTee cannot read would reach the client unstored).
_OURS = frozenset({"host", "content-length", "transfer-encoding", "accept-encoding"})
_PORTS = {"http": 80, "https": 443}
_OFFER = READABLE_ENCODINGS.encode()

Key = tuple[str, str, int]  # (scheme, host, port)


class _Stale(UpstreamError):
    """A reused connection failed before any byte of its reply: the provider had closed it."""


@dataclass(slots=True)
class Request:
    method: str
    url: str
    headers: list[tuple[str, str]]  # the caller's, as they go (their names' case kept)
    content: bytes


def tls_context() -> ssl.SSLContext:
    """What the relay verifies a provider's certificate with: certifi's CAs, as httpx did."""
    context = ssl.create_default_context(cafile=certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context


class Response:
    """A reply's head, its body read as it comes: `aiter_raw` yields what each read brought."""

    __slots__ = ("_client", "_conn", "_ended", "headers", "reason_phrase", "status_code")

    def __init__(self, client: Client, conn: _Connection, head: h11.Response) -> None:
        self.status_code = head.status_code
        self.reason_phrase = head.reason.decode("ascii", "ignore")
        # As mitmproxy reads header bytes (UTF-8, surrogate escapes): what goes on is what came.
        self.headers = [(k.decode("ascii"), v.decode("utf-8", "surrogateescape"))
                        for k, v in head.headers]
        self._client: Client | None = client
        self._conn = conn
        self._ended = False

    def header(self, name: str) -> str:
        """The first value of the header `name` (lower-case), or ""."""
        return next((v for k, v in self.headers if k == name), "")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives, undecoded; one chunk a read."""
        while not self._ended:
            chunk, self._ended = await self._conn.body()
            if chunk:
                yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        """Its connection back to the pool when the body was read to its end, else closed."""
        client, self._client = self._client, None
        if client is not None:
            client.release(self._conn, self._ended)


def decoded(body: bytes, encoding: str) -> bytes:
    """A whole body as its content-encoding (one of those we offer) leaves it readable."""
    if encoding.strip().lower() in ("gzip", "deflate"):
        try:
            return zlib.decompress(body, zlib.MAX_WBITS | 32)
        except zlib.error as e:
            raise UpstreamError(f"could not decode the reply's {encoding}: {e}") from e
    return body


def _head(request: Request) -> tuple[Key, h11.Request]:
    """Where the request goes, and its head. Header values go as the bytes mitmproxy read
    (it decodes them as UTF-8 with surrogate escapes)."""
    parts = urlsplit(request.url)
    scheme, host = parts.scheme, parts.hostname or ""
    try:
        if scheme not in _PORTS or not host:
            raise ValueError("not an http(s) URL with a host")
        port = parts.port or _PORTS[scheme]
        headers = [(k.encode("ascii"), v.encode("utf-8", "surrogateescape"))
                   for k, v in request.headers if k.lower() not in _OURS]
        netloc = parts.netloc.rpartition("@")[2].removesuffix(f":{_PORTS[scheme]}")
        if request.content or request.method not in ("GET", "HEAD"):
            headers.append((b"content-length", str(len(request.content)).encode()))
        target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        return (scheme, host, port), h11.Request(method=request.method, target=target, headers=[
            (b"host", netloc.encode("ascii")), *headers, (b"accept-encoding", _OFFER)])
    except (ValueError, h11.ProtocolError) as e:  # (UnicodeError is a ValueError)
        raise UpstreamError(f"cannot send to {request.url}: {e}") from e


class _Connection:
    """One HTTP/1.1 connection to a provider."""

    __slots__ = ("h11", "idle_since", "key", "reader", "reused", "writer")

    def __init__(self, key: Key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.key = key
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.reused = False

    def usable(self, now: float) -> bool:
        """Idle not too long, and not closed by the provider meanwhile."""
        return (now - self.idle_since < KEEP_ALIVE and not self.reader.at_eof()
                and not self.writer.is_closing())

    async def head(self, request: h11.Request, content: bytes) -> h11.Response:
        """The request sent; its reply's head read (the body stays to be read)."""
        conn, writer = self.h11, self.writer
        received = False
        try:
            head = conn.send(request)
            # One write of both (sendmsg): one segment where a body is small, as most are. (The
            # connection was just found open, or just opened: no write to a lost transport.)
            writer.writelines([head, conn.send(h11.Data(data=content))] if content else [head])
            conn.send(h11.EndOfMessage())  # (Content-Length framing: nothing to write)
            if writer.transport.get_write_buffer_size():
                async with asyncio.timeout(WRITE_TIMEOUT):
                    await writer.drain()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await self.reader.read(READ)
                    received = received or bool(data)
                    conn.receive_data(data)  # b"": the provider closed
                elif isinstance(event, h11.Response):
                    return event
                elif not isinstance(event, h11.InformationalResponse):  # (a 100 Continue)
                    # (the provider's close before a head is h11's RemoteProtocolError)
                    raise ConnectionResetError(f"the provider ended the exchange ({event})")
        except TimeoutError as e:
            raise UpstreamError(f"could not send the request within {WRITE_TIMEOUT:g} s") from e
        except (OSError, h11.ProtocolError) as e:
            if received:
                raise UpstreamError(f"could not read the reply's head: {e}") from e
            if self.reused:
                raise _Stale(str(e)) from e
            raise UpstreamError(f"the provider closed the connection without a reply ({e})") from e

    async def body(self) -> tuple[bytes, bool]:
        """What the next read brings of the body, and whether the body ended with it."""
        conn = self.h11
        parts: list[bytes] = []
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if parts:
                        return b"".join(parts), False
                    conn.receive_data(await self.reader.read(READ))
                elif isinstance(event, h11.Data):
                    parts.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(parts), True
                else:  # ConnectionClosed before the body's end
                    raise ConnectionResetError("the provider closed the connection mid-reply")
        except (OSError, h11.ProtocolError) as e:
            raise UpstreamError(str(e) or type(e).__name__) from e

    def close(self) -> None:
        self.writer.transport.abort()  # no TLS goodbye to wait for


class Client:
    """The relay's one client to every provider; it holds no state of any request."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls or tls_context()
        self._idle: dict[Key, list[_Connection]] = {}
        self._idle_count = 0
        self._busy = asyncio.Semaphore(MAX_BUSY)

    async def send(self, request: Request) -> Response:
        """The request sent; the response's head read, its body streaming."""
        key, head = _head(request)
        if self._busy.locked():
            try:
                async with asyncio.timeout(POOL_TIMEOUT):
                    await self._busy.acquire()
            except TimeoutError as e:
                raise UpstreamError(f"no connection free within {POOL_TIMEOUT:g} s") from e
        else:
            await self._busy.acquire()
        conn = None
        try:
            if (conn := self._take(key)) is not None:
                try:
                    return Response(self, conn, await conn.head(head, request.content))
                except _Stale:
                    conn.close()
            conn = await self._connect(key)
            return Response(self, conn, await conn.head(head, request.content))
        except BaseException:  # an error, or a cancelled call: the provider hears it stop
            if conn is not None:
                conn.close()
            self._busy.release()
            raise

    def release(self, conn: _Connection, ended: bool) -> None:
        """A response closed: its connection kept idle if it can carry another request."""
        self._busy.release()
        h = conn.h11
        if not (ended and h.our_state is h11.DONE and h.their_state is h11.DONE):
            conn.close()
            return
        h.start_next_cycle()
        conn.idle_since, conn.reused = time.monotonic(), True
        if self._idle_count >= MAX_IDLE:
            oldest = min((c for idle in self._idle.values() for c in idle[:1]),
                         key=lambda c: c.idle_since)
            self._idle[oldest.key].remove(oldest)
            self._idle_count -= 1
            oldest.close()
        self._idle.setdefault(conn.key, []).append(conn)
        self._idle_count += 1

    def _take(self, key: Key) -> _Connection | None:
        """The most recently used idle connection to `key` still open; any idle one past its
        keep-alive closed on the way."""
        now = time.monotonic()
        for kept in self._idle.values():  # oldest first in each list
            while kept and now - kept[0].idle_since >= KEEP_ALIVE:
                self._idle_count -= 1
                kept.pop(0).close()
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            if conn.usable(now):
                return conn
            conn.close()
        return None

    async def _connect(self, key: Key) -> _Connection:
        scheme, host, port = key
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._tls if scheme == "https" else None, limit=READ)
        except TimeoutError as e:
            raise UpstreamError(f"could not connect to {host}:{port} within "
                                f"{CONNECT_TIMEOUT:g} s") from e
        except OSError as e:  # refused, unreachable, a certificate not verified (ssl.SSLError)
            raise UpstreamError(f"could not connect to {host}:{port}: {e}") from e
        return _Connection(key, reader, writer)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        self._idle_count = 0
