"""The torch.distributed collectives of :class:`labs.fsdp.FSDP`, started asynchronously.

With ``collectives=Algorithm.TORCH`` (the default) FSDP gathers a unit's parameters with
:func:`all_gather_into` and reduce-scatters its gradient with :func:`reduce_scatter_from`,
both asynchronous: the all-gather of the next unit travels while this one computes, and a
:class:`Reduction` in flight lands when the next unit's gradient is complete. Per rank, for a
unit of S bytes: (N-1)/N x S sent by each. (``Algorithm.RING`` uses chapters 3 and 4's rings of
:mod:`labs.collectives` instead, one message at a time, every byte counted; with ``prefetch``
they run on a communication stream and land as a :class:`StreamReduction`.)

Kept apart from the wrapper that uses them, as torch's ``_fully_shard`` keeps
``_fsdp_collectives`` apart from its parameter groups.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from labs import staging
from labs.collectives import Recorder, ring_all_gather, ring_reduce_scatter
from labs.fsdp_timeline import Activity, FSDPTimeline, Interval


@dataclass
class Reduction:
    """An in-flight reduce-scatter of a unit's full gradient (torch collectives)."""

    work: Any
    """The ``dist.Work`` to wait for."""
    full_grad: torch.Tensor
    """The input: it must live until the work is done."""
    received: torch.Tensor
    """The output shard, or (all-to-all) the N pieces of this rank's shard, one per rank."""
    pieces: int
    """How many pieces ``received`` holds (1: the shard itself)."""
    #: What :meth:`land` returns is the sum over the shard group only: under HSDP it is still
    #: to be all-reduced across the groups.
    summed_across = False

    def land(self) -> torch.Tensor:
        """Wait; return this rank's shard of the sum over ranks.

        The full gradient (and the all-to-all's N pieces) are freed here, not left to
        reference counting: a backend may hold a finished work's tensors a little longer
        (gloo's worker thread lets go of them a moment after ``wait()`` returns, a quarter of
        the time on 2 cores), and an S-sized gradient would stay allocated, and measured,
        into the optimizer step. On a GPU ``wait()`` has ordered this stream after the
        collective, so the memory is not reused before the collective has read it."""
        self.work.wait()
        self.full_grad.untyped_storage().resize_(0)
        if self.pieces == 1:
            return self.received
        summed = self.received.view(self.pieces, -1).sum(0)  # 1-D, shard numel
        self.received.untyped_storage().resize_(0)
        return summed


@dataclass
class StreamReduction:
    """A reduce-scatter handed to FSDP's communication stream (``Algorithm.RING`` with
    ``prefetch``): the stream's thread runs the ring's reduce-scatter (and, under HSDP, the
    all-reduce across groups) and leaves the result in ``out``."""

    future: Future[None]
    """The stream's future for the job."""
    out: list[torch.Tensor] = field(default_factory=list)
    """Filled by the job: this rank's shard of the sum over every rank (1-D, shard numel)."""
    #: The job has already all-reduced across the groups (HSDP): :meth:`land` gives the sum
    #: over all N ranks.
    summed_across = True

    def land(self) -> torch.Tensor:
        """Wait for the job (re-raising its failure); return the summed shard."""
        self.future.result()
        return self.out.pop()


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None
                    ) -> Any:
    """torch.distributed's all-gather of equal shards into ``out``, asynchronously."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if staging.needed(shard, str(dist.get_backend(group))):
        return staging.staged(fn, out, shard, group=group, async_op=True)
    return fn(out, shard, group=group, async_op=True)


def reduce_scatter_from(full_grad: torch.Tensor, world_size: int,
                        group: dist.ProcessGroup | None) -> Reduction:
    """Start a reduce-scatter (SUM) of ``full_grad`` (1-D, N x shard), asynchronously.

    gloo has no reduce-scatter of its own: torch's ``reduce_scatter_tensor`` on gloo is an
    all-reduce of the whole tensor followed by a copy, twice the bytes of a reduce-scatter.
    On gloo this sends piece j of the gradient to rank j with one all-to-all and sums the N
    pieces that arrive, the direct algorithm: (N-1)/N x S sent per rank, as in the ring, in
    the background, at the cost of an S-sized receive buffer while it is in flight."""
    shard_numel = full_grad.numel() // world_size
    backend = str(dist.get_backend(group))
    # Ranks sharing a GPU under gloo: the tensors go through host memory (labs.staging).
    start = staging.staged if staging.needed(full_grad, backend) else _unstaged
    if world_size > 1 and backend == "gloo":
        received = torch.empty_like(full_grad)
        work = start(dist.all_to_all_single, received, full_grad, group=group, async_op=True)
        return Reduction(work, full_grad, received, world_size)
    out = torch.empty(shard_numel, dtype=full_grad.dtype, device=full_grad.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return Reduction(start(fn, out, full_grad, group=group, async_op=True), full_grad, out, 1)


def _unstaged(collective: Callable[..., Any], out: torch.Tensor, tensor: torch.Tensor,
              **kwargs: Any) -> Any:
    """``collective(out, tensor, **kwargs)``: :func:`labs.staging.staged`'s signature, for a
    backend that carries the tensors itself."""
    return collective(out, tensor, **kwargs)


def gather_on_stream(shard: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None,
                     recorder: Recorder | None, timed: tuple[FSDPTimeline, str]) -> None:
    """A :class:`~labs.ddp.CommStream` job: the ring's all-gather of ``shard`` into ``out``
    (a unit's full vector, N x shard numel), appended to ``timed``'s timeline under its unit's
    name."""
    timeline, name = timed
    start = timeline.clock.stamp()
    ring_all_gather(shard, group=group, recorder=recorder, out=out)
    timeline.intervals.append(Interval(name, Activity.ALL_GATHER, start,
                                       timeline.clock.stamp()))


def reduce_on_stream(full_grad: torch.Tensor, out: list[torch.Tensor],
                     group: dist.ProcessGroup | None, recorder: Recorder | None,
                     across: Callable[[torch.Tensor], torch.Tensor],
                     timed: tuple[FSDPTimeline, str]) -> None:
    """A :class:`~labs.ddp.CommStream` job: the ring's reduce-scatter of a unit's full
    gradient, then ``across`` (HSDP's all-reduce of the shard across groups; the identity
    for FSDP); the shard goes into ``out``, for :meth:`StreamReduction.land`."""
    timeline, name = timed
    start = timeline.clock.stamp()
    mine = ring_reduce_scatter(full_grad, group=group, recorder=recorder)
    del full_grad  # the S-sized gradient goes as soon as it is reduced
    out.append(across(mine))
    timeline.intervals.append(Interval(name, Activity.REDUCE_SCATTER, start,
                                       timeline.clock.stamp()))
