"""When the frame changes: one plan per conversation, so that the provider's prompt cache holds.

Providers bill a request by exact prefix. Anthropic reads a cached prefix at 0.1 of the input
price and writes one at 1.25; OpenAI reads at a tenth to a half and writes at 1, Gemini at a
tenth and 1 (its table in wire.protocols.gemini; a plan is weighed by its provider's rule,
`rule_for`). A harness that
re-sends its whole history pays 0.1 a token for it, and 1.25 only for what is new. Anything we
change early in a request is written again at 1.25, with everything after it. So the request
that goes upstream is

    frame · the harness's messages from the anchor on, addenda before the prompts they serve

and it changes in only three ways:

- Within one task (a person's prompt and every tool round after it) nothing changes but what
  the harness appends: the frame chosen at the prompt is re-sent byte-identical, the live task
  is never cut or reordered. The request only grows at its end, as the harness's own does, and
  no frame is built (the scan runs once a prompt, not once a call).
- A chat's new prompt whose ranking is not all in front of the model gets an addendum: its hits
  in rank order within the budget a new frame would have, those in front counted but not sent
  again, inserted just before the prompt. That is still growth at the end (written once at
  1.25, read at 0.1 after), so the frame in front stays cached; but an addendum that with what
  keeping re-reads costs a new frame's write (a change of subject, `outweighs`) is a new frame.
- A rebuild: a new frame for the prompt, and the harness's messages before it dropped (memory
  holds them). It writes the new frame once (1.25 F); keeping instead re-reads, on every later
  call, the turns accumulated since the last rebuild (0.1 K a call, K growing). A cost that
  grows by 0.1 K per call against a one-time 1.25 F is the ski-rental problem: rebuilding when
  the re-read cost paid since the last rebuild reaches the write cost of a frame is within a
  factor of two of the best schedule whatever the future holds (and, for K growing linearly,
  it is the best periodic schedule: rebuild every sqrt(25 F / g) calls for growth g a call).
  So a plan rebuilds at a prompt when `excess`, the 0.1 K paid since its frame was built,
  reaches 1.25 F, F the largest frame (`Cap.ceiling`); and it always rebuilds when the cache
  has expired (no call within `TTL`), when keeping would be written again in full anyway, if
  what it drops is larger than a frame.
  A frame can only change at a prompt, though, and what is kept there is re-read on every call
  of the task it starts: a coding task is tens of calls (tool rounds), not one. So the re-read
  cost a prompt counts is the one its task is expected to pay, 0.1 K times the calls a task of
  this conversation has taken so far (`Pace`): on the six shared Claude Code sessions one kept
  a 20k-token task under a 37-call task, 0.1 K a call, since one call's 0.1 K was below 1.25 F.

A request never passes `Cap.bound` (150k tokens, everything in it): a harness whose context is
framed never compacts, and a long task has no prompt to rebuild at, so a request about to pass
the bound is rebuilt mid-task, the turns before the live task dropped (memory holds them). When
the live task alone is too large, its oldest tool results go as short stubs naming the stored
row that `memory_more` reads (Anthropic's context editing, but recallable): a `Trim`, the frame
kept. Its prompt and its last `LAST_ROUNDS` rounds are never cut. Each of these rewrites the
cache from the first change on, so it happens only at the bound, and a trim frees `HEADROOM`
more than it must, so that the calls after it grow at their end again before the next.

An agent's conversation whose history is shorter than a frame is never replaced at all: it gets
a frame of other conversations' memory in front, its own turns kept as sent, until its history
outgrows the frame. A chat (a client that sends no tools of its own) keeps as sent only its
latest exchange, whatever its length, and the exchanges before it within `CHAT_KEPT` tokens
(`chat_keep`: the turns a follow-up leans on); memory holds the rest, and the frame is sized to
the room that leaves in the request (frame.select.budget). While its history is shorter than a
frame, each prompt gets a new frame: what that rewrites after the frame is the short history,
about what an addendum would cost, and the frame then holds what this prompt needs, not what
earlier ones did. An agent's prompts get addenda instead: a new frame rewrote the frame and the
history after it at every prompt, 1.1 to 1.4 times the direct cost of a new Claude Code
session's first calls.

Plans live in memory, on the thread that prepares requests; after a restart the next call
rebuilds once. A plan whose anchor or addenda no longer appear in what the harness sends
(compaction, an edited history, another branch) is dropped and rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from perpetuity_core.frame.cap import Cap
from perpetuity_core.frame.lean import FRESH, Asked, Lean
from perpetuity_core.frame.select import RECENT_TOKENS
from perpetuity_core.memory.derived.index import messages_tokens, token_estimate
from perpetuity_core.wire.conversation import Kind, Message, Protocol, is_prompt
from perpetuity_core.wire.protocols import gemini
from perpetuity_core.wire.protocols.base import CacheRule

# The provider's cache, as the plan (and the replay's bill, cli/replay/billing.py) prices it.
TTL = 300.0  # seconds: Anthropic's default cache lifetime, refreshed on use
READ, WRITE = 0.1, 1.25  # cache read and write prices, in units of an uncached input token
ANTHROPIC = CacheRule(1_024, READ, WRITE, TTL)  # the rule a plan is weighed by unless told


def rule_for(protocol: Protocol, model: str) -> CacheRule:
    """The cache rule a conversation's plan is weighed by: Gemini's implicit cache writes at no
    surcharge (so a rebuild is cheaper there), the others as Anthropic's explicit one."""
    return gemini.cache_rule(model) if protocol == Protocol.GEMINI else ANTHROPIC


