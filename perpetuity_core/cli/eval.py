"""Is the evidence in the frame? An evaluation through the real request pipeline.

Each conversation of a dataset is fed in order, turn by turn, as a chat client would send it
(the dataset's timestamps through `x-perpetuity-time`; replies stored as replies), then every
question is asked in probe mode and the request that would go upstream is checked: is every
labelled evidence turn in it, verbatim?

    recall_all   questions with every evidence turn in the request
    recall_any   questions with at least one
    frame tokens the frame's size (mean, median, p95) against the full history's

Per-conversation: each conversation is its own memory (its own database). Pooled: every
conversation in one memory, each its own user, with pool sharing on (own rows first).
Personal: every conversation in one memory as one person's (the loopback proxy's default,
`--tenants personal`): nothing tells the asker's conversation from the others.

In sequence (`--sequence`), a conversation's questions are asked one after another in one
conversation, as a person asks them (a minute apart, each answered "Noted."), and stored: the
frame then lives as it does for a person (its plan: kept, added to, rebuilt). With `--switch N`
(and `--personal`) one chat asks them all, N of one conversation's then N of the next's: a
person changing the subject, which a chat's leaning must follow.
Beside the request's recall, the ranking's own: its top rows within as many tokens as the
memory the request carried (`memory_tokens`: the frame and its addenda), and within as many as
the memory chosen for that question (`new_memory_tokens`: a new frame or an addendum).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from perpetuity_core.errors import ConfigError
from perpetuity_core.frame import build as frame
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.derived.index import token_estimate
from perpetuity_core.memory.jobs import importers
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import capture
from perpetuity_core.memory.storage.reads import shown_rows
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.serve.exchange import HttpRequest, PendingTurn
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Kind, Message, Part, Provider, Reply, Usage
from perpetuity_core.wire.identity import PERSONAL

HISTORY = 2  # earlier turns each fed request carries, as a chat client's window would


@dataclass(slots=True)
class Question:
    text: str
    at: float
    evidence: list[int]  # indexes into the thread's messages
    category: str = ""  # the dataset's own: LoCoMo's question category, BEAM's ability
    answer: str = ""  # the dataset's gold answer (a rubric for LongMemEval's preferences)
    key: str = ""  # the dataset's own id for the question, else its case and place


@dataclass(slots=True)
class Case:
    thread: importers.Thread
    questions: list[Question] = field(default_factory=list)


# --------------------------------------------------------------------------- datasets


# LoCoMo's category numbers, as its paper names them (5, adversarial, has no evidence to find).
LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}


def locomo(path: Path) -> Iterator[Case]:
    raw = {c.get("sample_id", ""): c for c in json.loads(path.read_text(encoding="utf-8"))}
    for t in importers.locomo(path):
        sample = raw[t.conversation_key.removeprefix("locomo:")]
        index = {label: i for i, label in enumerate(t.labels)}
        at = max(t.times) + 86400
        case = Case(t)
        for k, qa in enumerate(sample.get("qa", [])):
            ids = [e for x in qa.get("evidence", []) for e in re.split(r"[;,\s]+", x) if e]
            ev = [index[e] for e in ids if e in index]
            if ev and qa.get("category") != 5:  # category 5 is adversarial: nothing to find
                case.questions.append(Question(str(qa["question"]), at, ev,
                                               LOCOMO_CATEGORIES.get(qa.get("category"), ""),
                                               str(qa.get("answer", "")), f"{t.user_key}:{k}"))
        yield case


def beam(path: Path) -> Iterator[Case]:
    for t in importers.beam(path):
        folder = path if (path / "chat.json").exists() else path / t.user_key.removeprefix("beam:")
        probes = json.loads((folder / "probing_questions.json").read_text(encoding="utf-8"))
        index = {label: i for i, label in enumerate(t.labels)}
        at = max(t.times) + 86400
        case = Case(t)
        for ability, items in probes.items():
            for q in items:
                ev = [index[str(i)] for i in _ints(q.get("source_chat_ids")) if str(i) in index]
                if ev:
                    case.questions.append(Question(str(q["question"]), at, ev, ability))
        yield case


def longmemeval(path: Path) -> Iterator[Case]:
    """Each LongMemEval question has its own haystack: one case per question, its sessions
    folded into one thread (each session stays its own conversation when fed)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    questions = {f"longmemeval:{q.get('question_id', '')}": q
                 for q in (data if isinstance(data, list) else [data])}
    merged: dict[str, tuple[importers.Thread, list[str]]] = {}
    for t in importers.longmemeval(path):
        m, conv_of = merged.setdefault(t.user_key, (importers.Thread(t.user_key, t.user_key), []))
        m.messages += t.messages
        m.times += t.times
        m.labels += t.labels
        conv_of += [t.conversation_key] * len(t.messages)
    for user, (thread, conv_of) in merged.items():
        q = questions[user]
        thread.model = json.dumps(conv_of)  # read back by feed(): one conversation per session
        answers = _lme_answers(q)
        ev = [i for i, label in enumerate(thread.labels) if label in answers]
        day, _, clock = str(q["question_date"]).split(" ")
        at = datetime.strptime(f"{day} {clock}", "%Y/%m/%d %H:%M").replace(tzinfo=UTC).timestamp()
        yield Case(thread, [Question(str(q["question"]), at, ev, str(q.get("question_type", "")),
                                     str(q.get("answer", "")), str(q.get("question_id", "")))]
                   if ev else [])


