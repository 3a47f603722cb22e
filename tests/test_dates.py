"""Dates a question names, as spans of stored time (dates.window)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from perpetuity_core.frame import dates

ASKED = datetime(2023, 11, 15, 10, 30, tzinfo=UTC).timestamp()  # a Wednesday


def day(y: int, m: int, d: int) -> float:
    return datetime(y, m, d, tzinfo=UTC).timestamp()


DAY = 86400.0


@pytest.mark.parametrize("text, span", [
    ("What did Jolene ask Deb to help with on 13 March, 2023?",
     (day(2023, 3, 12), day(2023, 3, 15))),
    ("What book did Tim just finish reading on 8th December, 2023?",
     (day(2023, 12, 7), day(2023, 12, 10))),
    ("Who did Maria have dinner with on May 3, 2023?", (day(2023, 5, 2), day(2023, 5, 5))),
    ("what broke in the deploy on 2023-10-02", (day(2023, 10, 1), day(2023, 10, 4))),
    ("What did Dave open in May 2023?", (day(2023, 5, 1), day(2023, 6, 1))),
    ("Which classes did Evan join in mid-August 2023?", (day(2023, 8, 1), day(2023, 9, 1))),
    ("Which city did John recommend in December 2023?", (day(2023, 12, 1), day(2024, 1, 1))),
    ("What happened to John's job situation in 2022?", (day(2022, 1, 1), day(2023, 1, 1))),
    # A month alone is its latest start: October this year, December last year.
    ("What painting did Evan share with Sam in October?", (day(2023, 10, 1), day(2023, 11, 1))),
    ("what did we plan in December?", (day(2022, 12, 1), day(2023, 1, 1))),
    # Two dates: the span from the first to the last.
    ("between 1 May 2023 and June 2, 2023", (day(2023, 4, 30), day(2023, 6, 4))),
    # Relative dates count back from the question.
    ("what did we decide yesterday?", (day(2023, 11, 13), day(2023, 11, 16))),
    ("anything new today", (day(2023, 11, 14), day(2023, 11, 17))),
    ("the bug we fixed last week", (day(2023, 11, 5), day(2023, 11, 14))),
    ("the budget from last month", (day(2023, 10, 1), day(2023, 11, 1))),
    # Weekdays: "on" the latest up to today, "last" the latest before today.
    ("what did we do on Tuesday", (day(2023, 11, 13), day(2023, 11, 16))),
    ("on Wednesday", (day(2023, 11, 14), day(2023, 11, 17))),
    ("the call last Wednesday", (day(2023, 11, 7), day(2023, 11, 10))),
    # "N units ago": that day, or the week or month around that point.
    ("the error from 3 days ago", (day(2023, 11, 11), day(2023, 11, 14))),
    ("a day ago", (day(2023, 11, 13), day(2023, 11, 16))),
    ("the plan two weeks ago", (day(2023, 10, 27), day(2023, 11, 7))),
    ("a month ago", (day(2023, 9, 30), day(2023, 11, 2))),
    # An absolute date wins: "last week" here is the week before 6 November, not this one.
    ("What was Tim's writing issue last week, as mentioned on November 6, 2023?",
     (day(2023, 11, 5), day(2023, 11, 8))),
])
def test_named_dates(text: str, span: tuple[float, float]) -> None:
    assert dates.window(text, ASKED) == span


@pytest.mark.parametrize("text", [
    "May I ask what we discussed?",  # a modal verb, not the month
    "raise the limit to 2048 tokens",
    "the 2023 roadmap",  # a year without a preposition names a topic as often as a time
    "why does it fail? 2023-10-02T14:03:11 ERROR pool exhausted",  # a pasted log line
    "2023-10-02 14:03:11,207 WARNING retrying",
    "what is on 31 February, 2023",  # no such day
    "Where did Caroline move from?",
    "Monday's standup notes",  # a weekday without "on" or "last"
    "it has been days, weeks ago was fine",
    "",
])
def test_no_date_no_window(text: str) -> None:
    assert dates.window(text, ASKED) is None
