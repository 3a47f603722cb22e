"""The addon's hooks called directly (mitmproxy's test flows): how it fails and what mitmweb
shows."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mitmproxy.test import taddons, tflow

from perpetuity_core.serve.addon import Perpetuity
from perpetuity_core.serve.flowstate import STATE, FlowState
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.relay import JOB_HEADER


def direct_flow(body: bytes) -> tflow.http.HTTPFlow:
    flow = tflow.tflow()
    flow.request.host, flow.request.port, flow.request.path = "127.0.0.1", 8080, "/v1/messages"
    flow.request.method = "POST"
    flow.request.headers["x-api-key"] = "sk-ant-k"
    flow.request.headers["x-perpetuity-user"] = "addon"
    flow.request.content = body
    flow.client_conn.sockname = ("127.0.0.1", 8080)
    return flow


def test_a_failing_pipeline_still_routes_the_request_untouched(tmp_path: Path, monkeypatch) -> None:
    addon = Perpetuity()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, perpetuity_db=str(tmp_path / "m.db"),
                       perpetuity_anthropic_upstream="http://upstream.test:9")

        def broken(self: Pipeline, req: object) -> None:
            raise RuntimeError("a bug in the memory pipeline")

        monkeypatch.setattr(Pipeline, "prepare", broken)
        body = b'{"model": "claude-opus-4-8", "messages": [{"role": "user", "content": "hi"}]}'
        flow = direct_flow(body)
        asyncio.run(addon.request(flow))
        assert flow.request.url == "http://upstream.test:9/v1/messages"
        assert flow.request.content == body and "x-perpetuity-user" not in flow.request.headers
        assert flow.response is None  # forwarded, not answered


def test_mitmweb_shows_the_real_destination_not_the_relay(tmp_path: Path) -> None:
    addon = Perpetuity()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, perpetuity_db=str(tmp_path / "m.db"))
        flow = direct_flow(b"{}")
        flow.request.url = "http://127.0.0.1:5555/v1/messages"
        flow.request.headers[JOB_HEADER] = "token"
        flow.metadata[STATE] = FlowState(upstream="https://api.anthropic.com/v1/messages",
                                         relayed=True)
        asyncio.run(addon.response(flow))
        assert flow.request.url == "https://api.anthropic.com/v1/messages"
        assert JOB_HEADER not in flow.request.headers
