"""The fake provider is faithful: the official SDKs parse every reply it sends."""

from __future__ import annotations

import json
import socket
import threading

import anthropic
import httpx
import openai

try:  # the current SDKs vendor their HTTP client as httpx2
    import httpx2

    TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (httpx.HTTPError, httpx2.HTTPError)
except ImportError:  # pragma: no cover
    TRANSPORT_ERRORS = (httpx.HTTPError,)
import pytest

from tests.fake_provider import Cut, Error, FakeProvider, Recorded, Text, ToolCall

MODEL_A = "claude-opus-4-8"
MODEL_O = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "say hello"}]
WEATHER_TOOL_A = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
WEATHER_TOOL_CHAT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
WEATHER_TOOL_RESP = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server():
    with FakeProvider() as fake:
        yield fake
        assert fake.errors == []


@pytest.fixture
def fake(server):
    server.clear()
    yield server
    server.clear()


@pytest.fixture
def ant(fake):
    with anthropic.Anthropic(base_url=fake.url, api_key="test-key", max_retries=0) as client:
        yield client


@pytest.fixture
def oai(fake):
    with openai.OpenAI(base_url=fake.url + "/v1", api_key="test-key", max_retries=0) as client:
        yield client


def last_body_tokens(fake) -> int:
    return max(1, len(fake.requests[-1].body) // 4)


# --------------------------------------------------------------------------- Anthropic


def test_anthropic_create_not_streamed(fake, ant):
    fake.script(Text("Hello there, friend.", chunks=3))
    msg = ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES)
    assert msg.model == MODEL_A
    assert msg.id.startswith("msg_fake_")
    assert msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == "Hello there, friend."
    assert msg.stop_reason == "end_turn"
    assert msg.usage.input_tokens == last_body_tokens(fake)
    assert msg.usage.output_tokens == (len("Hello there, friend.") + 3) // 4
    rec = fake.requests[-1]
    assert isinstance(rec, Recorded)
    assert (rec.method, rec.path, rec.query) == ("POST", "/v1/messages", "")
    assert rec.json["model"] == MODEL_A
    assert "test-key" in (rec.headers.get("x-api-key") or rec.headers["authorization"])


def test_anthropic_create_streamed_events(fake, ant):
    fake.script(Text("Hello there, friend.", chunks=3))
    with ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES, stream=True) as stream:
        events = list(stream)
        request_id = stream.response.headers["request-id"]
        content_type = stream.response.headers["content-type"]
    assert content_type == "text/event-stream; charset=utf-8"
    assert request_id.startswith("req_fake_")
    types = [e.type for e in events]
    assert types == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # the SDK swallows ping
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == "Hello there, friend."
    assert events[0].message.model == MODEL_A
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == 5
    assert events[-2].usage.input_tokens == last_body_tokens(fake)


def test_anthropic_stream_helper_final_message_with_thinking(fake, ant):
    fake.script(Text("The answer is 4.", chunks=4, thinking="2 plus 2 is 4."))
    with ant.messages.stream(
        model=MODEL_A,
        max_tokens=2048,
        messages=MESSAGES,
        thinking={"type": "enabled", "budget_tokens": 1024},
    ) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == "The answer is 4."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "2 plus 2 is 4."
    assert len(final.content[0].signature) > 40
    assert final.content[1].text == "The answer is 4."
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == last_body_tokens(fake)
    assert final.usage.output_tokens == 4 + 4


def test_anthropic_thinking_not_streamed(fake, ant):
    fake.script(Text("Four.", thinking="Adding."))
    msg = ant.messages.create(model=MODEL_A, max_tokens=2048, messages=MESSAGES)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Adding." and msg.content[0].signature


def test_anthropic_tool_call_streamed_and_not(fake, ant):
    args = {"city": "Paris", "units": "metric"}
    fake.script(
        ToolCall("get_weather", args, text="Let me check."),
        ToolCall("get_weather", args, call_id="toolu_given"),
    )
    with ant.messages.stream(model=MODEL_A, max_tokens=64, messages=MESSAGES, tools=[WEATHER_TOOL_A]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check."
    tool = final.content[1]
    assert tool.name == "get_weather" and tool.input == args and tool.id.startswith("toolu_fake_")
    assert final.stop_reason == "tool_use"

    msg = ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES, tools=[WEATHER_TOOL_A])
    assert [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].id == "toolu_given" and msg.content[0].input == args
    assert msg.stop_reason == "tool_use"


