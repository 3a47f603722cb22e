"""The interface every protocol adapter offers: what the pipeline, the relay and the importers
call, whatever the wire format. An adapter is a module; mypy checks each against `Adapter`
(wire.protocols.ADAPTERS is typed with it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from perpetuity_core.wire.conversation import Message, ParsedRequest, Reply
from perpetuity_core.wire.sse import Event


class Assembler(Protocol):
    """Rebuilds the reply from the protocol's event stream."""

    def feed(self, ev: Event) -> None: ...
    def reply(self) -> Reply: ...


class Merger(Protocol):
    """Splits a reply round into our tools' calls (run inside the proxy) and everything else
    (passed to the client as one reply across rounds)."""

    def our_calls(self) -> list[tuple[str, str, Any]]: ...
    def others_called(self) -> bool: ...
    def assistant_blocks(self) -> Any: ...  # the round's assistant turn, in the wire's shape
    def next_round(self) -> None: ...
    def finish(self) -> bytes: ...


class StreamMerging(Merger, Protocol):
    def feed(self, name: str, data: dict[str, Any]) -> bytes: ...


class BodyMerging(Merger, Protocol):
    def feed_body(self, body: dict[str, Any]) -> None: ...


class Adapter(Protocol):
    """One wire format, translated to and from the neutral model in wire.conversation."""

    @property
    def ReplyAssembler(self) -> Callable[[], Assembler]: ...  # noqa: N802 - the module's class
    @property
    def StreamMerger(self) -> Callable[[frozenset[str]], StreamMerging]: ...  # noqa: N802
    @property
    def BodyMerger(self) -> Callable[[frozenset[str]], BodyMerging]: ...  # noqa: N802

    def parse_request(self, body: dict[str, Any]) -> ParsedRequest: ...
    def replace_history(self, body: dict[str, Any], frame: list[Message], keep_from: int,
                        inserts: Mapping[int, list[Message]] | None = None) -> dict[str, Any]: ...
    def check(self, body: dict[str, Any]) -> list[str]: ...
    def reply_from_body(self, body: dict[str, Any]) -> Reply: ...
    def render_text(self, text: str, model: str, stream: bool, reply_id: str) -> bytes: ...
    def add_tools(self, body: dict[str, Any], tools: list[dict[str, Any]],
                  last_round: bool) -> dict[str, Any]: ...
    def continue_body(self, body: dict[str, Any], assistant: Any,
                      results: list[tuple[str, str]]) -> dict[str, Any]: ...
    def ping(self) -> bytes: ...
    def error_event(self, message: str) -> bytes: ...
