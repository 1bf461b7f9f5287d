"""Time that means the same on a GPU as on the CPU.

A GPU runs kernels asynchronously: the Python call that launches one returns once it is
queued, so ``time.perf_counter()`` read after a training step on CUDA says when the step was
queued, not when it finished, and a loop of steps looks as fast as Python can queue them
until the queue fills. :func:`now` first waits for the work queued on the device (the device
module's ``synchronize``: ``torch.cuda.synchronize`` on a GPU, a no-op on the CPU), so that a
region timed between two calls of it ends with the work it times. Used around whole steps
(:mod:`labs.train`, the chapter 7 recipe); one call per region, not per kernel, because each
call stalls the queue.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` has finished."""
    torch.get_device_module(device.type).synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished."""
    synchronize(device)
    return time.perf_counter()
