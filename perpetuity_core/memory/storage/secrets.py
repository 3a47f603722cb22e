"""The credential scan: what looks like an API key, a token, a private key or a password
assignment. The store flags rows with it at capture (m011_secret), and the notes library
refuses a note that holds one.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate, compress

# Shapes of real credentials, each with the lower-case literals one of which every match of it
# holds (secret_kind looks for them first). A match refuses the whole note: a lesson
# never needs the secret.
_SECRET_KEY = r"(?:password|passwd|passphrase|secret|api[_-]?key|auth[_-]?token|access[_-]?token)\b"
_SECRET_WORDS = ("passw", "passphrase", "secret", *(f"{w}{sep}{t}" for w, t in (
    ("api", "key"), ("auth", "token"), ("access", "token")) for sep in ("_", "-", "")))
_LITERAL = r"(?![$<{*%]|[A-Za-z_][A-Za-z0-9_]*[.(\[])[^\s\"'`,;]{6,}"
CREDENTIAL_PATTERNS: tuple[tuple[str, re.Pattern[str], tuple[str, ...]], ...] = (
    ("an Anthropic API key", re.compile(r"\bsk-ant-[A-Za-z0-9_-]{20,}"), ("sk-ant-",)),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-|svcacct-)?[A-Za-z0-9_-]{20,}"), ("sk-",)),
    ("a Stripe secret key", re.compile(r"\b[rs]k_live_[A-Za-z0-9]{16,}"), ("k_live_",)),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), ("akia", "asia")),
    (
        "a GitHub token",
        re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})"),
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    ("a Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}"), ("xox",)),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), ("aiza",)),
    ("a private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"), ("-----begin ",)),
    (
        "a JSON Web Token",
        re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
        ("eyj",),
    ),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{24,}=*"), ("bearer",)),
    # A literal value after password=, secret: "...", api_key: ... and the like. References pass:
    # $VAR, ${VAR}, <placeholder>, ***, %s, and code such as os.environ["X"] or getpass().
    (
        "a password or secret assignment",
        re.compile(rf"(?i){_SECRET_KEY}[\"']?\s*=\s*[\"']?{_LITERAL}"),
        _SECRET_WORDS,
    ),
    (
        "a password or secret assignment",
        # After a colon, prose is common ("password: ask the admin"), so only a quoted value or
        # one with a digit or symbol in it counts.
        re.compile(
            rf"(?i){_SECRET_KEY}[\"']?\s*:\s*"
            rf"(?:[\"']{_LITERAL}|(?=[^\s\"'`,;]*[0-9!@#%^&*+~?]){_LITERAL})"
        ),
        _SECRET_WORDS,
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
        for kind, pattern, _ in CREDENTIAL_PATTERNS:
            if pattern.search(line):
                findings.append(CredentialFinding(kind, field_name, number))
                break  # one finding per line: an sk-ant- key is not also reported as sk-
    return findings


# IGNORECASE matches these letters for i and s, which lower() leaves as they are: folded first,
# a text a pattern matches holds its literal lowered (the rest of Unicode lowers to its match).
_FOLD = str.maketrans({"\u0130": "i", "\u0131": "i", "\u017f": "s"})
_FOLDED = tuple(map(chr, _FOLD))


def _lowered(text: str) -> str:
    # Looked for before translating: str.translate through a mapping costs a microsecond per
    # 200 characters (2.5 us a row of BEAM's turns, averaged), and these letters are rare.
    if text.isascii() or not any(map(text.__contains__, _FOLDED)):
        return text.lower()
    return text.translate(_FOLD).lower()


# A part of every literal above, looked for first: most rows hold none (a substring test is C
# speed, but each costs a call, and the literals are 29). "_" stands for the tokens' prefixes
# (ghp_, k_live_, github_pat_) and api_key's kind; "key" and "token" for apikey's and the like.
_HINTS = ("sk-", "_", "akia", "asia", "xox", "aiza", "-----begin ", "eyj", "bearer", "passw",
          "passphrase", "secret", "key", "token")


# Each literal with the hints it holds: it can be in a text only where they all are.
_NEEDS = {w: frozenset(h for h in _HINTS if h in w)
          for _, _, literals in CREDENTIAL_PATTERNS for w in literals}


def secret_kind(text: str) -> str:
    """The kind of the first credential the scan finds in `text`, else "": scan_credentials'
    first finding, each pattern run only on the lines that hold one of its literals (the
    patterns cost about 50 us a short row and a millisecond per 4 KB, and a long turn about
    code names an api_key or a password on a few of its lines)."""
    low = _lowered(text)
    # map over a bound method runs in C; a generator resumed a frame per hint (15 a row).
    hints = set(compress(_HINTS, map(low.__contains__, _HINTS)))
    if not hints:
        return ""
    # Only the literals whose hints are all there are looked for: a row with "key" in its
    # prose looks for apikey's three spellings, not the 29 (9 us a BEAM row, averaged).
    present = {w for w, needs in _NEEDS.items() if needs <= hints and w in low}
    if not present:
        return ""
    active = [(kind, pattern, present.intersection(literals))
              for kind, pattern, literals in CREDENTIAL_PATTERNS
              if not present.isdisjoint(literals)]
    lines = text.splitlines()
    for i in _lines_holding(low, text, present):
        line = lines[i]
        low = _lowered(line)
        for kind, pattern, literals in active:
            if any(map(low.__contains__, literals)) and pattern.search(line):
                return kind
    return ""


def _lines_holding(low: str, text: str, literals: set[str]) -> list[int]:
    """The indexes of `text.splitlines()` holding one of `literals` (lowered), in order: found
    by searching `low`, the whole text lowered, which keeps every character's place (_FOLD
    takes out the one character that lowers to two), since a long turn has dozens of lines
    and few of them hold one (going through every line was 170 us a long row that held one).
    A literal never spans a line break."""
    starts = list(accumulate(map(len, text.splitlines(keepends=True))))
    found = set()
    for w in literals:
        at = low.find(w)
        while at >= 0:
            i = bisect_right(starts, at)
            found.add(i)
            at = low.find(w, starts[i])
    return sorted(found)