def test_anthropic_beta_and_count_tokens(fake, ant):
    fake.script(Text("beta reply"))
    msg = ant.beta.messages.create(
        model=MODEL_A,
        max_tokens=64,
        messages=MESSAGES,
        betas=["interleaved-thinking-2025-05-14"],
        extra_query={"beta": "true"},  # what Claude Code sends
    )
    assert msg.content[0].text == "beta reply"
    rec = fake.requests[-1]
    assert rec.path == "/v1/messages" and rec.query == "beta=true"
    assert rec.headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"

    fake.script(Text("kept for later"))
    counted = ant.messages.count_tokens(model=MODEL_A, messages=MESSAGES)
    assert counted.input_tokens == last_body_tokens(fake)
    assert fake.requests[-1].path == "/v1/messages/count_tokens"
    assert fake.pending == 1  # count_tokens does not consume the script


def test_anthropic_errors(fake, ant):
    fake.script(Error(429, headers={"retry-after": "3"}), Error(529), Error(400, body={"type": "error", "error": {"type": "invalid_request_error", "message": "custom"}}))
    with pytest.raises(anthropic.RateLimitError) as info:
        ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES, stream=True)
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "3"
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert info.value.request_id and info.value.request_id.startswith("req_fake_")
    with pytest.raises(anthropic.InternalServerError) as info:
        ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES)
    assert info.value.status_code == 529
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    with pytest.raises(anthropic.BadRequestError, match="custom"):
        ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES)


def test_anthropic_cut_raises(fake, ant):
    fake.script(Cut(after_events=3))
    seen = []
    with pytest.raises((*TRANSPORT_ERRORS, anthropic.APIError)):
        with ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES, stream=True) as stream:
            for event in stream:
                seen.append(event.type)
    assert seen[:2] == ["message_start", "content_block_start"]
    assert "message_stop" not in seen
    assert fake.requests[-1].json["stream"] is True

    fake.script(Cut())  # a non-streamed request: half a body, then the connection drops
    with pytest.raises((*TRANSPORT_ERRORS, anthropic.APIError)):
        ant.messages.create(model=MODEL_A, max_tokens=64, messages=MESSAGES)


# --------------------------------------------------------------------------- OpenAI Chat Completions


def test_chat_streamed_with_usage(fake, oai):
    fake.script(Text("Hello from chat.", chunks=3))
    stream = oai.chat.completions.create(
        model=MODEL_O, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    with stream:
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from chat."
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.prompt_tokens == last_body_tokens(fake)
    assert usage.completion_tokens == 4
    assert usage.total_tokens == usage.prompt_tokens + 4
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-fake")
    assert all(c.model == MODEL_O for c in chunks)


def test_chat_streamed_without_usage_and_raw_shape(fake, oai):
    fake.script(Text("abc", chunks=3, thinking="ignored by chat"))
    with httpx.Client() as client:
        r = client.post(fake.url + "/v1/chat/completions", json={"model": MODEL_O, "messages": MESSAGES, "stream": True})
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["transfer-encoding"] == "chunked"
    assert r.headers["x-request-id"].startswith("req_fake_")
    datas = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "a", "b", "c", None]
    assert r.text.endswith("data: [DONE]\n\n")


