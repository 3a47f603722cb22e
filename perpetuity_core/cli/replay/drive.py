"""Recorded conversations through the real request pipeline, billed both ways.

Each call goes through `Pipeline.prepare` in-process, as the proxy runs it; what would go
upstream is `decision.body` (or the request untouched), with the recall tools added as the relay
adds them when they ride along. The answer is the recorded reply, stored as the relay stores a
reply (`store_turn`, then `store_reply` at the reply's own time). Both requests are billed on
the conversation's own timestamps, each world with its own prompt cache.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import resource
import sqlite3
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

from perpetuity_core.cli.replay.measure import (
    Tally,
    identifiers,
    live_kept,
    older_names,
    parts_text,
    request_text,
    with_context,
)
from perpetuity_core.cli.replay.request import (
    STAND_IN_SOURCE,
    Template,
    build,
    load_template,
)
from perpetuity_core.cli.replay.sessions import Call, Session, chained, sessions_in_order
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.billing import AnthropicCache
from perpetuity_core.frame.plan import TTL
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import templates
from perpetuity_core.memory.storage.location import where
from perpetuity_core.memory.storage.store import default_db_path
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider
from perpetuity_core.wire.protocols import ADAPTERS, anthropic

HARNESS = "claude-code"  # whose request shape the proxy keeps for this replay


@dataclass(slots=True)
class Report:
    """Per session (or conversation) and in total; `as_dict()` is what `--json` prints."""

    sessions: list[Tally] = field(default_factory=list)
    template: str = ""

    @property
    def total(self) -> Tally:
        t = Tally("total")
        for s in self.sessions:
            t.merge(s)
        return t

    def as_dict(self) -> dict[str, Any]:
        return {"template": self.template, "stand_ins": self.template == STAND_IN_SOURCE,
                "sessions": [s.as_dict() for s in self.sessions], "total": self.total.as_dict()}


@contextlib.contextmanager
def _pipeline(db: Path | None, options: dict[str, Any]) -> Iterator[Pipeline]:
    """The pipeline as `perpetuity proxy` runs it, on a fresh memory: at `db` (which must not
    exist yet, so no real memory is touched), else a temporary file. Its notes library is an
    empty one of its own (a new user's): the note_capture tool rides along as in the proxy, and
    no real library is read or marked."""
    if db is not None and db.exists():
        raise ConfigError(f"{db} exists; replay fills a new memory, give a new path")
    with tempfile.TemporaryDirectory() as tmp:
        store = open_memory(db or Path(tmp) / "replay.db")
        try:
            yield Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                           **{"notes_root": Path(tmp) / "notes", **options}))
        finally:
            store.close()


class _Side:
    """One call through the pipeline: the body that goes upstream, and the reply stored;
    `prepared` is how long the last call's request path took (the proxy's added time)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.prepared = 0.0
        self.stubs = 0  # the last call's tool results sent as stubs
        self.made = ""  # what the last call built: "frame", "addendum" or "" (kept its plan)

    def send(self, path: str, headers: tuple[tuple[str, str], ...], body: dict[str, Any],
             reply: dict[str, Any], replied_at: float) -> tuple[dict[str, Any], bool]:
        """(the body as it reached the provider, whether the history was replaced)."""
        req = HttpRequest("POST", "127.0.0.1", path, headers, json.dumps(body).encode(), True)
        started = time.perf_counter()
        d = self.pipeline.prepare(req)
        self.prepared = time.perf_counter() - started
        laid = d.recall.plan if d.recall is not None else None
        self.stubs = len(laid.stubs) if laid is not None else 0
        self.made = d.recall.made if d.recall is not None else ""
        sent = json.loads(d.body) if d.body is not None else body
        job = d.job
        if job is None:
            return sent, False
        if job.relay:  # the recall tools ride along, as the relay's first round sends them
            sent = ADAPTERS[job.protocol].add_tools(sent, job.tool_specs, job.max_rounds == 1)
        turn = self.pipeline.store_turn(job.pending)
        self.pipeline.store_reply(turn, ADAPTERS[job.protocol].reply_from_body(reply), replied_at,
                                  job.pending)
        return sent, d.body is not None


