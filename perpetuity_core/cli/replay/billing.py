"""What a request costs once the provider's prompt cache has done its work.

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

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from perpetuity_core.frame.plan import READ, TTL, WRITE
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.wire.protocols import gemini

# The cache the plan prices (frame/plan.py: READ, a 5-minute WRITE, TTL), and the 1-hour entry
# a harness's own mark may ask for, which only the bill meets.
WRITE_1H, TTL_1H = 2.0, 3600.0
LOOKBACK = 20  # blocks before a mark where Anthropic still finds a cached prefix
IMAGE_TOKENS = 1_600  # an image near Anthropic's 1.15-megapixel cap: (w*h)/750

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


@dataclass(frozen=True, slots=True)
class Block:
    """One cacheable unit of the prompt: its identity, its tokens, its mark's lifetime (0: none)."""

    key: bytes
    tokens: int
    ttl: float = 0.0


def block_text(block: Any) -> str:
    """What a content block costs to read, as text: the words of text and thinking, a tool
    call's name and arguments, a tool result's content."""
    if isinstance(block, str):
        return block
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "thinking":
        return str(block.get("thinking", ""))
    if kind in ("tool_use", "server_tool_use"):
        return str(block.get("name", "")) + json.dumps(block.get("input"), ensure_ascii=False)
    if kind == "tool_result":
        content = block.get("content")
        if isinstance(content, list):
            return "\n".join(block_text(b) for b in content)
        return str(content or "")
    if kind in ("image", "document", "redacted_thinking"):
        return ""
    return json.dumps(_unmarked(block), ensure_ascii=False, sort_keys=True)


def block_tokens(block: Any) -> int:
    images = 0
    if isinstance(block, dict):
        inner = block.get("content") if block.get("type") == "tool_result" else [block]
        images = sum(1 for b in inner if isinstance(b, dict) and b.get("type") == "image") \
            if isinstance(inner, list) else 0
    return token_estimate(block_text(block)) + IMAGE_TOKENS * images


def _unmarked(block: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if k != "cache_control"}


def _ttl(block: Any) -> float:
    mark = block.get("cache_control") if isinstance(block, dict) else None
    if not isinstance(mark, dict):
        return 0.0
    return TTL_1H if mark.get("ttl") == "1h" else TTL


def anthropic_blocks(body: dict[str, Any]) -> list[Block]:
    """The prompt as Anthropic caches it: tools, system, then messages, block by block. Each
    key digests the whole prefix up to that block, so equal keys mean equal prefixes."""
    units: list[tuple[str, Any, int]] = []  # (where, block, tokens)
    for tool in body.get("tools") or []:
        units.append(("tool", tool, token_estimate(json.dumps(_unmarked(tool) if isinstance(
            tool, dict) else tool, ensure_ascii=False))))
    system = body.get("system")
    for b in [{"type": "text", "text": system}] if isinstance(system, str) else system or []:
        units.append(("system", b, block_tokens(b)))
    for n, m in enumerate(body.get("messages") or []):
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for i, b in enumerate(blocks):
            units.append((f"{n}:{i}:{m.get('role')}", b, block_tokens(b)))
    return _chain(units)


def shared_prefix(entries: dict[bytes, float], blocks: list[Block], at: float) -> tuple[int, int]:
    """An automatic prefix cache's view of a request (OpenAI's, Gemini's): its tokens, and
    those of the longest prefix still cached at `at`."""
    ends, total = [], 0
    for b in blocks:
        total += b.tokens
        ends.append(total)
    return total, max((ends[i] for i, b in enumerate(blocks) if entries.get(b.key, -1.0) >= at),
                      default=0)


def _chain(units: list[tuple[str, Any, int]]) -> list[Block]:
    h = hashlib.blake2b(digest_size=16)
    out = []
    for where, b, tokens in units:
        raw = _unmarked(b) if isinstance(b, dict) else b
        h.update(where.encode() + b"\x00" + json.dumps(raw, sort_keys=True).encode() + b"\x01")
        out.append(Block(h.copy().digest(), tokens, _ttl(b)))
    return out


@dataclass(slots=True)
class _Entry:
    expires: float
    ttl: float


