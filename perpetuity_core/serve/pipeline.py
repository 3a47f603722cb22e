"""The per-request path, in the order data flows: route → identity → retrieve → render, then a
job to forward and capture.

`prepare` turns one HTTP request into a `Decision`: leave it alone, send it upstream untouched,
or forward it, its history replaced by the frame (and notes, when a task starts), as a `Job`
whose reply is captured (through the relay when the recall tools ride along). What becomes of
the conversation's frame is `plan.decide`'s to say; `serve.layout` builds what it said. It only
reads: the writes (`store_turn`, `store_reply`) run on the store's one writer thread while the
request is already on its way (`serve.writer`). It never raises for bad input: anything it
cannot read passes through as the client sent it. A deployment's options reach it as one
`Settings`.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

from perpetuity_core import notes
from perpetuity_core.errors import PerpetuityError
from perpetuity_core.frame import tenants
from perpetuity_core.memory.derived import bindings, heat
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.storage import capture, names, templates, users
from perpetuity_core.memory.storage.capture import TurnContext
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.exchange import (
    HOP_BY_HOP,
    UNKNOWN_PROVIDER,
    Answer,
    Decision,
    HttpRequest,
    Job,
    PendingTurn,
    Recall,
)
from perpetuity_core.serve.layout import Layout, last_user_text
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire.conversation import (
    Kind,
    ParsedRequest,
    Protocol,
    Reply,
)
from perpetuity_core.wire.identity import PERSONAL, identify
from perpetuity_core.wire.protocols import ADAPTERS, gemini
from perpetuity_core.wire.route import (
    CONTROL_PREFIX,
    anthropic_count,
    credential,
    gemini_call,
    parse_controls,
    reads_model,
    route,
)
from perpetuity_core.wire.seen import Read, Seen

log = logging.getLogger("perpetuity")

CURATE_COMMAND = "/perpetuity-curate"
BOUND_HITS = 20  # a turn's best rendered matches, bound to its reply in the binding log

# A surrogate's JSON escape: its high half (d800-dbff) or its low half (dc00-dfff).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")

# Bodies above this are forwarded untouched rather than parsed on the request path.
MAX_BODY = 32 * 1024 * 1024

# The largest body `prepare` reads on the event loop when it retrieves nothing (Pipeline.light):
# a 64 KB body is read in about 0.3 ms, less than the two thread hops it saves.
INLINE_BODY = 64 * 1024

# The longest history `carried` prepares on the event loop: a carried round's prepare walks the
# whole history (its check, its layout). Process CPU a round, a task of small rounds on a
# 2-core machine: 0.55 ms at 101 messages, 1.04 at 401, 1.26 at 601, 1.60 at 801.
INLINE_MESSAGES = 600

# Dropped from what goes upstream beside the hop-by-hop headers: encodings, since the reply is
# read to store it (providers stream SSE uncompressed anyway).
_DROP_UPSTREAM = HOP_BY_HOP | {"accept-encoding"}


@dataclass(frozen=True, slots=True)
class _Known:
    """What the request path made of a body, kept for the next body that starts as it does
    (wire.seen): the request in neutral terms, and the folder its messages state with the index
    of the message stating it (names.messages_folder; none: their count)."""

    parsed: ParsedRequest
    folder: tuple[str, int]


class Pipeline:
    """One memory's request path (`prepare`), its writes (`store_turn`, `store_reply`, run by
    the store's writer) and our tools (`run_tool`), as a deployment's `Settings` say."""

    def __init__(self, store: Store, settings: Settings, scanner: Scanner | None = None) -> None:
        """`scanner`: one made for this store and these settings' sharing, kept (its arena read
        already) when only other settings changed."""
        self.store = store
        self.settings = settings
        self.upstreams = dict(settings.upstreams)
        self.limits = settings.limits
        # Reads only, on the thread that prepares requests; the store's thread does the writing.
        self.scanner = scanner or _scanner(store, settings)
        if settings.personal:
            # The one user exists before the first request (written once, at start-up): on a
            # file of imports and older tenants, the person's first request recalls them.
            store.user_id(PERSONAL)
        self.layout = Layout(store, self.scanner, settings)
        self._shapes: dict[str, str] = {}  # harness -> digest of its request shape last kept
        self._seen = Seen()  # the bodies last read, so that a longer one reads only its tail

    def _json_body(self, raw: bytes) -> Read | None:
        """The body read, or None when it is not a JSON object this path may store (too
        large, unreadable, a lone surrogate); only bytes not read before are scanned."""
        if not raw or len(raw) > MAX_BODY:
            return None
        try:
            read = self._seen.read(raw)
            if _lone_surrogate(raw, read.fresh_from):  # a lone one (\ud800) cannot be stored
                json.dumps(read.data, ensure_ascii=False).encode()
        except (ValueError, RecursionError):  # RecursionError: deeper than Python's stack
            return None
        return read if isinstance(read.data, dict) else None

    def _parse(self, protocol: Protocol, read: Read) -> tuple[ParsedRequest, str]:
        """The request in neutral terms and the folder its harness states (names.folder), kept
        for the next body that starts as this one does: the messages an earlier body of the
        same wire read are taken as they were, and the folder is looked for among the new ones
        alone."""
        known = read.known if isinstance(read.known, _Known) else None
        if known is not None and known.parsed.protocol != protocol:
            known = None  # another wire's body that starts with the same bytes
        parsed = ADAPTERS[protocol].parse_request(read.data, known.parsed if known else None,
                                                  read.reused)
        found, reused = ("", 0), 0
        if known is not None:
            found = known.folder
            reused = bisect.bisect_left(known.parsed.raw_index, read.reused)
        if found[1] >= reused:  # none stated in the messages read before: look in the rest
            found = names.messages_folder(parsed.messages, reused)
        self._seen.keep(read, _Known(parsed, found))
        stated = names.stated_folder(parsed.system)
        return parsed, stated if stated is not None else found[0]

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

    def passed(self, req: HttpRequest) -> Decision | None:
        """`prepare`'s decision where the body cannot change it, made without reading the body:
        another host's traffic through us, and `x-perpetuity: off`. The addon asks this on the
        event loop first, so these never wait for the preparing thread (two thread hops) nor
        parse a body they pass on as it came. None: `prepare` decides (also where only the
        body's model tells the provider)."""
        if reads_model(path=req.path, direct=req.direct,
                       headers={k.lower(): v for k, v in req.headers}):
            return None
        decision = self.route_only(req)
        if decision.route is None:
            return decision
        if parse_controls(_text_headers(req)).enabled:
            return None
        decision.note = "x-perpetuity: off"
        return decision

    def warm(self) -> None:
        """Build what the first search reads (the arena of every stored row) before a request
        needs it: the proxy's first prompt after a start read every row of the memory first
        (the 4M-token unit of bench_retrieval: 90-112 ms to its first byte against 10-21 for the
        next ones; its cold catch-up takes 0.43 s at 20M tokens). The store's thread runs it as
        the proxy starts; a prompt that comes sooner waits for it, as it would have done the same
        work itself. Reads only; a failure is logged, and the first search reads what it needs
        as before."""
        try:
            self.scanner.catch_up()
        except Exception as e:  # never at error level: mitmdump exits on one logged at start
            log.warning("perpetuity: could not read memory ahead of the first request (%s); "
                        "the first search reads it", e)

    def light(self, req: HttpRequest) -> bool:
        """Is `prepare` light enough for the event loop: recall off (`x-perpetuity-recall:
        off`: nothing retrieved or rendered, the body only read to be stored), a small body,
        and no curate command in it (curating writes the notes library)? The addon then
        prepares it there, sparing capture alone two thread hops (issue 24: 0.5-0.6 ms near
        idle, several under load, around 0.4 ms of work). A command the bytes escape is still
        curated, on the loop."""
        return (len(req.body) <= INLINE_BODY and b"perpetuity-curate" not in req.body
                and not parse_controls(_text_headers(req)).recall)

    def carried(self, req: HttpRequest) -> Decision | None:
        """`prepare`'s decision for a tool round of the task in progress whose conversation's
        plan is carried as it stands (plan.Carry: nothing retrieved or built, no notes read),
        its body one that continues a body read before, its history no longer than
        INLINE_MESSAGES; None, with nothing decided, for any other request (`prepare` decides
        it). What a round costs then is far less than the GIL's switch interval (5 ms), so
        the preparing thread would not spare the event loop that time, and its two hops would
        still cost theirs (issue 24): the addon asks this on the loop first."""
        if req.method != "POST" or not self._seen.continues(req.body):
            return None
        return self._prepare(req, carried_only=True)

    def prepare(self, req: HttpRequest) -> Decision:
        decision = self._prepare(req)
        assert decision is not None  # (None only where carried_only asks)
        return decision

    def _prepare(self, req: HttpRequest, carried_only: bool = False) -> Decision | None:
        read = self._json_body(req.body) if req.method == "POST" else None
        body: dict[str, Any] | None = read.data if read is not None else None
        decision = self.route_only(req, str(body.get("model", "")) if body else "")
        r = decision.route
        if r is None:
            return decision
        headers = _text_headers(req)
        controls = parse_controls(headers)
        if not controls.enabled:
            decision.note = "x-perpetuity: off"
            return decision
        if r.protocol is None or read is None or body is None:
            decision.note = "no turn in this request"
            return decision
        try:
            parsed, folder = self._parse(r.protocol, read)
        except Exception as e:  # fail open: an unreadable body goes through as sent
            decision.note = f"unparsed: {e}"
            return decision
        if carried_only and len(parsed.messages) > INLINE_MESSAGES:
            return None
        # Anthropic's count_tokens and Gemini's countTokens are answered for the request as it
        # would go upstream (framed, our tools beside the harness's), and store nothing: a
        # harness sizing its context sees what the model reads.
        count = anthropic_count(req.path)
        if (call := gemini_call(req.path)) is not None:
            # Gemini: the path names the model and the streaming.
            parsed.model, parsed.stream = call.model or parsed.model, call.stream
            count = call.count
        if count:
            controls = replace(controls, probe=True)
        settings = self.settings
        ident = identify(headers, parsed, credential(headers, req.path), self.store.salt,
                         settings.trust_identity, settings.personal)
        decision.identity, decision.parsed = ident, parsed
        library = tenants.library(settings.notes_root, ident.tenant)
        if (last_user_text(parsed.messages) == CURATE_COMMAND and library is not None
                and settings.notes_capture):
            if carried_only:
                return None  # curating writes the notes library
            text = _curate(library)
            decision.answer = Answer(
                "text/event-stream; charset=utf-8" if parsed.stream else "application/json",
                ADAPTERS[r.protocol].render_text(text, parsed.model, parsed.stream,
                                                 "resp_perpetuity_" + secrets.token_hex(8)))
            decision.note = "answered /perpetuity-curate"
            return decision
        if ident.side:
            decision.note = f"side request: {ident.side}"
            if ident.side == "title" and controls.capture and not controls.probe:
                # Forwarded as sent; only its reply is read, for the conversation's name.
                pending = PendingTurn(user=ident.user, conversation=ident.conversation,
                                      provider=r.provider.value, model=parsed.model, messages=[],
                                      at=time.time(), title=True,
                                      structured=parsed.structured_output)
                decision.job = Job(method=req.method, url=r.upstream_url,
                                   headers=_forwarded(req), body=req.body, protocol=r.protocol,
                                   stream=parsed.stream, pending=pending)
            return decision
        at = controls.at if controls.at is not None else time.time()
        # The recall tools ride along with a frame (there is memory to reach) and a model call.
        tools_on = (settings.tools and controls.tools and controls.capture
                    and (count or not controls.probe))
        recall: Recall | None = Recall()
        if controls.recall and "previous_response_id" not in parsed.hints:
            recall = self.layout.recall(body, parsed, ident, r.protocol, at, tools_on, library,
                                        carried_only)
        if recall is None:
            return None  # (carried_only: the plan is not carried as it stands)
        if recall.memory is not None:
            recall.memory.library = library if settings.notes_capture else None
            recall.memory.history = parsed.messages
        decision.body, decision.frame, decision.recall = recall.body, recall.built, recall
        if count and recall.memory is not None:
            specs = self._tool_specs(recall.memory, parsed.tool_names)
            counted = recall.sent if recall.sent is not None else body
            if r.protocol == Protocol.GEMINI:
                counted = gemini.count_request(counted, parsed.model)
            decision.body = self._first_round(r.protocol, counted, specs)
        if controls.probe or not controls.capture:
            decision.note = _noted("probe" if controls.probe else "capture off", recall.note)
            return decision
        if recall.key is not None and recall.plan is not None:
            self.layout.remember(recall.key, recall.plan)
        built = recall.built
        pending = PendingTurn(
            user=ident.user, conversation=ident.conversation, provider=r.provider.value,
            model=parsed.model, messages=parsed.messages, at=at,
            reheats=built.reheats if built else {}, clock=built.now if built else 0.0,
            sent_tokens=(recall.sent_tokens if recall.body is not None
                         else messages_tokens(parsed.messages)),
            notes=recall.notes, hits=set(built.hits[:BOUND_HITS]) if built else set(),
            shown=recall.memory.shown if recall.memory else set(),
            frame_rows=set(recall.plan.shown) if recall.plan else set(),
            folder=folder, library=library,
            shape=self._new_shape(r.protocol, ident.harness, body, req.headers, parsed))
        specs = self._tool_specs(recall.memory, parsed.tool_names) if recall.memory else []
        decision.job = Job(
            method=req.method, url=r.upstream_url, headers=_forwarded(req),
            body=recall.body if recall.body is not None else req.body, protocol=r.protocol,
            stream=parsed.stream, pending=pending, at=controls.at, memory=recall.memory,
            max_rounds=settings.tool_rounds, tool_specs=specs,
            original=req.body if recall.body is not None else None,
            first_round=self._first_round(r.protocol, recall.sent, specs)
            if recall.memory is not None else None)
        decision.note = _noted("captured", recall.note)
        return decision

    def _new_shape(self, protocol: Protocol, harness: str, body: dict[str, Any],
                   headers: tuple[tuple[str, str], ...], parsed: ParsedRequest) -> tuple[str, dict[str, Any]] | None:
        """Claude Code's request shape (its system prompt and tools) for `perpetuity replay`
        to bill this person's sessions with (memory.storage.templates), when it differs from
        the one last kept; None otherwise. Not looked at in a tool round (most calls): a task's
        rounds are sent with the shape its prompt had."""
        if (protocol != Protocol.ANTHROPIC or harness != "claude-code" or not parsed.messages
                or any(p.kind == Kind.TOOL_RESULT for p in parsed.messages[-1].parts)):
            return None
        shape = templates.shape(_shaped(body, parsed), list(headers))
        if shape is None or self._shapes.get(harness) == (digest := templates.digest(shape)):
            return None
        self._shapes[harness] = digest
        return harness, shape

    def store_turn(self, p: PendingTurn) -> TurnContext:
        """Store what is new in the request, each message in its own transaction, this turn's
        reheats (retrieval is the only writer of activation after birth), and move the clock
        by what the model was sent. The store's writer calls this."""
        self._seen.release()  # the body this one replaced, freed here: off the request path
        heat.reheat(self.store.db, p.clock, p.reheats)
        if p.shape is not None:
            with self.store.db.writing("keep the harness's request shape") as raw:
                templates.keep(self.store.db.translated(raw), *p.shape)
        _, turn = capture.record(
            self.store, user_key=p.user, conversation_key=p.conversation, provider=p.provider,
            model=p.model, messages=p.messages, times=[p.at] * len(p.messages), source="request",
            folder=p.folder)
        heat.advance(self.store.db, turn.user_id, p.sent_tokens)
        return turn

    def store_reply(self, turn: TurnContext, reply: Reply, at: float,
                    pending: PendingTurn | None = None) -> None:
        """Store the reply, move the clock by what the model sent back, and log what the turn
        was shown as bound to it (the store's writer); a recalled note the reply cites by name
        was used. A title side request's reply is not a turn: it names the conversation."""
        if pending and pending.title:
            self.store.name_conversation(turn.conversation_id,
                                         title=names.title(reply, pending.structured))
            return
        message_id = capture.record_reply(self.store, turn, reply, at)
        if message_id is not None:
            heat.advance(self.store.db, turn.user_id, messages_tokens([reply.message]))
            if pending and (bound := pending.hits | (pending.shown - pending.frame_rows)):
                bindings.record_bindings(self.store.db, message_id, bound)
        recalled = pending.notes if pending else []
        if recalled and pending and pending.library is not None:
            text = "\n".join(p.text for p in reply.message.parts)
            if cited := notes.cited_notes(text, recalled):
                notes.mark_used(pending.library, cited, date.today())

    def run_tool(self, name: str, arguments: Any, memory: TurnMemory) -> str:
        """One call of a tool we added (the recall tools, note_capture): the text the model
        reads. Never raises."""
        if self.writes_notes(name):
            return self.capture_note(arguments, memory)
        return tools.run(name, arguments, memory, self.scanner)

    @staticmethod
    def writes_notes(name: str) -> bool:
        """The tool writes the notes library (the addon runs it on the notes' own thread)."""
        return name == notes.CAPTURE_TOOL_NAME

    def capture_note(self, arguments: Any, memory: TurnMemory) -> str:
        """The note_capture tool: write or patch one note in the asking tenant's library; its
        outcome, or why not, as text. A lesson drawn from a conversation that quoted untrusted
        content (a fetched page) is only a lead: tentative."""
        if memory.library is None:
            return "note_capture: no notes library is configured"
        try:
            fields = json.loads(arguments) if isinstance(arguments, str) else arguments
            if isinstance(fields, dict) and tenants.quotes_untrusted(memory.history):
                fields = {**fields, "confidence": "tentative"}
            return notes.capture(memory.library, fields, date.today()).text
        except (PerpetuityError, ValueError, TypeError) as e:
            return f"note_capture refused: {e}"

    def _first_round(self, protocol: Protocol, sent: dict[str, Any] | None,
                     specs: list[dict[str, Any]]) -> bytes | None:
        """The tool loop's first upstream body, our tools added, as the relay would make it
        (json.dumps, ASCII): made here, on the preparing thread, the event loop neither reads
        nor writes the request's JSON when the model calls none of our tools (most replies). A
        117 KB Claude Code request costs the loop 1.3 ms of loads and dumps otherwise
        (bench_relay_body.py, p50, a busy machine). Only what the last bodies did not hold is
        written (wire.written)."""
        if sent is None:
            return None
        return self.layout.written.dumps(
            ADAPTERS[protocol].add_tools(sent, specs, self.settings.tool_rounds == 1), ascii=True)

    def _tool_specs(self, memory: TurnMemory, taken: list[str]) -> list[dict[str, Any]]:
        """Our tools, never under a name the harness already uses (the model could not tell
        them apart, and the provider may refuse the duplicate)."""
        specs = _WITH_NOTES if memory.library is not None else _RECALL_SPECS
        return [s for s in specs if s["name"] not in taken]


# Our tools' definitions, made once: the same objects in every request, so wire.written writes
# them once (made afresh each call, their JSON, ~4 KB, was written again twice a call). Never
# changed after.
_RECALL_SPECS: tuple[dict[str, Any], ...] = tuple(
    {"name": t.name, "description": t.description, "input_schema": t.input_schema}
    for t in tools.TOOLS)
_WITH_NOTES = (*_RECALL_SPECS, {"name": notes.CAPTURE_TOOL_NAME,
                                "description": notes.CAPTURE_RULES,
                                "input_schema": notes.CAPTURE_TOOL_SCHEMA})


def _scanner(store: Store, settings: Settings) -> Scanner:
    share = settings.share_pool
    pool = share if isinstance(share, frozenset) else None
    # A set of tenants (the proxy's, even empty) asks users.pool_of on every search, so an
    # operator's `perpetuity memory tenants join` reaches a running proxy. The arena from the
    # first row (store_rows=0): a small memory scored from the store re-read every row on every
    # search (LoCoMo's 600 turns: 1.4 ms of a first prompt's 13).
    return Scanner(store, share_pool=bool(share) or pool is not None,
                   pool_of=(lambda uid: users.pool_of(store, uid, pool))
                   if pool is not None else None, one_person=settings.personal, store_rows=0)


def _shaped(body: dict[str, Any], parsed: ParsedRequest) -> dict[str, Any]:
    """`body` with only the messages templates.shape reads (the first user message, the
    system-role ones), in their order: the same shape without a walk of the whole history."""
    raw = body["messages"]
    first = next((i for i, m in enumerate(raw) if isinstance(m, dict) and m.get("role") == "user"),
                 None)
    keep = sorted({*parsed.raw_standing, *([] if first is None else [first])})
    return {**body, "messages": [raw[i] for i in keep]}


def _text_headers(req: HttpRequest) -> dict[str, str]:
    """The headers lower-cased, read as text: a value that was not UTF-8 (mitmproxy's
    surrogate escapes) must never reach the store or a digest as it is."""
    return {k.lower(): v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            for k, v in req.headers}


def _forwarded(req: HttpRequest) -> list[tuple[str, str]]:
    """The request's headers as they go upstream."""
    return [(k, v) for k, v in req.headers
            if k.lower() not in _DROP_UPSTREAM and not k.lower().startswith(CONTROL_PREFIX)]


def _noted(what: str, why: str) -> str:
    return f"{what}; {why}" if why else what


def _curate(root: Path) -> str:
    """Curate the notes library; its summary, or why it could not, as the reply."""
    try:
        return notes.curate(root, date.today()).text
    except PerpetuityError as e:
        return f"perpetuity: curate failed: {e}"


def _lone_surrogate(raw: bytes, start: int = 0) -> bool:
    """Does the body escape a surrogate that is not half of a pair, from byte `start` on (the
    bytes before were read before, and passed)? Scanned, not re-encoded: a long history's emoji
    (paired) made every call dump and encode the whole body (0.3 s at 6.5 MB). An escape is one
    only after an even run of backslashes (else it is text)."""
    paired = -1  # where the low half of the last pair starts
    for m in _SURROGATE.finditer(raw, start):
        start = k = m.start()
        while k and raw[k - 1] == 0x5C:
            k -= 1
        if (start - k) % 2 or start == paired:
            continue
        if raw[start + 3] not in b"89abAB" or not _LOW.match(raw, m.end()):
            return True
        paired = m.end()
    return False
