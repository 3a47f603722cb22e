"""What passes between the addon, the pipeline and the relay: a request as the proxy received it
(`HttpRequest`), what the pipeline decided for it (`Decision`), the exchange the relay runs
(`Job`), and the turn it stores off the request path (`PendingTurn`); and the one list of
headers no hop carries to the next.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perpetuity_core.frame.build import Frame
from perpetuity_core.frame.plan import Plan
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.wire.conversation import Message, ParsedRequest, Protocol
from perpetuity_core.wire.identity import Identity
from perpetuity_core.wire.route import Route

# Hop-by-hop headers (RFC 9110 section 7.6.1) and the framing ones: each describes one
# connection, and every hop (mitmproxy, the relay, httpx, h11) frames its own. The one list;
# whatever else a hop drops is said where it drops it.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
                        "trailer", "upgrade", "proxy-authorization", "proxy-authenticate",
                        "content-length", "host"})


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    host: str
    path: str  # with the query string
    headers: tuple[tuple[str, str], ...]
    body: bytes
    direct: bool  # the client addressed the proxy itself (base URL), not a host through it


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingTurn:
    """A request's messages, to be stored off the request path while it goes upstream."""

    user: str
    conversation: str
    provider: str
    model: str
    messages: list[Message]
    at: float
    # This turn's retrieval reheats (item -> peak) at the user's clock position `clock`.
    reheats: dict[int, float] = field(default_factory=dict)
    clock: float = 0.0
    sent_tokens: int = 0  # the conversation the model reads: frame and turns kept as sent
    notes: list[str] = field(default_factory=list)  # notes recall put before the model
    # What the binding log binds to the reply: the turn's own retrieval as rendered, and the
    # rows the tools showed (`shown` grows as they run; the frame's warm rows are left out,
    # since warmth is not topic).
    hits: set[int] = field(default_factory=set)
    shown: set[int] = field(default_factory=set)
    frame_rows: set[int] = field(default_factory=set)
    folder: str = ""  # the working directory the harness states (names.py)
    # A title side request: nothing of it is a turn; its reply names the conversation.
    title: bool = False
    structured: bool = False  # the title is asked for as JSON (Claude Code), else as text
    library: Path | None = None  # the tenant's notes library the recalled notes came from
    # (harness, its request shape) when it changed: kept for `perpetuity replay` (templates)
    shape: tuple[str, dict[str, Any]] | None = None


@dataclass(slots=True, kw_only=True)
class Job:
    """One exchange for the relay: what to send upstream and how to store what comes back."""

    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    protocol: Protocol
    stream: bool
    pending: PendingTurn  # what the capture stores (serve.writer)
    at: float | None = None  # fixed reply time (x-perpetuity-time), else the time it completes
    memory: TurnMemory | None = None  # set when the recall tools ride along (relay only)
    max_rounds: int = 4
    tool_specs: list[dict[str, Any]] = field(default_factory=list)  # ours, beside the harness's
    # The body exactly as the client sent it, when we changed it: a 400 on the first round is
    # retried once with it (the rejection may be ours: the frame, a tool).
    original: bytes | None = None
    # The tool loop's first round as it goes upstream, our tools added: built when preparing,
    # off the event loop, which then sends it as it is (None: the relay builds it).
    first_round: bytes | None = None
    # Set by the addon once mitmproxy has the relay's first bytes on their way to the client
    # (None: no one will; the relay then goes straight on).
    forwarded: asyncio.Event | None = None
    # The tool loop's upstream rounds as they happened (relay.Round), for inspection.
    rounds: list[Any] = field(default_factory=list)
    # The request's JSON as the client sent it, and as it goes upstream before our tools
    # (None: as sent): what the live tally bills (serve.tally). Read only.
    direct: Any = None
    sent: Any = None

    @property
    def relay(self) -> bool:
        """Through the relay when our tools ride along (their loop runs there); else on
        mitmproxy's own stream, which adds less to every request."""
        return self.memory is not None


@dataclass(frozen=True, slots=True)
class Answer:
    """A reply the proxy gives itself, with no model call (the /perpetuity-curate command)."""

    content_type: str
    body: bytes
    status: int = 200


# A request to us whose provider nothing names: forwarding it anywhere could hand its
# credential to the wrong host, and left alone it would loop back to us.
UNKNOWN_PROVIDER = Answer("text/plain; charset=utf-8", b"perpetuity: cannot tell which provider "
                          b"this request is for (no Anthropic or OpenAI credential, path or model "
                          b"names one); it was not forwarded\n", 421)


@dataclass(slots=True, kw_only=True)
class Decision:
    route: Route | None = None  # None: not provider traffic, the flow's destination stays
    strip: list[str] = field(default_factory=list)  # control headers to remove
    job: Job | None = None
    answer: Answer | None = None
    body: bytes | None = None  # the request body to send instead, with the frame
    frame: Frame | None = None
    identity: Identity | None = None
    note: str = ""  # why, for flow.metadata and logs
    # References for inspection (serve.inspection), read after the reply.
    parsed: ParsedRequest | None = None
    recall: Recall | None = None


@dataclass(slots=True, kw_only=True)
class Recall:
    """What memory adds to one request."""

    body: bytes | None = None  # the body to send instead
    sent: dict[str, Any] | None = None  # that body's JSON (the tools' first round builds on it)
    built: Frame | None = None  # the frame or addendum built for this request, if any
    keep: int = 0  # the first message kept as the harness sent it
    memory: TurnMemory | None = None  # set when the recall tools ride along
    notes: list[str] = field(default_factory=list)  # the notes recall put before the model
    key: tuple[int, str] | None = None  # (user, conversation key) of the plan
    plan: Plan | None = None  # the conversation's plan after this request
    sent_tokens: int = 0  # what the model reads of the conversation: frame, addenda, kept turns
    note: str = ""  # why the history was kept further back than planned, or left as sent
    front: list[Message] = field(default_factory=list)  # the frame as sent, notes included
    made: str = ""  # "frame" or "addendum": what this request built ("" when it kept the plan)
