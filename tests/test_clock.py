"""Timings that end with the work they time (issue 43): on a GPU the Python call that queues
a step returns before its kernels finish, so every timed region of the labs ends with
:func:`labs.clock.now`, which waits for the device first.

On the CPU nothing is asynchronous, so these tests give the ranks a device whose queued work
finishes late: ``torch.cpu.synchronize`` (what :func:`labs.clock.synchronize` calls on the CPU)
takes :data:`LATE` seconds, as ``torch.cuda.synchronize`` does after a step whose kernels are
still running. A region that ends without waiting for the device reads less than that.
"""

from __future__ import annotations

import time

import pytest
import torch

from labs import launch
from labs.clock import now
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