def proxy_shape(memory: str | Path | None = None) -> tuple[dict[str, Any], str] | None:
    """The Claude Code request shape the proxy kept in its memory (`memory`, else
    $PERPETUITY_DB or ~/.perpetuity/memory.db), and where; None when it kept none. A SQLite
    memory is read only, and one that is not there is not created."""
    at = where(memory or default_db_path())
    source = f"the latest Claude Code request through the proxy ({at})"
    if isinstance(at, Path):
        if not at.is_file():
            return None
        try:
            with contextlib.closing(sqlite3.connect(f"{at.resolve().as_uri()}?mode=ro",
                                                    uri=True)) as conn:
                kept = templates.kept(conn, HARNESS)
        except sqlite3.Error:  # not a memory, or one from before settings
            return None
    else:
        store = open_memory(at)
        try:
            kept = templates.kept(store.db.translated(), HARNESS)
        finally:
            store.close()
    return (kept, source) if kept else None


def claude_code(paths: Sequence[Path], db: Path | None = None, calls: int | None = None,
                template: Path | None = None, progress: bool = False, chain: int = 0,
                proxy_db: str | Path | None = None, **pipeline_options: Any) -> Report:
    """Replay Claude Code sessions (files, or folders searched for *.jsonl) into one memory,
    in time order; `calls` keeps each session's first N calls. The system prompt and tools are
    `template`'s, else ../shared's capture, else those the proxy kept in `proxy_db`
    (`proxy_shape`), else stand-ins. `chain` replays the sessions `chain` times over as one
    conversation that never ends (`sessions.chained`), with each call's figures in the report
    (not what its reply used of older history: that scan of the whole history on every call
    would be most of the replay's time). `pipeline_options` go to `Pipeline` as the proxy's
    options would (limits=Cap(...), tools=False, tool_rounds=...)."""
    shape = load_template(template, kept=proxy_shape(proxy_db) if template is None else None)
    sessions = list(sessions_in_order(paths))
    if not sessions:
        raise ConfigError("no Claude Code session files (*.jsonl) under the given paths")
    if chain:
        for s in sessions:
            s.calls = s.calls[:calls] if calls else s.calls
        sessions, calls = [chained(sessions * chain)], None
    report = Report([Tally(s.id, skipped_lines=s.skipped_lines, per_call=[] if chain else None)
                     for s in sessions], shape.source)
    queue = [(c.at, n, i, c) for n, s in enumerate(sessions) for i, c in
             enumerate(s.calls[:calls] if calls else s.calls)]
    heapq.heapify(queue)
    direct_cache, upstream_cache, floor_cache = AnthropicCache(), AnthropicCache(), AnthropicCache()
    with _pipeline(db, pipeline_options) as pipeline, tqdm(
            total=len(queue), disable=not progress, unit="call", desc="replay") as bar:
        side = _Side(pipeline)
        harness_ids = identifiers("\n".join(shape.harness_text()))
        while queue:
            _, n, _, call = heapq.heappop(queue)
            _replay_call(side, sessions[n], call, shape, report.sessions[n], harness_ids,
                         direct_cache, upstream_cache, floor_cache)
            bar.update()
    return report


def _replay_call(side: _Side, session: Session, call: Call, shape: Template, tally: Tally,
                 harness_ids: set[str], direct_cache: AnthropicCache,
                 upstream_cache: AnthropicCache, floor_cache: AnthropicCache) -> None:
    built = build(call, shape, session)
    tally.prompts += call.starts_task
    if problems := anthropic.check(built.body):  # Claude Code's record is not a valid request
        tally.skip(problems)
        return
    sent, framed = side.send("/v1/messages?beta=true", built.headers, built.body,
                             {"content": call.reply}, call.replied_at)
    direct = direct_cache.bill(built.body, call.at)
    upstream = upstream_cache.bill(sent, call.at)
    messages = built.body["messages"]
    tally.price(floor_cache.bill(floor_body(sent, messages, built.live_from), call.at), upstream,
                cause(call, side.made, tally), call.at)
    older: set[str] = set()
    in_context = 0
    if tally.per_call is None:
        older = older_names(call.reply, messages, built.live_from, harness_ids)
        in_context = with_context(older, parts_text(messages[:built.live_from]),
                                  "\n".join(parts_text(sent.get("messages") or []))) if older else 0
    kept = live_kept(messages, sent.get("messages") or [], built.live_from)
    tally.add(direct, upstream, anthropic.check(sent), kept, older, request_text(sent), framed,
              in_context, call.model)
    if tally.per_call is not None:
        tally.per_call.append({"direct_tokens": direct.tokens, "upstream_tokens": upstream.tokens,
                               "prepare_ms": round(side.prepared * 1000, 2),
                               "rss_mb": round(_rss() / 2**20, 1), "live_identical": kept,
                               "stubs": side.stubs})


