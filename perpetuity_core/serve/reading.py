"""What a request is, worked out once: its route, its `x-perpetuity-*` controls, its body read
and parsed into neutral terms, and whose it is. `RequestReader.understand` reads the line and
headers alone (on the event loop: enough to pass on another host's traffic, or `x-perpetuity:
off`); `RequestReader.read` reads the body, once, however many times the pipeline asks. What it
cannot read is decided here, as a pass-through with its reason; the pipeline decides the rest.
"""

from __future__ import annotations

import bisect
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from perpetuity_core.frame import tenants
from perpetuity_core.memory.storage import names
from perpetuity_core.serve.exchange import UNKNOWN_PROVIDER, Decision, HttpRequest
from perpetuity_core.serve.layout import last_user_text
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire.conversation import ParsedRequest, Protocol
from perpetuity_core.wire.identity import Identity, identify
from perpetuity_core.wire.protocols import ADAPTERS
from perpetuity_core.wire.route import (
    CONTROL_PREFIX,
    Controls,
    Route,
    anthropic_count,
    credential,
    gemini_call,
    parse_controls,
    reads_model,
    route,
)
from perpetuity_core.wire.seen import Read, Seen

CURATE_COMMAND = "/perpetuity-curate"

# Bodies above this are forwarded untouched rather than parsed on the request path.
MAX_BODY = 32 * 1024 * 1024

# A surrogate's JSON escape: its high half (d800-dbff) or its low half (dc00-dfff).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


@dataclass(slots=True, kw_only=True)
class Turn:
    """A request's body as a turn: what the pipeline decides and lays out from."""

    route: Route
    protocol: Protocol
    body: dict[str, Any]
    parsed: ParsedRequest
    folder: str  # the project folder its harness states ("" for none)
    count: bool  # a token count (Anthropic's count_tokens, Gemini's countTokens): a probe
    controls: Controls  # as the headers say, a count made a probe
    ident: Identity
    library: Path | None  # the asking tenant's notes library
    at: float  # when it was asked (x-perpetuity-time, else now)
    tools_on: bool  # the recall tools may ride along (settings, controls, a model call)
    curates: bool  # `/perpetuity-curate`, with a library to curate and notes on


    @property
    def recalls(self) -> bool:
        """Does memory lay it out (recall on, and no history kept by the provider)?"""
        return self.controls.recall and "previous_response_id" not in self.parsed.hints


@dataclass(slots=True)
class Understood:
    """One request as it is understood so far: `decision` is final once `done`; `turn` is set
    once the body was read as one."""

    req: HttpRequest
    headers: dict[str, str]  # lower-cased, as text (text_headers)
    controls: Controls
    decision: Decision | None = None  # routed (where the body's model is not needed to route)
    done: bool = False
    read: bool = False  # the body was read (to a turn, or to a decision)
    turn: Turn | None = None

    def decided(self, note: str) -> None:
        assert self.decision is not None
        self.decision.note, self.done = note, True


@dataclass(frozen=True, slots=True)
class _Known:
    """What the request path made of a body, kept for the next body that starts as it does
    (wire.seen): the request in neutral terms, and the folder its messages state with the index
    of the message stating it (names.messages_folder; none: their count)."""

    parsed: ParsedRequest
    folder: tuple[str, int]


