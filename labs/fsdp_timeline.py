"""When each unit of :class:`labs.fsdp.FSDP` gathered, computed and reduce-scattered in a step:
the :class:`FSDPTimeline` that FSDP fills (``model.timeline``), from which a step's timeline
is drawn, communication beside computation, unit by unit.

Its own module because both the wrapper (:mod:`labs.fsdp`, which times compute and torch's
collectives) and the communication stream's jobs (:mod:`labs.fsdp_collectives`) write to it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from labs.clock import DeviceClock, Moment, seconds


class Activity(enum.Enum):
    """What an :class:`Interval` of an :class:`FSDPTimeline` spent its time on."""

    ALL_GATHER = "all-gather"
    """Gathering the unit's parameters: on the communication stream, from when its thread
    began the ring to when it ended; with torch collectives, from when the all-gather was
    started to when FSDP waited for it (the end is then an upper bound)."""
    REDUCE_SCATTER = "reduce-scatter"
    """Reduce-scattering the unit's gradient (under HSDP with the all-reduce across groups):
    timed like ``ALL_GATHER``."""
    FORWARD = "forward"
    """The unit's forward, from when its parameters were there and the prefetches it starts
    were handed over, to its forward hook (a unit around other units includes theirs)."""
    BACKWARD = "backward"
    """The unit's backward, from when its parameters were there (its outputs' gradient
    arrived) and its prefetches handed over, to when its full gradient was complete."""


@dataclass(frozen=True)
class Interval:
    """One unit busy with one :class:`Activity`, from ``start`` to ``end``: moments of the
    timeline's :class:`labs.clock.DeviceClock` (``time.perf_counter()`` seconds on the CPU, a
    GPU's events on CUDA), seconds once read by :meth:`FSDPTimeline.of`."""

    unit: str
    activity: Activity
    start: Moment
    end: Moment

    def resolved(self) -> Interval:
        """This interval in ``time.perf_counter()`` seconds."""
        return Interval(self.unit, self.activity, seconds(self.start), seconds(self.end))


@dataclass
class FSDPTimeline:
    """The intervals of one training step (from the first forward after
    ``finish_gradient_synchronization``, or after construction, to the next
    ``finish_gradient_synchronization``), in the order they ended: enough to draw a step's
    timeline, communication and computation of every unit. Collectives on the stream are
    appended by its thread (``list.append`` is atomic in CPython). ``clock`` stamps them:
    FSDP's, on the device of its parameters."""

    clock: DeviceClock = field(default_factory=DeviceClock)
    intervals: list[Interval] = field(default_factory=list)

    def resolved(self) -> list[Interval]:
        """Every interval in ``time.perf_counter()`` seconds, in order of start (on a GPU
        this waits for the events it reads)."""
        return sorted((i.resolved() for i in self.intervals), key=lambda i: i.start)

    def of(self, activity: Activity, unit: str | None = None) -> list[Interval]:
        """The intervals of ``activity`` (of ``unit`` only, if given), in order of start."""
        return [i for i in self.resolved()
                if i.activity is activity and (unit is None or i.unit == unit)]

    def first(self, activity: Activity, unit: str) -> Interval:
        """The first interval of ``unit``'s ``activity``; a KeyError naming what was recorded
        when there is none."""
        found = self.of(activity, unit)
        if not found:
            seen = sorted({(i.unit, i.activity.value) for i in self.intervals})
            raise KeyError(f"no {activity.value} of unit {unit!r} in this timeline; it holds "
                           f"{seen}")
        return found[0]
