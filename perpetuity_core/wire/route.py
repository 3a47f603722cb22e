"""Which provider and wire protocol a request speaks, where it goes, and what the caller asked of us.

One listening port serves every client: the path names the protocol, the credential and the
model's name tell Anthropic from OpenAI; Gemini's paths are its own. As a regular HTTPS proxy,
the provider hosts are recognised by name and every other host is left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from perpetuity_core.errors import ConfigError
from perpetuity_core.wire.conversation import Protocol, Provider

# Code Assist (gemini-cli signed in with Google) is Gemini's second host.
CODE_ASSIST = "cloudcode-pa.googleapis.com"
# Codex signed in with ChatGPT speaks Responses to ChatGPT's backend; the rest of that host is
# not provider traffic.
CHATGPT, CHATGPT_CODEX = "chatgpt.com", "/backend-api/codex/"
PROVIDER_HOSTS = {"api.anthropic.com": Provider.ANTHROPIC, "api.openai.com": Provider.OPENAI,
                  "generativelanguage.googleapis.com": Provider.GOOGLE, CODE_ASSIST: Provider.GOOGLE}
DEFAULT_UPSTREAMS = {Provider.ANTHROPIC: "https://api.anthropic.com", Provider.OPENAI: "https://api.openai.com",
                     Provider.GOOGLE: "https://generativelanguage.googleapis.com"}

CONTROL_PREFIX = "x-perpetuity"
OPENAI_MODELS = ("gpt-", "o1", "o3", "o4", "codex", "chatgpt")


@dataclass(frozen=True, slots=True)
class Route:
    provider: Provider
    protocol: Protocol | None  # None: a provider endpoint that carries no turn (count_tokens, models)
    upstream_url: str


@dataclass(frozen=True, slots=True)
class Controls:
    """The per-request `x-perpetuity-*` headers; all are stripped before anything goes upstream."""

    enabled: bool = True
    capture: bool = True
    recall: bool = True
    tools: bool = True
    probe: bool = False
    at: float | None = None  # the time to record for this turn


# The Gemini API's `models/{model}:method` and Code Assist's `v1internal:method`.
_GEMINI_PATH = re.compile(r"/v1[a-z0-9]*/models/(?P<model>[^/:?]+):(?P<method>\w+)$"
                          r"|/v1internal:(?P<internal>\w+)$")
_GEMINI_TURNS = ("generateContent", "streamGenerateContent", "countTokens")


@dataclass(frozen=True, slots=True)
class GeminiCall:
    """What a Gemini path says that other protocols put in the body."""

    model: str  # "" for Code Assist, whose body names it
    stream: bool
    count: bool  # countTokens: answered for the request as it would go upstream, not a turn


def gemini_call(path: str) -> GeminiCall | None:
    """The call a Gemini path makes, when it carries a conversation. A stream without `alt=sse`
    is a JSON array: not read, it passes through as sent."""
    parts = urlsplit(path)
    m = _GEMINI_PATH.search(parts.path)
    method = m and (m["method"] or m["internal"])
    if not m or method not in _GEMINI_TURNS:
        return None
    stream = method == "streamGenerateContent"
    if stream and parse_qs(parts.query).get("alt") != ["sse"]:
        return None
    return GeminiCall(m["model"] or "", stream, method == "countTokens")


def is_gemini(path: str) -> bool:
    """A Gemini API or Code Assist path: its versions (OpenAI's are `/v1/` alone), or a model's
    `:method` (models, files, loadCodeAssist, embedContent, ...)."""
    p = urlsplit(path).path
    return p.startswith(("/v1internal:", "/v1beta/", "/v1alpha/")) or bool(_GEMINI_PATH.search(p))


def parse_upstream(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"upstream must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


def anthropic_count(path: str) -> bool:
    """Anthropic's `/v1/messages/count_tokens`: a request's tokens, answered for the request as
    it would go upstream (framed), not a turn."""
    return path.split("?", 1)[0].rstrip("/").endswith("/messages/count_tokens")


def protocol_of(path: str) -> Protocol | None:
    p = path.split("?", 1)[0].rstrip("/")
    if gemini_call(path) is not None:
        return Protocol.GEMINI
    if p.endswith("/messages") or anthropic_count(path):
        return Protocol.ANTHROPIC
    if p.endswith("/chat/completions"):
        return Protocol.CHAT
    if p.endswith("/responses"):
        return Protocol.RESPONSES
    return None


def provider_of(path: str, headers: Mapping[str, str], model: str) -> Provider | None:
    """`headers` lower-cased. Anthropic credentials and versions are unmistakable; then the
    path and the model. None when nothing names a provider: a credential must never be sent to
    a provider it was not meant for (a Gemini key, a CI token), so such a request is not ours."""
    named = _named(path, headers)
    if named != "model":
        return named
    if model.startswith("claude"):
        return Provider.ANTHROPIC
    if protocol_of(path) is not None or model.startswith(OPENAI_MODELS):
        return Provider.OPENAI
    if path.startswith("/v1/") and headers.get("authorization", "").lower().startswith("bearer "):
        return Provider.OPENAI  # the OpenAI API's other endpoints (models, embeddings, files)
    return None


def _named(path: str, headers: Mapping[str, str]) -> Provider | None | Literal["model"]:
    """The provider the path and credential name, or "model" when only the body's model can
    tell (an OpenAI path or credential may carry a Claude model)."""
    if is_gemini(path):
        return Provider.GOOGLE
    if "x-goog-api-key" in headers:
        return None  # a Gemini key on another provider's path: meant for neither
    if ("x-api-key" in headers or "anthropic-version" in headers
            or headers.get("authorization", "").startswith("Bearer sk-ant-")
            or protocol_of(path) == Protocol.ANTHROPIC):
        return Provider.ANTHROPIC
    return "model"


def reads_model(*, path: str, direct: bool, headers: Mapping[str, str]) -> bool:
    """Does `route` need the body's model for this request (`headers` lower-cased)? Only for a
    request to us whose path and credential leave Anthropic and OpenAI apart: through us, the
    host names the provider."""
    return (direct and not urlsplit(path).path.startswith(CHATGPT_CODEX)
            and _named(path, headers) == "model")


def route(
    *,
    host: str,
    path: str,
    direct: bool,
    headers: Mapping[str, str],
    model: str,
    upstreams: Mapping[Provider, str],
) -> Route | None:
    """Where a request goes; None when it is not provider traffic (another host through us) or
    its provider cannot be told (a request to us naming none).

    `direct` is true when the client addressed the proxy itself (a base URL pointing at us);
    otherwise the client used us as its HTTP(S) proxy to reach `host`.
    """
    chatgpt = urlsplit(path).path.startswith(CHATGPT_CODEX)
    if chatgpt and (direct or host == CHATGPT):
        provider: Provider | None = Provider.OPENAI
    elif not direct and host == CHATGPT:
        provider = None
    else:
        provider = provider_of(path, headers, model) if direct else PROVIDER_HOSTS.get(host)
    if provider is None:
        return None
    base = upstreams.get(provider, DEFAULT_UPSTREAMS[provider])
    if provider == Provider.OPENAI and chatgpt and base == DEFAULT_UPSTREAMS[Provider.OPENAI]:
        base = "https://" + CHATGPT  # its own host; an OpenAI upstream that was set takes both
    if (provider == Provider.GOOGLE and base == DEFAULT_UPSTREAMS[Provider.GOOGLE]
            and urlsplit(path).path.startswith("/v1internal:")):
        # Code Assist lives on its own host; a Gemini upstream that was set (a gateway, a test's
        # provider) takes both.
        base = "https://" + CODE_ASSIST
    # Clients configured with ".../v1" as base URL and upstreams given the same way: one "/v1".
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]
    return Route(provider, protocol_of(path), base + path)


def parse_controls(headers: Mapping[str, str]) -> Controls:
    def off(name: str) -> bool:
        return headers.get(name, "").strip().lower() in ("off", "0", "false", "no")

    at = None
    if raw := headers.get("x-perpetuity-time", "").strip():
        try:
            when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            when = None  # a bad time is ignored, not fatal: the turn is stored at arrival time
        if when is not None:
            at = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    return Controls(
        enabled=not off("x-perpetuity"),
        capture=not off("x-perpetuity-capture"),
        recall=not off("x-perpetuity-recall"),
        tools=not off("x-perpetuity-tools"),
        probe=headers.get("x-perpetuity-probe", "").strip().lower() in ("on", "1", "true", "yes"),
        at=at,
    )


def credential(headers: Mapping[str, str], path: str = "") -> str:
    """The request's key: its header (Gemini's among them), else Gemini's `?key=`, else the
    bearer token (Code Assist's OAuth token too, sent upstream as it came)."""
    key = headers.get("x-api-key") or headers.get("api-key") or headers.get("x-goog-api-key")
    if key:
        return key
    if "key=" in path and (keys := parse_qs(urlsplit(path).query).get("key")):
        return keys[0]
    auth = headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else auth
