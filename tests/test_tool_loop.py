"""The recall tools' loop, run inside the proxy mid-reply: real SDK clients, a real mitmdump,
the fake provider scripted to call our tools."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Proxy, owned, start_proxy, stop_proxy
from tests.fake_provider import Cut, FakeProvider, Text, ToolCall

WEATHER = {"name": "get_weather", "description": "Weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
MEMORY = ["The vault code is 4471.", "Noted.", "My sister Ada lives in Oslo.", "Noted.",
          "We planted tomatoes in April.", "Noted."]


@pytest.fixture(scope="module")
def proxy(fake: FakeProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    p = start_proxy(tmp_path_factory.mktemp("tools"), fake.url, "--set", "perpetuity_tool_rounds=3")
    yield p
    stop_proxy(p)
    assert b"perpetuity_core" not in p.log.read_bytes(), p.log.read_text()


def client(proxy: Proxy) -> anthropic.Anthropic:
    return owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-tools", max_retries=0))


def remember(proxy: Proxy, fake: FakeProvider, user: str) -> None:
    """Give `user` a memory: an earlier conversation, stored through the proxy."""
    history: list[dict] = []
    for said, reply in zip(MEMORY[::2], MEMORY[1::2]):
        history.append({"role": "user", "content": said})
        fake.script(Text(reply))
        client(proxy).messages.create(model="claude-opus-4-8", max_tokens=20, messages=history,
                                      extra_headers={"x-perpetuity-user": user,
                                                     "x-perpetuity-conversation": "earlier"})
        history.append({"role": "assistant", "content": reply})
    proxy.wait_messages(user, len(MEMORY))
    fake.clear()


def ask(user: str, text: str = "What is the vault code?") -> dict:
    return dict(model="claude-opus-4-8", max_tokens=50, tools=[WEATHER],
                messages=[{"role": "user", "content": text}],
                extra_headers={"x-perpetuity-user": user, "x-perpetuity-conversation": "now"})


def test_streamed_reply_hides_our_tool_and_continues_upstream(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t1")
    fake.script(ToolCall("memory_search", {"query": "sister Oslo"}, call_id="toolu_mem_1",
                         text="Let me look."),
                Text("Ada lives in Oslo.", chunks=2))
    with client(proxy).messages.stream(**ask("t1", "Where does my sister live?")) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "text"]
    assert final.content[0].text == "Let me look." and final.content[1].text == "Ada lives in Oslo."
    assert final.stop_reason == "end_turn"
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.index for e in starts] == [0, 1]  # renumbered consecutively across rounds
    assert sum(e.type == "message_start" for e in events) == 1
    assert not any("memory_" in str(e) for e in events)
    # Usage summed over both rounds.
    first, second = fake.wait_requests(2)
    assert final.usage.input_tokens >= 2
    # Upstream: our tools beside the harness's; the second round carries the call and result.
    names = [t["name"] for t in first.json["tools"]]
    assert names[0] == "get_weather" and "memory_search" in names and "memory_more" in names
    assert second.json["messages"][-2]["content"][-1]["name"] == "memory_search"
    result = second.json["messages"][-1]["content"][0]
    assert result["type"] == "tool_result" and result["tool_use_id"] == "toolu_mem_1"
    # The reply is stored once, as the client saw it.
    texts = [t for role, _, t, _ in proxy.wait_messages("t1", len(MEMORY) + 2) if role == "assistant"]
    assert texts[-1] == "Let me look.|Ada lives in Oslo."


def test_thinking_keeps_its_signature_across_rounds(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t7")
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_think",
                         thinking="I should check memory."),
                Text("4471.", thinking="Found it."))
    with client(proxy).messages.stream(**ask("t7")) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "thinking", "text"]
    assert all(b.signature for b in final.content if b.type == "thinking")
    carried = fake.wait_requests(2)[1].json["messages"][-2]["content"]
    assert carried[0]["type"] == "thinking" and carried[0]["signature"]
    assert carried[0]["thinking"] == "I should check memory."


def test_whole_reply_merged_when_not_streamed(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t2")
    fake.script(ToolCall("memory_dates", {"query": "tomatoes"}, call_id="toolu_mem_2"),
                Text("In April."))
    r = client(proxy).messages.create(**ask("t2", "When did we plant tomatoes?"))
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "In April."
    assert r.stop_reason == "end_turn"
    assert len(fake.wait_requests(2)) == 2
    stored = proxy.wait_messages("t2", len(MEMORY) + 2)
    assert stored[-1][:3] == ("assistant", "reply", "In April.")
    # Usage summed over both rounds (the fake counts a request's input as its length / 4).
    assert r.usage.input_tokens == sum(max(1, len(q.body) // 4) for q in fake.requests)


def test_tools_off_means_a_prompt_that_never_mentions_them(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t11")
    fake.script(Text("4471."))
    body = ask("t11")
    body["extra_headers"]["x-perpetuity-tools"] = "off"
    client(proxy).messages.create(**body)
    sent = fake.wait_requests(1)[0]
    assert [t["name"] for t in sent.json["tools"]] == ["get_weather"]
    assert b"memory_" not in sent.body and b"The vault code is 4471." in sent.body


def test_rounds_are_bounded_and_the_last_must_answer(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t3")
    fake.script(ToolCall("memory_search", {"query": "a"}, call_id="toolu_a"),
                ToolCall("memory_search", {"query": "b"}, call_id="toolu_b"),
                Text("Answer."))
    r = client(proxy).messages.create(**ask("t3"))
    assert r.content[-1].text == "Answer."
    sent = fake.wait_requests(3)
    assert "tool_choice" not in sent[0].json and sent[2].json["tool_choice"] == {"type": "none"}


def test_mixed_calls_reach_the_client_as_a_valid_reply(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t4")
    fake.script(ToolCall("memory_search", {"query": "x"}, call_id="toolu_ours",
                         also=(ToolCall("get_weather", {"city": "Oslo"}, call_id="toolu_theirs"),)))
    with client(proxy).messages.stream(**ask("t4")) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "name", "")) for b in final.content] == [("tool_use", "get_weather")]
    assert final.stop_reason == "tool_use" and final.content[0].id == "toolu_theirs"
    assert len(fake.requests) == 1  # the harness runs its tool; nothing more upstream now


def test_client_gone_during_a_tool_round_stops_upstream(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t5")
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_gone", delay=0.1),
                Text("late"))
    body = ask("t5")
    headers = {"x-api-key": "sk-ant-tools", "anthropic-version": "2023-06-01",
               **body.pop("extra_headers")}
    with httpx.stream("POST", proxy.url + "/v1/messages", json={**body, "stream": True},
                      headers=headers) as r:
        next(r.iter_raw())
    time.sleep(1.0)
    assert len(fake.requests) == 1  # the tool round ran for no one: no second upstream call
    assert proxy.alive()


def test_a_tool_round_never_delays_another_stream(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t6")
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_slow"),
                Text("slow " * 30, chunks=30, delay=0.05), Text("fast"))
    done = threading.Event()

    def slow() -> None:
        with client(proxy).messages.stream(**ask("t6")) as s:
            s.get_final_message()
        done.set()

    t = threading.Thread(target=slow)
    t.start()
    fake.wait_requests(2)
    r = client(proxy).messages.create(model="claude-opus-4-8", max_tokens=5,
                                      messages=[{"role": "user", "content": "quick one"}],
                                      extra_headers={"x-perpetuity-user": "t6-other"})
    assert r.content[0].text == "fast"
    assert not done.is_set()  # an ordering, not a clock: the other stream ended first
    t.join()


def gpt(proxy: Proxy) -> openai.OpenAI:
    return owned(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-tools", max_retries=0))


def remember_openai(proxy: Proxy, fake: FakeProvider, user: str) -> None:
    history: list[dict] = []
    for said, reply in zip(MEMORY[::2], MEMORY[1::2]):
        history.append({"role": "user", "content": said})
        fake.script(Text(reply))
        gpt(proxy).chat.completions.create(model="gpt-4o", messages=history, user=user,
                                           extra_headers={"x-perpetuity-conversation": "earlier"})
        history.append({"role": "assistant", "content": reply})
    proxy.wait_messages(user, len(MEMORY))
    fake.clear()


CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("stream", [True, False])
def test_chat_completions_loop(proxy: Proxy, fake: FakeProvider, stream: bool) -> None:
    user = f"c-{stream}"
    remember_openai(proxy, fake, user)
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="call_mem"),
                Text("It is 4471.", chunks=3))
    kwargs = dict(model="gpt-4o", user=user, tools=[CHAT_TOOL],
                  messages=[{"role": "user", "content": "What is the vault code?"}],
                  extra_headers={"x-perpetuity-conversation": "now"})
    if stream:
        chunks = list(gpt(proxy).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["stop"] and chunks[-1].usage is not None
        assert len({c.id for c in chunks}) == 1
    else:
        r = gpt(proxy).chat.completions.create(**kwargs)
        text = r.choices[0].message.content
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert text == "It is 4471."
    second = fake.wait_requests(2)[1].json
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "memory_search"
    assert second["messages"][-1]["role"] == "tool" and second["messages"][-1]["tool_call_id"] == "call_mem"


@pytest.mark.parametrize("stream", [True, False])
def test_responses_loop(proxy: Proxy, fake: FakeProvider, stream: bool) -> None:
    user = f"r-{stream}"
    remember_openai(proxy, fake, user)
    fake.script(ToolCall("memory_search", {"query": "sister"}, call_id="call_r"),
                Text("Oslo.", chunks=2))
    kwargs = dict(model="gpt-5", user=user, input="Where does my sister live?",
                  tools=[{"type": "function", "name": "get_weather",
                          "parameters": {"type": "object", "properties": {}}}],
                  extra_headers={"x-perpetuity-conversation": "now"})
    if stream:
        events = list(gpt(proxy).responses.create(stream=True, **kwargs))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert sum(e.type == "response.created" for e in events) == 1
        final = events[-1].response
        assert events[-1].type == "response.completed"
        assert not any(getattr(e, "item", None) is not None and e.item.type == "function_call"
                       for e in events)
    else:
        final = gpt(proxy).responses.create(**kwargs)
    assert final.output_text == "Oslo."
    assert [o.type for o in final.output] == ["message"]
    second = fake.wait_requests(2)[1].json
    assert second["input"][-1] == {"type": "function_call_output", "call_id": "call_r",
                                   "output": second["input"][-1]["output"]}
    assert second["input"][-2]["type"] == "function_call"


def test_the_binding_log_records_what_a_turn_was_shown(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t8")
    fake.script(Text("4471."))
    client(proxy).messages.create(**ask("t8"))
    deadline = time.monotonic() + 5
    while True:  # the binding is written by the store's thread after the reply
        texts = {t for (t,) in proxy.rows(
            "select i.text from binding b join item i on i.id = b.item_id join message m"
            " on m.id = b.turn_message_id join user u on u.id = m.user_id where u.key like '%/t8'")}
        if "4471." in texts or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "4471." in texts and "The vault code is 4471." in texts


def test_failure_before_the_first_byte_falls_back_to_the_plain_request(
        proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t9")
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_f"), Cut(),
                Text("Answered without the tools."))
    r = client(proxy).messages.create(**ask("t9"))  # whole reply: nothing sent before the cut
    assert r.content[0].text == "Answered without the tools."
    last = fake.wait_requests(3)[2].json
    assert not any(t["name"].startswith("memory_") for t in last.get("tools", []))


def test_failure_mid_stream_ends_with_the_protocols_error_event(
        proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "t10")
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_m", text="Looking."),
                Cut(after_events=1))
    with pytest.raises(anthropic.APIStatusError, match="upstream failed"):
        with client(proxy).messages.stream(**ask("t10")) as s:
            for _ in s:
                pass
    assert proxy.alive()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_mixed_calls_in_openai_protocols(proxy: Proxy, fake: FakeProvider, api: str) -> None:
    user = f"mixed-{api}"
    remember_openai(proxy, fake, user)
    fake.script(ToolCall("memory_search", {"query": "x"}, call_id="call_ours",
                         also=(ToolCall("get_weather", {"city": "Oslo"}, call_id="call_theirs"),)))
    if api == "chat":
        chunks = list(gpt(proxy).chat.completions.create(
            model="gpt-4o", user=user, tools=[CHAT_TOOL], stream=True,
            messages=[{"role": "user", "content": "Weather where my sister lives?"}],
            extra_headers={"x-perpetuity-conversation": "now"}))
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        assert [c.id for c in calls if c.id] == ["call_theirs"] and {c.index for c in calls} == {0}
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices
                and ch.choices[0].finish_reason] == ["tool_calls"]
    else:
        events = list(gpt(proxy).responses.create(
            model="gpt-5", user=user, stream=True, input="Weather where my sister lives?",
            tools=[{"type": "function", "name": "get_weather",
                    "parameters": {"type": "object", "properties": {}}}],
            extra_headers={"x-perpetuity-conversation": "now"}))
        final = events[-1].response
        assert [(o.type, o.call_id) for o in final.output] == [("function_call", "call_theirs")]
    assert len(fake.requests) == 1  # the harness's call goes back to the harness


def test_fifty_streams_never_wait_on_one_in_a_long_tool_round(proxy: Proxy,
                                                              fake: FakeProvider) -> None:
    """One client is inside a tool round whose second upstream round streams for ~10 s; 49
    more streams, all at once, each get their whole reply before it ends."""
    from concurrent.futures import ThreadPoolExecutor

    remember(proxy, fake, "t50")
    fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_long"),
                Text("slow " * 40, chunks=40, delay=0.25))
    slow_done = threading.Event()

    def slow() -> None:
        # Each client closed: one left to the collector warns (ResourceWarning) on its socket.
        with client(proxy) as c, c.messages.stream(**ask("t50")) as s:
            s.get_final_message()
        slow_done.set()

    long_round = threading.Thread(target=slow)
    long_round.start()
    fake.wait_requests(2)  # its tool ran; the second round is streaming
    fake.script(*(Text(f"fast {i}", chunks=2) for i in range(49)))

    def fast(i: int) -> str:
        with client(proxy) as c, c.messages.stream(**ask(f"s{i}", f"Question {i}?")) as s:
            return s.get_final_message().content[0].text

    with ThreadPoolExecutor(49) as pool:
        got = list(pool.map(fast, range(49)))
    assert sorted(got) == sorted(f"fast {i}" for i in range(49))
    assert not slow_done.is_set()
    long_round.join()
    assert slow_done.is_set()
