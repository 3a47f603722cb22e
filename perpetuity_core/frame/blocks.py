"""A request's prompt as a provider's prefix cache sees it: blocks in order, each keyed by the
whole prefix up to it (equal keys, equal prefixes), with its tokens and its cache mark.

Anthropic caches block by block: every tool, then the system blocks, then each message's
content blocks. OpenAI and Gemini cache a prefix of whole items: tools and instructions, then
each message, input item or content. `Blocks` makes a body's blocks; a unit of the prompt (a
tool, a system block, a message) that comes back as the same object after the same prefix is
not made again. A harness re-sends its whole history on every call, and both the proxy
(wire.seen) and the replay hand back the same objects for what was read before: making every
block anew (JSON of each, to digest it) took 0.6 s a call at 2,700 messages.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from perpetuity_core.frame.plan import TTL
from perpetuity_core.memory.derived.index import token_estimate

TTL_1H = 3600.0  # the 1-hour entry a harness's own mark may ask for
IMAGE_TOKENS = 1_600  # an image near Anthropic's 1.15-megapixel cap: (w*h)/750
KEEP_CALLS = 16  # a unit not met again within this many bodies is forgotten
LANES = 8  # bodies remembered whole, to find the next one's shared start (one per conversation)

Parts = list[tuple[Any, int, float]]  # a unit's blocks: (as digested, tokens, mark's lifetime)
# A run of units of one kind: the kind ("tool", "system", "message", "item"), the objects, and
# what makes a unit's blocks.
Group = tuple[str, list[Any], Callable[[Any], Parts]]


@dataclass(frozen=True, slots=True)
class Block:
    """One cacheable unit of the prompt: its identity, its tokens, its mark's lifetime (0: none)."""

    key: bytes
    tokens: int
    ttl: float = 0.0


@dataclass(slots=True)
class Prompt:
    """A body's blocks, the tokens up to the end of each, and which carry a mark."""

    blocks: list[Block]
    ends: list[int]
    marks: list[int]

    @classmethod
    def of(cls, blocks: list[Block]) -> Prompt:
        return cls(blocks, list(accumulate(b.tokens for b in blocks)),
                   [i for i, b in enumerate(blocks) if b.ttl])

    @property
    def tokens(self) -> int:
        return self.ends[-1] if self.ends else 0


@dataclass(slots=True)
class _Lane:
    units: list[Any]  # the body's units, in order (kept alive: their ids stay theirs)
    starts: list[int]  # where each group starts in them
    unit_ends: list[int]  # the blocks up to the end of each unit
    prompt: Prompt


class Blocks:
    """Bodies' blocks, made once for what comes back. A body that starts with the same objects
    as one of the last LANES takes that one's blocks up to where they part (a comparison of
    ids, in C); each unit after is looked up by (the prefix before it, its place, its id)."""

    def __init__(self) -> None:
        self._made: dict[tuple[bytes, str, int], tuple[Any, list[Block], int]] = {}
        self._lanes: list[_Lane] = []
        self.calls = 0

    def chain(self, groups: list[Group]) -> Prompt:
        self.calls += 1
        units = [u for _, objs, _ in groups for u in objs]
        starts = list(accumulate((len(objs) for _, objs, _ in groups), initial=0))[:-1]
        lane, same = self._lane(units, starts)
        base = lane.prompt if lane is not None else Prompt([], [], [])
        unit_ends = lane.unit_ends[:same] if lane is not None else []
        cut = unit_ends[-1] if unit_ends else 0  # the blocks taken as they were
        blocks = base.blocks[:cut]
        start = 0
        for kind, objs, parts in groups:
            for n in range(max(same - start, 0), len(objs)):
                blocks += self._unit(blocks[-1].key if blocks else b"", _where(kind, n, objs[n]),
                                     objs[n], parts)
                unit_ends.append(len(blocks))
            start += len(objs)
        fresh = blocks[cut:]
        ends = base.ends[:cut] + list(accumulate(
            (b.tokens for b in fresh), initial=base.ends[cut - 1] if cut else 0))[1:]
        marks = [m for m in base.marks if m < cut] + [cut + i for i, b in enumerate(fresh) if b.ttl]
        prompt = Prompt(blocks, ends, marks)
        self._lanes = [_Lane(units, starts, unit_ends, prompt),
                       *(other for other in self._lanes if other is not lane)][:LANES]
        if self.calls % KEEP_CALLS == 0:
            self._made = {k: v for k, v in self._made.items() if v[2] > self.calls - KEEP_CALLS}
        return prompt

    def _lane(self, units: list[Any], starts: list[int]) -> tuple[_Lane | None, int]:
        """The remembered body sharing the longest start with `units` (never past a group
        that starts elsewhere: a unit's place is in its key), and how many units."""
        best, most = None, 0
        for lane in self._lanes:
            if not units or not lane.units or lane.units[0] is not units[0]:
                continue
            same = list(map(operator.is_, lane.units, units))
            n = same.index(False) if False in same else len(same)
            n = min([n, *(min(a, b) for a, b in zip(lane.starts, starts) if a != b)])
            if n > most:
                best, most = lane, n
        return best, most

    def _unit(self, key: bytes, where: str, unit: Any, parts: Callable[[Any], Parts]) -> list[Block]:
        memo = (key, where, id(unit))
        found = self._made.get(memo)
        made = found[1] if found is not None else _make(key, where, parts(unit))
        self._made[memo] = (unit, made, self.calls)
        return made


