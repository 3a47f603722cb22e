"""Start-up and shutdown: the options that say which memory and how it serves, the memory
opened and its pipeline made from them, the address a harness is given, and everything let go
at the end (`Serving.stop`).

An option change rebuilds only what it affects: the store only when `perpetuity_db` names
another file (refused once serving), the scanner (its arena, read again whole) only with the
store or with who shares whose rows, the pipeline only when its `Settings` differ. Each option
is read by a pure `parse_*` function; a bad one is one line, at start-up or when changed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mitmproxy import ctx, exceptions
from mitmproxy.proxy.mode_specs import ProxyMode

from perpetuity_core.errors import PerpetuityError
from perpetuity_core.frame.cap import Cap
from perpetuity_core.memory.schema import open_memory
from perpetuity_core.memory.storage.location import where
from perpetuity_core.memory.storage.store import Store, default_db_path
from perpetuity_core.notes.library import notes_root
from perpetuity_core.serve.drain import BOUND as DRAIN_BOUND
from perpetuity_core.serve.pipeline import Pipeline
from perpetuity_core.serve.serving import Serving
from perpetuity_core.serve.settings import Settings
from perpetuity_core.wire import identity
from perpetuity_core.wire.conversation import Provider
from perpetuity_core.wire.route import DEFAULT_UPSTREAMS, parse_upstream

log = logging.getLogger("perpetuity")

_TENANCY_OPTIONS = frozenset({"perpetuity_tenants", "listen_host", "mode"})
_SETTINGS_OPTIONS = frozenset({
    "perpetuity_anthropic_upstream", "perpetuity_openai_upstream", "perpetuity_gemini_upstream",
    "perpetuity_tools", "perpetuity_notes_dir", "perpetuity_frame_ceiling",
    "perpetuity_share_pool", "perpetuity_tool_rounds", "perpetuity_trust_identity",
    "perpetuity_notes_capture"})
_OPTIONS = _TENANCY_OPTIONS | _SETTINGS_OPTIONS | {"perpetuity_db"}
_TENANCY = {identity.PERSONAL: "one person's memory, whatever the key: whoever can reach the "
                              "port reads it",
            identity.CREDENTIAL: "a memory per credential; `perpetuity memory tenants join` "
                                "joins one person's"}


def parse_share_pool(text: str) -> frozenset[str]:
    """The tenants whose users see each other's memory, from a comma-separated list."""
    pooled = frozenset(t.strip() for t in text.split(",") if t.strip())
    if pooled & {"true", "false", "1", "0", "yes", "no", "on", "off"}:
        raise ValueError("perpetuity_share_pool names the tenants that pool their memory "
                         "(comma-separated key-<hash> or anonymous); it no longer shares with "
                         "everyone")
    return pooled


def parse_ceiling(ceiling: int) -> Cap:
    if ceiling < Cap().floor:
        raise ValueError(f"perpetuity_frame_ceiling must be at least {Cap().floor}")
    return Cap(ceiling=ceiling)


def parse_settings(o: Any, personal: bool) -> Settings:
    """The pipeline's `Settings` from the options; ValueError (ConfigError for an upstream)
    names a bad one."""
    pooled = parse_share_pool(o.perpetuity_share_pool)
    upstreams = {
        Provider.ANTHROPIC: parse_upstream(o.perpetuity_anthropic_upstream),
        Provider.OPENAI: parse_upstream(o.perpetuity_openai_upstream),
        Provider.GOOGLE: parse_upstream(o.perpetuity_gemini_upstream),
    }
    limits = parse_ceiling(o.perpetuity_frame_ceiling)
    notes_dir = o.perpetuity_notes_dir
    return Settings(
        upstreams=upstreams, tools=o.perpetuity_tools, tool_rounds=max(1, o.perpetuity_tool_rounds),
        notes_root=Path(notes_dir).expanduser() if notes_dir else notes_root(),
        notes_capture=o.perpetuity_notes_capture, limits=limits, share_pool=pooled,
        trust_identity=o.perpetuity_trust_identity, personal=personal)


