"""What a request costs once the provider's prompt cache has done its work: the rules both
`perpetuity replay` and the proxy's live tally (serve/tally.py) bill by. The prompt's blocks
are made in frame/blocks.py; a bill's money, at the model's list price, in frame/prices.py.

Costs are in units of one uncached input token. Tokens are counted with the one estimator the
rest of the package uses (`memory.index.token_estimate`), on the direct request and on the one the proxy
sent alike, so the ratio between the two is what the estimator cannot bias.

Anthropic (explicit marks). The prompt is a prefix of blocks: every tool, then the system
blocks, then each message's content blocks. A cache entry is written only at a block that
carries `cache_control` (at most four per request); a lookup at a mark also tries the 20 blocks
before it, and the longest prefix found is read. Nothing shorter than the model's minimum is
cached. An entry lives 5 minutes from its last use, 1 hour where its mark says `ttl: 1h`.
Prices: read 0.1, written 1.25 (2.0 for a 1-hour entry), the rest 1.0.

OpenAI (automatic). Every request of 1,024 tokens or more caches its prefix; a later request
reads the longest prefix it shares with one still cached, in steps of 128 tokens past the first
1,024, at a read price that depends on the model family; entries live 5 minutes from last use.

Gemini (implicit). The same automatic prefix cache, its prefix the system instruction, the tools
and each content whole, read to the token, from a minimum size and at a read price by model
(`wire.protocols.gemini.IMPLICIT_CACHE`); writing costs nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perpetuity_core.frame.blocks import (
    TTL_1H,
    Block,
    Blocks,
    Prompt,
    anthropic_groups,
    gemini_groups,
    openai_groups,
)
from perpetuity_core.frame.plan import READ, TTL, WRITE
from perpetuity_core.wire.protocols import gemini

# The cache the plan prices (frame/plan.py: READ, a 5-minute WRITE, TTL), and the 1-hour entry
# a harness's own mark may ask for (blocks.TTL_1H), which only the bill meets.
WRITE_1H = 2.0
LOOKBACK = 20  # blocks before a mark where Anthropic still finds a cached prefix
SWEEP_EVERY = 256  # bodies between two sweeps of a cache's expired entries (a proxy runs for days)

# The smallest prefix Anthropic caches, by model family (the longest family name the model's
# name starts with; Anthropic's prompt-caching documentation); any other model: 1,024.
ANTHROPIC_MIN_TOKENS = {
    "claude-opus-4-5": 4_096, "claude-opus-4-6": 4_096, "claude-haiku-4-5": 4_096,
    "claude-3-5-haiku": 2_048, "claude-3-haiku": 2_048, "claude-haiku-3": 2_048,
}
# OpenAI's cached-input price as a share of its input price, by model family.
OPENAI_READ_PRICE = {
    "gpt-5": 0.1, "gpt-4.1": 0.25, "o3": 0.25, "o4": 0.25, "gpt-4o": 0.5, "o1": 0.5,
}  # anything else: 0.5
OPENAI_MIN_TOKENS, OPENAI_STEP = 1_024, 128


def _family(table: dict[str, Any], model: str, default: Any) -> Any:
    """The entry of the longest family name the model's name starts with."""
    name = model.lower()
    best = max((k for k in table if name.startswith(k)), key=len, default=None)
    return default if best is None else table[best]


def anthropic_min_tokens(model: str) -> int:
    return int(_family(ANTHROPIC_MIN_TOKENS, model, 1_024))


def openai_read_price(model: str) -> float:
    return float(_family(OPENAI_READ_PRICE, model, 0.5))


@dataclass(slots=True)
class Bill:
    """One request's input, split by how the provider charged it (tokens and cost units)."""

    tokens: int = 0
    read: int = 0
    written: int = 0
    uncached: int = 0
    read_cost: float = 0.0
    write_cost: float = 0.0
    uncached_cost: float = 0.0

    @property
    def cost(self) -> float:
        return self.read_cost + self.write_cost + self.uncached_cost

    def add(self, other: Bill) -> None:
        for name in ("tokens", "read", "written", "uncached", "read_cost", "write_cost",
                     "uncached_cost"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float]:
        return {"tokens": self.tokens, "cost": round(self.cost, 1),
                "read_cost": round(self.read_cost, 1), "write_cost": round(self.write_cost, 1),
                "uncached_cost": round(self.uncached_cost, 1), "read_tokens": self.read,
                "written_tokens": self.written, "uncached_tokens": self.uncached}


def anthropic_blocks(body: dict[str, Any], blocks: Blocks | None = None) -> list[Block]:
    return (blocks or Blocks()).chain(anthropic_groups(body)).blocks


def openai_blocks(body: dict[str, Any], blocks: Blocks | None = None) -> list[Block]:
    return (blocks or Blocks()).chain(openai_groups(body)).blocks


def gemini_blocks(body: dict[str, Any], blocks: Blocks | None = None) -> list[Block]:
    return (blocks or Blocks()).chain(gemini_groups(body)).blocks


def shared_prefix(entries: dict[bytes, float], prompt: Prompt, at: float) -> tuple[int, int]:
    """An automatic prefix cache's view of a request (OpenAI's, Gemini's): its tokens, and
    those of the longest prefix still cached at `at`. Every request writes all its prefixes,
    so a shorter prefix lives at least as long as a longer one: the last found is the longest."""
    for i in range(len(prompt.blocks) - 1, -1, -1):
        if entries.get(prompt.blocks[i].key, -1.0) >= at:
            return prompt.tokens, prompt.ends[i]
    return prompt.tokens, 0


