"""Frame plus recall rounds, without a model: a scripted reader in the model's place.

`perpetuity eval DATASET PATH --reader search` feeds each conversation as `perpetuity eval` does,
then asks its questions in sequence (one conversation, a minute apart, each answered "Noted.")
through the real pipeline and the real relay: the proxy's tool loop, the real tool code, the
per-turn rule that an answer never repeats what the model was shown, the real rendering of tool
answers. Only the model is replaced, by `Reader`, a Chat Completions endpoint on 127.0.0.1:

    round 0  the request with the frame: the reader calls memory_search(query=the question)
    round 1  the request answering that call (frame, call, result): the reader's second move
    round 2  the request answering the second call: the reader answers "Noted."

Each request the reader received is checked for every evidence turn, verbatim, in its message
text, and its size counted (message text, four characters a token): recall_all after the frame
alone, after one round, after two. Beside each, the ranking's own recall within as many tokens
(`ranking_recall_all_within_tokens`: the question's top rows best first while they fit), the bar
that lexical retrieval itself sets for whatever fills that room.

The second move (`--second`), the reader's next simplest step:

    rare  memory_search on the question's rarest words (by the shipped dictionary's corpus
          frequency), what was shown excluded, as the tools always do. The default: the first
          search already read the question's ranking on past the frame, so a query of other
          weight reaches rows it did not (4 LoCoMo and 8 BEAM conversations, two rounds:
          0.8814 and 0.6389 recall_all, against 0.8763 and 0.6250 with `more`)
    more  memory_more(): what this turn's retrieval found and the frame left out, best first
          (it adds almost nothing after that first search: the same ranking, read on)

The reader is deliberately simple: a real model searches no worse.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import h11
import httpx
from tqdm import tqdm

from perpetuity_core.cli import eval as base
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import dictionary
from perpetuity_core.serve.exchange import Job
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.serve.relay import JOB_HEADER, Relay
from perpetuity_core.serve.writer import Capture
from perpetuity_core.wire.conversation import Provider

ANSWER = "Noted."
SECOND_MOVES = ("rare", "more")
RARE_WORDS = 3  # words the `rare` move searches on
ROUNDS = 3  # frame alone, after one search round, after two


# --------------------------------------------------------------------------- the reader


def message_text(body: dict[str, Any]) -> str:
    """Every message's text in a Chat Completions request, as the model reads it."""
    out = []
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append(str(content or ""))
    return "\n".join(out)


def question_of(body: dict[str, Any]) -> str:
    """The last user message's text: the question being asked."""
    for m in reversed(body.get("messages") or []):
        if m.get("role") == "user":
            return message_text({"messages": [m]})
    return ""


def rare_words(text: str, n: int = RARE_WORDS) -> str:
    """The `n` rarest distinct words of `text` by the shipped dictionary's corpus frequency
    (a stem's id grows as it gets rarer; one it never saw is rarest), in the text's order."""
    d = dictionary.shipped()
    words = [w for w in dict.fromkeys(d.words(text))
             if w.isalnum() and w not in dictionary.STOP_WORDS]
    rank = {w: d.stem_ids.get(dictionary.stem(w), d.hash_base) for w in words}
    keep = set(sorted(words, key=lambda w: -rank[w])[:n])
    return " ".join(w for w in words if w in keep) or text


