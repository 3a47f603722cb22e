"""`/perpetuity-curate` through the proxy: answered by the proxy itself, no model call."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path

import anthropic
import openai
import pytest

from tests.conftest import Proxy, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider

NOTE = """---
name: {name}
description: How to {name} when it fails.
tags: [{name}]
created: {created}
source_task: a task
confidence: medium
state: active
use_count: 0
last_used: {created}
supersedes: null
pinned: false
origin: agent-created
---

## When

When {name} fails.

## Procedure

1. Do the {name} thing.

## Pitfalls

None.

## Verification

It works.
"""


@pytest.fixture(scope="module")
def notes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("notes")
    (root / "notes").mkdir()
    old = (date.today() - timedelta(days=40)).isoformat()
    (root / "notes" / "rebuild-wheels.md").write_text(NOTE.format(name="rebuild-wheels", created=old))
    return root


@pytest.fixture(scope="module")
def proxy(fake: FakeProvider, notes_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("curate"), fake.url,
                    "--set", f"perpetuity_notes_dir={notes_dir}")
    yield p
    stop_proxy(p)


def test_curate_command_answered_without_the_model(proxy: Proxy, fake: FakeProvider,
                                                   notes_dir: Path) -> None:
    c = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", max_retries=0)
    with c.messages.stream(model="claude-opus-4-8", max_tokens=50,
                           messages=[{"role": "user", "content": "/perpetuity-curate"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert "rebuild-wheels" in text and "stale" in text.lower()
    assert final.stop_reason == "end_turn"
    assert "state: stale" in (notes_dir / "notes" / "rebuild-wheels.md").read_text()

    o = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0)
    r = o.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                             "content": "/perpetuity-curate"}])
    assert r.choices[0].message.content  # nothing left to change: still a summary
    events = list(o.responses.create(model="gpt-5", input="/perpetuity-curate", stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text

    assert fake.requests == []  # no model call
    assert proxy.rows("select count(*) from message") == [(0,)]  # a command, not a turn
