"""One adapter per wire protocol, each translating to and from the neutral conversation model.

Each module offers `parse_request(body) -> ParsedRequest`, `reply_from_body(body) -> Reply` and a
`ReplyAssembler` that rebuilds the reply from the protocol's event stream.
"""

from types import ModuleType

from ..conversation import Protocol
from . import anthropic, chat, responses

ADAPTERS: dict[Protocol, ModuleType] = {
    Protocol.ANTHROPIC: anthropic,
    Protocol.CHAT: chat,
    Protocol.RESPONSES: responses,
}
