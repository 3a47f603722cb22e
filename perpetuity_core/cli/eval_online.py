"""A real-model evaluation, for users with a key: each question answered by a model through the
proxy (the frame and the recall tools, the relay's tool loop in process), graded by a judge
model with the benchmark's own judge prompt.

    perpetuity eval longmemeval FILE --online --model gpt-4o-mini --judge gpt-4o
    perpetuity eval locomo locomo10.json --online --model gpt-4o-mini --judge gpt-4o-mini

Any OpenAI-compatible Chat Completions endpoint (`--base-url`, the key in $OPENAI_API_KEY or
the variable `--key-env` names). Each conversation is fed as `perpetuity eval` feeds it; each
question is then asked in a conversation of its own and stored, as a person's would be. Answers
and verdicts go to a cache (JSON lines, `--cache`), read back on the next run: an interrupted
run resumes where it stopped, and a conversation whose questions are all cached is not fed.

The judges: LongMemEval's per question type (its src/evaluation/evaluate_qa.py; yes or no, an
abstention question by its own prompt), and for LoCoMo, which its paper grades by F1, the
LLM-judge prompt Mem0's evaluation made usual (evaluation/metrics/llm_judge.py; CORRECT or
WRONG). Reported: accuracy overall and per question type, the tokens the provider counted, and
their cost where the model's price is known (`--price IN OUT`, dollars a million tokens).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from perpetuity_core.cli import eval as base
from perpetuity_core.cli.eval_reader import EventLoop, Proxy
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider

DATASETS = ("locomo", "longmemeval")
BASE_URL = "https://api.openai.com"
TIMEOUT = 300.0  # seconds one answer (all its tool rounds) or one verdict may take
# Dollars a million tokens (input, output), as the providers list them; --price overrides.
PRICES = {"gpt-4o-mini": (0.15, 0.60), "gpt-4o": (2.50, 10.00), "gpt-4.1-mini": (0.40, 1.60),
          "gpt-4.1": (2.00, 8.00), "gpt-4.1-nano": (0.10, 0.40), "gpt-5-mini": (0.25, 2.00)}

# LongMemEval's judge, per question type (xiaowu0162/LongMemEval, src/evaluation/evaluate_qa.py).
_LME_RULE = ("I will give you a question, a correct answer, and a response from a model. Please"
             " answer yes if the response contains the correct answer. Otherwise, answer no. If"
             " the response is equivalent to the correct answer or contains all the intermediate"
             " steps to get the correct answer, you should also answer yes. If the response only"
             " contains a subset of the information required by the answer, answer no.")
_LME_ASK = ("\n\nQuestion: {}\n\nCorrect Answer: {}\n\nModel Response: {}\n\nIs the model response"
            " correct? Answer yes or no only.")
LME_JUDGE = {
    "single-session-user": _LME_RULE + " " + _LME_ASK,
    "single-session-assistant": _LME_RULE + " " + _LME_ASK,
    "multi-session": _LME_RULE + " " + _LME_ASK,
    "temporal-reasoning": _LME_RULE + " In addition, do not penalize off-by-one errors for the"
    " number of days. If the question asks for the number of days/weeks/months, etc., and the"
    " model makes off-by-one errors (e.g., predicting 19 days when the answer is 18), the model's"
    " response is still correct. " + _LME_ASK,
    "knowledge-update": "I will give you a question, a correct answer, and a response from a"
    " model. Please answer yes if the response contains the correct answer. Otherwise, answer no."
    " If the response contains some previous information along with an updated answer, the"
    " response should be considered as correct as long as the updated answer is the required"
    " answer." + _LME_ASK,
    "single-session-preference": "I will give you a question, a rubric for desired personalized"
    " response, and a response from a model. Please answer yes if the response satisfies the"
    " desired response. Otherwise, answer no. The model does not need to reflect all the points"
    " in the rubric. The response is correct as long as it recalls and utilizes the user's"
    " personal information correctly.\n\nQuestion: {}\n\nRubric: {}\n\nModel Response: {}\n\nIs"
    " the model response correct? Answer yes or no only.",
}
LME_ABSTENTION = (
    "I will give you an unanswerable question, an explanation, and a response from a model."
    " Please answer yes if the model correctly identifies the question as unanswerable. The model"
    " could say that the information is incomplete, or some other information is given but the"
    " asked information is not.\n\nQuestion: {}\n\nExplanation: {}\n\nModel Response: {}\n\nDoes"
    " the model correctly identify the question as unanswerable? Answer yes or no only.")
# LoCoMo's usual LLM judge (mem0ai/mem0, evaluation/metrics/llm_judge.py).
LOCOMO_JUDGE = """Your task is to label an answer to a question as 'CORRECT' or 'WRONG'. You will be given the following data:
    (1) a question (posed by one user to another user),
    (2) a 'gold' (ground truth) answer,
    (3) a generated answer