Mark = tuple[int, str]  # a message's index in the request and its fingerprint
Stub = tuple[str, str]  # a tool call's id, and the text its result is sent as
LAST_ROUNDS = 4  # a live task's latest tool rounds, never stubbed
HEADROOM = 8  # a trim frees a further 1/HEADROOM of the bound
# A chat keeps as sent its latest exchange whatever its length, and the exchanges before it
# while all it keeps fits in CHAT_KEPT tokens: the turns a follow-up leans on (`chat_keep`).
CHAT_KEPT = 200
# What the provider counts for an image or a document the text estimate sees as a short label:
# an image near Anthropic's 1.15-megapixel cap, (w*h)/750 (the replay's bill counts the same).
MEDIA_TOKENS = 1_600


@dataclass(frozen=True, slots=True)
class Pace:
    """How a conversation's tasks have run so far: its calls and its prompts, this one
    counted."""

    calls: int = 1
    prompts: int = 1

    def then(self, prompt: bool) -> Pace:
        """The pace after one more call, a new prompt's or a tool round's."""
        return Pace(self.calls + 1, self.prompts + prompt)

    @property
    def per_task(self) -> float:
        return self.calls / self.prompts


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One conversation's request plan, kept between calls."""

    frame: tuple[Message, ...]  # the frame in front, as sent (empty: none)
    frame_tokens: int
    # Messages are named by (index, fingerprint): a harness only appends, so a message keeps
    # its index, and the fingerprint proves it is still the same one.
    anchor: Mark  # the first harness message kept as sent
    prompt: Mark  # the prompt of the task in progress
    at: float  # the last call's time: the cache lives TTL seconds from its last use
    # Addenda, each before the prompt it was built for.
    inserts: tuple[tuple[Mark, tuple[Message, ...]], ...] = ()
    insert_tokens: int = 0
    shown: frozenset[int] = frozenset()  # item ids the frame and the addenda show
    below_cap: tuple[int, ...] = ()  # the frame's hits left out, best first (memory_more)
    left_out: int = 0  # warm rows the frame's cap left out
    excess: float = 0.0  # re-read cost paid since the frame was built for what a rebuild drops
    rule: CacheRule = ANTHROPIC  # the provider's cache prices (`rule_for`)
    # The harness's system-role messages before the anchor: they stay, after the frame.
    standing_tokens: int = 0
    stubs: tuple[Stub, ...] = ()  # the live task's tool results sent as stubs, oldest first
    stubbed: int = 0  # tokens the stubs save
    pace: Pace = Pace()
    agent: bool = False  # the harness sends tools of its own (a chat client sends none)
    tools: bool = False  # the recall tools rode along: they do on every later call
    lean: Lean = ()  # a chat's: what its questions were about (frame.lean)
    asked: Asked = FRESH  # a chat's: when it was about each (frame.lean)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where a plan's parts go in this request's messages."""

    keep: int  # index of the anchor: the first message kept as sent
    inserts: dict[int, tuple[Message, ...]]  # message index -> addendum before it


def mark(messages: list[Message], i: int) -> Mark:
    return (i, messages[i].fingerprint())


def holds(messages: list[Message], m: Mark) -> bool:
    """Is the marked message still where it was?"""
    return m[0] < len(messages) and messages[m[0]].fingerprint() == m[1]


def place(plan: Plan, messages: list[Message]) -> Placement | None:
    """The plan laid over this request's messages, or None when its anchor or an addendum's
    prompt is no longer where it was (the history changed under it: a compaction, an edit)."""
    marks = [plan.anchor, *(m for m, _ in plan.inserts)]
    if not all(holds(messages, m) for m in marks):
        return None
    return Placement(keep=plan.anchor[0], inserts={m[0]: added for m, added in plan.inserts})


