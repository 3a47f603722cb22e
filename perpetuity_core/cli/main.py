"""The `perpetuity` command: one subcommand per job, errors as one clear line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from perpetuity_core.errors import PerpetuityError

# Each module registers its own subcommands: register(subparsers) adds a parser whose
# `func(args) -> int` runs it. Imported lazily so `perpetuity --help` stays fast.
COMMAND_MODULES = ["perpetuity_core.cli.proxy", "perpetuity_core.cli.notes",
                   "perpetuity_core.cli.search", "perpetuity_core.cli.memory",
                   "perpetuity_core.cli.evaluate", "perpetuity_core.cli.replay",
                   "perpetuity_core.cli.show", "perpetuity_core.cli.try_it"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perpetuity", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    import importlib

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return int(args.func(args) or 0)
    except PerpetuityError as e:
        print(f"perpetuity: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
