"""What :func:`labs.launcher.launch` accepts, refused before any process starts, and the
backend and threads it picks for the ranks.

:func:`check_inputs` refuses a bad worker, world size, ``args`` or timeout with a message that
says what to pass, and picks the backend (:func:`choose_backend`: nccl when every rank can
have a GPU of its own, gloo otherwise); :func:`threads_per_rank` shares the machine's cores
(:func:`cpu_cores`) among the ranks. Nothing here starts a process: a notebook's mistake is
an error in the calling cell, not a rank that fails. Kept apart from the launcher's process
handling (:mod:`labs.launcher`); ``from labs.launcher import Backend, cpu_cores, ...`` keeps
working.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

#: More ranks than this on one machine is almost surely a typo; use torchrun across nodes.
MAX_WORLD_SIZE = 32


class Backend(enum.Enum):
    """A torch.distributed backend the launcher can start."""

    GLOO = "gloo"  #: CPU tensors; works everywhere.
    NCCL = "nccl"  #: CUDA tensors, one GPU per rank.


def check_inputs(
    fn: object, world_size: object, args: object, backend: object, timeout: object
) -> Backend:
    """The backend the ranks will use, once ``fn``, ``world_size``, ``args`` and ``timeout``
    are known to be what :func:`labs.launcher.launch` takes; a TypeError or ValueError that
    says what to pass otherwise."""
    if not callable(fn):
        raise TypeError(
            f"fn must be a function, got {type(fn).__name__}. Pass the function itself, "
            "e.g. launch(my_fn, world_size=4), not launch(my_fn(), ...)."
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"world_size must be a positive int, got {world_size!r} "
            f"({type(world_size).__name__}); e.g. world_size=4."
        )
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is more than {MAX_WORLD_SIZE} ranks on one machine. "
            "Use a smaller world_size here, or run the lab under torchrun across several nodes."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(
            f"args must be a tuple (or list) of extra arguments, got {type(args).__name__}; "
            "for one argument write args=(value,)."
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if not math.isfinite(timeout):
        raise ValueError("timeout must be finite: a hung rank would otherwise hang the notebook.")
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a build with it.")
    return choose_backend(backend, world_size)


def check_rank_args(rank_args: object, world_size: int) -> None:
    """Refuse ``rank_args`` that is not one tuple per rank."""
    if isinstance(rank_args, (str, bytes)) or not isinstance(rank_args, Sequence) or any(
            isinstance(a, (str, bytes)) or not isinstance(a, Sequence) for a in rank_args):
        raise TypeError("rank_args must be a sequence of one tuple per rank, e.g. "
                        "rank_args=[(x0,), (x1,)] for two ranks.")
    if len(rank_args) != world_size:
        raise ValueError(f"rank_args holds {len(rank_args)} tuple(s) for {world_size} rank(s): "
                         "give one per rank.")


def choose_backend(backend: object, world_size: int, *, ranks: str = "world_size") -> Backend:
    """The backend for ``world_size`` ranks on this machine, from the GPUs it has (``ranks``
    names that number in the error message): :func:`pick_backend` decides."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pick_backend(backend, world_size, gpus, dist.is_nccl_available(), ranks=ranks)


def pick_backend(backend: object, ranks_here: int, gpus: int, nccl_available: bool, *,
                 ranks: str = "world_size") -> Backend:
    """``"auto"`` is nccl when each of the ``ranks_here`` processes on this machine can have a
    GPU of its own, gloo otherwise; ``"nccl"`` without one GPU per process is an error.

    The answer depends only on numbers every process of a machine shares, so all of them
    pick the same backend: a process group whose ranks disagree waits forever."""
    names = {"auto", *(b.value for b in Backend)}
    if isinstance(backend, Backend):
        backend = backend.value
    if backend not in names:
        raise ValueError(f"backend must be one of {sorted(names)}, got {backend!r}.")
    if backend == "auto":
        return Backend.NCCL if gpus >= ranks_here and nccl_available else Backend.GLOO
    if backend == Backend.NCCL.value:
        if gpus < ranks_here:
            raise ValueError(
                f"NCCL needs one GPU per rank; use backend='gloo' "
                f"({ranks}={ranks_here}, GPUs visible: {gpus})."
            )
        if not nccl_available:
            raise ValueError("this torch build has no NCCL; use backend='gloo'.")
    return Backend(backend)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(world_size: int) -> int:
    """Each rank's intra-op threads when the caller gives none: the cores shared out."""
    # N ranks with the default thread count each would oversubscribe the cores many times over.
    return max(1, cpu_cores() // world_size)
