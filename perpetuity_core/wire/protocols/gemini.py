"""Google Gemini generateContent: request bodies and replies (streamed as SSE, or whole) to the
neutral model.

Two endpoints speak it: the Gemini API's `models/{model}:generateContent` and
`:streamGenerateContent?alt=sse` (the model is named by the path, wire.route reads it), and
Code Assist's `v1internal:...` (gemini-cli signed in with Google), whose body wraps the same
request as `{model, project, request}` and whose replies wrap it as `{response}`. Every function
here takes either and answers in the shape it was given.

Gemini's function calls carry no reliable id: the API sends none, and gemini-cli invents one per
request (the same call is `read_file_1796010651676_0` in one request and
`read_file__read_file_1796010651676_0` in the next, in the captures). So a call is named by its
name and arguments (gemini_parts.call_id), which the reply and every re-sent history agree on,
and a result by the call before it with the same name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from perpetuity_core.errors import ProtocolError
from perpetuity_core.wire.conversation import (
    Kind,
    Message,
    ParsedRequest,
    Protocol,
    Reply,
    Usage,
    read_before,
)
from perpetuity_core.wire.protocols.base import (
    BodyMergerBase,
    CacheRule,
    StreamMergerBase,
    spliced,
)
from perpetuity_core.wire.protocols.gemini_parts import (
    calls_in,
    content_parts,
    first_candidate,
    joined,
    listed,
    read_parts,
    sse_chunk,
    unwrapped,
)
from perpetuity_core.wire.sse import Event

# The wrappers around a request: Code Assist's envelope, countTokens' full request form.
_WRAPPERS = ("request", "generateContentRequest")
USAGE = ("promptTokenCount", "candidatesTokenCount", "totalTokenCount", "thoughtsTokenCount",
         "cachedContentTokenCount", "toolUsePromptTokenCount")

# Gemini's implicit prefix cache by model family (the longest family name the model's name starts
# with): the smallest prefix cached, in tokens, and a read's price as a share of the input price.
# Minimums: ai.google.dev/gemini-api/docs/caching (2026-10-13; Flash-Lite's 2,048 as the API
# enforces it). Reads: "a 90% discount on cached tokens" (Vertex AI's context cache overview);
# writes cost nothing extra. An entry's life is unpublished: 5 minutes is our assumption. Models
# before 2.5 cache nothing (the sources in full: docs/tuning.md).
IMPLICIT_CACHE: dict[str, tuple[int, float]] = {
    "gemini-2.5-pro": (2_048, 0.1), "gemini-2.5-flash": (2_048, 0.1),
    "gemini-2.5-flash-lite": (2_048, 0.1), "gemini-3": (4_096, 0.1), "gemini-4": (4_096, 0.1),
}
NO_CACHE = (1 << 62, 1.0)  # gemini-1.x, gemini-2.0: no implicit cache
IMPLICIT_TTL = 300.0


def cache_rule(model: str) -> CacheRule:
    """The implicit cache's rule for `model` (a newer family than the table knows: 4,096 and a
    tenth, as every model since 3 has it)."""
    name = model.lower().removeprefix("models/")
    family = max((k for k in IMPLICIT_CACHE if name.startswith(k)), key=len, default=None)
    old = name.startswith(("gemini-1", "gemini-2.0", "gemini-pro"))
    least, read = IMPLICIT_CACHE[family] if family else NO_CACHE if old else (4_096, 0.1)
    return CacheRule(least, read, 1.0, IMPLICIT_TTL)


def _inner(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The generateContent request inside `body`, with the key that wraps it ("" if none)."""
    if "contents" not in body:
        for key in _WRAPPERS:
            if isinstance(body.get(key), dict):
                return key, body[key]
    return "", body


def _wrapped(body: dict[str, Any], key: str, inner: dict[str, Any]) -> dict[str, Any]:
    return {**body, key: inner} if key else inner


