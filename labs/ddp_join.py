"""``DDP.join()``: labs' DDP on ranks that hold different numbers of batches, as torch DDP's
``join()`` (:class:`labs.ddp.DDP` inherits :class:`JoinMixin`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class JoinMixin:
    """What :class:`labs.ddp.DDP` needs to shadow the steps of peers that still train."""

    buckets: list[Any]
    process_group: dist.ProcessGroup | None
    world_size: int
    find_unused_parameters: bool
    module: nn.Module
    _params: list[nn.Parameter]
    _joining: bool | None
    _divisor: int

    def _broadcast_buffers(self) -> None:  # labs.ddp.DDP's
        raise NotImplementedError

    def _sum_over_ranks(self, tensor: torch.Tensor) -> None:  # labs.ddp.DDP's
        raise NotImplementedError

    def _count_training(self, mine: float) -> float:
        flag = torch.tensor([mine], device=self._device())
        dist.all_reduce(flag, group=self.process_group)
        return float(flag.item())

    def _device(self) -> torch.device:
        return self.buckets[0].buffer.device if self.buckets else torch.device("cpu")

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True) -> Iterator[None]:
        """Train ranks that hold different numbers of batches, as torch DDP's ``join()``.

        Inside the block every forward first all-reduces a 1 from each rank still training.
        A rank that leaves the block (it ran out of batches) *shadows* its peers' steps: for
        each of them it all-reduces a 0 (the count), its buffers when they are broadcast, then
        every bucket filled with zeros, in bucket order: the collectives its peers issue, so
        that nobody waits for it. The gradients are the sum over the ranks still training,
        divided by N (``divide_by_initial_world_size=True``, torch's default) or by how many
        ranks still train. Once the count is 0 (every rank has left) the ranks agree on the
        last one to leave, whose parameters are the trained ones, and it broadcasts them (and
        the buffers) to every rank."""
        if self._joining is not None:
            raise RuntimeError("DDP.join(): already inside a join() block of this model.")
        self._joining = bool(divide_by_initial_world_size)
        try:
            yield
        finally:
            self._joining = None
        last = True  # nobody trains after me, unless a peer's count says otherwise
        while True:
            if self._count_training(0.0) == 0:
                break
            last = False
            self._shadow_step()
        self._divisor = self.world_size
        self._sync_final_model(last)

    def _shadow_step(self) -> None:
        """One step of the peers still training, matched with zeros."""
        self._broadcast_buffers()
        for bucket in self.buckets:
            zeros = torch.zeros_like(bucket.buffer)
            self._sum_over_ranks(zeros)  # as DDP's buckets go
        if self.find_unused_parameters and self._params:
            flags = torch.zeros(len(self._params), dtype=torch.int32, device=self._device())
            dist.all_reduce(flags, group=self.process_group)

    def _sync_final_model(self, last: bool) -> None:
        """The highest rank among the last to leave broadcasts its parameters and buffers."""
        me = dist.get_rank(self.process_group)
        choice = torch.tensor([me if last else -1], device=self._device())
        dist.all_reduce(choice, op=dist.ReduceOp.MAX, group=self.process_group)
        source = int(choice.item())
        if self.process_group is not None:
            source = dist.get_global_rank(self.process_group, source)
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor, src=source, group=self.process_group)
