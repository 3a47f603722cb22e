"""The mitmproxy addon: the only module that imports mitmproxy.

It fails open: if anything in the memory pipeline raises, the request goes upstream exactly as the
client sent it (routed, when the client addressed us as its base URL) and the error is logged.
Changes to a flow are applied all at once, after everything they depend on succeeded, because
mitmproxy catches hook exceptions and carries on with whatever state the flow was left in.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mitmproxy import ctx, exceptions, http

from . import capture
from .conversation import Provider, Reply
from .errors import PerpetuityError
from .pipeline import Decision, HttpRequest, Job, Pipeline
from .relay import JOB_HEADER, Relay
from .route import DEFAULT_UPSTREAMS, PROVIDER_HOSTS, parse_upstream
from .store import Store, default_db_path

log = logging.getLogger("perpetuity")


class Perpetuity:
    def __init__(self) -> None:
        self.store: Store | None = None
        self.pipeline: Pipeline | None = None
        self.relay = Relay(self._store_reply)
        # One thread owns the store: SQLite has one writer, and the event loop never waits on disk.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-store")
        # Requests are parsed on their own thread, so a request never queues behind a write.
        self.parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perpetuity-parse")

    def load(self, loader: Any) -> None:
        loader.add_option("perpetuity_db", str, str(default_db_path()),
                          "SQLite file holding the memory ($PERPETUITY_DB overrides the default).")
        loader.add_option("perpetuity_anthropic_upstream", str, DEFAULT_UPSTREAMS[Provider.ANTHROPIC],
                          "Where Anthropic traffic goes (scheme://host[:port]).")
        loader.add_option("perpetuity_openai_upstream", str, DEFAULT_UPSTREAMS[Provider.OPENAI],
                          "Where OpenAI traffic goes (scheme://host[:port]).")

    def configure(self, updated: set[str]) -> None:
        keys = {"perpetuity_db", "perpetuity_anthropic_upstream", "perpetuity_openai_upstream"}
        if not updated & keys:
            return
        try:
            upstreams = {
                Provider.ANTHROPIC: parse_upstream(ctx.options.perpetuity_anthropic_upstream),
                Provider.OPENAI: parse_upstream(ctx.options.perpetuity_openai_upstream),
            }
            if "perpetuity_db" in updated or self.store is None:
                self.store = self.executor.submit(self._open, ctx.options.perpetuity_db).result()
        except PerpetuityError as e:
            raise exceptions.OptionsError(str(e)) from e
        self.pipeline = Pipeline(self.store, upstreams)

    def _open(self, path: str) -> Store:
        if self.store is not None:
            self.store.close()
        return Store(path)

    async def running(self) -> None:
        await self.relay.start()
        host = ctx.options.listen_host or "127.0.0.1"
        port = ctx.options.listen_port or 8080
        print(
            f"perpetuity: listening on http://{host}:{port}, memory in {ctx.options.perpetuity_db}\n"
            f"  Claude Code / Anthropic SDK: ANTHROPIC_BASE_URL=http://{host}:{port}\n"
            f"  OpenAI SDK / opencode:       OPENAI_BASE_URL=http://{host}:{port}/v1\n"
            f"  Codex (~/.codex/config.toml): [model_providers.perpetuity] base_url = "
            f"\"http://{host}:{port}/v1\", wire_api = \"responses\"\n"
            f"  any other harness: HTTPS_PROXY=http://{host}:{port} with the mitmproxy CA trusted",
            flush=True,
        )

    async def done(self) -> None:
        await self.relay.stop()
        if self.store is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.store.close)
        self.executor.shutdown(wait=False)
        self.parser.shutdown(wait=False)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live or self.pipeline is None:
            return
        req = HttpRequest(
            method=flow.request.method,
            host=flow.request.pretty_host,
            path=flow.request.path,
            headers=tuple(flow.request.headers.items(multi=True)),
            body=flow.request.raw_content or b"",
            direct=self._is_direct(flow),
        )
        loop = asyncio.get_running_loop()
        try:
            decision = await loop.run_in_executor(self.parser, self.pipeline.prepare, req)
        except Exception:
            log.exception("perpetuity: pipeline failed; forwarding the request untouched")
            decision = self.pipeline.route_only(req)
        self._apply(flow, decision)

    def _is_direct(self, flow: http.HTTPFlow) -> bool:
        """Did the client address us (a base URL) rather than a host through us?"""
        if flow.request.pretty_host in PROVIDER_HOSTS:
            return False
        sockname = flow.client_conn.sockname
        return bool(sockname) and flow.request.port == sockname[1]

    def _apply(self, flow: http.HTTPFlow, d: Decision) -> None:
        token = ""
        if d.job and self.pipeline:
            # Not awaited: the turn is written while the request is already on its way upstream.
            d.job.turn = self.executor.submit(self.pipeline.store_turn, d.job.pending)
            token = self.relay.submit(d.job)
        for name in d.strip:
            del flow.request.headers[name]
        if token:
            flow.request.scheme, flow.request.host, flow.request.port = "http", "127.0.0.1", self.relay.port
            flow.request.headers[JOB_HEADER] = token
        elif d.route:
            flow.request.url = d.route.upstream_url
        if d.route:
            flow.metadata["perpetuity"] = {
                "upstream": d.route.upstream_url,
                "note": d.note,
                "user": d.identity.user if d.identity else "",
                "conversation": d.identity.conversation if d.identity else "",
            }

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if "perpetuity" in flow.metadata and flow.response is not None:
            flow.response.stream = True  # no buffering: every chunk goes to the client as it comes

    def response(self, flow: http.HTTPFlow) -> None:
        self._restore(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._restore(flow)

    def _restore(self, flow: http.HTTPFlow) -> None:
        """Show the real destination in mitmweb, not the relay."""
        meta = flow.metadata.get("perpetuity")
        if meta and JOB_HEADER in flow.request.headers:
            del flow.request.headers[JOB_HEADER]
            flow.request.url = meta["upstream"]

    def _store_reply(self, job: Job, reply: Reply, at: float) -> None:
        """Queue the reply behind its request on the store's thread (FIFO: one writer, in order)."""
        store, turn = self.store, job.turn
        if store is None or turn is None:
            return

        def write() -> None:
            try:
                capture.record_reply(store, turn.result(), reply, at)
            except Exception:
                log.exception("perpetuity: could not store the reply")

        self.executor.submit(write)
