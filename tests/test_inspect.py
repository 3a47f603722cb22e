"""See what the model saw: the facts in flow.metadata, flow.comment and flow.marked, and the
`perpetuity` contentview, through the addon's hooks (mitmproxy's test flows), a saved flow file
and `perpetuity show`."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
from mitmproxy import contentviews, http
from mitmproxy import io as mio
from mitmproxy.addons.save import Save
from mitmproxy.addons.view import View
from mitmproxy.test import taddons

from perpetuity_core.serve.pipeline import Pipeline
from tests.addons import Perpetuity
from tests.conftest import owned, start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text, ToolCall
from tests.test_addon import direct_flow

PERPETUITY = Path(sys.executable).with_name("perpetuity")
MEMORY = [("The vault code is 4471.", "Noted."), ("My sister Ada lives in Oslo.", "Noted."),
          ("We planted tomatoes in April.", "Noted.")]


def request(messages: list[dict], conversation: str) -> bytes:
    return json.dumps({"model": "claude-opus-4-8", "max_tokens": 20,
                       "messages": messages}).encode()


def reply(text: str) -> bytes:
    return json.dumps({"id": "msg_1", "type": "message", "role": "assistant",
                       "model": "claude-opus-4-8", "stop_reason": "end_turn",
                       "content": [{"type": "text", "text": text}],
                       "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()


def exchange(addon: Perpetuity, body: bytes, conversation: str, answer: str) -> http.HTTPFlow:
    """One flow through the addon's hooks as mitmproxy calls them, the reply streamed through
    the addon's tee, then the store's writes waited for."""
    flow = direct_flow(body)
    flow.request.headers["x-perpetuity-conversation"] = conversation

    async def hooks() -> None:
        await addon.request(flow)
        flow.response = http.Response.make(200, b"", {"content-type": "application/json"})
        addon.responseheaders(flow)
        stream = flow.response.stream
        if callable(stream):
            stream(reply(answer))
            stream(b"")
        flow.response.content = reply(answer)
        await addon.response(flow)

    asyncio.run(hooks())
    addon.executor.submit(lambda: None).result()  # the store's thread has written the turn
    return flow


def remember(addon: Perpetuity) -> None:
    history: list[dict] = []
    for said, answer in MEMORY:
        history.append({"role": "user", "content": said})
        exchange(addon, request(history, "earlier"), "earlier", answer)
        history.append({"role": "assistant", "content": answer})


@contextmanager
def inspected(tmp_path: Path, **options: object) -> Iterator[Perpetuity]:
    """The addon beside a flow list, as in mitmweb, its upstream never reached."""
    addon = Perpetuity()
    with taddons.context(*addon.addons, View()) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9", **options)
        yield addon


def saved_and_reopened(flow: http.HTTPFlow) -> http.HTTPFlow:
    buf = io.BytesIO()
    mio.FlowWriter(buf).add(flow)
    buf.seek(0)
    return next(iter(mio.FlowReader(buf).stream()))


def test_a_framed_flow_carries_its_facts_comment_and_view(tmp_path: Path) -> None:
    with inspected(tmp_path, perpetuity_tools=False) as addon:
        remember(addon)
        flow = exchange(addon, request([{"role": "user", "content": "Where does my sister live?"}],
                                       "now"), "now", "Oslo.")
        facts = flow.metadata["perpetuity"]
        assert json.loads(json.dumps(facts)) == facts  # plain values only
        assert set(flow.metadata) == {"perpetuity"}  # nothing live is left on the flow
        assert facts["frame"]["made"] == "frame" and facts["frame"]["rows"] >= 2
        rows = facts["retrieval"]["rows"]
        top = next(r for r in rows if r["why"] == "the top hit")
        assert "Ada" in top["text"] and top["in"] and top["score"] > 0 and top["warmth"] > 0
        assert facts["retrieval"]["budget"] >= 1_000
        assert flow.comment.startswith(f"perpetuity: frame {facts['frame']['tokens']:,} tok from")
        assert not flow.marked
        # The request shows what went upstream; the view says what the model read and why.
        assert b"Ada lives in Oslo" in flow.request.content
        for shown in (flow, saved_and_reopened(flow)):
            view = contentviews.prettify_message(shown.request, shown)
            assert view.view_name == "perpetuity"
            assert "== The frame as the model read it ==" in view.text
            assert "My sister Ada lives in Oslo." in view.text
            assert "the top hit: My sister Ada lives in Oslo." in view.text
            assert "cache marks placed: 1" in view.text
        assert contentviews.prettify_message(flow.response, flow).view_name != "perpetuity"


def test_a_flow_that_fell_open_is_marked_and_still_saved(tmp_path: Path, monkeypatch) -> None:
    with inspected(tmp_path) as addon:

        def broken(self: Pipeline, req: object) -> None:
            raise RuntimeError("a bug in the memory pipeline")

        monkeypatch.setattr(Pipeline, "decide", broken)
        flow = exchange(addon, request([{"role": "user", "content": "hi"}], "c"), "c", "Hello.")
        assert flow.marked == ":warning:"
        assert "fell open: the pipeline failed (RuntimeError" in flow.comment
        reopened = saved_and_reopened(flow)
        assert reopened.metadata["perpetuity"]["fell_open"].startswith("the pipeline failed")


def test_a_captured_flow_survives_saving(tmp_path: Path) -> None:
    """It used to carry its Job in flow.metadata, which mitmproxy cannot copy: `-w` lost it."""
    with inspected(tmp_path) as addon:
        flow = exchange(addon, request([{"role": "user", "content": "hi"}], "c"), "c", "Hello.")
        assert saved_and_reopened(flow).comment == "perpetuity: captured"


def test_perpetuity_show_prints_the_view_of_a_saved_file(tmp_path: Path) -> None:
    with inspected(tmp_path, perpetuity_tools=False) as addon:
        remember(addon)
        flow = exchange(addon, request([{"role": "user", "content": "What is the vault code?"}],
                                       "now"), "now", "4471.")
    path = tmp_path / "flows.mitm"
    with path.open("wb") as fo:
        mio.FlowWriter(fo).add(flow)
    out = subprocess.run([str(PERPETUITY), "show", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"flow {flow.id}" in out.stdout and "The vault code is 4471." in out.stdout
    assert "== Retrieval (frame built for this request) ==" in out.stdout
    missing = subprocess.run([str(PERPETUITY), "show", str(tmp_path / "none.mitm")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.startswith("perpetuity: cannot read")


def test_no_facts_are_made_where_no_one_can_read_them(tmp_path: Path) -> None:
    """mitmdump without a flow file or bodies printed: the references are dropped unread."""
    addon, save = Perpetuity(), Save()
    with taddons.context(*addon.addons, save) as tctx:
        tctx.configure(addon.addons[0], perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")
        flow = exchange(addon, request([{"role": "user", "content": "hi"}], "c"), "c", "Hello.")
        assert flow.metadata == {"perpetuity": {"upstream": "http://upstream.test:9/v1/messages",
                                                "note": "captured"}}
        assert not flow.comment
        tctx.configure(save, save_stream_file=str(tmp_path / "flows.mitm"))  # now someone can
        flow = exchange(addon, request([{"role": "user", "content": "hi"}], "c"), "c", "Hello.")
        assert flow.comment.startswith("perpetuity: frame ")
        save.done()  # closes the flow file (mitmdump calls it at exit)


def test_mitmdump_saves_every_flow_relayed_or_not(tmp_path: Path) -> None:
    """`perpetuity proxy -w`: a first contact (mitmproxy's own stream) and a question answered
    through the relay after a memory_search round: both flows, and the hidden rounds, saved."""
    with FakeProvider() as fake:
        proxy = start_proxy(tmp_path, fake.url, "-w", str(tmp_path / "flows.mitm"))
        try:
            a = owned(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-w", max_retries=0))
            fake.script(Text("Noted."))
            a.messages.create(model="claude-opus-4-8", max_tokens=20,
                              messages=[{"role": "user", "content": "The vault code is 4471."}],
                              extra_headers={"x-perpetuity-conversation": "earlier"})
            deadline = time.monotonic() + 5  # the reply is stored a moment after the client has it
            while proxy.rows("select count(*) from message")[0][0] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            fake.script(ToolCall("memory_search", {"query": "vault"}, call_id="toolu_w"),
                        Text("4471."))
            a.messages.create(model="claude-opus-4-8", max_tokens=20,
                              messages=[{"role": "user", "content": "What is the vault code?"}],
                              extra_headers={"x-perpetuity-conversation": "now"})
        finally:
            stop_proxy(proxy)
    with (tmp_path / "flows.mitm").open("rb") as fo:
        saved = list(mio.FlowReader(fo).stream())
    comments = [f.comment for f in saved]
    assert len(saved) == 4, comments
    assert comments[0] == "perpetuity: captured"
    assert any(c.startswith("perpetuity: frame ") and "1 tool round" in c for c in comments)
    assert sum(c.startswith("perpetuity: tool round") for c in comments) == 2
    assert all(f.request.host == "127.0.0.1" and f.request.port != proxy.port for f in saved)
    assert all(f.response.raw_content for f in saved)  # streamed replies, kept for inspection


def test_the_view_lists_what_was_stripped_and_what_was_kept(tmp_path: Path) -> None:
    with inspected(tmp_path, perpetuity_tools=False, perpetuity_frame_ceiling=1_000) as addon:
        long = "The deployment checklist: " + "verify the canary, " * 300
        history = [{"role": "user", "content": long}, {"role": "assistant", "content": "Checked."},
                   {"role": "user", "content": "And the owner?"}]
        exchange(addon, request(history, "task"), "task", "Me.")
        history += [{"role": "assistant", "content": "Me."},
                    {"role": "user", "content": "And the rollback plan?"}]
        flow = exchange(addon, request(history, "task"), "task", "Ready.")
        facts = flow.metadata["perpetuity"]
        # A chat keeps its latest exchange as sent (plan.chat_keep); the one before is memory's.
        assert [s[:2] for s in facts["stripped"]] == [[0, "user"], [1, "assistant"]]
        assert facts["kept"] == {"from": 2, "messages": 3, "tokens": 11}
        assert facts["sent_tokens"] < facts["harness"]["tokens"]
        assert f"{sum(s[2] for s in facts['stripped']):,} stripped" in flow.comment
        # The checklist itself did not fit the budget: listed as a warm row left out.
        assert any(r["why"] == "warm, left out by the cap" and "checklist" in r["text"]
                   and not r["in"] for r in facts["retrieval"]["rows"])
        view = contentviews.prettify_message(flow.request, flow).text
        assert "stripped: messages 0-1" in view and "kept as sent: messages 2-4" in view
