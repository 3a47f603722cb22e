"""mitmproxy script: `mitmdump -s addon/perpetuity.py`. All logic lives in perpetuity_core."""

import sys
from pathlib import Path

# Works from a checkout whose package is not installed into mitmproxy's environment.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from perpetuity_core.serve.script import addons  # noqa: E402, F401