class RequestReader:
    """Reads requests for one memory: the bodies last read are kept (wire.seen), so that a
    longer one reads only its tail. One preparer at a time (serve.preparing)."""

    def __init__(self, salt: str, settings: Settings) -> None:
        self.salt = salt
        self.settings = settings
        self.upstreams = dict(settings.upstreams)
        self.seen = Seen()

    def understand(self, req: HttpRequest) -> Understood:
        """The line and headers read: the controls, and the route where the body's model does
        not choose it; done where they decide it (another host's traffic through us, a
        provider we cannot tell, `x-perpetuity: off`)."""
        headers = text_headers(req)
        u = Understood(req, headers, parse_controls(headers))
        lower = {k.lower(): v for k, v in req.headers}
        if not reads_model(path=req.path, direct=req.direct, headers=lower):
            self._routed(u, "")
        return u

    def _routed(self, u: Understood, model: str) -> None:
        u.decision = self.route_only(u.req, model)
        if u.decision.route is None:
            u.done = True
        elif not u.controls.enabled:
            u.decided("x-perpetuity: off")

    def route_only(self, req: HttpRequest, model: str = "") -> Decision:
        """Where the request goes and which headers to strip, touching nothing else."""
        headers = {k.lower(): v for k, v in req.headers}
        r = route(host=req.host, path=req.path, direct=req.direct, headers=headers, model=model,
                  upstreams=self.upstreams)
        if r is None and req.direct:
            return Decision(answer=UNKNOWN_PROVIDER, note="provider unknown")
        if r is None:
            return Decision(note="not provider traffic")  # untouched, our headers included
        strip = sorted({k for k, _ in req.headers if k.lower().startswith(CONTROL_PREFIX)})
        return Decision(route=r, strip=strip)

    def read(self, u: Understood) -> None:
        """The body read, once: to a turn, or to the decision that passes it on as it came
        (not JSON this path may store, no turn in it, unreadable)."""
        if u.read or u.done:
            return
        u.read = True
        req = u.req
        read = self._json_body(req.body) if req.method == "POST" else None
        body: dict[str, Any] | None = read.data if read is not None else None
        if u.decision is None:  # the body's model says which provider
            self._routed(u, str(body.get("model", "")) if body else "")
            if u.done:
                return
        assert u.decision is not None and u.decision.route is not None
        r = u.decision.route
        if r.protocol is None or read is None or body is None:
            return u.decided("no turn in this request")
        try:
            parsed, folder = self._parse(r.protocol, read)
        except Exception as e:  # fail open: an unreadable body goes through as sent
            return u.decided(f"unparsed: {e}")
        # Anthropic's count_tokens and Gemini's countTokens are answered for the request as it
        # would go upstream (framed, our tools beside the harness's), and store nothing: a
        # harness sizing its context sees what the model reads.
        count = anthropic_count(req.path)
        if (call := gemini_call(req.path)) is not None:
            # Gemini: the path names the model and the streaming.
            parsed.model, parsed.stream = call.model or parsed.model, call.stream
            count = call.count
        controls = replace(u.controls, probe=True) if count else u.controls
        s = self.settings
        ident = identify(u.headers, parsed, credential(u.headers, req.path), self.salt,
                         s.trust_identity, s.personal)
        u.decision.identity, u.decision.parsed = ident, parsed
        library = tenants.library(s.notes_root, ident.tenant)
        u.turn = Turn(
            route=r, protocol=r.protocol, body=body, parsed=parsed, folder=folder,
            count=bool(count), controls=controls, ident=ident, library=library,
            at=controls.at if controls.at is not None else time.time(),
            # The recall tools ride along with a frame (there is memory to reach) and a call.
            tools_on=(s.tools and controls.tools and controls.capture
                      and bool(count or not controls.probe)),
            curates=(last_user_text(parsed.messages) == CURATE_COMMAND and library is not None
                     and s.notes_capture))

    def _json_body(self, raw: bytes) -> Read | None:
        """The body read, or None when it is not a JSON object this path may store (too
        large, unreadable, a lone surrogate); only bytes not read before are scanned."""
        if not raw or len(raw) > MAX_BODY:
            return None
        try:
            read = self.seen.read(raw)
            if lone_surrogate(raw, read.fresh_from):  # a lone one (\ud800) cannot be stored
                json.dumps(read.data, ensure_ascii=False).encode()
        except (ValueError, RecursionError):  # RecursionError: deeper than Python's stack
            return None
        return read if isinstance(read.data, dict) else None

    def _parse(self, protocol: Protocol, read: Read) -> tuple[ParsedRequest, str]:
        """The request in neutral terms and the folder its harness states (names.folder), kept
        for the next body that starts as this one does: the messages an earlier body of the
        same wire read are taken as they were, and the folder is looked for among the new ones
        alone."""
        known = read.known if isinstance(read.known, _Known) else None
        if known is not None and known.parsed.protocol != protocol:
            known = None  # another wire's body that starts with the same bytes
        parsed = ADAPTERS[protocol].parse_request(read.data, known.parsed if known else None,
                                                  read.reused)
        found, reused = ("", 0), 0
        if known is not None:
            found = known.folder
            reused = bisect.bisect_left(known.parsed.raw_index, read.reused)
        if found[1] >= reused:  # none stated in the messages read before: look in the rest
            found = names.messages_folder(parsed.messages, reused)
        self.seen.keep(read, _Known(parsed, found))
        stated = names.stated_folder(parsed.system)
        return parsed, stated if stated is not None else found[0]


def text_headers(req: HttpRequest) -> dict[str, str]:
    """The headers lower-cased, read as text: a value that was not UTF-8 (mitmproxy's
    surrogate escapes) must never reach the store or a digest as it is."""
    return {k.lower(): v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            for k, v in req.headers}


def lone_surrogate(raw: bytes, start: int = 0) -> bool:
    """Does the body escape a surrogate that is not half of a pair, from byte `start` on (the
    bytes before were read before, and passed)? Scanned, not re-encoded: a long history's emoji
    (paired) made every call dump and encode the whole body (0.3 s at 6.5 MB). An escape is one
    only after an even run of backslashes (else it is text)."""
    paired = -1  # where the low half of the last pair starts
    for m in _SURROGATE.finditer(raw, start):
        start = k = m.start()
        while k and raw[k - 1] == 0x5C:
            k -= 1
        if (start - k) % 2 or start == paired:
            continue
        if raw[start + 3] not in b"89abAB" or not _LOW.match(raw, m.end()):
            return True
        paired = m.end()
    return False
