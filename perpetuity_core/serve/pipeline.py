"""The per-request path, in the order data flows: route → identity → retrieve → render, then a
job to forward and capture.

`prepare` turns one HTTP request into a `Decision`: leave it alone, send it upstream untouched,
or forward it, its history replaced by the frame (and notes, when a task starts), as a `Job`
whose reply is captured (through the relay when the recall tools ride along). What becomes of
the conversation's frame is `plan.decide`'s to say; the pipeline builds what it said. It only
reads: the writes (`store_turn`, `store_reply`) run on the store's one writer thread while the
request is already on its way (`serve.writer`). It never raises for bad input: anything it
cannot read passes through as the client sent it. A deployment's options reach it as one
`Settings`.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path
from typing import Any

from perpetuity_core import notes
from perpetuity_core.errors import PerpetuityError
from perpetuity_core.frame import build as frame
from perpetuity_core.frame import plan, render, tenants
from perpetuity_core.frame.build import Frame
from perpetuity_core.frame.cap import Cap
from perpetuity_core.frame.plan import Plan
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
from perpetuity_core.wire import repair
from perpetuity_core.wire.conversation import (
    Kind,
    Message,
    ParsedRequest,
    Protocol,
    Provider,
    Reply,
    is_prompt,
    prompt_text,
)
from perpetuity_core.wire.identity import PERSONAL, Identity, identify
from perpetuity_core.wire.protocols import ADAPTERS, anthropic
from perpetuity_core.wire.route import (
    CONTROL_PREFIX,
    anthropic_count,
    credential,
    gemini_call,
    parse_controls,
    route,
)

log = logging.getLogger("perpetuity")

CURATE_COMMAND = "/perpetuity-curate"
RECENT_STRETCH = 100  # the latest stored messages of the conversation the frame's tail comes from
PLANS = 10_000  # conversations whose plan is kept (least recently used go first)
BOUND_HITS = 20  # a turn's best rendered matches, bound to its reply in the binding log
NO_ONE = 0  # the recall tools' user before the store holds the asker: no row is anyone's 0

# A surrogate's JSON escape: its high half (d800-dbff) or its low half (dc00-dfff).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")

# Our tools' definitions as they ride along (notes' note_capture with them), in characters.
_OUR_TOOLS_CHARS = len(json.dumps(
    [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
     for t in tools.TOOLS] + [{"name": notes.CAPTURE_TOOL_NAME, "description": notes.CAPTURE_RULES,
                               "input_schema": notes.CAPTURE_TOOL_SCHEMA}]))

# Bodies above this are forwarded untouched rather than parsed on the request path.
MAX_BODY = 32 * 1024 * 1024

# Dropped from what goes upstream beside the hop-by-hop headers: encodings, since the reply is
# read to store it (providers stream SSE uncompressed anyway).
_DROP_UPSTREAM = HOP_BY_HOP | {"accept-encoding"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """How a deployment serves: what the addon's options give the pipeline (the defaults are
    the proxy's own)."""

    upstreams: Mapping[Provider, str]  # where each provider's traffic goes
    tools: bool = True  # the recall tools ride along (x-perpetuity-tools: off, per request)
    tool_rounds: int = 4  # upstream rounds one reply may take for the recall tools
    notes_root: Path | None = None  # the notes library (each tenant's under it)
    notes_capture: bool = True  # note_capture and /perpetuity-curate through us
    limits: Cap = Cap()
    # True pools every user (offline evaluation); a set of tenants pools the users of those
    # tenants with each other (the proxy); False, each user sees their own.
    share_pool: bool | frozenset[str] = False
    trust_identity: bool = False  # claimed identities are authenticated upstream of us (identity)
    # A personal proxy (identity.tenancy): every request is one person's, and so is every row
    # already in the file (old credential tenants, imports): one memory, nothing re-keyed.
    personal: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class _Built:
    """What a request made of its conversation's plan: the plan after it, the frame or addendum
    built (None when it kept the plan or memory had nothing), and the notes put in front."""

    plan: Plan
    frame: Frame | None = None
    made: str = ""  # "frame" or "addendum" ("" when nothing was built)
    notes: list[str] = field(default_factory=list)


