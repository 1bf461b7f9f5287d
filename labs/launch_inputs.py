"""What :func:`labs.launcher.launch` accepts, refused before any process starts, and where
it puts the ranks: their backend, their device and their threads.

:func:`check_inputs` refuses a bad worker, world size, ``args`` or timeout with a message that
says what to pass, and places the ranks (:func:`choose_placement`, one rule: nccl when every
rank can have a GPU of its own and no emulated link is asked for; otherwise gloo, with the
ranks sharing the GPUs there are, or on the CPU when there are none);
:func:`threads_per_rank` shares the machine's cores (:func:`cpu_cores`) among the ranks.
Nothing here starts a process: a notebook's mistake is an error in the calling cell, not a
rank that fails. Kept apart from the launcher's process handling (:mod:`labs.launcher`);
``from labs.launcher import Backend, cpu_cores, ...`` keeps working.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: More ranks than this on one machine is almost surely a typo; use torchrun across nodes.
MAX_WORLD_SIZE = 32


class Backend(enum.Enum):
    """A torch.distributed backend the launcher can start."""

    #: Works everywhere: CPU tensors, and the CUDA tensors of ranks that share GPUs (its own
    #: collectives carry them; labs' point-to-point messages stage them through host memory,
    #: :mod:`labs.staging`).
    GLOO = "gloo"
    NCCL = "nccl"  #: CUDA tensors, one GPU per rank.


class Device(enum.Enum):
    """Where the ranks' tensors live, as :func:`labs.launch` is asked (``device=``)."""

    #: A GPU when the machine has one (their own each, or shared), else the CPU.
    AUTO = "auto"
    CPU = "cpu"  #: The CPU, on a machine with GPUs too (gloo).
    CUDA = "cuda"  #: A GPU: an error where there is none.


@dataclass(frozen=True)
class Placement:
    """The backend of a launch's ranks and the GPUs they use.

    ``gpus`` is 0 when the ranks compute on the CPU. Otherwise rank r uses
    ``cuda:(r % gpus)``: one GPU each under nccl (``gpus`` = the ranks), and under gloo
    several ranks share a GPU when there are fewer GPUs than ranks (the one-GPU mode)."""

    backend: Backend
    gpus: int = 0

    def device(self, local_rank: int) -> torch.device:
        """Where the tensors of the rank with this local rank belong."""
        if self.gpus == 0:
            return torch.device("cpu")
        return torch.device("cuda", local_rank % self.gpus)

    def where(self) -> str:
        """Where the ranks computed and what carried their messages, in words."""
        if self.gpus == 0:
            return f"{self.backend.value}, on the CPU"
        if self.backend is Backend.NCCL:
            return f"{self.backend.value}, one GPU each"
        shared = "sharing one GPU" if self.gpus == 1 else f"sharing {self.gpus} GPUs"
        return f"{self.backend.value}, {shared} (messages staged through host memory)"

    def describe(self, ranks: int) -> str:
        """One line to print under a table: ``ranks`` ranks, and :meth:`where` they ran."""
        return f"{ranks} rank(s): {self.where()}"


#: How every :func:`placement_note` starts.
NOTE = "where the ranks ran"


def placement_note(ranks: int | Sequence[int], *, backend: object = "auto",
                   device: object = Device.AUTO, link: bool = False) -> str:
    """The line a chapter prints under a table of runs on ``ranks`` ranks (one world size or
    several) that :func:`labs.launch` started here with ``backend``, ``device`` and ``link``
    (whether it had one): where the ranks ran, by the rule that placed them
    (:func:`choose_placement`), e.g. ``"where the ranks ran (N = 2-8): gloo, on the CPU"``.
    World sizes that the rule places differently are listed apart, so a table whose rows ran
    in two places says so. nbval reads every line that starts so as the same line
    (``notebooks/sanitize.cfg``): a chapter's stored outputs, made on the CPU, still hold on a
    GPU box."""
    sizes = [ranks] if isinstance(ranks, int) else list(ranks)
    return sizes_note(sizes, lambda n: choose_placement(backend, n, device, link=link))


def sizes_note(sizes: Sequence[int], place: Callable[[int], Placement]) -> str:
    """:func:`placement_note` of world sizes ``sizes``, each placed by ``place``."""
    groups: dict[str, list[int]] = {}
    for n in sorted(set(sizes)):
        groups.setdefault(place(n).where(), []).append(n)
    parts = [f"N = {_span(ns)}: {where}" for where, ns in groups.items()]
    if len(parts) == 1:
        return f"{NOTE} ({parts[0].replace(': ', '): ', 1)}"
    return f"{NOTE}: " + "; ".join(parts)


def _span(sizes: list[int]) -> str:
    """Sorted world sizes in few words: ``2``, ``2-8`` when consecutive, else ``2, 4, 8``."""
    if len(sizes) > 2 and sizes == list(range(sizes[0], sizes[-1] + 1)):
        return f"{sizes[0]}-{sizes[-1]}"
    return ", ".join(map(str, sizes))


