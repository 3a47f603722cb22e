"""Prompt-cache friendliness: what each request upstream costs once the provider's cache is used.

This replays a conversation as a chat client would send it (the whole history every turn,
replies stored as replies) through the request pipeline, with the frame and, side by side, with
recall off (the history as the client sent it), in two protocols whose caches work differently:

  openai     Chat Completions, billed as gpt-5 (cached input at 0.1). OpenAI caches every
             request's prefix by itself: reported are the share of each request's tokens read
             from the cache, the tokens past it, and the cost.
  anthropic  Messages, the client marking its last message as a cache-aware client does, billed
             as a model with a 1,024-token minimum. Anthropic writes a prefix to its cache only
             at a marked block and reads one only at a marker or up to 20 blocks before it.

Both are billed by `perpetuity_core.frame.billing` (the rules are in its docstring), on the replay's
own clock, as `perpetuity replay` bills. Costs are in units of one uncached input token, per
request. Prints JSON.

    .venv/bin/python scripts/bench_prefix.py [--format locomo|beam] [--data PATH] [--turns 300]
                                             [--gap 60]

Turns of one sitting are replayed a minute apart (`--gap`), as a person would type them: the
frame's labels say how long before the question each turn was said, and that text changes as
time passes.

The defaults replay LoCoMo's first conversation (a history of about 7,600 tokens a request on
average over its first 300 turns); `--format beam` replays BEAM's first chat (long turns: the
history passes 75,000 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core.cli.eval import _request
from perpetuity_core.cli.replay.drive import paced
from perpetuity_core.frame.billing import AnthropicCache, Bill, OpenAICache
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider, Reply, Usage


def _anthropic_request(user: str, conversation: str, at: float,
                       history: list[dict[str, str]], recall: bool) -> HttpRequest:
    messages: list[dict[str, Any]] = [dict(m) for m in history]
    messages[-1]["content"] = [{"type": "text", "text": history[-1]["content"],
                                "cache_control": {"type": "ephemeral"}}]
    chat = _request(user, conversation, at, history)
    headers = tuple((k, v) for k, v in chat.headers if k != "authorization") + (
        ("x-api-key", "sk-eval"),) + (() if recall else (("x-perpetuity-recall", "off"),))
    body = {"model": "eval", "max_tokens": 1024, "messages": messages}
    return HttpRequest("POST", "127.0.0.1", "/v1/messages", headers, json.dumps(body).encode(),
                       True)


def _chat_request(user: str, conversation: str, at: float, history: list[dict[str, str]],
                  recall: bool) -> HttpRequest:
    req = _request(user, conversation, at, history)
    if recall:
        return req
    return HttpRequest(req.method, req.host, req.path,
                       req.headers + (("x-perpetuity-recall", "off"),), req.body, True)


def replay(thread: importers.Thread, turns: int, recall: bool, tmp: Path,
           build: Callable[..., HttpRequest], cache: OpenAICache | AnthropicCache,
           gap: float, model: str) -> list[Bill]:
    store = open_memory(tmp / f"prefix-{recall}-{type(cache).__name__}.db")
    pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                           trust_identity=True))
    history: list[dict[str, str]] = []
    turn = None
    bills = []
    times = paced(thread.times, gap)
    for i, m in enumerate(thread.messages[:turns]):
        if m.role == "assistant" and turn is not None and history[-1]["role"] == "user":
            history.append({"role": "assistant", "content": m.text})
            pipeline.store_reply(turn, Reply(m, Usage()), times[i])
            continue
        history.append({"role": "user", "content": m.text})
        req = build(thread.user_key, thread.conversation_key, times[i], history, recall)
        d = pipeline.prepare(req)
        sent = json.loads(d.body if d.body is not None else req.body)
        bills.append(cache.bill({**sent, "model": model}, times[i]))
        turn = pipeline.store_turn(d.job.pending)
    store.close()
    return bills


def _mean(bills: list[Bill], key: str) -> float:
    return round(statistics.mean(getattr(b, key) for b in bills))


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--format", choices=("locomo", "beam"), default="locomo")
    ap.add_argument("--data", type=Path)
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--gap", type=float, default=60.0,
                    help="seconds between the turns of one sitting (default 60)")
    args = ap.parse_args()
    data = args.data or here.parent / "shared/data" / {
        "locomo": "locomo/locomo10.json", "beam": "beam-100k"}[args.format]
    thread = next(getattr(importers, args.format)(data))
    out: dict[str, dict[str, Any]] = {"openai": {}, "anthropic": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for recall in (True, False):
            mode = "frame" if recall else "history_as_sent"
            oa = replay(thread, args.turns, recall, Path(tmp), _chat_request, OpenAICache(),
                        args.gap, "gpt-5")
            out["openai"][mode] = {
                "requests": len(oa),
                "prefix_share_mean": round(statistics.mean(b.read / b.tokens for b in oa), 4),
                "uncached_tokens_mean": _mean(oa, "uncached"),
                "sent_tokens_mean": _mean(oa, "tokens"),
                "cost_units_mean": _mean(oa, "cost")}
            an = replay(thread, args.turns, recall, Path(tmp), _anthropic_request,
                        AnthropicCache(), args.gap, "claude-sonnet-4-5")
            out["anthropic"][mode] = {
                "requests": len(an),
                "read_tokens_mean": _mean(an, "read"),
                "written_tokens_mean": _mean(an, "written"),
                "sent_tokens_mean": _mean(an, "tokens"),
                "cost_units_mean": _mean(an, "cost")}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
