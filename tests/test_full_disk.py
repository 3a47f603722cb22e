"""A memory on a disk that fills up, then grows: every turn the full disk refused is stored
once the conversation's next request re-sends it (issue 41), through a real mitmdump.

Needs a tmpfs of its own (`mount -t tmpfs`, root: CI runs as root); skips with the reason
where mounting is not allowed."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from perpetuity_core.memory.jobs.integrity import check
from perpetuity_core.memory.schema import open_memory
from tests.conftest import Proxy, owned, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text

TURN_BYTES = 700_000


def _mount(where: Path, size: str, *options: str) -> str | None:
    """Mount (or remount) a tmpfs of `size` at `where`; why not, or None."""
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([*options, f"size={size}"]),
                          "tmpfs", str(where)], capture_output=True, text=True, check=False)
    return None if run.returncode == 0 else (run.stderr.strip() or f"mount exited {run.returncode}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 5 MB tmpfs, unmounted after the test."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        why = _mount(where, "5m")
    except OSError as e:
        why = str(e)
    if why:
        pytest.skip(f"cannot mount a small tmpfs for the full disk ({why}); needs root")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _turn(i: int) -> str:
    return f"turn {i}: " + " ".join(f"line{i} word{j % 997}" for j in range(TURN_BYTES // 18))


def _history(n: int) -> list[dict]:
    """n user turns, each answered "ok", then the next user turn."""
    out: list[dict] = []
    for i in range(n):
        out += [{"role": "user", "content": _turn(i)}, {"role": "assistant", "content": "ok"}]
    return [*out, {"role": "user", "content": _turn(n)}]


def test_turns_refused_by_a_full_disk_are_stored_once_it_grows(
        small_disk: Path, fake: FakeProvider, tmp_path: Path) -> None:
    proxy: Proxy = start_proxy(tmp_path, fake.url, db=small_disk / "memory.db")
    try:
        c = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-disk", max_retries=0,
                                      timeout=60))
        for n in range(12):
            fake.script(Text("ok"))
            r = c.messages.create(model="claude-opus-4-8", max_tokens=5,
                                  metadata={"user_id": "disk"}, messages=_history(n))
            assert r.content[0].text == "ok"  # the reply reaches the client, disk full or not
        assert "not stored" in proxy.log.read_text(), "the disk never filled: nothing tested"
        assert _mount(small_disk, "200m", "remount") is None
        fake.script(Text("ok"))
        c.messages.create(model="claude-opus-4-8", max_tokens=5, metadata={"user_id": "disk"},
                          messages=_history(12))
        got = proxy.wait_messages("disk", 26, timeout=30)
    finally:
        stop_proxy(proxy)
    users = [text for role, _, text, _ in got if role == "user"]
    assert [t.split(":")[0] for t in users] == [f"turn {i}" for i in range(13)]
    assert users == [_turn(i) for i in range(13)]
    assert [text for role, _, text, _ in got if role == "assistant"] == ["ok"] * 13
    store = open_memory(small_disk / "memory.db")
    try:
        assert check(store) == []
    finally:
        store.close()