def reader_reply(body: dict[str, Any], second: str) -> dict[str, Any]:
    """The reader's next move for a request: a decision only, as a Chat Completions body."""
    messages = body.get("messages") or []
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    calls_made = sum(1 for m in messages[last_user + 1:] if m.get("role") == "tool")
    names = {(t.get("function") or {}).get("name") for t in body.get("tools") or []}
    question = question_of(body)
    call: tuple[str, dict[str, Any]] | None = None
    if body.get("tool_choice") != "none":
        if calls_made == 0 and "memory_search" in names:
            call = ("memory_search", {"query": question})
        elif calls_made == 1 and second == "more" and "memory_more" in names:
            call = ("memory_more", {})
        elif calls_made == 1 and second == "rare" and "memory_search" in names:
            call = ("memory_search", {"query": rare_words(question)})
    message: dict[str, Any] = {"role": "assistant", "content": None if call else ANSWER}
    if call:
        message["tool_calls"] = [{"id": f"call_reader_{calls_made}", "type": "function",
                                  "function": {"name": call[0], "arguments": json.dumps(call[1])}}]
    return {"id": f"chatcmpl-reader-{calls_made}", "object": "chat.completion", "created": 0,
            "model": str(body.get("model", "")),
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if call else "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


class EventLoop:
    """An event loop of its own in a thread, for the reader and the relay; `run` waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="eval-loop",
                                        daemon=True)
        self._thread.start()

    def run[T](self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class Reader:
    """The scripted reader as an HTTP endpoint (Chat Completions, whole bodies) on 127.0.0.1,
    on an event loop of its own in a thread (the relay's too, in process); every request it
    received is kept in order."""

    def __init__(self, second: str = "rare") -> None:
        if second not in SECOND_MOVES:
            raise ConfigError(f"unknown second move {second!r}; one of {', '.join(SECOND_MOVES)}")
        self.second = second
        self.requests: list[dict[str, Any]] = []
        self.loop = EventLoop()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Reader:
        self._server = self.loop.run(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER)
        body = bytearray()
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    request = json.loads(bytes(body))
                    self.requests.append(request)
                    out = json.dumps(reader_reply(request, self.second)).encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[
                        ("content-type", "application/json"), ("content-length", str(len(out)))])))
                    writer.write(conn.send(h11.Data(data=out)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    conn.start_next_cycle()
                    body.clear()
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    break
        except (h11.ProtocolError, ConnectionError):
            pass
        finally:
            writer.close()


# --------------------------------------------------------------------------- through the relay


class Proxy:
    """The pipeline and the real relay, in process: what mitmdump runs, without mitmproxy in
    between (the tests drive the same reader through a real mitmdump). A job's writes run on
    one writer thread after the reply, as the proxy's do; a question waits for the writes
    queued before it for its user (serve.writer.Landing), as it does through the proxy."""

    def __init__(self, pipeline: Pipeline, loop: EventLoop, timeout: float = 60.0) -> None:
        self.pipeline, self.loop = pipeline, loop
        self.relay = Relay(self._run_tool)
        loop.run(self.relay.start())
        self.http = httpx.Client(trust_env=False, timeout=timeout)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-store")

    def close(self) -> None:
        self.http.close()
        self.loop.run(self.relay.stop())
        self.writer.shutdown(wait=True)  # the last reply stored before the store closes

    def send(self, job: Job) -> httpx.Response:
        """Run one job's exchange through the relay, as mitmproxy hands it over: the reply
        the client receives."""
        capture = Capture(job, self.pipeline, self.writer, self.pipeline.landing)
        token = self.relay.submit(capture)
        return self.http.post(f"http://127.0.0.1:{self.relay.port}/",
                              headers={JOB_HEADER: token}, content=b"")

    def written(self) -> None:
        """Wait for every write queued so far (FIFO: a no-op behind them has run)."""
        self.writer.submit(lambda: None).result()

    async def _run_tool(self, name: str, arguments: Any, memory: Any) -> str:
        return self.pipeline.run_tool(name, arguments, memory)


class Outcome(NamedTuple):
    """One question: after the frame alone, one round, two rounds (a reader that had nothing
    to call carries its last request on)."""

    all: tuple[bool, ...]
    any: tuple[bool, ...]
    tokens: tuple[int, ...]  # message text of each request, four characters a token
    category: str
    first: bool  # the conversation's first question
    # Whether the ranking's top rows, best first, held every evidence turn within as many
    # tokens as each request carried: what lexical retrieval itself reaches in that room.
    ranking: tuple[bool, ...] = ()


def check(requests: list[dict[str, Any]], evidence: list[str], category: str = "",
          first: bool = False) -> Outcome:
    """What the reader's requests for one question held: each round's request checked for every
    evidence turn, verbatim."""
    texts = [message_text(b) for b in requests] or [""]
    texts += [texts[-1]] * (ROUNDS - len(texts))
    found = [[e in t for e in evidence] for t in texts[:ROUNDS]]
    return Outcome(tuple(all(f) for f in found), tuple(any(f) for f in found),
                   tuple(token_estimate(t) for t in texts[:ROUNDS]), category, first)


def ask_in_sequence(proxy: Proxy, reader: Reader, case: base.Case) -> list[Outcome]:
    user = case.thread.user_key
    conversation = user + ":reader"
    history: list[dict[str, str]] = []
    out = []
    for k, q in enumerate(case.questions):
        at = q.at + k * base.SEQUENCE_GAP
        history.append({"role": "user", "content": q.text})
        d = proxy.pipeline.prepare(base.chat_request(user, conversation, at, history))
        before = len(reader.requests)
        if d.job is not None:
            proxy.send(d.job).raise_for_status()
            requests = reader.requests[before:]
        else:  # not captured: what would have gone upstream, as the frame alone
            requests = [json.loads(d.body) if d.body is not None else {"messages": history}]
        evidence = [case.thread.messages[i].text for i in q.evidence]
        seen = check(requests, evidence, q.category, k == 0)
        proxy.written()  # the ranking read, as before, after this question's writes
        out.append(seen._replace(ranking=base.ranking_holds(
            proxy.pipeline, user, q.text, at, seen.tokens, evidence)))
        history.append({"role": "assistant", "content": ANSWER})
    return out


def evaluate(dataset: str, path: Path, *, second: str = "rare", pooled: bool = False,
             limits: Cap = Cap(), limit: int = 0, progress: bool = True,
             semantic: bool = True) -> dict[str, Any]:
    if dataset not in base.DATASETS:
        raise ConfigError(f"unknown dataset {dataset!r}; one of {', '.join(base.DATASETS)}")
    cases = list(base.DATASETS[dataset](path))[: limit or None]
    results: list[Outcome] = []
    with Reader(second) as reader, tempfile.TemporaryDirectory() as tmp, tqdm(
            total=len(cases), desc=dataset, unit="conversation", disable=not progress) as bar:
        proxy: Proxy | None = None
        for n, case in enumerate(cases):
            if proxy is None or not pooled:
                if proxy is not None:
                    proxy.close()
                    proxy.pipeline.store.close()
                store = open_memory(Path(tmp) / f"memory-{n}.db")
                proxy = Proxy(Pipeline(store, Settings(
                    upstreams={p: reader.url for p in Provider}, limits=limits,
                    share_pool=pooled, trust_identity=True, tool_rounds=ROUNDS + 1,
                    semantic=semantic)), reader.loop)
            base.feed(proxy.pipeline, case.thread)
            bar.update(1)
            if pooled and n < len(cases) - 1:
                continue
            for c in cases[: n + 1] if pooled else [case]:
                results += ask_in_sequence(proxy, reader, c)
            bar.set_postfix(questions=len(results))
        if proxy is not None:
            proxy.close()
            proxy.pipeline.store.close()
    return report(dataset, pooled, second, results)


@dataclass
class _Tally:
    n: int = 0
    all: list[int] = field(default_factory=lambda: [0] * ROUNDS)
    any: list[int] = field(default_factory=lambda: [0] * ROUNDS)
    tokens: list[int] = field(default_factory=lambda: [0] * ROUNDS)
    ranking: list[int] = field(default_factory=lambda: [0] * ROUNDS)

    def add(self, r: Outcome) -> None:
        self.n += 1
        for k in range(ROUNDS):
            self.all[k] += r.all[k]
            self.any[k] += r.any[k]
            self.tokens[k] += r.tokens[k]
            self.ranking[k] += bool(r.ranking) and r.ranking[k]

    def figures(self) -> dict[str, Any]:
        n = max(self.n, 1)
        return {"questions": self.n} | {
            stage: {"recall_all": round(self.all[k] / n, 4), "recall_any": round(self.any[k] / n, 4),
                    "tokens_mean": round(self.tokens[k] / n),
                    "ranking_recall_all_within_tokens": round(self.ranking[k] / n, 4)}
            for k, stage in enumerate(("frame", "one_round", "two_rounds"))}


def report(dataset: str, pooled: bool, second: str, results: list[Outcome]) -> dict[str, Any]:
    every, first = _Tally(), _Tally()
    by_category: dict[str, _Tally] = {}
    for r in results:
        every.add(r)
        if r.first:
            first.add(r)
        if r.category:
            by_category.setdefault(r.category, _Tally()).add(r)
    return {"dataset": dataset, "memory": "pooled" if pooled else "per-conversation",
            "reader": {"first": "memory_search(query=question)", "second": second}}\
        | every.figures() | {"first_question": first.figures(),
                             "by_category": {c: t.figures() for c, t in sorted(by_category.items())}}


def table(r: dict[str, Any]) -> str:
    """The report as a person reads it."""
    lines = [f"{r['dataset']} ({r['memory']}), {r['questions']} questions in sequence;"
             f" second round: {r['reader']['second']}",
             f"{'':26}{'frame':>16}{'one round':>16}{'two rounds':>16}"]
    rows = [("all", r), ("first question", r["first_question"])]
    rows += list(r["by_category"].items())
    for name, f in rows:
        cells = "".join(f"{f[s]['recall_all']:>8.3f} {f[s]['tokens_mean']:>6}t"
                        for s in ("frame", "one_round", "two_rounds"))
        lines.append(f"{name[:26]:26}{cells}")
    return "\n".join(lines)
