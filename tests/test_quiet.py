"""serve/quiet.py: the chatty loggers at the lowest level a handler reads, in a real mitmdump."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
from mitmproxy import log as mitmlog
from mitmproxy.addons import termlog
from mitmproxy.test import taddons

from perpetuity_core.serve.quiet import NOTHING_READ, Quiet, lowest_read
from tests.conftest import start_proxy, stop_proxy
from tests.fake_provider import FakeProvider, Text


def handler(level: int | str, kind: type[logging.Handler] = logging.Handler) -> logging.Handler:
    h = kind.__new__(kind)
    logging.Handler.__init__(h)
    h.setLevel(level)
    return h


@pytest.mark.parametrize(("handlers", "heard", "lowest"), [
    ([], False, NOTHING_READ),
    ([handler("ERROR", termlog.TermLogHandler)], False, logging.ERROR),
    ([handler("INFO", termlog.TermLogHandler), handler("WARNING")], False, logging.INFO),
    # mitmproxy's own add_log handler reads everything, for its listeners alone.
    ([handler("ERROR", termlog.TermLogHandler), handler(0, mitmlog.LegacyLogEvents)], False,
     logging.ERROR),
    ([handler("ERROR", termlog.TermLogHandler), handler(0, mitmlog.LegacyLogEvents)], True, 0),
    ([handler(0, logging.NullHandler)], False, NOTHING_READ),
    ([handler("ERROR"), handler(0)], False, 0),  # a handler a script installed, reading all
])
def test_lowest_read(handlers: list[logging.Handler], heard: bool, lowest: int) -> None:
    assert lowest_read(handlers, heard) == lowest


def test_a_handler_that_reads_debug_keeps_it_and_done_restores() -> None:
    """mitmweb's and the console's event log is such a handler (eventstore.CallbackLogger)."""
    root = logging.getLogger()
    before = root.level, root.handlers
    reader = handler("INFO")
    root.setLevel(logging.DEBUG)
    root.handlers = [reader]  # pytest's own capture reads everything
    mitm = logging.getLogger("mitmproxy")
    quiet = Quiet()
    try:
        with taddons.context(quiet) as tctx:
            tctx.configure(quiet)
            assert mitm.getEffectiveLevel() == logging.INFO
            reader.setLevel(logging.DEBUG)
            tctx.configure(quiet)
            assert mitm.getEffectiveLevel() == logging.DEBUG
            quiet.done()
            assert mitm.level == logging.NOTSET
    finally:
        root.setLevel(before[0])
        root.handlers = before[1]


PROBE = '''
import logging
OUT = {out!r}
def client_connected(client):
    with open(OUT, "a") as f:
        f.write(f"level {{logging.getLogger('mitmproxy.proxy.server').getEffectiveLevel()}}\\n")
'''
HEARD = '''
def add_log(entry):
    with open(OUT, "a") as f:
        f.write(f"entry {entry.level} {entry.msg}\\n")
'''


@pytest.mark.parametrize("heard", [False, True])
def test_mitmdump_quiet_makes_no_record_nobody_reads(fake: FakeProvider, tmp_path: Path,
                                                     heard: bool) -> None:
    """Under `mitmdump -q` the terminal reads errors only: mitmproxy's per-connection records
    are not made at all. An addon listening to `add_log` still gets every one."""
    out = tmp_path / "probe.txt"
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(out=str(out)) + (HEARD if heard else ""))
    p = start_proxy(tmp_path, fake.url, "-s", str(probe))
    try:
        fake.script(Text("hi"))
        r = httpx.post(p.url + "/v1/messages", headers={"x-api-key": "sk-ant-quiet"}, timeout=30,
                       json={"model": "claude-opus-4-8", "max_tokens": 20,
                             "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200
    finally:
        stop_proxy(p)
    lines = out.read_text().splitlines()
    levels = {int(line.split()[1]) for line in lines if line.startswith("level ")}
    if heard:
        assert levels == {logging.DEBUG}
        assert any(line.startswith("entry info") and "client connect" in line for line in lines)
    else:
        assert levels == {logging.ERROR}
