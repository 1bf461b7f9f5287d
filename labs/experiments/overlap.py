"""Chapter 5: a model of DDP's step on an emulated link, set beside the measured step.

From ``loss.backward()`` to averaged gradients, labs' DDP on a :class:`labs.Link` does two
things at once: backward computes, and one communication thread (:class:`labs.ddp.CommStream`,
the stand-in for NCCL's stream) all-reduces the buckets one at a time, in bucket order, each as
soon as it is full and the one before it is done. The model takes the times at which each
bucket became ready in a measured step (its last gradient's hook, on the later of the ranks:
an all-reduce needs every rank) and serves the buckets in order:

    start_k = max(ready_k, end_{k-1}),    end_k = start_k + T(bytes_k),

with T the link's price of labs' lock-step ring (:func:`labs.cost_model.predict_on_link`; at
N = 2, two messages of half the bucket, ``2 alpha + S_k / bandwidth``). Averaged gradients
come after the last bucket's sum, plus what finishing does after it (the waiting thread wakes,
each bucket is divided into ``.grad``), measured in the same step. Nothing is fitted.

The same recurrence with every ready time at the end of backward prices the control that
launches the same buckets only after backward (``DDP(..., overlap=False)``), and NaiveDDP,
which all-reduces each parameter after backward. What the model leaves out is what the link
does not emulate: the Python of each ring step, the copies and additions of each message, a
sleeping thread waking late, and backward and the communication thread taking turns at the
cores. :func:`measure_call_times` times that per call, with nothing else running.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.collectives import Algorithm
from labs.cost_model import predict_on_link
from labs.ddp import all_reduce_sum
from labs.experiments.ddp import StepTimeRow
from labs.experiments.sync_record import SyncRecord
from labs.launcher import launch
from labs.link import Link
from labs.wrappers import Wrapper

#: A schedule: (ready times, seconds each) -> (start, end) of each job, in the same order.
Schedule = Callable[[Sequence[float], Sequence[float]], list[tuple[float, float]]]


def serve_in_order(ready: Sequence[float], seconds: Sequence[float]) -> list[tuple[float, float]]:
    """One server, jobs in the given order: job k starts when it is ready and job k-1 is done,
    ``start_k = max(ready_k, end_{k-1})``, and ends ``seconds[k]`` later. Returns each job's
    ``(start, end)``."""
    if len(ready) != len(seconds):
        raise ValueError(f"one duration per ready time: got {len(ready)} ready times and "
                         f"{len(seconds)} durations.")
    spans, end = [], -float("inf")
    for r, s in zip(ready, seconds, strict=True):
        start = max(r, end)
        end = start + s
        spans.append((start, end))
    return spans


def allreduce_seconds(nbytes: int, world_size: int, link: Link) -> float:
    """The link's price of one all-reduce of ``nbytes`` with labs' lock-step ring (what
    :func:`labs.ddp.all_reduce_sum` runs on a link): 2(N-1)(alpha + nbytes / (N bandwidth))."""
    return predict_on_link(Algorithm.RING, nbytes, world_size, link, segment_bytes=None)


@dataclass(frozen=True)
class StepModel:
    """One measured step beside the model's account of it. Times in seconds, from the first
    rank's ``backward()`` call."""

    measured: float
    """From ``backward()`` to averaged gradients, the slowest rank's."""
    predicted: float
    """The model's value of the same, the slowest rank's."""
    backward_end: float
    """When the last rank's backward returned."""
    ready: tuple[float, ...]
    """When each all-reduce could start: its last gradient, on the later rank (after
    backward, for the control and NaiveDDP)."""
    modelled: tuple[tuple[float, float], ...]
    """The model's (start, end) of each all-reduce."""
    measured_spans: tuple[tuple[float, float], ...]
    """The measured (start, end) of each all-reduce: the earliest start and the latest end
    over the ranks."""
    tail: float
    """After the last all-reduce, until averaged gradients (measured, the slowest rank's)."""
    handoff: float = 0.0
    """From the first bucket's ready time to the moment its all-reduce began, the later rank's
    (measured; the model starts it at once). Overlapped runs only: the control hands its
    buckets over after backward."""

    @property
    def on_the_wire(self) -> float:
        """The model's seconds of all-reduce, every bucket's together."""
        return sum(end - start for start, end in self.modelled)

    @property
    def idle(self) -> float:
        """The model's seconds without an all-reduce between the first one's start and the
        last one's end: buckets not ready yet."""
        if not self.modelled:
            return 0.0
        return self.modelled[-1][1] - self.modelled[0][0] - self.on_the_wire


