"""Codex's built-in provider over a WebSocket: the client's chain of responses and the proxy's own.

Codex sends each `response.create` with only the items its last request and that request's
reply did not hold, and `previous_response_id` naming that reply; the provider keeps the
connection's last response (with `store: false`, only on that connection). The frame changes
what the provider holds, so the two chains part: the client's history at a response is what the
client sent plus what the provider answered, and the provider's is what we sent plus the same
answer. Every response id the client sees is the provider's own (we answer nothing ourselves),
and each is mapped here to the client's history at it, so a message on any socket (a reconnect,
`codex exec resume`) is read whole and framed as an HTTP request would be. Upstream, a message
whose whole input extends what this socket's provider connection holds goes as that extension
with the provider's last id; any other goes whole, without an id. Nothing is sent with an id the
provider did not issue on this connection, but a message passed as sent. The recall tools ride
along as on HTTP: their rounds are messages the proxy chains itself on the same connection
(socket_tools), hidden from the client, whose history at the final id holds only what it saw.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from perpetuity_core.serve.exchange import Decision, HttpRequest
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.wire import mend
from perpetuity_core.wire.protocols import responses

log = logging.getLogger("perpetuity")

HISTORIES = 256  # client response ids remembered (a resumed session past them goes as sent)
ENDED = ("response.failed", "response.incomplete", "error")

Items = list[dict[str, Any]]


class Histories:
    """Every socket's client responses, by credential and id: the client's whole input at each
    (what it sent, then the reply's items). A credential reads only its own ids' histories."""

    def __init__(self, bound: int = HISTORIES) -> None:
        self.bound = bound
        self._seen: OrderedDict[tuple[str, str], Items] = OrderedDict()
        # Read on the parsing thread, written from the event loop (a reply's end).
        self._lock = threading.Lock()

    def get(self, key: str, response_id: str) -> Items | None:
        with self._lock:
            got = self._seen.get((key, response_id))
            if got is not None:
                self._seen.move_to_end((key, response_id))
            return got

    def put(self, key: str, response_id: str, items: Items) -> None:
        with self._lock:
            self._seen[(key, response_id)] = items
            self._seen.move_to_end((key, response_id))
            while len(self._seen) > self.bound:
                self._seen.popitem(last=False)


@dataclass(slots=True)
class _Pending:
    """The message in flight: the client's whole input (None on a chain we do not know), what
    the provider holds once it is read (None: unknown), the reply's items so far in this round,
    the items the client saw in the rounds before, and our tools' names (hidden from it)."""

    client: Items | None
    upstream: Items | None
    items: Items = field(default_factory=list)
    shown: Items = field(default_factory=list)
    ours: frozenset[str] = frozenset()

    def seen(self) -> Items:
        """The reply's items the client saw: none of our calls."""
        return self.shown + [i for i in self.items
                             if not (i.get("type") == "function_call" and i.get("name") in self.ours)]


def request(body: Any) -> bool:
    """A message we read: a `response.create` with its input as a list of items."""
    return (isinstance(body, dict) and body.get("type") == "response.create"
            and isinstance(body.get("input"), list))


class Chain:
    """One WebSocket: what its provider connection holds, and the message in flight."""

    def __init__(self, histories: Histories, key: str) -> None:
        self.histories = histories
        self.key = key  # the credential's, so one tenant never reads another's history
        self.last_id = ""  # the provider's last response on this connection ("" for none)
        self.held: Items = []  # the whole input the provider holds at last_id, its reply's too
        self.pending: _Pending | None = None

    def whole(self, body: dict[str, Any]) -> Items | None:
        """The client's whole input for this message; None when it chains to a response we
        never saw (such a message goes as sent)."""
        prev = body.get("previous_response_id")
        if prev is None:
            return list(body["input"])
        base = self.histories.get(self.key, prev) if isinstance(prev, str) else None
        return None if base is None else base + body["input"]

    def passed(self, body: dict[str, Any]) -> None:
        """A message sent as it came, whole input unknown to us."""
        prev = body.get("previous_response_id")
        held = self.held + body["input"] if self.last_id and prev == self.last_id else None
        self.pending = _Pending(None, list(body["input"]) if prev is None else held)

    def send(self, body: dict[str, Any], whole: Items, target: Items,
             ours: frozenset[str] = frozenset()) -> dict[str, Any] | None:
        """What goes upstream so that the provider holds `target` (the frame and the kept
        items, or the client's `whole` input): None when the message as sent does; else its
        extension of what this connection holds, with the provider's id, or the whole of it
        without an id. `ours`: the tools that ride along, whose calls the client never sees."""
        self.pending = _Pending(whole, target, ours=ours)
        prev = body.get("previous_response_id")
        if prev is None:
            as_sent: Items | None = body["input"]
        elif self.last_id and prev == self.last_id:
            as_sent = self.held + body["input"]
        else:
            as_sent = None
        if as_sent == target:
            return None
        if self.last_id and target[:len(self.held)] == self.held:
            return {**body, "previous_response_id": self.last_id,
                    "input": target[len(self.held):]}
        out = {k: v for k, v in body.items() if k != "previous_response_id"}
        out["input"] = target
        return out

    def continued(self, rid: str, sent: Items) -> None:
        """A round of our tools completed as `rid`, hidden from the client, and `sent` (the
        calls' outputs) goes on it: the connection holds the round and then `sent`; the client
        keeps what it saw of the round."""
        pending = self.pending
        if pending is None or pending.upstream is None:
            self.lost()
            return
        self.last_id, self.held = rid, pending.upstream + pending.items
        pending.shown, pending.items = pending.seen(), []
        pending.upstream = self.held + sent

    def resent(self, body: dict[str, Any]) -> bytes | None:
        """The message in flight once more as the client's own, its whole input and no chain
        (the provider refused ours; what it holds now is unknown); None if that is unknown."""
        pending = self.pending
        if pending is None or pending.client is None:
            return None
        self.last_id, self.held = "", []
        self.pending = _Pending(pending.client, list(pending.client))
        return http_body(body, pending.client)

    def lost(self) -> None:
        """A message went by that we could not follow: what the connection holds is unknown,
        so the next message goes whole."""
        self.pending, self.last_id, self.held = None, "", []

    def event(self, event: Any) -> None:
        """A provider event: a finished item is the reply's; a completed response is where both
        chains now stand; anything else that ends a response leaves the connection holding
        nothing we know (the next message goes whole)."""
        pending = self.pending
        kind = event.get("type") if isinstance(event, dict) else None
        if pending is None or not isinstance(kind, str):
            return
        if kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            pending.items.append(event["item"])
        elif kind == "response.completed":
            self.pending = None
            rid = (event.get("response") or {}).get("id")
            if not isinstance(rid, str) or not rid or pending.upstream is None:
                self.last_id, self.held = "", []
            else:
                self.last_id, self.held = rid, pending.upstream + pending.items
            if isinstance(rid, str) and rid and pending.client is not None:
                self.histories.put(self.key, rid, pending.client + pending.seen())
        elif kind in ENDED:
            self.lost()


def http_body(body: dict[str, Any], whole: Items) -> bytes:
    """The message as the HTTP request it stands for: the whole input, no chain."""
    out = {k: v for k, v in body.items() if k != "previous_response_id"}
    out["input"] = whole
    return mend.dumps(out)


def framed(pipeline: Pipeline, handshake: HttpRequest, link: Chain,
           content: bytes) -> tuple[Decision, bytes | None]:
    """A client message, on the parsing thread (the event loop never parses or frames one):
    the decision for the HTTP request it stands for, and what goes upstream in its place (None:
    the message as sent), our tools beside the client's when they ride along. The socket's hook
    is awaited meanwhile, so nothing else touches its chain."""
    try:
        body = json.loads(content)
    except ValueError:
        return Decision(), None
    if not request(body):
        return Decision(), None
    whole = link.whole(body)
    if whole is None:
        link.passed(body)
        return Decision(), None
    req = HttpRequest("POST", handshake.host, handshake.path, handshake.headers,
                      http_body(body, whole), handshake.direct)
    try:
        decision = pipeline.prepare(req)
    except Exception:
        log.exception("perpetuity: pipeline failed; the WebSocket message goes unframed")
        decision = Decision()
    target = json.loads(decision.body)["input"] if decision.body is not None else whole
    job = decision.job
    specs = job.tool_specs if job is not None and job.memory is not None else []
    ours = frozenset(str(t["name"]) for t in specs)
    if specs and (at := responses.tools_item_at(body, target)) is not None:
        # Codex's own tools are an input item the provider holds (Responses Lite): ours go
        # beside it in what the provider is to hold, once, not into each message.
        assert job is not None
        target = [*target[:at], responses.tools_item(specs), *target[at:]]
        out = link.send(body, whole, target, ours)
        if job.max_rounds == 1:
            out = {**(body if out is None else out), "tool_choice": "none"}
    else:
        out = link.send(body, whole, target, ours)
        if specs:
            assert job is not None
            out = responses.add_tools(body if out is None else out, specs, job.max_rounds == 1)
    return decision, None if out is None else mend.dumps(out)
