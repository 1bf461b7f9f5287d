"""Claims a chapter makes about a measurement, checked on every rank (not exercises: the
chapter's own statements, e.g. "the reduce-scatter result is S/N bytes on every rank").

The verdict is a :class:`~labs.checks.core.CheckResult`, printed as an exercise check's is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence

from labs.checks.core import CheckResult
from labs.memory import MemorySnapshot, find


def check_held_bytes(
    measured: Mapping[int, Sequence[Sequence[MemorySnapshot]]],
    moment: str | enum.Enum,
    expected: Callable[[int, int], int],
    claim: str,
) -> CheckResult:
    """Compare every rank's measured ``held_bytes`` at ``moment`` with ``expected(N, rank)``.

    ``measured`` maps a world size N to the per-rank snapshots of one launch. The verdict
    names the first world size and rank where the measurement and the claim disagree.
    """
    for world_size, per_rank in sorted(measured.items()):
        if len(per_rank) != world_size:
            raise ValueError(f"world size {world_size}: got snapshots of {len(per_rank)} ranks")
        for rank, snaps in enumerate(per_rank):
            held, want = find(snaps, moment).held_bytes, expected(world_size, rank)
            if held != want:
                return CheckResult(claim, False, (
                    f"with N = {world_size}, rank {rank} held {held} bytes at "
                    f"{find(snaps, moment).moment!r}, the claim says {want}."
                ))
    sizes = ", ".join(str(n) for n in sorted(measured))
    return CheckResult(claim, True, f"measured on every rank for N = {sizes}.")
