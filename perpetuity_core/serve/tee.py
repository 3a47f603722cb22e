"""The reply read as it streams to the client: a copy of its bytes, decoded (SSE or one JSON
body, gzip or deflate), assembled into a neutral Reply to store. Both paths use it: mitmproxy's
stream (the addon) and the relay's tool loop. It never raises: what it cannot read is forwarded
as it came, and only its storing is given up."""

from __future__ import annotations

import json
import logging
import zlib

from perpetuity_core.serve.exchange import Job
from perpetuity_core.wire.conversation import Reply
from perpetuity_core.wire.protocols import ADAPTERS
from perpetuity_core.wire.sse import SSEDecoder

log = logging.getLogger("perpetuity")

READABLE_ENCODINGS = "gzip, deflate"  # what ReplyTee can read of a reply


class ReplyTee:
    """Reads a copy of the reply bytes into a neutral Reply. Never raises."""

    def __init__(self, job: Job, content_encoding: str) -> None:
        self.adapter = ADAPTERS[job.protocol]
        self.stream = job.stream
        self.failed = False
        self._sse = SSEDecoder()
        self._assembler = self.adapter.ReplyAssembler()
        self._body = bytearray()
        self._unread: list[bytes] = []  # chunks passed on to be read later (`defer`)
        enc = content_encoding.strip().lower()
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32) if enc in ("gzip", "deflate") else None
        if enc not in ("", "identity", "gzip", "deflate"):
            self.failed = True  # an encoding we cannot read: forward it, store no reply

    def defer(self, chunk: bytes) -> None:
        """Keep `chunk` to read later (`catch_up`), so that reading it never delays it; the
        next feed, or the reply, reads it first."""
        self._unread.append(chunk)

    def catch_up(self) -> None:
        """Read the chunks deferred, in their order."""
        unread, self._unread = self._unread, []
        for chunk in unread:
            self._read(chunk)

    def feed(self, chunk: bytes) -> None:
        if self._unread:
            self.catch_up()
        self._read(chunk)

    def _read(self, chunk: bytes) -> None:
        if self.failed:
            return
        try:
            if self._inflate is not None:
                chunk = self._inflate.decompress(chunk)
            if self.stream:
                for ev in self._sse.feed(chunk):
                    self._assembler.feed(ev)
            else:
                self._body += chunk
        except Exception:
            log.exception("perpetuity: could not read the reply; it is forwarded but not stored")
            self.failed = True

    def reply(self) -> Reply | None:
        self.catch_up()
        if self.failed:
            return None
        try:
            if self.stream:
                return self._assembler.reply()
            return self.adapter.reply_from_body(json.loads(bytes(self._body)))
        except Exception:
            log.exception("perpetuity: could not assemble the reply")
            return None
