"""House-style rules that a reader of ``labs`` relies on, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent.parent / "labs"


def undocumented_enum_members(source: str) -> list[str]:
    """``Class.MEMBER`` for every member of an ``enum.Enum`` subclass in ``source`` that has
    no documentation: a string right after it, a ``#:`` comment on the line before, or a
    trailing ``#:`` comment (the forms Sphinx autodoc reads)."""
    lines = source.splitlines()
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef)
                and any("Enum" in ast.unparse(base) for base in node.bases)):
            continue
        for i, statement in enumerate(node.body):
            if not isinstance(statement, ast.Assign):
                continue
            after = node.body[i + 1] if i + 1 < len(node.body) else None
            documented = (
                (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                 and isinstance(after.value.value, str))
                or lines[statement.lineno - 2].strip().startswith("#:")
                or "#:" in lines[statement.end_lineno - 1]
            )
            if not documented:
                missing.append(f"{node.name}.{ast.unparse(statement.targets[0])}")
    return missing


@pytest.mark.parametrize("path", sorted(LABS.rglob("*.py")), ids=lambda p: p.name)
def test_every_enum_member_is_documented(path):
    assert undocumented_enum_members(path.read_text()) == []


def test_an_undocumented_member_is_found():
    source = '''
import enum

class State(enum.Enum):
    """States."""

    #: documented before
    A = 1
    B = 2  #: documented on its line
    C = 3
    """documented after"""
    D = 4
    E = 5
'''
    assert undocumented_enum_members(source) == ["State.D", "State.E"]
