"""Trust boundaries through a real mitmdump: credentials go only to the host they were meant for,
and nothing crosses from one tenant to another."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest

from tests.conftest import FIXTURES, Proxy, needs_fixtures
from tests.fake_provider import FakeProvider, Text

JENKINS_TOKEN = "jenkins-token-1f2e3d4c5b6a"


def test_another_host_on_the_proxys_port_keeps_its_credential(proxy: Proxy,
                                                              fake: FakeProvider) -> None:
    """Regular-proxy mode (HTTP_PROXY at us): an absolute-form request for another host that
    happens to use our port goes to that host, untouched, never to a provider."""
    with FakeProvider(host="127.0.0.2", port=proxy.port) as jenkins:
        jenkins.script(Text("jenkins says hi"))
        with httpx.Client(proxy=proxy.url, trust_env=False) as h:
            r = h.post(f"http://127.0.0.2:{proxy.port}/v1/chat/completions",
                       headers={"authorization": f"Bearer {JENKINS_TOKEN}"},
                       json={"model": "gpt-4o", "messages": [{"role": "user", "content": "build?"}]})
        assert r.status_code == 200
        (got,) = jenkins.wait_requests(1)
        assert got.headers["authorization"] == f"Bearer {JENKINS_TOKEN}"
    assert not [q for q in fake.requests if JENKINS_TOKEN in str(q.headers)]


@pytest.mark.parametrize("path,headers", [
    ("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
     {"x-goog-api-key": "AIzaSyGOOGLE-KEY-never-forwarded"}),
    ("/api/json", {"authorization": "Bearer jenkins-token-never-forwarded"}),
])
def test_a_request_naming_no_provider_is_not_forwarded(proxy: Proxy, fake: FakeProvider,
                                                       path: str, headers: dict[str, str]) -> None:
    r = httpx.post(proxy.url + path, headers=headers, json={"contents": []})
    assert r.status_code == 421 and "cannot tell which provider" in r.text
    assert fake.requests == []
    assert proxy.alive()


# --------------------------------------------------------------------------- tenants

def ask(proxy: Proxy, key: str, text: str, **body: object) -> None:
    httpx.post(proxy.url + "/v1/messages", headers={"x-api-key": key, **body.pop("headers", {})},
               json={"model": "claude-opus-4-8", "max_tokens": 20,
                     "messages": body.pop("messages", [{"role": "user", "content": text}]),
                     **body}, timeout=30).raise_for_status()


def sent_upstream(fake: FakeProvider) -> str:
    return json.dumps([r.json for r in fake.requests])


CLAIMS = {
    "header": lambda who: {"headers": {"x-perpetuity-user": who}},
    "metadata": lambda who: {"metadata": {"user_id": who}},
    "device_id": lambda who: {"metadata": {"user_id": json.dumps(
        {"device_id": who, "account_uuid": "", "session_id": "s-" + secrets.token_hex(4)})},
        "headers": {"user-agent": "claude-cli/2.1.197 (external, sdk-cli)"}},
}


@pytest.mark.parametrize("claim", CLAIMS)
def test_a_claimed_identity_never_reaches_across_credentials(proxy: Proxy, fake: FakeProvider,
                                                             claim: str) -> None:
    alice, mallory = f"alice-{claim}", "mallory"
    fake.script(Text("Noted."))
    ask(proxy, "sk-ant-alice-key-000000000000", "My locker code is 8842 and my doctor is Dr Quill.",
        **CLAIMS[claim](alice))
    proxy.wait_messages(alice, 2)
    ask(proxy, "sk-ant-mallory-key-0000000000", "hello", **CLAIMS[claim](alice))  # history of her own
    fake.clear()
    ask(proxy, "sk-ant-mallory-key-0000000000", "What is my locker code and who is my doctor?",
        **CLAIMS[claim](alice))
    assert "8842" not in sent_upstream(fake) and "Quill" not in sent_upstream(fake)
    # Within a tenant, claims partition: the same key naming another user sees nothing of hers.
    fake.clear()
    ask(proxy, "sk-ant-alice-key-000000000000", "hello", **CLAIMS[claim](mallory))
    ask(proxy, "sk-ant-alice-key-000000000000", "What is my locker code and who is my doctor?",
        **CLAIMS[claim](mallory))
    assert "8842" not in sent_upstream(fake)
    # And her own requests still find it.
    fake.clear()
    ask(proxy, "sk-ant-alice-key-000000000000", "What is my locker code and who is my doctor?",
        **CLAIMS[claim](alice))
    assert "8842" in sent_upstream(fake)


@needs_fixtures
def test_subscription_oauth_passes_untouched_and_identity_works(proxy: Proxy,
                                                                fake: FakeProvider) -> None:
    """Claude Code signed in with a subscription: `Authorization: Bearer <OAuth token>` and the
    oauth anthropic-beta, on a request shaped like the capture."""
    raw = json.loads((FIXTURES / "claude-code" / "02-basic-messages-stream.json").read_text())
    body = raw["body"]
    device = json.loads(body["metadata"]["user_id"])["device_id"]
    query = "&".join(f"{k}={v}" for k, v in raw["query"])

    def send(token: str, text: str) -> None:
        headers = [(k, v) for k, v in raw["headers"]
                   if k.lower() not in ("x-api-key", "host", "content-length", "connection",
                                        "accept-encoding")]
        headers = [(k, "oauth-2025-04-20," + v if k.lower() == "anthropic-beta" else v)
                   for k, v in headers] + [("Authorization", f"Bearer {token}")]
        sent = {**body, "messages": [{"role": "user", "content": text}]}
        r = httpx.post(proxy.url + raw["path"] + "?" + query, headers=headers,
                       content=json.dumps(sent), timeout=30)
        assert r.status_code == 200, r.text

    mine, theirs = "sk-ant-oat01-" + "m" * 40, "sk-ant-oat01-" + "t" * 40
    fake.script(Text("Noted."))
    send(mine, "The staging password rotation happens every Thursday at 0900.")
    got = fake.wait_requests(1)[0]
    assert got.headers["authorization"] == f"Bearer {mine}"
    assert got.headers["anthropic-beta"].startswith("oauth-2025-04-20,claude-code-20250219")
    assert got.query == query
    users = proxy.wait_messages(device, 2) and [u for (u,) in proxy.rows(
        "select key from user where key like ?", f"%/{device}")]
    assert len(users) == 1 and users[0].startswith("key-")  # the device, under the token's tenant
    fake.clear()
    send(theirs, "hello")
    send(theirs, "When does the staging password rotation happen?")
    assert "Thursday" not in sent_upstream(fake)
    fake.clear()
    send(mine, "When does the staging password rotation happen?")
    assert "Thursday" in sent_upstream(fake)
    assert fake.requests[-1].headers["authorization"] == f"Bearer {mine}"


def secret_key(tag: str) -> str:
    return "sk-ant-api03-" + tag * 30


def test_a_pasted_secret_is_withheld_from_another_conversations_frame(proxy: Proxy,
                                                                      fake: FakeProvider) -> None:
    key = secret_key("Q")
    fake.script(Text("Got it."))
    ask(proxy, "sk-ant-paster-key-00000000000", f"Deploy creds for the billing service: {key}",
        headers={"x-perpetuity-conversation": "paste"})
    proxy.wait_messages("key-", 0)
    fake.clear()
    ask(proxy, "sk-ant-paster-key-00000000000", "Which deploy creds does the billing service use?",
        headers={"x-perpetuity-conversation": "later"})
    sent = sent_upstream(fake)
    assert key not in sent
    assert "[secret withheld: an Anthropic API key]" in sent
    # Stored verbatim: it is the user's data.
    assert proxy.rows("select count(*) from item where text like ?", f"%{key}%") == [(1,)]
