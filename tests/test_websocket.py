"""Codex's own provider over a WebSocket: the captured messages through the addon's hooks
(mitmproxy's test flows, a real store): prewarm skipped, each turn and reply stored once."""

from __future__ import annotations

import asyncio
import json
import socket as stdlib_socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import websocket
from mitmproxy.test import taddons, tflow
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage
from wsproto.frame_protocol import Opcode

from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.chain import http_body
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.protocols import responses
from perpetuity_core.wire.route import DEFAULT_UPSTREAMS, route
from perpetuity_core.wire.sse import Event
from tests.addons import Perpetuity
from tests.conftest import FIXTURES, Proxy, needs_fixtures, query
from tests.fake_provider import FakeProvider, Text, ToolCall

CODEX = FIXTURES / "codex"


def session(prefix: str) -> list[tuple[dict, list[dict]]]:
    """(client message, server events) for each captured message of one WebSocket session."""
    out = []
    for f in sorted(CODEX.glob(f"{prefix}-ws_message-*.json")):
        if f.name.endswith(".response.json"):
            continue
        reply = json.loads(f.with_name(f.name.removesuffix(".json") + ".response.json").read_text())
        out.append((json.loads(f.read_text())["body"], reply["frames"]))
    return out


async def drive(addon: Perpetuity, handshake: Path, exchanges: list[tuple[dict, list[dict]]]) -> None:
    flow = tflow.twebsocketflow(messages=False)
    raw = json.loads(handshake.read_text())
    flow.request.host, flow.request.port, flow.request.path = "127.0.0.1", 8080, raw["path"]
    flow.request.headers.clear()
    for k, v in raw["headers"]:
        flow.request.headers.add(k, v)
    flow.client_conn.sockname = ("127.0.0.1", 8080)
    response, flow.response = flow.response, None
    await addon.request(flow)
    flow.response = response
    for body, frames in exchanges:
        flow.websocket.messages.append(
            websocket.WebSocketMessage(Opcode.TEXT, True, json.dumps(body).encode()))
        await addon.websocket_message(flow)
        for frame in frames:
            flow.websocket.messages.append(
                websocket.WebSocketMessage(Opcode.TEXT, False, json.dumps(frame).encode()))
            await addon.websocket_message(flow)


def captured(tmp_path: Path, *sessions: tuple[str, str]) -> Path:
    """The store after the addon saw these (handshake file, message files' prefix) sessions."""
    db = tmp_path / "memory.db"
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(db), perpetuity_notes_dir=str(tmp_path / "notes"))
        for handshake, prefix in sessions:
            asyncio.run(drive(addon, CODEX / handshake, session(prefix)))
        addon.executor.submit(time.sleep, 0).result()  # every queued write done
    return db


@needs_fixtures
def test_codex_websocket_turns_are_captured(tmp_path: Path) -> None:
    db = captured(tmp_path,
                  ("05-builtin_ws_basic-ws_handshake-v1_responses.json", "0[67]-builtin_ws_basic"),
                  ("17-tui_ws_multiturn-ws_handshake-v1_responses.json", "1[89]-tui_ws_multiturn"))
    rows = query(
        db, "select c.key, m.role, m.source, group_concat(i.text, '|') from message m join item i"
        " on i.message_id = m.id join conversation c on c.id = m.conversation_id"
        " where i.kind in ('text', 'tool_call') group by m.id order by m.id")
    said = [(role, source, text) for _, role, source, text in rows]
    assert ("user", "request", "say hello") in said
    replies = [r for r in said if r[0] == "assistant"]
    assert replies and all(source == "reply" for _, source, _ in replies)
    assert len(rows) == len(set(rows))  # nothing stored twice
    # One conversation per Codex session, keyed by its session id, never the prewarm as a turn.
    sessions = {dict(json.loads((CODEX / f).read_text())["headers"])["session-id"] for f in (
        "05-builtin_ws_basic-ws_handshake-v1_responses.json",
        "17-tui_ws_multiturn-ws_handshake-v1_responses.json")}
    assert {key for key, *_ in rows} == sessions


@needs_fixtures
def test_codex_title_thread_is_not_a_conversation(tmp_path: Path) -> None:
    """Codex asks for a thread's title in a thread of its own (thread_source thread_title): its
    prompt is harness text, and nothing of it is stored."""
    db = captured(tmp_path,
                  ("20-tui_ws_multiturn-ws_handshake-v1_responses.json", "2[12]-tui_ws_multiturn"))
    assert query(db, "select count(*) from message") == [(0,)]


