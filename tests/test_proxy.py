"""Real SDK clients through a real mitmdump running the addon, against the fake provider."""

from __future__ import annotations

import os
import ssl
import stat
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests import postgres
from tests.conftest import Proxy, owned, start_proxy, stop_proxy
from tests.fake_provider import Cut, Error, FakeProvider, Text, ToolCall

KEY = "sk-ant-api03-SECRET-never-stored"


@pytest.fixture(scope="module", params=["relay", "mitmproxy-stream", "relay-postgresql"])
def proxy(request: pytest.FixtureRequest, fake: FakeProvider,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """Every test runs with the recall tools on (a request with memory to reach goes through
    the relay, where their loop runs) and off (every reply on mitmproxy's own stream), and
    with the memory on PostgreSQL (skipped with the reason where no server can start)."""
    extra = ("--set", "perpetuity_tools=false") if request.param == "mitmproxy-stream" else ()
    db = None
    if request.param.endswith("postgresql"):
        db = postgres.fresh_database(request.getfixturevalue("postgres_server"), "proxy")
    p = start_proxy(tmp_path_factory.mktemp(request.param), fake.url, *extra, db=db)
    yield p
    stop_proxy(p)
    assert b"perpetuity_core" not in p.log.read_bytes(), p.log.read_text()


def claude(base: str, **kw: object) -> anthropic.Anthropic:
    return owned(anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, **kw))


def gpt(base: str) -> openai.OpenAI:
    return owned(openai.OpenAI(base_url=base + "/v1", api_key="sk-proj-SECRET-never-stored", max_retries=0))


