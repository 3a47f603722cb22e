"""SIGTERM while a reply streams (issue 41): the proxy drains. It stops accepting, lets the
reply in flight reach the client whole, stores it, and exits cleanly; before, the client's
stream was cut and mitmproxy logged "Addon error: cannot schedule new futures after shutdown"."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import owned, start_proxy
from tests.fake_provider import FakeProvider, Text

WORDS = "".join(f"w{i} " for i in range(30))
HEADERS = {"x-api-key": "sk-ant-drain", "anthropic-version": "2023-06-01",
           "x-perpetuity-user": "u", "x-perpetuity-conversation": "c"}


def _text(lines: list[str]) -> tuple[str, bool]:
    """The streamed reply's text, and whether it ended (message_stop)."""
    text, done = [], False
    for line in lines:
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event.get("type") == "content_block_delta":
                text.append(event["delta"].get("text", ""))
            done = done or event.get("type") == "message_stop"
    return "".join(text), done


@pytest.mark.parametrize("tools", [True, False], ids=["relay", "mitmproxy-stream"])
def test_sigterm_mid_stream_lets_the_reply_finish_stores_it_once_and_exits(
        tmp_path: Path, tools: bool) -> None:
    extra = () if tools else ("--set", "perpetuity_tools=false")
    with FakeProvider() as fake:
        proxy = start_proxy(tmp_path, fake.url, *extra, quiet=False)
        kept = owned(httpx.Client(timeout=30))  # a connection accepted before the stop
        try:
            quick = {"model": "claude-opus-4-8", "max_tokens": 8,
                     "messages": [{"role": "user", "content": "hi"}]}
            assert kept.post(proxy.url + "/v1/messages", json=quick,
                             headers={**HEADERS, "x-perpetuity": "off"}).status_code == 200
            fake.script(Text(WORDS, chunks=30, delay=0.05))  # 1.5 s of reply
            body = {"model": "claude-opus-4-8", "max_tokens": 64, "stream": True,
                    "messages": [{"role": "user", "content": "count slowly"}]}
            with httpx.stream("POST", proxy.url + "/v1/messages", json=body, headers=HEADERS,
                              timeout=30) as r:
                lines = r.iter_lines()
                got = [next(lines)]  # the reply has begun
                proxy.process.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                with pytest.raises(httpx.ConnectError):  # it no longer accepts
                    httpx.post(proxy.url + "/v1/messages", json=body, headers=HEADERS)
                # Nor reads a new request on a connection it had: the harness sends it again.
                refused = kept.post(proxy.url + "/v1/messages", json=quick, headers=HEADERS)
                assert refused.status_code == 503 and b"shutting down" in refused.content
                got += list(lines)
            assert _text(got) == (WORDS, True)
            assert proxy.process.wait(30) == 0
        finally:
            if proxy.alive():
                proxy.process.kill()
                proxy.process.wait()
    stored = [(role, text, complete) for role, _, text, complete in proxy.messages("u")]
    assert stored == [("user", "count slowly", 1), ("assistant", WORDS, 1)]
    log = proxy.log.read_text()
    assert "Traceback" not in log and "Addon error" not in log, log


@pytest.mark.parametrize("tools", [True, False], ids=["relay", "mitmproxy-stream"])
def test_a_reply_still_running_at_the_bound_is_stored_as_far_as_it_came(
        tmp_path: Path, tools: bool) -> None:
    """The wait is bounded (perpetuity_drain): a reply that does not end in time is cut at the
    bound, what came of it stored, and the proxy exits cleanly, with one line saying so."""
    extra = () if tools else ("--set", "perpetuity_tools=false")
    with FakeProvider() as fake:
        proxy = start_proxy(tmp_path, fake.url, *extra, "--set", "perpetuity_drain=1",
                            quiet=False)
        try:
            fake.script(Text(WORDS, chunks=30, delay=0.4))  # 12 s of reply
            body = {"model": "claude-opus-4-8", "max_tokens": 64, "stream": True,
                    "messages": [{"role": "user", "content": "never done"}]}
            with httpx.stream("POST", proxy.url + "/v1/messages", json=body, headers=HEADERS,
                              timeout=30) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(8)]  # a few words have come
                t0 = time.monotonic()
                proxy.process.send_signal(signal.SIGTERM)
                with pytest.raises(httpx.HTTPError):
                    got += list(lines)
            assert proxy.process.wait(30) == 0
            assert time.monotonic() - t0 < 8
        finally:
            if proxy.alive():
                proxy.process.kill()
                proxy.process.wait()
    stored = [(role, text, complete) for role, _, text, complete in proxy.messages("u")]
    assert stored[0] == ("user", "never done", 1) and len(stored) == 2, stored
    role, text, complete = stored[1]
    assert role == "assistant" and not complete and text and WORDS.startswith(text), stored
    log = proxy.log.read_text()
    assert "1 reply still in flight after 1 s; stored as far as they came" in log, log
    assert "Traceback" not in log and "Addon error" not in log, log
