"""Benchmarks that print tables (never timed assertions in tests).

    python -m labs.bench launch [--world-sizes 1 2 4 8] [--repeats 5] [--methods forkserver spawn]
    python -m labs.bench collectives [--collectives all-reduce ...] [--algorithms ring torch ...]
        [--sizes 1K 64K 1M 16M] [--world-sizes 2 4] [--backends gloo nccl] [--iters 5]
        [--warmup 1] [--dtype float32] [--segment-bytes 1M] [--window 4]
        [--out _build/bench/collectives.csv] [--plot PATH.png]
    python -m labs.bench ddp [--world-size 2] [--bucket-cap-mb 25] [--launches 3] (see --help)
    python -m labs.bench fsdp [--memory-world-size 4] [--time-world-size 2] (see --help)

``launch``: the price a learner pays per widget click. For each start method and world size a
fresh Python process imports ``labs`` (torch included, as a notebook kernel already has), then
times its first ``launch`` of a trivial function (this includes starting the forkserver) and
the median of ``--repeats`` later launches.

``collectives``: an nccl-tests style sweep of the collectives of :mod:`labs.collectives`
against torch's built-in ones. One launch per backend and world size runs every case of that
world size, so starting processes is never part of a timing. For each case it reports the
median over iterations of the slowest rank's time per call, the algorithm bandwidth
``algbw = S / time`` and the bus bandwidth ``busbw = algbw x bus factor`` (2(N-1)/N for
all-reduce, (N-1)/N for reduce-scatter and all-gather: the bytes each rank must move over its
link per byte of S, so busbw can be compared with a link's speed whatever N is). Every call's
result is compared with the exact answer (integer-valued inputs, so sums are exact), torch's
built-in included.
"""

from __future__ import annotations

import argparse
import csv
import enum
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from labs.bench_ddp import add_ddp_parser, ddp_main
from labs.bench_fsdp import add_fsdp_parser, fsdp_main
from labs.collectives import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_WINDOW,
    Algorithm,
    Collective,
    RingBuffers,
    all_reduce,
    builtin_all_gather,
    builtin_reduce_scatter,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    shard_bounds,
)
from labs.collectives import all_gather as _all_gather
from labs.collectives import reduce_scatter as _reduce_scatter
from labs.launch import MAX_WORLD_SIZE, Backend, StartMethod, launch, rank_device

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Ranks import this module to find their workers (time_collectives, time_p2p, ...), so it
# imports nothing heavy at the top: tqdm and labs.viz (which pulls in matplotlib) are imported
# where the table or the figure is made.

#: The floating-point dtypes a sweep may use. Inputs are small integers (|x| <= 8), so the sum
#: over up to MAX_WORLD_SIZE ranks (|sum| <= 256) is exact in every one of them, bfloat16's
#: 8 significant bits included: a correct result is bit-identical to the exact one.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: The seed of every input of the sweeps (rank r draws from SEED + r).
SEED = 1234
#: Default sizes of ``python -m labs.bench collectives`` (about two minutes on 2 cores).
DEFAULT_SIZES: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 24)
#: Default output of ``python -m labs.bench collectives``.
DEFAULT_OUT = Path("_build/bench/collectives.csv")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# --- what is measured --------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"`` (or ``"torch.float32"``) -> ``torch.float32``; only the :data:`DTYPES`."""
    for dtype in DTYPES:
        if name in (dtype_name(dtype), str(dtype)):
            return dtype
    raise ValueError(f"dtype must be one of {[dtype_name(d) for d in DTYPES]}, got {name!r}.")


def format_size(size_bytes: int) -> str:
    """Bytes in binary units, exact: 1024 -> ``"1K"``, 1536 -> ``"1536B"``, 2**24 -> ``"16M"``."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size_bytes >= unit and size_bytes % unit == 0:
            return f"{size_bytes // unit}{suffix}"
    return f"{size_bytes}B"


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"16M"``, ``"1G"``, ``"4096"`` or ``"4096B"``: binary units."""
    cleaned = str(text).strip().upper()
    digits = cleaned.rstrip("BKMGI")
    unit = cleaned[len(digits):]
    try:
        number = float(digits)
    except ValueError:
        number = math.nan
    if unit not in _UNITS or not math.isfinite(number) or number <= 0:
        raise ValueError(f"a size is a positive number of bytes with an optional K, M or G "
                         f"(binary: 1K = 1024 B), like 64K or 16M; got {text!r}.")
    size = number * _UNITS[unit]
    if size != int(size):
        raise ValueError(f"size {text!r} is not a whole number of bytes.")
    return int(size)


