"""Counts as a person reads them: "1 user", "2 users"."""


def counted(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
