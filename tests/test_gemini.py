"""The Gemini protocol: the official google-genai SDK through a real mitmdump to the fake
provider, gemini-cli's captured requests replayed, Code Assist through the proxy as an HTTPS
proxy, and the adapter on the captures."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import httpx
import pytest
from google import genai
from google.genai import types

from perpetuity_core.wire.conversation import Kind, Message, Part, Provider
from perpetuity_core.wire.identity import identify
from perpetuity_core.wire.protocols import gemini
from perpetuity_core.wire.route import credential, gemini_call, provider_of
from perpetuity_core.wire.sse import SSEDecoder
from tests.conftest import FIXTURES, Proxy, needs_fixtures, owned
from tests.fake_provider import FakeProvider, Text, ToolCall

KEY = "AIzaSyGEMINI-test-key-never-stored-0123456"
MODEL = "gemini-2.5-flash"
CAPTURES = FIXTURES / "gemini-cli"
MEMORY = ["The vault code is 4471.", "Noted.", "My sister Ada lives in Oslo.", "Noted."]


def client(proxy: Proxy, user: str, conversation: str) -> genai.Client:
    options = types.HttpOptions(base_url=proxy.url, headers={
        "x-perpetuity-user": user, "x-perpetuity-conversation": conversation})
    return owned(genai.Client(api_key=KEY, http_options=options))


def remember(proxy: Proxy, fake: FakeProvider, user: str) -> None:
    """Give `user` a memory: an earlier conversation, through the proxy and the SDK."""
    chat = client(proxy, user, "earlier").chats.create(model=MODEL)
    for said, reply in zip(MEMORY[::2], MEMORY[1::2], strict=True):
        fake.script(Text(reply))
        assert chat.send_message(said).text == reply
    proxy.wait_messages(user, len(MEMORY))
    fake.clear()


def test_sdk_generate_and_stream_store_each_turn_once(proxy: Proxy, fake: FakeProvider) -> None:
    c = client(proxy, "g1", "first")
    fake.script(Text("Hello from Gemini.", chunks=3))
    assert c.models.generate_content(model=MODEL, contents="hi there").text == "Hello from Gemini."
    fake.script(Text("Streamed back.", chunks=4, thinking="pondering"))
    history = [types.Content(role="user", parts=[types.Part(text="hi there")]),
               types.Content(role="model", parts=[types.Part(text="Hello from Gemini.")]),
               types.Content(role="user", parts=[types.Part(text="and now stream")])]
    chunks = list(c.models.generate_content_stream(model=MODEL, contents=history))
    assert "".join(ch.text or "" for ch in chunks) == "Streamed back."
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    got = proxy.wait_messages("g1", 4)
    assert [(r, t) for r, _, t, _ in got] == [
        ("user", "hi there"), ("assistant", "Hello from Gemini."), ("user", "and now stream"),
        ("assistant", "pondering|Streamed back.")]
    sent = fake.requests[-1]
    assert sent.path.endswith(f"/models/{MODEL}:streamGenerateContent") and sent.query == "alt=sse"
    assert sent.headers["x-goog-api-key"] == KEY and "x-perpetuity-user" not in sent.headers
    assert proxy.rows("select count(*) from item where text like ?", f"%{KEY}%") == [(0,)]


def test_a_new_conversation_gets_the_frame_and_replies_byte_identical(
        proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "g2")
    fake.script(Text("It is 4471."))
    r = client(proxy, "g2", "now").models.generate_content(model=MODEL,
                                                           contents="What is the vault code?")
    assert r.text == "It is 4471."
    contents = fake.requests[-1].json["contents"]
    assert "4471" in json.dumps(contents[:-1])  # the frame in front
    assert contents[-1] == {"role": "user", "parts": [{"text": "What is the vault code?"}]}
    assert [c["role"] for c in contents[:2]] == ["user", "model"]
    # The recall tools rode along, as function declarations.
    names = [d["name"] for t in fake.requests[-1].json["tools"] for d in t["functionDeclarations"]]
    assert "memory_search" in names


def test_recall_tools_run_mid_reply_hidden_from_the_sdk(proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "g3")
    fake.script(ToolCall("memory_search", {"query": "sister Oslo"}, text="Let me look."),
                Text("Ada lives in Oslo.", chunks=2))
    chunks = list(client(proxy, "g3", "now").models.generate_content_stream(
        model=MODEL, contents="Where does my sister live?"))
    text = "".join(ch.text or "" for ch in chunks)
    assert text == "Let me look.Ada lives in Oslo."
    assert not any(ch.function_calls for ch in chunks)
    assert sum(ch.candidates[0].finish_reason is not None for ch in chunks) == 1
    assert chunks[-1].usage_metadata.prompt_token_count >= 2  # summed over both rounds
    first, second = fake.wait_requests(2)
    model_turn, answer = second.json["contents"][-2:]
    call = model_turn["parts"][-1]
    assert call["functionCall"]["name"] == "memory_search" and "thoughtSignature" in call
    assert answer["parts"][0]["functionResponse"]["name"] == "memory_search"
    assert "Oslo" in answer["parts"][0]["functionResponse"]["response"]["output"]
    assert [t for _, _, t, _ in proxy.wait_messages("g3", 6)][-1] == "Let me look.Ada lives in Oslo."
    # Not streamed: the same, in one body.
    fake.script(ToolCall("memory_search", {"query": "vault"}), Text("4471."))
    r = client(proxy, "g3", "whole").models.generate_content(model=MODEL,
                                                             contents="And the vault code?")
    assert r.text == "4471." and not r.function_calls


def test_gemini_cli_checks_pass_through_unstored_and_unframed(
        proxy: Proxy, fake: FakeProvider) -> None:
    """gemini-cli's routing classifier: a generateContent call with a JSON response schema."""
    capture = _capture("01-basic-generateContent-gemini_3_5_flash_lite.json")
    remember(proxy, fake, "g4")
    headers = {k: v for k, v in capture["headers"] if k.lower() not in ("host", "content-length")}
    headers |= {"x-goog-api-key": KEY, "x-perpetuity-user": "g4"}
    fake.script(Text('{"complexity_reasoning": "easy", "complexity_score": 5}'))
    r = httpx.post(proxy.url + capture["path"], headers=headers, json=capture["body"],
                   trust_env=False)
    assert r.status_code == 200
    assert fake.requests[-1].json == capture["body"]  # as sent: no frame, no tools
    assert len(proxy.messages("g4")) == len(MEMORY)  # nothing stored


