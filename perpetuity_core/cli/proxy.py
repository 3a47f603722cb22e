"""`perpetuity proxy`: start mitmdump with the Perpetuity addon."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from perpetuity_core.errors import ConfigError
from perpetuity_core.memory.storage.location import where
from perpetuity_core.memory.storage.store import default_db_path

# Inside the package, so an installed wheel runs the proxy too (not imported here: it builds the addon).
ADDON_SCRIPT = Path(__file__).resolve().parent.parent / "serve" / "script.py"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy", help="run the memory proxy (mitmdump with the addon)",
                       description="Run the memory proxy. Arguments it does not know go to mitmdump.")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    # Memory answers whoever reaches the port: only this machine, unless asked otherwise.
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--tenants", choices=("personal", "credential"), default=None,
                   help="personal: one memory for whoever reaches the port; credential: one per"
                   " API key (default: personal on loopback only, credential otherwise)")
    p.add_argument("--db", default=None, help=f"memory database (default {default_db_path()})")
    p.add_argument("--anthropic-upstream", default=None, help="where Anthropic traffic goes")
    p.add_argument("--openai-upstream", default=None, help="where OpenAI traffic goes")
    p.add_argument("--gemini-upstream", default=None, help="where Gemini traffic goes")
    p.set_defaults(func=run, accepts_extra=True)


def mitmdump_path() -> str:
    """The mitmdump beside this Python (the project's venv), else on PATH."""
    if not ADDON_SCRIPT.exists():
        raise ConfigError(f"addon script not found at {ADDON_SCRIPT}; reinstall the package")
    exe = Path(sys.executable).with_name("mitmdump")
    mitmdump = str(exe) if exe.exists() else shutil.which("mitmdump")
    if not mitmdump:
        raise ConfigError("mitmdump not found; install the project with its dependencies")
    return mitmdump


def mitmdump_command(args: argparse.Namespace) -> list[str]:
    mitmdump = mitmdump_path()
    if args.db:
        where(args.db)  # a URL the store cannot open is refused here, in one line
    cmd = [mitmdump, "-s", str(ADDON_SCRIPT), "--listen-host", args.host,
           "--listen-port", str(args.port)]
    for option, value in (("perpetuity_db", args.db), ("perpetuity_tenants", args.tenants),
                          ("perpetuity_anthropic_upstream", args.anthropic_upstream),
                          ("perpetuity_openai_upstream", args.openai_upstream),
                          ("perpetuity_gemini_upstream", args.gemini_upstream)):
        if value:
            cmd += ["--set", f"{option}={value}"]
    return cmd + list(args.extra)


def run(args: argparse.Namespace) -> int:
    cmd = mitmdump_command(args)
    os.execv(cmd[0], cmd)
    return 0  # not reached: execv replaces this process