def parse_request(body: dict[str, Any], known: ParsedRequest | None = None,
                  reused: int = 0) -> ParsedRequest:
    """`known`: an earlier request whose first `reused` contents are this body's, the same
    objects (wire.seen). A content reads beside the message before it (its calls pair the
    results), so those are taken as it read them and the rest read after them."""
    _, req = _inner(body)
    contents = req.get("contents")
    if not isinstance(contents, list):
        raise ProtocolError("Gemini request without a contents list")
    start = reused if known is not None and 0 < reused <= len(contents) else 0
    raw_index, messages, _ = read_before(known, start)
    for i in range(start, len(contents)):
        if isinstance(contents[i], dict):
            raw_index.append(i)
            messages.append(_message(contents[i], messages[-1] if messages else None))
    config = req.get("generationConfig")
    config = config if isinstance(config, dict) else {}
    hints = {"session_id": req["session_id"]} if isinstance(req.get("session_id"), str) else {}
    return ParsedRequest(
        protocol=Protocol.GEMINI,
        model=str(body.get("model", "")).removeprefix("models/"),  # Code Assist names it here
        stream=False,  # the path says (wire.route.gemini_call)
        messages=messages,
        system=_text_of(req.get("systemInstruction")),
        tool_names=[str(d.get("name", "")) for d in _declarations(req)],
        hints=hints,
        # gemini-cli's routing classifier and next-speaker check ask for JSON by schema.
        structured_output=config.get("responseMimeType") == "application/json"
        or "responseSchema" in config or "responseJsonSchema" in config,
        raw_index=raw_index,
    )


def _declarations(req: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for t in listed(req.get("tools")) if isinstance(t, dict)
            for d in listed(t.get("functionDeclarations")) if isinstance(d, dict)]


def _message(content: dict[str, Any], before: Message | None) -> Message:
    role = "assistant" if content.get("role") == "model" else "user"
    return Message(role, read_parts(listed(content.get("parts")), before))


def _text_of(instruction: Any) -> str:
    if isinstance(instruction, str):
        return instruction
    parts = instruction.get("parts") if isinstance(instruction, dict) else instruction
    if not isinstance(parts, list):
        return ""
    return "\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and "text" in p)


def replace_history(body: dict[str, Any], frame: list[Message], keep_from: int,
                    inserts: Mapping[int, list[Message]] | None = None,
                    standing: Sequence[int] | None = None) -> dict[str, Any]:
    """The body with contents before raw index `keep_from` replaced by the frame, and each of
    `inserts` (raw index -> messages) put just before the content at that index; the system
    instruction, tools and config untouched (no content stands: `standing` is always empty).
    Kept contents are the harness's own, verbatim, so thought signatures stay on the parts they
    came with."""
    key, req = _inner(body)
    kept = spliced(req["contents"], keep_from, inserts, _render)
    return _wrapped(body, key, {**req, "contents": _render(frame) + kept})


def _render(messages: list[Message]) -> list[dict[str, Any]]:
    return [{"role": "model" if m.role == "assistant" else "user",
             "parts": [{"text": "\n\n".join(p.text for p in m.parts)}]} for m in messages]


def check(body: dict[str, Any]) -> list[str]:
    """Why Gemini would refuse this body ([] when it would not), as far as replacing history can
    break it: it starts with the user, and every function response follows the model turn that
    called it (gemini-cli sometimes answers one call twice: by name, not by count)."""
    _, req = _inner(body)
    raw = req.get("contents")
    if not isinstance(raw, list) or not raw:
        return ["no contents"]
    errors: list[str] = []
    if not isinstance(raw[0], dict) or raw[0].get("role") == "model":
        errors.append("the first content is not the user's")
    called: set[str] = set()
    for i, c in enumerate(raw):
        parts = [p for p in listed(c.get("parts")) if isinstance(p, dict)] \
            if isinstance(c, dict) else []
        answers = {str(p["functionResponse"].get("name")) for p in parts
                   if isinstance(p.get("functionResponse"), dict)}
        if called and not answers:
            errors.append(f"content {i}: function calls without their responses: {sorted(called)}")
        if missing := answers - called:
            errors.append(f"content {i}: function response without its call: {sorted(missing)}")
        called = {str(p["functionCall"].get("name")) for p in parts
                  if isinstance(p.get("functionCall"), dict)}
    return errors


def _usage(u: Any) -> Usage:
    u = u if isinstance(u, dict) else {}
    return Usage(
        input_tokens=int(u.get("promptTokenCount") or 0),
        output_tokens=int(u.get("candidatesTokenCount") or 0) + int(u.get("thoughtsTokenCount") or 0),
        cache_read_tokens=int(u.get("cachedContentTokenCount") or 0),
    )


def reply_from_body(body: dict[str, Any]) -> Reply:
    data = unwrapped(body)
    candidate = first_candidate(data)
    return Reply(Message("assistant", read_parts(content_parts(candidate), None)),
                 _usage(data.get("usageMetadata")), str(candidate.get("finishReason") or ""))


