"""The chatty loggers kept at the lowest level a handler reads, so no record is made for nobody.

mitmproxy sets the root logger to DEBUG and lets each handler choose (tools/main.py), and it
installs a handler of its own (log.LegacyLogEvents) that takes every record, formats it and
queues the deprecated `add_log` event onto the event loop, whether or not an addon listens. So
every debug and info record mitmproxy's proxy server makes per connection and flow, and peewee's
per query, was made, formatted and dispatched across every addon only to be dropped: under
`mitmdump -q` (the terminal reads errors only) that was most of what the proxy's own logging
cost a request. `Quiet` raises those loggers to the lowest level any handler would read;
whatever a handler reads is still delivered (mitmweb's and the console's event log, the
terminal at its `termlog_verbosity`, an addon with `add_log`, a handler a script installed).
The handlers are looked at again on `running` and on every `configure`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from mitmproxy import addonmanager, ctx
from mitmproxy import log as mitmlog

# Loggers that make records per request: mitmproxy's connections and flows, peewee's queries
# (PostgreSQL), our own.
QUIETED = ("mitmproxy", "peewee", "perpetuity")
NOTHING_READ = logging.CRITICAL + 1


def lowest_read(handlers: Iterable[logging.Handler], add_log_heard: bool) -> int:
    """The lowest level any of `handlers` reads. mitmproxy's `add_log` handler reads for its
    listeners alone, a NullHandler for nobody; a handler at NOTSET reads everything."""
    levels = [h.level for h in handlers
              if not isinstance(h, logging.NullHandler)
              and (add_log_heard or not isinstance(h, mitmlog.LegacyLogEvents))]
    return min(levels, default=NOTHING_READ)


def handlers_of(name: str) -> list[logging.Handler]:
    """Every handler a record of `name` or a logger under it can reach: the root's, the
    logger's own and those of the loggers under it (their records pass through it)."""
    found = list(logging.getLogger().handlers)
    for other, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (other == name or other.startswith(name + ".")):
            found += logger.handlers
    return found


class Quiet:
    def __init__(self) -> None:
        self.saved: dict[str, tuple[int, int]] = {}  # name: (own level, effective level) before

    def running(self) -> None:
        self.adjust()

    def configure(self, updated: set[str]) -> None:
        self.adjust()

    def done(self) -> None:
        for name, (own, _) in self.saved.items():
            logging.getLogger(name).setLevel(own)
        self.saved.clear()

    def adjust(self) -> None:
        heard = any(callable(getattr(a, "add_log", None))
                    for a in addonmanager.traverse(ctx.master.addons.chain))
        for name in QUIETED:
            logger = logging.getLogger(name)
            own, floor = self.saved.setdefault(name, (logger.level, logger.getEffectiveLevel()))
            # Never below the level mitmproxy (or whoever embeds it) left: no record it did not make.
            wanted = max(lowest_read(handlers_of(name), heard), floor)
            logger.setLevel(own if wanted == floor else wanted)
