#!/usr/bin/env python3
"""Where a late call of a session that never ends spends its request path, against an early one
(issue 22): the six shared Claude Code sessions chained as `perpetuity replay claude-code
--chain --passes 3` chains them (2,034 calls, history to 1.37M tokens), each call through
`Pipeline.prepare` as the replay drives it.

    .venv/bin/python scripts/profile_late.py profile [--window 200] [--out DIR]
        cProfile of the first and the last `window` calls' prepares: DIR/early.pstats,
        DIR/late.pstats, and each one's costliest functions per call as JSON.
    .venv/bin/python scripts/profile_late.py save --at 1900 --out DIR
        the chain replayed up to call 1900 (counted from 0); the pipeline as it stood before
        call 1899 (its memory file, its plans and the bodies it keeps) and calls 1899 and 1900
        saved in DIR.
    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no .venv/bin/python \\
            scripts/profile_late.py count DIR
        the saved pipeline restored (its memory and plans), call 1899 sent (its body read whole
        and kept, warming what the first call after a start reads cold), then call 1900 with
        callgrind collecting inside its prepare alone (a client request through a small C
        library built with cc into a temporary folder).

The plans are pickled: a state saved by one version is read by another while `Plan` and
`Message` are the same classes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import json
import pickle
import pstats
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from perpetuity_core.cli.replay import drive  # noqa: E402
from perpetuity_core.cli.replay.measure import Tally  # noqa: E402
from perpetuity_core.cli.replay.request import load_template  # noqa: E402
from perpetuity_core.cli.replay.sessions import chained, sessions_in_order  # noqa: E402
from perpetuity_core.frame.billing import AnthropicCache  # noqa: E402
from perpetuity_core.memory.schema import open_memory  # noqa: E402
from perpetuity_core.serve.pipeline import Pipeline, Settings  # noqa: E402
from perpetuity_core.wire.conversation import Provider  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "claude-code"
PASSES = 3

_TOGGLE_C = """#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _chain() -> tuple[Any, Any]:
    """The chained session and the template, as `replay --chain --passes 3` makes them."""
    shape = load_template(None)
    sessions = list(sessions_in_order([DATA]))
    return chained(sessions * PASSES), shape


def _replay(session: Any, shape: Any, pipeline: Pipeline, upto: int,
            before: Callable[[int, drive._Side], None] | None = None) -> None:
    """Calls 0 .. `upto` - 1 of the chain through `pipeline`, as drive.claude_code sends them;
    `before(i, side)` runs before call i."""
    side = drive._Side(pipeline)
    tally = Tally("chain", per_call=[])
    direct, upstream, floor = AnthropicCache(), AnthropicCache(), AnthropicCache()
    for i, call in enumerate(session.calls[:upto]):
        if before is not None:
            before(i, side)
        drive._replay_call(side, session, call, shape, tally, set(), direct, upstream, floor)


def _settings(notes: Path) -> Settings:
    return Settings(upstreams={p: "http://127.0.0.1:9" for p in Provider}, notes_root=notes)


def _top(stats: pstats.Stats, calls: int, n: int = 25) -> list[dict[str, Any]]:
    """The `n` functions with the most time of their own, per call, with their cumulative time."""
    rows = []
    for (file, line, name), (_, ncalls, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": round(ncalls / calls, 1),
                     "own_ms": round(tt * 1000 / calls, 3), "cumulative_ms": round(ct * 1000 / calls, 3)})
    return sorted(rows, key=lambda r: -r["own_ms"])[:n]


def profile(args: argparse.Namespace) -> dict[str, Any]:
    session, shape = _chain()
    total = len(session.calls)
    windows = {"early": range(0, args.window), "late": range(total - args.window, total)}
    profiles = {name: cProfile.Profile() for name in windows}
    wall = {name: 0.0 for name in windows}
    prepare = Pipeline.prepare
    at = [0]

    def measured(self: Pipeline, req: Any) -> Any:
        name = next((n for n, w in windows.items() if at[0] in w), None)
        at[0] += 1
        if name is None:
            return prepare(self, req)
        started = time.perf_counter()
        out = profiles[name].runcall(prepare, self, req)
        wall[name] += time.perf_counter() - started
        return out

    args.out.mkdir(parents=True, exist_ok=True)
    Pipeline.prepare = measured  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        store = open_memory(Path(tmp) / "replay.db")
        try:
            _replay(session, shape, Pipeline(store, _settings(Path(tmp) / "notes")), total)
        finally:
            store.close()
    out: dict[str, Any] = {"calls": total}
    for name, p in profiles.items():
        p.dump_stats(args.out / f"{name}.pstats")
        out[name] = {"profiled_ms_per_call": round(wall[name] * 1000 / args.window, 2),
                     "top": _top(pstats.Stats(p), args.window)}
    return out


