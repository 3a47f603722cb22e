"""Trust boundaries through a real mitmdump: credentials go only to the host they were meant for,
and nothing crosses from one tenant to another."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Proxy
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
