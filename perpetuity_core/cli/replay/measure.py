"""What one replayed call cost each way, and what the upstream request kept.

Per call, `Tally.add` records:

- the bill of the request as the harness sent it (direct) and as it reached the provider;
- whether the provider would have refused the upstream request (the adapter's `check`);
- "uses older history": the identifiers (file paths, snake_case, CamelCase and dotted names of
  four characters or more) the recorded reply uses in its text and tool-call arguments that
  the older history held (before the person's latest prompt) but neither the live task nor the
  harness's own text (system prompt, tools, reminders) did; how many of them the upstream
  request still held (the direct request holds them all by construction), and how many it
  held with their context: the CONTEXT characters either side of the name's latest mention in
  the older history (within that block's text, as stored and quoted), verbatim;
- whether the live task (the messages from the person's latest prompt on) reached the provider
  byte-identical, compared as JSON without cache marks (marks are where the proxy places them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from perpetuity_core.frame.billing import Bill
from perpetuity_core.frame.blocks import block_text
from perpetuity_core.frame.prices import dollars, list_price
from perpetuity_core.wire.protocols import anthropic

# A dotted name may hold hyphens: a file is named "auto-pr.yml", not "pr.yml".
_CANDIDATE = re.compile(r"~?(?:[\w.\-]*/)+[\w.\-]+|[A-Za-z_][\w\-]*(?:\.[A-Za-z_][\w\-]*)+"
                        r"|[A-Za-z_][A-Za-z0-9_]*")
_CAMEL = re.compile(r"[a-z][A-Z]|[A-Z].*[A-Z].*[a-z]|[A-Z][a-z]+[A-Z]")
_EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,8}$")
# A tool call's arguments are read as JSON: "\nEOF" is a line break and a word, not "nEOF".
_ESCAPE = re.compile(r"\\[nrt]")
CONTEXT = 60  # characters either side of a name's latest mention that must come with it


def identifiers(text: str) -> set[str]:
    """File paths and code names in a text, not plain words."""
    out = set()
    for m in _CANDIDATE.finditer(_ESCAPE.sub(" ", text)):
        s = m.group().rstrip(".-/")
        if len(s) < 4:
            continue
        if "/" in s:
            if _is_path(s):
                out.add(s)
        elif "_" in s.strip("_") or "." in s or _CAMEL.search(s):
            out.add(s)
    return out


def _is_path(s: str) -> bool:
    """A path, not words joined by slashes ("and/or", "Mind/Body"): it has an extension, is
    rooted, or is three lower-case parts deep or more."""
    if _EXTENSION.search(s) or s.startswith(("/", "~", "./", "../")):
        return True
    parts = s.split("/")
    return len(parts) >= 3 and all(p == p.lower() for p in parts)


def reply_text(blocks: list[dict[str, Any]]) -> str:
    """What a reply says and calls with: its text and tool-call arguments' values (not its
    thinking, nor the names of the tools it calls and of their arguments: the API offers a
    model only the tools its request defines, with their schemas, so those are the harness's
    text, even where the replay's template lacks them: a session's MCP tools, a newer field)."""
    return "\n".join(_values(b.get("input")) if b.get("type") == "tool_use" else block_text(b)
                     for b in blocks if b.get("type") in ("text", "tool_use"))


def _values(arguments: Any) -> str:
    """A tool call's arguments without their names, as JSON."""
    if isinstance(arguments, dict):
        arguments = list(arguments.values())
    return json.dumps(arguments, ensure_ascii=False)


def older_names(reply: list[dict[str, Any]], messages: list[dict[str, Any]], live_from: int,
                harness: set[str]) -> set[str]:
    """The identifiers `reply` uses that the history before `live_from` held, and neither the
    live task nor the `harness`'s own text did."""
    live = identifiers(request_text({"messages": messages[live_from:]}))
    return (identifiers(reply_text(reply))
            & identifiers(request_text({"messages": messages[:live_from]}))) - live - harness


def request_text(body: dict[str, Any]) -> str:
    parts = [block_text(b) for b in body.get("system") or [] if isinstance(b, dict)]
    for m in body.get("messages") or []:
        content = m.get("content")
        parts += [content] if isinstance(content, str) else [block_text(b) for b in content or []]
    return "\n".join(parts)