def save(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline before call `at` - 1, and calls `at` - 1 and `at` as _Side.send gets them."""
    session, shape = _chain()
    args.out.mkdir(parents=True, exist_ok=True)
    sent: list[tuple[Any, ...]] = []
    send = drive._Side.send

    def kept(self: drive._Side, *a: Any) -> Any:
        sent.append(a)
        return send(self, *a)

    tmp = tempfile.TemporaryDirectory()
    db = Path(tmp.name) / "replay.db"

    def before(i: int, side: drive._Side) -> None:
        if i == args.at - 1:
            pipeline = side.pipeline
            with contextlib.closing(sqlite3.connect(db)) as src, \
                    contextlib.closing(sqlite3.connect(args.out / "memory.db")) as copy:
                src.backup(copy)
            with (args.out / "state.pickle").open("wb") as f:
                pickle.dump((pipeline.layout._plans, pipeline.reader.seen, pipeline._shapes), f)
            sent.clear()

    drive._Side.send = kept  # type: ignore[method-assign,assignment]
    with tmp:
        store = open_memory(db)
        try:
            _replay(session, shape, Pipeline(store, _settings(Path(tmp.name) / "notes")),
                    args.at + 1, before)
        finally:
            store.close()
    with (args.out / "calls.pickle").open("wb") as f:
        pickle.dump(sent, f)
    return {"saved": str(args.out), "at": args.at, "calls": len(sent),
            "messages": len(session.calls[args.at].messages)}


@contextlib.contextmanager
def _toggle() -> Iterator[ctypes.CDLL]:
    """Callgrind's instrumentation and collection started and stopped (`start`, `stop`: no-ops
    outside valgrind), so that the rest runs uninstrumented, several times faster."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "toggle.c", Path(tmp) / "toggle.so"
        src.write_text(_TOGGLE_C)
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        yield ctypes.CDLL(str(lib))


def count(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, _toggle() as toggle:
        db = Path(tmp) / "memory.db"
        with contextlib.closing(sqlite3.connect(args.saved / "memory.db")) as src, \
                contextlib.closing(sqlite3.connect(db)) as dst:
            src.backup(dst)
        store = open_memory(db)
        try:
            pipeline = Pipeline(store, _settings(Path(tmp) / "notes"))
            with (args.saved / "state.pickle").open("rb") as f:
                # The bodies it kept are left: the first call reads its body whole and keeps
                # it as the chain had (what it keeps depends on that body alone), so a state
                # saved by other code counts the same calls.
                pipeline.layout._plans, _, pipeline._shapes = pickle.load(f)
            with (args.saved / "calls.pickle").open("rb") as f:
                calls = pickle.load(f)
            side = drive._Side(pipeline)
            side.send(*calls[0])
            prepare = pipeline.prepare

            def counted(req: Any) -> Any:
                toggle.start()
                try:
                    return prepare(req)
                finally:
                    toggle.stop()

            pipeline.prepare = counted  # type: ignore[method-assign]
            started = time.perf_counter()
            side.send(*calls[1])
            return {"prepare_ms": round(side.prepared * 1000, 2),
                    "send_ms": round((time.perf_counter() - started) * 1000, 2),
                    "body_bytes": len(json.dumps(calls[1][2]))}
        finally:
            store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile")
    p.add_argument("--window", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("profile-late"))
    s = sub.add_parser("save")
    s.add_argument("--at", type=int, default=1900)
    s.add_argument("--out", type=Path, default=Path("late-call"))
    c = sub.add_parser("count")
    c.add_argument("saved", type=Path)
    args = ap.parse_args()
    print(json.dumps({"profile": profile, "save": save, "count": count}[args.command](args),
                     indent=1))


if __name__ == "__main__":
    main()
