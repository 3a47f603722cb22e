"""The per-request path, in the order data flows: route → identity → retrieve → render, then a
job to forward and capture.

`prepare` turns one HTTP request into a `Decision`: leave it alone, send it upstream untouched,
or forward it, its history replaced by the frame (and notes, when a task starts), as a `Job`
that captures the reply (through the relay when the recall tools ride along). It only reads:
the writes (`store_turn`, `store_reply`) run on the store's one writer thread while the request
is already on its way. It never raises for bad input: anything it cannot read passes through
as the client sent it.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from . import capture, frame, heat, notes, tenants, tools
from .cap import Cap
from .capture import TurnContext
from .conversation import Kind, Message, ParsedRequest, Protocol, Provider, Reply
from .errors import PerpetuityError
from .frame import Frame
from .identity import Identity, identify
from .protocols import ADAPTERS
from .route import CONTROL_PREFIX, Route, credential, parse_controls, route
from .scan import Scanner, token_estimate
from .store import Store
from .tools import TurnMemory

log = logging.getLogger("perpetuity")

CURATE_COMMAND = "/perpetuity-curate"
CODING = ("claude-code", "codex", "opencode")
CODING_KEEP_TURNS = 3  # a coding harness keeps its live turn and the two before it as sent
RECENT_STRETCH = 6  # the latest stored messages of the conversation, always in the frame
STICKY_CONVERSATIONS = 10_000
BOUND_HITS = 20  # a turn's best rendered matches, bound to its reply in the binding log

_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # a surrogate's JSON escape, paired or not

# Bodies above this are forwarded untouched rather than parsed on the request path.
MAX_BODY = 32 * 1024 * 1024

# Dropped from what goes upstream: hop-by-hop headers, and encodings, since the relay must read
# the reply to store it (providers stream SSE uncompressed anyway).
_DROP_UPSTREAM = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                  "proxy-connection", "proxy-authorization", "accept-encoding", "te", "upgrade"}


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    host: str
    path: str  # with the query string
    headers: tuple[tuple[str, str], ...]
    body: bytes
    direct: bool  # the client addressed the proxy itself (base URL), not a host through it


@dataclass(frozen=True, slots=True)
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
    library: Path | None = None  # the tenant's notes library the recalled notes came from


@dataclass(slots=True)
class Job:
    """One exchange for the relay: what to send upstream and how to store what comes back."""

    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    protocol: Protocol
    stream: bool
    pending: PendingTurn
    # The request's write on the store's thread; the reply's write is queued behind it.
    turn: Future[TurnContext] | None = None
    at: float | None = None  # fixed reply time (x-perpetuity-time), else the time it completes
    memory: TurnMemory | None = None  # set when the recall tools ride along (relay only)
    max_rounds: int = 4
    tool_specs: list[dict[str, Any]] = field(default_factory=list)  # ours, beside the harness's
    # The body exactly as the client sent it, when we changed it: a 400 on the first round is
    # retried once with it (the rejection may be ours: the frame, a tool).
    original: bytes | None = None

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


@dataclass(slots=True)
class Recall:
    """What memory adds to one request."""

    body: bytes | None = None  # the body to send instead
    frame: Frame | None = None
    keep: int = 0  # the first message kept as the harness sent it
    memory: TurnMemory | None = None  # set when the recall tools ride along
    notes: list[str] = field(default_factory=list)  # the notes recall put before the model
    sticky_key: tuple[int, int | None] | None = None  # (user, conversation) the frame was for


@dataclass(slots=True)
class Decision:
    route: Route | None = None  # None: not provider traffic, the flow's destination stays
    strip: list[str] = field(default_factory=list)  # control headers to remove
    job: Job | None = None
    answer: Answer | None = None
    body: bytes | None = None  # the request body to send instead, with the frame
    frame: Frame | None = None
    identity: Identity | None = None
    note: str = ""  # why, for flow.metadata and logs


class Pipeline:
    def __init__(self, store: Store, upstreams: Mapping[Provider, str], tools: bool = True,
                 notes_root: Path | None = None, limits: Cap = Cap(),
                 share_pool: bool | frozenset[str] = False, tool_rounds: int = 4,
                 trust_identity: bool = False, notes_capture: bool = True) -> None:
        """`share_pool`: True pools every user (offline evaluation); a set of tenants pools the
        users of those tenants with each other (the proxy); False, each user sees their own.
        `trust_identity`: claimed identities are authenticated upstream of us (see identity)."""
        self.store = store
        self.upstreams = dict(upstreams)
        self.tools = tools  # the deployment's default; x-perpetuity-tools: off turns them off
        self.tool_rounds = tool_rounds
        self.notes_root = notes_root
        self.notes_capture = notes_capture  # note_capture and /perpetuity-curate through us
        self.trust_identity = trust_identity
        self.limits = limits
        # Reads only, on the thread that prepares requests; the store's thread does the writing.
        pool = share_pool if isinstance(share_pool, frozenset) else None
        self.scanner = Scanner(store, share_pool=bool(share_pool),
                               pool_of=(lambda uid: tenants.pool_of(store, uid, pool))
                               if pool is not None else None)
        # Each conversation's last frame, kept in front while it stays warm (prompt caching).
        # Only the preparing thread touches it; a restart costs one rebuilt frame.
        self._sticky: OrderedDict[tuple[int, int | None], list[list[int]]] = OrderedDict()

    def route_only(self, req: HttpRequest, model: str = "") -> Decision:
        """Where the request goes and which headers to strip, touching nothing else."""
        headers = {k.lower(): v for k, v in req.headers}
        r = route(host=req.host, path=req.path, direct=req.direct, headers=headers, model=model,
                  upstreams=self.upstreams)
        if r is None and req.direct:
            return Decision(answer=UNKNOWN_PROVIDER, note="provider unknown")
        if r is None:
            return Decision(note="not provider traffic")  # untouched, our headers included
        strip = sorted({k for k, _ in req.headers if k.lower().startswith(CONTROL_PREFIX)})
        return Decision(route=r, strip=strip)

    def prepare(self, req: HttpRequest) -> Decision:
        body = _json_body(req.body) if req.method == "POST" else None
        decision = self.route_only(req, str(body.get("model", "")) if body else "")
        r = decision.route
        if r is None:
            return decision
        # Read as text: a value that was not UTF-8 (mitmproxy's surrogate escapes) must never
        # reach the store or a digest as it is.
        headers = {k.lower(): v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
                   for k, v in req.headers}
        controls = parse_controls(headers)
        if not controls.enabled:
            decision.note = "x-perpetuity: off"
            return decision
        if r.protocol is None or body is None:
            decision.note = "no turn in this request"
            return decision
        try:
            parsed = ADAPTERS[r.protocol].parse_request(body)
        except Exception as e:  # fail open: an unreadable body goes through as sent
            decision.note = f"unparsed: {e}"
            return decision
        ident = identify(headers, parsed, credential(headers), self.store.salt,
                         self.trust_identity)
        decision.identity = ident
        library = tenants.library(self.notes_root, ident.tenant)
        if (_last_user_text(parsed.messages) == CURATE_COMMAND and library is not None
                and self.notes_capture):
            text = _curate(library)
            decision.answer = Answer(
                "text/event-stream; charset=utf-8" if parsed.stream else "application/json",
                ADAPTERS[r.protocol].render_text(text, parsed.model, parsed.stream,
                                                 "resp_perpetuity_" + secrets.token_hex(8)))
            decision.note = "answered /perpetuity-curate"
            return decision
        if ident.side:
            decision.note = f"side request: {ident.side}"
            return decision
        at = controls.at if controls.at is not None else time.time()
        # The recall tools ride along with a frame (there is memory to reach) and a model call.
        tools_on = self.tools and controls.tools and not controls.probe and controls.capture
        recall = Recall()
        if controls.recall and "previous_response_id" not in parsed.hints:
            coding = headers.get("x-perpetuity-harness", "coding" if ident.harness in CODING
                                 else "chat") == "coding"
            recall = self._recall(body, parsed, ident, r.protocol, coding, at, tools_on)
        if recall.memory is not None:
            recall.memory.library = library if self.notes_capture else None
            recall.memory.untrusted = tenants.quotes_untrusted(parsed.messages)
        decision.body, decision.frame = recall.body, recall.frame
        if controls.probe or not controls.capture:
            decision.note = "probe" if controls.probe else "capture off"
            return decision
        built = recall.frame
        if built is not None and recall.sticky_key is not None:
            self._remember(recall.sticky_key, built)
        sent = parsed.messages[recall.keep:] if built else parsed.messages
        pending = PendingTurn(ident.user, ident.conversation, r.provider.value, parsed.model,
                              parsed.messages, at, built.reheats if built else {},
                              built.now if built else 0.0,
                              (built.tokens if built else 0) + _tokens(sent), recall.notes,
                              set(built.hits[:BOUND_HITS]) if built else set(),
                              recall.memory.shown if recall.memory else set(),
                              set(built.item_ids) if built else set(), library)
        forwarded = [(k, v) for k, v in req.headers
                     if k.lower() not in _DROP_UPSTREAM and not k.lower().startswith(CONTROL_PREFIX)]
        decision.job = Job(req.method, r.upstream_url, forwarded,
                           recall.body if recall.body is not None else req.body, r.protocol,
                           parsed.stream, pending, at=controls.at, memory=recall.memory,
                           max_rounds=self.tool_rounds,
                           tool_specs=self._tool_specs(recall.memory, parsed.tool_names)
                           if recall.memory else [],
                           original=req.body if recall.body is not None else None)
        decision.note = "captured"
        return decision

    def _recall(self, body: dict[str, Any], parsed: ParsedRequest, ident: Identity,
                protocol: Protocol, coding: bool, asked_at: float, tools_on: bool) -> Recall:
        """The request with its history replaced by the frame, notes when a task starts, and
        the note on the recall tools when they ride along."""
        out = Recall()
        rendered: list[Message] = []
        note = ""
        if planned := self._frame(ident, parsed, coding, asked_at):
            out.frame, out.keep, memory = planned
            out.sticky_key = (memory.user_id, memory.conversation_id)
            rendered = out.frame.messages
            if tools_on:
                out.memory = memory
                note = _tools_note(out.frame)
        if starts_task(parsed.messages) and (lesson := self._notes_for(parsed, ident.tenant)):
            out.notes = lesson.names
            note = "\n\n".join(t for t in (note, lesson.text) if t)
        if note:
            rendered = frame.with_note(rendered, note)
        if rendered:
            out.body = json.dumps(ADAPTERS[protocol].replace_history(
                body, rendered, parsed.raw_index[out.keep]), ensure_ascii=False).encode()
        return out

    def _frame(self, ident: Identity, parsed: ParsedRequest, coding: bool,
               asked_at: float) -> tuple[Frame, int, TurnMemory] | None:
        """The frame for this request, the index of the first message kept as sent, and what
        the recall tools start from."""
        user_id = self.store.find_user(ident.user)
        query = _last_user_text(parsed.messages)
        if user_id is None or not query:
            return None
        conv = self.store.find_conversation(user_id, ident.conversation)
        keep = _keep_from(parsed.messages, coding)
        if conv is None:
            keep = 0
        elif new := capture.new_messages(self.store, conv, parsed.messages):
            keep = min(keep, new[0])  # what the store does not hold yet is never stripped
        kept = self.store.message_ids(conv, [m.fingerprint() for m in parsed.messages[keep:]]) \
            if conv else []
        recent = self.store.latest_messages(conv, RECENT_STRETCH) if conv else []
        built = frame.build(self.scanner, user_id=user_id, conversation_id=conv, query=query,
                            exclude_messages=kept, asked_at=asked_at, limits=self.limits,
                            recent_messages=recent, previous=self._sticky.get((user_id, conv), []))
        if built is None:
            return None
        return built, keep, TurnMemory(user_id, conv, asked_at, set(built.item_ids),
                                       list(built.below_cap))

    def _remember(self, key: tuple[int, int | None], built: Frame) -> None:
        self._sticky[key] = built.sticky
        self._sticky.move_to_end(key)
        while len(self._sticky) > STICKY_CONVERSATIONS:
            self._sticky.popitem(last=False)

    def store_turn(self, p: PendingTurn) -> TurnContext:
        """Store what is new in the request, each message in its own transaction, this turn's
        reheats (retrieval is the only writer of activation after birth), and move the clock
        by what the model was sent. The store's writer calls this."""
        heat.reheat(p.clock, p.reheats)
        _, turn = capture.record(
            self.store, user_key=p.user, conversation_key=p.conversation, provider=p.provider,
            model=p.model, messages=p.messages, times=[p.at] * len(p.messages), source="request",
        )
        heat.advance(turn.user_id, p.sent_tokens)
        return turn

    def store_reply(self, turn: TurnContext, reply: Reply, at: float,
                    pending: PendingTurn | None = None) -> None:
        """Store the reply, move the clock by what the model sent back, and log what the turn
        was shown as bound to it (the store's writer); a recalled note the reply cites by name
        was used."""
        message_id = capture.record_reply(self.store, turn, reply, at)
        if message_id is not None:
            heat.advance(turn.user_id, _tokens([reply.message]))
            if pending and (bound := pending.hits | (pending.shown - pending.frame_rows)):
                tools.record_bindings(message_id, bound)
        recalled = pending.notes if pending else []
        if recalled and pending and pending.library is not None:
            text = "\n".join(p.text for p in reply.message.parts)
            if cited := notes.cited_notes(text, recalled):
                notes.mark_used(pending.library, cited, date.today())

    def _notes_for(self, parsed: ParsedRequest, tenant: str) -> notes.RecallResult | None:
        """Notes recall for a task's first prompt, from the tenant's own library; a library
        that cannot be read is skipped."""
        root = tenants.library(self.notes_root, tenant)
        if root is None or not (root / notes.NOTES_DIR).is_dir():
            return None
        try:
            return notes.recall(root, _last_user_text(parsed.messages))
        except (PerpetuityError, OSError) as e:
            log.warning("perpetuity: notes recall skipped: %s", e)
            return None

    def capture_note(self, arguments: Any, memory: TurnMemory) -> str:
        """The note_capture tool: write or patch one note in the asking tenant's library; its
        outcome, or why not, as text. A lesson drawn from a conversation that quoted untrusted
        content (a fetched page) is only a lead: tentative."""
        if memory.library is None:
            return "note_capture: no notes library is configured"
        try:
            fields = json.loads(arguments) if isinstance(arguments, str) else arguments
            if memory.untrusted and isinstance(fields, dict):
                fields = {**fields, "confidence": "tentative"}
            return notes.capture(memory.library, fields, date.today()).text
        except (PerpetuityError, ValueError, TypeError) as e:
            return f"note_capture refused: {e}"

    def _tool_specs(self, memory: TurnMemory, taken: list[str]) -> list[dict[str, Any]]:
        """Our tools, never under a name the harness already uses (the model could not tell
        them apart, and the provider may refuse the duplicate)."""
        specs: list[dict[str, Any]] = [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema}
            for t in tools.TOOLS]
        if memory.library is not None:
            specs.append({"name": notes.CAPTURE_TOOL_NAME, "description": notes.CAPTURE_RULES,
                          "input_schema": notes.CAPTURE_TOOL_SCHEMA})
        return [s for s in specs if s["name"] not in taken]


