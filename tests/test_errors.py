"""One error tree, and one meaning a name: what a reader meets in the package."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from perpetuity_core import errors

PACKAGE = Path(__file__).resolve().parent.parent / "perpetuity_core"


@pytest.mark.parametrize("error", [errors.StoreError, errors.ProtocolError, errors.ConfigError,
                                   errors.UpstreamError, errors.BadArguments])
def test_every_error_is_a_perpetuity_error_named_in_the_tree(error: type) -> None:
    assert issubclass(error, errors.PerpetuityError)
    assert f"── {error.__name__} " in (errors.__doc__ or "")


def test_a_class_name_is_defined_once() -> None:
    """Each protocol adapter has its own ReplyAssembler and mergers by design (wire.protocols),
    and peewee's models their Meta; any other class name means one thing."""
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if "protocols" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and node.name != "Meta":
                where[node.name].append(str(path.relative_to(PACKAGE)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_a_module_name_is_used_once() -> None:
    names = [p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert sorted({n for n in names if names.count(n) > 1}) == []
