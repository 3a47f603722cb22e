"""Capture: store what is new in a request, then the reply, each message in one transaction.

Harnesses re-send the whole history on every request. A message is recognised as already stored
by its pair key, a digest of (previous message, this message): it survives a harness rewriting or
dropping older turns (resume, compaction) and still tells a second "yes" after a different
question from the first. Everything after the last recognised message is new. Recognition counts
occurrences (issue 41): a pair the history holds n times is stored n times, the stored copies
standing for its first occurrences; and a reply is recognised by its content alone (its
predecessor rewritten) only after a message the store holds, so that a run of "ok" replies to
turns a full disk refused does not stand in for those turns.

A message the same as the one just before it is that message sent again, not a new one: a
harness keeps a turn whose reply never came (the proxy died, the connection broke) and the same
text goes again as the next message. It takes its copy's pair key, so it is stored once, whether
its copy was stored before the failure or both arrive in one request (issue 20: keyed as
following its copy, it looked new, and a proxy killed 12 times stored a dozen turns twice).
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from perpetuity_core.memory.storage import names
from perpetuity_core.memory.storage.store import Store
from perpetuity_core.wire.conversation import Message, Reply


@dataclass(frozen=True, slots=True)
class TurnContext:
    """What the reply needs to be stored beside the request that asked for it."""

    user_id: int
    conversation_id: int
    provider: str
    model: str
    at: float
    after: str  # fingerprint of the last message the request sent
    history: Sequence[Message] = ()  # what the request sent, read again when its reply comes


def pair_key(previous_fingerprint: str, message: Message) -> str:
    return _pair(previous_fingerprint, message.fingerprint())


@functools.lru_cache(maxsize=1 << 16)
def _pair(previous: str, this: str) -> str:
    # Every request re-sends the history: each pair is digested once, not once per request.
    return hashlib.blake2b((previous + ":" + this).encode(), digest_size=16).hexdigest()


TAIL = 16


def _keys(messages: Sequence[Message], start: int = 0) -> list[str]:
    """The pair keys of `messages[start:]`; a message sent again right after itself repeats its
    copy's. Digested from the first of the copies that end at `start`, not from the first
    message: a late call of a long session keys its tail, not its history."""
    first = start
    while first and messages[first].fingerprint() == messages[first - 1].fingerprint():
        first -= 1
    prev = messages[first - 1].fingerprint() if first else ""
    keys: list[str] = []
    for m in messages[first:]:
        this = m.fingerprint()
        keys.append(keys[-1] if keys and this == prev else _pair(prev, this))
        prev = this
    return keys[start - first:]


def after_itself(pair_key: str, fingerprint: str) -> bool:
    """Was this stored message keyed as following a copy of itself? The mark of a turn sent
    again and stored twice before _keys knew it (memory check reports it)."""
    return pair_key == _pair.__wrapped__(fingerprint, fingerprint)


def follows(pair_key: str, previous: str, fingerprint: str) -> bool:
    """Was this stored message keyed as following the message stored just before it?"""
    return pair_key == _pair.__wrapped__(previous, fingerprint)


def new_messages(store: Store, conversation_id: int, messages: Sequence[Message]) -> list[int]:
    """Indexes of the messages the store has not seen in this conversation.

    An assistant message in a request is history the harness re-sends, so it is recognised by
    its own fingerprint too: after a compaction its predecessor changes, the reply does not.
    """
    return list(_new(store, conversation_id, messages))


def _new(store: Store, conversation_id: int, messages: Sequence[Message]) -> dict[int, str]:
    """The messages the store has not seen in this conversation (new_messages), by index, each
    with its pair key."""

    def last_known(start: int, keys: list[str]) -> int:
        tail = range(start, len(messages))
        stored, replies = store.known(
            conversation_id, [(messages[i].fingerprint(), keys[i - start]) for i in tail],
            [messages[i].fingerprint() for i in tail if messages[i].role == "assistant"])
        if not stored and not replies:
            return -1
        # A pair said n times in the history is stored n times: the first stored copies are its
        # first occurrences, so a second "Continue" answered alike is not taken for the first.
        # A reply's words are counted so too (how many assistant messages hold them).
        seen_keys, seen_replies = _occurrences(
            messages[:start], {messages[i].fingerprint() for i in tail}, stored, replies)
        last, before = -1, True  # `before`: the message before is one the store holds
        for i in tail:
            if i and messages[i].fingerprint() == messages[i - 1].fingerprint():
                continue  # a copy sent again is not another occurrence (_keys)
            key, message = keys[i - start], messages[i]
            known = seen_keys[key] < stored[key]
            seen_keys[key] += 1
            if message.role == "assistant":
                # A reply re-sent keyed after another message (its predecessor rewritten: a
                # resume, a compaction) is the one stored with its words, where the store holds
                # as many or where it follows a message the store holds; a run of "ok" replies
                # to turns a full disk refused is neither (issue 41).
                fingerprint = message.fingerprint()
                known |= before and fingerprint in replies or (
                    seen_replies[fingerprint] < replies[fingerprint])
                seen_replies[fingerprint] += 1
            if known:
                last = i
            before = known
        return last

    # Usually only the newest turn is new: look at the tail first (and key it alone), the whole
    # history only when nothing there is known (a first contact, a rewritten history).
    start = max(0, len(messages) - TAIL)
    keys = _keys(messages, start)
    last = last_known(start, keys)
    if last < 0 and start:
        start, keys = 0, _keys(messages)
        last = last_known(0, keys)
    # A message whose key repeats the one before it is its copy sent again (see _keys); the
    # one before is keyed too, since `last` is at or after `start`.
    return {i: keys[i - start] for i in range(last + 1, len(messages))
            if not (i > start and keys[i - start] == keys[i - start - 1])}


def _occurrences(before: Sequence[Message], wanted: set[str], keys: Counter[str],
                 replies: Counter[str]) -> tuple[Counter[str], Counter[str]]:
    """How often the history before the tail holds these stored pair keys and assistant
    fingerprints; a pair is digested only for a message with one of the tail's fingerprints
    (`wanted`), so a late call of a long session pays a set lookup a message."""
    seen_keys: Counter[str] = Counter()
    seen_replies: Counter[str] = Counter()
    fingerprints = [m.fingerprint() for m in before]
    for i in [i for i, f in enumerate(fingerprints) if f in wanted]:
        this, prev = fingerprints[i], fingerprints[i - 1] if i else ""
        if this == prev:
            continue  # a copy sent again (_keys)
        if (key := _pair(prev, this)) in keys:
            seen_keys[key] += 1
        if before[i].role == "assistant" and this in replies:
            seen_replies[this] += 1
    return seen_keys, seen_replies


def record(
    store: Store,
    *,
    user_key: str,
    conversation_key: str,
    provider: str,
    model: str,
    messages: Sequence[Message],
    times: Sequence[float],
    source: str,
    folder: str = "",
) -> tuple[list[int], TurnContext]:
    """Store the new messages of a request (or an imported history); returns their ids. The
    conversation is named by its first prompt and the `folder` its harness works in, once."""
    user_id = store.user_id(user_key)
    conversation_id = store.conversation_id(user_id, conversation_key, provider)
    store.name_conversation(conversation_id, opening=names.opening(messages), folder=folder)
    ids = [
        store.add_message(
            conversation_id=conversation_id,
            user_id=user_id,
            message=messages[i],
            provider=provider,
            model=model,
            at=times[i],
            pair_key=key,
            source=source,
        ).message_id
        for i, key in _new(store, conversation_id, messages).items()
    ]
    after = messages[-1].fingerprint() if messages else ""
    return ids, TurnContext(user_id, conversation_id, provider, model,
                            times[-1] if times else 0.0, after, messages)


def record_reply(store: Store, turn: TurnContext, reply: Reply, at: float) -> int | None:
    """Store the assistant's reply; an empty one (a stream cut before any content) is not a turn,
    nor one the store holds already at this place more often than the history does: the same
    request sent again (a client's retry, a second chat opening with the same words) got the
    same answer, and the history holds it once."""
    if not reply.message.parts:
        return None
    key = pair_key(turn.after, reply.message)
    copies = store.copies(turn.conversation_id, reply.message.fingerprint(), key)
    if copies and copies > _held(turn.history, key, reply.message.fingerprint()):
        return None  # (the history read only when a copy is stored: seldom)
    return store.add_message(
        conversation_id=turn.conversation_id,
        user_id=turn.user_id,
        message=reply.message,
        provider=turn.provider,
        model=turn.model,
        at=at,
        pair_key=key,
        source="reply",
        usage=reply.usage,
        stop_reason=reply.stop_reason,
        complete=reply.complete,
    ).message_id


def _held(history: Sequence[Message], key: str, fingerprint: str) -> int:
    """How often `history` holds this message at the place `key` names (copies sent again
    counted once, as _keys keys them)."""
    held = 0
    for i in [i for i, m in enumerate(history) if m.fingerprint() == fingerprint]:
        prev = history[i - 1].fingerprint() if i else ""
        held += prev != fingerprint and _pair(prev, fingerprint) == key
    return held
