"""wire.mend on its own: what is read of a body is always storable, and only lone surrogates
change (U+FFFD); clean parts stay the same objects."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from perpetuity_core.wire import mend
from perpetuity_core.wire.conversation import Kind, Message, ParsedRequest, Part, Protocol

_TEXT = st.text(st.sampled_from(["a", "\\", '"', "\ud83d", "\ude00", "\ud800", "\udfff", "🦄"]),
                max_size=12)
_VALUE = st.recursive(st.one_of(st.none(), st.integers(), _TEXT),
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(_TEXT, inner, max_size=3)),
                      max_leaves=10)


def _reference(text: str) -> str:
    """Slow and plain: each code point in the surrogate range becomes U+FFFD."""
    return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


@given(_VALUE)
def test_a_mended_value_encodes_and_differs_only_at_lone_surrogates(value: object) -> None:
    read = json.loads(json.dumps(value))  # as a body is read: a pair joins, a lone half stays
    out = mend.mended(read)
    json.dumps(out, ensure_ascii=False).encode()  # storable
    assert out == _mended_reference(read)
    if out == read:
        assert out is read  # nothing lone: the very same object, never a copy


def _mended_reference(value: object) -> object:
    if isinstance(value, str):
        return _reference(value)
    if isinstance(value, list):
        return [_mended_reference(v) for v in value]
    if isinstance(value, dict):
        return {_reference(k): _mended_reference(v) for k, v in value.items()}
    return value


def test_a_request_is_mended_past_what_it_shares_with_the_reading_before() -> None:
    clean = Message("user", (Part(Kind.TEXT, "list the files"),))
    cut = Message("tool", (Part(Kind.TOOL_RESULT, "zebracorn-\ud83d", call_id="t1"),))
    known = ParsedRequest(Protocol.ANTHROPIC, "m", False, [clean])
    parsed = ParsedRequest(Protocol.ANTHROPIC, "m", False, [clean, cut], system="sys \udc00")
    out = mend.mended_request(parsed, known)
    assert out.messages[0] is clean
    assert out.messages[1].parts[0].text == "zebracorn-\ufffd"
    assert out.system == "sys \ufffd"
    assert mend.dumps({"t": "zebracorn-\ud83d"}) == b'{"t": "zebracorn-\\ud83d"}'
    assert mend.dumps({"t": "🦄"}) == '{"t": "🦄"}'.encode()


def test_a_surrogate_written_raw_is_mended_too(tmp_path) -> None:
    """UTF-8's pattern for a surrogate (ED A0..BF), which json.loads reads as one: found from
    its lead byte, past Hangul (ED 80..9F), and the turn stored mended."""
    from perpetuity_core.memory.schema import open_memory
    from perpetuity_core.serve.exchange import HttpRequest
    from perpetuity_core.serve.pipeline import Pipeline, Settings
    from perpetuity_core.wire.conversation import Provider

    store = open_memory(tmp_path / "m.db")
    try:
        pipeline = Pipeline(store, Settings(upstreams={Provider.ANTHROPIC: "https://a.test"}))
        body = ('{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": '
                '"\ud55c zebracorn-').encode() + b'\xed\xa0\xbd"}]}'
        d = pipeline.prepare(HttpRequest("POST", "127.0.0.1", "/v1/messages",
                                         (("x-api-key", "sk-ant-x"),), body, True))
        assert d.job is not None
        pipeline.store_turn(d.job.pending)
        assert [m.text for m in d.job.pending.messages] == ["\ud55c zebracorn-\ufffd"]
    finally:
        store.close()
