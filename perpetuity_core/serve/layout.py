"""The request laid out by its conversation's plan (`perpetuity_core.frame.plan`): the frame in
front, the harness's messages from the anchor on, addenda before the prompts they serve, a live
task too large for the bound trimmed; notes when a task starts, and the note on the recall tools
when they ride along. `plan.decide` says what changes; `Layout` builds and lays out what it said,
on the thread that prepares requests (its plans are that thread's alone).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from perpetuity_core import notes
from perpetuity_core.errors import PerpetuityError
from perpetuity_core.frame import build as frame
from perpetuity_core.frame import plan, render
from perpetuity_core.frame.build import Frame
from perpetuity_core.frame.lean import FRESH, Asked, Lean
from perpetuity_core.frame.plan import Plan
from perpetuity_core.memory.derived.index import messages_tokens
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.kept import deletions
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.recall import tools
from perpetuity_core.recall.answers import TurnMemory
from perpetuity_core.serve.exchange import Recall
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire import mend, repair
from perpetuity_core.wire.conversation import (
    Kind,
    Message,
    ParsedRequest,
    Protocol,
    is_prompt,
    prompt_text,
)
from perpetuity_core.wire.identity import Identity
from perpetuity_core.wire.protocols import ADAPTERS, anthropic
from perpetuity_core.wire.written import Written

log = logging.getLogger("perpetuity")

# The latest stored messages of the conversation the frame's tail (frame_stretch.latest) is chosen
# from: a coding task is tens of calls of two messages each, and what the next task used of the
# one before lay 6k to 40k tokens back (the six shared Claude Code sessions, identifiers in the
# request 0.869 from 100, 0.882 from 200).
RECENT_STRETCH = 200
PLANS = 10_000  # conversations whose plan is kept (least recently used go first)
# ... and the tokens of their frames and addenda kept in all (~40 MB of text): 10,000 plans at
# the ceiling (5,000 tokens; more where a deployment raises it) held 200 MB and more.
PLAN_TOKENS = 10_000_000
NO_ONE = 0  # the recall tools' user before the store holds the asker: no row is anyone's 0

# Our tools' definitions as they ride along (notes' note_capture with them), in characters.
_OUR_TOOLS_CHARS = len(json.dumps(
    [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
     for t in tools.TOOLS] + [{"name": notes.CAPTURE_TOOL_NAME, "description": notes.CAPTURE_RULES,
                               "input_schema": notes.CAPTURE_TOOL_SCHEMA}]))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Built:
    """What a request made of its conversation's plan: the plan after it, the frame or addendum
    built (None when it kept the plan or memory had nothing), and the notes put in front."""

    plan: Plan
    frame: Frame | None = None
    made: str = ""  # "frame" or "addendum" ("" when nothing was built)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """What a conversation's plan says of one request: `decided` is None where there is no plan
    to decide (no stored user yet, or no prompt in the request)."""

    user_id: int | None
    prompt: int | None = None
    key: tuple[int, str] | None = None
    fixed: int = 0  # the tokens the request carries besides its messages (plan.decide)
    old: Plan | None = None
    decided: plan.Carry | plan.Addendum | plan.Trim | plan.Rebuild | None = None


class Layout:
    """Each conversation's plan kept between calls, and the request laid out by it."""

    def __init__(self, store: Store, scanner: Scanner, settings: Settings) -> None:
        self.store = store
        self.scanner = scanner
        self.settings = settings
        self.limits = settings.limits
        # Each conversation's plan: when its frame changes (`perpetuity_core.frame.plan`). Only
        # the preparing thread touches it; a restart costs one rebuilt frame.
        self._plans: OrderedDict[tuple[int, str], Plan] = OrderedDict()
        self._plan_tokens = 0  # their frames' and addenda's, together (PLAN_TOKENS)
        self._deletions: int | None = None  # the memory's deletions when the plans were made
        # The bodies laid out, as JSON: a call writes only what the last ones did not.
        self.written = Written()
        # The frames' messages made before, by their text: a frame that shows what an earlier
        # one did hands the same messages on, whose wire form and JSON are made already.
        self.said = render.Said()

    def _forget_if_purged(self) -> None:
        """No plan is kept past a deletion from the memory: a frame quotes its rows verbatim,
        and what a purge removed must not live on in one (a tool round of a task in progress,
        decided on the loop by `Pipeline.carried`, still carries its frame to the task's next
        prompt). One read of a counter (kept.deletions) a request, off the loop."""
        count = deletions(self.store.db.connection())
        if self._deletions is not None and count != self._deletions:
            self._plans.clear()
            self._plan_tokens = 0
        self._deletions = count

    def planned(self, parsed: ParsedRequest, ident: Identity, asked_at: float,
                tools_on: bool, on_loop: bool = False) -> Planned:
        """What the conversation's plan says of this request (`plan.decide`, pure but for the
        purge check): read on the event loop for a tool round (`on_loop`: the plans are not
        checked against a purge there), whose plan is carried as it stands (`Pipeline.carried`),
        and again where the request is laid out."""
        messages = parsed.messages
        prompt = _prompt_index(messages)
        user_id = self.store.find_user(ident.user)
        if user_id is None or prompt is None:
            return Planned(user_id=user_id)
        # By the conversation's key, not its row: a first request has no row yet.
        key = (user_id, ident.conversation)
        # What the request carries besides its messages and the plan's frame: the harness's
        # system prompt and tools, and our tools with their note on the frame (its longest).
        ours = _OUR_TOOLS_CHARS + len(_tools_note(10**9)) if tools_on else 0
        fixed = (parsed.fixed_chars + ours + 3) // 4  # token_estimate's rule
        if not on_loop:
            self._forget_if_purged()
        old = self._plans.get(key)
        return Planned(user_id=user_id, prompt=prompt, key=key, fixed=fixed, old=old,
                       decided=plan.decide(old, messages, prompt, asked_at, self.limits, fixed))

    def recall(self, body: dict[str, Any], parsed: ParsedRequest, ident: Identity,
               protocol: Protocol, asked_at: float, tools_on: bool, library: Path | None,
               planned: Planned) -> Recall:
        """The request laid out by its conversation's plan (`perpetuity_core.frame.plan`): the
        frame in front, the harness's messages from the anchor on, addenda before the prompts
        they serve; notes when a task starts, and the note on the recall tools when they ride
        along. What changes is `planned`'s to say; this builds and lays out what it said."""
        messages = parsed.messages
        user_id, prompt, key, decided = planned.user_id, planned.prompt, planned.key, planned.decided
        if user_id is None or prompt is None or key is None or decided is None:
            out = self._lesson_only(body, parsed, protocol, library)
            out.memory = self._memory(user_id or NO_ONE, None, asked_at, None,
                                      tools_on and bool(parsed.tool_names))
            return out
        conv = self.store.find_conversation(user_id, ident.conversation)
        query = prompt_text(messages[prompt])
        old, fixed = planned.old, planned.fixed
        match decided:
            case plan.Carry(plan=carried):
                made = _Built(plan=carried)
            case plan.Addendum(plan=carried, keep=keep):
                made = self._add(carried, parsed, prompt, keep, user_id, conv, query, asked_at,
                                 library) or self._rebuilt(parsed, prompt, user_id, conv, query,
                                                           asked_at, library, carried, fixed)
            case plan.Trim(plan=carried):
                made = _Built(plan=self._trim(carried, parsed, prompt, conv, fixed))
            case plan.Rebuild(pace=pace):
                made = self._rebuilt(parsed, prompt, user_id, conv, query, asked_at, library,
                                     replace(old, pace=pace) if old else None, fixed)
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
        # The harness's system messages before the anchor stay, after the frame: the model
        # reads them too, and the token clock steps by what the model reads.
        out.sent_tokens = (messages_tokens(front) + laid_plan.standing_tokens
                           + laid_plan.insert_tokens
                           + messages_tokens(messages[replaced.keep:]) - laid_plan.stubbed)
        try:
            out.body = self.written.dumps(replaced.body)
        except UnicodeEncodeError:  # a lone surrogate kept as sent goes back as its escape
            out.body = self.written.dumps(replaced.body, ascii=True)
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

    def _rebuilt(self, parsed: ParsedRequest, prompt: int, user_id: int, conv: int | None,
                 query: str, asked_at: float, library: Path | None, old: Plan | None,
                 fixed: int) -> _Built:
        """A new frame (`_rebuild`), trimmed when its request would pass the bound; `old`
        the plan it replaces, with the conversation's pace this call counted."""
        made = self._rebuild(parsed, prompt, user_id, conv, query, asked_at, library,
                             old.pace if old else plan.Pace(), old.lean if old else (),
                             old.asked if old else FRESH)
        return replace(made, plan=self._trim(made.plan, parsed, prompt, conv, fixed))

    def _rebuild(self, parsed: ParsedRequest, prompt: int, user_id: int, conv: int | None,
                 query: str, asked_at: float, library: Path | None,
                 pace: plan.Pace, lean: Lean, asked: Asked) -> _Built:
        """A new frame for the prompt, the harness's messages before it dropped (memory holds
        them): an agent's conversation shorter than a frame keeps them all, with other
        conversations' memory in front; a chat keeps its latest exchanges (plan.chat_keep), or
        all of a short history memory has nothing else for. A chat's `lean` (what its earlier
        questions were about, frame.lean) goes on to its next plan with this question's, and
        so does `asked` (when it was about each)."""
        messages = parsed.messages
        agent = bool(parsed.tool_names)
        if agent:
            keep = prompt if plan.longer(messages, prompt, self.limits.ceiling) else 0
        else:
            keep = plan.chat_keep(messages, prompt)
            if messages_tokens(messages[keep:]) + self.limits.ceiling > self.limits.bound:
                keep = prompt  # at the bound the turns before the live task go, as an agent's
        if conv is None:
            keep = 0
        elif new := capture.new_messages(self.store, conv, messages):
            keep = min(keep, new[0])  # what the store does not hold yet is never stripped
        keep = repair.kept_start(messages, keep)  # never a result whose call is dropped
        kept = self.store.message_ids(conv, [m.fingerprint() for m in messages[keep:]]) \
            if conv else []
        # A chat has no latest stretch: its older turns come back as any stored row does.
        recent = self.store.latest_messages(conv, RECENT_STRETCH) if conv and agent else []
        built = frame.build(self.scanner, user_id=user_id, conversation_id=conv, query=query,
                            exclude_messages=kept, asked_at=asked_at, limits=self.limits,
                            recent_messages=recent, kept_tokens=_kept_tokens(messages, keep,
                                                                             prompt, agent),
                            narrow=agent and keep == 0, agent=agent, said=self.said,
                            lean=lean, asked=asked)
        # (A frame sent as it is still found its hits.)
        lean, asked = (built.lean, built.asked) if built else (lean, asked)
        if (built and not agent and keep and _own_only(built, conv)
                and not plan.longer(messages, prompt, self.limits.ceiling)):
            # A short chat that memory has nothing else for is sent as it is, as before: a frame
            # of its own older turns would rewrite, at every prompt, what the provider's cache
            # holds (LoCoMo's chat replay: docs/tuning.md).
            built = None
        front, notes_shown = self._with_notes(built.messages if built else [], parsed, library)
        if not built:
            keep = 0  # nothing to stand in for the history
        rebuilt = Plan(
            frame=tuple(front), frame_tokens=messages_tokens(front),
            anchor=plan.mark(messages, keep), prompt=plan.mark(messages, prompt), at=asked_at,
            standing_tokens=messages_tokens(m for m in messages[:keep] if m.role == "system"),
            shown=frozenset(built.item_ids if built else ()),
            below_cap=tuple(built.below_cap if built else ()),
            left_out=built.left_out if built else 0,
            rule=plan.rule_for(parsed.protocol, parsed.model), pace=pace,
            agent=agent, lean=lean, asked=asked)
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
             conv: int | None, query: str, asked_at: float, library: Path | None
             ) -> _Built | None:
        """An addendum for a new prompt under a frame that stays: its hits in other
        conversations not yet in front (a chat's; an agent's prompt gets its notes alone); None
        when a new frame costs no more (`plan.outweighs`). Nothing before a prompt that answers
        a call (an interrupted tool call's result rides with the next prompt): it would part the
        call from its result."""
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
            exclude_messages=kept, shown=carried.shown, asked_at=asked_at, limits=self.limits,
            kept_tokens=_kept_tokens(messages, plan.chat_keep(messages, prompt), prompt, False),
            said=self.said)
        if more is not None and plan.outweighs(carried, messages_tokens(more.messages),
                                               messages_tokens(messages[keep:prompt])
                                               + carried.insert_tokens, more.budget):
            return None  # as costly as a new frame, which drops what later calls re-read
        added, notes_shown = self._with_notes(more.messages if more else [], parsed, library)
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
            out.body = mend.dumps(ADAPTERS[protocol].replace_history(
                body, frame.with_note([], lesson.text), parsed.raw_index[0]))
        return out

    def remember(self, key: tuple[int, str], laid: Plan) -> None:
        if (old := self._plans.pop(key, None)) is not None:
            self._plan_tokens -= _held(old)
        self._plans[key] = laid
        self._plan_tokens += _held(laid)
        while len(self._plans) > 1 and (len(self._plans) > PLANS
                                        or self._plan_tokens > PLAN_TOKENS):
            self._plan_tokens -= _held(self._plans.popitem(last=False)[1])

    def _with_notes(self, front: list[Message], parsed: ParsedRequest,
                    library: Path | None) -> tuple[list[Message], list[str]]:
        """`front` with the notes recalled for a task's first prompt, and their names."""
        if starts_task(parsed.messages) and (lesson := self._notes_for(parsed, library)):
            return frame.with_note(front, lesson.text), lesson.names
        return front, []

    def _notes_for(self, parsed: ParsedRequest, root: Path | None) -> notes.RecallResult | None:
        """Notes recall for a task's first prompt, from the tenant's own library `root`; a
        library that cannot be read is skipped."""
        if root is None or not (root / notes.NOTES_DIR).is_dir():
            return None
        try:
            return notes.recall(root, last_user_text(parsed.messages))
        except (PerpetuityError, OSError) as e:
            log.warning("perpetuity: notes recall skipped: %s", e)
            return None


