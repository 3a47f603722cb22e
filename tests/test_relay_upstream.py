"""The relay's client to the provider (serve/upstream.py) over real sockets: the headers it
adds, a stale pooled connection, a read's worth of chunks, TLS verification, env proxies."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from mitmproxy import certs

from perpetuity_core.errors import UpstreamError
from perpetuity_core.serve.relay import JOB_HEADER, Relay
from perpetuity_core.serve.upstream import Client, Request
from perpetuity_core.serve.writer import Capture
from tests.fake_provider import FakeProvider, Text
from tests.test_relay import CaptureLog, Inline, _job

BODY = {"model": "claude-opus-4-8", "max_tokens": 20,
        "messages": [{"role": "user", "content": "hello"}]}


def reply(text: str) -> bytes:
    """A whole Anthropic message, as a provider sends it on a kept-alive connection."""
    body = json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                       "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                       "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


class Scripted:
    """An HTTP/1.1 server on 127.0.0.1 that answers the n-th request on its c-th connection
    with `answer(c, n)`: the raw bytes written at once, or None to close without a word."""

    def __init__(self, answer: Callable[[int, int], bytes | None],
                 tls: ssl.SSLContext | None = None) -> None:
        self.answer, self.tls = answer, tls
        self.connections: list[list[dict[str, str]]] = []  # each request's headers
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests: list[dict[str, str]] = []
        self.connections.append(requests)
        c = len(self.connections) - 1
        try:
            while True:
                lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in
                           (line.partition(":") for line in lines[1:] if line)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                requests.append(headers)
                answer = self.answer(c, len(requests) - 1)
                if answer is None:
                    return
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


async def delivered(relay: Relay, url: str, headers: list[tuple[str, str]]) -> bytes:
    """A plain job to `url` fetched from the relay as mitmproxy does: its whole reply."""
    job = _job(None, BODY, stream=False)
    job.url, job.headers = url + "/v1/messages", headers
    token = relay.submit(Capture(job, CaptureLog(), Inline()))
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\n{JOB_HEADER}: {token}\r\n"
                 "content-length: 0\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    if b"chunked" in head.lower():
        raw = head + await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 20)
    else:  # the relay's own answer (a 502)
        raw = head + await reader.readexactly(int(head.lower().split(b"content-length: ")[1]
                                                  .split(b"\r\n")[0]))
    writer.close()
    await writer.wait_closed()
    return raw


async def _headers_as_sent(fake: FakeProvider) -> None:
    relay = Relay(None)  # type: ignore[arg-type]
    await relay.start()
    await delivered(relay, fake.url, [("x-api-key", "k")])
    await delivered(relay, fake.url, [("X-Api-Key", "k"), ("User-Agent", "claude-cli/2.1.90"),
                                      ("Accept-Encoding", "br")])
    await relay.stop()


def test_the_provider_gets_the_clients_headers_and_only_the_framing_beside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx added a user-agent of its own (python-httpx/...), an accept and a connection
    header to every relayed call the client sent without them; mitmproxy's path adds none.
    The relay sends the client's headers, the framing (host, content-length) and the encodings
    the reply reader reads, whatever the client offered; no proxy from the environment."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # (the discard port: nothing answers)
    with FakeProvider() as fake:
        fake.script(Text("One."), Text("Two."))
        asyncio.run(_headers_as_sent(fake))
        bare, named = fake.requests
    assert set(bare.headers) == {"host", "content-length", "accept-encoding", "x-api-key"}
    assert bare.headers["host"] == f"127.0.0.1:{fake.port}"
    assert bare.headers["accept-encoding"] == "gzip, deflate"
    assert named.headers["user-agent"] == "claude-cli/2.1.90"
    assert named.headers["accept-encoding"] == "gzip, deflate"


async def _after_a_stale_connection(answer: Callable[[int, int], bytes | None]
                                    ) -> tuple[list[bytes], Scripted]:
    async with Scripted(answer) as provider:
        relay = Relay(None)  # type: ignore[arg-type]
        await relay.start()
        url = f"http://127.0.0.1:{provider.port}"
        raws = [await delivered(relay, url, [("x-api-key", "k")]) for _ in range(2)]
        await relay.stop()
    return raws, provider


def test_a_pooled_connection_the_provider_closed_unseen_is_retried_on_a_new_one() -> None:
    """A provider closes an idle connection as the next request reaches it (its keep-alive
    ran out): nothing of the reply came, so the request goes once more on a new connection
    (as browsers do on a reused socket), where httpx answered the client 502."""
    raws, provider = asyncio.run(_after_a_stale_connection(
        lambda c, n: reply("Two.") if c else (reply("One.") if n == 0 else None)))
    assert [len(requests) for requests in provider.connections] == [2, 1]
    assert raws[1].startswith(b"HTTP/1.1 200 ") and b"Two." in raws[1], raws[1][:200]


def test_a_fresh_connection_closed_before_its_reply_is_not_retried() -> None:
    """Only a reused connection's silence is taken for staleness: a provider that closes a
    new connection without answering is failing, and the client hears it (502)."""
    raws, provider = asyncio.run(_after_a_stale_connection(
        lambda c, n: reply("One.") if (c, n) == (0, 0) else None))
    assert [len(requests) for requests in provider.connections] == [2, 1]
    assert raws[1].startswith(b"HTTP/1.1 502 ")


def chunked(*chunks: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
            b"\r\n\r\n" + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")


async def _read(url: str, tls: ssl.SSLContext | None = None) -> list[bytes]:
    client = Client(tls)
    try:
        resp = await client.send(Request("POST", url + "/v1/messages", [], b"{}"))
        chunks = [chunk async for chunk in resp.aiter_raw()]
        await resp.aclose()
        return chunks
    finally:
        await client.aclose()


def test_what_one_read_brings_is_one_chunk() -> None:
    """Three chunks of the provider's framing in one read are one chunk of the body (httpx
    handed on each of them), as mitmproxy's own path reads a stream."""
    events = [b"event: ping\ndata: {}\n\n"] * 3

    async def run() -> list[bytes]:
        async with Scripted(lambda c, n: chunked(*events)) as provider:
            return await _read(f"http://127.0.0.1:{provider.port}")

    assert asyncio.run(run()) == [b"".join(events)]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(a provider's server context for `localhost`, a client context trusting its CA)."""
    where = tmp_path_factory.mktemp("ca")
    store = certs.CertStore.from_store(where, "test", 2048)
    entry = store.get_cert("localhost", [])
    pem = Path(where / "localhost.pem")
    pem.write_bytes(entry.cert.to_pem() + entry.privatekey.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption()))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(pem)
    trusting = ssl.create_default_context(cafile=str(where / "test-ca-cert.pem"))
    return server, trusting


@pytest.mark.parametrize(("host", "trusted", "readable"), [
    ("localhost", True, True), ("127.0.0.1", True, False), ("localhost", False, False)],
    ids=["verified", "another host's name", "an unknown CA"])
def test_tls_to_the_provider_is_verified(tls: tuple[ssl.SSLContext, ssl.SSLContext],
                                         host: str, trusted: bool, readable: bool) -> None:
    """An https provider's certificate is checked against the CAs (certifi's by default, as
    httpx did) and its name against the host: a certificate that fails either is refused."""
    server, trusting = tls

    async def run() -> list[bytes]:
        async with Scripted(lambda c, n: chunked(b"hi"), tls=server) as provider:
            return await _read(f"https://{host}:{provider.port}", trusting if trusted else None)

    if readable:
        assert asyncio.run(run()) == [b"hi"]
    else:
        with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
            asyncio.run(run())
