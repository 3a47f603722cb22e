"""Real harness requests (../shared/fixtures/harness) through the pipeline: protocol, identity,
side-request classification and exactly the new turns stored, replaying each harness's session
in order with the replies the recording provider sent back."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlencode

import pytest

from perpetuity_core.serve.exchange import HttpRequest
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.tee import ReplyTee
from perpetuity_core.wire.conversation import Protocol
from tests.conftest import FIXTURES, needs_fixtures, opened

pytestmark = needs_fixtures

TITLE = {("claude-code", n) for n in ("12", "19", "21", "25", "28")} | {
    ("opencode", n) for n in ("01", "03", "07")
}
COMPACTION = {("claude-code", "24")}


def http_fixtures(harness: str) -> list[Path]:
    out = []
    for f in sorted((FIXTURES / harness).glob("*.json")):
        if f.name.endswith(".response.json"):
            continue
        d = json.loads(f.read_text())
        if "headers" in d and isinstance(d.get("body"), dict):
            out.append(f)
    return out


def to_request(d: dict) -> HttpRequest:
    query = d.get("query") or ""
    if isinstance(query, list):
        query = urlencode([tuple(q) for q in query])
    return HttpRequest(
        method=d["method"], host="127.0.0.1", path=d["path"] + (f"?{query}" if query else ""),
        headers=tuple((k, v) for k, v in d["headers"]), body=json.dumps(d["body"]).encode(),
        direct=True,
    )


def replay(pipeline: Pipeline, harness: str) -> list[tuple[Path, object]]:
    """Send a harness's requests in order, storing each recorded reply as the relay would."""
    out = []
    for f in http_fixtures(harness):
        decision = pipeline.prepare(to_request(json.loads(f.read_text())))
        out.append((f, decision))
        job = decision.job
        turn = pipeline.store_turn(job.pending) if job else None
        reply_file = f.with_name(f.name.removesuffix(".json") + ".response.json")
        if turn and reply_file.exists():
            body = json.loads(reply_file.read_text())["body"]
            tee = ReplyTee(job, "")
            tee.feed(body.encode() if isinstance(body, str) else json.dumps(body).encode())
            reply = tee.reply()
            assert reply is not None and reply.complete, f
            pipeline.store_reply(turn, reply, 0.0, job.pending)
    return out


def stored(pipeline: Pipeline) -> list[tuple[str, str, str]]:
    con = opened(pipeline.store.path)
    try:
        return con.execute(
            "select c.key, m.role, group_concat(i.text, '|') from message m "
            "join conversation c on c.id = m.conversation_id join item i on i.message_id = m.id "
            "where i.kind = 'text' group by m.id order by m.id"
        ).fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("harness", ["claude-code", "codex", "opencode", "anthropic-python",
                                     "openai-python", "gemini-cli"])