def floor_body(sent: dict[str, Any], messages: list[dict[str, Any]],
               live_from: int) -> dict[str, Any]:
    """The least a request of this call could be: what went upstream besides its messages
    (the system prompt, the harness's tools and ours), and of its messages only the harness's
    system-role ones and the live task, as the harness sent them."""
    extra = [m for m in messages[:live_from] if m.get("role") == "system"]
    return {**sent, "messages": extra + messages[live_from:]}


def cause(call: Call, made: str, tally: Tally) -> str:
    """What a call did, for the cost above its floor: a tool round of the task in progress, a
    new prompt under the frame it kept, one that got an addendum, a rebuilt frame (after the
    cache expired, or not); a conversation's first call builds its first frame."""
    if made == "frame":
        if not tally.calls:
            return "first_frame"
        return "rebuild_expired" if call.at - tally.last_at > TTL else "rebuild"
    if made == "addendum":
        return "addendum"
    return "prompt_kept" if call.starts_task else "tool_round"


def _rss() -> int:
    """This process's resident memory, in bytes (0 where /proc is not there)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


# --------------------------------------------------------------------------- chat replay


def paced(times: list[float], gap: float) -> list[float]:
    """A dataset's times with the turns of one sitting `gap` seconds apart (LoCoMo's are a
    second apart), as a person types; sittings keep their dates."""
    out: list[float] = []
    for i, t in enumerate(times):
        same_sitting = i > 0 and 0 <= t - times[i - 1] < 60
        out.append(out[-1] + gap if same_sitting else t)
    return out


def chat_locomo(path: Path, db: Path | None = None, limit: int = 0, turns: int = 0,
                gap: float = 60.0, model: str = "claude-sonnet-4-6", progress: bool = False,
                **pipeline_options: Any) -> Report:
    """Each LoCoMo conversation re-sent turn by turn as a chat client sends it: the whole
    history every time, Anthropic Messages with a cache mark on the last message."""
    if not path.exists():
        raise ConfigError(f"no such dataset path: {path}")
    threads = list(importers.locomo(path))[: limit or None]
    report = Report([Tally(t.conversation_key) for t in threads], "chat client")
    direct_cache, upstream_cache = AnthropicCache(), AnthropicCache()
    with _pipeline(db, pipeline_options) as pipeline, tqdm(
            total=len(threads), disable=not progress, unit="conversation", desc="replay") as bar:
        side = _Side(pipeline)
        for thread, tally in zip(threads, report.sessions, strict=True):
            _chat_thread(side, thread, tally, turns, gap, model, direct_cache, upstream_cache)
            bar.update()
    return report


def _chat_thread(side: _Side, thread: importers.Thread, tally: Tally, turns: int, gap: float,
                 model: str, direct_cache: AnthropicCache,
                 upstream_cache: AnthropicCache) -> None:
    # A chat client sends when the person has finished: consecutive turns of one side are one
    # message (sent at its last part's time); a conversation opening with the other side's
    # turn sends it as the person's.
    said: list[tuple[str, str, float]] = []
    for m, at in zip(thread.messages[: turns or None], paced(thread.times, gap), strict=False):
        role = m.role if said or m.role == "user" else "user"
        if said and said[-1][0] == role:
            said[-1] = (role, said[-1][1] + "\n" + m.text, at)
        else:
            said.append((role, m.text, at))
    for k, (role, text, at) in enumerate(said):
        if role != "user":
            continue
        last = {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        history = [{"role": r, "content": x} for r, x, _ in said[:k]] + [
            {"role": "user", "content": [last]}]
        body = {"model": model, "max_tokens": 1024, "messages": history}
        reply = said[k + 1] if k + 1 < len(said) else ("assistant", "", at)
        tally.prompts += 1
        headers = (("x-api-key", "sk-ant-replay"), ("anthropic-version", "2023-06-01"),
                   ("content-type", "application/json"), ("x-perpetuity-user", thread.user_key),
                   ("x-perpetuity-conversation", thread.conversation_key),
                   ("x-perpetuity-time", datetime.fromtimestamp(at, UTC).isoformat()))
        sent, framed = side.send("/v1/messages", headers, body,
                                 {"content": [{"type": "text", "text": reply[1]}]}, reply[2])
        tally.add(direct_cache.bill(body, at), upstream_cache.bill(sent, at),
                  anthropic.check(sent), live_kept(history, sent.get("messages") or [], k),
                  set(), "", framed, model=model)
