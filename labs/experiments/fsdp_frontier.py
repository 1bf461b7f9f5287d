"""Chapter 7: FSDP's step beside DDP's as the link gets faster (the overlap frontier).

The model of :mod:`labs.experiments.fsdp_overlap` (equal blocks, one FSDP unit each) runs on
one launch per link of :data:`FRONTIER_LINKS` (the chapter's slow link's latency, three
bandwidths), twice:

* labs' FSDP, ``prefetch=1``, ``reshard_after_forward=True``, its collectives labs' ring on
  the link's communication stream (as in :mod:`~labs.experiments.fsdp_overlap`);
* labs' DDP with one bucket per block (:func:`ddp_bucket_cap_mb`),
  its all-reduces labs' ring on the same kind of stream, overlapped with backward. torch's
  default of 25 MB would put this 16 MiB model in one bucket, sent after backward; at scale
  25 MB is a small part of a model, and one bucket per block keeps that proportion.

Per setting, each step is timed (the slower rank's), and so is its **exposed communication**:
the time the step waited for the wire. For FSDP it is the step less its busy time
(:func:`labs.experiments.fsdp_overlap.busy_seconds`: compute and overheads, every wait taken
out); for DDP, the time from the end of backward to the last all-reduce's end, when that
is later (:class:`labs.experiments.sync_record.SyncRecord`): before it, backward computes.

The models price the same steps at any bandwidth: FSDP's with
:func:`labs.experiments.fsdp_overlap.simulate` from the measured profile, DDP's with chapter
5's :func:`labs.experiments.overlap.model_step` from the measured ready times of the buckets.
:func:`crossover` finds the bandwidth from which FSDP's modelled wait for the wire exceeds
DDP's by no more than 10 % of DDP's step. Compute is taken as measured at each point, and
each call's cost beyond the link's price as measured alone; nothing is fitted.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labs.collectives import Algorithm, ring_all_gather, ring_reduce_scatter
from labs.ddp import DDP, StepTimeline, all_reduce_sum
from labs.experiments.fsdp_overlap import (
    SLOW_LINK,
    Block,
    OverlapSettings,
    Profile,
    busy_seconds,
    collective_seconds,
    median_profile,
    profile_of,
    rebase,
    simulate,
    train_step,
)
from labs.experiments.overlap import allreduce_seconds, model_step, serve_in_order
from labs.experiments.sync_record import BackwardTimes, SyncRecord, sync_record
from labs.fsdp import FSDP
from labs.launcher import launch
from labs.link import Link

#: The chapter's slow link's latency at three bandwidths: slow, middling, fast.
FRONTIER_LINKS = tuple(Link(alpha=SLOW_LINK.alpha, bandwidth=b) for b in (31.25e6, 250e6, 1e9))


#: The chapter's run: the shapes of :mod:`~labs.experiments.fsdp_overlap`, 4 timed steps each.
FRONTIER = OverlapSettings(steps=4)


def ddp_bucket_cap_mb(config: OverlapSettings) -> float:
    """One block's fp32 weight, in MiB: a bucket closes once it holds the cap or more
    (:func:`labs.ddp.assign_buckets`), so each block's bias and weight make one bucket."""
    return config.width * config.width * 4 / 2**20


@dataclass(frozen=True)
class FrontierSteps:
    """One rank's timed steps on one link."""

    fsdp_seconds: tuple[float, ...]
    fsdp_profiles: tuple[Profile, ...]
    ddp_seconds: tuple[float, ...]
    ddp_records: tuple[SyncRecord, ...]
    calls: tuple[tuple[float, ...], ...]
    """Seconds of each all-gather, reduce-scatter and all-reduce timed alone."""


def frontier_worker(rank: int, world_size: int, config: OverlapSettings) -> FrontierSteps:
    """FSDP (prefetch 1, reshard on) then DDP (a bucket per block) on the launch's link: one
    untimed step and ``config.steps`` timed ones each, a barrier before every step."""
    torch.manual_seed(rank)
    x = torch.randn(config.tokens, config.width)
    torch.manual_seed(0)
    fsdp = FSDP(nn.Sequential(*(Block(config.width) for _ in range(config.units))),
                collectives=Algorithm.RING, prefetch=1, reshard_after_forward=True)
    optimizer = torch.optim.SGD(fsdp.parameters(), lr=1e-3)
    train_step(fsdp, optimizer, x)
    fsdp_seconds, profiles = [], []
    for _ in range(config.steps):
        dist.barrier()
        start = time.perf_counter()
        train_step(fsdp, optimizer, x)
        fsdp_seconds.append(time.perf_counter() - start)
        profiles.append(profile_of(rebase(fsdp.timeline, start), fsdp_seconds[-1],
                                   config.units))
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*(Block(config.width) for _ in range(config.units))),
              bucket_cap_mb=ddp_bucket_cap_mb(config))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    _ddp_step(ddp, optimizer, x)
    ddp_seconds, records = [], []
    for _ in range(config.steps):
        dist.barrier()
        start = time.perf_counter()
        record = _ddp_step(ddp, optimizer, x)
        ddp_seconds.append(time.perf_counter() - start)
        records.append(record)
    return FrontierSteps(tuple(fsdp_seconds), tuple(profiles), tuple(ddp_seconds),
                         tuple(records), _call_seconds(config))


