"""Codex itself (`codex exec`, its built-in provider: Responses over a WebSocket) through a real
mitmdump to the fake provider, which refuses a previous_response_id it never issued as the
provider does: a fact told through the Anthropic path reaches a new Codex session's model, the
chain stays valid through `codex exec resume --last`, and a provider without WebSockets (426)
gets Codex's HTTP fallback, framed too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, Proxy
from tests.fake_provider import Error, FakeProvider, Text, ToolCall
from tests.test_claude_code import claude_bin, tell_in_real_claude_code
from tests.test_personal import FACT, QUESTION, tell_claude_code

CODEX = ROOT / ".cache" / "npm" / "node_modules" / ".bin" / "codex"
codex_bin = str(CODEX) if CODEX.exists() else shutil.which("codex")

pytestmark = pytest.mark.skipif(
    codex_bin is None,
    reason="Codex is not installed (scripts/run test installs @openai/codex with npm where npm exists)",
)


def run_codex(proxy: Proxy, home: Path, *args: str, base_url: bool = True
              ) -> subprocess.CompletedProcess:
    """`codex exec` with its built-in provider, signed in by CODEX_API_KEY, pointed at the
    proxy by `openai_base_url` (the OPENAI_BASE_URL variable is not read for it), or else using
    it as its HTTPS proxy."""
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'openai_base_url = "{proxy.url}/v1"\n' if base_url else "")
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("OPENAI", "CODEX"))}
    env.update(HOME=str(home), CODEX_HOME=str(codex_home), CODEX_API_KEY="sk-proj-e2e-codex",
               NO_COLOR="1")
    if not base_url:
        env.update(HTTPS_PROXY=proxy.url,
                   CODEX_CA_CERTIFICATE=str(proxy.confdir / "mitmproxy-ca-cert.pem"))
    work = home / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([codex_bin, "exec", "--skip-git-repo-check", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def turns(fake: FakeProvider) -> list[dict]:
    """The model calls the provider received over the socket (not the prewarms)."""
    return [r.json for r in fake.requests if r.method == "WS" and isinstance(r.json, dict)
            and r.json.get("generate") is not False]


def held(fake: FakeProvider, body: dict) -> list[dict]:
    """What the provider held for a message: its chain's history, then its input."""
    out: list[dict] = []
    prev = body.get("previous_response_id")
    messages = [r.json for r in fake.requests if r.method == "WS" and isinstance(r.json, dict)]
    if prev:
        # The message that made `prev`: the one before this on its connection.
        before = messages[messages.index(body) - 1]
        out = held(fake, before)
    return out + list(body["input"])


def tool_items(items: list[dict]) -> list[str]:
    """The names of the tools in `additional_tools` items (Codex's own are in namespaces)."""
    return [t.get("name", "") for i in items if i.get("type") == "additional_tools"
            for t in i.get("tools", [])]


