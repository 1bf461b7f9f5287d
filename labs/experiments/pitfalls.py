"""Chapter 5's pitfalls, each shown on real ranks: a parameter unused in forward, changing the
model after wrapping it, logging and checkpointing from every rank, and seeding.

Each ``*_worker`` runs inside a rank. The ones that go wrong on purpose are launched by the
notebook with a short timeout, so a mistake that hangs becomes a ``LaunchTimeout`` (naming the
stuck ranks) instead of a frozen notebook, and a mistake that raises becomes a ``RankError``
(naming the rank, with its traceback).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labs.launcher import rank_device
from labs.wrappers import Wrapper, synchronise, wrap


class TwoHeads(nn.Module):
    """A trunk and two heads; ``forward`` uses the second head only if asked to."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
            torch.manual_seed(seed)
            self.trunk = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)
            self.aux_head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        return out + self.aux_head(h) if use_aux else out


def unused_parameter_worker(rank: int, world_size: int, wrapper: Wrapper,
                            find_unused: bool, steps: int = 3,
                            aux_on: tuple[int, ...] = ()) -> str:
    """Train ``steps`` steps of :class:`TwoHeads`, its ``aux_head`` used only by the ranks
    in ``aux_on`` (by default by none)."""
    model = TwoHeads().to(rank_device())
    if wrapper is Wrapper.TORCH_DDP:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, find_unused_parameters=find_unused)
    else:
        from labs.ddp import DDP

        model = DDP(model, find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(rank_device())
    for _ in range(steps):
        optimizer.zero_grad()
        model(x, use_aux=rank in aux_on).square().mean().backward()
        synchronise(model)
        optimizer.step()
    grad = model.module.aux_head.weight.grad
    return f"{steps} steps done; aux_head.weight.grad is {'None' if grad is None else 'set'}"


@dataclass(frozen=True)
class Drift:
    """How far rank ``rank``'s parameters are from rank 0's after training."""

    rank: int
    max_difference: float


def _difference_from_rank0(params: Iterable[torch.Tensor]) -> float:
    """The largest |difference| between this rank's parameters and rank 0's (rank 0
    broadcasts its own; every rank must call this)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(rank_device())
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return (flat - reference).abs().max().item()


def unused_parameter_first_step_worker(rank: int, world_size: int, find_unused: bool) -> Drift:
    """One step of torch's DDP on :class:`TwoHeads` without its ``aux_head``, on rank-specific
    data, then how far this rank's parameters are from rank 0's: 0 when the step used averaged
    gradients. (The error comes only at the second step's forward, so the first one runs.)"""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(TwoHeads().to(rank_device()),
                                    find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(rank_device())
    model(x).square().mean().backward()
    optimizer.step()
    return Drift(rank, _difference_from_rank0(model.module.parameters()))


class ChangeAfterWrapping(enum.Enum):
    """Ways of changing a model after wrapping it, shown by
    :func:`change_after_wrapping_worker`."""

    RANK0_EDITS_WEIGHTS = "rank 0 edits a weight in place"
    """``model.module.trunk.weight.mul_(2)`` on rank 0 only: nothing tells the others."""
    NEW_LAYER = "every rank replaces a layer"
    """``model.module.head = nn.Linear(...)`` on every rank: the new parameters are in no
    bucket, so their gradients are never averaged."""
    NOTHING = "no change"
    """The control: the ranks stay equal."""


def change_after_wrapping_worker(rank: int, world_size: int, change: ChangeAfterWrapping,
                                 wrapper: Wrapper, steps: int = 5) -> Drift:
    """Wrap, make ``change``, train ``steps`` steps on rank-specific data, then measure the
    largest difference between this rank's parameters and rank 0's."""
    model = wrap(wrapper, TwoHeads(), 25.0)
    if change is ChangeAfterWrapping.RANK0_EDITS_WEIGHTS and rank == 0:
        with torch.no_grad():
            model.module.trunk.weight.mul_(2)
    if change is ChangeAfterWrapping.NEW_LAYER:
        torch.manual_seed(1)  # the same new layer on every rank
        model.module.head = nn.Linear(8, 2).to(rank_device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # sees the new layer, if any
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(rank_device())
    for _ in range(steps):
        optimizer.zero_grad()
        model(x, use_aux=True).square().mean().backward()
        synchronise(model)
        optimizer.step()
    return Drift(rank, _difference_from_rank0(model.module.parameters()))


class Logging(enum.Enum):
    """Who prints the loss at a logging step."""

    EVERY_RANK = "every rank prints its own loss"
    """N lines per logging step, each the loss of one rank's shard of the batch."""
    RANK_ZERO = "rank 0 prints its own loss"
    """One line, but the loss of rank 0's shard only: noisier than the batch's loss."""
    RANK_ZERO_AVERAGED = "rank 0 prints the loss averaged over ranks"
    """One line with the batch's loss: every rank joins an all-reduce, rank 0 prints."""


def logging_worker(rank: int, world_size: int, mode: Logging) -> None:
    loss = torch.tensor(0.25 * (rank + 1))  # each rank's loss on its own shard of the batch
    if mode is Logging.RANK_ZERO_AVERAGED:
        dist.all_reduce(loss)  # every rank calls it: a collective inside `if rank == 0` hangs
        loss /= world_size
    if mode is Logging.EVERY_RANK or rank == 0:
        print(f"step 10: loss {loss.item():.3f}")


@dataclass(frozen=True)
class CheckpointReport:
    """What rank ``rank`` saw of a checkpoint written by rank 0."""

    rank: int
    wrapper_keys: tuple[str, ...]
    module_keys: tuple[str, ...]
    differed_before: bool
    """A model built from another seed differed from the wrapped one before loading."""
    loaded_equal: bool
    """After loading the checkpoint, that model equals the wrapped one."""
    storage_device: str
    """The device the loaded tensors are on (``map_location`` chose it)."""


def checkpoint_worker(rank: int, world_size: int, path: str) -> CheckpointReport:
    """Rank 0 saves ``model.module.state_dict()`` (atomically: temp file, then rename);
    a barrier; every rank loads it with ``map_location`` set to its own device into a model
    built from a seed of its own, so only the load can make the two equal."""
    device = rank_device()
    model = wrap(Wrapper.DDP, TwoHeads(), 25.0)
    if rank == 0:
        tmp = f"{path}.tmp"
        torch.save(model.module.state_dict(), tmp)
        os.replace(tmp, path)  # a crash mid-save leaves the old checkpoint, not half a new one
    dist.barrier()  # nobody reads the file before rank 0 finished writing it
    state = torch.load(path, map_location=device, weights_only=True)  # tensors only
    fresh = TwoHeads(seed=1000 + rank).to(device)

    def same() -> bool:
        return all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                      model.module.state_dict().values(),
                                                      strict=True))

    differed = not same()
    fresh.load_state_dict(state)
    return CheckpointReport(rank, tuple(model.state_dict()), tuple(model.module.state_dict()),
                            differed, same(), str(next(iter(state.values())).device))


def seeding_worker(rank: int, world_size: int, wrapper: Wrapper) -> float:
    """Build the model from a *different* seed on every rank, wrap it, and return the
    largest difference from rank 0's parameters right after wrapping."""
    torch.manual_seed(100 + rank)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    if wrapper is not Wrapper.LOCAL:
        wrap(wrapper, net, 25.0)
    return _difference_from_rank0(net.parameters())