@dataclass(frozen=True)
class CollectiveCase:
    """One thing to time: a collective, the algorithm that implements it, and the size.

    ``size_bytes`` is S, the full array: the tensor every rank all-reduces, the input of a
    reduce-scatter (each rank gets chunk r of it, ``shard_bounds``) and the result of an
    all-gather (each rank contributes its chunk, about S/N bytes). ``segment_bytes`` and
    ``window`` tune the pipelined ring (:func:`labs.collectives.ring_all_reduce`;
    ``segment_bytes=None`` is the lock-step ring) and apply to ``Algorithm.RING`` only.
    """

    collective: Collective
    algorithm: Algorithm
    size_bytes: int
    dtype: torch.dtype = torch.float32
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if not isinstance(self.collective, Collective):
            raise TypeError(f"collective must be a labs.collectives.Collective, got "
                            f"{self.collective!r}.")
        if not isinstance(self.algorithm, Algorithm):
            raise TypeError(f"algorithm must be a labs.collectives.Algorithm, got "
                            f"{self.algorithm!r}.")
        if self.algorithm not in self.collective.algorithms():
            names = ", ".join(a.name for a in self.collective.algorithms())
            raise ValueError(f"{self.collective.value} is implemented by {names}; "
                             f"{self.algorithm.name} is not one of them.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {[dtype_name(d) for d in DTYPES]}, got "
                             f"{self.dtype!r}.")
        item = self.itemsize
        if (isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int)
                or self.size_bytes < item or self.size_bytes % item):
            raise ValueError(f"size_bytes must be a positive multiple of {item} "
                             f"({dtype_name(self.dtype)}), got {self.size_bytes!r}.")
        ring = self.algorithm is Algorithm.RING
        if self.segment_bytes is not None and (
                isinstance(self.segment_bytes, bool) or not isinstance(self.segment_bytes, int)
                or self.segment_bytes < item):
            raise ValueError(f"segment_bytes must be None (lock-step ring) or at least one "
                             f"element ({item} B), got {self.segment_bytes!r}.")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be a positive int, got {self.window!r}.")
        if not ring and (self.segment_bytes != DEFAULT_SEGMENT_BYTES
                         or self.window != DEFAULT_WINDOW):
            raise ValueError("segment_bytes and window tune the pipelined ring; leave them at "
                             f"their defaults for {self.algorithm.name}.")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def numel(self) -> int:
        """Elements in S."""
        return self.size_bytes // self.itemsize

    @property
    def label(self) -> str:
        """The algorithm's name, with the ring's segment when it is not the default."""
        if self.algorithm is not Algorithm.RING:
            return self.algorithm.value
        if self.segment_bytes is None:
            return "ring (lock-step)"
        if self.segment_bytes != DEFAULT_SEGMENT_BYTES or self.window != DEFAULT_WINDOW:
            return f"ring (segment {format_size(self.segment_bytes)}, window {self.window})"
        return "ring"


@dataclass(frozen=True)
class CollectiveTiming:
    """The measurement of one :class:`CollectiveCase` at one world size.

    ``seconds`` is the median over iterations of the slowest rank's time per call (a
    collective is done when its last rank is); ``all_seconds`` holds every iteration's, those
    of ``launches`` launches pooled one launch after the other (equal numbers per launch).
    ``correct`` is True when every call on every rank gave the exact result.
    """

    case: CollectiveCase
    world_size: int
    backend: str
    seconds: float
    all_seconds: tuple[float, ...]
    correct: bool
    launches: int = 1

    def launch_medians(self) -> list[float]:
        """The median of each launch's iterations."""
        per = len(self.all_seconds) // self.launches
        return [statistics.median(self.all_seconds[i * per:(i + 1) * per])
                for i in range(self.launches)]

    def summary(self, statistic: Statistic) -> float:
        """The median (= ``seconds``) or the minimum over iterations."""
        return statistic.of(self.all_seconds)

    @property
    def algbw_gbps(self) -> float:
        """Algorithm bandwidth S / time, in GB/s (1e9 bytes)."""
        return self.case.size_bytes / self.seconds / 1e9

    @property
    def busbw_gbps(self) -> float:
        """Bus bandwidth: algbw x the collective's bus factor (2(N-1)/N or (N-1)/N)."""
        return self.algbw_gbps * self.case.collective.bus_factor(self.world_size)

    def as_record(self) -> dict[str, Any]:
        """A flat dict for CSV and JSON (:func:`timing_from_record` reads it back)."""
        return {
            "backend": self.backend, "world_size": self.world_size,
            "collective": self.case.collective.value, "algorithm": self.case.algorithm.value,
            "label": self.case.label, "segment_bytes": self.case.segment_bytes,
            "window": self.case.window, "dtype": dtype_name(self.case.dtype),
            "size_bytes": self.case.size_bytes, "seconds": self.seconds,
            "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps,
            "correct": self.correct, "launches": self.launches,
            "all_seconds": list(self.all_seconds),
        }


def timing_from_record(record: dict[str, Any]) -> CollectiveTiming:
    """Inverse of :meth:`CollectiveTiming.as_record` (from JSON, or CSV strings)."""
    segment = record["segment_bytes"]
    all_seconds = record["all_seconds"]
    if isinstance(all_seconds, str):
        all_seconds = [float(s) for s in all_seconds.split()]
    correct = record["correct"]
    case = CollectiveCase(
        Collective(record["collective"]), Algorithm(record["algorithm"]),
        int(record["size_bytes"]), parse_dtype(record["dtype"]),
        None if segment in (None, "", "None") else int(segment), int(record["window"]),
    )
    return CollectiveTiming(
        case, int(record["world_size"]), str(record["backend"]), float(record["seconds"]),
        tuple(float(s) for s in all_seconds),
        correct if isinstance(correct, bool) else str(correct) == "True",
        int(record.get("launches") or 1),
    )


def results_match(result: torch.Tensor, expected: torch.Tensor) -> bool:
    """The correctness verdict of every timed call: same shape, same dtype, same bits.

    Exact equality is the right test here, not a tolerance: the inputs are small integers, so
    every order of summation gives the same, exactly representable, sum.
    """
    return (result.shape == expected.shape and result.dtype == expected.dtype
            and bool(torch.equal(result, expected)))


def _check_cases(cases: object, iters: object, warmup: object) -> list[CollectiveCase]:
    if isinstance(cases, CollectiveCase):
        raise TypeError("cases must be a sequence of CollectiveCase: wrap the one case in a "
                        "list.")
    try:
        found = list(cases)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"cases must be a sequence of CollectiveCase, got "
                        f"{type(cases).__name__}.") from None
    if not found:
        raise ValueError("cases is empty: give at least one CollectiveCase.")
    for case in found:
        if not isinstance(case, CollectiveCase):
            raise TypeError(f"every case must be a CollectiveCase, got {case!r}.")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}.")
    return found


# --- the rank side -------------------------------------------------------------------------------


