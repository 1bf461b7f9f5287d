"""Which data-parallel wrapper holds the model: one enum for every chapter, and the one
factory that builds each wrapper with its optimizer.

Chapter 5 compares the wrappers that replicate the model and average the gradients
(:data:`DDP_WRAPPERS`, plus :attr:`Wrapper.LOCAL`, the floor with no communication at all);
chapter 6 goes down the ZeRO stages (:data:`ZERO_STAGES`), each sharding one more part of the
training state, and sets torch's ``fully_shard`` beside the course's FSDP; chapter 8 shards
inside a node and replicates across nodes (:data:`HSDP_STRATEGIES`).

    model, optimizer = build(Wrapper.ZERO2, net, torch.optim.Adam, lr=1e-3)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labs.ddp import DDP, DEFAULT_BUCKET_CAP_MB, NaiveDDP
from labs.fsdp import FSDP
from labs.launcher import rank_device
from labs.zero import ShardedOptimizer, ZeroStage


class Wrapper(enum.Enum):
    """A way of sharing the training state between the ranks (the value is its label in
    tables and figures)."""

    LOCAL = "no sync"
    """No communication at all: each rank trains alone (the compute-only floor; at one rank,
    the reference that every wrapper must match)."""
    NAIVE = "NaiveDDP"
    """:class:`labs.ddp.NaiveDDP`: one blocking all-reduce per parameter after backward."""
    DDP = "DDP"
    """:class:`labs.ddp.DDP`: flat buckets, all-reduced asynchronously during backward
    (ZeRO stage 0: everything replicated)."""
    TORCH_DDP = "torch DDP"
    """``torch.nn.parallel.DistributedDataParallel``: the same idea in C++."""
    ZERO1 = "ZeRO-1"
    """:class:`labs.zero.ShardedOptimizer`: the optimizer state sharded."""
    ZERO2 = "ZeRO-2"
    """:class:`labs.zero.ShardedOptimizer`: the optimizer state and the gradients sharded."""
    FSDP = "FSDP (ZeRO-3)"
    """:class:`labs.fsdp.FSDP`: everything sharded, parameters gathered one unit at a time."""
    HSDP = "HSDP"
    """``FSDP(shard_size=g)`` (chapter 8): sharded inside each group of g ranks (a node),
    replicated across the groups, the gradients' shards all-reduced between them."""
    FULLY_SHARD = "torch fully_shard (FSDP2)"
    """torch's ZeRO-3 (:mod:`labs.fsdp_torch` builds and compares it)."""

    @property
    def stage(self) -> int | None:
        """The ZeRO stage: 0 for the wrappers that replicate everything, 3 for FSDP and
        ``fully_shard``, None for :attr:`LOCAL` (no sharing at all)."""
        return _STAGES.get(self)


_STAGES = {Wrapper.NAIVE: 0, Wrapper.DDP: 0, Wrapper.TORCH_DDP: 0, Wrapper.ZERO1: 1,
           Wrapper.ZERO2: 2, Wrapper.FSDP: 3, Wrapper.HSDP: 3, Wrapper.FULLY_SHARD: 3}

#: Chapter 5's wrappers: replicate the model, average the gradients.
DDP_WRAPPERS = (Wrapper.NAIVE, Wrapper.DDP, Wrapper.TORCH_DDP)
#: Chapter 6's stages, in order, built by the course's own code.
ZERO_STAGES = (Wrapper.DDP, Wrapper.ZERO1, Wrapper.ZERO2, Wrapper.FSDP)
#: Chapter 8's three ways over nodes: replicate everything, shard over all N, shard in a node.
HSDP_STRATEGIES = (Wrapper.DDP, Wrapper.FSDP, Wrapper.HSDP)


def wrap(wrapper: Wrapper, model: nn.Module, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
         observer: Callable[[enum.Enum, str], None] | None = None, *,
         shard_size: int | None = None) -> nn.Module:
    """``model`` on this rank's device, wrapped by ``wrapper``. ZeRO-1 and ZeRO-2 shard in the
    optimizer and return the model itself (see :func:`build`). ``bucket_cap_mb`` is the bucket
    size of DDP and torch DDP; ``observer`` is told FSDP's events (:class:`labs.fsdp.Event`);
    ``shard_size`` is HSDP's group g (it must divide the world size)."""
    if wrapper is Wrapper.HSDP and shard_size is None:
        raise ValueError("Wrapper.HSDP shards inside groups of shard_size ranks: pass "
                         "shard_size=g, a divisor of the world size (e.g. the GPUs per node).")
    device = rank_device()
    model = model.to(device)
    if wrapper is Wrapper.NAIVE:
        return NaiveDDP(model)
    if wrapper is Wrapper.DDP:
        return DDP(model, bucket_cap_mb=bucket_cap_mb)
    if wrapper is Wrapper.TORCH_DDP:
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                   bucket_cap_mb=bucket_cap_mb)
    if wrapper is Wrapper.FSDP:
        return FSDP(model, observer=observer)
    if wrapper is Wrapper.HSDP:
        return FSDP(model, observer=observer, shard_size=shard_size)
    if wrapper is Wrapper.FULLY_SHARD:
        raise ValueError("Wrapper.FULLY_SHARD is torch's own ZeRO-3: labs.fsdp_torch builds it "
                         "(compare_on_ranks), after checking that this torch has it.")
    return model


def build(wrapper: Wrapper, model: nn.Module, optimizer: type[torch.optim.Optimizer],
          *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
          observer: Callable[[enum.Enum, str], None] | None = None,
          shard_size: int | None = None,
          **optimizer_args: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(model, optimizer)`` for ``wrapper``: the model as :func:`wrap` returns it, and
    ``optimizer(params, **optimizer_args)`` over what this rank updates: all the parameters
    (replicated wrappers), the flat shards (FSDP, HSDP), or a :class:`labs.zero.ShardedOptimizer`
    around it (ZeRO-1 and ZeRO-2, which tell ``observer`` each gradient's reduce-scatter)."""
    if wrapper in (Wrapper.ZERO1, Wrapper.ZERO2):
        model = model.to(rank_device())
        stage = ZeroStage.OPTIMIZER if wrapper is Wrapper.ZERO1 else ZeroStage.GRADIENTS
        return model, ShardedOptimizer(model.named_parameters(), optimizer, stage=stage,
                                       observer=observer, **optimizer_args)
    wrapped = wrap(wrapper, model, bucket_cap_mb, observer, shard_size=shard_size)
    return wrapped, optimizer(wrapped.parameters(), **optimizer_args)


def synchronise(model: nn.Module) -> None:
    """After backward: labs' wrappers average here; torch DDP already did during backward."""
    finish = getattr(model, "finish_gradient_synchronization", None)
    if finish is not None:
        finish()
