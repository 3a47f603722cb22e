"""The saving, live: each captured call billed as the harness sent it and as it went upstream,
under the prompt-cache rules the replay bills by (frame.billing), with the usage the provider
reported, and added to the day's tally in the memory (memory.storage.savings).

Both sides are billed on the same token estimate, each in a prompt cache of its own (one per
wire format: a world where the harness spoke to the provider directly, and the one where it
went through us), so the saving does not depend on the estimate. Upstream is every round that
went out: with the recall tools, their hidden rounds too. Runs on the store's writer thread,
after the call's reply is stored: the bodies are the objects the request path read (the same
objects for a history already read, so billing a late call of a long session takes well
under a millisecond: frame.blocks). Never raises.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from perpetuity_core.frame.billing import (
    AnthropicCache,
    Bill,
    GeminiCache,
    OpenAICache,
    openai_read_price,
)
from perpetuity_core.frame.plan import READ, WRITE
from perpetuity_core.frame.prices import dollars, list_price
from perpetuity_core.memory.storage import savings
from perpetuity_core.memory.storage.savings import Saved
from perpetuity_core.memory.storage.store import Database
from perpetuity_core.serve.exchange import Job
from perpetuity_core.wire.conversation import Protocol, Reply
from perpetuity_core.wire.protocols import ADAPTERS, gemini

log = logging.getLogger("perpetuity")

Cache = AnthropicCache | OpenAICache | GeminiCache


class Savings:
    """The two worlds' prompt caches, and the tally written through them."""

    def __init__(self) -> None:
        self._caches: dict[tuple[Protocol, str], Cache] = {}

    def record(self, db: Database, job: Job, reply: Reply) -> None:
        """Bill the call both ways and add it to its day's row. Never raises."""
        try:
            if job.direct is None:
                return
            at = job.pending.at
            saved = self.bill(job, reply, at)
            day = time.strftime("%Y-%m-%d", time.localtime(at))
            savings.add(db, day, job.pending.provider, job.pending.model, saved)
        except Exception:
            log.exception("perpetuity: could not tally what this call saved")

    def bill(self, job: Job, reply: Reply, at: float) -> Saved:
        model = job.pending.model
        direct = self._bill(job.protocol, "direct", job.direct, at, model)
        sent = Bill()
        for body in upstream_bodies(job):
            sent.add(self._bill(job.protocol, "sent", body, at, model))
        reported = reported_bill(job.protocol, reply, model)
        price = list_price(model)
        return Saved(calls=1, priced=int(price is not None), direct_tokens=direct.tokens,
                     sent_tokens=sent.tokens, direct_cost=direct.cost, sent_cost=sent.cost,
                     direct_usd=dollars(direct, price) if price else 0.0,
                     sent_usd=dollars(sent, price) if price else 0.0,
                     reported=int(reported is not None),
                     reported_cost=reported.cost if reported else 0.0,
                     reported_usd=dollars(reported, price) if reported and price else 0.0)

    def _bill(self, protocol: Protocol, side: str, body: Any, at: float, model: str) -> Bill:
        cache = self._caches.get((protocol, side))
        if cache is None:
            cache = self._caches[(protocol, side)] = (
                AnthropicCache() if protocol == Protocol.ANTHROPIC else
                GeminiCache() if protocol == Protocol.GEMINI else OpenAICache())
        if isinstance(cache, GeminiCache):
            return cache.bill(body, at, model)
        return cache.bill(body, at)


def upstream_bodies(job: Job) -> list[Any]:
    """What went upstream for the call: each round the provider answered (the first as the
    request path made it, our tools added; a hidden round as it was sent), else the body the
    request path settled on (framed, or the client's own when that went instead)."""
    base = job.sent if job.sent is not None and job.original is not None else job.direct
    answered = [(n, r) for n, r in enumerate(job.rounds) if 0 < r.status < 400]
    if not answered:
        return [base]
    adapter = ADAPTERS[job.protocol]
    return [adapter.add_tools(base, job.tool_specs, job.max_rounds == 1) if n == 0 else
            json.loads(r.body) for n, r in answered]


def reported_bill(protocol: Protocol, reply: Reply, model: str) -> Bill | None:
    """The usage the provider reported, billed by the same prices; None when it reported none.
    Anthropic counts its uncached input apart; OpenAI and Gemini count the cached in it."""
    u = reply.usage
    if not (u.input_tokens or u.cache_read_tokens or u.cache_write_tokens):
        return None
    if protocol == Protocol.ANTHROPIC:
        uncached, read_price = u.input_tokens, READ
    else:
        uncached = max(0, u.input_tokens - u.cache_read_tokens)
        read_price = (gemini.cache_rule(model).read if protocol == Protocol.GEMINI else
                      openai_read_price(model))
    written = u.cache_write_tokens
    return Bill(tokens=uncached + u.cache_read_tokens + written, read=u.cache_read_tokens,
                written=written, uncached=uncached, read_cost=read_price * u.cache_read_tokens,
                write_cost=WRITE * written, uncached_cost=float(uncached))
