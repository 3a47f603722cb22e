"""One adapter per wire protocol, each translating to and from the neutral conversation model
behind the `Adapter` interface (base.py)."""

from perpetuity_core.wire.conversation import Protocol
from perpetuity_core.wire.protocols import anthropic, chat, gemini, responses
from perpetuity_core.wire.protocols.base import Adapter

ADAPTERS: dict[Protocol, Adapter] = {
    Protocol.ANTHROPIC: anthropic,
    Protocol.CHAT: chat,
    Protocol.RESPONSES: responses,
    Protocol.GEMINI: gemini,
}
