"""Dates a question names, as the span of stored time it asks about.

"What did Jolene ask Deb on 13 March, 2023?" is about what was said that day, whether or not
the turn repeats any of the question's words; the retrieval ranks the rows said then first
(see frame_read.search). Absolute dates are read in the forms people write them (13 March 2023,
March 13th, 2023, 2023-03-13, March 2023, in 2023, in March); relative ones (today, yesterday,
last week, last month, on Tuesday, last Friday, 3 days ago, two weeks ago) count back from when
the question is asked and are read only where no absolute date is named, since "last week, as
mentioned on 6 November" means the week before that date, not this one.

Stored times are UTC and the asker's time zone is unknown, so a named day also takes in the day
either side of it. Nothing here is fuzzy beyond that: no date named, no window.
"""

from __future__ import annotations

import calendar
import re
from datetime import UTC, datetime, timedelta

Window = tuple[float, float]  # [start, end) in epoch seconds

_MONTHS = {m.lower(): i for i, m in enumerate(calendar.month_name) if m}
_MONTHS |= {m.lower(): i for i, m in enumerate(calendar.month_abbr) if m and m != "May"}
_MONTH = "(" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_YEAR = r"((?:19|20)\d\d)"
_SLACK = timedelta(days=1)  # the asker's day may start or end a day off UTC's

_DAY_MONTH_YEAR = re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE)
_MONTH_DAY_YEAR = re.compile(rf"\b{_MONTH}\s+{_DAY},?\s+{_YEAR}\b", re.IGNORECASE)
# A date with a time of day after it is a log line's timestamp, not a day asked about.
_ISO_DAY = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b(?![T ]\d{1,2}:)")
_MONTH_YEAR = re.compile(rf"\b{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE)
# A month or a year alone must follow a preposition: "May I" and "2048 tokens" are no dates.
_IN_MONTH = re.compile(rf"\b(?:in|during|of|since|early|mid|late)[\s-]+{_MONTH}\b(?!\s*\d)", re.IGNORECASE)
_IN_YEAR = re.compile(rf"\b(?:in|during|of)\s+{_YEAR}\b(?!-)", re.IGNORECASE)
_RELATIVE = re.compile(r"\b(today|yesterday|last\s+week|last\s+month)\b", re.IGNORECASE)
_WEEKDAYS = {d.lower(): i for i, d in enumerate(calendar.day_name)}
_WEEKDAY = re.compile(r"\b(on|last)\s+(" + "|".join(_WEEKDAYS) + r")\b", re.IGNORECASE)
_NUMBERS = {w: n for n, w in enumerate(["zero", "a", "two", "three", "four", "five", "six", "seven",
                                          "eight", "nine", "ten", "eleven", "twelve"])} | {"one": 1}
_AGO = re.compile(r"\b(\d{1,3}|" + "|".join(_NUMBERS) + r")\s+(day|week|month)s?\s+ago\b",
                  re.IGNORECASE)


def window(text: str, asked_at: float) -> Window | None:
    """The span of time `text` names (all the dates it names, first to last), or None."""
    now = datetime.fromtimestamp(asked_at, UTC)
    spans = [s for s in (*_days(text), *_months(text, now), *_years(text)) if s is not None]
    if not spans:
        spans = [_relative(m[1].lower(), now) for m in _RELATIVE.finditer(text)]
        spans += [_weekday(m[1].lower(), _WEEKDAYS[m[2].lower()], now)
                  for m in _WEEKDAY.finditer(text)]
        spans += [_ago(m[1].lower(), m[2].lower(), now) for m in _AGO.finditer(text)]
    if not spans:
        return None
    return min(a for a, _ in spans).timestamp(), max(b for _, b in spans).timestamp()


Span = tuple[datetime, datetime]


def _days(text: str) -> list[Span | None]:
    found: list[tuple[str, int | str, str]] = [
        (m[3], _MONTHS[m[2].lower()], m[1]) for m in _DAY_MONTH_YEAR.finditer(text)]
    found += [(m[3], _MONTHS[m[1].lower()], m[2]) for m in _MONTH_DAY_YEAR.finditer(text)]
    found += [(m[1], m[2], m[3]) for m in _ISO_DAY.finditer(text)]
    return [_day(int(y), int(mo), int(d)) for y, mo, d in found]


def _day(year: int, month: int, day: int) -> Span | None:
    try:
        start = datetime(year, month, day, tzinfo=UTC)
    except ValueError:  # 31 February names no day
        return None
    return start - _SLACK, start + timedelta(days=1) + _SLACK


def _months(text: str, now: datetime) -> list[Span | None]:
    # A day's month is not a month of its own: "13 March, 2023" names the day only.
    rest = _ISO_DAY.sub(" ", _MONTH_DAY_YEAR.sub(" ", _DAY_MONTH_YEAR.sub(" ", text)))
    spans: list[Span | None] = [_month(int(m[2]), _MONTHS[m[1].lower()])
                                for m in _MONTH_YEAR.finditer(rest)]
    rest = _MONTH_YEAR.sub(" ", rest)
    for m in _IN_MONTH.finditer(rest):
        month = _MONTHS[m[1].lower()]
        # A month without a year is its latest occurrence that has begun.
        spans.append(_month(now.year - (month > now.month), month))
    return spans


def _month(year: int, month: int) -> Span:
    start = datetime(year, month, 1, tzinfo=UTC)
    return start, datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)


def _years(text: str) -> list[Span]:
    return [(datetime(int(m[1]), 1, 1, tzinfo=UTC), datetime(int(m[1]) + 1, 1, 1, tzinfo=UTC))
            for m in _IN_YEAR.finditer(text)]


def _weekday(which: str, weekday: int, now: datetime) -> Span:
    """"on Tuesday": the latest Tuesday up to today; "last Tuesday": the latest before today."""
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    back = (today.weekday() - weekday) % 7 or (7 if which == "last" else 0)
    day = today - timedelta(days=back)
    return day - _SLACK, day + timedelta(days=1) + _SLACK


def _ago(count: str, unit: str, now: datetime) -> Span:
    """"3 days ago" is that day; "two weeks ago" and "a month ago" the week or month around
    that point, as people round."""
    n = int(count) if count.isdigit() else _NUMBERS[count]
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    days, half = {"day": (1, 0), "week": (7, 4), "month": (30, 15)}[unit]
    point = today - timedelta(days=n * days)
    reach = _SLACK + timedelta(days=half)
    return point - reach, point + timedelta(days=1) + reach


def _relative(phrase: str, now: datetime) -> Span:
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if phrase == "today":
        return today - _SLACK, today + timedelta(days=1) + _SLACK
    if phrase == "yesterday":
        return today - timedelta(days=1) - _SLACK, today + _SLACK
    if phrase.endswith("week"):  # the calendar week before this one, Monday to Monday
        monday = today - timedelta(days=today.weekday())
        return monday - timedelta(days=7) - _SLACK, monday + _SLACK
    first = today.replace(day=1)
    return _month(first.year - (first.month == 1), (first.month - 2) % 12 + 1)
