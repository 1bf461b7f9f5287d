"""Item 7 of the grading threat model: a check's ranks get their own inputs and nothing that
decides the verdict. For every exercise of the book, its check is called with the notebook's
own solution and a distinctive seed, and what the launcher would send each rank is caught
before any process starts: no rank is sent the seed (as an int, or in a plan), and a rank that
draws its inputs from keys holds its own key only. The attacks this closes (a learner's
function that draws the other ranks' inputs from the check's frames and sums without a
message) are in tests/test_checks.py, where they fail with "not this rank's to draw"."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import labs.checks
import labs.launcher
from labs.checks.core import CaseKeys
from labs.grading.handout import load_chapters

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SEED = 987_654_321_012
CHAPTERS = {c.path.name: c for c in load_chapters(NOTEBOOKS)}
EXERCISES = [(name, ex.exercise) for name, c in CHAPTERS.items() for ex in c.exercises]


class _Caught(Exception):
    """Raised where the launcher would start the first rank."""


def _seen(value: object, path: str = "args") -> list[str]:
    """Where in ``value`` the seed is, or a key of another rank's."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes, float)):
        return []
    if isinstance(value, int):
        return [path] if value == SEED else []
    if isinstance(value, torch.Tensor):
        return []
    if isinstance(value, CaseKeys):
        return [f"{path}: keys of ranks {sorted(value.own)}"] if len(value.own) != 1 else []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _seen(v, f"{path}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _seen(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value)
                for p in _seen(getattr(value, f.name), f"{path}.{f.name}")]
    return []


@pytest.mark.parametrize(("notebook", "exercise"), EXERCISES,
                         ids=[e for _, e in EXERCISES])
def test_no_rank_is_sent_the_seed_or_another_ranks_key(notebook, exercise, monkeypatch):
    chapter = CHAPTERS[notebook]
    ex = next(e for e in chapter.exercises if e.exercise == exercise)
    namespace: dict[str, Any] = {}
    for source in chapter.sources(chapter.setup):
        exec(compile(source, notebook, "exec"), namespace)
    for index in ex.solutions:
        exec(compile(chapter.nb.cells[index].source, notebook, "exec"), namespace)
    sent: list[tuple[Any, ...]] = []

    def pack_call(fn: object, args: tuple[Any, ...]) -> bytes:
        sent.append(args)
        return b""

    def start(*args: object, **kwargs: object) -> None:
        raise _Caught

    monkeypatch.setattr(labs.launcher, "pack_call", pack_call)
    monkeypatch.setattr(labs.launcher._Rank, "start", start)
    for call in ex.calls:
        check = getattr(labs.checks, call.function)
        sent.clear()
        with pytest.raises(_Caught):
            check(*(namespace[name] for name in call.submitted), seed=SEED)
        assert sent, f"{call.function} started no rank"
        found = [p for r, args in enumerate(sent) for p in _seen(args, f"rank {r}'s args")]
        assert not found, f"{call.function} sends its ranks the seed: {found}"