def test_key_in_the_query_is_the_tenant_and_count_tokens_is_framed(
        proxy: Proxy, fake: FakeProvider) -> None:
    remember(proxy, fake, "g5")
    body = {"contents": [{"role": "user", "parts": [{"text": "What is the vault code?"}]}]}
    url = f"{proxy.url}/v1beta/models/{MODEL}:countTokens?key={KEY}"
    r = httpx.post(url, json=body, headers={"x-perpetuity-user": "g5"}, trust_env=False)
    assert r.status_code == 200 and r.json()["totalTokens"] > 0
    counted = fake.requests[-1].json["generateContentRequest"]
    assert "4471" in json.dumps(counted["contents"])  # counted as it would go upstream
    assert counted["model"] == f"models/{MODEL}"  # a generateContentRequest names its model
    declared = [d["name"] for t in counted["tools"] for d in t["functionDeclarations"]]
    assert "memory_search" in declared  # our tools, as they ride along upstream
    assert fake.requests[-1].query == f"key={KEY}"
    assert len(proxy.messages("g5")) == len(MEMORY)  # a count is not a turn


def test_code_assist_through_the_proxy_as_https_proxy(proxy: Proxy, fake: FakeProvider) -> None:
    """gemini-cli signed in with Google: the envelope kept, the OAuth bearer byte-identical."""
    ca = ssl.create_default_context(cafile=str(proxy.confdir / "mitmproxy-ca-cert.pem"))
    bearer = "Bearer ya29.a0-oauth-token"
    envelope = {"model": "gemini-2.5-pro", "project": "proj-1", "user_prompt_id": "u1",
                "request": {"contents": [{"role": "user", "parts": [{"text": "hello assist"}]}],
                            "session_id": "sess-ca-1"}}
    fake.script(Text("Assisted.", chunks=2))
    with httpx.Client(proxy=proxy.url, verify=ca, trust_env=False) as h:
        r = h.post("https://cloudcode-pa.googleapis.com/v1internal:streamGenerateContent?alt=sse",
                   json=envelope, headers={"authorization": bearer, "x-perpetuity-user": "g6"})
    assert r.status_code == 200
    events = [ev.json() for ev in SSEDecoder().feed(r.content)]
    assert "".join(e["response"]["candidates"][0]["content"]["parts"][0]["text"]
                   for e in events if e) == "Assisted."
    sent = fake.requests[-1]
    assert sent.path == "/v1internal:streamGenerateContent"
    assert sent.headers["authorization"] == bearer
    assert sent.json["project"] == "proj-1" and sent.json["request"]["contents"] == \
        envelope["request"]["contents"]
    got = proxy.wait_messages("g6", 2)
    assert [t for _, _, t, _ in got] == ["hello assist", "Assisted."]
    conv = proxy.rows("select c.key from conversation c join message m on m.conversation_id = c.id"
                      " join user u on u.id = m.user_id where u.key like '%g6' limit 1")
    assert conv == [("sess-ca-1",)]


