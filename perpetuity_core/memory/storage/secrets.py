"""The credential scan: what looks like an API key, a token, a private key or a password
assignment. The store flags rows with it at capture (m011_secret), and the notes library
refuses a note that holds one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Shapes of real credentials. A match refuses the whole note: a lesson never needs the secret.
_SECRET_KEY = r"(?:password|passwd|passphrase|secret|api[_-]?key|auth[_-]?token|access[_-]?token)\b"
_LITERAL = r"(?![$<{*%]|[A-Za-z_][A-Za-z0-9_]*[.(\[])[^\s\"'`,;]{6,}"
CREDENTIAL_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an Anthropic API key", re.compile(r"\bsk-ant-[A-Za-z0-9_-]{20,}")),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-|svcacct-)?[A-Za-z0-9_-]{20,}")),
    ("a Stripe secret key", re.compile(r"\b[rs]k_live_[A-Za-z0-9]{16,}")),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    (
        "a GitHub token",
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})"),
    ),
    ("a Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    (
        "a JSON Web Token",
        re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    ),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{24,}=*")),
    # A literal value after password=, secret: "...", api_key: ... and the like. References pass:
    # $VAR, ${VAR}, <placeholder>, ***, %s, and code such as os.environ["X"] or getpass().
    (
        "a password or secret assignment",
        re.compile(rf"(?i){_SECRET_KEY}[\"']?\s*=\s*[\"']?{_LITERAL}"),
    ),
    (
        "a password or secret assignment",
        # After a colon, prose is common ("password: ask the admin"), so only a quoted value or
        # one with a digit or symbol in it counts.
        re.compile(
            rf"(?i){_SECRET_KEY}[\"']?\s*:\s*"
            rf"(?:[\"']{_LITERAL}|(?=[^\s\"'`,;]*[0-9!@#%^&*+~?]){_LITERAL})"
        ),
    ),
)


@dataclass(frozen=True)
class CredentialFinding:
    kind: str
    field: str
    line: int


def scan_credentials(text: str, field_name: str = "text") -> list[CredentialFinding]:
    """Where a text looks like it holds a credential (kind, field and line, never the value)."""
    findings = []
    for number, line in enumerate(text.splitlines() or [text], start=1):
        for kind, pattern in CREDENTIAL_PATTERNS:
            if pattern.search(line):
                findings.append(CredentialFinding(kind, field_name, number))
                break  # one finding per line: an sk-ant- key is not also reported as sk-
    return findings


# Lower-case literals at least one of which every CREDENTIAL_PATTERNS match contains: a text
# holding none is clean without running the patterns (a substring test is C speed; the patterns
# cost about 50 us a short row and a millisecond per 4 KB).
_TRIGGERS = ("sk-", "k_live_", "akia", "asia", "ghp_", "gho_", "ghu_", "ghs_", "ghr_",
             "github_pat_", "xox", "aiza", "-----begin", "eyj", "bearer", "pass", "secret",
             "api", "auth", "access")


def secret_kind(text: str) -> str:
    """The kind of the first credential the scan finds in `text`, else ""."""
    low = text.lower()
    if not any(t in low for t in _TRIGGERS):
        return ""
    findings = scan_credentials(text)
    return findings[0].kind if findings else ""

