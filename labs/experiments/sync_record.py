"""What one rank records of one step of NaiveDDP or labs' DDP, from ``loss.backward()`` to
averaged gradients: the record chapter 5's step-time experiment
(:func:`labs.experiments.ddp.measure_step_times`) keeps, and the model of the overlapped step
(:mod:`labs.experiments.overlap`) reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from labs.ddp import DDP, NaiveDDP, trainable_parameters


@dataclass(frozen=True)
class SyncRecord:
    """One rank's record of one step of NaiveDDP or labs' DDP, from ``loss.backward()`` to
    averaged gradients (of the optimizer step's last micro-batch). Times are
    ``time.perf_counter()`` seconds, read on the host: on Linux that is the monotonic clock,
    which every process of one machine shares, so the ranks' records can be set side by side.

    One entry per all-reduce, in the order they were made: a bucket of DDP, a parameter of
    NaiveDDP (in :func:`labs.ddp.trainable_parameters` order)."""

    backward_start: float
    backward_end: float
    """When ``loss.backward()`` returned."""
    ready: tuple[float, ...]
    """When the all-reduce's last gradient was accumulated (its hook ran). NaiveDDP has no
    hooks and sends nothing before backward ends: its entries are ``backward_end``."""
    started: tuple[float, ...]
    """When the all-reduce began (on a link, when the communication thread began sending)."""
    done: tuple[float, ...]
    synchronised: float
    """When ``finish_gradient_synchronization()`` returned: every gradient holds its average."""
    nbytes: tuple[int, ...]
    """Bytes each all-reduce summed."""


@dataclass(frozen=True)
class BackwardTimes:
    """What the step loop of :mod:`labs.experiments.ddp` measured over an optimizer step:
    seconds from each ``backward()`` to the end of its synchronisation, summed, and the last
    micro-batch's three moments (``time.perf_counter()``)."""

    spent: float
    start: float
    backward_end: float
    synchronised: float


def sync_record(model: nn.Module, timed: BackwardTimes) -> SyncRecord | None:
    """The last micro-batch's :class:`SyncRecord`, from the wrapper's
    :class:`labs.ddp.StepTimeline` (None for a wrapper that keeps none, or a record with a
    gap: on the real transport a completion is recorded by a callback that may run late)."""
    if not isinstance(model, (NaiveDDP, DDP)):
        return None
    t = model.timeline.resolved()  # on a GPU: when the GPU got to each point
    if isinstance(model, DDP):
        ready = tuple(max(t.grad_ready.get(n, math.inf) for n in b.names)
                      for b in model.buckets)
        nbytes = tuple(b.buffer.numel() * b.buffer.element_size() for b in model.buckets)
    else:
        params = [p for _, p in trainable_parameters(model.module)]
        ready = (timed.backward_end,) * len(params)
        nbytes = tuple(p.numel() * p.element_size() for p in params)
    calls = range(len(ready))
    if not all(i in t.launched and i in t.done for i in calls) or math.inf in ready:
        return None
    return SyncRecord(timed.start, timed.backward_end, ready,
                      tuple(t.started.get(i, t.launched[i]) for i in calls),
                      tuple(t.done[i] for i in calls), timed.synchronised, nbytes)
