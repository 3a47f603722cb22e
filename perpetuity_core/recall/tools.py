"""The recall tools: what the model can ask its memory mid-reply, and the answers.

The frame is what the model remembers at the start of a turn; these tools reach the rest. The
proxy runs them inside the streamed reply (relay.py). Here they are neutral: a name, a
description and a JSON schema each (`TOOLS`), the paragraph that tells the model how to use them
(`INSTRUCTIONS`), and `run`, which checks one call's arguments and dispatches it to its query
(queries.py), returning the text the model reads (answers.py).

Every answer is for one user (another user's rows never appear, pooled or not) and one turn:
`TurnMemory.shown` holds the rows the model has seen this turn (the frame's, then every row a
call returned), and no call shows a row's text twice. Answers are compact: LIMIT rows by
default. The structures derived for the tools, with their writers, are memory's: the binding
log (memory/derived/bindings.py) and the subject chains (memory/derived/chains.py).

How it fails: `run` never raises. Bad arguments and unknown names get a one-line error the
model can read and correct; a failure inside a tool is logged and reported the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from perpetuity_core.errors import BadArguments
from perpetuity_core.memory.derived.index import sequence
from perpetuity_core.memory.derived.scan import Scanner
from perpetuity_core.recall.answers import TurnMemory, see_sent
from perpetuity_core.recall.queries import COUNT_LIST, RUNNERS

log = logging.getLogger("perpetuity")

LIMIT = 8  # rows an answer shows unless asked for more
MAX_LIMIT = 50


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]  # JSON schema of the arguments


# The definitions ride along with every request that carries the tools, read on every call of
# a conversation: kept short. No "additionalProperties": an unknown argument is refused by
# `parse_arguments` in words the model reads, and the key cost 31 characters a tool a call.
_FILTERS: dict[str, dict[str, Any]] = {
    "conversation": {"type": "string", "description":
                     "A conversation's number from results (c12), or 'current'."},
    "role": {"type": "string", "enum": ["user", "assistant", "tool"]},
    "after": {"type": "string", "description": "From this ISO date/time on (UTC)."},
    "before": {"type": "string", "description": "Before this ISO date/time (UTC)."},
}


def _limit(default: int = LIMIT, most: int = MAX_LIMIT) -> dict[str, Any]:
    return {"type": "integer", "minimum": 1, "maximum": most, "default": default}


def _schema(required: Sequence[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required)}


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "memory_search",
        "Search all earlier conversations with this user, best match first: rows not seen this"
        " turn, each with the other half of its exchange.",
        _schema(["query"], query={"type": "string", "description": "Words said before."},
                **_FILTERS, limit={"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                                   "description": "At most this many (default: as many as"
                                   " score close to the best)."})),
    ToolSpec(
        "memory_more",
        "More of what this turn's retrieval found but the frame left out, best first, one page"
        " per call. With `item`, the rest of a row that an answer cut short.",
        _schema([], page={"type": "integer", "minimum": 1, "default": 1},
                limit=_limit(),
                item={"type": "integer", "minimum": 1, "description": "A cut row's #id."},
                offset={"type": "integer", "minimum": 0, "default": 0,
                        "description": "As the cut note says."})),
    ToolSpec(
        "memory_cooccur",
        "What came up together with a topic in earlier turns: the rows retrieved or said in the"
        " same turns as the topic's best matches, and the words most frequent among them.",
        _schema(["topic"], topic={"type": "string"}, limit=_limit())),
    ToolSpec(
        "memory_count",
        "Count exactly the stored rows that mention something (all are read), by conversation"
        " and date, instances listed. A row counts when it holds every word of `category` (hike"
        " matches hiking), or any with match='any'. Use an instance's own words.",
        _schema(["category"], category={"type": "string"},
                match={"type": "string", "enum": ["all", "any"], "default": "all"},
                **_FILTERS, limit=_limit(COUNT_LIST, 200) | {
                    "description": "Instances to list; the count is always complete."})),
    ToolSpec(
        "memory_chains",
        "Follow a subject (a name, a place, a thing) through time: every row about it, oldest"
        " first, so a fact that changed ends at its latest state; and the subjects linked to it.",
        _schema(["subject"], subject={"type": "string", "description":
                                      "One or two distinctive words (e.g. 'Oslo', 'vault code')."},
                limit=_limit(),
                page={"type": "integer", "minimum": 1, "default": 1,
                      "description": "1 is the latest rows, 2 the ones before."})),
    ToolSpec(
        "memory_dates",
        "When something happened: the rows that mention it, oldest first, dated, with the time"
        " between consecutive ones and before now.",
        _schema(["query"], query={"type": "string", "description": "What happened."},
                **_FILTERS, limit=_limit())),
)
TOOL_NAMES = frozenset(t.name for t in TOOLS)
_SPECS = {t.name: t for t in TOOLS}

# The note on the frame's end: that it is not all, and that the tools reach the rest. What each
# tool does is in its own definition, which rides along; said again here, as it was, it cost
# 215 tokens of every framed request (the frame's header says what the quoted turns are).
INSTRUCTIONS = (
    "This is not all you remember: the memory tools (memory_search, memory_more, memory_count,"
    " memory_dates, memory_chains, memory_cooccur) reach the rest. Use them when the answer"
    " needs something not in front of you, before saying you do not know; each call returns"
    " only what you have not seen this turn."
)


def run(call_name: str, arguments: dict | str, memory: TurnMemory, scanner: Scanner) -> str:
    """Execute one call and return the text the model reads. Never raises."""
    spec = _SPECS.get(call_name)
    if spec is None:
        return f"Unknown tool {call_name!r}: the memory tools are {', '.join(sorted(TOOL_NAMES))}."
    try:
        args = parse_arguments(spec, arguments)
        # Some tools read the store's rows directly (count, chains, dates): on PostgreSQL, what
        # was stored since the last search, by this process or another, is ordered in first
        # (a tool that searches catches up itself; nothing to do on SQLite).
        sequence(scanner.db)
        see_sent(memory, scanner)
        return RUNNERS[call_name](args, memory, scanner)
    except BadArguments as e:
        return f"{call_name}: {e}. It takes {_signature(spec)}."
    except Exception as e:  # the reply goes on: the model reads that the call failed
        log.exception("perpetuity: %s failed", call_name)
        return f"{call_name} failed ({type(e).__name__}); answer without it or try another call."


def parse_arguments(spec: ToolSpec, arguments: dict | str) -> dict[str, Any]:
    """The arguments checked against the spec's schema (types, bounds, enums, required)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise BadArguments(f"the arguments are not valid JSON ({e.msg})") from e
    if not isinstance(arguments, dict):
        raise BadArguments("the arguments must be a JSON object")
    props = spec.input_schema["properties"]
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if key not in props:
            raise BadArguments(f"unknown argument {key!r}")
        if value is not None:
            out[key] = _check(key, value, props[key])
    for key in spec.input_schema["required"]:
        if key not in out or out[key] == "":
            raise BadArguments(f"{key!r} is required")
    for key, prop in props.items():
        if key not in out and "default" in prop:
            out[key] = prop["default"]
    return out


def _check(key: str, value: Any, prop: dict[str, Any]) -> Any:
    if prop["type"] == "integer":
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)  # models sometimes quote numbers
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadArguments(f"{key!r} must be a whole number, not {value!r}")
        lo, hi = prop.get("minimum"), prop.get("maximum")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            most = hi if hi is not None else "any"
            raise BadArguments(f"{key!r} must be between {lo} and {most}")
        return value
    if not isinstance(value, str):
        raise BadArguments(f"{key!r} must be a string, not {value!r}")
    value = value.strip()
    if "enum" in prop and value not in prop["enum"]:
        raise BadArguments(f"{key!r} must be one of {', '.join(prop['enum'])}")
    return value


def _signature(spec: ToolSpec) -> str:
    required = spec.input_schema["required"]
    names = [k if k in required else k + "?" for k in spec.input_schema["properties"]]
    return f"{spec.name}({', '.join(names)})"

