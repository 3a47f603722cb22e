"""`perpetuity eval --reader search`: a scripted reader in the model's place, its rounds through
the relay's tool loop, in process and through a real mitmdump."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from perpetuity_core.cli import eval as base
from perpetuity_core.cli import eval_reader
from perpetuity_core.cli.main import main
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider
from tests.conftest import start_proxy, stop_proxy
from tests.test_evaluate import LONGMEMEVAL, tiny_locomo


def test_reader_reply_is_search_then_second_move_then_answer() -> None:
    tools = [{"type": "function", "function": {"name": n}} for n in ("memory_search", "memory_more")]
    asked = {"messages": [{"role": "system", "content": "frame"},
                          {"role": "user", "content": "Where does Ada live?"}], "tools": tools}
    first = eval_reader.reader_reply(asked, "more")["choices"][0]["message"]
    call = first["tool_calls"][0]["function"]
    assert call["name"] == "memory_search"
    assert json.loads(call["arguments"]) == {"query": "Where does Ada live?"}
    answered = {**asked, "messages": [*asked["messages"], first,
                                      {"role": "tool", "tool_call_id": "x", "content": "r"}]}
    second = eval_reader.reader_reply(answered, "more")["choices"][0]["message"]
    assert second["tool_calls"][0]["function"]["name"] == "memory_more"
    rare = eval_reader.reader_reply(answered, "rare")["choices"][0]["message"]
    assert json.loads(rare["tool_calls"][0]["function"]["arguments"])["query"] == "ada live"
    last = {**answered, "tool_choice": "none"}
    assert eval_reader.reader_reply(last, "more")["choices"][0]["message"]["content"] == "Noted."


def test_rounds_in_process(tmp_path: Path) -> None:
    report = eval_reader.evaluate("locomo", tiny_locomo(tmp_path / "l.json"), progress=False)
    assert report["questions"] == 2 and report["first_question"]["questions"] == 1
    for stage in ("frame", "one_round", "two_rounds"):
        assert report[stage]["recall_all"] == 1.0 and report[stage]["tokens_mean"] > 0
        # The ranking's own bar in the same room: this tiny memory fits whole in a request.
        assert report[stage]["ranking_recall_all_within_tokens"] == 1.0
    # Each round's request carries the one before it and the tool's answer.
    assert (report["frame"]["tokens_mean"] < report["one_round"]["tokens_mean"]
            <= report["two_rounds"]["tokens_mean"])


def test_ranking_holds_only_what_fits_its_tokens(tmp_path: Path) -> None:
    case = next(base.locomo(tiny_locomo(tmp_path / "l.json")))
    store = open_memory(tmp_path / "memory.db")
    pipeline = Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                        trust_identity=True))
    base.feed(pipeline, case.thread)
    q = case.questions[0]
    evidence = [case.thread.messages[i].text for i in q.evidence]
    held = base.ranking_holds(pipeline, case.thread.user_key, q.text, q.at, (0, 1, 100_000),
                              evidence)
    store.close()
    assert held == (False, False, True)


def test_reader_rounds_through_a_real_mitmdump(tmp_path: Path) -> None:
    """The memory fed by the pipeline, then the question asked through mitmdump with the
    scripted reader as its upstream: three requests reach the reader (frame; the search's
    answer; the second move's), as in process."""
    case = next(base.locomo(tiny_locomo(tmp_path / "l.json")))
    db = tmp_path / "memory.db"
    store = open_memory(db)
    base.feed(Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                       trust_identity=True)),
              case.thread)
    store.close()
    with eval_reader.Reader("more") as reader:
        proxy = start_proxy(tmp_path, reader.url, "--set", "perpetuity_trust_identity=true")
        try:
            q = case.questions[0]
            req = base.chat_request(case.thread.user_key, "asked", q.at,
                                    [{"role": "user", "content": q.text}])
            reply = httpx.post(proxy.url + req.path, headers=dict(req.headers), content=req.body,
                               timeout=30, trust_env=False)
        finally:
            stop_proxy(proxy)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "Noted."
    assert len(reader.requests) == 3
    frame, searched, more = reader.requests
    assert [m["role"] for m in searched["messages"][-2:]] == ["assistant", "tool"]
    call = searched["messages"][-2]["tool_calls"][0]["function"]
    assert call["name"] == "memory_search" and json.loads(call["arguments"])["query"] == q.text
    assert more["messages"][-2]["tool_calls"][0]["function"]["name"] == "memory_more"
    # The frame showed every row of this small memory: the search repeats none of them.
    answer = searched["messages"][-1]["content"]
    assert "nothing you have not seen this turn matches" in answer
    evidence = [case.thread.messages[i].text for i in q.evidence]
    outcome = eval_reader.check(reader.requests, evidence)
    assert outcome.all == (True, True, True)
    assert outcome.tokens[0] < outcome.tokens[1] <= outcome.tokens[2]


def test_eval_reader_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tiny_locomo(tmp_path / "l.json"))
    assert main(["eval", "locomo", path, "--reader", "search", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["two_rounds"]["recall_all"] == 1.0
    assert main(["eval", "locomo", path, "--reader", "search", "--second", "more",
                 "--pooled"]) == 0
    assert "two rounds" in capsys.readouterr().out


@pytest.mark.skipif(not LONGMEMEVAL.exists(), reason=f"LongMemEval question not at {LONGMEMEVAL}")
def test_longmemeval_rounds() -> None:
    report = eval_reader.evaluate("longmemeval", LONGMEMEVAL, progress=False)
    assert report["questions"] == 1
    assert report["two_rounds"]["recall_any"] >= report["frame"]["recall_any"]
