"""The live tally (memory.storage.savings) as `perpetuity memory stats` shows it: per day and
in total, what the calls through the proxy cost against what they would have cost direct."""

from __future__ import annotations

from typing import Any

from perpetuity_core.memory.storage.savings import Saved

LEGEND = (
    "$ direct: the calls as the harness sent them; $ Perpetuity: as they went upstream (the"
    " recall tools' rounds included); both input only, prompt cache included, at each model's"
    " list price, on one token estimate, so their ratio is the saving (less)",
    "$ reported: what the provider's own usage figures for the calls through Perpetuity come to"
    " at the same prices",
)


def summary(days: list[tuple[str, Saved]]) -> dict[str, Any]:
    total = Saved()
    for _, saved in days:
        total.add(saved)
    return {"days": {day: saved.as_dict() for day, saved in days}, "total": total.as_dict()}


def table(days: list[tuple[str, Saved]]) -> str:
    """A row per day (local time) and the total; cost units where no model has a list price."""
    if not days:
        return "saving: no call through the proxy yet"
    total = Saved()
    for _, saved in days:
        total.add(saved)
    money = total.priced > 0
    unit = "$" if money else "units"
    head = (f"{'day':<12}{'calls':>7}{unit + ' direct':>14}{unit + ' Perpetuity':>18}"
            f"{'less':>6}{unit + ' reported':>16}")
    rows = ["saving: what the calls through Perpetuity cost against sending them direct", head,
            "-" * len(head)]
    for day, s in [*days, ("total", total)]:
        d, u, r = ((s.direct_usd, s.sent_usd, s.reported_usd) if money else
                   (s.direct_cost, s.sent_cost, s.reported_cost))
        saved = s.as_dict()["saved"]
        rows.append(f"{day:<12}{s.calls:>7}{d:>14,.2f}{u:>18,.2f}"
                    f"{'-' if saved is None else f'{saved:.0%}':>6}"
                    f"{f'{r:,.2f}' if s.reported else '-':>16}")
    if money and total.priced < total.calls:
        rows.append(f"{total.calls - total.priced} calls of models without a list price are in"
                    " the calls but not the money")
    return "\n".join([*rows, "", *LEGEND])
