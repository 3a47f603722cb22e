"""The mitmproxy script of the installed package: `mitmdump -s <this file>` (what `perpetuity
proxy` runs); addon/perpetuity.py is the same for a checkout. The addons share one `Serving`
and run in this order on every hook: start-up before the rest, the HTTP path's end of a flow
before inspection settles it."""

from perpetuity_core.serve.client_reads import LargeReads
from perpetuity_core.serve.codex_socket import CodexSocket
from perpetuity_core.serve.heap import LargeBlocks
from perpetuity_core.serve.http_path import HttpPath
from perpetuity_core.serve.quiet import Quiet
from perpetuity_core.serve.serving import Serving
from perpetuity_core.serve.settle import Settle
from perpetuity_core.serve.startup import Startup


def make() -> list[object]:
    """The proxy's addons, sharing one memory and its threads."""
    shared = Serving()
    return [Startup(shared), LargeReads(), LargeBlocks(), HttpPath(shared), CodexSocket(shared), Settle(), Quiet()]


addons = make()