def test_chat_not_streamed(fake, oai):
    fake.script(Text("Plain reply."))
    completion = oai.chat.completions.create(model=MODEL_O, messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.model == MODEL_O
    assert completion.choices[0].message.content == "Plain reply."
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == last_body_tokens(fake)
    assert completion.usage.completion_tokens == 3


def test_chat_tool_calls(fake, oai):
    args = {"city": "Paris"}
    fake.script(ToolCall("get_weather", args), ToolCall("get_weather", args, call_id="call_given", text="Checking."))
    stream = oai.chat.completions.create(
        model=MODEL_O, messages=MESSAGES, tools=[WEATHER_TOOL_CHAT], stream=True, stream_options={"include_usage": True}
    )
    with stream:
        chunks = list(stream)
    call_id, name, arguments = None, "", ""
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            assert tc.index == 0
            call_id = tc.id or call_id
            name += (tc.function.name or "") if tc.function else ""
            arguments += (tc.function.arguments or "") if tc.function else ""
    assert name == "get_weather" and json.loads(arguments) == args
    assert call_id.startswith("call_fake_")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None

    completion = oai.chat.completions.create(model=MODEL_O, messages=MESSAGES, tools=[WEATHER_TOOL_CHAT])
    message = completion.choices[0].message
    assert message.content == "Checking."
    assert completion.choices[0].finish_reason == "tool_calls"
    (tc,) = message.tool_calls
    assert tc.id == "call_given" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == args


def test_chat_stream_helper_accumulates(fake, oai):
    fake.script(ToolCall("get_weather", {"city": "Oslo"}, text="One moment."))
    with oai.chat.completions.stream(model=MODEL_O, messages=MESSAGES, tools=[WEATHER_TOOL_CHAT]) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "One moment."
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_chat_error_and_cut(fake, oai):
    fake.script(Error(429, headers={"retry-after": "3"}), Error(500), Cut(2))
    with pytest.raises(openai.RateLimitError) as info:
        oai.chat.completions.create(model=MODEL_O, messages=MESSAGES, stream=True)
    assert info.value.response.headers["retry-after"] == "3"
    assert info.value.code == "rate_limit_exceeded"
    assert info.value.request_id.startswith("req_fake_")
    with pytest.raises(openai.InternalServerError):
        oai.chat.completions.create(model=MODEL_O, messages=MESSAGES)
    seen = []
    with pytest.raises((*TRANSPORT_ERRORS, openai.APIError)):
        stream = oai.chat.completions.create(model=MODEL_O, messages=MESSAGES, stream=True)
        with stream:
            for chunk in stream:
                seen.append(chunk)
    assert len(seen) == 2


# --------------------------------------------------------------------------- OpenAI Responses


RESPONSES_TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def test_responses_streamed(fake, oai):
    fake.script(Text("Hello from responses.", chunks=3))
    stream = oai.responses.create(model="gpt-5", input="say hello", instructions="Be terse.", stream=True)
    with stream:
        events = list(stream)
    assert [e.type for e in events] == RESPONSES_TEXT_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello from responses."
    done = events[-1].response
    assert done.status == "completed" and done.model == "gpt-5"
    assert done.output_text == "Hello from responses."
    assert done.usage.input_tokens == last_body_tokens(fake)
    assert done.usage.output_tokens == 6
    assert done.id.startswith("resp_fake_") and events[0].response.id == done.id


def test_responses_not_streamed_with_reasoning(fake, oai):
    fake.script(Text("Four.", thinking="Two and two."))
    response = oai.responses.create(model="gpt-5", input="2+2?")
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].summary[0].text == "Two and two."
    assert response.output_text == "Four."
    assert response.usage.output_tokens_details.reasoning_tokens == 3


def test_responses_stream_helper_with_reasoning(fake, oai):
    fake.script(Text("Four.", thinking="Two and two.", chunks=2))
    with oai.responses.stream(model="gpt-5", input="2+2?") as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[2:9] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
    ]
    assert final.output_text == "Four."


def test_responses_function_call(fake, oai):
    args = {"city": "Paris"}
    fake.script(ToolCall("get_weather", args), ToolCall("get_weather", args, call_id="call_given", text="Checking."))
    stream = oai.responses.create(model="gpt-5", input="weather?", tools=[WEATHER_TOOL_RESP], stream=True)
    with stream:
        events = list(stream)
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert json.loads("".join(e.delta for e in events if e.type.endswith("arguments.delta"))) == args
    (item,) = events[-1].response.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == args and item.call_id.startswith("call_fake_")

    response = oai.responses.create(model="gpt-5", input="weather?", tools=[WEATHER_TOOL_RESP])
    assert [i.type for i in response.output] == ["message", "function_call"]
    assert response.output_text == "Checking."
    assert response.output[1].call_id == "call_given"
    assert json.loads(response.output[1].arguments) == args


def test_responses_error_and_cut(fake, oai):
    fake.script(Error(429, headers={"retry-after": "3"}), Cut(4))
    with pytest.raises(openai.RateLimitError):
        oai.responses.create(model="gpt-5", input="hi", stream=True)
    seen = []
    with pytest.raises((*TRANSPORT_ERRORS, openai.APIError)):
        stream = oai.responses.create(model="gpt-5", input="hi", stream=True)
        with stream:
            for event in stream:
                seen.append(event.type)
    assert seen == RESPONSES_TEXT_EVENTS[:4]


# --------------------------------------------------------------------------- server behaviour