def should_rebuild(plan: Plan, kept_tokens: int, at: float, frame_size: int) -> bool:
    """At a new prompt: is a new frame cheaper than keeping what accumulated since the last
    one (`kept_tokens`: the harness's turns before the prompt and the addenda)?"""
    if plan.agent and kept_tokens <= frame_size < RECENT_TOKENS:
        # An agent's frame shorter than a full latest stretch grows, when rebuilt, by up to what
        # the rebuild drops: it would not shrink the request. One as long as a full stretch is
        # replaced by one about as long (the conversation only grew), so all it drops is saved.
        # A chat's is sized to the room its request has (frame.select.budget), never larger.
        return False
    if at - plan.at > plan.rule.ttl:
        return True  # the cache has expired: keeping is written again in full anyway
    task = plan.rule.read * kept_tokens * plan.pace.then(True).per_task
    return plan.excess + task >= plan.rule.write * frame_size


def outweighs(plan: Plan, added: int, kept_tokens: int, frame_size: int) -> bool:
    """A chat's addendum of `added` tokens, written at the cache's write price, and what keeping
    re-reads on this call (the frame and the `kept_tokens` after it): do they cost as much as a
    new frame of `frame_size` written instead? Then the new frame: it costs no more now, and
    drops what every later call would re-read (a chat's call is its task: `Pace`)."""
    r = plan.rule
    return r.write * added + r.read * (plan.frame_tokens + kept_tokens) >= r.write * frame_size


def carried(plan: Plan, dropped_tokens: int, at: float, prompt: Mark) -> Plan:
    """The plan after one more call that keeps it: what a rebuild would have dropped was
    re-read once more."""
    return replace(plan, at=at, prompt=prompt,
                   excess=plan.excess + plan.rule.read * dropped_tokens,
                   pace=plan.pace.then(prompt != plan.prompt))


def with_addendum(plan: Plan, prompt: Mark, messages: list[Message], tokens: int,
                  items: list[int]) -> Plan:
    return replace(plan, inserts=(*plan.inserts, (prompt, tuple(messages))),
                   insert_tokens=plan.insert_tokens + tokens, shown=plan.shown | set(items))


@dataclass(frozen=True, slots=True, kw_only=True)
class Carry:
    """Keep the plan as it is: the frame and addenda re-sent byte-identical."""

    plan: Plan  # the plan after this call (`carried`)


@dataclass(frozen=True, slots=True, kw_only=True)
class Addendum:
    """Keep the frame and add, before the new prompt, its hits not yet in front (when it has
    any: the caller builds it)."""

    plan: Plan  # the plan after this call, before the addendum (`carried`)
    keep: int  # the first harness message kept as sent


@dataclass(frozen=True, slots=True, kw_only=True)
class Trim:
    """The request is about to pass the bound with nothing before its live task left to drop:
    the frame stays, more of the live task's oldest tool results become stubs (`trimmed`)."""

    plan: Plan  # the plan after this call, before the new stubs (`carried`)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rebuild:
    """A new frame for the prompt."""

    pace: Pace = Pace()  # the conversation's, this call counted (the new plan carries it)


def size(plan: Plan, messages: list[Message], keep: int, fixed: int) -> int:
    """The tokens of the request as `plan` lays it out from message `keep` on, `fixed` those of
    what the harness sends besides its messages (its system prompt, its tools). The system-role
    messages before `keep` go too (`standing_tokens`): the shared sessions chained, a bound of
    40k, sent 41.4k where they were left out (1.5k of Claude Code's agent lists)."""
    kept = messages[keep:]
    media = sum(1 for m in kept for p in m.parts if p.kind == Kind.MEDIA)
    return (fixed + plan.frame_tokens + plan.insert_tokens + plan.standing_tokens
            + messages_tokens(kept) + MEDIA_TOKENS * media - plan.stubbed)


def trimmed(plan: Plan, messages: list[Message], keep: int, prompt: int, fixed: int,
            limits: Cap, stubs: dict[str, str]) -> Plan:
    """`plan` with the live task's oldest tool results as stubs until its request is within
    the bound, HEADROOM under it (none when it is already); `stubs` holds each tool result
    that may go as a stub (stored, so memory can give it back) with its stub's text. Never the
    prompt's own message, nor the last LAST_ROUNDS rounds."""
    over = size(plan, messages, keep, fixed) - limits.bound
    if over <= 0:
        return plan
    need = plan.stubbed + over + limits.bound // HEADROOM  # what all the stubs must save
    chosen, saved = list(plan.stubs), plan.stubbed
    done = {call_id for call_id, _ in chosen}
    for m in messages[max(keep, prompt + 1):max(prompt + 1, len(messages) - 2 * LAST_ROUNDS)]:
        for p in m.parts:
            if saved >= need:
                break
            text = stubs.get(p.call_id) if p.kind == Kind.TOOL_RESULT else None
            gain = messages_tokens([Message(m.role, (p,))]) - token_estimate(text or "")
            if text is not None and p.call_id not in done and gain > 0:
                chosen.append((p.call_id, text))
                done.add(p.call_id)
                saved += gain
    return replace(plan, stubs=tuple(chosen), stubbed=saved)


