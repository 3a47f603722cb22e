"""The upstream body written as far as it was written before (wire.written, issue 22): every
body is exactly what json.dumps writes, and a late call writes what is new, not its history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.wire.written import _SPLIT, Written
from tests.test_seen import REMINDER, _long_session

_TEXT = st.text(st.sampled_from(["a", " ", "\n", '"', "\\", "é", "😀", "\u2028", "\x7f", "\x00",
                                 "}", ",", "]"]), max_size=6)
# _SPLIT among them: the string new elements are written apart at, inside a body all the same.
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**70), _TEXT, st.just(_SPLIT),
                    st.floats(allow_nan=True, allow_infinity=True))
_VALUE = st.recursive(_SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(_TEXT, inner, max_size=3)), max_leaves=8)
# One call's change to the body: an element appended, the last one replaced (a moved cache
# mark), one dropped from the front (a rebuilt frame), or a member set.
_STEP = st.one_of(st.tuples(st.just("append"), _VALUE), st.tuples(st.just("replace"), _VALUE),
                  st.tuples(st.just("drop"), st.none()),
                  st.tuples(st.just("member"), st.tuples(st.sampled_from(["a", "b", "é"]), _VALUE)))


@settings(max_examples=80, deadline=None)
@given(st.lists(_STEP, min_size=1, max_size=14), st.dictionaries(_TEXT, _VALUE, max_size=3))
def test_every_body_is_what_json_dumps_writes(steps: list[tuple[str, Any]],
                                              head: dict[str, Any]) -> None:
    """Call after call, the same objects again and new ones beside them, in both encodings:
    byte for byte json.dumps's, and its error where it has one (a lone surrogate's)."""
    written, elements, members = Written(), [{"role": "user"}], dict(head)
    for step, value in steps:
        if step == "append":
            elements = [*elements, value]
        elif step == "replace":
            elements = [*elements[:-1], value]
        elif step == "drop":
            elements = elements[1:]
        else:
            members = {**members, value[0]: value[1]}
        body = {**members, "messages": elements, "tools": elements[-2:]}
        for ascii in (False, True):
            try:
                want: Any = json.dumps(body, ensure_ascii=ascii).encode()
            except UnicodeEncodeError as e:
                want = type(e)
            try:
                got: Any = written.dumps(body, ascii)
            except UnicodeEncodeError as e:
                got = type(e)
            assert got == want
        _counted_once(written)


def _counted_once(written: Written) -> None:
    """What is kept is counted once, however often an object appears (its budget holds)."""
    assert written._bytes == sum(len(p) for _, *pieces in written._pieces.values()
                                 for p in pieces if p is not None)


_TWICE = {"k": ["v"]}  # one object, three times in one array


def _outcome(dump: Any) -> Any:
    try:
        return dump()
    except (UnicodeEncodeError, ValueError) as e:
        return type(e)


@pytest.mark.parametrize("ascii", [False, True])
@pytest.mark.parametrize("body", [
    {}, {"messages": []}, {1: "a", "b": [1]}, {"messages": [{}, [], [[]]], "x": {}},
    {"m": [float("nan"), float("inf"), 1e300, -0.0]}, {"m": ["\ud800"]}, {"m": [{"k": "\ud83d"}]},
    {"m": [{"a": [1, _SPLIT, 2]}, {"b": 1}]}, {"m": [{"a": 1}, _SPLIT, {"b": 2}, [_SPLIT, _SPLIT]]},
    {"m": [{"a": 1}, [_SPLIT], {"b": [_SPLIT, 3]}, {"c": {"d": [0, _SPLIT]}}]},
    {"m": [_TWICE, {"b": 2}, _TWICE, _TWICE]},
])
def test_odd_bodies_are_what_json_dumps_writes(body: dict[Any, Any], ascii: bool) -> None:
    """Cold, then from the pieces kept: the same bytes, or the same error."""
    written = Written()
    want = _outcome(lambda: json.dumps(body, ensure_ascii=ascii).encode())
    assert _outcome(lambda: written.dumps(body, ascii)) == want
    assert _outcome(lambda: written.dumps(body, ascii)) == want
    _counted_once(written)


def _prepare_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The characters JSON encodings write inside Pipeline.prepare from now on (json.dumps
    goes through JSONEncoder.encode, whatever its arguments)."""
    chars: list[int] = []
    inside = [False]
    encode, prepare = json.JSONEncoder.encode, Pipeline.prepare

    def counted(self: json.JSONEncoder, o: Any) -> str:
        out = encode(self, o)
        if inside[0]:
            chars.append(len(out))
        return out

    def marked(self: Pipeline, req: Any) -> Any:
        inside[0] = True
        try:
            return prepare(self, req)
        finally:
            inside[0] = False

    monkeypatch.setattr(json.JSONEncoder, "encode", counted)
    monkeypatch.setattr(Pipeline, "prepare", marked)
    return chars


def test_a_late_call_writes_what_is_new_not_its_history(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The body that goes upstream (the frame, then every round of the task in progress) and
    the relay's first round with our tools are written from the pieces the call before wrote:
    the next call writes about as much after 120 rounds as after 30 (json.dumps of both bodies
    wrote the whole request each time: over three times as much at 120), and what it writes is
    byte for byte what json.dumps writes."""
    written, sizes = [], []
    for rounds in (30, 120):
        (tmp_path / str(rounds)).mkdir()
        s = _long_session(tmp_path / str(rounds), rounds)
        chars = _prepare_writes(monkeypatch)
        _, d = s.tool_round(f"file {rounds} body", REMINDER)
        monkeypatch.undo()
        s.store.close()
        assert d.job is not None and d.body is not None and d.job.first_round is not None
        assert d.body == json.dumps(json.loads(d.body), ensure_ascii=False).encode()
        assert d.job.first_round == json.dumps(json.loads(d.job.first_round)).encode()
        written.append(sum(chars))
        sizes.append(len(d.body))
    assert sizes[1] > 3 * sizes[0], sizes
    assert written[1] < 1.25 * written[0], (written, sizes)