class Pipeline:
    """One memory's request path (`prepare`), its writes (`store_turn`, `store_reply`, run by
    the store's writer) and our tools (`run_tool`), as a deployment's `Settings` say."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.upstreams = dict(settings.upstreams)
        self.limits = settings.limits
        # Reads only, on the thread that prepares requests; the store's thread does the writing.
        share = settings.share_pool
        pool = share if isinstance(share, frozenset) else None
        # A set of tenants (the proxy's, even empty) asks users.pool_of on every search, so
        # an operator's `perpetuity memory tenants join` reaches a running proxy.
        self.scanner = Scanner(store, share_pool=bool(share) or pool is not None,
                               pool_of=(lambda uid: users.pool_of(store, uid, pool))
                               if pool is not None else None, one_person=settings.personal)
        if settings.personal:
            # The one user exists before the first request (written once, at start-up): on a
            # file of imports and older tenants, the person's first request recalls them.
            store.user_id(PERSONAL)
        # Each conversation's plan: when its frame changes (`perpetuity_core.frame.plan`). Only
        # the preparing thread touches it; a restart costs one rebuilt frame.
        self._plans: OrderedDict[tuple[int, str], Plan] = OrderedDict()
        self._shapes: dict[str, str] = {}  # harness -> digest of its request shape last kept

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
        # Anthropic's count_tokens and Gemini's countTokens are answered for the request as it
        # would go upstream (framed; Anthropic's with our tools beside the harness's), and
        # store nothing: a harness sizing its context sees what the model reads.
        count = anthropic_count(req.path)
        if (call := gemini_call(req.path)) is not None:
            # Gemini: the path names the model and the streaming.
            parsed.model, parsed.stream = call.model or parsed.model, call.stream
        if count or (call is not None and call.count):
            controls = replace(controls, probe=True)
        settings = self.settings
        ident = identify(headers, parsed, credential(headers, req.path), self.store.salt,
                         settings.trust_identity, settings.personal)
        decision.identity, decision.parsed = ident, parsed
        library = tenants.library(settings.notes_root, ident.tenant)
        if (_last_user_text(parsed.messages) == CURATE_COMMAND and library is not None
                and settings.notes_capture):
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
        recall = Recall()
        if controls.recall and "previous_response_id" not in parsed.hints:
            recall = self._recall(body, parsed, ident, r.protocol, at, tools_on, library)
        if recall.memory is not None:
            recall.memory.library = library if settings.notes_capture else None
            recall.memory.untrusted = tenants.quotes_untrusted(parsed.messages)
        decision.body, decision.frame, decision.recall = recall.body, recall.built, recall
        if count and recall.memory is not None:
            specs = self._tool_specs(recall.memory, parsed.tool_names)
            decision.body = _first_round(r.protocol, recall.sent, specs, settings.tool_rounds)
        if controls.probe or not controls.capture:
            decision.note = _noted("probe" if controls.probe else "capture off", recall.note)
            return decision
        if recall.key is not None and recall.plan is not None:
            self._remember(recall.key, recall.plan)
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
            folder=names.folder(parsed), library=library,
            shape=self._new_shape(r.protocol, ident.harness, body, req.headers, parsed))
        specs = self._tool_specs(recall.memory, parsed.tool_names) if recall.memory else []
        decision.job = Job(
            method=req.method, url=r.upstream_url, headers=_forwarded(req),
            body=recall.body if recall.body is not None else req.body, protocol=r.protocol,
            stream=parsed.stream, pending=pending, at=controls.at, memory=recall.memory,
            max_rounds=settings.tool_rounds, tool_specs=specs,
            original=req.body if recall.body is not None else None,
            first_round=_first_round(r.protocol, recall.sent, specs, settings.tool_rounds)
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
        shape = templates.shape(body, list(headers))
        if shape is None or self._shapes.get(harness) == (digest := templates.digest(shape)):
            return None
        self._shapes[harness] = digest
        return harness, shape

    def _recall(self, body: dict[str, Any], parsed: ParsedRequest, ident: Identity,
                protocol: Protocol, asked_at: float, tools_on: bool,
                library: Path | None) -> Recall:
        """The request laid out by its conversation's plan (`perpetuity_core.frame.plan`): the
        frame in front, the harness's messages from the anchor on, addenda before the prompts
        they serve; notes when a task starts, and the note on the recall tools when they ride
        along. What changes is `plan.decide`'s to say; this builds and lays out what it said."""
        messages = parsed.messages
        prompt = _prompt_index(messages)
        user_id = self.store.find_user(ident.user)
        if user_id is None or prompt is None:
            out = self._lesson_only(body, parsed, protocol, library)
            out.memory = self._memory(user_id or NO_ONE, None, asked_at, None,
                                      tools_on and bool(parsed.tool_names))
            return out
        conv = self.store.find_conversation(user_id, ident.conversation)
        # By the conversation's key, not its row: a first request has no row yet.
        key = (user_id, ident.conversation)
        query = prompt_text(messages[prompt])
        # What the request carries besides its messages and the plan's frame: the harness's
        # system prompt and tools, and our tools with their note on the frame (its longest).
        ours = _OUR_TOOLS_CHARS + len(_tools_note(10**9)) if tools_on else 0
        fixed = (parsed.fixed_chars + ours + 3) // 4  # token_estimate's rule
        old = self._plans.get(key)
        match plan.decide(old, messages, prompt, asked_at, self.limits, fixed):
            case plan.Carry(plan=carried):
                made = _Built(plan=carried)
            case plan.Addendum(plan=carried, keep=keep):
                made = self._add(carried, parsed, prompt, keep, user_id, conv, query, asked_at,
                                 library)
            case plan.Trim(plan=carried):
                made = _Built(plan=self._trim(carried, parsed, prompt, conv, fixed))
            case plan.Rebuild(pace=pace):
                made = self._rebuild(parsed, prompt, user_id, conv, query, asked_at, library,
                                     pace)
                made = replace(made, plan=self._trim(made.plan, parsed, prompt, conv, fixed))
        # Once the recall tools rode along in a conversation they always do. An agent's ride
        # from its first call: tools come first in the provider's cached prefix, and ours
        # coming later would rewrite the harness's system prompt and tools after them (17k
        # tokens of Claude Code's). A chat's ride from its first frame: a chat with nothing
        # to recall yet pays for none (LoCoMo's chat replay: 0.766 of direct with them on
        # every call, against 0.737).
        rides = tools_on and (bool(parsed.tool_names) or bool(made.plan.frame)
                              or (old is not None and old.tools))
        laid_plan = replace(made.plan, tools=rides)
        out = Recall(key=key, plan=laid_plan, built=made.frame, made=made.made, notes=made.notes,
                     memory=self._memory(user_id, conv, asked_at, laid_plan, rides))
        laid = plan.place(laid_plan, messages)
        if laid is None:
            return out
        front = list(laid_plan.frame)
        if front and tools_on:
            front = frame.with_note(front, _tools_note(laid_plan.left_out))
        if out.memory is not None:
            out.memory.sent = _sent_whole(messages[laid.keep:], laid_plan.stubs)
        if not front and not laid.inserts and not laid_plan.stubs:
            return out
        if laid_plan.stubs:
            body = anthropic.stub_results(body, dict(laid_plan.stubs), parsed.raw_index[laid.keep])
        replaced = repair.replace_history(
            ADAPTERS[protocol], body, parsed, front, laid.keep,
            {parsed.raw_index[i]: list(m) for i, m in laid.inserts.items()})
        if replaced.body is None:
            log.warning("perpetuity: %s", replaced.why)
            return Recall(note=replaced.why, memory=out.memory)
        if replaced.why:
            log.info("perpetuity: %s", replaced.why)
        if replaced.keep != laid.keep:
            # The plan keeps what went upstream, so the next call grows from it.
            out.plan = replace(laid_plan, anchor=plan.mark(messages, replaced.keep))
        out.keep, out.note, out.front = replaced.keep, replaced.why, front
        out.sent_tokens = (messages_tokens(front) + laid_plan.insert_tokens
                           + messages_tokens(messages[replaced.keep:]) - laid_plan.stubbed)
        out.body = json.dumps(replaced.body, ensure_ascii=False).encode()
        out.sent = replaced.body
        return out

    def _memory(self, user_id: int, conv: int | None, asked_at: float, laid: Plan | None,
                rides: bool) -> TurnMemory | None:
        """What the recall tools read this call, or None when they do not ride along
        (`rides`): tools come first in the provider's cached prefix, so tools that came and
        went between the calls of one conversation would rewrite its whole prefix each time."""
        if not rides:
            return None
        return TurnMemory(user_id, conv, asked_at, set(laid.shown) if laid else set(),
                          list(laid.below_cap) if laid else [], everyone=self.settings.personal)

    def _rebuild(self, parsed: ParsedRequest, prompt: int, user_id: int, conv: int | None,
                 query: str, asked_at: float, library: Path | None,
                 pace: plan.Pace) -> _Built:
        """A new frame for the prompt, the harness's messages before it dropped (memory holds
        them); a conversation shorter than a frame keeps them all, with other conversations'
        memory in front."""
        messages = parsed.messages
        keep = prompt if messages_tokens(messages[:prompt]) > self.limits.ceiling else 0
        if conv is None:
            keep = 0
        elif new := capture.new_messages(self.store, conv, messages):
            keep = min(keep, new[0])  # what the store does not hold yet is never stripped
        keep = repair.kept_start(messages, keep)  # never a result whose call is dropped
        fps = [m.fingerprint() for m in messages]
        kept = self.store.message_ids(conv, fps[keep:]) if conv else []
        recent = self.store.latest_messages(conv, RECENT_STRETCH) if conv else []
        built = frame.build(self.scanner, user_id=user_id, conversation_id=conv, query=query,
                            exclude_messages=kept, asked_at=asked_at, limits=self.limits,
                            recent_messages=recent,
                            kept_tokens=messages_tokens(messages[keep:prompt]))
        front = built.messages if built else []
        notes_shown: list[str] = []
        if starts_task(messages) and (lesson := self._notes_for(parsed, library)):
            notes_shown = lesson.names
            front = frame.with_note(front, lesson.text)
        if not built:
            keep = 0  # nothing to stand in for the history
        rebuilt = Plan(
            frame=tuple(front), frame_tokens=messages_tokens(front),
            anchor=plan.mark(messages, keep), prompt=plan.mark(messages, prompt), at=asked_at,
            shown=frozenset(built.item_ids if built else ()),
            below_cap=tuple(built.below_cap if built else ()),
            left_out=built.left_out if built else 0,
            rule=plan.rule_for(parsed.protocol, parsed.model), pace=pace,
            agent=bool(parsed.tool_names))
        return _Built(plan=rebuilt, frame=built, made="frame", notes=notes_shown)

    def _trim(self, laid: Plan, parsed: ParsedRequest, prompt: int, conv: int | None,
              fixed: int) -> Plan:
        """`laid` with the live task's oldest tool results as stubs when its request would
        pass the bound (`plan.trimmed`); only results the store holds, so memory_more gives
        them back. Anthropic's results are stubbed; another wire's go as sent."""
        messages = parsed.messages
        keep = laid.anchor[0]
        if (parsed.protocol != Protocol.ANTHROPIC or conv is None
                or plan.size(laid, messages, keep, fixed) <= self.limits.bound):
            return laid
        results = {p.call_id: messages_tokens([Message(m.role, (p,))])
                   for m in messages[prompt + 1:] for p in m.parts
                   if p.kind == Kind.TOOL_RESULT and p.call_id}
        items = self.store.result_items(conv, list(results))
        stubs = {c: render.stub(i, results[c]) for c, i in items.items()}
        return plan.trimmed(laid, messages, keep, prompt, fixed, self.limits, stubs)

    def _add(self, carried: Plan, parsed: ParsedRequest, prompt: int, keep: int, user_id: int,
             conv: int | None, query: str, asked_at: float, library: Path | None) -> _Built:
        """An addendum for a new prompt under a frame that stays: its hits in other
        conversations not yet in front (a chat's; an agent's prompt gets its notes alone). Nothing before a prompt that answers a call (an
        interrupted tool call's result rides with the next prompt): it would part the call from
        its result."""
        messages = parsed.messages
        if repair.answers_earlier(messages, prompt):
            return _Built(plan=carried)
        kept = self.store.message_ids(conv, [m.fingerprint() for m in messages[keep:]]) \
            if conv else []
        # An agent's prompt gets none: the tool rounds after it re-read an addendum on every
        # call (the six shared Claude Code sessions: 0.735 of direct with them, 0.688 without,
        # the identifiers a next reply used from older history kept 0.830 and 0.813).
        more = None if carried.agent else frame.addendum(
            self.scanner, user_id=user_id, conversation_id=conv, query=query,
            exclude_messages=kept, shown=carried.shown, asked_at=asked_at, limits=self.limits)
        added = more.messages if more else []
        notes_shown: list[str] = []
        if starts_task(messages) and (lesson := self._notes_for(parsed, library)):
            notes_shown = lesson.names
            added = frame.with_note(added, lesson.text)
        if not added:
            return _Built(plan=carried)
        return _Built(plan=plan.with_addendum(carried, plan.mark(messages, prompt), added,
                                              messages_tokens(added),
                                              more.item_ids if more else []),
                      frame=more, made="addendum", notes=notes_shown)

    def _lesson_only(self, body: dict[str, Any], parsed: ParsedRequest,
                     protocol: Protocol, library: Path | None) -> Recall:
        """Before memory holds anything of this user: notes alone, when a task starts."""
        out = Recall()
        if starts_task(parsed.messages) and (lesson := self._notes_for(parsed, library)):
            out.notes = lesson.names
            out.body = json.dumps(ADAPTERS[protocol].replace_history(
                body, frame.with_note([], lesson.text), parsed.raw_index[0]),
                ensure_ascii=False).encode()
        return out

    def _remember(self, key: tuple[int, str], laid: Plan) -> None:
        self._plans[key] = laid
        self._plans.move_to_end(key)
        while len(self._plans) > PLANS:
            self._plans.popitem(last=False)

    def store_turn(self, p: PendingTurn) -> TurnContext:
        """Store what is new in the request, each message in its own transaction, this turn's
        reheats (retrieval is the only writer of activation after birth), and move the clock
        by what the model was sent. The store's writer calls this."""
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

    def _notes_for(self, parsed: ParsedRequest, root: Path | None) -> notes.RecallResult | None:
        """Notes recall for a task's first prompt, from the tenant's own library `root`; a
        library that cannot be read is skipped."""
        if root is None or not (root / notes.NOTES_DIR).is_dir():
            return None
        try:
            return notes.recall(root, _last_user_text(parsed.messages))
        except (PerpetuityError, OSError) as e:
            log.warning("perpetuity: notes recall skipped: %s", e)
            return None

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