def model_step(records: Sequence[SyncRecord], link: Link, *, after_backward: bool = False,
               schedule: Schedule = serve_in_order) -> StepModel:
    """The model of one step from every rank's :class:`SyncRecord` of it.

    An all-reduce needs every rank, so bucket k is ready at the latest of the ranks' ready
    times (``after_backward``: at the latest end of backward). ``schedule`` serves the
    buckets (:func:`serve_in_order`; a test passes a wrong one to see the check fail). Rank r
    then has averaged gradients at ``max(end_last, its backward end) + its tail``, the tail
    being what it measured after its last all-reduce ended."""
    if not records:
        raise ValueError("model_step needs every rank's record of the step, got none.")
    world_size = len(records)
    origin = min(r.backward_start for r in records)
    if after_backward:
        ready = [max(r.backward_end for r in records)] * len(records[0].ready)
    else:
        ready = [max(r.ready[k] for r in records) for k in range(len(records[0].ready))]
    seconds = [allreduce_seconds(n, world_size, link) for n in records[0].nbytes]
    spans = schedule(ready, seconds)
    end = spans[-1][1] if spans else origin
    predicted, measured = [], []
    for r in records:
        after = max(r.done[-1] if r.done else r.backward_end, r.backward_end)
        predicted.append(max(end, r.backward_end) + (r.synchronised - after) - r.backward_start)
        measured.append(r.synchronised - r.backward_start)
    tails = [r.synchronised - max(r.done[-1] if r.done else r.backward_end, r.backward_end)
             for r in records]
    handoff = 0.0 if after_backward or not ready else max(r.started[0] - r.ready[0]
                                                          for r in records)
    return StepModel(
        max(measured), max(predicted), max(r.backward_end for r in records) - origin,
        tuple(t - origin for t in ready),
        tuple((s - origin, e - origin) for s, e in spans),
        tuple((min(r.started[k] for r in records) - origin,
               max(r.done[k] for r in records) - origin) for k in range(len(ready))),
        max(tails), handoff)