def _device(rank: int) -> torch.device:
    """Where this rank's tensors live: its own GPU under NCCL, the CPU otherwise."""
    return rank_device()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seeded_input(numel: int, stream: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-8, 8) stored as ``dtype``, drawn from ``SEED + stream`` (1-D, CPU)."""
    generator = torch.Generator().manual_seed(SEED + stream)
    return torch.randint(-8, 8, (numel,), generator=generator, dtype=dtype)


@dataclass
class _Inputs:
    """One rank's inputs and expected results for every case of one (size, dtype).

    Rank r's tensor is ``seeded_input(numel, r)``; the all-gather's full array is drawn from
    stream ``world_size`` (rank r contributes chunk r of it). The expected sum is computed
    locally from every rank's seed, so torch's built-in collectives are checked too.
    """

    mine: torch.Tensor  # 1-D, numel: this rank's contribution to all-reduce / reduce-scatter
    work: torch.Tensor  # 1-D, numel: all-reduce works in place, refilled from `mine` each call
    total: torch.Tensor | None  # 1-D, numel: the exact sum over ranks
    gathered: torch.Tensor | None  # 1-D, numel: the all-gather's expected result
    bounds: list[int]
    #: Kept across the calls of one size, as a training loop keeps its buckets' buffers.
    ring_buffers: RingBuffers = field(default_factory=RingBuffers)

    @classmethod
    def build(cls, cases: Sequence[CollectiveCase], rank: int, world_size: int,
              device: torch.device) -> _Inputs:
        numel, dtype = cases[0].numel, cases[0].dtype
        collectives = {c.collective for c in cases}
        mine_cpu = seeded_input(numel, rank, dtype)
        total = gathered = None
        if collectives & {Collective.ALL_REDUCE, Collective.REDUCE_SCATTER}:
            total = mine_cpu.clone()
            for other in range(world_size):
                if other != rank:
                    total += seeded_input(numel, other, dtype)  # integers: any order is exact
            total = total.to(device)
        mine = mine_cpu.to(device)
        if Collective.ALL_GATHER in collectives:
            gathered = seeded_input(numel, world_size, dtype).to(device)
        work = torch.empty_like(mine) if Collective.ALL_REDUCE in collectives else mine
        return cls(mine, work, total, gathered, shard_bounds(numel, world_size))


def _run(case: CollectiveCase, inputs: _Inputs, rank: int, world_size: int) -> torch.Tensor:
    """One call of the case's collective; returns its result. torch's built-ins are called
    directly (no padding copy) whenever S divides evenly by N."""
    even = case.numel % world_size == 0
    lo, hi = inputs.bounds[rank], inputs.bounds[rank + 1]
    if case.collective is Collective.ALL_REDUCE:
        if case.algorithm is Algorithm.RING:
            return ring_all_reduce(inputs.work, segment_bytes=case.segment_bytes,
                                   window=case.window, buffers=inputs.ring_buffers)
        return all_reduce(inputs.work, algorithm=case.algorithm)
    if case.collective is Collective.REDUCE_SCATTER:
        if case.algorithm is Algorithm.RING:
            return ring_reduce_scatter(inputs.mine, segment_bytes=case.segment_bytes,
                                       window=case.window)
        if even:
            out = torch.empty(hi - lo, dtype=case.dtype, device=inputs.mine.device)
            builtin_reduce_scatter(out, inputs.mine, dist.ReduceOp.SUM, None)
            return out
        return _reduce_scatter(inputs.mine, algorithm=Algorithm.TORCH)
    assert inputs.gathered is not None
    shard = inputs.gathered[lo:hi]
    if case.algorithm is Algorithm.RING:
        return ring_all_gather(shard, numel=case.numel, segment_bytes=case.segment_bytes,
                               window=case.window)
    if even:
        out = torch.empty(case.numel, dtype=case.dtype, device=shard.device)
        builtin_all_gather(out, shard, None)
        return out
    return _all_gather(shard, numel=case.numel, algorithm=Algorithm.TORCH)


def _expected(case: CollectiveCase, inputs: _Inputs, rank: int) -> torch.Tensor:
    if case.collective is Collective.ALL_GATHER:
        assert inputs.gathered is not None
        return inputs.gathered
    assert inputs.total is not None
    if case.collective is Collective.ALL_REDUCE:
        return inputs.total
    return inputs.total[inputs.bounds[rank]:inputs.bounds[rank + 1]]


def _time_one(case: CollectiveCase, inputs: _Inputs, rank: int, world_size: int,
              device: torch.device) -> tuple[float, bool]:
    """Barrier, then one timed call; returns this rank's seconds and whether it was right."""
    if case.collective is Collective.ALL_REDUCE:
        inputs.work.copy_(inputs.mine)  # in place: start every call from the same input
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    result = _run(case, inputs, rank, world_size)
    _sync(device)
    seconds = time.perf_counter() - start
    return seconds, results_match(result, _expected(case, inputs, rank))


def time_collectives(
    rank: int, world_size: int, cases: Sequence[CollectiveCase], iters: int = 5,
    warmup: int = 1,
) -> list[CollectiveTiming]:
    """The worker of :func:`measure_collectives`: run by ``launch`` on every rank.

    Cases of one size and dtype share their inputs and run interleaved, iteration by
    iteration (iteration 1 of every case, then iteration 2, ...), so a drift in the machine's
    load affects them alike. Every call starts after a barrier; a call's time is its slowest
    rank's (times are max-reduced over ranks), ``correct`` is and-reduced over every call of
    every rank. Every rank returns the same list, in the order of ``cases``.
    """
    found = _check_cases(cases, iters, warmup)
    device = _device(rank)
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, case in enumerate(found):
        groups.setdefault((case.size_bytes, case.dtype), []).append(i)
    seconds = torch.zeros(len(found), iters, dtype=torch.float64)
    correct = torch.ones(len(found), dtype=torch.int32)
    for indices in groups.values():
        inputs = _Inputs.build([found[i] for i in indices], rank, world_size, device)
        for it in range(warmup + iters):
            # Every other iteration in reverse order, so that no case always runs first
            # after the inputs are refilled (or always right after another case).
            for i in indices if it % 2 == 0 else indices[::-1]:
                took, right = _time_one(found[i], inputs, rank, world_size, device)
                if it >= warmup:
                    seconds[i, it - warmup] = took
                if not right:
                    correct[i] = 0
        del inputs
    slowest, all_right = seconds.to(device), correct.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(all_right, op=dist.ReduceOp.MIN)
    backend = str(dist.get_backend())
    timings = []
    for i, case in enumerate(found):
        times = tuple(float(t) for t in slowest[i].cpu())
        timings.append(CollectiveTiming(case, world_size, backend, statistics.median(times),
                                        times, bool(all_right[i].item())))
    return timings


