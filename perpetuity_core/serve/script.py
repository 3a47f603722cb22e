"""The mitmproxy script of the installed package: `mitmdump -s <this file>` (what `perpetuity
proxy` runs); addon/perpetuity.py is the same for a checkout."""

from perpetuity_core.serve.addon import Perpetuity
from perpetuity_core.serve.quiet import Quiet

addons = [Perpetuity(), Quiet()]
