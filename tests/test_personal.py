"""One person, one memory (issue 23): a proxy on loopback with default settings serves one
person, so what they told one harness reaches another's new session, whatever its key or
protocol, and so do their imported histories and the memory stored before the upgrade; a
shared proxy (listening beyond loopback, or told so) keeps credentials apart until an operator
joins them."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

from perpetuity_core.cli.main import main
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage import users
from perpetuity_core.wire import identity
from perpetuity_core.wire.identity import tenant_of
from tests.conftest import Proxy, owned, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall

PERPETUITY = Path(sys.executable).with_name("perpetuity")
CLAUDE_KEY, CODEX_KEY = "sk-ant-api03-personal-claude-0000", "sk-proj-personal-codex-0000"
FACT = "The staging database lives on host quokka-17 behind the bastion."
QUESTION = "Which host does the staging database live on?"


def tell_claude_code(p: Proxy, fake: FakeProvider, text: str = FACT) -> None:
    """A Claude Code turn: the Anthropic protocol, its own key, its device id and session."""
    fake.script(Text("Noted."))
    client = owned(anthropic.Anthropic(base_url=p.url, api_key=CLAUDE_KEY, max_retries=0))
    client.messages.create(
        model="claude-opus-4-8", max_tokens=20, messages=[{"role": "user", "content": text}],
        metadata={"user_id": json.dumps({"device_id": "dev-" + secrets.token_hex(4),
                                         "account_uuid": "", "session_id": "s-cc"})},
        extra_headers={"user-agent": "claude-cli/2.1.197 (external, cli)",
                       "x-claude-code-session-id": "s-cc"})
    p.wait_messages("", 2)


def ask_codex(p: Proxy, fake: FakeProvider, api: str, question: str = QUESTION) -> str:
    """Another harness's new session: OpenAI's protocol (Responses or Chat), another key;
    returns what went upstream."""
    fake.clear()
    fake.script(Text("quokka"))
    client = owned(openai.OpenAI(base_url=p.url + "/v1", api_key=CODEX_KEY, max_retries=0))
    session = {"session-id": "codex-" + secrets.token_hex(4)}
    if api == "responses":
        client.responses.create(model="gpt-5", input=question, extra_headers=session)
    else:
        client.chat.completions.create(model="gpt-4o", extra_headers=session,
                                       messages=[{"role": "user", "content": question}])
    return json.dumps(fake.wait_requests(1)[0].json)


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_a_personal_proxy_is_one_memory_across_harnesses(fake: FakeProvider, tmp_path: Path,
                                                         api: str) -> None:
    p = start_proxy(tmp_path, fake.url, tenants=None)  # loopback, default settings
    try:
        assert b"tenants: personal" in p.log.read_bytes()
        tell_claude_code(p, fake)
        assert "quokka-17" in ask_codex(p, fake, api)
        # One user: the device id the harness claimed split nothing off.
        assert p.rows("select key from user") == [(identity.PERSONAL,)]
    finally:
        stop_proxy(p)


def test_a_shared_proxy_keeps_credentials_apart_until_joined(fake: FakeProvider,
                                                            tmp_path: Path) -> None:
    """Listening beyond loopback, the default is credential; an operator's join reaches the
    running proxy on its next request."""
    p = start_proxy(tmp_path, fake.url, "--listen-host", "0.0.0.0", tenants=None)
    try:
        assert b"tenants: credential" in p.log.read_bytes()
        tell_claude_code(p, fake)
        assert "quokka-17" not in ask_codex(p, fake, "responses")
        store = open_memory(tmp_path / "memory.db")
        salt = store.salt
        store.close()
        claude, codex = tenant_of(CLAUDE_KEY, salt), tenant_of(CODEX_KEY, salt)
        assert main(["memory", "tenants", "join", claude, codex, "--db", str(p.db)]) == 0
        assert "quokka-17" in ask_codex(p, fake, "chat")
    finally:
        stop_proxy(p)
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("memory.db*")) + p.log.read_bytes()
    assert CLAUDE_KEY.encode() not in raw and CODEX_KEY.encode() not in raw


def claude_code_history(root: Path) -> Path:
    """A Claude Code session file as ~/.claude/projects holds one."""
    project = root / "projects" / "-home-dev-app"
    project.mkdir(parents=True)
    lines = [
        {"type": "user", "uuid": "u1", "timestamp": "2025-01-02T03:04:05.000Z", "sessionId": "old",
         "message": {"role": "user", "content": "Our release train leaves every second Tuesday"
                     " from the branch named pelican."}},
        {"type": "assistant", "uuid": "a1", "timestamp": "2025-01-02T03:04:06.000Z",
         "message": {"id": "msg_1", "role": "assistant", "model": "claude-x",
                     "content": [{"type": "text", "text": "Got it: pelican, fortnightly."}]}},
    ]
    (project / "old.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return root / "projects"


def test_imported_history_and_older_tenants_are_the_persons(fake: FakeProvider,
                                                            tmp_path: Path) -> None:
    """Upgrading: a memory stored per credential, then a Claude Code history imported while
    the personal proxy runs; both reach a request with a key neither was stored under."""
    old = start_proxy(tmp_path, fake.url)  # the shared mode, as before this release
    try:
        tell_claude_code(old, fake)
    finally:
        stop_proxy(old)
    p = start_proxy(tmp_path, fake.url, tenants=None)
    try:
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        subprocess.run([str(PERPETUITY), "memory", "import", "claude-code",
                        str(claude_code_history(tmp_path)), "--db", str(p.db), "--quiet"],
                       check=True, env=env, capture_output=True)
        assert "pelican" in ask_codex(p, fake, "responses", "Which branch does the release"
                                      " train leave from?")
        assert "quokka-17" in ask_codex(p, fake, "chat")
    finally:
        stop_proxy(p)
    keys = {k for (k,) in p.rows("select key from user")}
    assert "claude-code:local" in keys and any(k.startswith("key-") for k in keys)  # not re-keyed


@pytest.mark.parametrize("setting,hosts,mode", [
    ("", ["127.0.0.1"], "personal"),
    ("", ["::1", "localhost", "127.0.0.2"], "personal"),
    ("", [""], "credential"),  # every interface
    ("", ["0.0.0.0"], "credential"),
    ("", ["127.0.0.1", "192.168.1.4"], "credential"),  # one address beyond loopback is enough
    ("", ["proxy.internal"], "credential"),  # a name may resolve anywhere
    ("", [], "credential"),
    ("credential", ["127.0.0.1"], "credential"),
    ("personal", ["0.0.0.0"], "personal"),  # the operator said so
])
def test_tenancy_follows_the_listen_addresses(setting: str, hosts: list[str], mode: str) -> None:
    assert identity.tenancy(setting, hosts) == mode


def test_tenancy_refuses_another_word() -> None:
    with pytest.raises(ValueError, match="'personal' or 'credential'"):
        identity.tenancy("shared", ["127.0.0.1"])


def test_tenants_lists_and_joins_and_parts(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "m.db"
    store = open_memory(db)
    for key in ("key-aaa/dev-1", "key-bbb", "key-ccc/alice", "claude-code:local"):
        store.user_id(key)
    store.close()
    assert main(["memory", "tenants", "join", "key-aaa", "key-nope", "--db", str(db)]) == 1
    assert "no tenant 'key-nope'" in capsys.readouterr().err
    assert main(["memory", "tenants", "join", "key-aaa", "key-bbb", "--db", str(db)]) == 0
    assert main(["memory", "tenants", "join", "key-ccc", "key-bbb", "--db", str(db)]) == 0
    capsys.readouterr()
    assert main(["memory", "tenants", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "key-ccc  joined as key-aaa" in out and "  key-ccc/alice  0 conversations" in out
    assert "claude-code:local\n" in out
    assert main(["memory", "tenants", "part", "key-ccc", "--db", str(db)]) == 0
    assert main(["memory", "tenants", "part", "key-ccc", "--db", str(db)]) == 1
    store = open_memory(db)
    try:
        assert users.persons(store.db.translated()) == {"key-aaa": "key-aaa",
                                                          "key-bbb": "key-aaa"}
        aaa = store.user_id("key-aaa/dev-1")
        assert users.pool_of(store, aaa, frozenset()) == {aaa, store.user_id("key-bbb")}
        assert users.pool_of(store, store.user_id("key-ccc/alice"), frozenset()) == set()
    finally:
        store.close()


@pytest.mark.parametrize("given,expected", [([], None), (["--tenants", "credential"], "credential"),
                                            (["--tenants", "personal"], "personal")])
def test_perpetuity_proxy_passes_the_tenancy(given: list[str], expected: str | None) -> None:
    from perpetuity_core.cli.main import build_parser
    from perpetuity_core.cli.proxy import mitmdump_command

    args, extra = build_parser().parse_known_args(["proxy", *given])
    args.extra = extra
    sets = [a for a in mitmdump_command(args) if a.startswith("perpetuity_tenants=")]
    assert sets == ([f"perpetuity_tenants={expected}"] if expected else [])


def test_a_personal_proxys_recall_tools_read_the_whole_file(fake: FakeProvider,
                                                             tmp_path: Path) -> None:
    """The recall tools on a personal proxy count and chain an imported history, as its frames
    quote it (before, they read only the asking user's rows and found nothing)."""
    assert main(["memory", "import", "claude-code", str(claude_code_history(tmp_path)),
                 "--db", str(tmp_path / "memory.db"), "--quiet"]) == 0
    p = start_proxy(tmp_path, fake.url, tenants=None)
    try:
        fake.script(ToolCall("memory_count", {"category": "pelican"}, call_id="toolu_count"),
                    ToolCall("memory_chains", {"subject": "pelican"}, call_id="toolu_chain"),
                    Text("pelican"))
        client = owned(anthropic.Anthropic(base_url=p.url, api_key=CLAUDE_KEY, max_retries=0))
        client.messages.create(model="claude-opus-4-8", max_tokens=20, messages=[
            {"role": "user", "content": "Look up which branch the release train leaves from."}])
        rounds = fake.wait_requests(3)
        for n, call in ((1, "toolu_count"), (2, "toolu_chain")):
            result = rounds[n].json["messages"][-1]["content"][0]
            assert result["tool_use_id"] == call and "Tuesday" in json.dumps(result), result
    finally:
        stop_proxy(p)
