"""What a request is, worked out once: its route, its `x-perpetuity-*` controls, its body read
and parsed into neutral terms, and whose it is. `RequestReader.understand` reads the line and
headers alone (on the event loop: enough to pass on another host's traffic, or `x-perpetuity:
off`); `RequestReader.read` reads the body, once, however many times the pipeline asks. What it
cannot read is decided here, as a pass-through with its reason; the pipeline decides the rest.
"""

from __future__ import annotations

import bisect
import logging
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
from perpetuity_core.wire import mend
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
from perpetuity_core.wire.seen import Look, Read, Seen

log = logging.getLogger("perpetuity")

CURATE_COMMAND = "/perpetuity-curate"

# Bodies above this are forwarded untouched rather than parsed on the request path.
MAX_BODY = 32 * 1024 * 1024

# A surrogate's JSON escape: its high half (d800-dbff) or its low half (dc00-dfff).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
# A surrogate written raw (UTF-8's pattern for one: ED A0-BF), which json.loads also reads.
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")

# How far past the proxy's clock a claimed time (x-perpetuity-time) may be: another machine's
# clock, a little ahead.
CLOCK_SKEW = 300.0


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
    claimed: float | None  # x-perpetuity-time, unless absent or in the future (_claimed_time)
    cut: bool  # the body held a lone surrogate, mended where it was read (wire.mend)
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
    look: Look | None = None  # where the body starts as one read before did, once looked for

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
    cut: bool = False  # the body held a lone surrogate, mended where it was read (wire.mend)


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
        read, unread = self._json_body(req.body, u.look) if req.method == "POST" else (None, "")
        body: dict[str, Any] | None = read.data if read is not None else None
        if u.decision is None:  # the body's model says which provider
            self._routed(u, str(body.get("model", "")) if body else "")
            if u.done:
                return
        assert u.decision is not None and u.decision.route is not None
        r = u.decision.route
        if r.protocol is not None and unread:
            # Forwarded as it came, and said once: a turn the memory never saw is not silent.
            log.warning("perpetuity: %s %s: not stored, forwarded as sent: %s", req.method,
                        req.path.split("?", 1)[0], unread)
        if r.protocol is None or read is None or body is None:
            return u.decided("no turn in this request")
        try:
            parsed, folder, cut = self._parse(r.protocol, read, req.body)
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
        now = time.time()
        claimed = _claimed_time(controls.at, now)
        u.turn = Turn(
            route=r, protocol=r.protocol, body=body, parsed=parsed, folder=folder,
            count=bool(count), controls=controls, ident=ident, library=library,
            at=claimed if claimed is not None else now, claimed=claimed, cut=cut,
            # The recall tools ride along with a frame (there is memory to reach) and a call.
            tools_on=(s.tools and controls.tools and controls.capture
                      and bool(count or not controls.probe)),
            curates=(last_user_text(parsed.messages) == CURATE_COMMAND and library is not None
                     and s.notes_capture))

    def _json_body(self, raw: bytes, look: Look | None) -> tuple[Read | None, str]:
        """The body read, or None with why not when it is not a JSON object this path may
        read (too large, not UTF-8 JSON); "" for no body. Only bytes not read before are
        scanned."""
        if not raw:
            return None, ""
        if len(raw) > MAX_BODY:
            return None, f"it is over {MAX_BODY >> 20} MB ({len(raw)} bytes)"
        try:
            read = self.seen.read(raw, look)
        except UnicodeDecodeError as e:
            return None, f"it is not UTF-8 ({e.reason} at byte {e.start})"
        except ValueError as e:
            return None, f"it is not JSON ({e})"
        except RecursionError:  # deeper than Python's stack
            return None, "it is JSON nested deeper than the parser reads"
        if not isinstance(read.data, dict):
            return None, "it is JSON but not an object"
        return read, ""

    def _parse(self, protocol: Protocol, read: Read, raw: bytes) -> tuple[ParsedRequest, str, bool]:
        """The request in neutral terms, the folder its harness states (names.folder) and
        whether the body holds a lone surrogate (mended in what is read: wire.mend), kept for
        the next body that starts as this one does: the messages an earlier body of the same
        wire read are taken as they were, and the folder is looked for among the new ones
        alone."""
        known = read.known if isinstance(read.known, _Known) else None
        if known is not None and known.parsed.protocol != protocol:
            known = None  # another wire's body that starts with the same bytes
        # Once mended, every body that starts as that one did is mended too: what an adapter
        # reads again of it (the system prompt, a message that goes on past the reused part)
        # is read from the body, not taken from the earlier reading.
        start = read.fresh_from if known is not None else 0
        cut = ((known is not None and known.cut) or lone_surrogate(raw, start)
               or _raw_surrogate(raw, start))
        parsed = ADAPTERS[protocol].parse_request(read.data, known.parsed if known else None,
                                                  read.reused)
        if cut:
            parsed = mend.mended_request(parsed, known.parsed if known else None)
        found, reused = ("", 0), 0
        if known is not None:
            found = known.folder
            reused = bisect.bisect_left(known.parsed.raw_index, read.reused)
        if found[1] >= reused:  # none stated in the messages read before: look in the rest
            found = names.messages_folder(parsed.messages, reused)
        self.seen.keep(read, _Known(parsed, found, cut))
        stated = names.stated_folder(parsed.system)
        return parsed, stated if stated is not None else found[0], cut


def text_headers(req: HttpRequest) -> dict[str, str]:
    """The headers lower-cased, read as text: a value that was not UTF-8 (mitmproxy's
    surrogate escapes) must never reach the store or a digest as it is."""
    return {k.lower(): v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            for k, v in req.headers}


def _claimed_time(at: float | None, now: float) -> float | None:
    """The time `x-perpetuity-time` claims, unless it is past now by more than a clock's skew
    (None: the arrival time stands): a turn from the future would stand as the user's last in
    `memory users` and in every recency ordering."""
    return at if at is None or at <= now + CLOCK_SKEW else None


def _raw_surrogate(raw: bytes, start: int) -> bool:
    """Does the body hold a surrogate written raw, from byte `start` on? Looked for by its lead
    byte first (memchr): a 20.8 MB body without one, 1.4 ms where the pattern alone took 12."""
    at = raw.find(b"\xed", start)
    return at >= 0 and _RAW_SURROGATE.search(raw, at) is not None


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
