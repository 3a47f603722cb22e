"""`perpetuity show FLOW_FILE`: what the model saw, for each flow of a saved flow file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mitmproxy import exceptions, http, io

from perpetuity_core.cli.words import counted
from perpetuity_core.errors import PerpetuityError
from perpetuity_core.serve.flowview import FACTS, ROUND, view_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print what the model saw, for each flow of a saved flow file",
                       description="Print the perpetuity view of every flow Perpetuity touched in "
                       "a flow file saved with `perpetuity proxy -w FILE` (or mitmdump/mitmweb).")
    p.add_argument("flow_file", type=Path, help="a mitmproxy flow file")
    p.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    path: Path = args.flow_file
    try:
        with path.open("rb") as fo:
            flows = list(io.FlowReader(fo).stream())
    except OSError as e:
        raise PerpetuityError(f"cannot read {path}: {e.strerror or e}") from e
    except exceptions.FlowReadException as e:
        raise PerpetuityError(_unreadable(path, e)) from e
    shown = 0
    for flow in flows:
        if not isinstance(flow, http.HTTPFlow) or not (
                FACTS in flow.metadata or ROUND in flow.metadata):
            continue
        rule = "=" * 78
        sys.stdout.write(f"{rule}\nflow {flow.id}  {flow.request.method} {flow.request.url}"
                         f"  {flow.response.status_code if flow.response else 'no response'}\n"
                         f"{rule}\n{view_text(flow)}\n")
        shown += 1
    if not shown:
        raise PerpetuityError(f"no flow in {path} went through Perpetuity ({counted(len(flows), 'flow')})")
    return 0


def _unreadable(path: Path, e: Exception) -> str:
    """mitmproxy reads a file that opens with JSON as HAR, and says only that it is no HAR."""
    with path.open("rb") as fo:
        json_like = fo.read(64).lstrip()[:1] in (b"{", b"[")
    if json_like:
        return (f"{path} is JSON but not a HAR file; `perpetuity show` reads flows saved with"
                " `perpetuity proxy -w FILE` (or a HAR export)")
    return f"{path} is not a mitmproxy flow file: {e}"
