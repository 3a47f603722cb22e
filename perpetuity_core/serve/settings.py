"""How a deployment serves: the options the addon (or an evaluation) gives the pipeline."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from perpetuity_core.frame.cap import Cap
from perpetuity_core.wire.conversation import Provider


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """How a deployment serves: what the addon's options give the pipeline (the defaults are
    the proxy's own)."""

    upstreams: Mapping[Provider, str]  # where each provider's traffic goes
    tools: bool = True  # the recall tools ride along (x-perpetuity-tools: off, per request)
    tool_rounds: int = 4  # upstream rounds one reply may take for the recall tools
    notes_root: Path | None = None  # the notes library (each tenant's under it)
    notes_capture: bool = True  # note_capture and /perpetuity-curate through us
    limits: Cap = Cap()
    # True pools every user (offline evaluation); a set of tenants pools the users of those
    # tenants with each other (the proxy); False, each user sees their own.
    share_pool: bool | frozenset[str] = False
    trust_identity: bool = False  # claimed identities are authenticated upstream of us (identity)
    # A personal proxy (identity.tenancy): every request is one person's, and so is every row
    # already in the file (old credential tenants, imports): one memory, nothing re-keyed.
    personal: bool = False
    semantic: bool = True  # the scan's semantic half (bm25.Params.semantic); off to compare
