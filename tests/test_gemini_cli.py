"""gemini-cli itself, in -p mode, through the proxy to the fake provider (API-key mode, with
GOOGLE_GEMINI_BASE_URL pointing at the proxy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, Proxy
from tests.fake_provider import FakeProvider, Text
from tests.test_claude_code import claude_bin, tell_in_real_claude_code
from tests.test_personal import FACT, QUESTION

GEMINI = ROOT / ".cache" / "npm" / "node_modules" / ".bin" / "gemini"
gemini_bin = str(GEMINI) if GEMINI.exists() else shutil.which("gemini")

pytestmark = pytest.mark.skipif(
    gemini_bin is None,
    reason="gemini-cli is not installed (scripts/run test installs it with npm where npm exists)",
)
# gemini-cli's routing classifier asks first, for JSON: a side request, never a turn.
ROUTE = Text('{"complexity_reasoning": "a short request", "complexity_score": 10}', chunks=1)


def run_gemini(proxy: Proxy, home: Path, prompt: str) -> subprocess.CompletedProcess:
    (home / ".gemini").mkdir(exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(
        {"security": {"auth": {"selectedType": "gemini-api-key"}}}))
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("GEMINI", "GOOGLE"))}
    env.update(HOME=str(home), GEMINI_API_KEY="AIza-e2e-test-key", GOOGLE_GEMINI_BASE_URL=proxy.url,
               GEMINI_CLI_TRUST_WORKSPACE="true", NO_COLOR="1")
    return subprocess.run([gemini_bin, "-p", prompt], cwd=home, env=env, capture_output=True,
                          text=True, timeout=100, stdin=subprocess.DEVNULL)


def test_gemini_cli_turns_are_stored_once_and_recalled_in_a_new_session(
        proxy: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    fake.script(ROUTE, Text("Noted: pineapple."))
    first = run_gemini(proxy, tmp_path, "remember the word pineapple")
    assert first.returncode == 0, first.stderr
    assert "Noted: pineapple." in first.stdout
    fake.script(ROUTE, Text("You said pineapple."))
    second = run_gemini(proxy, tmp_path, "which word did I ask you to remember?")
    assert second.returncode == 0, second.stderr
    assert "You said pineapple." in second.stdout

    turns = [r for r in fake.requests if r.path.endswith(":streamGenerateContent")]
    checks = [r for r in fake.requests if r.path.endswith(":generateContent")]
    assert len(turns) == 2 and checks
    # The new session's request carries the first one's words in its frame.
    assert "pineapple" in json.dumps(turns[1].json["contents"][:-1])
    assert all("memory_search" not in json.dumps(r.json) for r in checks)  # unframed, as sent
    rows = proxy.rows(
        "select m.role, i.text from message m join item i on i.message_id = m.id "
        "where i.kind = 'text' order by m.id, i.seq")
    assert rows.count(("user", "remember the word pineapple")) == 1
    assert rows.count(("assistant", "Noted: pineapple.")) == 1
    assert rows.count(("assistant", "You said pineapple.")) == 1
    assert not [t for _, t in rows if "complexity_score" in t]  # the checks are not stored


@pytest.mark.skipif(claude_bin is None, reason="Claude Code is not installed (scripts/run test "
                    "installs it with npm where npm exists)")
def test_a_fact_told_in_claude_code_reaches_a_new_gemini_cli_session(
        personal: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    """The two real programs through one proxy on loopback with default settings: their keys
    differ, their protocols differ, the person is one."""
    tell_in_real_claude_code(personal, fake, tmp_path / "cc", FACT)
    fake.script(ROUTE, Text("On quokka-17."))
    (tmp_path / "gemini").mkdir()
    asked = run_gemini(personal, tmp_path / "gemini", QUESTION)
    assert asked.returncode == 0, asked.stderr
    assert "On quokka-17." in asked.stdout
    turns = [r for r in fake.requests if r.path.endswith(":streamGenerateContent")]
    assert len(turns) == 1
    assert turns[0].headers.get("x-goog-api-key") == "AIza-e2e-test-key"
    earlier, last = turns[0].json["contents"][:-1], turns[0].json["contents"][-1]
    assert FACT in json.dumps(earlier)  # the frame, before the question
    assert QUESTION in json.dumps(last) and FACT not in json.dumps(last)
