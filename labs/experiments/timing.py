"""Timing collectives on real ranks: what is measured, and the rank-side workers.

:class:`CollectiveCase` names one thing to time (a collective, the algorithm that implements
it, the size S and dtype); :func:`time_collectives` is the worker that ``launch`` runs on every
rank, and :func:`measure_collectives` launches it. A call's time is its slowest rank's; every
call's result is compared with the exact answer (integer-valued inputs, so sums are exact).
:class:`Statistic` says how a measurement's iterations are summarised. Single messages and
additions, for the cost model of chapter 2, are timed in :mod:`labs.experiments.p2p_timing`;
the sweep, its tables and its plot are :mod:`labs.experiments.sweep` and
:mod:`labs.bench.collectives`.
"""

from __future__ import annotations

import enum
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from labs.clock import synchronize
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
from labs.launcher import launch, rank_device

# Ranks import this module to find their workers (time_collectives, time_p2p, ...), so it
# imports nothing heavy: tqdm and matplotlib stay in labs.bench.collectives.

#: The floating-point dtypes a sweep may use. Inputs are small integers (|x| <= 8), so the sum
#: over up to MAX_WORLD_SIZE ranks (|sum| <= 256) is exact in every one of them, bfloat16's
#: 8 significant bits included: a correct result is bit-identical to the exact one.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: The seed of every input of the sweeps (rank r draws from SEED + r).
SEED = 1234
#: Intra-op threads per rank when collectives are timed: one, as torchrun gives each process
#: by default. gloo's own all-reduce adds in its own thread and never uses them; the ring
#: adds with torch, and with many threads per rank (the launcher's default is cores / N) its
#: additions compete with the transfers for the cores: on a 16-core machine that put the
#: ring clearly behind gloo at 16 and 64 MiB, where with one thread the two were level.
COMM_THREADS = 1
#: The most timed calls :func:`calls_per_case` gives a case, however small it is.
MAX_CALLS = 100
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


class Statistic(enum.Enum):
    """How the iterations of one measurement are summarised."""

    #: The typical call, waits for a busy core included (what a training step would see).
    MEDIAN = "median"
    #: The best call: the closest to the cost of the operation itself on an idle machine.
    MIN = "min"

    def of(self, times: Sequence[float]) -> float:
        """This statistic of ``times``."""
        return statistics.median(times) if self is Statistic.MEDIAN else min(times)


def per_launch_medians(values: Sequence[float], launches: int) -> list[float]:
    """The median of each of ``launches`` equal, consecutive parts of ``values`` (iterations
    of several launches, pooled one launch after the other)."""
    per = len(values) // launches
    return [statistics.median(values[i * per:(i + 1) * per]) for i in range(launches)]


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
        return per_launch_medians(self.all_seconds, self.launches)

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


def calls_per_case(size_bytes: int, iters: int, min_bytes: int) -> int:
    """How many timed calls a case of ``size_bytes`` gets: ``iters``, or more where that is
    needed for the calls together to carry ``min_bytes`` (S per call), at most
    :data:`MAX_CALLS`.

    A call on a small tensor is short and its time swings with whatever else the machine is
    doing; a few more samples cost little there and steady the median. On the course machine
    five calls at 1 MiB gave a ring/torch ratio anywhere between 0.3 and 2.3 from one launch
    to the next. The count depends on the size alone, so every rank and every launch agrees
    on it without a message.
    """
    return max(iters, min(MAX_CALLS, -(-min_bytes // size_bytes)))


def check_min_bytes(min_bytes: object) -> int:
    """``min_bytes`` checked: an int >= 0 (0: every case gets exactly ``iters`` calls)."""
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0 (0 turns it off), got {min_bytes!r}.")
    return min_bytes


def check_cases(cases: object, iters: object, warmup: object) -> list[CollectiveCase]:
    """``cases`` as a list, with ``iters`` and ``warmup`` checked: an error that says what to
    give instead, raised before any rank starts."""
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
    check_iters(iters, warmup)
    return found


def check_iters(iters: object, warmup: object) -> None:
    """``iters`` (timed calls, >= 1) and ``warmup`` (untimed calls first, >= 0) checked."""
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}.")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}.")


# --- the rank side -------------------------------------------------------------------------------


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
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    result = _run(case, inputs, rank, world_size)
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, results_match(result, _expected(case, inputs, rank))


def time_collectives(
    rank: int, world_size: int, cases: Sequence[CollectiveCase], iters: int = 5,
    warmup: int = 1, min_bytes: int = 0,
) -> list[CollectiveTiming]:
    """The worker of :func:`measure_collectives`: run by ``launch`` on every rank.

    Cases of one size and dtype share their inputs and run interleaved, iteration by
    iteration (iteration 1 of every case, then iteration 2, ...), so a drift in the machine's
    load affects them alike. Every call starts after a barrier; a call's time is its slowest
    rank's (times are max-reduced over ranks), ``correct`` is and-reduced over every call of
    every rank. Each case makes :func:`calls_per_case` timed calls (``iters`` unless
    ``min_bytes`` asks for more at small sizes). Every rank returns the same list, in the
    order of ``cases``.
    """
    found = check_cases(cases, iters, warmup)
    check_min_bytes(min_bytes)
    device = rank_device()  # its own GPU under NCCL, else the CPU
    groups: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, case in enumerate(found):
        groups.setdefault((case.size_bytes, case.dtype), []).append(i)
    calls = [calls_per_case(case.size_bytes, iters, min_bytes) for case in found]
    seconds = torch.zeros(len(found), max(calls), dtype=torch.float64)
    correct = torch.ones(len(found), dtype=torch.int32)
    for indices in groups.values():
        inputs = _Inputs.build([found[i] for i in indices], rank, world_size, device)
        for it in range(warmup + calls[indices[0]]):  # one size: one count
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
        times = tuple(float(t) for t in slowest[i, :calls[i]].cpu())
        timings.append(CollectiveTiming(case, world_size, backend, statistics.median(times),
                                        times, bool(all_right[i].item())))
    return timings


def measure_collectives(
    cases: Sequence[CollectiveCase], world_size: int, *, iters: int = 5, warmup: int = 1,
    backend: str = "auto", timeout: float = 300.0, threads: int = COMM_THREADS,
    min_bytes: int = 0,
) -> list[CollectiveTiming]:
    """Time ``cases`` on ``world_size`` real ranks (one launch); returns rank 0's list.

    A notebook's entry point: ``measure_collectives([CollectiveCase(Collective.ALL_REDUCE,
    Algorithm.RING, 1 << 20)], 4)``. Bad input is refused before any process starts.
    ``threads`` is each rank's intra-op threads (see :data:`COMM_THREADS`); ``min_bytes``
    gives small sizes more calls than ``iters`` (:func:`calls_per_case`).
    """
    found = check_cases(cases, iters, warmup)
    check_min_bytes(min_bytes)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    results = launch(time_collectives, world_size, args=(found, iters, warmup, min_bytes),
                     backend=backend, timeout=timeout, echo=False, threads=threads)
    return list(results[0])
