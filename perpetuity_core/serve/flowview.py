"""Perpetuity in mitmproxy's own tools: the `perpetuity` contentview (mitmweb, the console,
`mitmdump --flow-detail`), the recall tools' hidden rounds as flows of their own, and
`perpetuity show FLOW_FILE` for a saved flow file.

The facts come from `flow.metadata` (`perpetuity_core.serve.inspection`), so the view reads a
live flow and a flow loaded from a file alike; nothing is rendered until a view is opened.
"""

from __future__ import annotations

from typing import Any

from mitmproxy import connection, contentviews, http

from perpetuity_core.serve import inspection
from perpetuity_core.serve.exchange import Decision, Job
from perpetuity_core.serve.relay import Round

FACTS = "perpetuity"  # flow.metadata key of a client's flow's facts
ROUND = "perpetuity_round"  # flow.metadata key of a tool round's flow
# flow.metadata key of a WebSocket's facts, one per client message by its place in the messages
MESSAGES = "perpetuity_messages"


class PerpetuityView(contentviews.Contentview):
    """What the model saw and why, for any flow the addon touched."""

    name = "perpetuity"

    def prettify(self, data: bytes, metadata: contentviews.Metadata) -> str:
        flow = metadata.flow
        if not isinstance(flow, http.HTTPFlow):
            raise ValueError("not an HTTP flow")
        if metadata.websocket_message is not None:
            facts = message_facts(flow, metadata.websocket_message)
            if facts is None:
                raise ValueError("Perpetuity did not frame this message")
            return inspection.render(facts, data)
        return view_text(flow)

    def render_priority(self, data: bytes, metadata: contentviews.Metadata) -> float:
        """First choice for a request Perpetuity touched (its body is what went upstream), and
        for a WebSocket message it framed; chosen by hand for anything else of that flow."""
        flow = metadata.flow
        if not isinstance(flow, http.HTTPFlow):
            return -1
        if metadata.websocket_message is not None:
            return 2 if message_facts(flow, metadata.websocket_message) is not None else -1
        if (metadata.http_message is not flow.request
                or not (FACTS in flow.metadata or ROUND in flow.metadata)):
            return -1
        return 2


def message_facts(flow: http.HTTPFlow, message: Any) -> dict[str, Any] | None:
    """The facts of a WebSocket message Perpetuity framed (None for any other)."""
    by_index = flow.metadata.get(MESSAGES)
    if not isinstance(by_index, dict) or flow.websocket is None:
        return None
    index = next((i for i, m in enumerate(flow.websocket.messages) if m is message), -1)
    facts = by_index.get(str(index))
    return facts if isinstance(facts, dict) else None


def socket_facts(flow: http.HTTPFlow, decision: Decision, job: Job | None, index: int,
                 fell_open: str) -> None:
    """A WebSocket message's facts, once its reply has passed, under its place among the
    flow's messages; the flow's comment says how many were framed and what the last one was
    shown, and its mark that one fell open or was repaired."""
    facts = inspection.facts(decision, job, fell_open)
    by_index = flow.metadata.setdefault(MESSAGES, {})
    by_index[str(index)] = facts
    flow.comment = (f"perpetuity: {len(by_index)} message{'s' if len(by_index) > 1 else ''}; "
                    f"the last: {inspection.summary(facts).removeprefix('perpetuity: ')}")
    if facts["fell_open"] or facts["repaired"]:
        flow.marked = ":warning:" if facts["fell_open"] else ":wrench:"


def view_text(flow: http.HTTPFlow) -> str:
    if (rnd := flow.metadata.get(ROUND)) is not None:
        head = (f"perpetuity: tool round {rnd['round']} of {rnd['of']}, hidden from the client "
                f"of flow {rnd['parent']}; upstream {rnd['status']}")
        return "\n".join([head, "", *inspection.render_round(rnd)]) + "\n"
    facts = flow.metadata.get(FACTS)
    if not isinstance(facts, dict):
        raise ValueError("Perpetuity did not touch this flow")
    out = inspection.render(facts, flow.request.get_content(strict=False))
    # A WebSocket's handshake: then each message Perpetuity framed, in the order sent.
    by_index = flow.metadata.get(MESSAGES)
    if isinstance(by_index, dict) and flow.websocket is not None:
        messages = flow.websocket.messages
        for index in sorted(by_index, key=int):
            sent = messages[int(index)].content if int(index) < len(messages) else None
            out += f"\n== WebSocket message {index} ==\n" + inspection.render(by_index[index], sent)
    return out


def round_flows(parent: http.HTTPFlow, method: str, url: str,
                headers: list[tuple[str, str]], rounds: list[Round],
                facts: list[dict[str, Any]]) -> list[http.HTTPFlow]:
    """Each hidden upstream round as its own flow, linked both ways by flow id: the request as
    it went upstream (our tools added), the provider's reply as it came."""
    out = []
    for n, (r, f) in enumerate(zip(rounds, facts, strict=True), 1):
        child = http.HTTPFlow(parent.client_conn, connection.Server(address=None))
        child.request = http.Request.make(method, url, r.body, _fields(headers))
        child.request.timestamp_start = child.request.timestamp_end = r.started
        child.response = http.Response.make(r.status or 502, b"".join(r.raw), _fields(r.headers))
        child.response.timestamp_start = r.started
        child.response.timestamp_end = r.ended or r.started
        child.metadata[ROUND] = {"parent": parent.id, "round": n, "of": len(rounds), **f}
        names = ", ".join(name for _, name, _ in r.calls) or "the answer"
        child.comment = f"perpetuity: tool round {n}/{len(rounds)} of {parent.id[:8]}: {names}"
        f["flow"] = child.id
        out.append(child)
    return out


def _fields(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape"))
            for k, v in headers]