def _where(kind: str, n: int, unit: Any) -> str:
    if kind == "message":
        return f"{n}:{unit.get('role')}"
    return f"{n}" if kind == "item" else kind


def _make(key: bytes, where: str, parts: Parts) -> list[Block]:
    made = []
    for i, (raw, tokens, ttl) in enumerate(parts):
        key = hashlib.blake2b(key + f"{where}:{i}".encode() + b"\x00" + json.dumps(
            raw, sort_keys=True).encode(), digest_size=16).digest()
        made.append(Block(key, tokens, ttl))
    return made


# --------------------------------------------------------------------------- Anthropic


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


def anthropic_groups(body: dict[str, Any]) -> list[Group]:
    system = body.get("system")
    return [("tool", list(body.get("tools") or []), _tool_parts),
            ("system", [{"type": "text", "text": system}] if isinstance(system, str) else
             list(system or []), _block_parts),
            ("message", [m for m in body.get("messages") or [] if isinstance(m, dict)],
             _message_parts)]


def _tool_parts(tool: Any) -> Parts:
    raw = _unmarked(tool) if isinstance(tool, dict) else tool
    return [(raw, token_estimate(json.dumps(raw, ensure_ascii=False)), _ttl(tool))]


def _block_parts(block: Any) -> Parts:
    return [(_unmarked(block) if isinstance(block, dict) else block, block_tokens(block),
             _ttl(block))]


def _message_parts(message: dict[str, Any]) -> Parts:
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    return [part for b in blocks for part in _block_parts(b)]


# --------------------------------------------------------------------------- OpenAI, Gemini


def openai_groups(body: dict[str, Any]) -> list[Group]:
    """Tools, instructions, then each message or input item whole (Chat Completions or
    Responses)."""
    items = body.get("messages") or body.get("input") or []
    instructions = body.get("instructions")
    return [("tool", list(body.get("tools") or []), _json_whole),
            ("instructions", [instructions] if isinstance(instructions, str) else [], _text_whole),
            ("item", [items] if isinstance(items, str) else list(items), _item_whole)]


def gemini_groups(body: dict[str, Any]) -> list[Group]:
    """The system instruction, the tools, then each content whole (a Code Assist envelope
    read inside)."""
    inner = body.get("request")
    req: dict[str, Any] = inner if "contents" not in body and isinstance(inner, dict) else body
    system = req.get("systemInstruction")
    return [("system", [] if system is None else [system], _json_whole),
            ("tool", list(req.get("tools") or []), _json_whole),
            ("item", list(req.get("contents") or []), _content_whole)]


def _json_whole(value: Any) -> Parts:
    return [(value, token_estimate(json.dumps(value, ensure_ascii=False)), 0.0)]


def _text_whole(text: str) -> Parts:
    return [(text, token_estimate(text), 0.0)]


def _item_whole(item: Any) -> Parts:
    return [(item, token_estimate(_item_text(item)), 0.0)]


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


def _content_whole(content: Any) -> Parts:
    parts = content.get("parts") if isinstance(content, dict) else None
    text = "\n".join(str(p.get("text", "")) if "text" in p else json.dumps(p, ensure_ascii=False)
                     for p in parts or [] if isinstance(p, dict))
    return [(content, token_estimate(text), 0.0)]
