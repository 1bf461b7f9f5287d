"""How the timing tests hold a measured time to the emulated link's model: one-sided.

The link sleeps for the wire's time, so a call cannot beat its model by more than the
transport's own jitter (EARLY); a rank woken late on a loaded machine (make test's two workers
on two cores) only adds, so the bound above is wide (LATE), and the time compared is the fastest
repeat of the slowest rank (chapter A2's method). A symmetric bound around the median flaked
under two workers (CI measured +16 % and +18 %)."""

from __future__ import annotations

from collections.abc import Sequence

EARLY = 0.15  #: how far below the model a call may finish
LATE = 0.5    #: how far above it, on a loaded machine


def fastest_of_slowest(per_rank: Sequence[Sequence[float]]) -> float:
    """The fastest repeat, each repeat timed by its slowest rank."""
    return min(max(times) for times in zip(*per_rank, strict=True))


def follows(measured: float, model: float) -> bool:
    """Whether ``measured`` is at most EARLY below ``model`` and at most LATE above it."""
    return -EARLY * model <= measured - model <= LATE * model


def near(measured: float, model: float, tolerance: float = EARLY) -> bool:
    """Two-sided: used only to show that a *wrong* form misses what was measured."""
    return abs(measured - model) <= tolerance * model
