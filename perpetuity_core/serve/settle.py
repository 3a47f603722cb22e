"""Inspection, after the reply: each flow's facts as plain values (what mitmproxy saves and
mitmweb shows, `serve.inspection`), its one-line comment and mark, the recall tools' hidden
rounds as flows of their own, and the `perpetuity` contentview; then the flow's live state let
go. Listed after the HTTP path, whose `response` and `error` hooks end the flow first. Nothing
here is on the request path, and nothing is made when no one can read it (`readable`). A
failure is logged and leaves the flow as the client received it.
"""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import contentviews, ctx, http

from perpetuity_core.serve import inspection
from perpetuity_core.serve.flowstate import STATE, FlowState, state_of
from perpetuity_core.serve.flowview import FACTS, PerpetuityView, round_flows
from perpetuity_core.serve.relay import REFUSED

log = logging.getLogger("perpetuity")


class Settle:
    def load(self, loader: Any) -> None:
        contentviews.add(PerpetuityView)

    async def response(self, flow: http.HTTPFlow) -> None:
        await self._settle(flow)

    async def error(self, flow: http.HTTPFlow) -> None:
        await self._settle(flow)

    async def _settle(self, flow: http.HTTPFlow) -> None:
        """The flow's facts as plain values (what mitmproxy saves and mitmweb shows), its
        comment and mark, and the tool loop's hidden rounds as flows of their own; the live
        state dropped (a WebSocket keeps its handshake). After the reply: nothing here is on
        the request path."""
        state = state_of(flow.metadata)
        if state is None:
            return
        d, fell_open, kept = state.decision, state.fell_open, state.kept
        if kept is not None and flow.response is not None and flow.response.raw_content is None:
            flow.response.raw_content = b"".join(kept.chunks)  # the reply the client received
        if flow.websocket and state.handshake is not None:
            flow.metadata[STATE] = FlowState(handshake=state.handshake, chain=state.chain)
        else:
            del flow.metadata[STATE]
        if d is None or not readable():
            return
        try:
            job = d.job if d.job and d.job.relay else None
            if job and d.body is not None and job.original is None and not fell_open:
                fell_open = (REFUSED if job.rounds and job.rounds[0].status == 400 else
                             "the recall tools failed before the first byte; sent as sent")
            facts = inspection.facts(d, d.job, fell_open)
            if job and job.body != flow.request.raw_content:
                flow.request.content = job.body  # what went upstream, as on mitmproxy's path
            # One round is the flow itself (the model answered); more were hidden from it.
            children = round_flows(flow, job.method, job.url, job.headers, job.rounds,
                                   facts["rounds"]) if job and len(job.rounds) > 1 else []
            flow.metadata[FACTS] = facts
            flow.comment = inspection.summary(facts)
            if facts["fell_open"] or facts["repaired"]:
                flow.marked = ":warning:" if facts["fell_open"] else ":wrench:"
            for child in children:
                await ctx.master.load_flow(child)
        except Exception:
            log.exception("perpetuity: could not gather what this flow showed the model")


def readable() -> bool:
    """Can anyone read a flow's facts: a flow list (mitmweb, the console), a flow file being
    written, or mitmdump printing bodies? Otherwise making them would cost the event loop
    0.18 ms a request (p50; 0.9 ms p90, on bench_latency's sides) for no one."""
    o = ctx.options
    return (ctx.master.addons.get("view") is not None
            or ("save_stream_file" in o and bool(o.save_stream_file))
            or ("flow_detail" in o and o.flow_detail >= 3))
