"""The breadth-sized cap: how many tokens of memory a question gets.

The budget follows how the retrieval scores are spread, never which row ranks where. One clear
best match means a narrow question: a small frame. Many matches scoring close to the best mean a
broad one (a question across many conversations or topics): a larger frame, up to the ceiling.

Breadth is the effective number of good matches among the top scores, the participation ratio
(sum s)^2 / sum s^2 over the scores at least BREADTH_FLOOR of the best. It is 1 for one clear
match and k for k equal ones, and grows as good matches multiply or draw level with the best.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BREADTH_FLOOR = 0.5  # scores below half the best do not count as good matches
BREADTH_TOP = 50  # the matches the statistic looks at
BREADTH_FULL = 12.0  # this many equally good matches earn the whole ceiling


@dataclass(frozen=True, slots=True)
class Cap:
    """Frame budgets in tokens. The defaults are LoCoMo's best trade measured (mean frame
    3.8k tokens of 22k-token histories); the ceiling is a deployment option."""

    floor: int = 1_000
    ceiling: int = 5_000
    # The largest request that goes upstream, everything in it (frame/plan.py): below Claude
    # Code's own compaction threshold (its 200k window less its reserve), so a harness whose
    # history grows without end is never refused, where going direct it would have compacted.
    bound: int = 150_000


def breadth(scores: np.ndarray) -> float:
    s = np.sort(np.asarray(scores, np.float64))[::-1][:BREADTH_TOP]
    if s.size == 0 or s[0] <= 0:
        return 0.0
    good = s[s >= BREADTH_FLOOR * s[0]]
    return float(good.sum() ** 2 / (good ** 2).sum())


def budget(scores: np.ndarray, cap: Cap) -> int:
    """Tokens of memory for a question whose retrieval scored `scores`."""
    b = breadth(scores)
    if b == 0.0:
        return cap.floor
    share = min(1.0, (b - 1.0) / (BREADTH_FULL - 1.0))
    return int(cap.floor + share * (cap.ceiling - cap.floor))
