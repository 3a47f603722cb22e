"""A replay's figures as a readable table, and its cumulative cost as a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perpetuity_core.cli.replay.measure import Tally


def table(report: dict[str, Any]) -> str:
    """One row per session and the total: the figures a person checks first."""
    head = (f"{'session':<16}{'calls':>6}{'prompts':>8}{'tokens direct':>15}{'upstream':>13}"
            f"{'ratio':>7}{'cost direct':>13}{'upstream':>12}{'ratio':>7}{'invalid':>8}"
            f"{'skipped':>8}{'older kept':>11}{'in context':>11}{'live same':>10}")
    rows = [head, "-" * len(head)]
    for s in [*report["sessions"], report["total"]]:
        older = s["older_history"]["recall"]
        context = s["older_history"]["context_recall"]
        rows.append(
            f"{s['name'][:15]:<16}{s['calls']:>6}{s['prompts']:>8}"
            f"{s['tokens']['direct']:>15,}{s['tokens']['upstream']:>13,}{_r(s['tokens']['ratio'])}"
            f"{s['cost']['direct']:>13,.0f}{s['cost']['upstream']:>12,.0f}{_r(s['cost']['ratio'])}"
            f"{s['invalid_requests']:>8}{s['skipped_invalid_calls']:>8}"
            f"{'-' if older is None else f'{older:.0%}':>11}"
            f"{'-' if context is None else f'{context:.0%}':>11}"
            f"{'-' if s['live_task_identical'] is None else f'{s['live_task_identical']:.0%}':>10}")
    t = report["total"]
    rows.append("")
    for side in ("direct", "upstream"):
        b = t[side]
        rows.append(f"{side:<9} cost {b['cost']:>12,.0f} = cache read {b['read_cost']:,.0f}"
                    f" + cache write {b['write_cost']:,.0f} + uncached {b['uncached_cost']:,.0f}"
                    " (units of one uncached input token)")
    if "floor" in t:
        causes = ", ".join(f"{cause} {share:.3f}" for cause, share in t["above_floor"].items())
        rows.append(f"floor     cost {t['floor']['cost']:>12,.0f} = {t['floor']['ratio']:.3f} of"
                    f" direct (system prompt, tools, live task); above it: {causes}")
    if t["invalid_reasons"]:
        rows.append("invalid: " + "; ".join(t["invalid_reasons"]))
    if t["skipped_reasons"]:
        rows.append("skipped: " + "; ".join(t["skipped_reasons"]))
    rows.append(f"request template: {report['template']}")
    return "\n".join(rows)


def _r(value: float | None) -> str:
    return f"{'-' if value is None else f'{value:.2f}':>7}"


PLOT_SESSIONS = 8  # beyond this many sessions one line pair for the total reads better


def plot(sessions: list[Tally], path: Path) -> None:
    """Cumulative cost over the calls, direct (dashed) against through the proxy: one line pair
    per session, or for the total (calls laid end to end) when there are many sessions."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    if len(sessions) > PLOT_SESSIONS:
        sessions = [_end_to_end(sessions)]
    fig, ax = plt.subplots(figsize=(10, 6))
    for n, s in enumerate(sessions):
        color = f"C{n % 10}"
        ax.plot(s.direct_curve, linestyle="--", color=color, label=f"{s.name[:15]} direct")
        ax.plot(s.upstream_curve, color=color, label=f"{s.name[:15]} through the proxy")
    ax.set_xlabel("call")
    ax.set_ylabel("cumulative cost (uncached input tokens)")
    ax.set_title("What each session cost: direct against through Perpetuity")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _end_to_end(sessions: list[Tally]) -> Tally:
    total = Tally("total")
    for s in sessions:
        base_d = total.direct_curve[-1] if total.direct_curve else 0.0
        base_u = total.upstream_curve[-1] if total.upstream_curve else 0.0
        total.direct_curve += [base_d + c for c in s.direct_curve]
        total.upstream_curve += [base_u + c for c in s.upstream_curve]
    return total