def parts_text(messages: list[dict[str, Any]]) -> list[str]:
    """Each block's text as the proxy reads and stores it (a tool call's arguments as stored,
    its keys sorted): the form a frame quotes verbatim."""
    return [p.text for m in messages if isinstance(m, dict)
            for p in anthropic.message_from(m).parts]


def with_context(names: set[str], older: list[str], sent: str) -> int:
    """How many of `names` the text `sent` holds with the CONTEXT characters either side of
    their latest mention in `older` (block texts, oldest first), clipped to that block."""
    held = 0
    for name in names:
        for text in reversed(older):
            at = text.rfind(name)
            if at >= 0:
                held += text[max(0, at - CONTEXT):at + len(name) + CONTEXT] in sent
                break
    return held


def _unmarked(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_unmarked(v) for v in value]
    return value


def live_kept(direct: list[dict[str, Any]], upstream: list[dict[str, Any]], live: int) -> bool:
    """The live task at the end of the upstream messages, as the harness sent it."""
    tail = direct[live:]
    if len(upstream) < len(tail):
        return False
    sent = upstream[len(upstream) - len(tail):]
    return json.dumps(_unmarked(tail)) == json.dumps(_unmarked(sent))


@dataclass(slots=True)
class Tally:
    """One session's figures (or the total's)."""

    name: str
    calls: int = 0
    prompts: int = 0
    skipped_calls: int = 0  # Claude Code's own record would have been refused
    skipped_reasons: list[str] = field(default_factory=list)  # why, the first few
    skipped_lines: int = 0
    invalid: int = 0  # upstream requests the provider would refuse
    reasons: list[str] = field(default_factory=list)
    direct: Bill = field(default_factory=Bill)
    upstream: Bill = field(default_factory=Bill)
    older_used: int = 0  # identifiers a reply used that only older history held
    older_kept: int = 0  # ... and the upstream request still held
    older_in_context: int = 0  # ... with the text around their latest mention (`with_context`)
    calls_using_older: int = 0
    live_identical: int = 0
    framed: int = 0  # calls whose history the proxy replaced
    direct_curve: list[float] = field(default_factory=list)  # cumulative cost
    upstream_curve: list[float] = field(default_factory=list)
    # Each call's sizes, request-path time and memory (a chained replay's; None: not kept).
    per_call: list[dict[str, Any]] | None = None
    floor: Bill = field(default_factory=Bill)  # each call's floor (drive.floor_body), billed
    above: dict[str, float] = field(default_factory=dict)  # upstream less floor, by cause
    last_at: float = 0.0  # the latest call's time
    # In dollars at each model's list price (prices.py), over the calls of a priced model.
    direct_usd: float = 0.0
    upstream_usd: float = 0.0
    unpriced: list[str] = field(default_factory=list)  # models the price list does not know

    def price(self, floor: Bill, upstream: Bill, cause: str, at: float) -> None:
        """One call's floor, and what its upstream request cost above it, under `cause`."""
        self.floor.add(floor)
        self.above[cause] = self.above.get(cause, 0.0) + upstream.cost - floor.cost
        self.last_at = at

    def add(self, direct: Bill, upstream: Bill, problems: list[str], live_same: bool,
            older: set[str], upstream_text: str, framed: bool, in_context: int = 0,
            model: str = "") -> None:
        self.calls += 1
        if (price := list_price(model)) is not None:
            self.direct_usd += dollars(direct, price)
            self.upstream_usd += dollars(upstream, price)
        elif model not in self.unpriced:
            self.unpriced.append(model)
        self.direct.add(direct)
        self.upstream.add(upstream)
        self.direct_curve.append((self.direct_curve[-1] if self.direct_curve else 0) + direct.cost)
        self.upstream_curve.append(
            (self.upstream_curve[-1] if self.upstream_curve else 0) + upstream.cost)
        if problems:
            self.invalid += 1
            self.reasons += [p for p in problems if p not in self.reasons][:5 - len(self.reasons)]
        self.live_identical += live_same
        self.framed += framed
        if older:
            self.calls_using_older += 1
            self.older_used += len(older)
            self.older_kept += sum(1 for name in older if name in upstream_text)
            self.older_in_context += in_context

    def skip(self, problems: list[str]) -> None:
        """A call not replayed: the API would refuse its rebuilt request, for `problems`."""
        self.skipped_calls += 1
        if len(self.skipped_reasons) < 5:
            self.skipped_reasons.append(
                f"{self.name} call {self.calls + self.skipped_calls}: {'; '.join(problems)}")

    def merge(self, other: Tally) -> None:
        for name in ("calls", "prompts", "skipped_calls", "skipped_lines", "invalid",
                     "older_used", "older_kept", "older_in_context", "calls_using_older", "live_identical", "framed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reasons += [r for r in other.reasons if r not in self.reasons][:5 - len(self.reasons)]
        self.skipped_reasons += other.skipped_reasons[:5 - len(self.skipped_reasons)]
        self.direct.add(other.direct)
        self.upstream.add(other.upstream)
        self.floor.add(other.floor)
        self.direct_usd += other.direct_usd
        self.upstream_usd += other.upstream_usd
        self.unpriced += [m for m in other.unpriced if m not in self.unpriced]
        for cause, cost in other.above.items():
            self.above[cause] = self.above.get(cause, 0.0) + cost

    def as_dict(self) -> dict[str, Any]:
        def ratio(a: float, b: float) -> float | None:
            return round(a / b, 4) if b else None

        return {
            "name": self.name, "calls": self.calls, "prompts": self.prompts,
            "framed_calls": self.framed,
            "tokens": {"direct": self.direct.tokens, "upstream": self.upstream.tokens,
                       "ratio": ratio(self.upstream.tokens, self.direct.tokens)},
            "cost": {"direct": round(self.direct.cost, 1), "upstream": round(self.upstream.cost, 1),
                     "ratio": ratio(self.upstream.cost, self.direct.cost)},
            "money": {"direct_usd": round(self.direct_usd, 2),
                      "upstream_usd": round(self.upstream_usd, 2),
                      "saved": None if not self.direct_usd else
                      round(1 - self.upstream_usd / self.direct_usd, 4),
                      "unpriced_models": self.unpriced},
            "direct": self.direct.as_dict(), "upstream": self.upstream.as_dict(),
            "invalid_requests": self.invalid, "invalid_reasons": self.reasons[:5],
            "skipped_invalid_calls": self.skipped_calls, "skipped_reasons": self.skipped_reasons,
            "skipped_lines": self.skipped_lines,
            "older_history": {"calls": self.calls_using_older, "identifiers": self.older_used,
                              "kept": self.older_kept,
                              "recall": ratio(self.older_kept, self.older_used),
                              "in_context": self.older_in_context,
                              "context_recall": ratio(self.older_in_context, self.older_used)},
            "live_task_identical": ratio(self.live_identical, self.calls),
        } | self._floor() | ({} if self.per_call is None else _long_session(self.per_call))

    def _floor(self) -> dict[str, Any]:
        """What the calls could not cost less than (their system prompt, tools and live task),
        and what they cost above it by what they did, as shares of the direct cost (a chat
        replay prices no floor)."""
        if not self.above or not self.direct.cost:
            return {}
        return {"floor": {"cost": round(self.floor.cost, 1),
                          "ratio": round(self.floor.cost / self.direct.cost, 4)},
                "above_floor": {cause: round(cost / self.direct.cost, 4)
                                for cause, cost in sorted(self.above.items())}}


def _long_session(per_call: list[dict[str, Any]]) -> dict[str, Any]:
    """A chained replay's figures: the largest requests each way, the request path's time
    early and late (medians of the first and last tenth of the calls) and each call's own."""
    tenth = max(1, len(per_call) // 10)

    def median_ms(calls: list[dict[str, Any]]) -> float:
        times = sorted(c["prepare_ms"] for c in calls)
        return times[len(times) // 2] if times else 0.0

    early, late = median_ms(per_call[:tenth]), median_ms(per_call[-tenth:])
    return {"largest_direct_tokens": max((c["direct_tokens"] for c in per_call), default=0),
            "largest_upstream_tokens": max((c["upstream_tokens"] for c in per_call), default=0),
            "prepare_ms": {"early_median": early, "late_median": late,
                           "late_over_early": round(late / early, 2) if early else None},
            "rss_mb": {"first": per_call[0]["rss_mb"] if per_call else 0.0,
                       "max": max((c["rss_mb"] for c in per_call), default=0.0)},
            "per_call": per_call}