# ------------------------------------------------------------------ framing over the socket

AT = "2026-11-30T10:00:00Z"  # one time for both paths, so their frames are alike
FACT = "the launch code word is PELICAN-42, remember it"
ASK = "what is the launch code word?"


def said(body: dict, text: str) -> dict:
    """The captured message with its last user text replaced (the shape stays as captured)."""
    out = json.loads(json.dumps(body))
    for item in reversed(out["input"]):
        if item.get("type") == "message" and item.get("role") == "user":
            item["content"] = [{"type": "input_text", "text": text}]
            return out
    raise AssertionError("no user message")


def items_of(frames: list[dict]) -> list[dict]:
    return [f["item"] for f in frames if f.get("type") == "response.output_item.done"]


def completed_id(frames: list[dict]) -> str:
    return next(f["response"]["id"] for f in frames if f.get("type") == "response.completed")


class Provider:
    """One socket's provider as a real one keeps it: the connection's last response (store:
    false), what each message made it hold, and an id it did not issue on this connection is
    refused."""

    def __init__(self) -> None:
        self.last, self.held = "", []
        self.sent: list[tuple[dict, list[dict]]] = []  # (message as sent, the input it held)

    def take(self, body: dict, frames: list[dict]) -> None:
        prev = body.get("previous_response_id")
        assert prev is None or prev == self.last, f"{prev} was not issued on this connection"
        whole = (self.held if prev else []) + body["input"]
        self.sent.append((body, whole))
        self.last, self.held = completed_id(frames), whole + items_of(frames)


class Client:
    """Codex's side: the whole history each message stands for, by the ids it was given."""

    def __init__(self) -> None:
        self.at: dict[str, list[dict]] = {}

    def whole(self, body: dict, frames: list[dict]) -> list[dict]:
        prev = body.get("previous_response_id")
        whole = (self.at[prev] if prev else []) + body["input"]
        self.at[completed_id(frames)] = whole + items_of(frames)
        return whole


def handshake_flow(handshake: Path, *extra: tuple[str, str]) -> tflow.tflow:
    flow = tflow.twebsocketflow(messages=False)
    raw = json.loads(handshake.read_text())
    flow.request.host, flow.request.port, flow.request.path = "127.0.0.1", 8080, raw["path"]
    flow.request.headers.clear()
    for k, v in [*raw["headers"], *extra]:
        flow.request.headers.add(k, v)
    flow.client_conn.sockname = ("127.0.0.1", 8080)
    return flow


async def socket(addon: Perpetuity, handshake: Path, exchanges: list[tuple[dict, list[dict]]],
                 client: Client, wholes: list[list[dict]]) -> Provider:
    """One WebSocket through the addon's hooks: each client message as the proxy sent it
    upstream, taken by the provider, answered with the captured events."""
    flow = handshake_flow(handshake, ("x-perpetuity-time", AT))
    response, flow.response = flow.response, None
    await addon.request(flow)
    flow.response = response
    await addon.response(flow)
    provider = Provider()
    for body, frames in exchanges:
        wholes.append(client.whole(body, frames))
        flow.websocket.messages.append(
            websocket.WebSocketMessage(Opcode.TEXT, True, json.dumps(body).encode()))
        await addon.websocket_message(flow)
        provider.take(json.loads(flow.websocket.messages[-1].content), frames)
        for frame in frames:
            flow.websocket.messages.append(
                websocket.WebSocketMessage(Opcode.TEXT, False, json.dumps(frame).encode()))
            await addon.websocket_message(flow)
        addon.executor.submit(time.sleep, 0).result()  # its turn and reply stored
    return provider


def messages_of(*numbered: tuple[int, str | None]) -> list[tuple[dict, list[dict]]]:
    """Captured messages by their file's number, each with its user text replaced if given."""
    out = []
    for n, text in numbered:
        (body, frames), = session(f"{n:02d}-*")
        out.append((said(body, text) if text else body, frames))
    return out


REASONING = {"id": "rs_fake_0001", "type": "reasoning", "summary": [],
             "encrypted_content": "gAAAAB-encrypted-reasoning-blob"}


