"""The per-request path, in the order data flows: route → identity → retrieve → render, then a
job to forward and capture.

A request is understood once (`understand`, then the body read by `serve.reading`: its route,
controls, parsing and identity), then decided, then laid out by its conversation's plan:
`decide` turns it into a `Decision`: leave it alone, send it upstream untouched, or forward it,
its history replaced by the frame (and notes, when a task starts), as a `Job` whose reply is
captured (through the relay when the recall tools ride along). What becomes of the
conversation's frame is `plan.decide`'s to say; `serve.layout` builds what it said. It only
reads: the writes (`store_turn`, `store_reply`) run on the store's one writer thread while the
request is already on its way (`serve.writer`). It never raises for bad input: anything it
cannot read passes through as the client sent it. A deployment's options reach it as one
`Settings`.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from datetime import date
from pathlib import Path
from typing import Any

from perpetuity_core import notes
from perpetuity_core.errors import PerpetuityError
from perpetuity_core.frame import plan, tenants
from perpetuity_core.memory.derived import bindings, heat
from perpetuity_core.memory.derived.bm25 import Params
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.storage import capture, names, templates, users
from perpetuity_core.memory.storage.capture import TurnContext
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.exchange import (
    HOP_BY_HOP,
    Answer,
    Decision,
    HttpRequest,
    Job,
    PendingTurn,
    Recall,
)
from perpetuity_core.serve.layout import Layout, Planned
from perpetuity_core.serve.reading import RequestReader, Turn, Understood
from perpetuity_core.serve.settings import Settings
from perpetuity_core.serve.tally import Savings
from perpetuity_core.serve.writer import Landing
from perpetuity_core.wire import mend
from perpetuity_core.wire.conversation import Kind, ParsedRequest, Protocol, Reply, is_prompt
from perpetuity_core.wire.identity import PERSONAL
from perpetuity_core.wire.protocols import ADAPTERS, gemini
from perpetuity_core.wire.route import CONTROL_PREFIX

log = logging.getLogger("perpetuity")

BOUND_HITS = 20  # a turn's best rendered matches, bound to its reply in the binding log

# The largest body `decide` reads on the event loop when it retrieves nothing (Pipeline.light):
# a 64 KB body is read in about 0.3 ms, less than the two thread hops it saves.
INLINE_BODY = 64 * 1024

# The longest live task `carried` decides on the event loop: a carried round's decision walks
# the live task (from the person's latest prompt: its check, its layout), not the history
# before it, which only grows. CPU a round, a task of small rounds on a 2-core machine: 1.05 ms
# at 600 messages, 3.1 at 2,000, 5.3 at 4,000 (load 9).
INLINE_MESSAGES = 600

# The most bytes of a body not read before that `carried` reads on the event loop (the rest is
# read already, `Seen.look`): a tool round's results, about 1 ms of parsing.
INLINE_UNREAD = 256 * 1024

# Dropped from what goes upstream beside the hop-by-hop headers: encodings, since the reply is
# read to store it (providers stream SSE uncompressed anyway).
_DROP_UPSTREAM = HOP_BY_HOP | {"accept-encoding"}


class Pipeline:
    """One memory's request path (`understand`, then `decide`; `prepare` both), its writes (`store_turn`, `store_reply`, run by
    the store's writer) and our tools (`run_tool`), as a deployment's `Settings` say."""

    def __init__(self, store: Store, settings: Settings, scanner: Scanner | None = None) -> None:
        """`scanner`: one made for this store and these settings' sharing, kept (its arena read
        already) when only other settings changed."""
        self.store = store
        self.settings = settings
        # Reads only, on the thread that prepares requests; the store's thread does the writing.
        self.scanner = scanner or _scanner(store, settings)
        if settings.personal:
            # The one user exists before the first request (written once, at start-up): on a
            # file of imports and older tenants, the person's first request recalls them.
            store.user_id(PERSONAL)
        self.layout = Layout(store, self.scanner, settings)
        self._shapes: dict[str, str] = {}  # harness -> digest of its request shape last kept
        self.reader = RequestReader(store.salt, settings)  # each request read once
        self.savings = Savings()  # the live tally's prompt caches (the store's writer uses them)
        self.landing = Landing()  # each user's writes queued and not yet run (serve.writer)

    def understand(self, req: HttpRequest) -> Understood:
        """The request's line and headers read (serve.reading): done where they decide it
        (another host's traffic through us, `x-perpetuity: off`), with no body read. The addon
        asks this on the event loop, so those never wait for the preparing thread (two thread
        hops) nor parse a body they pass on as it came."""
        return self.reader.understand(req)

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

    def light(self, u: Understood) -> bool:
        """Is the decision light enough for the event loop: recall off (`x-perpetuity-recall:
        off`: nothing retrieved or rendered, the body only read to be stored), a small body,
        and no curate command in it (curating writes the notes library)? The addon then
        decides it there, sparing capture alone two thread hops (issue 24: 0.5-0.6 ms near
        idle, several under load, around 0.4 ms of work). A command the bytes escape is still
        curated, on the loop."""
        return (len(u.req.body) <= INLINE_BODY and b"perpetuity-curate" not in u.req.body
                and not u.controls.recall)

    def carried(self, u: Understood) -> Decision | None:
        """The decision for a tool round of the task in progress whose conversation's plan is
        carried as it stands (plan.Carry: nothing retrieved or built, no notes read), its body
        one that continues a body read before by at most INLINE_UNREAD bytes, its live task no
        longer than INLINE_MESSAGES, however long the history before it; None for any other
        request, with what was read of it kept in `u` for `decide`. What a round costs then is
        far less than the GIL's switch interval (5 ms), so the preparing thread would not spare
        the event loop that time, and its two hops would still cost theirs (issue 24): the
        addon asks this on the loop first."""
        if u.req.method != "POST":
            return None
        u.look = self.reader.seen.look(u.req.body)  # (read compares none of it again)
        if not u.look.continues(INLINE_UNREAD):
            return None  # (a body not read before is declined before it is parsed)
        self.reader.read(u)
        t = u.turn
        if u.done or t is None:
            return u.decision
        if t.curates or not any(map(is_prompt, reversed(t.parsed.messages[-INLINE_MESSAGES:]))):
            return None  # (a longer live task is laid out on the thread; curating writes notes)
        planned = None
        if t.recalls and not t.ident.side:
            planned = self.layout.planned(t.parsed, t.ident, t.at, t.tools_on, on_loop=True)
            if not isinstance(planned.decided, plan.Carry):
                return None
        return self.decide(u, planned)

    def prepare(self, req: HttpRequest) -> Decision:
        """One request's decision, from its bytes (the evaluations, the Codex socket)."""
        return self.decide(self.understand(req))

    def decide(self, u: Understood, planned: Planned | None = None) -> Decision:
        """`u` read (once: serve.reading), decided, and laid out by its conversation's plan;
        `planned` is the plan's word when `carried` read it already."""
        self.reader.read(u)
        d, t = u.decision, u.turn
        assert d is not None
        if u.done or t is None:
            return d
        r, parsed, ident, controls, body = t.route, t.parsed, t.ident, t.controls, t.body
        if t.curates and t.library is not None:
            d.answer = Answer(
                "text/event-stream; charset=utf-8" if parsed.stream else "application/json",
                ADAPTERS[t.protocol].render_text(_curate(t.library), parsed.model, parsed.stream,
                                                 "resp_perpetuity_" + secrets.token_hex(8)))
            d.note = "answered /perpetuity-curate"
            return d
        req = u.req
        if ident.side:
            d.note = f"side request: {ident.side}"
            if ident.side == "title" and controls.capture and not controls.probe:
                # Forwarded as sent; only its reply is read, for the conversation's name.
                pending = PendingTurn(user=ident.user, conversation=ident.conversation,
                                      provider=r.provider.value, model=parsed.model, messages=[],
                                      at=time.time(), title=True,
                                      structured=parsed.structured_output)
                d.job = Job(method=req.method, url=r.upstream_url, headers=_forwarded(req),
                            body=req.body, protocol=t.protocol, stream=parsed.stream,
                            pending=pending, direct=body)
            return d
        recall = Recall()
        if t.recalls:
            planned = planned or self.layout.planned(parsed, ident, t.at, t.tools_on)
            # What retrieves reads the user's earlier turns, reheats and clock as stored: their
            # writes, queued before the client had its reply, may not have run yet (the
            # figures of `perpetuity eval` through the proxy moved with the load). A carried
            # round retrieves nothing, and is not held up.
            if (isinstance(planned.decided, plan.Rebuild | plan.Addendum | None)
                    and self.landing.wait(ident.user)):
                planned = self.layout.planned(parsed, ident, t.at, t.tools_on)
            recall = self.layout.recall(body, parsed, ident, t.protocol, t.at, t.tools_on,
                                        t.library, planned)
        return self._laid_out(u, t, recall)

    def _laid_out(self, u: Understood, t: Turn, recall: Recall) -> Decision:
        """The decision for a turn laid out as `recall` says: the body to send, and the job
        that sends it and captures the reply."""
        d, req, r, parsed, controls = u.decision, u.req, t.route, t.parsed, t.controls
        assert d is not None
        if recall.memory is not None:
            recall.memory.library = t.library if self.settings.notes_capture else None
            recall.memory.history = parsed.messages
        d.body, d.frame, d.recall = recall.body, recall.built, recall
        if t.count and recall.memory is not None:
            specs = self._tool_specs(recall.memory, parsed.tool_names)
            counted = recall.sent if recall.sent is not None else t.body
            if t.protocol == Protocol.GEMINI:
                counted = gemini.count_request(counted, parsed.model)
            d.body = self._first_round(t.protocol, counted, specs)
        if controls.probe or not controls.capture:
            d.note = _noted("probe" if controls.probe else "capture off", recall.note)
            return d
        if recall.key is not None and recall.plan is not None:
            self.layout.remember(recall.key, recall.plan)
        if controls.at is not None and t.claimed is None:  # said here: once a request
            log.warning("perpetuity: x-perpetuity-time %s is in the future; the turn is stored "
                        "at its arrival time", u.headers.get("x-perpetuity-time", ""))
        built, ident = recall.built, t.ident
        pending = PendingTurn(
            user=ident.user, conversation=ident.conversation, provider=r.provider.value,
            model=parsed.model, messages=parsed.messages, at=t.at,
            reheats=built.reheats if built else {}, clock=built.now if built else 0.0,
            sent_tokens=(recall.sent_tokens if recall.body is not None
                         else messages_tokens(parsed.messages)),
            notes=recall.notes, hits=set(built.hits[:BOUND_HITS]) if built else set(),
            shown=recall.memory.shown if recall.memory else set(),
            frame_rows=set(recall.plan.shown) if recall.plan else set(),
            folder=t.folder, library=t.library,
            shape=self._new_shape(t.protocol, ident.harness, t.body, req.headers, parsed, t.cut))
        specs = self._tool_specs(recall.memory, parsed.tool_names) if recall.memory else []
        d.job = Job(
            method=req.method, url=r.upstream_url, headers=_forwarded(req),
            body=recall.body if recall.body is not None else req.body, protocol=t.protocol,
            stream=parsed.stream, pending=pending, at=t.claimed, memory=recall.memory,
            max_rounds=self.settings.tool_rounds, tool_specs=specs,
            original=req.body if recall.body is not None else None,
            first_round=self._first_round(t.protocol, recall.sent, specs)
            if recall.memory is not None else None, direct=t.body, sent=recall.sent)
        d.note = _noted("captured", recall.note)
        return d

    def _new_shape(self, protocol: Protocol, harness: str, body: dict[str, Any],
                   headers: tuple[tuple[str, str], ...], parsed: ParsedRequest,
                   cut: bool) -> tuple[str, dict[str, Any]] | None:
        """Claude Code's request shape (its system prompt and tools) for `perpetuity replay`
        to bill this person's sessions with (memory.storage.templates), when it differs from
        the one last kept; None otherwise. Not looked at in a tool round (most calls): a task's
        rounds are sent with the shape its prompt had."""
        if (protocol != Protocol.ANTHROPIC or harness != "claude-code" or not parsed.messages
                or any(p.kind == Kind.TOOL_RESULT for p in parsed.messages[-1].parts)):
            return None
        shaped = _shaped(body, parsed)
        shape = templates.shape(mend.mended(shaped) if cut else shaped, list(headers))
        if shape is None or self._shapes.get(harness) == (digest := templates.digest(shape)):
            return None
        self._shapes[harness] = digest
        return harness, shape

    def store_turn(self, p: PendingTurn) -> TurnContext:
        """Store what is new in the request, each message in its own transaction, this turn's
        reheats (retrieval is the only writer of activation after birth), and move the clock
        by what the model was sent. The store's writer calls this."""
        self.reader.seen.release()  # the body this one replaced, freed here: off the request path
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

    def tally(self, job: Job, reply: Reply) -> None:
        """Add the call to the live tally of what the proxy saves (the store's writer)."""
        self.savings.record(self.store.db, job, reply)

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
                   if pool is not None else None, one_person=settings.personal, store_rows=0,
                   params=Params() if settings.semantic else Params(semantic=0.0))


def _shaped(body: dict[str, Any], parsed: ParsedRequest) -> dict[str, Any]:
    """`body` with only the messages templates.shape reads (the first user message, the
    system-role ones), in their order: the same shape without a walk of the whole history."""
    raw = body["messages"]
    first = next((i for i, m in enumerate(raw) if isinstance(m, dict) and m.get("role") == "user"),
                 None)
    keep = sorted({*parsed.raw_standing, *([] if first is None else [first])})
    return {**body, "messages": [raw[i] for i in keep]}


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