def test_codex_recalls_a_fact_told_through_anthropic_and_resumes_on_a_valid_chain(
        personal: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    tell_claude_code(personal, fake)
    fake.clear()
    fake.script(Text("It lives on quokka-17."))
    first = run_codex(personal, tmp_path, QUESTION)
    assert first.returncode == 0, first.stderr
    assert "It lives on quokka-17." in first.stdout
    asked = turns(fake)
    assert len(asked) == 1
    assert "quokka-17" in json.dumps(held(fake, asked[0]))  # the frame reached the model
    upgrades = [r for r in fake.requests if r.method == "GET"]
    assert upgrades and upgrades[0].headers["authorization"] == "Bearer sk-proj-e2e-codex"

    fake.clear()
    fake.script(Text("Still quokka-17."))
    again = run_codex(personal, tmp_path, "resume", "--last", "And where is the bastion?")
    assert again.returncode == 0, again.stderr
    assert "Still quokka-17." in again.stdout
    assert fake.refused == []  # every previous_response_id was one the provider issued
    resumed = turns(fake)
    assert len(resumed) == 1
    whole = json.dumps(held(fake, resumed[0]))
    assert QUESTION in whole and "And where is the bastion?" in whole
    assert "quokka-17" in whole  # the frame again, on the resumed session's new socket
    rows = personal.rows("select count(*) from message m join item i on i.message_id = m.id"
                         " where i.text = ?", QUESTION)
    assert rows == [(1,)]  # the question stored once, though Codex sent it twice


def test_codex_falls_back_to_http_when_the_upgrade_is_refused(
        personal: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    """A provider without WebSockets answers the upgrade 426; it reaches Codex as sent, and
    Codex retries over HTTP, which the proxy frames."""
    tell_claude_code(personal, fake)
    fake.clear()
    fake.websockets = False
    try:
        fake.script(Text("quokka-17, over HTTP."))
        got = run_codex(personal, tmp_path, QUESTION)
    finally:
        fake.websockets = True
    assert got.returncode == 0, got.stderr
    assert "quokka-17, over HTTP." in got.stdout
    assert [r.method for r in fake.requests][:1] == ["GET"]
    posts = [r for r in fake.requests if r.method == "POST" and r.path == "/v1/responses"]
    assert posts and "quokka-17" in json.dumps(posts[0].json["input"])


def test_codex_through_the_proxy_as_https_proxy(personal: Proxy, fake: FakeProvider,
                                                tmp_path: Path) -> None:
    """No base URL: Codex reaches api.openai.com through HTTPS_PROXY, trusting mitmproxy's CA
    (CODEX_CA_CERTIFICATE); its socket is framed the same way, its key byte-identical."""
    tell_claude_code(personal, fake)
    fake.clear()
    fake.script(Text("quokka-17, by proxy."))
    got = run_codex(personal, tmp_path, QUESTION, base_url=False)
    assert got.returncode == 0, got.stderr
    assert "quokka-17, by proxy." in got.stdout
    upgrades = [r for r in fake.requests if r.method == "GET"]
    assert upgrades and upgrades[0].headers["authorization"] == "Bearer sk-proj-e2e-codex"
    asked = turns(fake)
    assert len(asked) == 1 and "quokka-17" in json.dumps(held(fake, asked[0]))


@pytest.mark.skipif(claude_bin is None, reason="Claude Code is not installed (scripts/run test "
                    "installs it with npm where npm exists)")
def test_a_fact_told_in_claude_code_reaches_a_new_codex_session(
        personal: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    """The two real programs through one proxy on loopback with default settings."""
    tell_in_real_claude_code(personal, fake, tmp_path / "cc", FACT)
    fake.script(Text("On quokka-17."))
    asked = run_codex(personal, tmp_path / "codex", QUESTION)
    assert asked.returncode == 0, asked.stderr
    assert "On quokka-17." in asked.stdout
    sent = turns(fake)
    assert len(sent) == 1 and FACT in json.dumps(held(fake, sent[0]))


def rollout(home: Path) -> str:
    """Everything Codex kept of its sessions (its rollout files): what it saw."""
    return "".join(f.read_text() for f in (home / ".codex" / "sessions").rglob("*.jsonl"))


def test_codex_recall_tools_ride_its_websocket_hidden_and_chained(
        personal: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    """The model calls memory_search over Codex's own socket: the proxy runs it and sends the
    next round on the same connection, chained to the hidden round; Codex sees only the final
    reply, its next request (a tool of its own) and `codex exec resume` chain validly, and each
    turn is stored once."""
    tell_claude_code(personal, fake)
    fake.clear()
    fake.script(ToolCall("memory_search", {"query": "staging database host"}),
                ToolCall("lookup_weather", {"city": "Oslo"}),
                Text("It lives on quokka-17."))
    first = run_codex(personal, tmp_path, QUESTION)
    assert first.returncode == 0, first.stderr
    assert "It lives on quokka-17." in first.stdout
    asked = turns(fake)
    assert len(asked) == 3, asked  # Codex's turn, the proxy's round, Codex's own tool's output
    turn, hidden, after = asked
    # Codex's tools are an input item (its Responses Lite), so ours are an item of our own just
    # after it, as Codex's own incremental tools update would be (docs/codex.md), and Codex's
    # item goes up as Codex sent it.
    assert "tools" not in turn
    items = held(fake, turn)
    at = [n for n, i in enumerate(items) if i.get("type") == "additional_tools"]
    assert len(at) == 2 and at[1] == at[0] + 1, at
    codex, ours = items[at[0]], items[at[1]]
    assert "memory_search" not in tool_items([codex]) and "memory_search" in tool_items([ours])
    assert ours["role"] == codex["role"] == "developer"
    # The proxy's round: on the connection's last response, the call's output its only input.
    assert hidden["previous_response_id"] and [i["type"] for i in hidden["input"]] == [
        "function_call_output"]
    assert hidden["input"][0]["output"].startswith("memory_search")  # the tool's answer
    assert fake.refused == []  # every previous_response_id was one the provider issued
    # Codex saw the visible call and answered it; of ours it saw nothing.
    seen = rollout(tmp_path)
    assert "lookup_weather" in seen and "memory_search" not in seen
    calls = [i.get("name") for i in after["input"] if i.get("type") == "function_call"]
    assert calls == ["lookup_weather"]
    fake.clear()
    fake.script(Text("Still quokka-17."))
    again = run_codex(personal, tmp_path, "resume", "--last", "And where is the bastion?")
    assert again.returncode == 0, again.stderr
    assert "Still quokka-17." in again.stdout
    assert fake.refused == []
    resumed = turns(fake)
    assert len(resumed) == 1
    whole = held(fake, resumed[0])
    assert [i.get("name") for i in whole if i.get("type") == "function_call"] == ["lookup_weather"]
    assert "memory_search" not in rollout(tmp_path)
    for text in (QUESTION, "It lives on quokka-17.", "And where is the bastion?",
                 "Still quokka-17."):
        assert personal.rows("select count(*) from item where text = ?", text) == [(1,)], text


def test_a_refused_framed_message_goes_again_as_codex_sent_it(
        personal: Proxy, fake: FakeProvider, tmp_path: Path) -> None:
    """Fail open over the socket as over HTTP: a 400 for the message we framed (our tools
    beside Codex's) is not Codex's to see; its own history goes once more, whole, unchained,
    without our tools, and that answer is Codex's, stored once."""
    tell_claude_code(personal, fake)
    fake.clear()
    fake.script(Error(400), Text("It lives on quokka-17."))
    got = run_codex(personal, tmp_path, QUESTION)
    assert got.returncode == 0, got.stderr
    assert "It lives on quokka-17." in got.stdout
    ours, again = turns(fake)
    assert "tools" not in ours and "memory_search" in tool_items(held(fake, ours))
    assert "previous_response_id" not in again and "tools" not in again
    assert "memory_search" not in tool_items(again["input"])
    assert QUESTION in json.dumps(again["input"]) and "quokka-17" not in json.dumps(again["input"])
    assert personal.rows("select count(*) from item where text = ?", QUESTION) == [(1,)]
    assert personal.rows("select count(*) from item where text = ?",
                         "It lives on quokka-17.") == [(1,)]
