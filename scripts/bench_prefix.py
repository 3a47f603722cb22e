"""Prompt-cache friendliness: what each request upstream costs once the provider's cache is used.

This replays a conversation as a chat client would send it (the whole history every turn,
replies stored as replies) through the request pipeline, with the frame and, side by side, with
recall off (the history as the client sent it), in two protocols whose caches work differently:

  openai     Chat Completions. OpenAI caches every request's prefix by itself: reported are the
             share of each request's characters that equal the previous request's prefix, the
             tokens past it, and the cost with the prefix read at 0.1 and the rest at 1.
  anthropic  Messages, the client marking its last message as a cache-aware client does.
             Anthropic writes a prefix to its cache only where a block carries a cache marker,
             and reads one only at a marker or up to 20 blocks before it; nothing under 1,024
             tokens is cached. Simulated from the markers actually sent: the cost with the
             longest cached prefix read at 0.1, the rest up to the last marker written at 1.25,
             the tail at 1 (every request counted as within the cache's lifetime).

Costs are in units of one uncached input token, per request; tokens are characters / 4, the
rule of thumb the frame's own counts use. Prints JSON.

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
import hashlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core import importers
from perpetuity_core.conversation import Provider, Reply, Usage
from perpetuity_core.evaluate import _request
from perpetuity_core.pipeline import HttpRequest, Pipeline
from perpetuity_core.store import Store

CACHE_READ, CACHE_WRITE = 0.1, 1.25  # multiples of an input token's price
LOOKBACK = 20  # blocks before a marker where Anthropic still finds a cached prefix
MIN_CACHED = 1024  # tokens: shorter prefixes are not cached


def shared_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # binary search on equal prefixes: bytes compare in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class OpenAICache:
    """Automatic prefix caching: whatever the previous request shares with this one is cached."""

    def __init__(self) -> None:
        self.previous = b""
        self.rows: list[dict[str, float]] = []

    def request(self, body: bytes) -> None:
        if self.previous:
            common = shared_prefix(self.previous, body)
            self.rows.append({"share": common / len(body), "uncached": (len(body) - common) / 4,
                              "sent": len(body) / 4,
                              "cost": (CACHE_READ * common + len(body) - common) / 4})
        self.previous = body


class AnthropicCache:
    """Prefixes written at marked blocks; read at a marker or up to LOOKBACK blocks before."""

    def __init__(self) -> None:
        self.cached: set[bytes] = set()
        self.rows: list[dict[str, float]] = []

    def request(self, body: bytes) -> None:
        blocks = _blocks(json.loads(body))
        keys, ends, marks = [], [], []
        h = hashlib.blake2b(digest_size=16)
        total = 0.0
        for n, (text, marked) in enumerate(blocks):
            h.update(text.encode() + b"\x00")
            keys.append(h.copy().digest())
            total += len(text) / 4
            ends.append(total)
            if marked:
                marks.append(n)
        read = 0.0
        for m in marks:
            for j in range(m, max(-1, m - LOOKBACK - 1), -1):
                if keys[j] in self.cached:
                    read = max(read, ends[j])
                    break
        marked_to = ends[marks[-1]] if marks else 0.0
        written = max(0.0, marked_to - read)
        self.rows.append({"read": read, "written": written, "sent": total,
                          "cost": CACHE_READ * read + CACHE_WRITE * written
                          + (total - max(read, marked_to))})
        self.cached |= {keys[m] for m in marks if ends[m] >= MIN_CACHED}


def _blocks(body: dict[str, Any]) -> list[tuple[str, bool]]:
    """(text, marked) of every block in the order Anthropic caches them: system, then messages
    (this replay sends no tools)."""
    out = []
    system = body.get("system") or []
    for part in [{"text": system}] if isinstance(system, str) else system:
        out.append((part["text"], "cache_control" in part))
    for m in body["messages"]:
        content = m["content"]
        for b in [{"text": content}] if isinstance(content, str) else content:
            out.append((m["role"] + ":" + b.get("text", ""), "cache_control" in b))
    return out


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


def paced(times: list[float], gap: float) -> list[float]:
    """The dataset's times with the turns of one sitting `gap` seconds apart (LoCoMo's are a
    second apart), as a person types; sittings keep their dates."""
    out: list[float] = []
    for i, t in enumerate(times):
        same_sitting = i > 0 and 0 <= t - times[i - 1] < 60
        out.append(out[-1] + gap if same_sitting else t)
    return out


def replay(thread: importers.Thread, turns: int, recall: bool, tmp: Path,
           build: Callable[..., HttpRequest], cache: OpenAICache | AnthropicCache,
           gap: float) -> None:
    store = Store(tmp / f"prefix-{recall}-{type(cache).__name__}.db")
    pipeline = Pipeline(store, {p: "http://127.0.0.1:9" for p in Provider}, trust_identity=True)
    history: list[dict[str, str]] = []
    turn = None
    times = paced(thread.times, gap)
    for i, m in enumerate(thread.messages[:turns]):
        if m.role == "assistant" and turn is not None and history[-1]["role"] == "user":
            history.append({"role": "assistant", "content": m.text})
            pipeline.store_reply(turn, Reply(m, Usage()), times[i])
            continue
        history.append({"role": "user", "content": m.text})
        req = build(thread.user_key, thread.conversation_key, times[i], history, recall)
        d = pipeline.prepare(req)
        cache.request(d.body if d.body is not None else req.body)
        turn = pipeline.store_turn(d.job.pending)
    store.close()


def _mean(rows: list[dict[str, float]], key: str, digits: int = 0) -> float:
    return round(statistics.mean(r[key] for r in rows), digits or None)


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
            oa = OpenAICache()
            replay(thread, args.turns, recall, Path(tmp), _chat_request, oa, args.gap)
            out["openai"][mode] = {
                "requests": len(oa.rows) + 1,
                "prefix_share_mean": _mean(oa.rows, "share", 4),
                "prefix_share_median": round(statistics.median(r["share"] for r in oa.rows), 4),
                "uncached_tokens_mean": _mean(oa.rows, "uncached"),
                "sent_tokens_mean": _mean(oa.rows, "sent"),
                "cost_units_mean": _mean(oa.rows, "cost")}
            an = AnthropicCache()
            replay(thread, args.turns, recall, Path(tmp), _anthropic_request, an, args.gap)
            out["anthropic"][mode] = {
                "requests": len(an.rows),
                "read_tokens_mean": _mean(an.rows, "read"),
                "written_tokens_mean": _mean(an.rows, "written"),
                "sent_tokens_mean": _mean(an.rows, "sent"),
                "cost_units_mean": _mean(an.rows, "cost")}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