def measure_collectives(
    cases: Sequence[CollectiveCase], world_size: int, *, iters: int = 5, warmup: int = 1,
    backend: str = "auto", timeout: float = 300.0,
) -> list[CollectiveTiming]:
    """Time ``cases`` on ``world_size`` real ranks (one launch); returns rank 0's list.

    A notebook's entry point: ``measure_collectives([CollectiveCase(Collective.ALL_REDUCE,
    Algorithm.RING, 1 << 20)], 4)``. Bad input is refused before any process starts.
    """
    found = _check_cases(cases, iters, warmup)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    results = launch(time_collectives, world_size, args=(found, iters, warmup),
                     backend=backend, timeout=timeout, echo=False)
    return list(results[0])


# --- point-to-point and reduction timings, for the cost model -------------------------------------


class Statistic(enum.Enum):
    """How the iterations of one measurement are summarised."""

    #: The typical call, waits for a busy core included (what a training step would see).
    MEDIAN = "median"
    #: The best call: the closest to the cost of the operation itself on an idle machine.
    MIN = "min"

    def of(self, times: Sequence[float]) -> float:
        """This statistic of ``times``."""
        return statistics.median(times) if self is Statistic.MEDIAN else min(times)


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
    try:
        found = list(sizes)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"sizes must be a sequence of ints, got {type(sizes).__name__}.") from None
    if not found or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 or s % 4
                        for s in found):
        raise ValueError(f"sizes must be a non-empty list of byte counts, each a multiple of 4 "
                         f"(float32 elements), got {sizes!r}.")
    _check_cases([CollectiveCase(Collective.ALL_REDUCE, Algorithm.TORCH, 4)], iters, warmup)
    return found


class P2PPattern(enum.Enum):
    """How :func:`time_p2p` moves a message of m bytes between ranks 0 and 1."""

    #: Both ranks send m bytes to each other at once and wait for both: one step of a ring or
    #: one round of recursive doubling. Its time is the slower rank's.
    EXCHANGE = "exchange"
    #: Rank 0 sends m bytes, rank 1 sends them back: the time is half the round trip, one
    #: message on an otherwise idle link (the textbook measurement of alpha and beta).
    PING_PONG = "ping-pong"


