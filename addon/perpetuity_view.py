"""mitmproxy script that only adds the `perpetuity` contentview, for reading saved flows without
a memory: `mitmdump -nr flows.mitm -s addon/perpetuity_view.py --flow-detail 3`, or
`mitmweb -r flows.mitm -s addon/perpetuity_view.py`."""

import sys
from pathlib import Path

# Works from a checkout whose package is not installed into mitmproxy's environment.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mitmproxy import contentviews

from perpetuity_core.serve.flowview import PerpetuityView

contentviews.add(PerpetuityView)