def _forwarded(req: HttpRequest) -> list[tuple[str, str]]:
    """The request's headers as they go upstream."""
    return [(k, v) for k, v in req.headers
            if k.lower() not in _DROP_UPSTREAM and not k.lower().startswith(CONTROL_PREFIX)]


def _first_round(protocol: Protocol, sent: dict[str, Any] | None, specs: list[dict[str, Any]],
                 rounds: int) -> bytes | None:
    """The tool loop's first upstream body, our tools added, as the relay would make it: made
    here, on the preparing thread, the event loop neither reads nor writes the request's JSON
    when the model calls none of our tools (most replies). A 117 KB Claude Code request costs
    the loop 1.3 ms of loads and dumps otherwise (bench_relay_body.py, p50, a busy machine)."""
    if sent is None:
        return None
    return json.dumps(ADAPTERS[protocol].add_tools(sent, specs, rounds == 1)).encode()


def _sent_whole(messages: list[Message], stubs: tuple[plan.Stub, ...]) -> list[Message]:
    """The messages the model reads as the harness sent them: a tool result sent as a stub is
    not in front of the model (memory_more gives it back)."""
    stubbed = {call_id for call_id, _ in stubs}
    if not stubbed:
        return messages
    return [m for m in messages if not any(p.call_id in stubbed for p in m.parts)]


