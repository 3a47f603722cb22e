"""A user's next request waits for their earlier writes (serve.writer.Landing): the reply
reaches the client before the store's one writer thread has run the turn, its reheats and the
clock, so a next question prepared at once read whatever had landed, which the load decided.
Real SQLite, the real pipeline, a real writer thread held up as a loaded machine holds it."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from perpetuity_core.cli.eval import chat_request, noted
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.serve.writer import Capture, Landing
from perpetuity_core.wire.conversation import Provider, Reply, Usage

# Many past turns on few subjects, in a frame too small for them all: which enter follows what
# each question reheated, and what the earlier questions left warm.
SUBJECTS = ["painting a sunrise over the lake", "camping in the mountains under the stars",
            "the adoption agencies she researched", "the support group meeting downtown",
            "running a charity race for the shelter", "pottery class with the kids"]
PAST = [f"Week {k}: we talked again about {SUBJECTS[k % len(SUBJECTS)]}, and about "
        f"{SUBJECTS[(3 * k + 1) % len(SUBJECTS)]}; note {k} of the diary." for k in range(48)]
QUESTIONS = ["What about the lake and the sunrise?", "Tell me about camping and the stars.",
             "What about the lake and the camping trip?", "And the pottery class?"]
T0 = 1_700_000_000.0


class Inline(Executor):
    """Each write at once, on the caller's thread: what every request reads when it lands."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        done: Future = Future()
        done.set_result(fn(*args, **kwargs))
        return done


def _pipeline(tmp: Path) -> Pipeline:
    return Pipeline(open_memory(tmp / "memory.db"), Settings(
        upstreams={p: "http://127.0.0.1:9" for p in Provider}, trust_identity=True,
        limits=Cap(floor=150, ceiling=250)))


def _asked(pipeline: Pipeline, writer: Executor, user: str = "caroline",
           before: Any = None) -> list[bytes | None]:
    """The past turns sent one by one, then the questions in one conversation, each reply's
    writes queued on `writer` as the relay queues them (`before` runs first, on its thread);
    the body each question went upstream with."""
    if before is not None:
        writer.submit(before)

    def sent(conversation: str, at: float, history: list[dict[str, str]]) -> bytes | None:
        d = pipeline.prepare(chat_request(user, conversation, at, history))
        assert d.job is not None
        Capture(d.job, pipeline, writer, pipeline.landing).replied(Reply(noted(), Usage()))
        return d.body

    for k, text in enumerate(PAST):
        sent("past", T0 + k * 60, [{"role": "user", "content": text}])
    bodies = []
    history: list[dict[str, str]] = []
    for k, q in enumerate(QUESTIONS):
        history.append({"role": "user", "content": q})
        bodies.append(sent("questions", T0 + 3_600 + k * 60, history))
        history.append({"role": "assistant", "content": "Noted."})
    return bodies


def test_each_question_is_framed_after_the_writes_before_it(tmp_path: Path) -> None:
    """The same turns and questions, the writer held up 0.3 s before their writes, frame
    byte for byte as with every write run at once."""
    inline = _asked(_pipeline(tmp_path / "a"), Inline())
    writer = ThreadPoolExecutor(max_workers=1)
    try:
        late = _asked(_pipeline(tmp_path / "b"), writer, before=lambda: time.sleep(0.3))
    finally:
        writer.shutdown(wait=True)
    assert [json.loads(b or b"{}") for b in late] == [json.loads(b or b"{}") for b in inline]


def test_another_users_request_does_not_wait(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path)
    writer = ThreadPoolExecutor(max_workers=1)
    held = threading.Event()
    try:
        writer.submit(held.wait, 30)
        Capture(pipeline.prepare(chat_request("caroline", "past", T0, [
            {"role": "user", "content": PAST[0]}])).job, pipeline, writer,  # type: ignore[arg-type]
            pipeline.landing).replied(Reply(noted(), Usage()))
        d = pipeline.prepare(chat_request("melanie", "hers", T0 + 7_200,
                                          [{"role": "user", "content": "What did I paint?"}]))
        assert d.job is not None and not held.is_set()  # prepared while caroline's wait
    finally:
        held.set()
        writer.shutdown(wait=True)


def test_a_stuck_writer_delays_a_request_never_stops_it(
        caplog: pytest.LogCaptureFixture) -> None:
    landing = Landing(bound=0.05)
    never: Future = Future()
    landing.queued("caroline", never)
    with caplog.at_level(logging.WARNING, logger="perpetuity"):
        assert landing.wait("caroline")
    assert "before its user's earlier writes were stored" in caplog.text
    assert not landing.wait("melanie")
    never.set_result(None)
    assert not landing.wait("caroline")  # landed: nothing pending
