"""The proxy's addons as serve/script.py makes them, driven as mitmproxy drives them: each hook
called on every addon that has it, in their order. All but Quiet, which raises the loggers'
levels pytest's caplog reads (tests/test_quiet.py drives it)."""

from __future__ import annotations

import inspect
from typing import Any

from perpetuity_core.serve import script
from perpetuity_core.serve.quiet import Quiet
from perpetuity_core.serve.serving import Serving


class Perpetuity:
    def __init__(self) -> None:
        self.addons = [a for a in script.make() if not isinstance(a, Quiet)]
        self.shared: Serving = self.addons[0].shared  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shared, name)  # store, pipeline, relay, executor, parser

    async def _hook(self, name: str, *args: Any) -> None:
        for addon in self.addons:
            if (hook := getattr(addon, name, None)) is not None and inspect.isawaitable(
                    done := hook(*args)):
                await done

    def _sync(self, name: str, *args: Any) -> None:
        for addon in self.addons:
            if (hook := getattr(addon, name, None)) is not None:
                hook(*args)

    async def request(self, flow: Any) -> None:
        await self._hook("request", flow)

    def responseheaders(self, flow: Any) -> None:
        self._sync("responseheaders", flow)

    async def response(self, flow: Any) -> None:
        await self._hook("response", flow)

    async def error(self, flow: Any) -> None:
        await self._hook("error", flow)

    async def websocket_message(self, flow: Any) -> None:
        await self._hook("websocket_message", flow)

    def websocket_end(self, flow: Any) -> None:
        self._sync("websocket_end", flow)

    async def running(self) -> None:
        await self._hook("running")

    async def done(self) -> None:
        await self._hook("done")
