"""`perpetuity eval --online`: a model answers through memory, a judge grades; here the fake
provider is both, so nothing leaves the machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perpetuity_core.cli import eval_online
from perpetuity_core.cli.main import main
from tests.fake_provider import FakeProvider, Text, ToolCall
from tests.test_evaluate import LONGMEMEVAL, tiny_locomo


def test_online_locomo_end_to_end_and_resumed(tmp_path: Path, fake: FakeProvider) -> None:
    path, cache = tiny_locomo(tmp_path / "l.json"), tmp_path / "cache.jsonl"
    fake.script(ToolCall("memory_search", {"query": "cat"}, call_id="call_1"), Text("Pixel."),
                Text('Same pet. {"label": "CORRECT"}'),
                Text("In July."), Text('{"label": "WRONG"}'))
    run = dict(model="gpt-4o-mini", judge="gpt-4o-mini", key="sk-test", base_url=fake.url,
               cache=cache, progress=False)
    report = eval_online.evaluate("locomo", path, **run)
    assert report["questions"] == 2 and report["accuracy"] == 0.5
    assert report["by_type"] == {"single-hop": {"questions": 1, "accuracy": 1.0},
                                 "temporal": {"questions": 1, "accuracy": 0.0}}
    assert report["tokens"]["answer_input"] > 0 and report["tokens"]["judge_input"] > 0
    assert report["cost_usd"]["total"] is not None
    asked, searched, judged = (r.json for r in fake.requests[:3])
    # The answer went through memory: the frame and our tools, then the tool's answer.
    assert any("Pixel" in str(m["content"]) for m in asked["messages"][:-1])
    assert {t["function"]["name"] for t in asked["tools"]} >= {"memory_search", "memory_more"}
    assert searched["messages"][-1]["role"] == "tool"
    assert "memory_search" not in json.dumps(judged) and "Gold answer: Pixel" in json.dumps(judged)
    assert len(cache.read_text().splitlines()) == 2
    # Resumed from the cache: no request reaches the provider again.
    seen = len(fake.requests)
    again = eval_online.evaluate("locomo", path, **run)
    assert again == report and len(fake.requests) == seen


@pytest.mark.skipif(not LONGMEMEVAL.exists(), reason=f"LongMemEval question not at {LONGMEMEVAL}")
def test_online_longmemeval_command(tmp_path: Path, fake: FakeProvider,
                                    monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PERPETUITY_TEST_KEY", "sk-test")
    fake.script(Text("I do not know."), Text("no"))
    assert main(["eval", "longmemeval", str(LONGMEMEVAL), "--online", "--model", "m",
                 "--judge", "j", "--base-url", fake.url, "--key-env", "PERPETUITY_TEST_KEY",
                 "--cache", str(tmp_path / "c.jsonl"), "--price", "1", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["questions"] == 1 and report["accuracy"] == 0.0
    assert report["cost_usd"]["answer"] is not None and report["cost_usd"]["judge"] is None
    judged = fake.requests[-1].json
    assert judged["model"] == "j" and judged["max_tokens"] == 10
    assert "Answer yes or no only." in judged["messages"][0]["content"]


def test_online_needs_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PERPETUITY_NO_KEY", raising=False)
    path = str(tiny_locomo(tmp_path / "l.json"))
    assert main(["eval", "locomo", path, "--online", "--model", "m", "--judge", "j",
                 "--key-env", "PERPETUITY_NO_KEY"]) == 1
    assert main(["eval", "locomo", path, "--online"]) == 1


def test_verdicts_read_as_their_benchmarks_read_them() -> None:
    assert eval_online.verdict("locomo", 'It matches. {"label": "CORRECT"}')
    assert not eval_online.verdict("locomo", '{"label": "WRONG"}')
    assert eval_online.verdict("locomo", "CORRECT")
    assert eval_online.verdict("longmemeval", "Yes.")
    assert not eval_online.verdict("longmemeval", "No")