# --------------------------------------------------------------------------- the adapter


def _capture(name: str) -> dict:
    if not CAPTURES.is_dir():
        pytest.skip(f"gemini-cli captures not present at {CAPTURES}")
    return json.loads((CAPTURES / name).read_text())


def _path(capture: dict) -> str:
    return capture["path"] + ("?" + "&".join(f"{k}={v}" for k, v in capture["query"])
                              if capture["query"] else "")


@needs_fixtures
@pytest.mark.parametrize("capture", sorted(p.name for p in CAPTURES.glob("*.json")
                                           if not p.name.endswith(".response.json"))
                         if CAPTURES.is_dir() else [])
def test_every_capture_parses_checks_and_its_reply_assembles(capture: str) -> None:
    c = _capture(capture)
    call = gemini_call(_path(c))
    assert call is not None and call.model.startswith("gemini-")
    parsed = gemini.parse_request(c["body"])
    assert gemini.check(c["body"]) == []
    assert parsed.messages[0].parts[0].kind == Kind.CONTEXT  # gemini-cli's <session_context>
    assert credential({k.lower(): v for k, v in c["headers"]}, _path(c)) == "REDACTED"
    reply = json.loads((CAPTURES / capture.replace(".json", ".response.json")).read_text())
    if call.stream:
        assembler = gemini.ReplyAssembler()
        for ev in SSEDecoder().feed(reply["body"].encode()):
            assembler.feed(ev)
        got = assembler.reply()
    else:
        got = gemini.reply_from_body(json.loads(reply["body"]))
    assert got.stop_reason == "STOP" and got.message.parts and got.usage.input_tokens == 42


@needs_fixtures
def test_call_ids_agree_between_the_reply_and_the_resent_history() -> None:
    """gemini-cli renames a call's id from request to request; its identity must not change,
    or the reply and the re-sent history would be stored twice."""
    reply = json.loads(Path(CAPTURES / "04-tool_read-streamGenerateContent-gemini_3_8_flash"
                            ".response.json").read_text())
    assembler = gemini.ReplyAssembler()
    for ev in SSEDecoder().feed(reply["body"].encode()):
        assembler.feed(ev)
    replied = assembler.reply().message
    for name in ("05-tool_read-streamGenerateContent-gemini_3_8_flash.json",
                 "06-resume-generateContent-gemini_3_5_flash_lite.json"):
        resent = gemini.parse_request(_capture(name)["body"]).messages
        assert resent[1].fingerprint() == replied.fingerprint()
        assert resent[2].parts[0].call_id == replied.parts[0].call_id  # its result pairs


@needs_fixtures
def test_replaced_history_keeps_thought_signatures_where_they_were() -> None:
    body = _capture("10-tool_shell_yolo-streamGenerateContent-gemini_3_8_flash.json")["body"]
    frame = [Message("user", (Part(Kind.TEXT, "remembered"),)),
             Message("assistant", (Part(Kind.TEXT, "noted"),))]
    out = gemini.replace_history(body, frame, 0)
    assert out["contents"][:2] == [{"role": "user", "parts": [{"text": "remembered"}]},
                                   {"role": "model", "parts": [{"text": "noted"}]}]
    assert out["contents"][2:] == body["contents"]
    assert out["contents"][3]["parts"][0]["thoughtSignature"] == \
        body["contents"][1]["parts"][0]["thoughtSignature"]
    assert gemini.check(out) == []
    assert gemini.check({"contents": body["contents"][2:]})  # a result without its call


