"""Comments say why in a line or two; a trial's history goes to docs/tuning.md, where its
tables are kept, not into a comment block of the code (issue 42)."""

from __future__ import annotations

from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "perpetuity_core"
MOST = 6


def long_blocks(text: str) -> list[tuple[int, int]]:
    """(first line, length) of every run of more than MOST comment lines."""
    found, run, start = [], 0, 0
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.lstrip().startswith("#"):
            start = start if run else number
            run += 1
            continue
        if run > MOST:
            found.append((start, run))
        run = 0
    return found


def test_long_blocks_are_found() -> None:
    block = "x = 1\n" + "# why\n" * (MOST + 1) + "y = 2\n    # one\n    # two\n"
    assert long_blocks(block) == [(2, MOST + 1)]
    assert long_blocks("# a\n" * MOST) == []


def test_no_comment_block_is_over_six_lines() -> None:
    over = {str(f.relative_to(CORE)): blocks for f in sorted(CORE.rglob("*.py"))
            if (blocks := long_blocks(f.read_text()))}
    assert over == {}, over
