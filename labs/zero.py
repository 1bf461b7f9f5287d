"""Chapter 6, part 1: ZeRO stages 1 and 2 (Rajbhandari et al., arXiv 1910.02054).

Data parallelism keeps N copies of everything: the parameters, their gradients and the
optimizer state. With Adam in fp32 that is 4 + 4 + 8 = 16 bytes per parameter on every rank.
ZeRO removes the copies one kind at a time:

* **Stage 1** (:class:`ShardedOptimizer`): the optimizer state. Every trainable parameter is
  flattened, padded to a multiple of N and cut into N equal shards; rank r keeps the
  optimizer state of shard r of every parameter and updates only that shard. The gradients
  are reduce-scattered (rank r receives the sum of shard r) and the updated shards are
  all-gathered back into the parameters. Per rank and step that is (N-1)/N * S for the
  reduce-scatter and (N-1)/N * S for the all-gather: the 2(N-1)/N * S of DDP's all-reduce, since
  a ring all-reduce *is* a reduce-scatter followed by an all-gather (chapter 4).
* **Stage 2** (``stage=ZeroStage.GRADIENTS``): the gradients too. A hook on every parameter
  reduce-scatters its gradient as soon as backward has produced it, keeps this rank's shard
  of the sum, and frees the full gradient (``p.grad = None``): a rank holds full gradients
  only for the parameters in flight. Same traffic.

Stage 3 shards the parameters themselves: :mod:`labs.fsdp`.

The collectives are those of :mod:`labs.collectives` (built on point-to-point messages, so
they run on gloo and nccl alike), and a :class:`~labs.collectives.Recorder` passed in counts
every byte this rank sends.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs.collectives import Recorder, ring_all_gather, ring_reduce_scatter


class ZeroStage(enum.Enum):
    """What :class:`ShardedOptimizer` shards besides the optimizer state."""

    OPTIMIZER = 1
    """ZeRO-1: optimizer state only; full gradients on every rank until the step."""
    GRADIENTS = 2
    """ZeRO-2: gradients too, reduce-scattered during backward."""


class GradientEvent(enum.Enum):
    """What a stage-2 :class:`ShardedOptimizer` observer is told, with the parameter's name
    (the value is the label chapter 6's memory timeline prints)."""

    REDUCE_SCATTER = "reduce-scatter gradient"
    """Backward has finished this parameter's full gradient and its reduce-scatter is about to
    start: the full gradient is still held."""


@dataclass
class ShardedParameter:
    """One parameter seen as N equal shards of its flattened, zero-padded values.

    ``param.data`` is re-pointed at ``padded[:numel]`` (viewed in its shape), so the shard this
    rank owns, ``padded[rank * shard_numel:(rank + 1) * shard_numel]``, is a *view* of the
    parameter: updating the shard updates the parameter, and no second copy is kept.
    """

    name: str
    param: nn.Parameter
    padded: torch.Tensor
    """1-D, numel = world_size * shard_numel; the parameter's values, then zeros."""
    shard: nn.Parameter
    """This rank's shard of ``padded`` (a view), what the local optimizer updates."""

    @property
    def numel(self) -> int:
        return self.param.numel()


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per shard: ``ceil(numel / world_size)`` (the last shards hold the padding)."""
    return math.ceil(numel / world_size)


def _shard_parameter(name: str, param: nn.Parameter, rank: int, world_size: int
                     ) -> ShardedParameter:
    k = shard_numel(param.numel(), world_size)
    padded = torch.zeros(k * world_size, dtype=param.dtype, device=param.device)  # 1-D
    padded[:param.numel()].copy_(param.detach().reshape(-1))
    param.data = padded[:param.numel()].view_as(param)  # the parameter now lives in `padded`
    shard = nn.Parameter(padded[rank * k:(rank + 1) * k])  # a view: numel = k
    return ShardedParameter(name, param, padded, shard)


def _flat_padded(tensor: torch.Tensor, padded_numel: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded to ``padded_numel`` (a copy only when padding)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == padded_numel:
        return flat
    out = torch.zeros(padded_numel, dtype=flat.dtype, device=flat.device)
    out[:flat.numel()].copy_(flat)
    return out


class ShardedOptimizer:
    """ZeRO stage 1 or 2 around any torch optimizer (``optimizer_cls(shards, **kwargs)``).

    It broadcasts rank 0's values of the parameters when it is built. Use it as the model's
    only gradient synchronisation (not inside DDP): after
    ``loss.backward()``, :meth:`step` reduce-scatters what stage 2 has not already
    reduce-scattered, averages, steps this rank's shards, and all-gathers every parameter.
    ``zero_grad()`` clears the full gradients and the shard gradients.

    Memory per rank, for P trainable parameters (measured in chapter 6): the parameters (4P
    bytes in fp32), the gradients (4P from backward until the step at stage 1, which frees each
    full gradient once it is reduce-scattered; about 4P/N plus one parameter's gradient in
    flight at stage 2), and the optimizer state of P/N parameters (8P/N for Adam).
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]],
                 optimizer_cls: Callable[..., torch.optim.Optimizer], *,
                 stage: ZeroStage = ZeroStage.OPTIMIZER,
                 process_group: dist.ProcessGroup | None = None,
                 recorder: Recorder | None = None,
                 observer: Callable[[GradientEvent, str], None] | None = None,
                 **kwargs: Any) -> None:
        """``observer`` (stage 2) is called with ``GradientEvent.REDUCE_SCATTER`` and the
        parameter's name as each gradient is about to be reduce-scattered, as
        :class:`~labs.fsdp.FSDP`'s observer is told its events: chapter 6's memory timeline
        snapshots there."""
        self.group = process_group
        self.observer = observer
        self.stage = stage
        self.recorder = recorder
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        named = [(p if isinstance(p, tuple) else (f"param{i}", p)) for i, p in enumerate(params)]
        seen: set[int] = set()
        self.sharded: list[ShardedParameter] = []
        root = dist.get_global_rank(process_group, 0) if process_group else 0
        for name, param in named:
            if id(param) in seen:
                continue  # a tied parameter: once
            seen.add(id(param))
            with torch.no_grad():  # every rank starts from rank 0's values, frozen ones too
                dist.broadcast(param, src=root, group=process_group)
            if param.requires_grad:  # frozen parameters are left whole
                self.sharded.append(_shard_parameter(name, param, self.rank, self.world_size))
        self.optimizer = optimizer_cls([s.shard for s in self.sharded], **kwargs)
        self._hooks = []
        if stage is ZeroStage.GRADIENTS:
            self._hooks = [s.param.register_post_accumulate_grad_hook(self._reduce_now)
                           for s in self.sharded]
        self._by_param = {id(s.param): s for s in self.sharded}

    # -- stage 2: during backward --

    def _reduce_now(self, param: nn.Parameter) -> None:
        """Reduce-scatter a full gradient the moment it is complete, keep this rank's shard
        of the sum (added to what earlier backward passes left), free the full gradient."""
        sharded = self._by_param[id(param)]
        if self.observer is not None:  # the full gradient is still there to see
            self.observer(GradientEvent.REDUCE_SCATTER, sharded.name)
        mean = self._reduce_scatter(sharded, param.grad) / self.world_size
        if sharded.shard.grad is None:
            sharded.shard.grad = mean
        else:
            sharded.shard.grad += mean
        param.grad = None  # the full gradient is gone: only the shard remains

    def _reduce_scatter(self, sharded: ShardedParameter, grad: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sum over ranks of ``grad`` (1-D, numel = shard numel)."""
        flat = _flat_padded(grad, sharded.padded.numel())
        return ring_reduce_scatter(flat, group=self.group, recorder=self.recorder)

    # -- the step --

    def _check_still_linked(self) -> None:
        """Every parameter must still live in its padded vector: ``model.to(...)``,
        ``.cuda()`` or ``.half()`` after building the optimizer gives a parameter new memory,
        and the step would then update shards that nothing reads."""
        for sharded in self.sharded:
            if sharded.param.data_ptr() != sharded.padded.data_ptr():
                raise RuntimeError(
                    f"ShardedOptimizer: parameter {sharded.name} no longer lives in the "
                    f"memory the optimizer shards (it is now {sharded.param.dtype} on "
                    f"{sharded.param.device}; the shards are {sharded.padded.dtype} on "
                    f"{sharded.padded.device}). Move or cast the model (model.to(...), "
                    ".cuda(), .half()) before building the ShardedOptimizer, not after.")

    def step(self) -> None:
        """Average the gradients' shards, step them, and all-gather every parameter."""
        self._check_still_linked()
        for sharded in self.sharded if self.stage is ZeroStage.OPTIMIZER else ():
            if sharded.param.grad is None:
                raise RuntimeError(
                    f"ShardedOptimizer: {sharded.name} has no gradient on this rank, so this "
                    "rank cannot make the same reduce-scatters as the others (they would "
                    "wait for it). Use the parameter in the loss on every rank, or freeze it "
                    "(requires_grad=False) before building the optimizer.")
            summed = self._reduce_scatter(sharded, sharded.param.grad)
            sharded.shard.grad = summed / self.world_size  # the mean of this shard
            sharded.param.grad = None  # reduce-scattered: the shard is all the step needs
        self.optimizer.step()
        with torch.no_grad():
            for sharded in self.sharded:  # every rank's updated shard, into the parameter
                ring_all_gather(sharded.shard.detach().clone(), group=self.group,
                                recorder=self.recorder, out=sharded.padded)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for sharded in self.sharded:
            for tensor in (sharded.param, sharded.shard):
                if set_to_none:
                    tensor.grad = None
                elif tensor.grad is not None:
                    tensor.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (every tensor in ``optimizer.state``)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