def test_paths_that_carry_no_turn() -> None:
    assert gemini_call("/v1beta/models/gemini-2.5-flash:streamGenerateContent") is None  # JSON array
    assert gemini_call("/v1beta/models/gemini-2.5-flash:embedContent") is None
    assert gemini_call("/v1internal:loadCodeAssist") is None
    counted = gemini_call("/v1beta/models/gemini-2.5-flash:countTokens")
    assert counted is not None and counted.count
    bearer = {"authorization": "Bearer sk-proj-x"}
    assert provider_of("/v1/models", bearer, "") == Provider.OPENAI  # OpenAI's list, not Gemini's
    assert provider_of("/v1beta/models", {}, "") == Provider.GOOGLE
    assert provider_of("/v1internal:loadCodeAssist", bearer, "") == Provider.GOOGLE


def code_assist(proxy: Proxy, text: str, conversation: str, stream: bool = True) -> httpx.Response:
    """A Code Assist call as gemini-cli makes it when CODE_ASSIST_ENDPOINT names the proxy."""
    envelope = {"model": "gemini-3.8-flash", "project": "proj-7",
                "request": {"contents": [{"role": "user", "parts": [{"text": text}]}]}}
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    return httpx.post(f"{proxy.url}/v1internal:{method}", json=envelope, trust_env=False,
                      timeout=30, headers={"authorization": "Bearer ya29.tool-loop",
                                           "x-perpetuity-user": "g7",
                                           "x-perpetuity-conversation": conversation})


def test_code_assist_tool_loop_keeps_the_envelope_and_the_wrapping(
        proxy: Proxy, fake: FakeProvider) -> None:
    fake.script(Text("Noted."))
    assert code_assist(proxy, "The vault code is 4471.", "earlier").status_code == 200
    proxy.wait_messages("g7", 2)
    fake.clear()
    fake.script(ToolCall("memory_search", {"query": "vault code"}, text="Looking."),
                Text("It is 4471."))
    r = code_assist(proxy, "What is the vault code?", "now")
    chunks = [ev.json() for ev in SSEDecoder().feed(r.content)]
    assert chunks and all(c is not None and set(c) == {"response"} for c in chunks)
    parts = [p for c in chunks for p in c["response"]["candidates"][0]["content"]["parts"]]
    assert "".join(p.get("text", "") for p in parts) == "Looking.It is 4471."
    assert not any("functionCall" in p for p in parts)
    assert chunks[-1]["response"]["candidates"][0]["finishReason"] == "STOP"
    first, second = fake.wait_requests(2)
    assert second.json["project"] == "proj-7" and second.json["model"] == "gemini-3.8-flash"
    call = second.json["request"]["contents"][-2]["parts"][-1]["functionCall"]
    assert call["name"] == "memory_search"
    fake.script(ToolCall("memory_search", {"query": "vault"}), Text("4471."))
    whole = code_assist(proxy, "And again, the vault code?", "whole", stream=False).json()
    assert whole["response"]["candidates"][0]["content"]["parts"] == [{"text": "4471."}]


def test_unread_shapes_pass_through_as_sent(proxy: Proxy, fake: FakeProvider) -> None:
    """A stream without alt=sse (one JSON array) and a body without contents: forwarded to the
    Gemini upstream untouched, nothing stored."""
    body = {"contents": [{"role": "user", "parts": [{"text": "array please"}]}]}
    fake.script(Text("As an array."))
    r = httpx.post(f"{proxy.url}/v1beta/models/{MODEL}:streamGenerateContent", json=body,
                   headers={"x-goog-api-key": KEY, "x-perpetuity-user": "g8"}, trust_env=False)
    assert r.status_code == 200 and isinstance(r.json(), list)
    assert fake.requests[-1].json == body
    r = httpx.post(f"{proxy.url}/v1beta/models/{MODEL}:generateContent",
                   json={"contents": "not a list"}, headers={"x-goog-api-key": KEY,
                                                             "x-perpetuity-user": "g8"},
                   trust_env=False)
    assert r.status_code == 200 and fake.requests[-1].json == {"contents": "not a list"}
    assert proxy.messages("g8") == []


def test_gemini_cli_compression_is_a_side_request() -> None:
    body = {"systemInstruction": {"parts": [{"text": "\nYou are a specialized system component "
            "responsible for distilling chat history into a structured XML <state_snapshot>."}]},
            "contents": [{"role": "user", "parts": [{"text": "summarise"}]}]}
    headers = {"user-agent": "GeminiCLI/0.61.0/gemini-3.8-flash (linux; x64)"}
    assert identify(headers, gemini.parse_request(body), "AIza-k", "salt").side == "compaction"
    assert identify({}, gemini.parse_request(body), "AIza-k", "salt").side == ""  # not gemini-cli