def reasoned(exchanges: list[tuple[dict, list[dict]]], index: int) -> list[tuple[dict, list[dict]]]:
    """The reply to message `index` led by an encrypted reasoning item (store: false with
    include reasoning.encrypted_content, as Codex asks)."""
    body, frames = exchanges[index]
    done = {"type": "response.output_item.done", "output_index": 0, "item": REASONING}
    shifted = [{**f, "output_index": f["output_index"] + 1} if "output_index" in f else f
               for f in frames]
    return [*exchanges[:index], (body, [shifted[0], done, *shifted[1:]]), *exchanges[index + 1:]]


def tui_sessions() -> list[tuple[str, list[tuple[dict, list[dict]]]]]:
    """A fact told in one Codex session, then the captured TUI session asking for it: a
    prompt, two more, a reconnect (its history re-sent whole, a tool round, a compaction
    trigger), a compaction on a new socket and the question after it."""
    return [
        ("05-builtin_ws_basic-ws_handshake-v1_responses.json", messages_of((6, None), (7, FACT))),
        ("17-tui_ws_multiturn-ws_handshake-v1_responses.json",
         reasoned(messages_of((18, None), (19, ASK), (23, None), (24, None)), 1)),
        ("25-tui_ws_after_reconnect-ws_handshake-v1_responses.json",
         messages_of((26, None), (27, None), (28, None))),
        ("29-tui_compact-ws_handshake-v1_responses.json", messages_of((30, None), (31, None))),
    ]


def http_side(settings: Settings, db: Path, sessions: list[tuple[str, list[tuple[dict, list[dict]]]]],
              wholes: list[list[dict]]) -> list[list[dict]]:
    """The same history as HTTP requests, each whole (as a custom provider sends it), through
    a pipeline of its own on a memory of its own: the input each would have sent upstream (our
    tools' item in it where they ride)."""
    pipeline = Pipeline(open_memory(str(db)), settings)
    sent = []
    messages = [(handshake, body, frames) for handshake, exchanges in sessions
                for body, frames in exchanges]
    for (handshake, body, frames), whole in zip(messages, wholes, strict=True):
        headers = tuple(json.loads((CODEX / handshake).read_text())["headers"])
        req = HttpRequest("POST", "127.0.0.1", "/v1/responses",
                          (*headers, ("x-perpetuity-time", AT)),
                          http_body(body, whole), direct=True)
        d = pipeline.prepare(req)
        # As it goes upstream: the relay's first round when our tools ride (beside Codex's).
        upstream = d.job.first_round if d.job is not None and d.job.first_round else d.body
        sent.append(json.loads(upstream if upstream is not None else req.body)["input"])
        if d.job is not None:
            turn = pipeline.store_turn(d.job.pending)
            assembler = responses.ReplyAssembler()
            for frame in frames:
                assembler.feed(Event(str(frame.get("type", "")), json.dumps(frame)))
            pipeline.store_reply(turn, assembler.reply(), d.job.pending.at, d.job.pending)
    pipeline.store.close()
    return sent


def frame_text(items: list[dict]) -> str:
    return json.dumps(items)


