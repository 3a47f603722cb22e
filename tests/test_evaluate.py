"""`perpetuity eval`: datasets fed through the pipeline, evidence looked for in the frame."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from perpetuity_core.cli.eval import DATASETS, evaluate, switching
from perpetuity_core.cli.main import main
from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.cap import Cap
from tests.conftest import SHARED

LONGMEMEVAL = SHARED / "data" / "longmemeval" / "longmemeval_s_one_question.json"


def tiny_locomo(path: Path) -> Path:
    turns = [("Ana", "I adopted a grey cat named Pixel last week."), ("Ben", "Pixel is a great name!"),
             ("Ana", "My brother Leo starts at the fire academy in June."),
             ("Ben", "Tell Leo good luck from me.")]
    conversation = {"speaker_a": "Ana", "speaker_b": "Ben",
                    "session_1_date_time": "1:56 pm on 8 May, 2023",
                    "session_1": [{"speaker": s, "dia_id": f"D1:{i + 1}", "text": t}
                                  for i, (s, t) in enumerate(turns[:2])],
                    "session_2_date_time": "10:00 am on 20 May, 2023",
                    "session_2": [{"speaker": s, "dia_id": f"D2:{i + 1}", "text": t}
                                  for i, (s, t) in enumerate(turns[2:])]}
    qa = [{"question": "What is the name of Ana's cat?", "answer": "Pixel", "evidence": ["D1:1"],
           "category": 4},
          {"question": "When does Leo start at the fire academy?", "answer": "June",
           "evidence": ["D2:1"], "category": 2},
          {"question": "Adversarial, not counted", "evidence": ["D1:2"], "category": 5}]
    path.write_text(json.dumps([{"sample_id": "tiny", "conversation": conversation, "qa": qa}]))
    return path


def test_locomo_evidence_in_the_frame(tmp_path: Path) -> None:
    report = evaluate("locomo", tiny_locomo(tmp_path / "locomo.json"), limits=Cap(500, 1000),
                      frames=tmp_path / "frames", progress=False)
    assert report["questions"] == 2 and report["recall_all"] == 1.0
    assert 0 < report["frame_tokens"]["mean"] <= 1000
    written = sorted((tmp_path / "frames").iterdir())
    assert len(written) == 2 and "Pixel" in written[0].read_text()
    pooled = evaluate("locomo", tmp_path / "locomo.json", pooled=True, progress=False)
    assert pooled["memory"] == "pooled" and pooled["questions"] == 2


def test_in_sequence_the_request_is_measured_beside_the_ranking(tmp_path: Path) -> None:
    report = evaluate("locomo", tiny_locomo(tmp_path / "locomo.json"), limits=Cap(500, 1000),
                      progress=False, sequence=True)
    seq = report["sequence"]
    assert seq["questions"] == 2 and seq["first_question"]["questions"] == 1
    # The request carries the frame, the questions asked so far and their answers.
    assert seq["request_tokens_mean"] > seq["memory_tokens_mean"] > 0
    assert sum(m["questions"] for m in seq["by_made"].values()) == 2
    assert seq["frame_only"] == seq["ranking_only"] == 0  # both hold both questions


def test_personal_pools_every_conversation_as_one_persons(tmp_path: Path) -> None:
    """The loopback proxy's default: every conversation one person's memory, nothing telling
    the asker's conversation from another's; the ranking beside the frame is that person's."""
    path = tiny_locomo(tmp_path / "locomo.json")
    one = json.loads(path.read_text())[0]
    other = json.loads(json.dumps(one).replace("Pixel", "Nimbus").replace("Leo", "Max"))
    path.write_text(json.dumps([one, other | {"sample_id": "other"}]))
    report = evaluate("locomo", path, limits=Cap(500, 1000), progress=False, sequence=True,
                      personal=True)
    assert report["memory"] == "personal" and report["questions"] == 4
    seq = report["sequence"]
    assert seq["recall_all"] == 1.0
    assert seq["ranking_recall_all_within_memory_tokens"] == 1.0


def test_one_chat_switching_between_a_persons_conversations(tmp_path: Path) -> None:
    """`--switch N`: one chat asks every conversation's questions, N of each in turn, so a
    chat's leaning must follow a person who changes the subject."""
    path = tiny_locomo(tmp_path / "locomo.json")
    one = json.loads(path.read_text())[0]
    other = json.loads(json.dumps(one).replace("Pixel", "Nimbus").replace("Leo", "Max"))
    path.write_text(json.dumps([one, other | {"sample_id": "other"}]))
    cases = list(DATASETS["locomo"](path))
    assert [(c.thread.user_key, q.text) for c, q in switching(cases, 1)] == [
        (c.thread.user_key, c.questions[k].text) for k in (0, 1) for c in cases]
    report = evaluate("locomo", path, limits=Cap(500, 1000), progress=False, sequence=True,
                      personal=True, switch=1)
    assert report["memory"] == "personal, one chat switching every 1"
    seq = report["sequence"]
    assert seq["questions"] == 4 and seq["first_question"]["questions"] == 1  # one chat
    assert seq["recall_all"] == 1.0
    with pytest.raises(ConfigError, match="--sequence --personal"):
        evaluate("locomo", path, progress=False, sequence=True, switch=1)


def test_the_measure_in_sequence_is_the_same_from_run_to_run(tmp_path: Path) -> None:
    """Two runs, string hashing seeded differently, give the same JSON byte for byte: a
    measure that moved on its own would hide small gains (issue 40). Every time, clock and
    write is the dataset's and the asking thread's: nothing depends on the wall clock, on
    thread timing or on the order of a set of strings."""
    path = tiny_locomo(tmp_path / "locomo.json")
    runs = [subprocess.run([sys.executable, "-m", "perpetuity_core.cli.main", "eval", "locomo",
                            str(path), "--sequence", "--personal"], capture_output=True,
                           text=True, check=True, env=os.environ | {"PYTHONHASHSEED": seed}).stdout
            for seed in ("0", "1")]
    assert runs[0] == runs[1] and json.loads(runs[0])["memory"] == "personal"


def test_eval_command_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "locomo", str(tiny_locomo(tmp_path / "l.json"))]) == 0
    assert json.loads(capsys.readouterr().out)["dataset"] == "locomo"
    assert main(["eval", "locomo", str(tmp_path / "missing.json")]) == 1


@pytest.mark.skipif(not LONGMEMEVAL.exists(), reason=f"LongMemEval question not at {LONGMEMEVAL}")
def test_longmemeval_format(tmp_path: Path) -> None:
    report = evaluate("longmemeval", LONGMEMEVAL, progress=False)
    assert report["questions"] == 1 and report["recall_any"] == 1.0