def raw_exchange(url: str, path: str, body: dict) -> bytes:
    """One request over a raw socket; returns every byte the server sent."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(head + payload)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
    return bytes(received)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/messages?beta=true", {"model": MODEL_A, "max_tokens": 9, "messages": MESSAGES, "stream": True}),
        ("/v1/messages", {"model": MODEL_A, "max_tokens": 9, "messages": MESSAGES}),
        ("/v1/chat/completions", {"model": MODEL_O, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"model": MODEL_O, "messages": MESSAGES}),
        ("/v1/responses", {"model": "gpt-5", "input": "hi", "stream": True}),
        ("/v1/responses", {"model": "gpt-5", "input": "hi"}),
    ],
)
def test_determinism_raw_bytes(fake, path, body):
    script = [Text("Same every time.", thinking="Hmm."), ToolCall("get_weather", {"city": "Paris"}, text="x"), Error(429, headers={"retry-after": "3"})]
    runs = []
    for _ in range(2):
        fake.script(*script)
        runs.append([raw_exchange(fake.url, path, body) for _ in script])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == len(script)  # different items, different replies
    for raw in runs[0]:
        assert b"date:" not in raw.lower()

    # and through httpx: same status, headers and body
    seen = []
    for _ in range(2):
        fake.script(*script)
        with httpx.Client() as client:
            seen.append(
                [
                    (r.status_code, r.headers.raw, r.content)
                    for r in (client.post(fake.url + path, json=body) for _ in script)
                ]
            )
    assert seen[0] == seen[1]


def test_ids_follow_model_and_item(fake):
    with httpx.Client() as client:
        fake.script(Text("a"), Text("a"), Text("b"))
        ids = [
            client.post(fake.url + "/v1/messages", json={"model": m, "max_tokens": 9, "messages": MESSAGES}).json()["id"]
            for m in ("m1", "m2", "m1")
        ]
    assert len(set(ids)) == 3


def test_default_reply_and_unknown_path(fake, oai):
    completion = oai.chat.completions.create(model=MODEL_O, messages=MESSAGES)
    assert completion.choices[0].message.content == "Hello from the fake provider."
    with httpx.Client() as client:
        assert client.head(fake.url + "/").status_code == 200
        assert client.get(fake.url + "/").json() == {}
        r = client.get(fake.url + "/v1/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_events_are_flushed_as_produced(fake):
    """The first event reaches the client while the server holds the rest back: were events
    buffered, it would never come and the read would time out."""
    release = threading.Event()
    fake.script(Text("abcd", chunks=4, hold=release))
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", fake.url + "/v1/chat/completions", json={"model": MODEL_O, "messages": MESSAGES, "stream": True}) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            first = next(events)
            release.set()
            rest = list(events)
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert len(rest) == 6  # 4 deltas, finish, [DONE]


def test_records_request_when_client_disconnects_mid_stream(fake):
    fake.script(Text("x" * 40, chunks=40, delay=0.02), Text("after"))
    with httpx.Client() as client:
        with client.stream("POST", fake.url + "/v1/messages", json={"model": MODEL_A, "max_tokens": 9, "messages": MESSAGES, "stream": True}) as r:
            next(r.iter_lines())  # read a little, then hang up
    (rec,) = fake.wait_requests(1)
    assert rec.json["model"] == MODEL_A
    fake.wait_hung_up()  # the server has seen the reset
    with httpx.Client() as client:
        r = client.post(fake.url + "/v1/messages", json={"model": MODEL_A, "max_tokens": 9, "messages": MESSAGES})
    assert r.json()["content"][0]["text"] == "after"
    assert fake.errors == []


def test_wait_requests_and_clear(fake):
    with pytest.raises(TimeoutError):
        fake.wait_requests(1, timeout=0.05)
    fake.script(Text("queued"))
    with httpx.Client() as client:
        client.post(fake.url + "/v1/messages/count_tokens", json={"model": MODEL_A, "messages": MESSAGES}, headers={"X-Thing": "1"})
    (rec,) = fake.wait_requests(1)
    assert rec.headers["x-thing"] == "1"
    assert rec.json == {"model": MODEL_A, "messages": MESSAGES}
    fake.clear()
    assert fake.requests == [] and fake.pending == 0


def test_keep_alive_serves_several_requests(fake, ant):
    fake.script(*(Text(f"reply {i}") for i in range(5)))
    texts = [ant.messages.create(model=MODEL_A, max_tokens=9, messages=MESSAGES).content[0].text for _ in range(5)]
    assert texts == [f"reply {i}" for i in range(5)]


def test_start_stop_standalone():
    fake = FakeProvider().start()
    try:
        assert fake.url.startswith("http://127.0.0.1:")
        with httpx.Client() as client:
            assert client.post(fake.url + "/v1/responses", json={"model": "gpt-5", "input": "hi"}).status_code == 200
    finally:
        fake.stop()
    fake.stop()  # idempotent