which you will score as CORRECT/WRONG.

The point of the question is to ask about something one user should know about the other user based on their prior conversations.
The gold answer will usually be a concise and short answer that includes the referenced topic, for example:
Question: Do you remember what I got the last time I went to Hawaii?
Gold answer: A shell necklace
The generated answer might be much longer, but you should be generous with your grading - as long as it touches on the same topic as the gold answer, it should be counted as CORRECT.

For time related questions, the gold answer will be a specific date, month, year, etc. The generated answer might be much longer or use relative time references (like "last Tuesday" or "next month"), but you should be generous with your grading - as long as it refers to the same date or time period as the gold answer, it should be counted as CORRECT. Even if the format differs (e.g., "May 7th" vs "7 May"), consider it CORRECT if it's the same date.

Now it's time for the real question:
Question: {question}
Gold answer: {gold_answer}
Generated answer: {generated_answer}

First, provide a short (one sentence) explanation of your reasoning, then finish with CORRECT or WRONG.
Do NOT include both CORRECT and WRONG in your response, or it will break the evaluation script.

Just return the label CORRECT or WRONG in a json format with the key as "label".
"""  # noqa: E501 - the benchmark's prompt, line for line


def judge_prompt(dataset: str, q: base.Question, answer: str) -> str:
    if dataset == "locomo":
        return LOCOMO_JUDGE.format(question=q.text, gold_answer=q.answer, generated_answer=answer)
    if "_abs" in q.key:
        return LME_ABSTENTION.format(q.text, q.answer, answer)
    template = LME_JUDGE.get(q.category)
    if template is None:
        raise ConfigError(f"LongMemEval has no judge prompt for question type {q.category!r}")
    return template.format(q.text, q.answer, answer)


def verdict(dataset: str, said: str) -> bool:
    """The judge's reply read as its benchmark reads it."""
    if dataset == "longmemeval":
        return "yes" in said.lower()
    try:
        label = str(json.loads(said[said.find("{"):said.rfind("}") + 1]).get("label", ""))
    except (ValueError, AttributeError):
        label = said
    return "CORRECT" in label.upper() and "WRONG" not in label.upper()


