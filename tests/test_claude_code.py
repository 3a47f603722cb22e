"""Claude Code itself, in -p mode, through the proxy to the fake provider."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, Proxy
from tests.fake_provider import FakeProvider, Text

CLAUDE = ROOT / ".cache" / "npm" / "node_modules" / ".bin" / "claude"
claude_bin = str(CLAUDE) if CLAUDE.exists() else shutil.which("claude")

pytestmark = pytest.mark.skipif(
    claude_bin is None,
    reason="Claude Code is not installed (scripts/run test installs it with npm where npm exists)",
)


def run_claude(proxy: Proxy, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update(
        HOME=str(home), ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY="sk-ant-e2e-test",
        DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    return subprocess.run([claude_bin, *args], cwd=home, env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def tell_in_real_claude_code(proxy: Proxy, fake: FakeProvider, home: Path, fact: str) -> None:
    """The real Claude Code (-p) tells `fact` through `proxy`; both its turns are stored."""
    fake.script(Text("Noted."))
    home.mkdir()
    told = run_claude(proxy, home, "-p", fact)
    assert told.returncode == 0, told.stderr
    proxy.wait_messages("", 2)
    fake.clear()


def test_claude_code_turns_are_stored_once(proxy: Proxy, fake: FakeProvider,
                                           tmp_path: Path) -> None:
    fake.script(Text("Noted: pineapple."), Text("You said pineapple."))
    first = run_claude(proxy, tmp_path, "-p", "remember the word pineapple")
    assert first.returncode == 0, first.stderr
    assert "Noted: pineapple." in first.stdout
    second = run_claude(proxy, tmp_path, "-p", "--continue", "which word did I say?")
    assert second.returncode == 0, second.stderr
    assert "You said pineapple." in second.stdout

    sent = [r for r in fake.requests if r.path == "/v1/messages"]
    assert sent and all(r.headers.get("x-claude-code-session-id") for r in sent)
    rows = proxy.rows(
        "select m.role, m.source, i.text from message m join item i on i.message_id = m.id "
        "where i.kind = 'text' order by m.id, i.seq")
    said = [(role, text) for role, _, text in rows if role in ("user", "assistant")]
    assert said.count(("user", "remember the word pineapple")) == 1
    assert said.count(("user", "which word did I say?")) == 1
    assert said.count(("assistant", "Noted: pineapple.")) == 1
    assert said.count(("assistant", "You said pineapple.")) == 1
    assert not [r for r in rows if r[0] == "assistant" and r[1] == "request"]
