"""Time that means the same on a GPU as on the CPU.

A GPU runs kernels asynchronously: the Python call that launches one returns once it is
queued, so ``time.perf_counter()`` read after a training step on CUDA says when the step was
queued, not when it finished, and a loop of steps looks as fast as Python can queue them
until the queue fills. Two ways to read the time of the work itself:

* :func:`now` first waits for the work queued on the device (the device module's
  ``synchronize``: ``torch.cuda.synchronize`` on a GPU, a no-op on the CPU), so that a region
  timed between two calls of it ends with the work it times. Used around whole steps
  (:mod:`labs.train`, the chapter 7 recipe, the timed collectives); one call per region, not
  per kernel, because each call stalls the queue.
* :class:`DeviceClock` marks moments inside a step without stalling it: on CUDA each
  :meth:`DeviceClock.stamp` records an event on the current stream, which the GPU completes
  when it reaches that point of its queue; the moment is read later (:func:`seconds`, after
  the step), as the clock's origin (a host time taken with the queue empty) plus the GPU's
  elapsed time from the origin's event. On the CPU a stamp is ``time.perf_counter()`` at
  once. The DDP wrappers' timelines (:class:`labs.ddp.StepTimeline`) and FSDP's
  (:class:`labs.fsdp_timeline.FSDPTimeline`) are stamped this way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` has finished."""
    torch.get_device_module(device.type).synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished."""
    synchronize(device)
    return time.perf_counter()


class Pending:
    """A moment of a device's queue, not read yet: an event recorded there, and the clock's
    origin (host seconds, and the event recorded at that moment) to read it against."""

    __slots__ = ("event", "origin")

    def __init__(self, event: Any, origin: tuple[float, Any]) -> None:
        self.event, self.origin = event, origin

    def seconds(self) -> float:
        """``time.perf_counter()`` seconds at which the device reached the event (waits for
        it). ``elapsed_time`` is in milliseconds, with about half a microsecond's
        resolution."""
        self.event.synchronize()
        host, origin_event = self.origin
        return host + origin_event.elapsed_time(self.event) / 1e3


#: A moment as a timeline stores it: host seconds, or a device's :class:`Pending` event.
Moment = float | Pending


def seconds(moment: Moment) -> float:
    """``moment`` in ``time.perf_counter()`` seconds (waiting for the device if pending)."""
    return moment.seconds() if isinstance(moment, Pending) else moment


class DeviceClock:
    """Stamps of the moments the work queued on ``device`` reaches a point, read on the
    host's clock.

    On the CPU, whose kernels run in the calling thread, :meth:`stamp` is
    ``time.perf_counter()``. On CUDA it records an event (``event()``, by default a
    ``torch.cuda.Event`` with timing) on the current stream, without waiting for it: the
    caller's stream runs on. The origin is taken once, when the clock is made: a
    synchronize (the queue empty), the host time, then an event that the GPU completes at
    once. ``event`` forces the event path on any device: the tests give it a CPU stand-in
    whose queue finishes late (tests/test_clock.py)."""

    def __init__(self, device: torch.device | None = None,
                 event: Callable[[], Any] | None = None) -> None:
        self.device = torch.device("cpu") if device is None else device
        if event is None and self.device.type == "cuda":
            def event() -> Any:
                return torch.cuda.Event(enable_timing=True)
        self._event = event
        self._origin: tuple[float, Any] | None = None
        if event is not None:
            synchronize(self.device)
            origin = event()
            host = time.perf_counter()
            origin.record()
            self._origin = (host, origin)

    @classmethod
    def of(cls, module: torch.nn.Module) -> DeviceClock:
        """A clock of the device ``module``'s parameters live on (the CPU if it has none)."""
        return cls(next((p.device for p in module.parameters()), torch.device("cpu")))

    def stamp(self) -> Moment:
        """This moment of the device's queue: now on the CPU; on CUDA, when the GPU gets to
        the work queued so far on the current stream (read it with :func:`seconds`)."""
        if self._origin is None:
            return time.perf_counter()
        event = self._event()
        event.record()
        return Pending(event, self._origin)