def time_p2p(
    rank: int, world_size: int, sizes: Sequence[int], iters: int = 20, warmup: int = 2,
    pattern: P2PPattern = P2PPattern.EXCHANGE,
) -> list[PointTiming]:
    """Time a message of each size in ``sizes`` between ranks 0 and 1 (others wait at the
    barriers): what the alpha-beta model calls ``alpha + beta * m``.

    With ``P2PPattern.EXCHANGE`` (the default) both ranks send and receive m bytes at once,
    as every step of the ring does. On one machine this is not the same as a one-way message:
    loopback "links" are memory copies made by the CPUs, so sending and receiving at once
    share them, where a network link would carry both directions at full speed.
    Needs ``world_size >= 2``. Every rank returns the same list.
    """
    found = _check_sizes(sizes, iters, warmup)
    if world_size < 2:
        raise ValueError("time_p2p needs two ranks: launch it with world_size >= 2.")
    if not isinstance(pattern, P2PPattern):
        raise TypeError(f"pattern must be a P2PPattern, got {pattern!r}.")
    device = _device(rank)
    seconds = torch.zeros(len(found), iters, dtype=torch.float64)
    for i, size in enumerate(found):
        outgoing = torch.zeros(size // 4, dtype=torch.float32, device=device)
        incoming = torch.empty_like(outgoing)
        for it in range(warmup + iters):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            if rank < 2 and pattern is P2PPattern.EXCHANGE:
                peer = 1 - rank
                ops = [dist.P2POp(dist.isend, outgoing, peer),
                       dist.P2POp(dist.irecv, incoming, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            elif rank == 0:
                dist.send(outgoing, 1)
                dist.recv(incoming, 1)
            elif rank == 1:
                dist.recv(incoming, 0)
                dist.send(incoming, 0)
            _sync(device)
            took = time.perf_counter() - start
            if it >= warmup and rank < 2:
                seconds[i, it - warmup] = took / (2 if pattern is P2PPattern.PING_PONG else 1)
    return _gather_points(found, seconds, device)


def time_reduction(
    rank: int, world_size: int, sizes: Sequence[int], iters: int = 20, warmup: int = 2,
) -> list[PointTiming]:
    """Every rank at once times ``torch.add(a, b, out=c)`` on m bytes of float32: the
    reduction a ring step does on each chunk it receives (the cost model's gamma). All ranks
    run it together because in a ring they all reduce at the same time and share the cores.
    A time is the slowest rank's."""
    found = _check_sizes(sizes, iters, warmup)
    device = _device(rank)
    seconds = torch.zeros(len(found), iters, dtype=torch.float64)
    for i, size in enumerate(found):
        a = torch.ones(size // 4, dtype=torch.float32, device=device)
        b, out = torch.ones_like(a), torch.empty_like(a)
        for it in range(warmup + iters):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            torch.add(a, b, out=out)
            _sync(device)
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


# --- python -m labs.bench launch ----------------------------------------------------------------


def _trivial(rank: int, world_size: int) -> int:
    return rank


def _time_launches(world_size: int, method: StartMethod, repeats: int) -> dict[str, float]:
    """Run in a fresh process: first launch, then the median of ``repeats`` more."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        launch(_trivial, world_size, echo=False, start_method=method)
        times.append(time.perf_counter() - start)
    return {"first": times[0], "median_later": statistics.median(times[1:])}


def bench_launch(world_sizes: Sequence[int], repeats: int, methods: Sequence[str]) -> str:
    from tqdm import tqdm

    from labs.viz import format_table

    rows = []
    cases = [(m, n) for m in methods for n in world_sizes]
    for method, world_size in tqdm(cases, desc="launch latency", unit="case"):
        code = (
            "import json\n"
            "from labs.bench import _time_launches\n"
            "from labs.launch import StartMethod\n"
            "if __name__ == '__main__':\n"
            f"    print(json.dumps(_time_launches({world_size}, StartMethod({method!r}), "
            f"{repeats})))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        timing = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([method, world_size, f"{timing['first']:.3f}",
                     f"{timing['median_later']:.3f}"])
    return format_table(["start method", "world size", "first launch (s)",
                         f"median of {repeats} later (s)"], rows)


# --- python -m labs.bench collectives -----------------------------------------------------------


def algorithm_from_name(name: str) -> Algorithm:
    """``"ring"``, ``"recursive-doubling"`` or ``"recursive doubling"``, ... -> Algorithm."""
    for algorithm in Algorithm:
        if name in (algorithm.value, algorithm.value.replace(" ", "-"), algorithm.name.lower()):
            return algorithm
    raise ValueError(f"unknown algorithm {name!r}; choose from "
                     f"{[a.value.replace(' ', '-') for a in Algorithm]}.")


@dataclass(frozen=True)
class SweepSettings:
    """The settings of one ``python -m labs.bench collectives`` sweep (the CLI parses into it,
    a notebook can build one and call :func:`run_sweep`).

    ``algorithms=None`` means every algorithm each collective supports; otherwise each
    collective runs the listed algorithms it supports. ``segment_bytes`` lists the pipeline
    segments to sweep for the ring (``None`` = lock-step ring).
    """

    collectives: tuple[Collective, ...] = tuple(Collective)
    algorithms: tuple[Algorithm, ...] | None = None
    sizes: tuple[int, ...] = DEFAULT_SIZES
    world_sizes: tuple[int, ...] = (2, 4)
    backends: tuple[Backend, ...] = (Backend.GLOO,)
    iters: int = 5
    warmup: int = 1
    dtype: torch.dtype = torch.float32
    segment_bytes: tuple[int | None, ...] = (DEFAULT_SEGMENT_BYTES,)
    window: int = DEFAULT_WINDOW
    timeout_s: float = 600.0
    #: Launches per backend and world size, their iterations pooled: on a small machine the
    #: way the ranks happen to share the cores changes from launch to launch, and moves the
    #: timings of a whole launch together.
    launches: int = 1

    def __post_init__(self) -> None:
        if not self.collectives or not all(isinstance(c, Collective) for c in self.collectives):
            raise ValueError("--collectives: give one or more of "
                             f"{[c.value for c in Collective]}.")
        if self.algorithms is not None:
            if not self.algorithms or not all(isinstance(a, Algorithm) for a in self.algorithms):
                raise ValueError("--algorithms: give one or more of "
                                 f"{[a.value.replace(' ', '-') for a in Algorithm]}.")
            for collective in self.collectives:
                if not self.algorithms_of(collective):
                    supported = [a.value.replace(" ", "-") for a in collective.algorithms()]
                    raise ValueError(f"--algorithms: none of them implements "
                                     f"{collective.value} (that takes {supported}); add one or "
                                     "drop the collective from --collectives.")
            unused = [a for a in self.algorithms
                      if not any(a in c.algorithms() for c in self.collectives)]
            if unused:
                raise ValueError(f"--algorithms: {unused[0].value!r} implements none of "
                                 f"{[c.value for c in self.collectives]} (it is an all-reduce "
                                 "algorithm); drop it or add all-reduce to --collectives.")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {[dtype_name(d) for d in DTYPES]}.")
        item = torch.empty((), dtype=self.dtype).element_size()
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < item
                                 or s % item for s in self.sizes):
            raise ValueError(f"--sizes: each size must be a positive multiple of {item} B "
                             f"(one {dtype_name(self.dtype)} element), got "
                             f"{[format_size(s) if isinstance(s, int) else s for s in self.sizes]}"
                             ".")
        if not self.world_sizes or any(isinstance(n, bool) or not isinstance(n, int)
                                       or not 2 <= n <= MAX_WORLD_SIZE
                                       for n in self.world_sizes):
            raise ValueError(f"--world-sizes: each must be between 2 and {MAX_WORLD_SIZE} "
                             f"(a collective needs two ranks), got {list(self.world_sizes)}.")
        if not self.backends or not all(isinstance(b, Backend) for b in self.backends):
            raise ValueError(f"--backends: give one or more of {[b.value for b in Backend]}.")
        try:
            _check_cases([CollectiveCase(Collective.ALL_REDUCE, Algorithm.TORCH, 4)],
                         self.iters, self.warmup)
        except ValueError as err:
            raise ValueError(f"--{str(err).split()[0]}: {err}") from None
        for segment in self.segment_bytes:
            if segment is not None and (isinstance(segment, bool) or not isinstance(segment, int)
                                        or segment < item):
                raise ValueError(f"--segment-bytes: each must be 'none' (lock-step ring) or at "
                                 f"least one element ({item} B), got {segment!r}.")
        if not self.segment_bytes:
            raise ValueError("--segment-bytes: give at least one segment size.")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"--window must be a positive int, got {self.window!r}.")
        if isinstance(self.launches, bool) or not isinstance(self.launches, int) \
                or self.launches < 1:
            raise ValueError(f"--launches must be an int >= 1, got {self.launches!r}.")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise ValueError(f"--timeout must be a positive number of seconds, got "
                             f"{self.timeout_s!r}.")

    def algorithms_of(self, collective: Collective) -> tuple[Algorithm, ...]:
        """The algorithms this sweep runs for ``collective``."""
        supported = collective.algorithms()
        if self.algorithms is None:
            return supported
        return tuple(a for a in self.algorithms if a in supported)

    def cases(self) -> list[CollectiveCase]:
        """Every case of the sweep, for one world size (sizes outermost)."""
        cases = []
        for size in self.sizes:
            for collective in self.collectives:
                for algorithm in self.algorithms_of(collective):
                    if algorithm is Algorithm.RING:
                        cases += [CollectiveCase(collective, algorithm, size, self.dtype, seg,
                                                 self.window) for seg in self.segment_bytes]
                    else:
                        cases.append(CollectiveCase(collective, algorithm, size, self.dtype))
        return cases


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def runnable(settings: SweepSettings) -> tuple[list[tuple[Backend, int]], list[str]]:
    """The (backend, world size) launches this machine can run, and why others are skipped."""
    plan, skipped = [], []
    for backend in settings.backends:
        for world_size in settings.world_sizes:
            if backend is Backend.NCCL:
                if not dist.is_nccl_available() or _gpus() == 0:
                    skipped.append("skipping nccl: no CUDA GPU (or no NCCL in this torch "
                                   "build); run the sweep with --backends gloo here.")
                    break
                if _gpus() < world_size:
                    skipped.append(f"skipping nccl at world size {world_size}: it needs one "
                                   f"GPU per rank and {_gpus()} are visible.")
                    continue
            plan.append((backend, world_size))
    return plan, skipped


def run_sweep(
    settings: SweepSettings, *, progress: Callable[[int], None] | None = None,
) -> list[CollectiveTiming]:
    """Run every case of ``settings`` (one launch per backend and world size); ``progress`` is
    called with the number of cases each launch finished."""
    plan, _ = runnable(settings)
    cases = settings.cases()
    timings: list[CollectiveTiming] = []
    for backend, world_size in plan:
        runs = []
        for _ in range(settings.launches):
            runs.append(measure_collectives(cases, world_size, iters=settings.iters,
                                            warmup=settings.warmup, backend=backend.value,
                                            timeout=settings.timeout_s))
            if progress is not None:
                progress(len(cases))
        timings += [_pool(same) for same in zip(*runs, strict=True)]
    return timings


def _pool(runs: Sequence[CollectiveTiming]) -> CollectiveTiming:
    """One timing from the same case measured in several launches: every iteration kept."""
    times = tuple(t for run in runs for t in run.all_seconds)
    first = runs[0]
    return CollectiveTiming(first.case, first.world_size, first.backend,
                            statistics.median(times), times, all(r.correct for r in runs),
                            sum(r.launches for r in runs))


def _torch_of(timing: CollectiveTiming,
              timings: Sequence[CollectiveTiming]) -> CollectiveTiming | None:
    for other in timings:
        if (other.case.algorithm is Algorithm.TORCH and other.backend == timing.backend
                and other.world_size == timing.world_size
                and other.case.collective is timing.case.collective
                and other.case.size_bytes == timing.case.size_bytes
                and other.case.dtype == timing.case.dtype):
            return other
    return None


def ratio_to_torch(timing: CollectiveTiming, timings: Sequence[CollectiveTiming]) -> float | None:
    """busbw of ``timing`` / busbw of torch's built-in at the same backend, N, collective and
    size (> 1: faster than torch); None when torch was not measured there."""
    reference = _torch_of(timing, timings)
    if reference is None or timing.case.algorithm is Algorithm.TORCH:
        return None
    return reference.seconds / timing.seconds


def launch_ratios(timing: CollectiveTiming,
                  timings: Sequence[CollectiveTiming]) -> list[float] | None:
    """:func:`ratio_to_torch` launch by launch (each launch's median against the same launch's
    median of torch's built-in): how far one launch can move the ratio. None where there is no
    ratio or only one launch."""
    reference = _torch_of(timing, timings)
    if (reference is None or timing.case.algorithm is Algorithm.TORCH or timing.launches < 2
            or reference.launches != timing.launches):
        return None
    return [ref / mine for ref, mine in zip(reference.launch_medians(), timing.launch_medians(),
                                            strict=True)]


def _ratio_cell(ratio: float | None, spread: list[float] | None = None) -> str:
    if ratio is None:
        return "-"
    if not spread:
        return f"{ratio:.2f}"
    return f"{ratio:.2f} ({min(spread):.2f}-{max(spread):.2f})"


def sweep_tables(timings: Sequence[CollectiveTiming]) -> str:
    """One table per backend and world size, then the all-reduce "ring vs torch" summary."""
    from labs.viz import format_table

    header = ["collective", "algorithm", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)",
              "correct", "busbw / torch"]
    blocks = []
    for backend, world_size in dict.fromkeys((t.backend, t.world_size) for t in timings):
        rows = []
        chosen = [t for t in timings if (t.backend, t.world_size) == (backend, world_size)]
        order = {c: i for i, c in enumerate(Collective)}
        for t in sorted(chosen, key=lambda t: (order[t.case.collective], t.case.size_bytes)):
            rows.append([t.case.collective.value, t.case.label, format_size(t.case.size_bytes),
                         f"{t.seconds * 1e6:.1f}", f"{t.algbw_gbps:.3g}",
                         f"{t.busbw_gbps:.3g}", str(t.correct),
                         _ratio_cell(ratio_to_torch(t, timings))])
        dtype = dtype_name(chosen[0].case.dtype)
        blocks.append(f"{backend}, world size {world_size}, {dtype} (median of "
                      f"{len(chosen[0].all_seconds)} iterations, slowest rank per call):\n"
                      + format_table(header, rows))
    summary = ring_vs_torch_table(timings)
    if summary:
        spread = any(t.launches > 1 for t in timings)
        blocks.append("all-reduce, ring busbw / torch busbw (> 1: the ring is faster"
                      + ("; in brackets the lowest and highest ratio of one launch" if spread
                         else "") + "):\n" + summary)
    return "\n\n".join(blocks)


def ring_vs_torch_table(timings: Sequence[CollectiveTiming]) -> str:
    """All-reduce: backend, world size and ring variant (rows) x size (columns) -> busbw ratio
    of the ring to torch's built-in, and, after several launches, the lowest and highest
    ratio of a single launch in brackets. Empty when the sweep had no ring or no torch."""
    from labs.viz import format_table

    rings = [t for t in timings if t.case.collective is Collective.ALL_REDUCE
             and t.case.algorithm is Algorithm.RING and _torch_of(t, timings) is not None]
    if not rings:
        return ""
    sizes = sorted({t.case.size_bytes for t in rings})
    rows = []
    for key in dict.fromkeys((t.backend, t.world_size, t.case.label) for t in rings):
        cells = {t.case.size_bytes: _ratio_cell(ratio_to_torch(t, timings),
                                                launch_ratios(t, timings))
                 for t in rings if (t.backend, t.world_size, t.case.label) == key}
        rows.append([*key, *(cells.get(s, "-") for s in sizes)])
    return format_table(["backend", "world size", "algorithm",
                         *(format_size(s) for s in sizes)], rows)


def plot_busbw(timings: Sequence[CollectiveTiming]) -> Figure:
    """Bus bandwidth against size (log x), one line per algorithm (and backend), one panel per
    world size (rows) and collective (columns); an algorithm keeps its colour in every panel.
    A red cross marks an incorrect result."""
    import matplotlib.pyplot as plt

    world_sizes = sorted({t.world_size for t in timings})
    collectives = [c for c in Collective if any(t.case.collective is c for t in timings)]
    backends = sorted({t.backend for t in timings})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = list(dict.fromkeys(t.case.label for t in sorted(
        timings, key=lambda t: list(Algorithm).index(t.case.algorithm))))
    colour = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    fig, axes = plt.subplots(len(world_sizes), len(collectives), squeeze=False,
                             figsize=(4.2 * len(collectives), 3.2 * len(world_sizes)),
                             layout="constrained")
    for row, world_size in enumerate(world_sizes):
        for col, collective in enumerate(collectives):
            ax = axes[row][col]
            chosen = [t for t in timings
                      if t.world_size == world_size and t.case.collective is collective]
            for backend in backends:
                for label in dict.fromkeys(t.case.label for t in chosen if t.backend == backend):
                    line = sorted((t for t in chosen
                                   if t.backend == backend and t.case.label == label),
                                  key=lambda t: t.case.size_bytes)
                    name = label if len(backends) == 1 else f"{label} ({backend})"
                    ax.plot([t.case.size_bytes for t in line], [t.busbw_gbps for t in line],
                            "o-" if backend == backends[0] else "s--", label=name,
                            color=colour[label])
                    bad = [t for t in line if not t.correct]
                    ax.plot([t.case.size_bytes for t in bad], [t.busbw_gbps for t in bad], "x",
                            color="red", ms=12, mew=2)
            ax.set_xscale("log", base=2)
            sizes = sorted({t.case.size_bytes for t in chosen})
            ax.set_xticks(sizes, [format_size(s) for s in sizes])
            ax.set(xlabel="size S", ylabel="busbw (GB/s)",
                   title=f"{collective.value}, N = {world_size}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    return fig


def write_timings(timings: Sequence[CollectiveTiming], path: Path,
                  settings: SweepSettings | None = None) -> None:
    """``.csv`` (one row per timing, ``all_seconds`` space-separated) or ``.json`` (the rows,
    the settings and the machine) by the path's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [t.as_record() for t in timings]
    if path.suffix == ".json":
        meta = {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                else os.cpu_count(), "torch": torch.__version__,
                "python": platform.python_version(), "machine": platform.machine()}
        document = {"machine": meta, "timings": records}
        if settings is not None:
            document["settings"] = _settings_record(settings)
        path.write_text(json.dumps(document, indent=1) + "\n")
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]) if records else ["backend"])
        writer.writeheader()
        for record in records:
            writer.writerow({**record, "all_seconds": " ".join(map(repr, record["all_seconds"]))})


def read_timings(path: Path) -> list[CollectiveTiming]:
    """The timings :func:`write_timings` wrote (CSV or JSON)."""
    path = Path(path)
    if path.suffix == ".json":
        return [timing_from_record(r) for r in json.loads(path.read_text())["timings"]]
    with path.open(newline="") as handle:
        return [timing_from_record(r) for r in csv.DictReader(handle)]


def _settings_record(settings: SweepSettings) -> dict[str, Any]:
    return {
        "collectives": [c.value for c in settings.collectives],
        "algorithms": None if settings.algorithms is None else
        [a.value for a in settings.algorithms],
        "sizes": list(settings.sizes), "world_sizes": list(settings.world_sizes),
        "backends": [b.value for b in settings.backends], "iters": settings.iters,
        "launches": settings.launches,
        "warmup": settings.warmup, "dtype": dtype_name(settings.dtype),
        "segment_bytes": list(settings.segment_bytes), "window": settings.window,
    }


@dataclass(frozen=True)
class _Outputs:
    out: Path
    plot: Path


def _outputs(out: str, plot: str | None) -> _Outputs:
    out_path = Path(out)
    if out_path.suffix not in (".csv", ".json"):
        raise ValueError(f"--out must end in .csv or .json, got {out!r}.")
    plot_path = out_path.with_suffix(".png") if plot is None else Path(plot)
    if plot_path.suffix != ".png":
        raise ValueError(f"--plot must end in .png, got {plot!r}.")
    for path, flag in ((out_path, "--out"), (plot_path, "--plot")):
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"{flag}: cannot create {path} (no writable folder above it).")
    return _Outputs(out_path, plot_path)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _segment_arg(text: str) -> int | None:
    return None if text.lower() in ("none", "lockstep", "lock-step") else _size_arg(text)


def _algorithm_arg(text: str) -> Algorithm:
    try:
        return algorithm_from_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _collective_arg(text: str) -> Collective:
    try:
        return Collective(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown collective {text!r}; choose from {[c.value for c in Collective]}."
        ) from None


def _backend_arg(text: str) -> Backend:
    try:
        return Backend(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown backend {text!r}; choose from {[b.value for b in Backend]}."
        ) from None


def _dtype_arg(text: str) -> torch.dtype:
    try:
        return parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose what is measured: shared by ``python -m labs.bench collectives``
    (which launches ranks itself) and ``python -m labs collectives`` (which also runs under
    torchrun); :func:`settings_from_args` reads them back."""
    parser.add_argument("--collectives", nargs="+", type=_collective_arg,
                        default=list(Collective), metavar="NAME",
                        help=f"any of {[c.value for c in Collective]} (default: all)")
    parser.add_argument("--algorithms", nargs="+", type=_algorithm_arg, default=None,
                        metavar="NAME",
                        help=f"any of {[a.value.replace(' ', '-') for a in Algorithm]} "
                             "(default: every one the collective supports)")
    parser.add_argument("--sizes", nargs="+", type=_size_arg, default=list(DEFAULT_SIZES),
                        metavar="SIZE", help="bytes, binary units: 1K 64K 1M 16M "
                        f"(default: {' '.join(format_size(s) for s in DEFAULT_SIZES)})")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per case first")
    parser.add_argument("--dtype", type=_dtype_arg, default=torch.float32,
                        help=f"one of {[dtype_name(d) for d in DTYPES]}")
    parser.add_argument("--segment-bytes", nargs="+", type=_segment_arg,
                        default=[DEFAULT_SEGMENT_BYTES], metavar="SIZE",
                        help="pipeline segment(s) of the ring, or 'none' for the lock-step "
                             f"ring (default: {format_size(DEFAULT_SEGMENT_BYTES)})")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help="segments the ring receives ahead")


def settings_from_args(opts: argparse.Namespace, **more: Any) -> SweepSettings:
    """The :class:`SweepSettings` of the flags :func:`add_case_arguments` added (repeated
    values dropped), with ``more`` for the rest; raises ValueError on a bad combination."""
    return SweepSettings(
        collectives=tuple(dict.fromkeys(opts.collectives)),
        algorithms=None if opts.algorithms is None else tuple(dict.fromkeys(opts.algorithms)),
        sizes=tuple(dict.fromkeys(opts.sizes)), iters=opts.iters, warmup=opts.warmup,
        dtype=opts.dtype, segment_bytes=tuple(dict.fromkeys(opts.segment_bytes)),
        window=opts.window, **more,
    )


def _add_collectives_parser(sub: Any) -> None:
    col = sub.add_parser("collectives", help="nccl-tests style sweep of the collectives")
    add_case_arguments(col)
    col.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], metavar="N")
    col.add_argument("--backends", nargs="+", type=_backend_arg, default=[Backend.GLOO],
                     metavar="NAME", help="gloo and/or nccl (nccl is skipped without CUDA)")
    col.add_argument("--launches", type=int, default=1,
                     help="launches per backend and world size, iterations pooled (default 1)")
    col.add_argument("--timeout", type=float, default=600.0,
                     help="seconds per launch (one per backend and world size)")
    col.add_argument("--out", default=str(DEFAULT_OUT), help="results, .csv or .json")
    col.add_argument("--plot", default=None,
                     help="busbw figure, .png (default: next to --out)")


def _collectives_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from tqdm import tqdm

    try:
        settings = settings_from_args(
            opts, world_sizes=tuple(dict.fromkeys(opts.world_sizes)),
            backends=tuple(dict.fromkeys(opts.backends)), timeout_s=opts.timeout,
            launches=opts.launches,
        )
        outputs = _outputs(opts.out, opts.plot)
    except ValueError as err:
        parser.error(str(err))
    plan, skipped = runnable(settings)
    for line in dict.fromkeys(skipped):
        print(line, file=sys.stderr)
    if not plan:
        parser.error("nothing to run on this machine (see above).")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    crowded = [n for b, n in plan if b is Backend.GLOO and cores is not None and n > cores]
    if crowded:
        print(f"note: {cores} CPU cores; gloo at world size {', '.join(map(str, crowded))} "
              "runs more ranks than cores, so ranks also wait for a core.", file=sys.stderr)
    total = len(plan) * len(settings.cases()) * settings.launches
    with tqdm(total=total, desc="collectives", unit="case", file=sys.stderr) as bar:
        timings = run_sweep(settings, progress=bar.update)
    print(sweep_tables(timings))
    write_timings(timings, outputs.out, settings)
    print(f"\nwrote {outputs.out}")
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_busbw(timings)
    outputs.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(outputs.plot, dpi=110)
    print(f"wrote {outputs.plot}")
    if not all(t.correct for t in timings):
        wrong = [f"{t.case.collective.value}/{t.case.label}/{format_size(t.case.size_bytes)}"
                 f"/N={t.world_size}" for t in timings if not t.correct]
        print(f"INCORRECT results: {', '.join(wrong)}", file=sys.stderr)
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labs.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    lat = sub.add_parser("launch", help="launch latency of a trivial fn")
    lat.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    lat.add_argument("--repeats", type=int, default=5)
    lat.add_argument("--methods", nargs="+", default=[m.value for m in StartMethod],
                     choices=[m.value for m in StartMethod])
    _add_collectives_parser(sub)
    add_ddp_parser(sub)
    add_fsdp_parser(sub)
    opts = parser.parse_args(argv)
    if opts.bench == "launch":
        print(bench_launch(opts.world_sizes, opts.repeats, opts.methods))
    elif opts.bench == "ddp":
        ddp_main(opts, sub.choices["ddp"])
    elif opts.bench == "fsdp":
        fsdp_main(opts, sub.choices["fsdp"])
    else:
        _collectives_main(opts, sub.choices["collectives"])


if __name__ == "__main__":
    main()