def _unexpired(entries: dict[bytes, float], blocks: Blocks, at: float) -> dict[bytes, float]:
    """An automatic cache's entries, those expired at `at` dropped every SWEEP_EVERY bodies."""
    if blocks.calls % SWEEP_EVERY:
        return entries
    return {k: expires for k, expires in entries.items() if expires >= at}


@dataclass(slots=True)
class _Entry:
    expires: float
    ttl: float


@dataclass(slots=True)
class AnthropicCache:
    """One organisation's Anthropic prompt cache, billed request by request in time order."""

    entries: dict[bytes, _Entry] = field(default_factory=dict)
    blocks: Blocks = field(default_factory=Blocks)

    def bill(self, body: dict[str, Any], at: float) -> Bill:
        if self.blocks.calls % SWEEP_EVERY == 0:
            self.entries = {k: e for k, e in self.entries.items() if e.expires >= at}
        return self.bill_prompt(self.blocks.chain(anthropic_groups(body)), at,
                                str(body.get("model", "")))

    def bill_blocks(self, blocks: list[Block], at: float, model: str) -> Bill:
        return self.bill_prompt(Prompt.of(blocks), at, model)

    def bill_prompt(self, prompt: Prompt, at: float, model: str) -> Bill:
        blocks, ends, marks = prompt.blocks, prompt.ends, prompt.marks
        hit = -1
        for m in marks:
            for j in range(m, max(-1, m - LOOKBACK - 1), -1):
                entry = self.entries.get(blocks[j].key)
                if entry is not None and entry.expires >= at:
                    hit = max(hit, j)
                    break
        read = ends[hit] if hit >= 0 else 0
        if hit >= 0:
            entry = self.entries[blocks[hit].key]
            entry.expires = max(entry.expires, at + entry.ttl)
        minimum = anthropic_min_tokens(model)
        bill = Bill(tokens=prompt.tokens, read=read, read_cost=READ * read)
        covered = read
        for m in marks:
            if ends[m] < minimum:
                continue
            if ends[m] > covered:  # the stretch since the last cached point, written here
                price = WRITE_1H if blocks[m].ttl == TTL_1H else WRITE
                bill.written += ends[m] - covered
                bill.write_cost += price * (ends[m] - covered)
                covered = ends[m]
            old = self.entries.get(blocks[m].key)
            ttl = max(blocks[m].ttl, old.ttl if old and old.expires >= at else 0.0)
            self.entries[blocks[m].key] = _Entry(at + ttl, ttl)
        bill.uncached = prompt.tokens - covered
        bill.uncached_cost = float(bill.uncached)
        return bill


@dataclass(slots=True)
class OpenAICache:
    """OpenAI's automatic prefix cache: each request reads what it shares with a cached one."""

    entries: dict[bytes, float] = field(default_factory=dict)  # prefix key -> expiry
    blocks: Blocks = field(default_factory=Blocks)

    def bill(self, body: dict[str, Any], at: float) -> Bill:
        self.entries = _unexpired(self.entries, self.blocks, at)
        return self.bill_prompt(self.blocks.chain(openai_groups(body)), at,
                                str(body.get("model", "")))

    def bill_blocks(self, blocks: list[Block], at: float, model: str) -> Bill:
        return self.bill_prompt(Prompt.of(blocks), at, model)

    def bill_prompt(self, prompt: Prompt, at: float, model: str) -> Bill:
        total, shared = shared_prefix(self.entries, prompt, at)
        read = 0
        if shared >= OPENAI_MIN_TOKENS:
            read = OPENAI_MIN_TOKENS + (shared - OPENAI_MIN_TOKENS) // OPENAI_STEP * OPENAI_STEP
        if total >= OPENAI_MIN_TOKENS:
            self.entries.update(dict.fromkeys((b.key for b in prompt.blocks), at + TTL))
        price = openai_read_price(model)
        return Bill(tokens=total, read=read, uncached=total - read, read_cost=price * read,
                    uncached_cost=float(total - read))


@dataclass(slots=True)
class GeminiCache:
    """Gemini's implicit prefix cache: each request reads, to the token, the longest prefix it
    shares with a cached one, when that is at least the model's minimum."""

    entries: dict[bytes, float] = field(default_factory=dict)  # prefix key -> expiry
    blocks: Blocks = field(default_factory=Blocks)

    def bill(self, body: dict[str, Any], at: float, model: str) -> Bill:
        """`model`: the path names it (Code Assist's body too)."""
        self.entries = _unexpired(self.entries, self.blocks, at)
        return self.bill_prompt(self.blocks.chain(gemini_groups(body)), at,
                                model or str(body.get("model", "")))

    def bill_blocks(self, blocks: list[Block], at: float, model: str) -> Bill:
        return self.bill_prompt(Prompt.of(blocks), at, model)

    def bill_prompt(self, prompt: Prompt, at: float, model: str) -> Bill:
        rule = gemini.cache_rule(model)
        total, shared = shared_prefix(self.entries, prompt, at)
        read = shared if shared >= rule.min_tokens else 0
        if total >= rule.min_tokens:
            self.entries.update(dict.fromkeys((b.key for b in prompt.blocks), at + rule.ttl))
        return Bill(tokens=total, read=read, uncached=total - read, read_cost=rule.read * read,
                    uncached_cost=float(total - read))