@needs_fixtures
def test_codex_socket_is_framed_as_http_is(tmp_path: Path) -> None:
    """Over the socket the provider ends up holding, message by message, exactly what the
    HTTP path sends for the same history (the frame, its addenda, the kept items), reached by
    extensions of what the connection holds with the provider's own last id, and whole only
    where the HTTP input did not grow at its end (a new frame, a new connection)."""
    sessions = tui_sessions()
    addon = Perpetuity()
    client, wholes, providers = Client(), [], []
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "ws.db"), perpetuity_tenants="personal",
                       perpetuity_notes_dir=str(tmp_path / "notes"))
        for handshake, exchanges in sessions:
            providers.append(asyncio.run(socket(addon, CODEX / handshake, exchanges, client, wholes)))
        assert addon.pipeline is not None
        http = http_side(addon.pipeline.settings, tmp_path / "http.db", sessions, wholes)
    held = [whole for p in providers for _, whole in p.sent]
    bodies = [body for p in providers for body, _ in p.sent]
    assert held == http  # the same lifecycle: Carry, Addendum, Rebuild as over HTTP
    sent_as_is = [exchanges[0][0] for _, exchanges in sessions]
    assert bodies[0] == sent_as_is[0] and bodies[2] == sent_as_is[1]  # prewarms, as sent
    assert bodies[9] == sent_as_is[3]  # the compaction on a new socket, as sent
    # Message by message: 6 prewarm, 7 the fact, 18 prewarm, 19 the question, 23, 24, then the
    # reconnect's 26 (whole), 27 (a tool output), 28 (compaction trigger), 30 and 31.
    question, tool_round, trigger, after = 3, 7, 8, 10
    assert "PELICAN-42" in frame_text(held[question])  # the fact, in front of the question
    assert wholes[question][-1] == held[question][-1]  # the live prompt, as the client sent it
    assert bodies[tool_round]["previous_response_id"] and len(bodies[tool_round]["input"]) == 1
    # The encrypted reasoning of the question's reply stays, byte for byte, in what follows.
    assert all(h.count(REASONING) == 1 for h in held[question + 1:question + 3])
    # Remote compaction compacts the client's own history, not the frame; whole, no chain.
    assert held[trigger] == wholes[trigger] and "previous_response_id" not in bodies[trigger]
    assert any(i.get("type") == "compaction" for i in held[after])  # its summary is kept
    # On each socket, a message rides the chain exactly where what the HTTP path sends
    # extends what the connection holds (append-only); whole where it does not.
    for provider, (_, exchanges) in zip(providers, sessions, strict=True):
        holds: list[dict] | None = None
        for (body, whole), (_, frames) in zip(provider.sent, exchanges, strict=True):
            extends = holds is not None and whole[:len(holds)] == holds
            assert ("previous_response_id" in body) == extends
            holds = whole + items_of(frames)
    # (23 is whole: a chat's new frame, sized to the room its latest exchange leaves, is not
    # the one in front of 19.)
    assert [("previous_response_id" in b) for b in bodies] == [
        False, True, False, True, False, True, False, True, False, False, False]


@needs_fixtures
def test_codex_chain_holds_across_sockets(tmp_path: Path) -> None:
    """A client's response id read on another socket (a reconnect that keeps its chain,
    `store: true`) stands for the client's history at it: sent whole, without the id, which the
    new connection never issued. An id we never saw, or another credential's, goes as sent."""
    (first, first_frames), = messages_of((7, FACT))
    (turn, frames), = messages_of((23, None))
    addon = Perpetuity()
    handshake = CODEX / "05-builtin_ws_basic-ws_handshake-v1_responses.json"
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "ws.db"),
                       perpetuity_notes_dir=str(tmp_path / "notes"))
        first = {k: v for k, v in first.items() if k != "previous_response_id"}
        asyncio.run(socket(addon, handshake, [(first, first_frames)], Client(), []))
        known = {**turn, "previous_response_id": completed_id(first_frames)}
        unknown = {**turn, "previous_response_id": "resp_never_seen"}

        async def resend(body: dict, *extra: tuple[str, str]) -> dict:
            flow = handshake_flow(handshake, *extra)
            response, flow.response = flow.response, None
            await addon.request(flow)
            flow.response = response
            flow.websocket.messages.append(
                websocket.WebSocketMessage(Opcode.TEXT, True, json.dumps(body).encode()))
            await addon.websocket_message(flow)
            return json.loads(flow.websocket.messages[-1].content)

        again = asyncio.run(resend(known))
        assert "previous_response_id" not in again
        assert again["input"][-1] == turn["input"][-1]
        assert [i for i in again["input"] if i in first["input"]] == first["input"]
        assert asyncio.run(resend(unknown)) == unknown
        other = asyncio.run(resend(known, ("authorization", "Bearer sk-someone-else")))
        assert other == known


def through_proxy(p: Proxy, host: str, path: str, headers: list[tuple[str, str]],
                  messages: list[dict]) -> list[list[dict]]:
    """A WebSocket client using the proxy as its HTTPS proxy (CONNECT, mitmproxy's CA): each
    message sent once the last one's response ended; the events of each."""
    raw = stdlib_socket.create_connection(("127.0.0.1", p.port), timeout=10)
    raw.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += raw.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    ca = ssl.create_default_context(cafile=str(p.confdir / "mitmproxy-ca-cert.pem"))
    return exchanged(ca.wrap_socket(raw, server_hostname=host), host, path, headers, messages)