@dataclass(frozen=True)
class OverlapRow:
    """A case of the sweep, measured and modelled: medians over its timed steps."""

    row: StepTimeRow
    steps: tuple[StepModel, ...]

    @property
    def after_backward(self) -> bool:
        """The control (or NaiveDDP): every all-reduce launched after backward."""
        return self.row.case.wrapper is Wrapper.NAIVE or not self.row.case.overlap

    @property
    def measured(self) -> float:
        return statistics.median(s.measured for s in self.steps)

    @property
    def predicted(self) -> float:
        return statistics.median(s.predicted for s in self.steps)

    @property
    def tail(self) -> float:
        return statistics.median(s.tail for s in self.steps)

    @property
    def backward_end(self) -> float:
        """When backward ended on the later rank, from the first rank's ``backward()``."""
        return statistics.median(s.backward_end for s in self.steps)

    @property
    def handoff(self) -> float:
        """See :attr:`StepModel.handoff`."""
        return statistics.median(s.handoff for s in self.steps)

    @property
    def first_ready(self) -> float:
        """When the first all-reduce could start (see :attr:`StepModel.ready`)."""
        return statistics.median(s.ready[0] for s in self.steps if s.ready)

    @property
    def error(self) -> float:
        """(model - measured) / measured, of the medians."""
        return self.predicted / self.measured - 1

    def typical(self) -> StepModel:
        """The step whose measured time is the median one (the lower middle, if even)."""
        ordered = sorted(self.steps, key=lambda s: s.measured)
        return ordered[(len(ordered) - 1) // 2]


def compare_to_model(rows: Sequence[StepTimeRow], link: Link,
                     schedule: Schedule = serve_in_order) -> list[OverlapRow]:
    """Every row that kept :class:`SyncRecord` s (NaiveDDP, labs' DDP and its control), each
    step modelled by :func:`model_step`."""
    out = []
    for row in rows:
        if not row.records:
            continue
        after = row.case.wrapper is Wrapper.NAIVE or not row.case.overlap
        out.append(OverlapRow(row, tuple(model_step(step, link, after_backward=after,
                                                    schedule=schedule)
                                         for step in row.records)))
    return out


def within(rows: Sequence[OverlapRow], tolerance: float) -> list[bool]:
    """For each row: does the model's median lie within ``tolerance`` (0.15: 15 %) of the
    measured median?"""
    return [abs(r.error) <= tolerance for r in rows]


# --- what one call costs beyond the link's price ------------------------------------------------


@dataclass(frozen=True)
class CallTiming:
    """Back-to-back all-reduces of one size on the link, nothing else running."""

    nbytes: int
    model: float
    """The link's price (:func:`allreduce_seconds`)."""
    seconds: tuple[float, ...]
    """Each call, the slowest rank's."""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def overhead(self) -> float:
        """The median call minus the link's price: what the link does not emulate."""
        return self.median - self.model


def call_times_worker(rank: int, world_size: int, sizes: Sequence[int], repeats: int,
                      warmup: int = 2) -> list[list[float]]:
    """Seconds of each of ``repeats`` all-reduces (:func:`labs.ddp.all_reduce_sum`) of each
    size in ``sizes`` (bytes of float32), back to back as NaiveDDP makes them, the sizes taking
    turns (so that a slow moment of the machine lands on all of them), after one barrier and
    ``warmup`` untimed rounds (which leave the ranks in step)."""
    tensors = [torch.ones(nbytes // 4) for nbytes in sizes]
    out: list[list[float]] = [[] for _ in sizes]
    dist.barrier()
    for i in range(warmup + repeats):
        for tensor, seconds in zip(tensors, out, strict=True):
            start = time.perf_counter()
            all_reduce_sum(tensor)
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
    return out


def measure_call_times(world_size: int, sizes: Sequence[int], link: Link, repeats: int = 30,
                       timeout: float = 120.0) -> list[CallTiming]:
    """Time ``repeats`` back-to-back all-reduces of each size (bytes, multiples of 4) on
    ``link``, one launch; per call, the slowest rank's time."""
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 4 or s % 4]
    if bad or repeats < 1:
        raise ValueError(f"sizes must be byte counts of float32 tensors (ints >= 4, multiples "
                         f"of 4) and repeats >= 1; got sizes {list(sizes)}, repeats {repeats}.")
    per_rank = launch(call_times_worker, world_size, args=(list(sizes), repeats),
                      timeout=timeout, echo=False, link=link, device="cpu")
    return [CallTiming(nbytes, allreduce_seconds(nbytes, world_size, link),
                       tuple(max(r[i][k] for r in per_rank) for k in range(repeats)))
            for i, nbytes in enumerate(sizes)]


# --- the overlap's gain, cap by cap, and NaiveDDP's account -----------------------------------


def pairs_by_cap(rows: Sequence[OverlapRow]) -> list[tuple[OverlapRow, OverlapRow]]:
    """(overlapped, after backward) rows of labs' DDP at each cap where both ran, by cap."""
    overlapped = {r.row.case.bucket_cap_mb: r for r in rows
                  if r.row.case.wrapper is Wrapper.DDP and r.row.case.overlap}
    after = {r.row.case.bucket_cap_mb: r for r in rows
             if r.row.case.wrapper is Wrapper.DDP and not r.row.case.overlap}
    return [(overlapped[cap], after[cap]) for cap in sorted(overlapped) if cap in after]


@dataclass(frozen=True)
class CallCount:
    """All-reduces of one size in a step: how many, the link's price of one, and what one
    costs beyond that price, timed alone (:attr:`CallTiming.overhead`) and in the steps."""

    nbytes: int
    calls: int
    model: float
    overhead: float
    in_run: float
    """The median call of this size in the measured steps (slowest rank), minus ``model``."""


@dataclass(frozen=True)
class NaiveAccount:
    """NaiveDDP's time from ``backward()`` to averaged gradients, taken apart: its own
    backward, the link's price of each all-reduce, and what each costs beyond that price when
    timed alone (:func:`measure_call_times`). Medians, in seconds."""

    backward: float
    """From the first rank's ``backward()`` call to the last rank's end of backward."""
    sizes: tuple[CallCount, ...]
    between: float
    """Measured in the steps: from backward's end to averaged gradients, less the
    all-reduces themselves (the loop, the division by N after each call). The slowest
    rank's, median."""
    measured: float

    @property
    def link_price(self) -> float:
        return sum(s.calls * s.model for s in self.sizes)

    @property
    def overhead(self) -> float:
        return sum(s.calls * s.overhead for s in self.sizes)

    @property
    def accounted(self) -> float:
        return self.backward + self.link_price + self.overhead + self.between

    @property
    def unaccounted(self) -> float:
        """Measured minus accounted for (negative: the parts add up to more)."""
        return self.measured - self.accounted


def call_sizes(row: OverlapRow) -> list[int]:
    """The distinct sizes (bytes) of the all-reduces of ``row``'s steps."""
    return sorted({n for step in row.row.records for r in step for n in r.nbytes})


def account_for_naive(row: OverlapRow, calls: Sequence[CallTiming]) -> NaiveAccount:
    """NaiveDDP's row taken apart with ``calls`` timed at each of its all-reduce sizes."""
    if row.row.case.wrapper is not Wrapper.NAIVE:
        raise ValueError(f"account_for_naive takes NaiveDDP's row, got {row.row.case.label}.")
    timed = {c.nbytes: c for c in calls}
    first = row.row.records[0][0].nbytes
    missing = sorted(set(first) - set(timed))
    if missing:
        raise ValueError(f"no call timed at {missing} bytes: time every size of "
                         f"call_sizes(row) with measure_call_times.")
    steps = row.row.records
    in_run = {n: statistics.median(max(r.done[k] - r.started[k] for r in step)
                                   for step in steps for k in range(len(first)) if first[k] == n)
              for n in set(first)}
    sizes = tuple(CallCount(n, first.count(n), timed[n].model, timed[n].overhead,
                            in_run[n] - timed[n].model) for n in sorted(set(first)))
    # from the first rank's backward() to the last rank's end of backward: the first
    # all-reduce needs both ranks, and the measured time is the slowest rank's
    backward = statistics.median(max(r.backward_end for r in step)
                                 - min(r.backward_start for r in step) for step in steps)
    between = statistics.median(
        max(r.synchronised - r.backward_end
            - sum(d - s for s, d in zip(r.started, r.done, strict=True)) for r in step)
        for step in steps)
    return NaiveAccount(backward, sizes, between, row.measured)
