"""Whose conversation is this, which harness sent it, and is it a turn at all?

The credential is the tenant: a salted hash of it (the credential itself never leaves this
module), or `anonymous` for every request that carries none. Explicit `x-perpetuity-user` /
`x-perpetuity-conversation` headers win, then what each harness sends; every identity a request
claims is scoped under its tenant, so a claim partitions the tenant's memory but never reaches
into another's (a `device_id` or `x-perpetuity-user: alice` sent with someone else's key used to
read Alice's turns). Only a deployment whose own gateway authenticates the headers trusts them
globally (`trust`). A personal proxy (`personal`: one person's, listening on loopback) is one
memory: every credential and every claim is that person's, so all of them are one user,
`personal`, and a fact told to one harness is in every other's frames. A conversation without an id is derived from its first user turn, which
every later request of that conversation re-sends unchanged.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from perpetuity_core.wire.conversation import Kind, ParsedRequest

CLAUDE_CODE_COMPACT = "Your task is to create a detailed summary of the conversation so far"
OPENCODE_TITLE = "You are a title generator"
# gemini-cli's chat compression prompt (its getCompressionPrompt), the history summarised.
GEMINI_CLI_COMPRESS = "distilling chat history into a structured XML <state_snapshot>"
CODEX_TURN = "x-codex-turn-metadata"
ANONYMOUS = "anonymous"  # the one tenant every request without a credential shares
PERSONAL = "personal"  # a personal proxy's one tenant and user, whatever the credential


@dataclass(frozen=True, slots=True)
class Identity:
    user: str  # the store's user key: "<tenant>/<claimed>", the tenant alone, or (trusted) the claim
    conversation: str
    harness: str  # "claude-code" | "codex" | "opencode" | "gemini-cli" | "client"
    side: str = ""  # why this request is a harness side request and not a turn ("" for turns)
    tenant: str = ANONYMOUS  # whose memory and notes this request may reach


def identify(headers: Mapping[str, str], req: ParsedRequest, credential: str, salt: str,
             trust: bool = False, personal: bool = False) -> Identity:
    """`headers` must have lower-case keys; `trust`: the identity headers are authenticated
    upstream of us, so a claimed user is the user, whatever the credential; `personal`: every
    request is the one person's (claims ignored: a device id must not split them in two)."""
    harness = _harness(headers)
    cc = _claude_code_metadata(req.hints.get("metadata.user_id", ""))
    tenant = tenant_of(credential, salt)
    claimed = (
        headers.get("x-perpetuity-user")
        or (cc and (cc.get("account_uuid") or cc.get("device_id")))
        or (not cc and req.hints.get("metadata.user_id"))
        or req.hints.get("user")
        or req.hints.get("safety_identifier")
        or ""
    )
    if personal:
        user = tenant = PERSONAL
    elif trust:
        user = str(claimed) or tenant
        tenant = user
    else:
        user = f"{tenant}/{claimed}" if claimed else tenant
    conversation = headers.get("x-perpetuity-conversation") or _harness_conversation(headers, req, cc)
    if not conversation:
        seed = "\x00".join((user, req.protocol.value, _first_user_turn(req)))
        conversation = "derived-" + _digest(salt, seed)
    return Identity(user, conversation, harness, _side(headers, req, harness), tenant)


def tenant_of(credential: str, salt: str) -> str:
    """The tenant a credential names: its salted hash, or the one anonymous tenant."""
    return "key-" + _digest(salt, credential) if credential else ANONYMOUS


def _harness(headers: Mapping[str, str]) -> str:
    agent = headers.get("user-agent", "")
    if agent.startswith("claude-cli") or "x-claude-code-session-id" in headers:
        return "claude-code"
    if headers.get("originator", "").startswith("codex") or agent.startswith("codex"):
        return "codex"
    if agent.startswith("opencode"):
        return "opencode"
    if agent.startswith("GeminiCLI"):
        return "gemini-cli"
    return "client"


