"""The live tally of what the proxy saves: per day, provider and model, what the captured calls
cost as the harness sent them (direct) and as they went upstream, billed under the prompt-cache
rules (frame.billing), and what the provider reported for them (serve.tally computes each
call's figures; this keeps their sums).

A call adds to its row in one upsert on the store's writer thread, beside its capture. Costs
are in units of one uncached input token and in dollars at the model's list price then
(frame.prices; 0 for a model the list does not know, counted in `priced` = 0 calls).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from perpetuity_core.memory.storage.dialect import SQL, Sql
from perpetuity_core.memory.storage.store import Database


@dataclass(slots=True)
class Saved:
    """One call's figures, or their sum over a day or in total."""

    calls: int = 0
    priced: int = 0  # calls of a model with a list price
    direct_tokens: int = 0
    sent_tokens: int = 0
    direct_cost: float = 0.0
    sent_cost: float = 0.0
    direct_usd: float = 0.0
    sent_usd: float = 0.0
    reported: int = 0  # calls whose reply reported its usage
    reported_cost: float = 0.0
    reported_usd: float = 0.0

    def add(self, other: Saved) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: round(v, 4) if isinstance(v := getattr(self, f.name), float)
                               else v for f in fields(self)}
        out["saved"] = (round(1 - self.sent_usd / self.direct_usd, 4) if self.direct_usd else
                        round(1 - self.sent_cost / self.direct_cost, 4) if self.direct_cost else
                        None)
        return out


COLUMNS = tuple(f.name for f in fields(Saved))


def m018_savings(db: Database) -> None:
    """The live tally's table (memory.storage.savings): a row per day, provider and model."""
    db.connection().execute(db.legacy(
        "CREATE TABLE saving (day TEXT NOT NULL, provider TEXT NOT NULL, model TEXT NOT NULL,"
        + "".join(f" {c} {'REAL' if c.endswith(('cost', 'usd')) else 'INTEGER'} NOT NULL"
                  " DEFAULT 0," for c in COLUMNS)
        + " PRIMARY KEY (day, provider, model)) WITHOUT ROWID"))


_ADD = SQL.both(
    f"INSERT INTO saving (day, provider, model, {', '.join(COLUMNS)}) VALUES (?, ?, ?"
    f"{', ?' * len(COLUMNS)}) ON CONFLICT (day, provider, model) DO UPDATE SET "
    + ", ".join(f"{c} = saving.{c} + excluded.{c}" for c in COLUMNS))


def add(db: Database, day: str, provider: str, model: str, saved: Saved) -> None:
    """Add one call's figures to its day's row (the store's writer)."""
    with db.writing("tally what a call saved", ordered=False) as conn:
        conn.execute(db.pick(_ADD), (day, provider, model,
                                     *(getattr(saved, c) for c in COLUMNS)))


def by_day(conn: Sql) -> list[tuple[str, Saved]]:
    """Every day's sums, oldest first (a command's read, in SQLite's dialect translated)."""
    rows = conn.execute(f"SELECT day, {', '.join(f'sum({c})' for c in COLUMNS)} FROM saving"
                        " GROUP BY day ORDER BY day").fetchall()
    return [(day, _summed(values)) for day, *values in rows]


def _summed(values: list[Any]) -> Saved:
    """A row of sums as Saved (PostgreSQL's sums come back as numeric)."""
    saved = Saved()
    for c, v in zip(COLUMNS, values):
        setattr(saved, c, type(getattr(saved, c))(v or 0))
    return saved