def parse_tenancy(o: Any) -> str:
    """`personal` or `credential` (identity.tenancy), from the setting and the listen addresses."""
    return identity.tenancy(o.perpetuity_tenants, listening(o))


def listening(o: Any) -> list[str]:
    """Every address the proxy listens on (each mode's own, else listen_host; "" is all)."""
    hosts = []
    for spec in o.mode:
        try:
            hosts.append(ProxyMode.parse(spec).listen_host(o.listen_host))
        except ValueError:
            hosts.append("")  # mitmproxy refuses it anyway; never taken for loopback
    return hosts


def scanner_kept(old: Pipeline | None, store: Store, settings: Settings) -> bool:
    """Can a new pipeline keep the old one's scanner: the same store, the same sharing?"""
    return (old is not None and old.store is store
            and old.settings.share_pool == settings.share_pool
            and old.settings.personal == settings.personal)


class Startup:
    """Opens the memory and makes its pipeline from the options; prints where to point a
    harness; lets everything go at shutdown. A bad option at start-up is logged as one line
    (mitmdump then exits); while serving, the change is refused and the old value stands."""

    def __init__(self, shared: Serving) -> None:
        self.shared = shared

    def load(self, loader: Any) -> None:
        loader.add_option("perpetuity_db", str, str(default_db_path()),
                          "SQLite file (a path or sqlite:///path) holding the memory ($PERPETUITY_DB overrides the default).")
        loader.add_option("perpetuity_anthropic_upstream", str, DEFAULT_UPSTREAMS[Provider.ANTHROPIC],
                          "Where Anthropic traffic goes (scheme://host[:port]).")
        loader.add_option("perpetuity_openai_upstream", str, DEFAULT_UPSTREAMS[Provider.OPENAI],
                          "Where OpenAI traffic goes (scheme://host[:port]).")
        loader.add_option("perpetuity_gemini_upstream", str, DEFAULT_UPSTREAMS[Provider.GOOGLE],
                          "Where Gemini traffic goes (scheme://host[:port]); left as it is, "
                          "Code Assist's goes to its own host.")
        loader.add_option("perpetuity_notes_dir", str, "",
                          "The notes library (default: $PERPETUITY_NOTES_DIR, a repository's "
                          ".perpetuity/, else ~/.claude/perpetuity/).")
        loader.add_option("perpetuity_frame_ceiling", int, Cap().ceiling,
                          "The largest frame of memory a request gets, in tokens; a narrow "
                          "question gets less (the breadth-sized cap).")
        loader.add_option("perpetuity_share_pool", str, "",
                          "Tenants whose users see each other's memory (own rows ranked first), "
                          "comma-separated (key-<hash>, anonymous); empty, each user sees only "
                          "their own.")
        loader.add_option("perpetuity_trust_identity", bool, False,
                          "Trust x-perpetuity-user and the harnesses' identity fields across "
                          "credentials: only behind a gateway that authenticates them. Off, "
                          "every identity is scoped under its request's credential.")
        loader.add_option("perpetuity_tenants", str, "",
                          "personal: every credential is one person's and reaches one memory "
                          "(with every row already stored); credential: a tenant per credential. "
                          "Empty: personal when every listen address is loopback, else credential.")
        loader.add_option("perpetuity_notes_capture", bool, True,
                          "Offer note_capture and answer /perpetuity-curate through the proxy.")
        loader.add_option("perpetuity_tool_rounds", int, 4,
                          "Upstream rounds one reply may take for the recall tools; the last "
                          "round must answer.")
        loader.add_option("perpetuity_drain", int, int(DRAIN_BOUND),
                          "Seconds a stop (SIGTERM, SIGINT) waits for the replies in flight to "
                          "finish and be stored, no longer accepting; then they are stored as "
                          "far as they came.")
        loader.add_option("perpetuity_tools", bool, True,
                          "Offer the recall tools; their loop runs in the relay. Off, replies "
                          "stream on mitmproxy's own path (x-perpetuity-tools: off, per request).")

    def configure(self, updated: set[str]) -> None:
        if "perpetuity_drain" in updated:
            self.shared.drain.bound = max(0, ctx.options.perpetuity_drain)
        try:
            self._configure(updated)
        except exceptions.OptionsError as e:
            if self.shared.serving:
                raise
            # At start-up mitmproxy prints an error raised from a script's configure with its
            # traceback, and exits on any error logged: logged, the cause is one line.
            log.error("perpetuity: %s", e)

    def _configure(self, updated: set[str]) -> None:
        if not updated & _OPTIONS:
            return
        s, o = self.shared, ctx.options
        try:
            moved = ("perpetuity_db" in updated and s.store is not None
                     and where(o.perpetuity_db) != s.store.path)
            if moved and s.serving and s.store is not None:
                # The preparing thread's reads would stay on the old file while writes went to
                # the new one: one memory split in two.
                raise exceptions.OptionsError(
                    f"perpetuity_db cannot change while running (memory is in {s.store.shown}); "
                    "restart the proxy to use another file")
            tenancy = (parse_tenancy(o) if updated & _TENANCY_OPTIONS or s.pipeline is None
                       else s.tenancy)
            settings = parse_settings(o, tenancy == identity.PERSONAL)
            if s.store is None or moved:  # before serving: the file given at start-up
                s.store = s.executor.submit(self._open, o.perpetuity_db).result()
        except (PerpetuityError, ValueError) as e:
            raise exceptions.OptionsError(str(e)) from e
        s.tenancy = tenancy
        old = s.pipeline
        if old is not None and old.store is s.store and old.settings == settings:
            return
        kept = scanner_kept(old, s.store, settings)
        s.pipeline = Pipeline(s.store, settings, old.scanner if kept and old else None)
        if not kept:
            # On the store's thread, where the store is closed (`_open`, `Serving.stop`): never
            # under a catch-up still reading (a connection closed from another thread
            # mid-statement crashed the process). The loop goes on; writes queue behind it.
            s.executor.submit(s.pipeline.warm)

    def _open(self, path: str) -> Store:
        if self.shared.store is not None:
            self.shared.store.close()
        return open_memory(path)

    async def running(self) -> None:
        s = self.shared
        s.serving = True
        if "web_columns" in ctx.options and "comment" not in ctx.options.web_columns:
            # mitmweb: each flow's one-line summary in the flow list.
            ctx.options.update(web_columns=[*ctx.options.web_columns, "comment"])
        await s.relay.start()
        host = ctx.options.listen_host or "127.0.0.1"
        port = ctx.options.listen_port or 8080
        print(
            f"perpetuity: listening on http://{host}:{port}, memory in {s.store.shown if s.store else ''}\n"
            f"  Claude Code / Anthropic SDK: ANTHROPIC_BASE_URL=http://{host}:{port}\n"
            f"  OpenAI SDK / opencode:       OPENAI_BASE_URL=http://{host}:{port}/v1\n"
            f"  gemini-cli / Google GenAI SDK: GOOGLE_GEMINI_BASE_URL=http://{host}:{port}\n"
            f"  Codex (~/.codex/config.toml): openai_base_url = \"http://{host}:{port}/v1\"; "
            f"signed in with ChatGPT, HTTPS_PROXY=http://{host}:{port} with "
            f"CODEX_CA_CERTIFICATE=~/.mitmproxy/mitmproxy-ca-cert.pem\n"
            f"  any other harness: HTTPS_PROXY=http://{host}:{port} with the mitmproxy CA trusted",
            flush=True,
        )
        print(f"perpetuity: tenants: {s.tenancy} ({_TENANCY[s.tenancy]})", flush=True)
        if s.store is not None and s.store.notice:
            print(f"perpetuity: {s.store.notice}", flush=True)

    async def done(self) -> None:
        await self.shared.stop(_stop_accepting)  # once the replies in flight drained


async def _stop_accepting() -> None:
    """Close every listening socket; the connections they accepted go on."""
    if (server := ctx.master.addons.get("proxyserver")) is not None:
        await server.servers.update([])