def exchanged(tls: stdlib_socket.socket, host: str, path: str, headers: list[tuple[str, str]],
              messages: list[dict]) -> list[list[dict]]:
    """A WebSocket on this connection: each message sent once the last one's response ended
    (a previous_response_id of "<last>" names it); the events of each."""
    ws = WSConnection(ConnectionType.CLIENT)
    tls.sendall(ws.send(Request(host=host, target=path, extra_headers=[
        (k.encode(), v.encode()) for k, v in headers])))

    def received() -> Iterator[Any]:
        while True:
            yield from ws.events()
            ws.receive_data(tls.recv(65536))

    stream = received()
    assert isinstance(next(stream), AcceptConnection)
    out: list[list[dict]] = []
    with tls:
        for body in messages:
            if body.get("previous_response_id") == "<last>":
                body = {**body, "previous_response_id": completed_id(out[-1])}
            tls.sendall(ws.send(TextMessage(json.dumps(body))))
            events, text = [], ""
            while not events or events[-1].get("type") not in ("response.completed", "error"):
                ev = next(stream)
                if isinstance(ev, TextMessage):
                    text += ev.data
                    if ev.message_finished:
                        events.append(json.loads(text))
                        text = ""
            out.append(events)
    return out


def test_chatgpt_backend_through_the_proxy_as_https_proxy(proxy: Proxy, fake: FakeProvider) -> None:
    """Codex signed in with ChatGPT, the proxy as its HTTPS proxy: ChatGPT's Codex endpoint is
    recognised, its bearer and account headers reach the provider byte-identical, and its turns
    are stored; the rest of chatgpt.com is not provider traffic."""
    headers = [("authorization", "Bearer eyJhbGciOi.chatgpt-oauth.sig"),
               ("chatgpt-account-id", "acct-7f3e-0001"), ("originator", "codex_exec"),
               ("openai-beta", "responses_websockets=2026-02-06"), ("session-id", "s-chatgpt-1"),
               ("x-perpetuity-user", "cg1")]
    first = {"type": "response.create", "model": "gpt-6.2-sol", "stream": True, "store": False,
             "input": [{"type": "message", "role": "user",
                        "content": [{"type": "input_text", "text": "the vault opens at dawn"}]}]}
    second = {**first, "previous_response_id": "<last>", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "when?"}]}]}
    fake.script(Text("Noted."), Text("At dawn."))
    got = through_proxy(proxy, "chatgpt.com", "/backend-api/codex/responses", headers,
                        [first, second])
    assert [e[-1]["type"] for e in got] == ["response.completed", "response.completed"]
    upgrade = next(r for r in fake.requests if r.method == "GET")
    assert upgrade.path == "/backend-api/codex/responses"
    for k, v in headers[:5]:
        assert upgrade.headers[k] == v
    assert "x-perpetuity-user" not in upgrade.headers
    assert fake.refused == []
    texts = [t for _, _, t, _ in proxy.wait_messages("cg1", 4)]
    assert texts == ["the vault opens at dawn", "Noted.", "when?", "At dawn."]


@pytest.mark.parametrize(("host", "path", "direct", "upstream"), [
    ("chatgpt.com", "/backend-api/codex/responses", False, "https://chatgpt.com/backend-api/codex/responses"),
    ("chatgpt.com", "/backend-api/conversation", False, None),  # the rest of ChatGPT: not ours
    ("api.openai.com", "/v1/responses", False, "https://api.openai.com/v1/responses"),
    ("127.0.0.1", "/backend-api/codex/models", True, "https://chatgpt.com/backend-api/codex/models"),
    ("127.0.0.1", "/v1/responses", True, "https://api.openai.com/v1/responses"),
])
def test_codex_endpoints_route_to_their_own_hosts(host: str, path: str, direct: bool,
                                                  upstream: str | None) -> None:
    r = route(host=host, path=path, direct=direct, headers={"authorization": "Bearer t"},
              model="", upstreams=DEFAULT_UPSTREAMS)
    assert (r.upstream_url if r else None) == upstream