def user_msgs(*texts: str) -> list[dict]:
    """Alternating user/assistant history ending with a user turn."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def test_anthropic_create_and_stream_store_every_turn_once(proxy: Proxy, fake: FakeProvider) -> None:
    c = claude(proxy.url)
    meta = {"user_id": "alice"}
    fake.script(Text("Paris is lovely in May."))
    r = c.messages.create(model="claude-opus-4-8", max_tokens=50, metadata=meta,
                          messages=user_msgs("Where should I travel in spring?"))
    assert r.content[0].text == "Paris is lovely in May."
    fake.script(Text("Book the Louvre early.", chunks=4))
    with c.messages.stream(model="claude-opus-4-8", max_tokens=50, metadata=meta,
                           messages=user_msgs("Where should I travel in spring?",
                                              "Paris is lovely in May.", "Any museum tips?")) as s:
        assert "".join(s.text_stream) == "Book the Louvre early."
    got = proxy.wait_messages("alice", 4)
    assert [(role, src, text) for role, src, text, _ in got] == [
        ("user", "request", "Where should I travel in spring?"),
        ("assistant", "reply", "Paris is lovely in May."),
        ("user", "request", "Any museum tips?"),
        ("assistant", "reply", "Book the Louvre early."),
    ]
    # The control of what went upstream: the same body the client sent, to the provider's path.
    assert fake.requests[-1].path == "/v1/messages"
    assert fake.requests[-1].json["messages"][-1]["content"] == "Any museum tips?"


def test_openai_chat_streamed_and_not(proxy: Proxy, fake: FakeProvider) -> None:
    c = gpt(proxy.url)
    fake.script(Text("One."))
    r = c.chat.completions.create(model="gpt-4o-mini", user="bob",
                                  messages=user_msgs("Count to one."))
    assert r.choices[0].message.content == "One."
    fake.script(Text("One, two.", chunks=3))
    stream = c.chat.completions.create(
        model="gpt-4o-mini", user="bob", stream=True, stream_options={"include_usage": True},
        messages=user_msgs("Count to one.", "One.", "Now to two."),
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "One, two."
    assert chunks[-1].usage is not None
    got = proxy.wait_messages("bob", 4)
    assert [t for _, _, t, _ in got] == ["Count to one.", "One.", "Now to two.", "One, two."]


def test_openai_responses_stream_and_tool_call(proxy: Proxy, fake: FakeProvider) -> None:
    c = gpt(proxy.url)
    fake.script(ToolCall("get_weather", {"city": "Oslo"}, call_id="call_1"))
    events = list(c.responses.create(model="gpt-5", input="Weather in Oslo?", stream=True,
                                     user="carol"))
    assert events[-1].type == "response.completed"
    fake.script(Text("It is snowing."))
    r = c.responses.create(model="gpt-5", user="carol", input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "snow, -3C"},
    ])
    assert r.output_text == "It is snowing."
    got = proxy.wait_messages("carol", 4)
    assert [(role, text) for role, _, text, _ in got] == [
        ("user", "Weather in Oslo?"),
        ("assistant", '{"city": "Oslo"}'),
        ("tool", "snow, -3C"),
        ("assistant", "It is snowing."),
    ]


@pytest.mark.parametrize("path,body", [
    ("/v1/messages", {"model": "claude-opus-4-8", "max_tokens": 20, "stream": True,
                      "messages": [{"role": "user", "content": "bytes?"}]}),
    ("/v1/chat/completions", {"model": "gpt-4o", "stream": True,
                              "messages": [{"role": "user", "content": "bytes?"}]}),
    ("/v1/responses", {"model": "gpt-5", "stream": True, "input": "bytes?"}),
    ("/v1/responses", {"model": "gpt-5", "input": "bytes, whole?"}),
])
def test_reply_bytes_identical_to_direct(proxy: Proxy, fake: FakeProvider, path: str,
                                         body: dict) -> None:
    headers = {"x-api-key": KEY} if path == "/v1/messages" else {"authorization": "Bearer sk-x"}
    fake.script(Text("Same bytes either way.", chunks=5))
    direct = httpx.post(fake.url + path, json=body, headers=headers)
    fake.script(Text("Same bytes either way.", chunks=5))
    # Recall off: the fake's usage figures count the request, which a frame would lengthen.
    via = httpx.post(proxy.url + path, json=body, headers={**headers, "x-perpetuity-recall": "off"})
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content
    assert via.headers["content-type"] == direct.headers["content-type"]


def test_control_headers_stripped_and_switches(proxy: Proxy, fake: FakeProvider) -> None:
    c = claude(proxy.url)

    def ask(text: str, **headers: str) -> None:
        c.messages.create(model="claude-opus-4-8", max_tokens=5, messages=user_msgs(text),
                          extra_headers={"x-perpetuity-user": "dave", **headers})

    ask("pass-through please", **{"x-perpetuity": "off"})
    ask("probe only", **{"x-perpetuity-probe": "on"})
    ask("do not capture", **{"x-perpetuity-capture": "off"})
    ask("recall and tools off", **{"x-perpetuity-recall": "off", "x-perpetuity-tools": "off",
                                   "x-perpetuity-time": "2023-05-08T13:56:00Z"})
    for r in fake.wait_requests(4):
        assert not [h for h in r.headers if h.startswith("x-perpetuity")], r.headers
    got = proxy.wait_messages("dave", 2)
    assert [t for _, _, t, _ in got] == ["recall and tools off", "Hello from the fake provider."]
    (at,) = proxy.rows("select m.at from message m join user u on u.id=m.user_id "
                       "where u.key like '%/dave' and m.role='user'")[0]
    assert at == 1683554160.0


def test_upstream_errors_reach_client_and_turn_is_kept(proxy: Proxy, fake: FakeProvider) -> None:
    c = claude(proxy.url)
    fake.script(Error(500))
    with pytest.raises(anthropic.InternalServerError):
        c.messages.create(model="claude-opus-4-8", max_tokens=5, metadata={"user_id": "erin"},
                          messages=user_msgs("first try"))
    fake.script(Error(429, headers={"retry-after": "3"}))
    with pytest.raises(anthropic.RateLimitError) as e:
        c.messages.create(model="claude-opus-4-8", max_tokens=5, metadata={"user_id": "erin"},
                          messages=user_msgs("second try"))
    assert e.value.response.headers["retry-after"] == "3"
    fake.script(Error(429, headers={"retry-after": "3"}))
    direct = httpx.post(fake.url + "/v1/messages", headers={"x-api-key": KEY},
                        json={"model": "m", "max_tokens": 1, "messages": user_msgs("x")})
    fake.script(Error(429, headers={"retry-after": "3"}))
    via = httpx.post(proxy.url + "/v1/messages", headers={"x-api-key": KEY},
                     json={"model": "m", "max_tokens": 1, "messages": user_msgs("x")})
    assert (via.status_code, via.content) == (direct.status_code, direct.content)
    assert [t for _, _, t, _ in proxy.wait_messages("erin", 2)] == ["first try", "second try"]


def test_stream_cut_midway_reaches_client_and_partial_reply_kept(proxy: Proxy,
                                                                  fake: FakeProvider) -> None:
    c = claude(proxy.url)
    fake.script(Cut(after_events=4))
    # The SDK's own transport error type varies by version: any error is the provider's cut.
    with pytest.raises(Exception, match="incomplete|closed|peer"):
        with c.messages.stream(model="claude-opus-4-8", max_tokens=50,
                               metadata={"user_id": "frank"}, messages=user_msgs("cut me")) as s:
            for _ in s.text_stream:
                pass
    got = proxy.wait_messages("frank", 2)
    assert got[0][:3] == ("user", "request", "cut me")
    assert len(got) == 2 and got[1][0] == "assistant" and got[1][3] == 0  # stored, incomplete
    assert proxy.alive()


def test_client_disconnect_midstream(proxy: Proxy, fake: FakeProvider) -> None:
    fake.script(Text("word " * 200, chunks=200, delay=0.01))
    body = {"model": "claude-opus-4-8", "max_tokens": 500, "stream": True,
            "metadata": {"user_id": "gina"}, "messages": user_msgs("talk a lot")}
    with httpx.stream("POST", proxy.url + "/v1/messages", json=body,
                      headers={"x-api-key": KEY}) as r:
        next(r.iter_raw())  # first bytes arrived; now hang up
    fake.wait_hung_up(fake.requests[-1])  # the proxy hung up on the provider in turn
    assert proxy.alive()
    fake.script(Text("still here"))
    r = claude(proxy.url).messages.create(model="claude-opus-4-8", max_tokens=5,
                                          metadata={"user_id": "gina"},
                                          messages=user_msgs("are you ok?"))
    assert r.content[0].text == "still here"
    texts = [t for _, _, t, _ in proxy.wait_messages("gina", 3)]
    assert texts[0] == "talk a lot" and "are you ok?" in texts


@pytest.mark.parametrize("path,content,ctype", [
    ("/v1/messages", b'{"model": "claude", "messages": [', "application/json"),
    ("/v1/messages", b"\x00\xff not json at all", "application/octet-stream"),
    ("/v1/chat/completions", b'["a list", "not an object"]', "application/json"),
    ("/v1/messages", b'{"model": "claude", "messages": "not a list"}', "application/json"),
    ("/v1/unknown/endpoint", b'{"x": 1}', "application/json"),
])
def test_bad_input_passes_through_untouched(proxy: Proxy, fake: FakeProvider, path: str,
                                            content: bytes, ctype: str) -> None:
    r = httpx.post(proxy.url + path, content=content,
                   headers={"x-api-key": KEY, "content-type": ctype})
    (rec,) = fake.wait_requests(1)
    assert rec.body == content and rec.path == path
    assert r.status_code == 404 if "unknown" in path else r.status_code in (200, 400)
    assert proxy.alive()


def test_huge_body_passes_through(proxy: Proxy, fake: FakeProvider) -> None:
    big = "x" * (33 * 1024 * 1024)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": big}], "user": "hugo"}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body,
                   headers={"authorization": "Bearer sk-x"}, timeout=60)
    assert r.status_code == 200
    assert len(fake.wait_requests(1)[0].body) > 33 * 1024 * 1024
    assert proxy.messages("hugo") == []


def test_secrets_never_stored_and_db_private(proxy: Proxy, fake: FakeProvider) -> None:
    claude(proxy.url).messages.create(model="claude-opus-4-8", max_tokens=5,
                                      messages=user_msgs("who am I?"))
    # Stored under the salted hash of the key (never the key): wait for the store's thread.
    deadline = time.monotonic() + 5
    while not proxy.rows("select 1 from message m join item i on i.message_id = m.id "
                         "where i.text = 'who am I?'"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if isinstance(proxy.db, str):  # PostgreSQL: no file to read, every text instead
        assert not proxy.rows("select 1 from item where strpos(text, 'SECRET') > 0"
                              " or strpos(text, 'never-stored') > 0")
    else:
        raw = b"".join(p.read_bytes() for p in proxy.db.parent.glob("memory.db*"))
        assert b"SECRET" not in raw and b"never-stored" not in raw
        assert stat.S_IMODE(os.stat(proxy.db).st_mode) == 0o600
    # The salted hash of the key is the user, never the key.
    users = [u for (u,) in proxy.rows("select key from user")]
    assert any(u.startswith("key-") for u in users)


def test_concurrent_streams_do_not_wait_for_each_other(proxy: Proxy, fake: FakeProvider) -> None:
    fake.script(Text("slow " * 20, chunks=20, delay=0.1), Text("fast"))
    c = claude(proxy.url)
    slow_done = threading.Event()

    def slow() -> None:
        with c.messages.stream(model="claude-opus-4-8", max_tokens=50,
                               messages=user_msgs("slow one"),
                               extra_headers={"x-perpetuity-user": "ivy"}) as s:
            "".join(s.text_stream)
        slow_done.set()

    t = threading.Thread(target=slow)
    t.start()
    fake.wait_requests(1)
    r = c.messages.create(model="claude-opus-4-8", max_tokens=5, messages=user_msgs("fast one"),
                          extra_headers={"x-perpetuity-user": "ivy"})
    assert r.content[0].text == "fast"
    assert not slow_done.is_set()  # an ordering, not a clock: the fast one ended first
    t.join()


def test_regular_proxy_mode_routes_provider_hosts_and_leaves_others(proxy: Proxy,
                                                                    fake: FakeProvider) -> None:
    """HTTPS_PROXY use: api.anthropic.com is recognised (TLS through the mitmproxy CA) and
    carried to the configured upstream; any other host passes through untouched."""
    ca = proxy.confdir / "mitmproxy-ca-cert.pem"
    http_client = anthropic.DefaultHttpxClient(proxy=proxy.url,
                                               verify=ssl.create_default_context(cafile=str(ca)))
    c = owned(anthropic.Anthropic(api_key=KEY, max_retries=0, http_client=http_client))
    fake.script(Text("Through the proxy."))
    r = c.messages.create(model="claude-opus-4-8", max_tokens=5, metadata={"user_id": "jack"},
                          messages=user_msgs("proxied hello"))
    assert r.content[0].text == "Through the proxy."
    assert [t for _, _, t, _ in proxy.wait_messages("jack", 2)] == ["proxied hello",
                                                                   "Through the proxy."]
    http_client.close()
    # Another host, reached through the proxy: forwarded as sent, nothing parsed or stored.
    other = fake.url.replace("127.0.0.1", "localhost")
    with httpx.Client(proxy=proxy.url, trust_env=False) as h:
        got = h.post(other + "/v1/messages", headers={"x-perpetuity-user": "kate"},
                     json={"model": "claude-opus-4-8", "max_tokens": 5, "messages": user_msgs("hi")})
    assert got.status_code == 200
    assert fake.requests[-1].headers.get("x-perpetuity-user") == "kate"  # not even stripped
    assert proxy.messages("kate") == []
