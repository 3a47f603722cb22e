"""The proxy's addons and their options: each option read by a pure parse_* function, and an
option change rebuilds only what it affects (the store, the scanner, the pipeline, the relay's
timeout), through mitmproxy's own option machinery."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from perpetuity_core.errors import ConfigError
from perpetuity_core.frame.cap import Cap
from perpetuity_core.serve import script
from perpetuity_core.serve.client_reads import LargeReads
from perpetuity_core.serve.codex_socket import CodexSocket
from perpetuity_core.serve.heap import LargeBlocks
from perpetuity_core.serve.http_path import HttpPath
from perpetuity_core.serve.quiet import Quiet
from perpetuity_core.serve.settle import Settle
from perpetuity_core.serve.startup import Startup, parse_ceiling, parse_settings, parse_share_pool
from perpetuity_core.wire.conversation import Provider
from tests.addons import Perpetuity


def test_the_script_lists_one_addon_per_concern_sharing_one_state() -> None:
    addons = script.make()
    assert [type(a) for a in addons] == [Startup, LargeReads, LargeBlocks, HttpPath, CodexSocket,
                                         Settle, Quiet]
    shared = {id(a.shared) for a in addons if hasattr(a, "shared")}
    assert len(shared) == 1


@pytest.mark.parametrize(("text", "pooled"), [
    ("", frozenset()),
    ("anonymous", frozenset({"anonymous"})),
    (" key-ab , anonymous,", frozenset({"key-ab", "anonymous"})),
])
def test_share_pool_parses_tenant_names(text: str, pooled: frozenset[str]) -> None:
    assert parse_share_pool(text) == pooled


@pytest.mark.parametrize("text", ["true", "key-ab,yes", "off"])
def test_share_pool_refuses_a_switch(text: str) -> None:
    with pytest.raises(ValueError, match="names the tenants"):
        parse_share_pool(text)


def test_ceiling_below_the_floor_is_refused() -> None:
    assert parse_ceiling(3_000) == Cap(ceiling=3_000)
    with pytest.raises(ValueError, match=f"at least {Cap().floor}"):
        parse_ceiling(Cap().floor - 1)


def _options(**changed: object) -> SimpleNamespace:
    o = dict(perpetuity_share_pool="", perpetuity_anthropic_upstream="https://a.test",
             perpetuity_openai_upstream="https://o.test", perpetuity_gemini_upstream="https://g.test",
             perpetuity_frame_ceiling=5_000, perpetuity_notes_dir="/tmp/notes", perpetuity_tools=True,
             perpetuity_tool_rounds=0, perpetuity_notes_capture=True,
             perpetuity_trust_identity=False)
    return SimpleNamespace(**{**o, **changed})


def test_settings_come_from_the_options_alone() -> None:
    s = parse_settings(_options(), personal=True)
    assert s.upstreams[Provider.OPENAI] == "https://o.test"
    assert (s.tool_rounds, s.notes_root, s.personal) == (1, Path("/tmp/notes"), True)
    assert s == parse_settings(_options(), personal=True)  # compared, not rebuilt, on a change
    with pytest.raises(ConfigError, match="http"):
        parse_settings(_options(perpetuity_openai_upstream="ftp://o.test"), personal=True)


def test_an_option_change_rebuilds_only_what_it_affects(tmp_path: Path) -> None:
    addon = Perpetuity()
    startup = addon.addons[0]
    with taddons.context(*addon.addons) as tctx:
        tctx.configure(startup, perpetuity_db=str(tmp_path / "m.db"))
        store, pipeline = addon.store, addon.pipeline
        scanner = pipeline.scanner

        tctx.configure(startup, perpetuity_tool_timeout=7)  # the relay's alone
        assert addon.relay.tool_timeout == 7
        assert (addon.store, addon.pipeline) == (store, pipeline)

        tctx.configure(startup, perpetuity_frame_ceiling=3_000)  # the pipeline, not its scanner
        assert addon.pipeline is not pipeline and addon.pipeline.settings.limits.ceiling == 3_000
        assert addon.pipeline.scanner is scanner and addon.store is store
        pipeline = addon.pipeline

        tctx.configure(startup, perpetuity_frame_ceiling=3_000)  # no change: nothing made
        assert addon.pipeline is pipeline

        tctx.configure(startup, perpetuity_share_pool="anonymous")  # who sees whose rows
        assert addon.pipeline.scanner is not scanner and addon.store is store
        pipeline = addon.pipeline

        with pytest.raises(exceptions.OptionsError):  # serving: refused, the old value stands
            addon.shared.serving = True
            tctx.configure(startup, perpetuity_frame_ceiling=10)
        assert addon.pipeline is pipeline and tctx.options.perpetuity_frame_ceiling == 3_000
        addon.executor.submit(store.close).result()