def longer(messages: list[Message], end: int, tokens: int) -> bool:
    """messages_tokens(messages[:end]) > tokens, summed from `end` back until it is: a late
    prompt's history is far over a frame's ceiling, and summing all of it made every rebuild
    grow with the session."""
    total = 0
    for i in range(end - 1, -1, -1):
        total += messages_tokens((messages[i],))
        if total > tokens:
            return True
    return False


def chat_keep(messages: list[Message], prompt: int, tokens: int = CHAT_KEPT) -> int:
    """Where a chat's request starts: at its latest exchange (the person's message before
    `prompt` and what answered it, whatever its length), or at an earlier person's message while
    everything from there to the prompt fits in `tokens`. Memory holds the turns before it, and
    a frame brings them back when the prompt needs them. Always a person's message (a kept part
    opening with a reply went back to the whole history: repair.kept_start); 0 without one."""
    keep, used = prompt, 0
    for i in range(prompt - 1, -1, -1):
        used += messages_tokens((messages[i],))
        if messages[i].role == "user" and is_prompt(messages[i]):  # an exchange opens here
            if keep < prompt and used > tokens:
                break
            keep = i
    return keep if keep < prompt else 0


def decide(old: Plan | None, messages: list[Message], prompt: int, at: float,
           limits: Cap, fixed: int = 0) -> Carry | Addendum | Trim | Rebuild:
    """What this request does with its conversation's plan `old` (None: no plan yet, or it was
    forgotten), `prompt` the index of the person's latest prompt in `messages`, `at` the time it
    was asked, `fixed` the tokens of what it carries besides its messages. Pure: the caller
    builds what it says and acts on it."""
    if old is None:
        return Rebuild()  # none yet, or forgotten
    here = mark(messages, prompt)
    pace = old.pace.then(here != old.prompt)
    placed = place(old, messages)
    if placed is None:
        return Rebuild(pace=pace)  # the history changed under it
    before = messages_tokens(messages[placed.keep:prompt])
    kept = before + old.insert_tokens
    # Short: the history before the prompt fits a frame. An agent's plan anchored past the first
    # message was built when its history did not, and histories only grow; so only an anchor at
    # 0 (what is before the prompt is all kept) needs counting, and `before` is that count. A
    # chat's keeps its latest exchanges only (`chat_keep`): its history is walked back from the
    # prompt until it is over a frame (`longer`), never over the whole of a long one.
    if placed.keep == 0 or old.agent:
        short = placed.keep == 0 and before <= limits.ceiling
    else:
        short = not longer(messages, prompt, limits.ceiling)
    drops = 0 if short else kept  # a short conversation's rebuild keeps all of it
    grows = 0 if here == old.prompt else limits.ceiling  # a new prompt may get an addendum
    if size(old, messages, placed.keep, fixed) + grows > limits.bound:
        # About to pass the bound, mid-task too: the turns before the live task go (memory
        # holds them) when there are any worth a frame; else the live task is trimmed.
        if kept - old.insert_tokens > limits.ceiling:
            return Rebuild(pace=pace)
        return Trim(plan=carried(old, drops, at, here))
    if here == old.prompt:  # a tool round of the task in progress
        return Carry(plan=carried(old, drops, at, here))
    if short and not old.agent:
        # A short chat: a new frame rewrites only the short history after it, about what an
        # addendum would cost, and leaves out what earlier prompts needed (LoCoMo's questions
        # asked in sequence: 0.854 of them with their evidence when only a new subject got a
        # new frame, 0.864 so).
        return Rebuild(pace=pace)
    # An agent's short conversation: a rebuild would keep all of it, written again after a new
    # frame, and save no re-read (a chat's, above, gets a new frame for what its prompt needs).
    fresh = at - old.at <= old.rule.ttl
    if not (short and fresh) and should_rebuild(old, kept, at,
                                                max(old.frame_tokens, limits.floor)):
        return Rebuild(pace=pace)
    return Addendum(plan=carried(old, drops, at, here), keep=placed.keep)