@needs_fixtures
def test_a_failing_pipeline_sends_the_socket_message_as_sent(tmp_path: Path, monkeypatch) -> None:
    """Fail open over the socket too: the message goes as the client sent it, and the chain
    still holds (the next message, on it, as sent)."""
    sessions = tui_sessions()[:2]
    addon = Perpetuity()
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "ws.db"),
                       perpetuity_notes_dir=str(tmp_path / "notes"))
        asyncio.run(socket(addon, CODEX / sessions[0][0], sessions[0][1], Client(), []))
        assert addon.pipeline is not None

        def fails(_req: HttpRequest) -> None:
            raise RuntimeError("boom")

        monkeypatch.setattr(addon.pipeline, "prepare", fails)
        provider = asyncio.run(socket(addon, CODEX / sessions[1][0], sessions[1][1], Client(), []))
    assert [body for body, _ in provider.sent] == [body for body, _ in sessions[1][1]]


def test_the_fake_provider_refuses_an_id_it_did_not_issue_on_the_connection(
        fake: FakeProvider) -> None:
    """As the provider does with store: false: the connection's last response chains, an id
    from another connection (or none it issued) is previous_response_not_found."""
    create = {"type": "response.create", "model": "gpt-5", "store": False, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    addr = ("127.0.0.1", fake.port or 0)
    first = exchanged(stdlib_socket.create_connection(addr, timeout=10), "127.0.0.1",
                      "/v1/responses", [], [create, {**create, "previous_response_id": "<last>"}])
    assert [e[-1]["type"] for e in first] == ["response.completed"] * 2
    other = exchanged(stdlib_socket.create_connection(addr, timeout=10), "127.0.0.1",
                      "/v1/responses", [], [{**create, "previous_response_id": completed_id(first[1])}])
    assert other[0][-1]["error"]["code"] == "previous_response_not_found"
    assert fake.refused == [completed_id(first[1])]


def test_recall_tools_ride_the_socket_hidden_and_the_chain_holds(proxy: Proxy,
                                                                 fake: FakeProvider) -> None:
    """Through a real mitmdump: a fact told on one socket; on another the model calls
    memory_search, which the proxy answers with a round of its own on that connection. The
    client sees one response without our call; its next message, chained to that response's
    id, is accepted (sent whole: the provider holds the hidden round), and each turn is stored
    once."""
    headers = [("authorization", "Bearer sk-ws-tools"), ("x-perpetuity-user", "wt1")]
    say = {"type": "response.create", "model": "gpt-5", "stream": True, "store": False}

    def user(text: str) -> list[dict]:
        return [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                               "text": text}]}]

    direct, host = ("127.0.0.1", proxy.port), f"127.0.0.1:{proxy.port}"
    fake.script(Text("Noted."))
    exchanged(stdlib_socket.create_connection(direct, timeout=10), host, "/v1/responses",
              [*headers, ("session-id", "s-told")], [{**say, "input": user(FACT)}])
    proxy.wait_messages("wt1", 2)
    fake.clear()
    fake.script(ToolCall("memory_search", {"query": "launch code"}), Text("PELICAN-42."),
                Text("Yes, PELICAN-42."))
    asked, again = exchanged(
        stdlib_socket.create_connection(direct, timeout=10), host, "/v1/responses",
        [*headers, ("session-id", "s-asked")],
        [{**say, "input": user(ASK)},
         {**say, "previous_response_id": "<last>", "input": user("sure?")}])
    assert "memory_search" not in json.dumps(asked)
    assert [e["item"]["type"] for e in asked if e["type"] == "response.output_item.done"] == [
        "message"]
    assert {e["output_index"] for e in asked if "output_index" in e} == {0}  # renumbered
    assert asked[-1]["response"]["output"][0]["content"][0]["text"] == "PELICAN-42."
    assert again[-1]["type"] == "response.completed" and fake.refused == []
    ours, hidden, follow = [r.json for r in fake.requests if r.method == "WS"]
    assert "memory_search" in [t["name"] for t in ours["tools"]]
    assert hidden["previous_response_id"] and hidden["input"][0]["type"] == "function_call_output"
    assert "previous_response_id" not in follow  # the provider holds the hidden round
    assert not [i for i in follow["input"] if i.get("type", "").startswith("function_call")]
    assert "PELICAN-42." in json.dumps(follow["input"]) and follow["input"][-1] == user("sure?")[0]
    texts = [t for _, _, t, _ in proxy.wait_messages("wt1", 6)]
    assert texts == [FACT, "Noted.", ASK, "PELICAN-42.", "sure?", "Yes, PELICAN-42."]
