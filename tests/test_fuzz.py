"""Property-based fuzzing of each protocol's request bodies through the pipeline (hypothesis):
valid, truncated, wrong types, huge strings, deep nesting, odd Unicode. Every body passes
through untouched or is handled, never a crash, and a turn is stored whole or not at all.

`scripts/run test tests/test_fuzz.py --hypothesis-show-statistics` reports the cases run."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from perpetuity_core.memory.schema import open_memory
from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline, Settings
from perpetuity_core.wire.conversation import Provider

CASES = 400  # per protocol

# Any code point, lone surrogates included (they reach us as JSON \ud800 escapes).
odd = st.text(st.characters(exclude_categories=()), max_size=40)
huge = st.integers(100_000, 400_000).map(lambda n: "x" * n)
text = st.one_of(st.text(max_size=40), odd, huge, st.sampled_from(["", " ", "/perpetuity-curate"]))
scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text)
anything = st.recursive(scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=12)


def maybe(value: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(value, anything)  # the right shape, or any JSON value in its place


def block(types: list[str]) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": maybe(st.sampled_from(types))}, optional={
        "text": maybe(text), "id": maybe(text), "name": maybe(text), "input": anything,
        "tool_use_id": maybe(text), "content": maybe(st.one_of(text, st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": text}), max_size=2))),
        "call_id": maybe(text), "arguments": maybe(text), "output": maybe(text),
        "role": maybe(st.sampled_from(["user", "assistant"])), "signature": text,
        "thinking": text, "cache_control": anything})


def message(roles: list[str], types: list[str]) -> st.SearchStrategy:
    return st.fixed_dictionaries({"role": maybe(st.sampled_from(roles))}, optional={
        "content": maybe(st.one_of(text, st.lists(block(types), max_size=4))),
        "tool_calls": st.lists(st.fixed_dictionaries({
            "id": maybe(text), "type": st.just("function"), "function": st.fixed_dictionaries(
                {"name": maybe(text), "arguments": maybe(text)})}), max_size=2),
        "tool_call_id": maybe(text), "name": maybe(text)})


gemini_part = st.fixed_dictionaries({}, optional={
    "text": maybe(text), "thought": anything, "thoughtSignature": maybe(text),
    "functionCall": maybe(st.fixed_dictionaries({"name": maybe(text), "args": anything},
                                                optional={"id": maybe(text)})),
    "functionResponse": maybe(st.fixed_dictionaries({"name": maybe(text), "response": anything},
                                                    optional={"id": maybe(text)})),
    "inlineData": maybe(st.fixed_dictionaries({"mimeType": maybe(text), "data": text}))})
gemini_content = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "model"]))},
                                       optional={"parts": maybe(st.lists(gemini_part, max_size=4))})
COMMON = {"stream": maybe(st.booleans()), "metadata": anything, "user": maybe(text),
          "tools": maybe(st.lists(st.fixed_dictionaries({"name": maybe(text),
                                                         "input_schema": anything}), max_size=2))}
BODIES = {
    "/v1/messages": st.fixed_dictionaries({
        "model": maybe(st.sampled_from(["claude-opus-4-8", ""])),
        "messages": maybe(st.lists(message(["user", "assistant", "system"], [
            "text", "tool_use", "tool_result", "thinking", "image", "server_tool_use"]),
            max_size=6))}, optional={"system": maybe(st.one_of(text, st.lists(block(["text"]),
                                                                               max_size=2))),
                                     "max_tokens": maybe(st.integers()), **COMMON}),
    "/v1/chat/completions": st.fixed_dictionaries({
        "model": maybe(st.sampled_from(["gpt-4o", ""])),
        "messages": maybe(st.lists(message(["system", "developer", "user", "assistant", "tool"],
                                           ["text", "image_url", "input_audio"]), max_size=6))},
        optional=COMMON),
    "/v1/responses": st.fixed_dictionaries({
        "model": maybe(st.sampled_from(["gpt-5", ""])),
        "input": maybe(st.one_of(text, st.lists(block([
            "message", "function_call", "function_call_output", "reasoning", "input_text",
            "output_text"]), max_size=6)))},
        optional={"instructions": maybe(text), "prompt_cache_key": maybe(text),
                  "previous_response_id": maybe(text), **COMMON}),
    "/v1beta/models/gemini-3.8-flash:streamGenerateContent?alt=sse": st.fixed_dictionaries({
        "contents": maybe(st.lists(gemini_content, max_size=6))}, optional={
        "systemInstruction": maybe(st.fixed_dictionaries({"parts": st.lists(gemini_part, max_size=2)})),
        "tools": maybe(st.lists(st.fixed_dictionaries({"functionDeclarations": maybe(st.lists(
            st.fixed_dictionaries({"name": maybe(text)}), max_size=2))}), max_size=2)),
        "generationConfig": anything, "toolConfig": anything, "session_id": maybe(text)}),
}


def raw_bodies(path: str) -> st.SearchStrategy[bytes]:
    valid = BODIES[path].map(lambda b: json.dumps(b).encode())
    return st.one_of(
        valid, valid,
        valid.flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # truncated
        st.integers(1, 50_000).map(  # deep nesting
            lambda d: b'{"model": "m", "messages": ' + b"[" * d + b"]" * d + b"}"),
        st.binary(max_size=64),
    )


HEADERS = st.lists(st.sampled_from([
    ("x-api-key", "sk-ant-fuzz"), ("authorization", "Bearer sk-fuzz"),
    ("x-perpetuity-user", "fuzz"), ("x-perpetuity-user", "\udcff"), ("x-perpetuity-time", "nope"),
    ("x-perpetuity-time", "9999-12-31T23:59:59"), ("x-perpetuity-conversation", ""),
    ("x-perpetuity-harness", "coding"), ("user-agent", "claude-cli/2.1"),
    ("x-claude-code-session-id", "s1"), ("x-codex-turn-metadata", "{not json"),
    ("x-perpetuity-recall", "off"), ("x-perpetuity-tools", "off"), ("x-goog-api-key", "AIza-fuzz"),
    ("user-agent", "GeminiCLI/0.61.0")]), max_size=5, unique=True)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    root = tmp_path_factory.mktemp("fuzz")
    store = open_memory(root / "m.db")
    yield Pipeline(store, Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider},
                                   notes_root=root / "notes"))
    store.close()


def messages_stored(db: Path) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("select count(*) from message").fetchone()[0]
    finally:
        con.close()


def run_one(pipeline: Pipeline, path: str, body: bytes, headers: list[tuple[str, str]]) -> None:
    req = HttpRequest("POST", "127.0.0.1", path, tuple(headers), body, direct=True)
    decision = pipeline.prepare(req)  # never raises
    event(decision.note.split(":")[0] or "passed through")
    if decision.body is not None:
        json.loads(decision.body)  # what we send instead is a JSON body
    if decision.job is None:
        return
    before = messages_stored(pipeline.store.path)
    try:
        pipeline.store_turn(decision.job.pending)
    except Exception:
        # Logged by the proxy; the turn is stored whole or not at all.
        assert messages_stored(pipeline.store.path) == before
        raise


@pytest.mark.parametrize("path", list(BODIES))
@settings(max_examples=CASES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(data=st.data())
def test_request_bodies_pass_through_or_are_handled(pipeline: Pipeline, path: str,
                                                    data: st.DataObject) -> None:
    run_one(pipeline, path, data.draw(raw_bodies(path)), data.draw(HEADERS))
