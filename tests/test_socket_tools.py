"""The recall tools' rounds over a WebSocket (serve/socket_tools.py), event by event, without a
network: what the client gets in each event's place, the next round's message, the two chains
after, and the reply stored once. The real programs are in test_codex.py and test_websocket.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.chain import Chain, Histories, framed
from perpetuity_core.serve.exchange import Decision, HttpRequest, Job, PendingTurn
from perpetuity_core.serve.socket_tools import SocketReply, Step, run_calls
from perpetuity_core.wire.conversation import Protocol
from perpetuity_core.wire.protocols import responses
from perpetuity_core.wire.protocols.base import Reply
from tests.conftest import FIXTURES, needs_fixtures

WHOLE = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
SPECS = [{"name": "memory_search", "description": "", "input_schema": {}}]


class Stored:
    """What SocketReply asks of its capture: the job, and the reply once."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.replies: list[Reply | None] = []

    def replied(self, reply: Reply | None) -> None:
        self.replies.append(reply)


def job(max_rounds: int) -> Job:
    pending = PendingTurn(user="u", conversation="c", provider="openai", model="gpt-5",
                          messages=[], at=0.0)
    return Job(method="POST", url="https://api.openai.com/v1/responses", headers=[], body=b"",
               protocol=Protocol.RESPONSES, stream=True, pending=pending,
               memory=TurnMemory(user_id=1, conversation_id=1, asked_at=0.0),
               max_rounds=max_rounds, tool_specs=SPECS)


def call(n: int) -> dict[str, Any]:
    return {"id": f"fc_{n}", "type": "function_call", "name": "memory_search",
            "call_id": f"call_{n}", "arguments": '{"query": "x"}'}


TEXT = {"id": "msg_1", "type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "Done."}]}


def round_events(rid: str, item: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "response.created", "response": {"id": rid}},
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": {"id": rid, "usage": {
                "input_tokens": 10, "output_tokens": 2, "total_tokens": 12}}}]


async def answer(name: str, arguments: Any, memory: TurnMemory) -> str:
    return f"{name} answered"


def replay(rounds: list[list[dict[str, Any]]], max_rounds: int
           ) -> tuple[Chain, Stored, list[list[Step]]]:
    link = Chain(Histories(), "key")
    body = {"type": "response.create", "model": "gpt-5", "input": WHOLE, "tools": SPECS}
    link.send(body, WHOLE, WHOLE, frozenset({"memory_search"}))
    capture = Stored(job(max_rounds))
    reply = SocketReply(link, capture, Decision(), json.dumps(body).encode(), None,
                        answer, 5.0, 0)
    steps = [[asyncio.run(reply.event(json.dumps(e).encode())) for e in events]
             for events in rounds]
    return link, capture, steps


def test_a_round_of_our_calls_is_hidden_and_the_next_goes_on_its_id() -> None:
    link, capture, (first, second) = replay([round_events("r1", call(1)),
                                             round_events("r2", TEXT)], 4)
    assert first[0].show is not None and [s.show for s in first[1:]] == [None, None, None]
    message = json.loads(first[-1].send or b"")
    assert message["previous_response_id"] == "r1" and "tool_choice" not in message
    assert message["input"] == [{"type": "function_call_output", "call_id": "call_1",
                                 "output": "memory_search answered"}]
    assert second[0].show is None  # one response.created stands for both rounds
    shown = [json.loads(s.show) for s in second[1:] if s.show]
    assert [e.get("output_index") for e in shown[:2]] == [0, 0]
    done = shown[-1]
    assert second[-1].done and done["response"]["id"] == "r2"
    assert done["response"]["output"] == [TEXT] and done["response"]["usage"]["input_tokens"] == 20
    assert len(capture.replies) == 1 and capture.replies[0] is not None
    # The client's history at r2 is what it saw; the connection holds the hidden round too.
    assert link.histories.get("key", "r2") == WHOLE + [TEXT]
    assert link.last_id == "r2" and link.held == WHOLE + [call(1)] + message["input"] + [TEXT]


def test_the_last_round_allowed_must_answer_and_hides_a_call_it_makes_anyway() -> None:
    link, capture, (first, second) = replay([round_events("r1", call(1)),
                                             round_events("r2", call(2))], 2)
    assert json.loads(first[-1].send or b"")["tool_choice"] == "none"
    assert second[-1].send is None and second[-1].done
    assert json.loads(second[-1].show or b"")["response"]["output"] == []
    assert link.histories.get("key", "r2") == WHOLE
    assert len(capture.replies) == 1


def test_a_tool_past_its_time_is_answered_so() -> None:
    async def slow(name: str, arguments: Any, memory: TurnMemory) -> str:
        await asyncio.sleep(5)
        return "late"

    memory = TurnMemory(user_id=1, conversation_id=1, asked_at=0.0)
    got = asyncio.run(run_calls([("c1", "memory_search", {})], slow, memory, 0.01))
    assert got == [("c1", "memory_search: timed out after 0.01 s")]


# Codex's tools as its Responses Lite request carries them: an input item, no `tools` field
# (../shared's captures of codex-cli 0.171: 07-builtin_ws_basic, 15-custom_http_model_gpt62).
CODEX_TOOLS = {"type": "additional_tools", "id": "at_1", "role": "developer",
               "tools": [{"type": "namespace", "name": "functions", "description": "",
                          "tools": [{"type": "function", "name": "wait", "parameters": {}}]}]}
OURS = {"type": "additional_tools", "role": "developer", "tools": [
    {"type": "function", "name": "memory_search", "description": "", "parameters": {}}]}


class Framing:
    """What chain.framed asks of the pipeline: a decision whose job lets our tools ride."""

    def prepare(self, req: Any) -> Decision:
        return Decision(job=job(4))


def test_our_tools_ride_beside_codex_s_own_item_held_once_on_the_chain() -> None:
    link = Chain(Histories(), "key")
    handshake = HttpRequest("GET", "api.openai.com", "/v1/responses", (), b"", False)
    first = {"type": "response.create", "model": "gpt-6.2-sol", "input": [CODEX_TOOLS, *WHOLE]}
    _, sent = framed(Framing(), handshake, link, json.dumps(first).encode())  # type: ignore[arg-type]
    out = json.loads(sent or b"")
    assert "tools" not in out and out["input"] == [CODEX_TOOLS, OURS, *WHOLE]
    link.event({"type": "response.completed", "response": {"id": "r1"}})
    more = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and?"}]}]
    second = {**first, "previous_response_id": "r1", "input": more}
    _, sent = framed(Framing(), handshake, link, json.dumps(second).encode())  # type: ignore[arg-type]
    assert sent is None  # as Codex sent it: the provider holds ours already, on r1
    assert link.pending is not None and link.pending.upstream == [CODEX_TOOLS, OURS, *WHOLE, *more]


@needs_fixtures
def test_over_http_codex_s_lite_request_gets_ours_as_an_item_after_its_own() -> None:
    body = json.loads((FIXTURES / "codex" / "15-custom_http_model_gpt62-responses-stream.json"
                       ).read_text())["body"]
    out = responses.add_tools(body, SPECS, last_round=True)
    assert "tools" not in body and "tools" not in out and out["tool_choice"] == "none"
    assert out["input"] == [body["input"][0], OURS, *body["input"][1:]]
    plain = responses.add_tools({"input": WHOLE, "tools": []}, SPECS, last_round=False)
    assert plain["tools"] == OURS["tools"] and plain["input"] == WHOLE
