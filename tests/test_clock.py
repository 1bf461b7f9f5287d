"""Timings that end with the work they time (issue 43): on a GPU the Python call that queues
a step returns before its kernels finish, so every timed region of the labs ends with
:func:`labs.clock.now`, which waits for the device first, and the DDP wrappers' timelines are
stamped by a :class:`labs.clock.DeviceClock`, whose stamps on a GPU are events the GPU reaches.

On the CPU nothing is asynchronous, so these tests give the ranks a device whose queued work
finishes late: ``torch.cpu.synchronize`` (what :func:`labs.clock.synchronize` calls on the CPU)
takes :data:`LATE` seconds, as ``torch.cuda.synchronize`` does after a step whose kernels are
still running, and :class:`LateQueue`'s events complete :data:`LATE` seconds after they are
recorded. A region or a stamp that does not wait for the device reads less than that.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from labs import launch
from labs.clock import DeviceClock, now
from labs.ddp import DDP, NaiveDDP
from labs.experiments.recipe import RecipeConfig, recipe_worker
from labs.train import TrainConfig, train_worker

LATE = 0.4  #: seconds the device's queued work takes to finish, after the last call returns


def late_device(rank: int, world_size: int, which: str) -> float:
    """The seconds ``which`` lab reports for its steps, its device's work finishing late."""
    def finish_late(device: object = None) -> None:
        time.sleep(LATE)

    torch.cpu.synchronize = finish_late
    if which == "train":
        return train_worker(rank, world_size, TrainConfig(steps=1)).seconds
    return recipe_worker(rank, world_size, RecipeConfig(steps=1, d_model=32, n_heads=2,
                                                        n_layers=1, seq_len=16)).seconds


@pytest.mark.parametrize("which", ["train", "recipe"])
def test_a_labs_timed_steps_end_when_the_devices_work_does(which):
    assert launch(late_device, 1, args=(which,), echo=False)[0] >= LATE


def test_now_waits_for_the_device_and_the_test_device_is_late():
    """The check above can fail: perf_counter alone does not wait for the late device."""
    def seconds(clock) -> float:
        start = clock()
        return clock() - start

    real = torch.cpu.synchronize
    try:
        torch.cpu.synchronize = lambda device=None: time.sleep(LATE)
        assert seconds(lambda: now(torch.device("cpu"))) >= LATE
        assert seconds(time.perf_counter) < LATE
    finally:
        torch.cpu.synchronize = real


class LateQueue:
    """A GPU's queue, played on the CPU: :meth:`synchronize` empties it, the first event
    recorded after that (a clock's origin) completes at once, and every later one
    :data:`LATE` seconds after it was recorded, the work queued before it still running."""

    def __init__(self) -> None:
        self.empty = True

    def synchronize(self, device: object = None) -> None:
        self.empty = True

    def event(self) -> LateEvent:
        return LateEvent(self)


class LateEvent:
    """``torch.cuda.Event``'s three calls that :class:`labs.clock.DeviceClock` makes."""

    def __init__(self, queue: LateQueue) -> None:
        self.queue, self.at = queue, math.nan

    def record(self) -> None:
        self.at = time.perf_counter() + (0.0 if self.queue.empty else LATE)
        self.queue.empty = False

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))

    def elapsed_time(self, end: LateEvent) -> float:
        return (end.at - self.at) * 1e3


def ddp_timelines(rank: int, world_size: int, late: bool) -> dict[str, list[float]]:
    """One step of NaiveDDP and of DDP (a bucket per layer), their clocks reading a late
    queue or the host's: every moment of each timeline, from the start of backward."""
    queue = LateQueue()
    torch.cpu.synchronize = queue.synchronize
    out = {}
    for wrapper in (NaiveDDP, DDP):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        model = NaiveDDP(net) if wrapper is NaiveDDP else DDP(net, bucket_cap_mb=1e-4)
        if late:
            model.clock = DeviceClock(torch.device("cpu"), event=queue.event)
        loss = model(torch.ones(2, 8)).square().sum()
        start = time.perf_counter()
        loss.backward()
        model.finish_gradient_synchronization()
        t = model.timeline.resolved()
        moments = [*t.grad_ready.values(), *t.launched.values(), *t.done.values()]
        out[wrapper.__name__] = [m - start for m in moments + [t.finished] if m is not None]
    return out


def test_the_ddp_timelines_say_when_the_device_got_there():
    """Every stamp of both wrappers (gradients ready, all-reduces launched and done, the end)
    comes from the clock: on the late queue each is LATE after the host passed it. The same
    step on the host's clock reads every moment within the step's few milliseconds, so the
    check can fail (a stamp taken with time.perf_counter would read so too)."""
    for late in (True, False):
        for rank in launch(ddp_timelines, 2, args=(late,), echo=False):
            for wrapper, moments in rank.items():
                assert len(moments) == {"NaiveDDP": 4 + 4, "DDP": 4 + 2 + 2 + 1}[wrapper]
                assert all((m >= LATE) == late for m in moments), (wrapper, late, moments)