class ReplyAssembler:
    """Rebuilds the model's turn from the SSE chunks (the first candidate only)."""

    def __init__(self) -> None:
        self._parts: list[dict[str, Any]] = []
        self._usage = Usage()
        self._stop = ""

    def feed(self, ev: Event) -> None:
        data = ev.json()
        if data is None:
            return
        data = unwrapped(data)
        if isinstance(data.get("usageMetadata"), dict):
            self._usage = _usage(data["usageMetadata"])  # each chunk's counts are the totals so far
        candidate = first_candidate(data)
        self._parts += content_parts(candidate)
        if candidate.get("finishReason"):
            self._stop = str(candidate["finishReason"])

    def reply(self) -> Reply:
        return Reply(Message("assistant", read_parts(joined(self._parts), None)), self._usage,
                     self._stop, bool(self._stop))


def render_text(text: str, model: str, stream: bool, reply_id: str) -> bytes:
    """A whole model turn the proxy answers itself, as the Gemini API would have sent it."""
    body = {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 0, "candidatesTokenCount": 0,
                              "totalTokenCount": 0},
            "modelVersion": model, "responseId": reply_id}
    return sse_chunk(body) if stream else json.dumps(body).encode()


# --------------------------------------------------------------------------- the tool loop


def count_request(body: dict[str, Any], model: str) -> dict[str, Any]:
    """A countTokens body as the generateContentRequest it stands for (one already is): the API
    counts tools and a system instruction only inside one, and takes bare `contents` beside
    nothing else."""
    if isinstance(body.get("generateContentRequest"), dict):
        return body
    return {"generateContentRequest": {"model": f"models/{model}", **body}}


def add_tools(body: dict[str, Any], tools: list[dict[str, Any]], last_round: bool) -> dict[str, Any]:
    """Our tools as function declarations beside the harness's own (in its first tool that
    declares functions: one tool of declarations is what every model accepts); on the last round
    the model must answer."""
    key, req = _inner(body)
    ours = [{"name": t["name"], "description": t["description"],
             "parametersJsonSchema": t["input_schema"]} for t in tools]
    held = [t for t in listed(req.get("tools")) if isinstance(t, dict)]
    at = next((i for i, t in enumerate(held) if isinstance(t.get("functionDeclarations"), list)),
              None)
    if at is None:
        held.append({"functionDeclarations": ours})
    else:
        held[at] = {**held[at], "functionDeclarations": [*held[at]["functionDeclarations"], *ours]}
    out = {**req, "tools": held}
    if last_round:
        config = req.get("toolConfig")
        out["toolConfig"] = {**(config if isinstance(config, dict) else {}),
                             "functionCallingConfig": {"mode": "NONE"}}
    return _wrapped(body, key, out)


def continue_body(body: dict[str, Any], assistant: dict[str, Any],
                  results: list[tuple[str, str]]) -> dict[str, Any]:
    """The next round's request: this round's model turn, its parts as sent (thought signatures
    and all), and one user turn with our tools' results, named as the calls were."""
    key, req = _inner(body)
    names = {p.call_id: p.name for p in read_parts(assistant["parts"], None) if p.kind == Kind.TOOL_CALL}
    answers = [{"functionResponse": {"name": names.get(cid, ""), "response": {"output": text}}}
               for cid, text in results]
    contents = [*req["contents"], assistant, {"role": "user", "parts": answers}]
    return _wrapped(body, key, {**req, "contents": contents})


def ping() -> bytes:
    """Nothing: both SDKs read every line that is not `data:` as JSON, so a comment would break
    the stream (google-genai's _iter_response_stream)."""
    return b""


def error_event(message: str) -> bytes:
    """The error the API streams mid-reply; the SDKs raise it."""
    return sse_chunk({"error": {"code": 500, "message": message, "status": "INTERNAL"}})


