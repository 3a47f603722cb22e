"""Each model's list price for input, to say what a bill (billing.Bill) costs in money.

US dollars per million input tokens, as the providers' pricing pages list them: Anthropic's
(platform.claude.com/docs/en/about-claude/pricing, with its cache hits where they are not a
tenth of the input price), OpenAI's (openai.com/api/pricing) and Google's
(ai.google.dev/gemini-api/docs/pricing, prompts up to 200k tokens). A model is priced by the
longest family here its name starts with, followed by nothing, a date or a variant
("claude-haiku-4-5-20251001", "gpt-5-codex"), never by a version the table does not know
("claude-opus-4-9" is not Opus 4's): a model not here has no money figure, only cost units.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from perpetuity_core.frame.billing import Bill


@dataclass(frozen=True, slots=True)
class Price:
    input: float  # dollars per million uncached input tokens
    read: float | None = None  # a cache hit's, where it is not the bill's share of `input`


PRICES: dict[str, Price] = {
    # Anthropic
    "claude-fable-5-1": Price(10.0, 0.25), "claude-mythos-5-1": Price(10.0, 0.25),
    "claude-fable-5": Price(10.0, 1.0), "claude-mythos-5": Price(10.0, 1.0),
    "claude-opus-5-5": Price(4.0, 0.2), "claude-opus-5": Price(5.0),
    "claude-opus-4-8": Price(5.0), "claude-opus-4-7": Price(5.0), "claude-opus-4-6": Price(5.0),
    "claude-opus-4-5": Price(5.0), "claude-opus-4-1": Price(15.0), "claude-opus-4": Price(15.0),
    "claude-sonnet-5-5": Price(2.0, 0.1), "claude-sonnet-5": Price(2.0),
    "claude-sonnet-4-6": Price(3.0), "claude-sonnet-4-5": Price(3.0), "claude-sonnet-4": Price(3.0),
    "claude-3-7-sonnet": Price(3.0), "claude-3-5-sonnet": Price(3.0),
    "claude-haiku-4-5": Price(1.0), "claude-3-5-haiku": Price(0.8), "claude-3-haiku": Price(0.25),
    "claude-3-opus": Price(15.0),
    # OpenAI
    "gpt-5.5": Price(5.0), "gpt-5.4": Price(2.5), "gpt-5.4-mini": Price(0.75),
    "gpt-5.4-nano": Price(0.2), "gpt-5.2": Price(1.75), "gpt-5.1": Price(1.25),
    "gpt-5": Price(1.25), "gpt-5-mini": Price(0.25), "gpt-5-nano": Price(0.05),
    "gpt-4.1": Price(2.0), "gpt-4.1-mini": Price(0.4), "gpt-4.1-nano": Price(0.1),
    "gpt-4o": Price(2.5), "gpt-4o-mini": Price(0.15), "o3": Price(2.0), "o4-mini": Price(1.1),
    # Google
    "gemini-3-pro": Price(2.0), "gemini-2.5-pro": Price(1.25), "gemini-2.5-flash": Price(0.3),
    "gemini-2.5-flash-lite": Price(0.1),
}
_VERSION = re.compile(r"-\d{1,2}(?:\D|$)")  # "-9", "-5-1": a version, not a date or a variant


def list_price(model: str) -> Price | None:
    """The list price of `model`'s family, or None when the table does not know it."""
    name = model.lower().removeprefix("models/")
    best = None
    for family in PRICES:
        rest = name[len(family):]
        if (name.startswith(family) and (not rest or rest[0] == "-" and not _VERSION.match(rest))
                and (best is None or len(family) > len(best))):
            best = family
    return PRICES[best] if best is not None else None


def dollars(bill: Bill, price: Price) -> float:
    """What `bill` costs at `price`: its cost units at the input price, a cache hit at its own
    where the model prices hits apart."""
    per_token = price.input / 1e6
    if price.read is None:
        return bill.cost * per_token
    return (bill.uncached_cost + bill.write_cost) * per_token + bill.read * price.read / 1e6