def _call_seconds(config: OverlapSettings, repeats: int = 5) -> tuple[tuple[float, ...], ...]:
    """Each of ``repeats`` calls, back to back with nothing else running: the ring's
    all-gather and reduce-scatter of one unit (FSDP's), then the all-reduce of one block's
    bucket (DDP's), after one untimed round."""
    n = dist.get_world_size()
    full = torch.ones(config.unit_bytes // 4)
    shard = torch.ones(full.numel() // n)
    bucket = torch.ones(config.width * config.width + config.width)
    calls = (lambda: ring_all_gather(shard, out=full), lambda: ring_reduce_scatter(full),
             lambda: all_reduce_sum(bucket))
    seconds: list[list[float]] = [[] for _ in calls]
    dist.barrier()
    for i in range(1 + repeats):
        for call, out in zip(calls, seconds, strict=True):
            start = time.perf_counter()
            call()
            if i:
                out.append(time.perf_counter() - start)
    return tuple(tuple(s) for s in seconds)


def _ddp_step(model: DDP, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> SyncRecord:
    model.timeline = StepTimeline()  # a fresh record of this step
    loss = model(x).square().mean()
    start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    model.finish_gradient_synchronization()
    synchronised = time.perf_counter()
    record = sync_record(model, BackwardTimes(synchronised - start, start, backward_end,
                                              synchronised))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if record is None:
        raise RuntimeError("DDP kept no complete record of its step on the link.")
    return record


@dataclass(frozen=True)
class CallCosts:
    """What one call costs beyond the link's price (its port model), measured alone: the
    median call less the price. The ring's Python, the copies and additions of each message,
    a thread waking: what the link does not emulate."""

    gather: float
    reduce: float
    all_reduce: float


@dataclass(frozen=True)
class FrontierPoint:
    """One link: both steps measured, their busy and exposed time, and both models."""

    link: Link
    fsdp_seconds: tuple[float, ...]
    """Each timed step, the slower rank's."""
    fsdp_busy: float
    """Median over steps of FSDP's compute and overheads, every wait taken out."""
    ddp_seconds: tuple[float, ...]
    ddp_exposed: float
    """Median over steps of the slower rank's wait, after backward, for the last all-reduce."""
    profile: Profile
    """FSDP's median profile (compute, measured), for the model at other bandwidths."""
    ddp_records: tuple[tuple[SyncRecord, ...], ...]
    """Every timed step's records of both ranks, for the model at other bandwidths."""
    ddp_outside: float
    """Median over steps of DDP's step less its backward-to-synchronised part (forward, the
    loss, the optimizer step), measured."""
    costs: CallCosts
    config: OverlapSettings

    @property
    def fsdp(self) -> float:
        return statistics.median(self.fsdp_seconds)

    @property
    def ddp(self) -> float:
        return statistics.median(self.ddp_seconds)

    @property
    def fsdp_exposed(self) -> float:
        """FSDP's step less its busy time: the waits."""
        return self.fsdp - self.fsdp_busy

    @property
    def ddp_busy(self) -> float:
        return self.ddp - self.ddp_exposed

    def fsdp_model(self, link: Link | None = None) -> float:
        """FSDP's step (prefetch 1, reshard on) on ``link`` (this point's by default): this
        point's compute, each collective at the link's price plus its measured cost."""
        link = link or self.link
        price = collective_seconds(self.config.unit_bytes, self.config.world_size, link)
        return simulate(self.profile, 1, True, price + self.costs.gather,
                        price + self.costs.reduce).step

    def ddp_model(self, link: Link | None = None) -> float:
        """DDP's step on ``link``: this point's measured ready times and the rest of the step
        measured, each all-reduce at the link's price plus its measured cost, served in order
        (chapter 5's model)."""
        link = link or self.link
        extra = self.costs.all_reduce

        def schedule(ready: Sequence[float], seconds: Sequence[float]
                     ) -> list[tuple[float, float]]:
            return serve_in_order(ready, [s + extra for s in seconds])
        return self.ddp_outside + statistics.median(
            model_step(records, link, schedule=schedule).predicted
            for records in self.ddp_records)

    def fsdp_model_free(self) -> float:
        """FSDP's model with every collective free: its compute and overheads alone."""
        return simulate(self.profile, 1, True, 0.0, 0.0).step

    def ddp_model_free(self) -> float:
        """DDP's model with every all-reduce free: backward, the tail and the rest alone."""
        def free(ready: Sequence[float], seconds: Sequence[float]) -> list[tuple[float, float]]:
            return serve_in_order(ready, [0.0] * len(seconds))
        return self.ddp_outside + statistics.median(
            model_step(records, self.link, schedule=free).predicted
            for records in self.ddp_records)


def _ddp_exposed(records: Sequence[SyncRecord]) -> float:
    """The slower rank's wait, after its backward, for the step's last all-reduce."""
    last = max(r.done[-1] for r in records)
    return max(max(0.0, last - r.backward_end) for r in records)


def _costs(calls: Sequence[Sequence[float]], config: OverlapSettings, link: Link) -> CallCosts:
    gather = collective_seconds(config.unit_bytes, config.world_size, link)
    bucket = (config.width * config.width + config.width) * 4
    prices = (gather, gather, allreduce_seconds(bucket, config.world_size, link))
    return CallCosts(*(statistics.median(c) - p for c, p in zip(calls, prices, strict=True)))


def measure_frontier(config: OverlapSettings = FRONTIER,
                     links: Sequence[Link] = FRONTIER_LINKS, timeout: float = 300.0
                     ) -> list[FrontierPoint]:
    """One launch per link (``config.link`` is not used): FSDP's and DDP's timed steps, then
    the calls alone."""
    if not links or not all(isinstance(link, Link) for link in links):
        raise ValueError(f"links must be one or more labs.Link, e.g. "
                         f"[Link(alpha=2e-3, bandwidth=250e6)]; got {links!r}.")
    points = []
    for link in links:
        per_rank = launch(frontier_worker, config.world_size, args=(config,), link=link,
                          device="cpu", timeout=timeout, echo=False)
        steps = range(config.steps)
        slower = [max(per_rank, key=lambda r, s=s: r.fsdp_seconds[s]) for s in steps]
        profiles = [r.fsdp_profiles[s] for s, r in zip(steps, slower, strict=True)]
        records = tuple(tuple(r.ddp_records[s] for r in per_rank) for s in steps)
        ddp_seconds = tuple(max(r.ddp_seconds[s] for r in per_rank) for s in steps)
        outside = statistics.median(
            d - max(r.synchronised - r.backward_start for r in rec)
            for d, rec in zip(ddp_seconds, records, strict=True))
        calls = [[max(r.calls[c][k] for r in per_rank) for k in range(len(r0))]
                 for c, r0 in enumerate(per_rank[0].calls)]
        points.append(FrontierPoint(
            link, tuple(r.fsdp_seconds[s] for s, r in zip(steps, slower, strict=True)),
            statistics.median(busy_seconds(p) for p in profiles), ddp_seconds,
            statistics.median(_ddp_exposed(r) for r in records), median_profile(profiles),
            records, outside, _costs(calls, config, link), config))
    return points


@dataclass(frozen=True)
class Curve:
    """Both models over a range of bandwidths, from one point's measured compute and costs,
    and each model's step with its communication free (what it waits for is the rest)."""

    bandwidths: tuple[float, ...]
    fsdp: tuple[float, ...]
    ddp: tuple[float, ...]
    fsdp_free: float
    ddp_free: float


def curves(point: FrontierPoint, low: float = 25e6, high: float = 4e9, count: int = 60
           ) -> Curve:
    """Both models from ``low`` to ``high`` bytes/s (log-spaced), at ``point``'s latency."""
    ratio = (high / low) ** (1 / (count - 1))
    bands = tuple(low * ratio**i for i in range(count))
    links = [Link(alpha=point.link.alpha, bandwidth=b) for b in bands]
    return Curve(bands, tuple(point.fsdp_model(k) for k in links),
                 tuple(point.ddp_model(k) for k in links), point.fsdp_model_free(),
                 point.ddp_model_free())


def crossover(curve: Curve, slack: float = 0.10) -> float:
    """The lowest bandwidth of ``curve`` from which on FSDP's modelled wait for the wire (its
    step less its step with free communication) exceeds DDP's by no more than ``slack`` of
    DDP's step. ``math.inf`` if the curve never gets there. Both waits come from the models
    alone, so the noise of two measured busy times does not move it."""
    met = [(f - curve.fsdp_free) - (d - curve.ddp_free) <= slack * d
           for f, d in zip(curve.fsdp, curve.ddp, strict=True)]
    for i in range(len(met)):
        if all(met[i:]):
            return curve.bandwidths[i]
    return math.inf
