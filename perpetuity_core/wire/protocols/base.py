"""The interface every protocol adapter offers: what the pipeline, the relay and the importers
call, whatever the wire format. An adapter is a module; mypy checks each against `Adapter`
(wire.protocols.ADAPTERS is typed with it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from perpetuity_core.wire.conversation import Message, ParsedRequest, Reply
from perpetuity_core.wire.sse import Event


def spliced(raw: list[Any], keep_from: int, inserts: Mapping[int, list[Message]] | None,
            render: Callable[[list[Message]], list[dict[str, Any]]]) -> list[Any]:
    """The raw messages from `keep_from` on, each of `inserts` (raw index -> messages),
    rendered by the adapter, just before the message at its index."""
    out: list[Any] = []
    for i in range(keep_from, len(raw)):
        out += render((inserts or {}).get(i, []))
        out.append(raw[i])
    return out


@dataclass(frozen=True, slots=True)
class CacheRule:
    """How a provider's prompt cache bills a request's prefix, in units of one uncached input
    token: nothing shorter than `min_tokens` is cached; a cached prefix is read at `read`,
    written at `write`, and lives `ttl` seconds from its last use."""

    min_tokens: int
    read: float
    write: float
    ttl: float


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


class BodyMergerBase:
    """Rounds of whole (not streamed) reply bodies merged into the one the client sees: the
    first round's fields, the last round's ending, the usage of every round summed. A protocol
    says what a round is (`_take`) and how the merged body reads (`finish`)."""

    USAGE: tuple[str, ...] = ()  # the usage counters summed over rounds
    USAGE_FIELD = "usage"  # the body's field that holds them

    def __init__(self, ours: frozenset[str]) -> None:
        self.ours = ours
        self.first: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}
        self.visible: list[dict[str, Any]] = []
        self.usage = dict.fromkeys(self.USAGE, 0)

    def feed_body(self, body: dict[str, Any]) -> None:
        self.first = self.first or body
        self.last = body
        self._take(body)
        for key in self.usage:
            self.usage[key] += int((body.get(self.USAGE_FIELD) or {}).get(key) or 0)

    def _take(self, body: dict[str, Any]) -> None:
        raise NotImplementedError


class StreamMergerBase:
    """Rounds of a streamed reply merged into the one stream the client sees: our tools' calls
    hidden, every other block, call or item keeping its place, renumbered consecutively across
    rounds (the SDKs index them by it). A protocol says how its events read (`feed`) and how
    the merged stream ends (`finish`)."""

    def __init__(self, ours: frozenset[str]) -> None:
        self.ours = ours
        self.next_index = 0
        self._new_round()

    def _new_round(self) -> None:
        self.hidden: set[int] = set()  # this round's upstream indexes of our calls
        self.remap: dict[int, int] = {}  # this round's upstream index -> the client's

    def _renumbered(self, index: int) -> int:
        """The client's index for this round's upstream `index` (the next free one if new)."""
        if index not in self.remap:
            self.remap[index] = self.next_index
            self.next_index += 1
        return self.remap[index]

    def next_round(self) -> None:
        self._new_round()


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

    # `known`: an earlier request of this wire whose history's first `reused` raw entries are
    # this body's, the same objects (wire.seen): what it read of them is taken as it read it,
    # and only the rest is read. `standing`: the request's `raw_standing` (None: looked for).
    def parse_request(self, body: dict[str, Any], known: ParsedRequest | None = None,
                      reused: int = 0) -> ParsedRequest: ...
    def replace_history(self, body: dict[str, Any], frame: list[Message], keep_from: int,
                        inserts: Mapping[int, list[Message]] | None = None,
                        standing: Sequence[int] | None = None) -> dict[str, Any]: ...
    def check(self, body: dict[str, Any]) -> list[str]: ...
    def reply_from_body(self, body: dict[str, Any]) -> Reply: ...
    def render_text(self, text: str, model: str, stream: bool, reply_id: str) -> bytes: ...
    def add_tools(self, body: dict[str, Any], tools: list[dict[str, Any]],
                  last_round: bool) -> dict[str, Any]: ...
    def continue_body(self, body: dict[str, Any], assistant: Any,
                      results: list[tuple[str, str]]) -> dict[str, Any]: ...
    def ping(self) -> bytes: ...
    def error_event(self, message: str) -> bytes: ...
