"""Codex's own provider over a WebSocket: the captured messages through the addon's hooks
(mitmproxy's test flows, a real store): prewarm skipped, each turn and reply stored once."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from mitmproxy import websocket
from mitmproxy.test import taddons, tflow
from wsproto.frame_protocol import Opcode

from perpetuity_core.serve.addon import Perpetuity
from tests.conftest import FIXTURES, needs_fixtures, query

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
    with taddons.context(addon) as tctx:
        tctx.configure(addon, perpetuity_db=str(db), perpetuity_notes_dir=str(tmp_path / "notes"))
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