def test_protocol_identity_and_side_requests(pipeline: Pipeline, harness: str) -> None:
    for f, d in replay(pipeline, harness):
        raw = json.loads(f.read_text())
        headers = {k.lower(): v for k, v in raw["headers"]}
        number = f.name[:2]
        if harness == "gemini-cli":
            assert d.route.protocol == Protocol.GEMINI and d.identity.harness == "gemini-cli", f
            # Its routing classifier (generateContent, a JSON schema): passed through, no job.
            check = raw["path"].endswith(":generateContent")
            assert d.identity.side == ("gemini-cli-check" if check else ""), f
            assert (d.job is None) == check, f
            assert d.identity.tenant.startswith("key-")  # from x-goog-api-key
            assert d.identity.conversation.startswith("derived-")
            continue
        if raw["path"].endswith("count_tokens"):
            # Counted for the request as it would go upstream: read, framed, never a turn.
            assert d.route.protocol == Protocol.ANTHROPIC and d.job is None, f
            assert d.note.startswith("probe"), f
            continue
        assert d.route.protocol == {"/v1/messages": Protocol.ANTHROPIC,
                                    "/v1/chat/completions": Protocol.CHAT,
                                    "/v1/responses": Protocol.RESPONSES}[raw["path"]], f
        ident = d.identity
        assert ident.harness == {"claude-code": "claude-code", "codex": "codex",
                                 "opencode": "opencode"}.get(harness, "client"), f
        assert ident.side == ("title" if (harness, number) in TITLE else
                              "compaction" if (harness, number) in COMPACTION else ""), f
        # A title request is forwarded with a job that reads its reply (the conversation's
        # name) and stores no turn; other side requests have no job.
        assert (d.job is None) == bool(ident.side and ident.side != "title"), f
        assert not d.job or d.job.pending.title == (ident.side == "title"), f
        if harness == "claude-code":
            meta = json.loads(raw["body"]["metadata"]["user_id"])
            assert ident.user == f"{ident.tenant}/{meta['device_id']}"  # scoped by its key
            assert ident.tenant.startswith("key-")
            session = headers["x-claude-code-session-id"]
            agent = headers.get("x-claude-code-agent-id")
            assert ident.conversation == (f"{session}/agent-{agent}" if agent else session)
        elif harness == "codex":
            assert ident.conversation == headers["session-id"]
            assert ident.user.startswith("key-")
        elif harness == "opencode":
            assert ident.conversation == headers["x-session-id"]
        else:
            body = raw["body"]
            expected = (body.get("metadata") or {}).get("user_id") or body.get("user")
            assert ident.user == (f"{ident.tenant}/{expected}" if expected else ident.tenant)
            assert ident.tenant.startswith("key-")
            assert ident.conversation.startswith("derived-")
        # The credential never becomes part of an identity.
        for secret in (headers.get("x-api-key"), headers.get("authorization")):
            assert not secret or secret not in (ident.user + ident.conversation)


def test_claude_code_sessions_store_each_typed_turn_once(pipeline: Pipeline) -> None:
    captured = [d for _, d in replay(pipeline, "claude-code") if d.job and not d.job.pending.title]
    user_turns = [t for _, role, t in stored(pipeline) if role == "user"]
    assert user_turns == [
        "hello", "second turn: what did I say before?", "RUN_BASH please run echo hi",
        "READ_FILE:/home/dev/claude-proj/notes.txt", "hello again", "third turn via resume",
        "hello haiku", "hello interactive", "RUN_BASH now", "after compact question",
        "hello proxied", "hello proxied", "RUN_AGENT please delegate",
        "Reply with the single word hi.",
    ]
    # Every reply stored once, and the history re-sent around it (resume and compaction
    # included) never again: no assistant message was stored from a request.
    con = opened(pipeline.store.path)
    sources = dict(con.execute("select source, count(*) from message where role = 'assistant' "
                               "group by source").fetchall())
    con.close()
    assert sources == {"reply": len(captured)}


def test_codex_and_opencode_sessions(pipeline: Pipeline) -> None:
    replay(pipeline, "codex")
    replay(pipeline, "opencode")
    turns = [(role, t) for _, role, t in stored(pipeline) if role == "user"]
    assert turns == [
        ("user", "say hello"), ("user", "RUN_SHELL: please run echo hi"),
        ("user", "second turn: what did I ask before?"), ("user", "RUN_SHELL: please run echo hi"),
        ("user", '"say hello"'), ("user", '"RUN_SHELL please run echo hi"'),
        ("user", '"second turn: what did I ask?"'), ("user", '"RUN_BASH please run echo hi"'),
    ]


def test_gemini_cli_sessions_store_each_typed_turn_once(pipeline: Pipeline) -> None:
    captured = [d for _, d in replay(pipeline, "gemini-cli") if d.job]
    assert [t for _, role, t in stored(pipeline) if role == "user"] == [
        "say hello", "READ_FILE:/home/dev/gemini-proj/notes.txt", "second turn: what did I ask?",
        "RUN_SHELL please run echo hi"]
    con = opened(pipeline.store.path)
    sources = dict(con.execute("select source, count(*) from message where role = 'assistant' "
                               "group by source").fetchall())
    con.close()
    assert sources == {"reply": len(captured)}  # a re-sent model turn is never stored again
