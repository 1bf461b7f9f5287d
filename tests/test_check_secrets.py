"""Item 7 of the grading threat model: a check's ranks get their own inputs and nothing that
decides the verdict. For every exercise of the registry, its check is called with the
notebook's own solution (run after its chapter's setup, as the grader runs it) and a
distinctive seed, and what the launcher would send each rank is caught before any process
starts: no rank is sent the seed (as an int, or in a plan), and a rank that draws its inputs
from keys holds its own key only. The attacks this closes (a learner's function that draws the
other ranks' inputs from the check's frames and sums without a message) are in
tests/test_checks.py, where they fail with "not this rank's to draw"."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import labs.launcher
from labs.checks.core import CaseKeys
from labs.checks.exercises import EXERCISES

from solutions import reference

SEED = 987_654_321_012


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


@pytest.mark.parametrize("row", EXERCISES, ids=[e.id for e in EXERCISES])
def test_no_rank_is_sent_the_seed_or_another_ranks_key(row, monkeypatch):
    sent: list[tuple[Any, ...]] = []

    def pack_call(fn: object, args: tuple[Any, ...]) -> bytes:
        sent.append(args)
        return b""

    def start(*args: object, **kwargs: object) -> None:
        raise _Caught

    monkeypatch.setattr(labs.launcher, "pack_call", pack_call)
    monkeypatch.setattr(labs.launcher._Rank, "start", start)
    with pytest.raises(_Caught):
        row.check_function()(reference(row), seed=SEED)
    assert sent, f"{row.check} started no rank"
    found = [p for r, args in enumerate(sent) for p in _seen(args, f"rank {r}'s args")]
    assert not found, f"{row.check} sends its ranks the seed: {found}"