def _sent_whole(messages: list[Message], stubs: tuple[plan.Stub, ...]) -> list[Message]:
    """The messages the model reads as the harness sent them: a tool result sent as a stub is
    not in front of the model (memory_more gives it back)."""
    stubbed = {call_id for call_id, _ in stubs}
    if not stubbed:
        return messages
    return [m for m in messages if not any(p.call_id in stubbed for p in m.parts)]


def _own_only(built: Frame, conv: int | None) -> bool:
    """Does the frame show only rows of conversation `conv` (the one it is built for)?"""
    return all(r.conversation_id == conv for i in built.item_ids
               if (r := built.rows.get(i)) is not None)


def _kept_tokens(messages: list[Message], keep: int, prompt: int, agent: bool) -> int:
    """What the budget pays for of the messages kept as sent: an agent's turns before its
    prompt; a chat's turns and its prompt, the room its request has left (frame_select.budget),
    its system messages aside (the harness's instructions, as an agent's system prompt is)."""
    if agent:
        return messages_tokens(messages[keep:prompt])
    return messages_tokens(m for m in messages[keep:] if m.role != "system")


def _held(laid: Plan) -> int:
    """The tokens a kept plan holds: its frame's and its addenda's."""
    return laid.frame_tokens + laid.insert_tokens


def _tools_note(left_out: int) -> str:
    left = f" {left_out} more were left out of this frame." if left_out else ""
    return f"[{tools.INSTRUCTIONS}{left}]"


def starts_task(messages: list[Message]) -> bool:
    """A new prompt from the person, not a round of tool results."""
    return bool(messages) and is_prompt(messages[-1])


def _prompt_index(messages: list[Message]) -> int | None:
    """The person's latest prompt: where the live task begins."""
    return next((i for i in range(len(messages) - 1, -1, -1) if is_prompt(messages[i])), None)


def last_user_text(messages: list[Message]) -> str:
    """What the person last said: the query, and the command check."""
    return next((text for m in reversed(messages) if (text := prompt_text(m))), "")