class Cache:
    """Answers and verdicts by question, model and judge: one JSON line each, appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry

    def put(self, entry: dict[str, Any]) -> None:
        self.entries[entry["key"]] = entry
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")


@dataclass
class Online:
    dataset: str
    model: str
    judge: str
    key: str
    base_url: str = BASE_URL
    http: httpx.Client = field(default_factory=lambda: httpx.Client(trust_env=False,
                                                                    timeout=TIMEOUT))

    def cache_key(self, q: base.Question) -> str:
        return json.dumps([self.dataset, q.key, self.model, self.judge])

    def answer(self, proxy: Proxy, case: base.Case, k: int, q: base.Question) -> dict[str, Any]:
        """The model's answer through the pipeline and the relay, and its usage."""
        user = case.thread.user_key
        req = base.chat_request(user, f"{user}:online:{k}", q.at,
                                [{"role": "user", "content": q.text}], model=self.model,
                                key=self.key)
        d = proxy.pipeline.prepare(req)
        if d.job is None:
            raise ConfigError(f"the question was not sent through memory: {d.note}")
        reply = proxy.send(d.job)
        if reply.status_code != 200:
            raise ConfigError(f"the model's provider answered {reply.status_code}:"
                              f" {reply.text[:300]}")
        body = reply.json()
        said = str(((body.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
        return {"answer": said, "usage": body.get("usage") or {}, "rounds": len(d.job.rounds)}

    def grade(self, q: base.Question, answer: str) -> dict[str, Any]:
        """The judge's verdict, asked directly (never through memory)."""
        body = {"model": self.judge, "temperature": 0, "messages": [
            {"role": "user", "content": judge_prompt(self.dataset, q, answer)}]}
        if self.dataset == "longmemeval":
            body["max_tokens"] = 10  # as the benchmark asks its judge
        reply = self.http.post(f"{self.base_url.rstrip('/')}/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {self.key}"})
        if reply.status_code != 200:
            raise ConfigError(f"the judge's provider answered {reply.status_code}:"
                              f" {reply.text[:300]}")
        data = reply.json()
        said = str(((data.get("choices") or [{}])[0].get("message") or {}).get("content") or "")
        return {"judged": said, "correct": verdict(self.dataset, said),
                "judge_usage": data.get("usage") or {}}


def evaluate(dataset: str, path: Path, *, model: str, judge: str, key: str,
             base_url: str = BASE_URL, cache: Path | None = None, limits: Cap = Cap(),
             limit: int = 0, price: tuple[float, float] | None = None,
             judge_price: tuple[float, float] | None = None,
             progress: bool = True) -> dict[str, Any]:
    if dataset not in DATASETS:
        raise ConfigError(f"the online evaluation runs on {' and '.join(DATASETS)}, not {dataset}")
    cases = list(base.DATASETS[dataset](path))[: limit or None]
    run = Online(dataset, model, judge, key, base_url)
    store = Cache(cache or Path(f"perpetuity-eval-{dataset}-{model}.jsonl"))
    done: list[tuple[base.Question, dict[str, Any]]] = []
    loop = EventLoop()
    try:
        with tempfile.TemporaryDirectory() as tmp, tqdm(
                total=sum(len(c.questions) for c in cases), desc=f"{dataset} {model}",
                unit="question", disable=not progress) as bar:
            for n, case in enumerate(cases):
                if all(run.cache_key(q) in store.entries for q in case.questions):
                    done += [(q, store.entries[run.cache_key(q)]) for q in case.questions]
                    bar.update(len(case.questions))
                    continue
                memory = open_memory(Path(tmp) / f"memory-{n}.db")
                proxy = Proxy(Pipeline(memory, Settings(
                    upstreams={p: base_url for p in Provider}, limits=limits,
                    trust_identity=True)), loop, timeout=TIMEOUT)
                try:
                    base.feed(proxy.pipeline, case.thread)
                    for k, q in enumerate(case.questions):
                        entry = store.entries.get(run.cache_key(q))
                        if entry is None:
                            entry = {"key": run.cache_key(q), "question": q.text,
                                     "gold": q.answer, "type": q.category}
                            entry |= run.answer(proxy, case, k, q)
                            entry |= run.grade(q, entry["answer"])
                            store.put(entry)
                        done.append((q, entry))
                        bar.update(1)
                finally:
                    proxy.close()
                    memory.close()
    finally:
        loop.close()
        run.http.close()
    return report(dataset, model, judge, store.path, done, price or PRICES.get(model),
                  judge_price or PRICES.get(judge))


def report(dataset: str, model: str, judge: str, cache: Path,
           done: list[tuple[base.Question, dict[str, Any]]], price: tuple[float, float] | None,
           judge_price: tuple[float, float] | None) -> dict[str, Any]:
    n = max(len(done), 1)
    by_type: dict[str, list[bool]] = {}
    for q, e in done:
        by_type.setdefault(q.category or "all", []).append(bool(e["correct"]))

    def used(field: str, counter: str) -> int:
        return sum(int((e.get(field) or {}).get(counter) or 0) for _, e in done)

    tokens = {"answer_input": used("usage", "prompt_tokens"),
              "answer_output": used("usage", "completion_tokens"),
              "judge_input": used("judge_usage", "prompt_tokens"),
              "judge_output": used("judge_usage", "completion_tokens")}

    def dollars(p: tuple[float, float] | None, i: int, o: int) -> float | None:
        return None if p is None else round((i * p[0] + o * p[1]) / 1e6, 4)

    answer_cost = dollars(price, tokens["answer_input"], tokens["answer_output"])
    judge_cost = dollars(judge_price, tokens["judge_input"], tokens["judge_output"])
    return {
        "dataset": dataset, "model": model, "judge": judge, "questions": len(done),
        "accuracy": round(sum(bool(e["correct"]) for _, e in done) / n, 4),
        "by_type": {t: {"questions": len(v), "accuracy": round(sum(v) / len(v), 4)}
                    for t, v in sorted(by_type.items())},
        "tokens": tokens, "answer_input_tokens_mean": round(tokens["answer_input"] / n),
        "cost_usd": {"answer": answer_cost, "judge": judge_cost,
                     "total": None if answer_cost is None or judge_cost is None
                     else round(answer_cost + judge_cost, 4)},
        "cache": str(cache),
    }


def api_key(variable: str) -> str:
    key = os.environ.get(variable, "")
    if not key:
        raise ConfigError(f"the online evaluation needs a key in ${variable}")
    return key