def check_inputs(
    fn: object, world_size: object, args: object, backend: object, timeout: object,
    device: object = Device.AUTO, *, link: bool = False,
) -> Placement:
    """Where the ranks will run, once ``fn``, ``world_size``, ``args`` and ``timeout`` are
    known to be what :func:`labs.launcher.launch` takes; a TypeError or ValueError that says
    what to pass otherwise. ``link``: the launch emulates a network (gloo only)."""
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
    return choose_placement(backend, world_size, device, link=link)


def check_rank_args(rank_args: object, world_size: int) -> None:
    """Refuse ``rank_args`` that is not one tuple per rank."""
    if isinstance(rank_args, (str, bytes)) or not isinstance(rank_args, Sequence) or any(
            isinstance(a, (str, bytes)) or not isinstance(a, Sequence) for a in rank_args):
        raise TypeError("rank_args must be a sequence of one tuple per rank, e.g. "
                        "rank_args=[(x0,), (x1,)] for two ranks.")
    if len(rank_args) != world_size:
        raise ValueError(f"rank_args holds {len(rank_args)} tuple(s) for {world_size} rank(s): "
                         "give one per rank.")


def choose_placement(backend: object, ranks_here: int, device: object = Device.AUTO, *,
                     link: bool = False, ranks: str = "world_size") -> Placement:
    """The placement of ``ranks_here`` ranks on this machine, from the GPUs it has
    (``ranks`` names that number in an error message): :func:`pick_placement` decides."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pick_placement(backend, ranks_here, gpus, dist.is_nccl_available(), device,
                          link=link, ranks=ranks)


def pick_placement(backend: object, ranks_here: int, gpus: int, nccl_available: bool,
                   device: object = Device.AUTO, *, link: bool = False,
                   ranks: str = "world_size") -> Placement:
    """One rule. ``backend="auto"`` is nccl when each of the ``ranks_here`` processes on this
    machine can have a GPU of its own, the build has NCCL and no emulated ``link`` is asked
    for (the link carries gloo's messages); otherwise gloo. ``device="auto"`` computes on the
    GPUs whenever there is one, so that one machine's runs never mix devices between the rows
    of a table: 1 rank on nccl, 2-8 ranks on gloo sharing the one GPU. ``"nccl"`` without one
    GPU per process, ``device="cuda"`` without a GPU and nccl on the CPU are errors.

    The answer depends only on numbers every process of a machine shares, so all of them
    pick the same backend: a process group whose ranks disagree waits forever."""
    names = {"auto", *(b.value for b in Backend)}
    backend = backend.value if isinstance(backend, Backend) else backend
    if backend not in names:
        raise ValueError(f"backend must be one of {sorted(names)}, got {backend!r}.")
    devices = [d.value for d in Device]
    device = device.value if isinstance(device, Device) else device
    if device not in devices:
        raise ValueError(f"device must be one of {devices}, got {device!r}.")
    if device == Device.CUDA.value and gpus == 0:
        raise ValueError("device='cuda' but no GPU is visible here; use device='cpu' "
                         "(or 'auto', which takes the CPU when there is no GPU).")
    if backend == Backend.NCCL.value:
        if device == Device.CPU.value:
            raise ValueError("nccl carries CUDA tensors only; use backend='gloo' with "
                             "device='cpu'.")
        if link:
            raise ValueError("the emulated link runs on gloo (ranks on one machine, one "
                             "clock): pass backend='gloo' (or 'auto') with link=.")
        if gpus < ranks_here:
            raise ValueError(
                f"NCCL needs one GPU per rank; use backend='gloo' "
                f"({ranks}={ranks_here}, GPUs visible: {gpus})."
            )
        if not nccl_available:
            raise ValueError("this torch build has no NCCL; use backend='gloo'.")
        return Placement(Backend.NCCL, ranks_here)
    on_gpus = 0 if device == Device.CPU.value else gpus
    if backend == "auto" and on_gpus >= ranks_here and nccl_available and not link:
        return Placement(Backend.NCCL, ranks_here)
    return Placement(Backend.GLOO, min(on_gpus, ranks_here))


def pick_backend(backend: object, ranks_here: int, gpus: int, nccl_available: bool, *,
                 ranks: str = "world_size") -> Backend:
    """The backend of :func:`pick_placement` with the device left to ``auto``."""
    return pick_placement(backend, ranks_here, gpus, nccl_available, ranks=ranks).backend


#: Set in every rank's environment by :func:`enter`: its device (``cuda:0``, ``cpu``), which
#: :func:`labs.launcher.rank_device` reads, and whether every message is staged through host
#: memory (:mod:`labs.staging`).
DEVICE_VARIABLE, STAGING_VARIABLE = "LABS_DEVICE", "LABS_HOST_STAGING"


def enter(placement: Placement, local_rank: int, *, host_staging: bool = False) -> None:
    """Make this process the rank ``local_rank`` of ``placement`` on its machine, before its
    group is made: its GPU the current device, and the variables above set."""
    device = placement.device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ[DEVICE_VARIABLE] = str(device)
    os.environ[STAGING_VARIABLE] = "1" if host_staging else "0"


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(world_size: int) -> int:
    """Each rank's intra-op threads when the caller gives none: the cores shared out."""
    # N ranks with the default thread count each would oversubscribe the cores many times over.
    return max(1, cpu_cores() // world_size)