def _tools_note(built: Frame) -> str:
    left = (f" {built.left_out} more remembered items were left out of this frame;"
            " memory_more and memory_search reach them." if built.left_out else "")
    return f"[{tools.INSTRUCTIONS}{left}]"


def _tokens(messages: list[Message]) -> int:
    return sum(token_estimate(p.text) for m in messages for p in m.parts)


def starts_task(messages: list[Message]) -> bool:
    """A new prompt from the person, not a round of tool results."""
    return bool(messages) and messages[-1].role == "user" and any(
        p.kind == Kind.TEXT for p in messages[-1].parts)


def _keep_from(messages: list[Message], coding: bool) -> int:
    """Where the turns kept as the harness sent them begin: the live turn for a chat client,
    the last few human turns (with their tool rounds, so every call keeps its result) for a
    coding harness."""
    human = [i for i, m in enumerate(messages)
             if m.role == "user" and any(p.kind == Kind.TEXT for p in m.parts)]
    if not human:
        return len(messages) - 1 if messages else 0
    turns = CODING_KEEP_TURNS if coding else 1
    return human[-turns] if len(human) >= turns else human[0]


def _last_user_text(messages: list[Message]) -> str:
    """What the person last said: the query, and the command check."""
    for m in reversed(messages):
        if m.role == "user" and (text := m.text.strip()):
            return text
    return ""


def _curate(root: Path) -> str:
    """Curate the notes library; its summary, or why it could not, as the reply."""
    try:
        return notes.curate(root, date.today()).text
    except PerpetuityError as e:
        return f"perpetuity: curate failed: {e}"


def _json_body(raw: bytes) -> dict | None:
    if not raw or len(raw) > MAX_BODY:
        return None
    try:
        data = json.loads(raw)
        if _SURROGATE.search(raw):  # a lone one (\ud800) cannot be stored: found by fuzzing
            json.dumps(data, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None
    return data if isinstance(data, dict) else None