def _claude_code_metadata(user_id: str) -> dict[str, str]:
    """Claude Code puts JSON (device_id, account_uuid, session_id) in metadata.user_id."""
    if not user_id.startswith("{"):
        return {}
    try:
        data = json.loads(user_id)
    except ValueError:
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str) and v} if isinstance(data, dict) else {}


def _harness_conversation(headers: Mapping[str, str], req: ParsedRequest, cc: dict[str, str]) -> str:
    session = headers.get("x-claude-code-session-id") or cc.get("session_id")
    if session:
        agent = headers.get("x-claude-code-agent-id")
        return f"{session}/agent-{agent}" if agent else session
    turn_meta = _turn_metadata(headers, req)
    return (
        headers.get("session-id")
        or str(turn_meta.get("session_id") or "")
        or req.hints.get("prompt_cache_key", "")
        or req.hints.get("session_id", "")  # gemini-cli's, in the Code Assist envelope
        or headers.get("x-session-id", "")
    )


def _side(headers: Mapping[str, str], req: ParsedRequest, harness: str) -> str:
    if not req.generate:
        return "prewarm"
    if req.compaction:
        return "compaction"
    turn_meta = _turn_metadata(headers, req)
    kind = turn_meta.get("request_kind")
    if isinstance(kind, str) and kind != "turn":
        return f"codex-{kind}"
    # Codex asks for a thread's title in a thread of its own (its own session id, so the
    # title cannot be tied to the conversation it names): harness text, not a turn.
    if turn_meta.get("thread_source") == "thread_title":
        return "codex-title"
    if harness == "claude-code":
        if req.structured_output and not req.tool_names:
            return "title"
        last = req.messages[-1] if req.messages else None
        if last and last.role == "user" and any(
            CLAUDE_CODE_COMPACT in p.text for p in last.parts if p.kind == Kind.TEXT
        ):
            return "compaction"
    if harness == "opencode" and not req.tool_names and req.system.startswith(OPENCODE_TITLE):
        return "title"
    if harness == "gemini-cli" and GEMINI_CLI_COMPRESS in req.system:
        return "compaction"
    if harness == "gemini-cli" and req.structured_output and not req.tool_names:
        # Its routing classifier and next-speaker check: the history under a prompt of their
        # own, answered as JSON by schema.
        return "gemini-cli-check"
    return ""


def _first_user_turn(req: ParsedRequest) -> str:
    for m in req.messages:
        if m.role == "user":
            return m.fingerprint()
    return req.system


def _turn_metadata(headers: Mapping[str, str], req: ParsedRequest) -> dict[str, object]:
    """Codex's turn metadata: the request's own (a WebSocket message's) before the headers'."""
    return _json_header(req.hints.get(CODEX_TURN) or headers.get(CODEX_TURN, ""))


def _json_header(value: str) -> dict[str, object]:
    try:
        data = json.loads(value) if value else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _digest(salt: str, value: str) -> str:
    return hashlib.blake2b(value.encode(), key=salt.encode()[:64], digest_size=12).hexdigest()


CREDENTIAL = "credential"  # the shared proxy's tenancy; PERSONAL the other


def tenancy(setting: str, hosts: Iterable[str]) -> str:
    """`personal` or `credential`: the setting when given, else `personal` only when every
    address the proxy listens on is loopback (whoever can reach the port reads the memory;
    an empty host is every interface). A ValueError names a setting that is neither."""
    if setting in (PERSONAL, CREDENTIAL):
        return setting
    if setting:
        raise ValueError(f"perpetuity_tenants is {PERSONAL!r} or {CREDENTIAL!r}, not {setting!r}")
    hosts = list(hosts)
    return PERSONAL if hosts and all(_loopback(h) for h in hosts) else CREDENTIAL


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another name: it may resolve beyond this machine


def tenant_of_key(user_key: str) -> str:
    """A stored user's tenant: the part of its key before the claimed name (`key-<hash>/<name>`,
    as `identify` makes it); `tenant_of` makes that tenant from a credential."""
    return user_key.split("/", 1)[0]
