"""One client message's reply over Codex's WebSocket, and the recall tools' rounds inside it.

The client sends one `response.create`; the provider answers with events, one a message. When
our tools ride along (chain.framed put them beside the client's), a round that ends with calls
to ours only is hidden: its events are dropped, its `response.completed` too, the calls run
(off the event loop, as the relay runs them) and the proxy sends the next round on the same
connection, chained to the hidden round's own id, its input the calls' outputs. The client sees
one response: every other item of the rounds, renumbered as one stream (the relay's merger),
closed by the last round's `response.completed`. Its id is the provider's, the connection's
last response, so the client's next message chains to it validly; chain.Chain keeps the two
histories (the provider holds the hidden rounds, the client's history at that id does not).

How it fails: a tool's failure or timeout is an answer the model reads (tools.run never
raises). A message we changed that the provider refuses (an `error` of status 400, before the
client saw anything) goes once more as the client's own, whole and unchained (relay.as_sent's
rule); any other error reaches the client. The reply is stored once, as the client saw it,
when its last event passes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.chain import ENDED, Chain
from perpetuity_core.serve.exchange import Decision
from perpetuity_core.serve.relay import REFUSED, Round, RunTool
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire import mend
from perpetuity_core.wire.protocols import responses
from perpetuity_core.wire.sse import Event

log = logging.getLogger("perpetuity")

ENDS = ("response.completed", *ENDED)  # the events that end a response


class SocketMerger(responses.StreamMerger):
    """The relay's merger of rounds, each event written as one WebSocket message (JSON)."""

    def _emit(self, name: str, data: dict[str, Any]) -> bytes:
        data = {**data, "sequence_number": self.sequence}
        self.sequence += 1
        return mend.dumps(data)


@dataclass(slots=True)
class Step:
    """What becomes of one provider event."""

    show: bytes | None  # what the client gets in its place (None: nothing)
    send: bytes | None = None  # the next round's message, to go upstream now
    done: bool = False  # the reply ended, and is stored


class SocketReply:
    """The reply to one client message: read for its capture, and, when our tools ride along,
    made of as many rounds as they need (at most the job's `max_rounds`)."""

    def __init__(self, link: Chain, capture: Capture, decision: Decision, sent: bytes,
                 original: bytes | None, run_tool: RunTool, timeout: float, index: int) -> None:
        self.link, self.capture, self.decision = link, capture, decision
        self.original = original  # the client's message, when what went upstream differs
        self.fell_open = ""  # why it went upstream as the client's own after all
        self.shown = False  # the client has seen an event of the reply
        self.job = job = capture.job
        self.run_tool, self.timeout = run_tool, timeout
        self.index = index  # the client message's place in the flow's messages (inspection)
        self.assembler = responses.ReplyAssembler()
        self.merger: SocketMerger | None = None
        self.sent = sent  # the message as it went upstream: the next rounds' fields
        self.round = Round(time.time(), sent)
        if job.memory is not None:
            self.merger = SocketMerger(frozenset(str(t["name"]) for t in job.tool_specs))
            job.rounds.append(self.round)

    async def event(self, raw: bytes) -> Step:
        try:
            event = json.loads(raw)
        except ValueError:
            return Step(raw)
        if not isinstance(event, dict):
            return Step(raw)
        kind = str(event.get("type", ""))
        if kind == "error" and (resend := self._refused(event)) is not None:
            return Step(None, send=resend)
        if self.merger is None:
            self.link.event(event)
            return self._shown(kind, raw)
        self.round.raw.append(raw)
        shown = self.merger.feed(kind, event)
        if kind not in ENDS:
            self.link.event(event)
            return self._shown(kind, shown) if shown else Step(None)
        self.round.ended = time.time()
        self.round.status = 200 if kind == "response.completed" else int(event.get("status") or 500)
        calls = self.merger.our_calls()
        if (kind == "response.completed" and calls and not self.merger.others_called()
                and len(self.job.rounds) < self.job.max_rounds):
            return await self._next_round(str((event.get("response") or {}).get("id") or ""),
                                          calls)
        self.link.event(event)
        return self._shown(kind, shown if kind == "error" else self.merger.finish())

    def _refused(self, event: dict[str, Any]) -> bytes | None:
        """The client's own message, to send in place of ours that the provider refused before
        the client saw a thing; None when the error stands."""
        if (self.original is None or event.get("status") != 400 or len(self.job.rounds) > 1
                or self.shown):
            return None
        try:
            resend = self.link.resent(json.loads(self.original))
        except ValueError:
            return None
        if resend is not None:
            log.warning("perpetuity: upstream refused the WebSocket message with our changes "
                        "(400); sending it again as the client's own")
            self.original, self.merger, self.job.rounds[:] = None, None, []
            self.fell_open = REFUSED
        return resend

    def _shown(self, kind: str, data: bytes) -> Step:
        """`data` goes to the client and into the stored reply; the reply ends with a response."""
        self.shown = True
        self.assembler.feed(Event(kind, data.decode("utf-8", "replace")))
        if kind not in ENDS:
            return Step(data)
        self.capture.replied(self.assembler.reply())
        return Step(data, done=True)

    async def _next_round(self, rid: str, calls: list[tuple[str, str, Any]]) -> Step:
        """A round of our calls only: hidden; its calls run, and the next round goes on it."""
        assert self.merger is not None and self.job.memory is not None
        self.round.calls = calls
        self.round.results = results = await run_calls(calls, self.run_tool, self.job.memory,
                                                       self.timeout)
        outputs = [{"type": "function_call_output", "call_id": call_id, "output": text}
                   for call_id, text in results]
        body = json.loads(self.sent)
        message = {**body, "previous_response_id": rid, "input": outputs}
        if len(self.job.rounds) + 1 >= self.job.max_rounds:
            message["tool_choice"] = "none"  # the last allowed round must answer
        self.link.continued(rid, outputs)
        self.merger.next_round()
        content = mend.dumps(message)
        self.round = Round(time.time(), content)
        self.job.rounds.append(self.round)
        return Step(None, send=content)


async def run_calls(calls: list[tuple[str, str, Any]], run_tool: RunTool, memory: TurnMemory,
                    timeout: float) -> list[tuple[str, str]]:
    """Each call's answer, in order; one that takes longer than `timeout` is told so (its
    thread finishes on its own). No keep-alive: a WebSocket's idle limit is the client's own
    (Codex's is minutes), far over a tool's."""
    results = []
    for call_id, name, arguments in calls:
        try:
            answer = await asyncio.wait_for(run_tool(name, arguments, memory), timeout)
        except TimeoutError:
            log.warning("perpetuity: %s timed out after %g s", name, timeout)
            answer = f"{name}: timed out after {timeout:g} s"
        results.append((call_id, answer))
    return results