class StreamMerger(StreamMergerBase):
    """Rounds of SSE chunks merged into the one stream the client sees.

    Parts are forwarded as they come, our calls taken out of them; a chunk left without parts is
    dropped. A round's finishing chunk is held back: the last round's ends the stream, its usage
    the sum over rounds, and an earlier round's visible parts go out at the next round's start.
    Gemini numbers no parts, so the base class's `hidden` holds the positions, within the
    round, of our calls.
    """

    def __init__(self, ours: frozenset[str]) -> None:
        self.usage = dict.fromkeys(USAGE, 0)
        self.wrapped = False  # Code Assist: every chunk is `{response: ...}`
        self.template: dict[str, Any] = {}  # the first chunk's fields (responseId, modelVersion)
        self.held: dict[str, Any] | None = None  # the last finishing chunk, not yet sent
        super().__init__(ours)

    def _new_round(self) -> None:
        super()._new_round()
        self.parts: list[dict[str, Any]] = []  # this round's parts as upstream sent them
        self.round_usage: dict[str, Any] = {}

    def feed(self, name: str, data: dict[str, Any]) -> bytes:
        if "error" in data:  # the provider's own error, as it sent it
            return sse_chunk(data)
        self.wrapped = self.wrapped or ("response" in data and "candidates" not in data)
        chunk = unwrapped(data)
        self.template = self.template or {k: v for k, v in chunk.items()
                                          if k not in ("candidates", "usageMetadata")}
        if isinstance(chunk.get("usageMetadata"), dict):
            self.round_usage = chunk["usageMetadata"]
        candidate = first_candidate(chunk)
        visible = []
        for p in content_parts(candidate):
            call = p.get("functionCall")
            if isinstance(call, dict) and call.get("name") in self.ours:
                self.hidden.add(len(self.parts))
            else:
                visible.append(p)
            self.parts.append(p)
        out = self._flush()
        shown = {**chunk, "candidates": [{**candidate, "content": {"role": "model", "parts": visible}}]}
        shown.pop("usageMetadata", None)  # summed over rounds, sent once at the end
        if candidate.get("finishReason"):
            self.held = shown
            return out
        return out + (self._out(shown) if visible else b"")

    def _flush(self) -> bytes:
        """An earlier round's held finishing chunk: its parts, without its ending."""
        held, self.held = self.held, None
        if held is None or not held["candidates"][0]["content"]["parts"]:
            return b""
        candidate = {k: v for k, v in held["candidates"][0].items() if k != "finishReason"}
        return self._out({**held, "candidates": [candidate]})

    def _out(self, chunk: dict[str, Any]) -> bytes:
        return sse_chunk({"response": chunk} if self.wrapped else chunk)

    def our_calls(self) -> list[tuple[str, str, Any]]:
        return [c for i, c in zip(self._positions(), calls_in(self.parts), strict=True)
                if i in self.hidden]

    def _positions(self) -> list[int]:
        return [i for i, p in enumerate(self.parts) if isinstance(p.get("functionCall"), dict)]

    def others_called(self) -> bool:
        return any(i not in self.hidden for i in self._positions())

    def assistant_blocks(self) -> dict[str, Any]:
        """This round's model turn as the next round re-sends it: every part it sent."""
        return {"role": "model", "parts": joined(self.parts)}

    def next_round(self) -> None:
        for k in self.usage:
            self.usage[k] += int(self.round_usage.get(k) or 0)
        super().next_round()

    def finish(self) -> bytes:
        for k in self.usage:
            self.usage[k] += int(self.round_usage.get(k) or 0)
        self.round_usage = {}
        end = self.held or {**self.template, "candidates": [
            {"content": {"role": "model", "parts": []}, "finishReason": "STOP", "index": 0}]}
        self.held = None
        return self._out({**end, "usageMetadata": {k: v for k, v in self.usage.items() if v}})


class BodyMerger(BodyMergerBase):
    """Rounds of whole generateContent replies merged into the one the client sees."""

    USAGE = USAGE
    USAGE_FIELD = "usageMetadata"

    def __init__(self, ours: frozenset[str]) -> None:
        super().__init__(ours)
        self.round: list[dict[str, Any]] = []
        self.wrapped = False

    def feed_body(self, body: dict[str, Any]) -> None:
        self.wrapped = self.wrapped or ("response" in body and "candidates" not in body)
        super().feed_body(unwrapped(body))

    def _take(self, body: dict[str, Any]) -> None:
        self.round = content_parts(first_candidate(body))
        self.visible += [p for p in self.round if not self._ours(p)]

    def _ours(self, part: dict[str, Any]) -> bool:
        call = part.get("functionCall")
        return isinstance(call, dict) and call.get("name") in self.ours

    def our_calls(self) -> list[tuple[str, str, Any]]:
        return [c for c in calls_in(self.round) if c[1] in self.ours]

    def others_called(self) -> bool:
        return any(isinstance(p.get("functionCall"), dict) and not self._ours(p) for p in self.round)

    def assistant_blocks(self) -> dict[str, Any]:
        return {"role": "model", "parts": self.round}

    def next_round(self) -> None:
        self.round = []

    def finish(self) -> bytes:
        candidate = {**first_candidate(self.last), "index": 0,
                     "content": {"role": "model", "parts": self.visible}}
        out = {**(self.first or {}), "candidates": [candidate],
               "usageMetadata": {k: v for k, v in self.usage.items() if v}}
        return json.dumps({"response": out} if self.wrapped else out).encode()
