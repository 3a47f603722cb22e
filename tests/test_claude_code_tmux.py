"""Claude Code itself, interactive, in a detached tmux session, through the proxy to the fake
provider: two prompts typed into one session; the second request upstream carries the first
turn, and each turn is stored once."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import Proxy
from tests.fake_provider import FakeProvider, Text
from tests.test_claude_code import claude_bin

TMUX = shutil.which("tmux")
KEY = "sk-ant-e2e-tmux-test-key-0000"

pytestmark = [
    pytest.mark.skipif(claude_bin is None, reason="Claude Code is not installed (scripts/run "
                       "test installs it with npm where npm exists)"),
    pytest.mark.skipif(TMUX is None, reason="tmux is not installed"),
]


class Pane:
    """One detached tmux session, on a server of its own (-L), running one program."""

    def __init__(self, socket: str, name: str, env: dict[str, str]) -> None:
        self.socket, self.name, self.env = socket, name, env

    def tmux(self, *args: str) -> str:
        """The server starts with the first command, and its environment is the program's."""
        return subprocess.run([str(TMUX), "-L", self.socket, *args], capture_output=True,
                              text=True, check=True, timeout=10, env=self.env).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", self.name)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", text)
        self.tmux("send-keys", "-t", self.name, "Enter")

    def wait(self, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.screen()}")
            time.sleep(0.2)


@pytest.fixture
def claude(proxy: Proxy, tmp_path: Path) -> Iterator[Pane]:
    """Interactive Claude Code with its first-run screens answered in its config: onboarding
    done, the key approved, the folder trusted."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir(parents=True)
    home.mkdir()
    (home / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "theme": "dark",
        "customApiKeyResponses": {"approved": [KEY[-20:]], "rejected": []},
        "projects": {str(work): {"hasTrustDialogAccepted": True,
                                 "hasCompletedProjectOnboarding": True}},
    }))
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("ANTHROPIC_", "CLAUDE", "TMUX"))}
    env.update(
        HOME=str(home), TERM="xterm-256color", ANTHROPIC_BASE_URL=proxy.url,
        ANTHROPIC_API_KEY=KEY, DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    pane = Pane("perpetuity-" + secrets.token_hex(4), "cc", env)
    pane.tmux("new-session", "-d", "-s", pane.name, "-x", "160", "-y", "50", "-c", str(work),
              str(claude_bin))
    try:
        yield pane
    finally:
        subprocess.run([str(TMUX), "-L", pane.socket, "kill-server"], capture_output=True,
                       timeout=10, env=env)


def turns(fake: FakeProvider) -> list[dict]:
    """The model calls the provider received for the session's turns: not its title request
    (a side call with its own prompt and a JSON schema)."""
    return [r.json for r in fake.requests if r.path == "/v1/messages"
            and "format" not in r.json.get("output_config", {})]


def say(claude: Pane, fake: FakeProvider, prompt: str, reply: str) -> None:
    """Type a prompt and wait for the reply on screen and both queued answers used. Claude
    Code asks for the session's title with each prompt, racing the turn, so both get the same
    answer: whichever comes first, the screen shows it (a title that is not JSON is dropped)."""
    fake.script(Text(reply), Text(reply))
    claude.type(prompt)
    claude.wait(lambda: reply in claude.screen(), f"the reply {reply!r}")
    claude.wait(lambda: fake.pending == 0, "the title request")


def test_interactive_claude_code_in_tmux(claude: Pane, proxy: Proxy,
                                         fake: FakeProvider) -> None:
    claude.wait(lambda: "? for shortcuts" in claude.screen(), "the prompt")
    say(claude, fake, "remember the word pineapple", "Noted: pineapple.")
    say(claude, fake, "which word did I say?", "You said pineapple.")

    first, second = turns(fake)
    said = [("user", "remember the word pineapple"), ("assistant", "Noted: pineapple."),
            ("user", "which word did I say?")]
    # The live task kept as Claude Code sent it: the first turn, its reply, then the new
    # prompt; its system and tools as they were, so the provider's cached prefix holds.
    assert [(m["role"], text) for m in second["messages"] if isinstance(m["content"], list)
            for text in texts(m) if not text.startswith("<system-reminder>")] == said
    assert second["messages"][:len(first["messages"])] == without_marks(first["messages"])
    assert second["system"] == first["system"] and second["tools"] == first["tools"]

    proxy.wait_messages("", 4)
    rows = proxy.rows(
        "select m.role, i.text from message m join item i on i.message_id = m.id "
        "where i.kind = 'text' order by m.id, i.seq")
    for turn in [*said, ("assistant", "You said pineapple.")]:
        assert rows.count(turn) == 1, rows
    assert not [t for _, t in rows if "Write the title" in t]  # the title call is not a turn


def texts(message: dict) -> list[str]:
    return [b["text"] for b in message["content"] if b.get("type") == "text"]


def without_marks(messages: list[dict]) -> list[dict]:
    """Claude Code moves its cache mark to the newest block each turn."""
    return [{**m, "content": [{k: v for k, v in b.items() if k != "cache_control"}
                              for b in m["content"]]} if isinstance(m["content"], list) else m
            for m in messages]