def _tools_note(left_out: int) -> str:
    left = (f" {left_out} more remembered items were left out of this frame;"
            " memory_more and memory_search reach them." if left_out else "")
    return f"[{tools.INSTRUCTIONS}{left}]"


def starts_task(messages: list[Message]) -> bool:
    """A new prompt from the person, not a round of tool results."""
    return bool(messages) and is_prompt(messages[-1])


def _prompt_index(messages: list[Message]) -> int | None:
    """The person's latest prompt: where the live task begins."""
    return next((i for i in range(len(messages) - 1, -1, -1) if is_prompt(messages[i])), None)


def _last_user_text(messages: list[Message]) -> str:
    """What the person last said: the query, and the command check."""
    return next((text for m in reversed(messages) if (text := prompt_text(m))), "")


def _noted(what: str, why: str) -> str:
    return f"{what}; {why}" if why else what


def _curate(root: Path) -> str:
    """Curate the notes library; its summary, or why it could not, as the reply."""
    try:
        return notes.curate(root, date.today()).text
    except PerpetuityError as e:
        return f"perpetuity: curate failed: {e}"


def _lone_surrogate(raw: bytes) -> bool:
    """Does the body escape a surrogate that is not half of a pair? Scanned, not re-encoded: a
    long history's emoji (paired) made every call dump and encode the whole body (0.3 s at
    6.5 MB). An escape is one only after an even run of backslashes (else it is text)."""
    paired = -1  # where the low half of the last pair starts
    for m in _SURROGATE.finditer(raw):
        start = k = m.start()
        while k and raw[k - 1] == 0x5C:
            k -= 1
        if (start - k) % 2 or start == paired:
            continue
        if raw[start + 3] not in b"89abAB" or not _LOW.match(raw, m.end()):
            return True
        paired = m.end()
    return False


def _json_body(raw: bytes) -> dict | None:
    if not raw or len(raw) > MAX_BODY:
        return None
    try:
        data = json.loads(raw)
        if _lone_surrogate(raw):  # a lone one (\ud800) cannot be stored: found by fuzzing
            json.dumps(data, ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None
    return data if isinstance(data, dict) else None

