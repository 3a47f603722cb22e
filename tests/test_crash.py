"""Crash safety, the short version of scripts/kill_loop.py: a real proxy ingesting two
conversations at full speed is killed with SIGKILL three times at random moments; every
restart leaves `memory check` clean, and every turn is stored exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kill_9_while_ingesting_stores_every_turn_exactly_once() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "kill_loop.py"), "--kills", "3",
                          "--seed", "7", "--max-gap", "1.0"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["user_turns"] > 6 and r["replies"] == r["user_turns"]
    assert r["check_violations"] == []
    for key in ("user_twice", "user_lost", "replies_twice", "replies_lost", "partial_messages",
                "out_of_order"):
        assert r[key] == 0, (key, r)
