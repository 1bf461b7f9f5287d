"""Timing single messages and additions on real ranks: the micro-benchmarks of the cost model.

The alpha-beta model of chapter 2 (:mod:`labs.cost_model`) prices a message of m bytes at
``alpha + beta * m`` and the reduction of m bytes at ``gamma * m``. :func:`time_p2p` times
messages between ranks (:class:`P2PPattern`: an exchange, a ping-pong, or a whole ring step)
and :func:`time_reduction` times ``torch.add`` on every rank at once; both are workers that
``launch`` runs on every rank, and return one :class:`PointTiming` per size, its time the
slowest rank's. The timing of whole collectives is :mod:`labs.experiments.timing`.
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.clock import synchronize
from labs.collectives import exchange
from labs.experiments.timing import Statistic, check_iters
from labs.launcher import rank_device
from labs.p2p import Peers

# Ranks import this module to find their workers (time_p2p, time_reduction), so it imports
# nothing heavy.


@dataclass(frozen=True)
class PointTiming:
    """One size of a micro-benchmark: the median and every iteration's seconds."""

    size_bytes: int
    seconds: float
    all_seconds: tuple[float, ...]

    def summary(self, statistic: Statistic) -> float:
        """The median (= ``seconds``) or the minimum over iterations."""
        return statistic.of(self.all_seconds)


def _check_sizes(sizes: object, iters: object, warmup: object) -> list[int]:
    """``sizes`` as a list of float32 byte counts, with ``iters`` and ``warmup`` checked."""
    try:
        found = list(sizes)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}.") from None
    if not found or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 or s % 4
                        for s in found):
        raise ValueError(f"sizes must be a non-empty list of byte counts, each a multiple of 4 "
                         f"(float32 elements), got {sizes!r}.")
    check_iters(iters, warmup)
    return found


class P2PPattern(enum.Enum):
    """How :func:`time_p2p` moves a message of m bytes between ranks."""

    #: Ranks 0 and 1 send m bytes to each other at once and wait for both: one step of a ring
    #: or one round of recursive doubling, on two ranks. Its time is the slower rank's; the
    #: other ranks idle.
    EXCHANGE = "exchange"
    #: Rank 0 sends m bytes, rank 1 sends them back: the time is half the round trip, one
    #: message on an otherwise idle link (the textbook measurement of alpha and beta).
    PING_PONG = "ping-pong"
    #: Every rank sends m bytes to rank + 1 while receiving m bytes from rank - 1: one step
    #: of a ring with all N ranks busy, as in a real collective. Its time is the slowest
    #: rank's, so on more ranks than cores it includes the waits for a core. On two ranks it
    #: is :attr:`EXCHANGE`.
    RING_STEP = "ring-step"


def time_p2p(
    rank: int, world_size: int, sizes: Sequence[int], iters: int = 20, warmup: int = 2,
    pattern: P2PPattern = P2PPattern.EXCHANGE,
) -> list[PointTiming]:
    """Time a message of each size in ``sizes`` between ranks 0 and 1 (others wait at the
    barriers), or round the whole ring: what the alpha-beta model calls ``alpha + beta * m``.

    With ``P2PPattern.EXCHANGE`` (the default) both ranks send and receive m bytes at once,
    as every step of the ring does. On one machine this is not the same as a one-way message:
    loopback "links" are memory copies made by the CPUs, so sending and receiving at once
    share them, where a network link would carry both directions at full speed.
    ``P2PPattern.RING_STEP`` has every rank do the same at once with its two neighbours.
    Needs ``world_size >= 2``. Every rank returns the same list.
    """
    found = _check_sizes(sizes, iters, warmup)
    if world_size < 2:
        raise ValueError("time_p2p needs two ranks: launch it with world_size >= 2.")
    if not isinstance(pattern, P2PPattern):
        raise TypeError(f"pattern must be a P2PPattern, got {pattern!r}.")
    device = rank_device()  # its own GPU under NCCL, else the CPU
    peers = Peers.of(None, None)
    seconds = torch.zeros(len(found), iters, dtype=torch.float64)
    source = _p2p_source(rank, world_size, pattern)
    for i, size in enumerate(found):
        # Each rank sends its own number, so the received values name the rank they came from.
        outgoing = torch.full((size // 4,), float(rank), dtype=torch.float32, device=device)
        incoming = torch.full_like(outgoing, -1.0)
        for it in range(warmup + iters):
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            if pattern is P2PPattern.RING_STEP:
                exchange(outgoing, rank + 1, incoming, rank - 1)  # ranks taken mod N
            elif rank < 2 and pattern is P2PPattern.EXCHANGE:
                exchange(outgoing, 1 - rank, incoming, 1 - rank)  # as the ring's steps do
            elif rank == 0:  # labs' messages: a CUDA tensor on gloo goes through host memory
                peers.isend(outgoing, 1).wait()
                peers.irecv(incoming, 1).wait()
            elif rank == 1:
                peers.irecv(incoming, 0).wait()
                peers.isend(incoming, 0).wait()
            synchronize(device)
            took = time.perf_counter() - start
            if it >= warmup and (rank < 2 or pattern is P2PPattern.RING_STEP):
                seconds[i, it - warmup] = took / (2 if pattern is P2PPattern.PING_PONG else 1)
        if source is not None and not bool((incoming == source).all()):
            raise RuntimeError(f"rank {rank}: the {pattern.value} messages of {size} bytes did "
                               f"not come from rank {source}; the timings would not be of them.")
    return _gather_points(found, seconds, device)


def _p2p_source(rank: int, world_size: int, pattern: P2PPattern) -> int | None:
    """The rank whose number ``rank`` holds after a :func:`time_p2p` message (None: it takes
    no part). In a ping-pong rank 1 sends rank 0's message back."""
    if pattern is P2PPattern.RING_STEP:
        return (rank - 1) % world_size
    if rank >= 2:
        return None
    return 1 - rank if pattern is P2PPattern.EXCHANGE else 0


def time_reduction(
    rank: int, world_size: int, sizes: Sequence[int], iters: int = 20, warmup: int = 2,
) -> list[PointTiming]:
    """Every rank at once times ``torch.add(a, b, out=c)`` on m bytes of float32: the
    reduction a ring step does on each chunk it receives (the cost model's gamma). All ranks
    run it together because in a ring they all reduce at the same time and share the cores.
    A time is the slowest rank's."""
    found = _check_sizes(sizes, iters, warmup)
    device = rank_device()  # its own GPU under NCCL, else the CPU
    seconds = torch.zeros(len(found), iters, dtype=torch.float64)
    for i, size in enumerate(found):
        a = torch.ones(size // 4, dtype=torch.float32, device=device)
        b, out = torch.ones_like(a), torch.empty_like(a)
        for it in range(warmup + iters):
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            torch.add(a, b, out=out)
            synchronize(device)
            if it >= warmup:
                seconds[i, it - warmup] = time.perf_counter() - start
    return _gather_points(found, seconds, device)


def _gather_points(sizes: list[int], seconds: torch.Tensor,
                   device: torch.device) -> list[PointTiming]:
    slowest = seconds.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    points = []
    for i, size in enumerate(sizes):
        times = tuple(float(t) for t in slowest[i].cpu())
        points.append(PointTiming(size, statistics.median(times), times))
    return points