def _lme_answers(q: dict[str, Any]) -> set[str]:
    return {f"{sid}:{i}" for sid, session in zip(q["haystack_session_ids"], q["haystack_sessions"],
                                                  strict=True)
            for i, m in enumerate(session) if m.get("has_answer")}


def _ints(value: Any) -> Iterator[int]:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _ints(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _ints(v)


DATASETS = {"locomo": locomo, "beam": beam, "longmemeval": longmemeval}


# --------------------------------------------------------------------------- feeding and asking


def chat_request(user: str, conversation: str, at: float, messages: list[dict[str, str]],
                 probe: bool = False, model: str = "eval", key: str = "sk-eval") -> HttpRequest:
    """A Chat Completions request as a client sends it, the dataset's speaker and time in
    perpetuity's headers."""
    headers = [("authorization", f"Bearer {key}"), ("content-type", "application/json"),
               ("x-perpetuity-user", user), ("x-perpetuity-conversation", conversation),
               ("x-perpetuity-time", datetime.fromtimestamp(at, UTC).isoformat())]
    if probe:
        headers.append(("x-perpetuity-probe", "on"))
    body = {"model": model, "messages": messages}
    return HttpRequest("POST", "127.0.0.1", "/v1/chat/completions", tuple(headers),
                       json.dumps(body).encode(), direct=True)


def feed(pipeline: Pipeline, thread: importers.Thread) -> None:
    """Send a thread through the pipeline: user turns as requests, the others as replies."""
    convs = json.loads(thread.model) if thread.model.startswith("[") else None
    turn = None
    # The role each turn was sent with: an assistant turn with no question before it goes as a
    # request, so as the user's, and must be re-sent that way to be recognised.
    sent: list[str] = []
    for i, m in enumerate(thread.messages):
        conversation = convs[i] if convs else thread.conversation_key
        if m.role == "assistant" and turn is not None and turn.conversation_key == conversation:
            pipeline.store_reply(turn.context, Reply(m, Usage()), thread.times[i], turn.pending)
            sent.append("assistant")
            turn = None
            continue
        sent.append("user")
        window = [j for j in range(max(0, i - HISTORY), i + 1)
                  if not convs or convs[j] == conversation]
        messages = [{"role": sent[j], "content": thread.messages[j].text} for j in window]
        d = pipeline.prepare(chat_request(thread.user_key, conversation, thread.times[i], messages))
        if d.job is None:
            raise ConfigError(f"turn {i} of {thread.conversation_key} was not captured: {d.note}")
        turn = _Turn(conversation, pipeline.store_turn(d.job.pending), d.job.pending)


class Result(NamedTuple):
    """One question's outcome."""

    all: bool  # every evidence turn in the request
    any: bool
    tokens: int  # the frame's
    history: int  # the whole history's, up to the question
    category: str
    # In sequence: the memory the request carried (frame and addenda), the memory chosen for
    # this question, and whether the ranking's top rows held all the evidence within each.
    memory: int = 0
    new_memory: int = 0
    ranked_all: bool = False
    ranked_new_all: bool = False
    request: int = 0  # every message's text the request carried, four characters a token
    first: bool = False  # the conversation's first question
    made: str = ""  # what the plan made for it: a frame, an addendum, or nothing new
    ranked_fixed: bool = False  # the ranking's top rows held all the evidence in RANKING_TOKENS


@dataclass(slots=True)
class _Turn:
    conversation_key: str
    context: capture.TurnContext
    pending: PendingTurn


def ask(pipeline: Pipeline, thread: importers.Thread, q: Question) -> tuple[str, int]:
    """The request text that would go upstream for a question, and its frame's tokens."""
    req = chat_request(thread.user_key, thread.user_key + ":question", q.at,
                   [{"role": "user", "content": q.text}], probe=True)
    d = pipeline.prepare(req)
    body = json.loads(d.body) if d.body is not None else json.loads(req.body)
    text = "\n".join(str(m.get("content", "")) for m in body["messages"])
    return text, d.frame.tokens if d.frame else 0


def evaluate(dataset: str, path: Path, *, pooled: bool = False, limits: Cap = Cap(),
             frames: Path | None = None, limit: int = 0, progress: bool = True,
             sequence: bool = False, personal: bool = False,
             semantic: bool = True, switch: int = 0) -> dict[str, Any]:
    if dataset not in DATASETS:
        raise ConfigError(f"unknown dataset {dataset!r}; one of {', '.join(DATASETS)}")
    if switch and not (sequence and personal):
        raise ConfigError("--switch asks one chat in sequence of a person's memory:"
                          " it needs --sequence --personal")
    cases = list(DATASETS[dataset](path))
    if limit:
        cases = cases[:limit]
    pooled = pooled or personal
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(
            total=len(cases), desc=dataset, unit="conversation", disable=not progress) as bar:
        store: Store | None = None
        for n, case in enumerate(cases):
            if store is None or not pooled:
                if store is not None:
                    store.close()
                store = open_memory(Path(tmp) / f"memory-{n}.db")
                pipeline = Pipeline(store, Settings(
                    upstreams={p: "http://127.0.0.1:9" for p in Provider}, limits=limits,
                    share_pool=pooled and not personal, trust_identity=True,  # its speakers
                    personal=personal, semantic=semantic))
            feed(pipeline, case.thread)
            bar.update(1)
            if pooled and n < len(cases) - 1:
                continue
            if switch:
                results += _ask_in_sequence(pipeline, switching(cases, switch), "switching")
            else:
                for c in cases[: n + 1] if pooled else [case]:
                    results += (_ask_in_sequence(pipeline, [(c, q) for q in c.questions])
                                if sequence else _ask_all(pipeline, c, frames))
            bar.set_postfix(questions=len(results))
        if store is not None:
            store.close()
    memory = "personal" if personal else "pooled" if pooled else "per-conversation"
    report = _report(dataset, f"{memory}, one chat switching every {switch}" if switch else memory,
                     limits, results) | {"semantic": semantic}
    if sequence:
        report["sequence"] = _sequence_report(results)
    return report


def _ask_all(pipeline: Pipeline, case: Case, frames: Path | None) -> list[Result]:
    out = []
    for k, q in enumerate(case.questions):
        text, tokens = ask(pipeline, case.thread, q)
        found = [case.thread.messages[i].text in text for i in q.evidence]
        history = sum(token_estimate(m.text) for m, at in zip(case.thread.messages,
                                                               case.thread.times) if at <= q.at)
        out.append(Result(all(found), any(found), tokens, history, q.category))
        if frames is not None:
            frames.mkdir(parents=True, exist_ok=True)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{case.thread.user_key}-{k}.txt")
            (frames / name).write_text(f"Q: {q.text}\nfound: {found}\n\n{text}", encoding="utf-8")
    return out


SEQUENCE_GAP = 60.0  # seconds between questions asked in sequence


def switching(cases: list[Case], block: int) -> list[tuple[Case, Question]]:
    """Every case's questions, `block` of one case's then `block` of the next's, round and round
    until all are asked: one chat changing its subject."""
    out: list[tuple[Case, Question]] = []
    for start in range(0, max((len(c.questions) for c in cases), default=0), block):
        out += [(c, q) for c in cases for q in c.questions[start:start + block]]
    return out


def _ask_in_sequence(pipeline: Pipeline, asked: list[tuple[Case, Question]],
                     chat: str = "") -> list[Result]:
    """The questions (each with the case it is about), one after another in one conversation
    (the first case's own, else `chat`), each stored with its reply; the request that went
    upstream checked for the evidence."""
    if not asked:
        return []
    user = asked[0][0].thread.user_key
    conversation = f"{user}:{chat or 'sequence'}"
    history: list[dict[str, str]] = []
    out = []
    # One chat asking about several conversations asks after the last of their dates: its own
    # clock only moves forward.
    latest = max(q.at for _, q in asked) if chat else 0.0
    for k, (case, q) in enumerate(asked):
        at = max(q.at, latest) + k * SEQUENCE_GAP
        history.append({"role": "user", "content": q.text})
        d = pipeline.prepare(chat_request(user, conversation, at, history))
        sent = json.loads(d.body)["messages"] if d.body is not None else history
        text = "\n".join(str(m.get("content", "")) for m in sent)
        # The memory the request carried: its frame and addenda (the recall tools' note is
        # instructions, not memory).
        laid = d.recall.plan if d.recall is not None and d.body is not None else None
        memory = laid.frame_tokens + laid.insert_tokens if laid else 0
        new = d.frame.tokens if d.frame else 0
        evidence = [case.thread.messages[i].text for i in q.evidence]
        found = [e in text for e in evidence]
        history_tokens = sum(token_estimate(m.text) for m, t in zip(
            case.thread.messages, case.thread.times) if t <= q.at)
        made = d.recall.made if d.recall is not None and d.frame else "none"
        in_memory, in_new, in_fixed = ranking_holds(pipeline, user, q.text, at,
                                                    (memory, new, RANKING_TOKENS), evidence)
        out.append(Result(all(found), any(found), new, history_tokens, q.category, memory, new,
                          in_memory, in_new,
                          sum(token_estimate(str(m.get("content", ""))) for m in sent),
                          k == 0, made, in_fixed))
        if d.job is not None:
            turn = pipeline.store_turn(d.job.pending)
            pipeline.store_reply(turn, Reply(noted(), Usage()), at, d.job.pending)
        history.append({"role": "assistant", "content": "Noted."})
    return out


def noted() -> Message:
    return Message("assistant", (Part(Kind.TEXT, "Noted."),))


RANKING_DEPTH = 2_000  # rows the ranking is read to: past any request's tokens on every dataset
RANKING_TOKENS = 4_000  # the ranking's recall within a fixed budget too, whatever the frame took


def ranking_holds(pipeline: Pipeline, user: str, query: str, at: float,
                  budgets: tuple[int, ...], evidence: list[str]) -> tuple[bool, ...]:
    """For each of `budgets` (tokens), do the ranking's top rows, taken best first while they
    fit, hold every piece of evidence? What lexical retrieval itself holds in that room, the
    bar for a frame or a tool answer in the same tokens."""
    user_id = pipeline.store.find_user(PERSONAL if pipeline.settings.personal else user)
    if user_id is None:
        return tuple(False for _ in budgets)
    hits = frame.search(pipeline.scanner, query, user_id, at, limit=RANKING_DEPTH)
    rows = shown_rows(pipeline.store.db, [h.item_id for h in hits])
    out = []
    for tokens in budgets:
        taken: list[str] = []
        used = 0
        for h in hits:
            r = rows.get(h.item_id)
            if r is not None and used + (cost := token_estimate(r.text)) <= tokens:
                taken.append(r.text)
                used += cost
        text = "\n".join(taken)
        out.append(tokens > 0 and all(e in text for e in evidence))
    return tuple(out)


def _sequence_report(results: list[Result]) -> dict[str, Any]:
    """In sequence: the request's recall and size beside the ranking's recall within the same
    memory, for every question, the first of each conversation, and by what the plan made."""

    def figures(rs: list[Result]) -> dict[str, Any]:
        n = max(len(rs), 1)
        return {
            "questions": len(rs),
            "recall_all": round(sum(r.all for r in rs) / n, 4),
            "request_tokens_mean": round(sum(r.request for r in rs) / n),
            "memory_tokens_mean": round(sum(r.memory for r in rs) / n),
            "ranking_recall_all_within_memory_tokens": round(sum(r.ranked_all for r in rs) / n,
                                                             4),
            # Where the two differ: questions only the frame held whole, and only the ranking.
            "frame_only": sum(r.all and not r.ranked_all for r in rs),
            "ranking_only": sum(r.ranked_all and not r.all for r in rs),
            "new_memory_tokens_mean": round(sum(r.new_memory for r in rs) / n),
            "ranking_recall_all_within_new_memory_tokens": round(
                sum(r.ranked_new_all for r in rs) / n, 4),
            f"ranking_recall_all_within_{RANKING_TOKENS}_tokens": round(
                sum(r.ranked_fixed for r in rs) / n, 4),
        }

    made = sorted({r.made for r in results})
    return figures(results) | {
        "first_question": figures([r for r in results if r.first]),
        "by_made": {m: figures([r for r in results if r.made == m]) for m in made}}


def _report(dataset: str, memory: str, limits: Cap,
            results: list[Result]) -> dict[str, Any]:
    if not results:
        return {"dataset": dataset, "questions": 0}
    all_, any_, tokens, history = (np.asarray(c) for c in list(zip(*results))[:4])
    by_category: dict[str, list[Result]] = {}
    for r in results:
        by_category.setdefault(r.category, []).append(r)
    return {
        "dataset": dataset, "memory": memory,
        "questions": len(results),
        "recall_all": round(float(all_.mean()), 4), "recall_any": round(float(any_.mean()), 4),
        "frame_tokens": {"mean": round(float(tokens.mean())), "median": int(np.median(tokens)),
                         "p95": int(np.percentile(tokens, 95))},
        "history_tokens": {"mean": round(float(history.mean()))},
        "cap": {"floor": limits.floor, "ceiling": limits.ceiling},
        "by_category": {
            c: {"questions": len(rs), "recall_all": round(sum(r.all for r in rs) / len(rs), 4),
                "frame_tokens_mean": round(sum(r.tokens for r in rs) / len(rs))}
            for c, rs in sorted(by_category.items()) if c},
    }