@dataclass(slots=True)
class AnthropicCache:
    """One organisation's Anthropic prompt cache, billed request by request in time order."""

    entries: dict[bytes, _Entry] = field(default_factory=dict)

    def bill(self, body: dict[str, Any], at: float) -> Bill:
        return self.bill_blocks(anthropic_blocks(body), at, str(body.get("model", "")))

    def bill_blocks(self, blocks: list[Block], at: float, model: str) -> Bill:
        ends, total = [], 0
        for b in blocks:
            total += b.tokens
            ends.append(total)
        marks = [i for i, b in enumerate(blocks) if b.ttl]
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
        bill = Bill(tokens=total, read=read, read_cost=READ * read)
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
        bill.uncached = total - covered
        bill.uncached_cost = float(bill.uncached)
        return bill


def openai_blocks(body: dict[str, Any]) -> list[Block]:
    """The prompt as OpenAI sees its prefix: tools, instructions, then each message or input
    item whole (Chat Completions or Responses)."""
    units: list[tuple[str, Any, int]] = []
    for tool in body.get("tools") or []:
        units.append(("tool", tool, token_estimate(json.dumps(tool, ensure_ascii=False))))
    if isinstance(body.get("instructions"), str):
        units.append(("instructions", body["instructions"], token_estimate(body["instructions"])))
    items = body.get("messages") or body.get("input") or []
    if isinstance(items, str):
        items = [items]
    for n, item in enumerate(items):
        units.append((f"{n}", item, token_estimate(_item_text(item))))
    return [Block(b.key, b.tokens) for b in _chain(units)]


def _item_text(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(c.get("text", "")) if isinstance(c, dict) else str(c)
                         for c in content)
    return json.dumps(item, ensure_ascii=False, sort_keys=True)


@dataclass(slots=True)
class OpenAICache:
    """OpenAI's automatic prefix cache: each request reads what it shares with a cached one."""

    entries: dict[bytes, float] = field(default_factory=dict)  # prefix key -> expiry

    def bill(self, body: dict[str, Any], at: float) -> Bill:
        return self.bill_blocks(openai_blocks(body), at, str(body.get("model", "")))

    def bill_blocks(self, blocks: list[Block], at: float, model: str) -> Bill:
        total, shared = shared_prefix(self.entries, blocks, at)
        read = 0
        if shared >= OPENAI_MIN_TOKENS:
            read = OPENAI_MIN_TOKENS + (shared - OPENAI_MIN_TOKENS) // OPENAI_STEP * OPENAI_STEP
        if total >= OPENAI_MIN_TOKENS:
            for b in blocks:
                self.entries[b.key] = at + TTL
        price = openai_read_price(model)
        return Bill(tokens=total, read=read, uncached=total - read, read_cost=price * read,
                    uncached_cost=float(total - read))


def gemini_blocks(body: dict[str, Any]) -> list[Block]:
    """The prompt as Gemini's implicit cache sees its prefix: the system instruction, the
    tools, then each content whole (a Code Assist envelope read inside)."""
    inner = body.get("request")
    req: dict[str, Any] = inner if "contents" not in body and isinstance(inner, dict) else body
    units: list[tuple[str, Any, int]] = []
    if (system := req.get("systemInstruction")) is not None:
        units.append(("system", system, token_estimate(json.dumps(system, ensure_ascii=False))))
    for tool in req.get("tools") or []:
        units.append(("tool", tool, token_estimate(json.dumps(tool, ensure_ascii=False))))
    for n, content in enumerate(req.get("contents") or []):
        parts = content.get("parts") if isinstance(content, dict) else None
        text = "\n".join(str(p.get("text", "")) if "text" in p else json.dumps(p, ensure_ascii=False)
                         for p in parts or [] if isinstance(p, dict))
        units.append((f"{n}", content, token_estimate(text)))
    return [Block(b.key, b.tokens) for b in _chain(units)]


@dataclass(slots=True)
class GeminiCache:
    """Gemini's implicit prefix cache: each request reads, to the token, the longest prefix it
    shares with a cached one, when that is at least the model's minimum."""

    entries: dict[bytes, float] = field(default_factory=dict)  # prefix key -> expiry

    def bill(self, body: dict[str, Any], at: float, model: str) -> Bill:
        """`model`: the path names it (Code Assist's body too)."""
        return self.bill_blocks(gemini_blocks(body), at, model or str(body.get("model", "")))

    def bill_blocks(self, blocks: list[Block], at: float, model: str) -> Bill:
        rule = gemini.cache_rule(model)
        total, shared = shared_prefix(self.entries, blocks, at)
        read = shared if shared >= rule.min_tokens else 0
        if total >= rule.min_tokens:
            for b in blocks:
                self.entries[b.key] = at + rule.ttl
        return Bill(tokens=total, read=read, uncached=total - read, read_cost=rule.read * read,
                    uncached_cost=float(total - read))
