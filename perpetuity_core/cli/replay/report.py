"""A replay's figures as a readable table, and its cumulative cost as a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perpetuity_core.cli.replay.measure import Tally


def table(report: dict[str, Any]) -> str:
    """What the sessions would have saved, in a sentence (stand-ins said first, where the
    system prompt and tools are not the person's harness's), one row per session and the
    total, what each column means, and where the cost went."""
    t = report["total"]
    rows = []
    if report.get("stand_ins"):
        rows.append(f"Stand-in prompts: {report['template']}; the figures are a guess.")
    rows += [saving(t), ""]
    head = (f"{'session':<16}{'calls':>6}{'prompts':>8}{'$ direct':>11}{'$ Perpetuity':>13}"
            f"{'less':>6}{'tokens direct':>15}{'tokens Perp.':>14}{'refused':>8}{'skipped':>8}"
            f"{'older kept':>11}{'+context':>9}{'live same':>10}")
    rows += [head, "-" * len(head)]
    for s in [*report["sessions"], t]:
        older, context = s["older_history"]["recall"], s["older_history"]["context_recall"]
        money = s["money"]
        rows.append(
            f"{s['name'][:15]:<16}{s['calls']:>6}{s['prompts']:>8}"
            f"{money['direct_usd']:>11,.2f}{money['upstream_usd']:>13,.2f}"
            f"{_less(money['saved'] if money['direct_usd'] else _saved(s['cost'])):>6}"
            f"{s['tokens']['direct']:>15,}{s['tokens']['upstream']:>14,}"
            f"{s['invalid_requests']:>8}{s['skipped_invalid_calls']:>8}"
            f"{_share(older):>11}{_share(context):>9}{_share(s['live_task_identical']):>10}")
    rows += ["", *LEGEND, ""]
    for side in ("direct", "upstream"):
        b = t[side]
        rows.append(f"{SIDE[side]:<19} cost {b['cost']:>12,.0f} = cache read {b['read_cost']:,.0f}"
                    f" + cache write {b['write_cost']:,.0f} + uncached {b['uncached_cost']:,.0f}"
                    " (in uncached input tokens)")
    if "floor" in t:
        causes = ", ".join(f"{cause} {share:.3f}" for cause, share in t["above_floor"].items())
        rows.append(f"{'floor':<19} cost {t['floor']['cost']:>12,.0f} = {t['floor']['ratio']:.3f}"
                    f" of direct (system prompt, tools, live task); above it: {causes}")
    if t["invalid_reasons"]:
        rows.append("refused: " + "; ".join(t["invalid_reasons"]))
    if t["skipped_reasons"]:
        rows.append("skipped: " + "; ".join(t["skipped_reasons"]))
    if not report.get("stand_ins"):
        rows.append(f"system prompt and tools: {report['template']}")
    return "\n".join(rows)


SIDE = {"direct": "direct", "upstream": "through Perpetuity"}
LEGEND = (
    "calls: model calls replayed; prompts: of them, a person's new prompt (the rest are tool"
    " rounds)",
    "$ direct, $ Perpetuity: input at each model's list price, prompt cache included, as the"
    " harness sent each call and as it reached the provider through Perpetuity; less: the saving",
    "tokens: input tokens of every call, summed, each way",
    "refused: requests through Perpetuity the provider would refuse; skipped: calls whose"
    " recorded session is incomplete (not replayed)",
    "older kept: of the file paths and code names a reply used that only older history held,"
    " the share still in its request; +context: with the text around their latest mention",
    "live same: calls whose live task (the latest prompt on) reached the provider unchanged",
)


def saving(t: dict[str, Any]) -> str:
    """The total's saving in one sentence: money where the models have a list price."""
    money, calls = t["money"], f"{t['calls']:,} calls"
    unpriced = (f"; no list price for {', '.join(money['unpriced_models'])}"
                if money["unpriced_models"] else "")
    if money["direct_usd"]:
        return (f"${money['direct_usd']:,.2f} direct, ${money['upstream_usd']:,.2f} through"
                f" Perpetuity, {_less(money['saved']).strip()} less ({calls}, input at each model's"
                f" list price, prompt cache included{unpriced})")
    return (f"{t['cost']['direct']:,.0f} direct, {t['cost']['upstream']:,.0f} through Perpetuity,"
            f" {_less(_saved(t['cost'])).strip()} less ({calls}, in uncached input tokens"
            f"{unpriced})")


def _saved(cost: dict[str, Any]) -> float | None:
    return None if cost["ratio"] is None else 1 - cost["ratio"]


def _less(saved: float | None) -> str:
    return "-" if saved is None else f"{saved:.0%}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


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
