"""Chapter 9: a straggler, on real ranks.

N ranks train a small model with labs' DDP (:func:`measure_stragglers`); before each step
every rank sleeps a delay drawn from an exponential distribution of mean ``mean_s`` (the draws
are known in advance: a generator seeded by step and rank). A step cannot end before the
slowest rank's all-reduce, so each step should last a step without delays plus the largest of
that step's N delays, whose expectation is ``mean_s`` times the harmonic number
H_N = 1 + 1/2 + ... + 1/N: 1.5, 2.08 and 2.72 means at N = 2, 4, 8.

Where the wait goes (:func:`measure_straggler_timeline`): one step of chapter 5's bucketed DDP
with one rank late, every rank's backward and bucket all-reduces on one clock. The punctual
rank's first all-reduce starts on time and ends only once the late rank has sent its half:
the wait is hidden inside the punctual rank's communication, not in its computation.
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

from labs.ddp import DDP, StepTimeline
from labs.launcher import launch
from labs.link import Link
from labs.tables import format_table


@dataclass(frozen=True)
class StragglerSettings:
    """N ranks, ``steps`` timed steps, delays of mean ``mean_s`` before each."""

    mean_s: float = 0.03
    steps: int = 12
    width: int = 64
    batch: int = 16
    link: Link = Link(alpha=2e-4, bandwidth=1e9)
    seed: int = 0

    def delays(self, world_size: int) -> list[list[float]]:
        """``delays[step][rank]``: the seconds each rank sleeps before each step (the first
        row is the untimed step's: zeros)."""
        rows = [[0.0] * world_size]
        for step in range(1, self.steps + 1):
            generator = torch.Generator().manual_seed(self.seed * 100_003 + step)
            draws = torch.empty(world_size).exponential_(1.0, generator=generator)
            rows.append([self.mean_s * float(d) for d in draws])
        return rows


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n: the expected largest of n exponential draws of mean 1."""
    return sum(1.0 / k for k in range(1, n + 1))


def straggler_worker(rank: int, world_size: int, config: StragglerSettings,
                     delayed: bool) -> list[float]:
    """Each timed step on this rank (a barrier first; with ``delayed`` a sleep of this rank's
    delay, then forward, backward, the all-reduces and the optimizer step)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh(),
                              nn.Linear(config.width, config.width)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(config.batch, config.width, generator=torch.Generator().manual_seed(rank))
    delays = config.delays(world_size)
    seconds = []
    for step in range(config.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        if delayed:
            time.sleep(delays[step][rank])
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            seconds.append(time.perf_counter() - start)
    return seconds


@dataclass(frozen=True)
class StragglerRow:
    """One world size: steps without and with delays, and what the delays predict."""

    world_size: int
    base: tuple[float, ...]
    """Each step without delays, the slowest rank's."""
    delayed: tuple[float, ...]
    """Each step with delays, the slowest rank's."""
    largest: tuple[float, ...]
    """Each step's largest delay (drawn before the run)."""
    mean_s: float

    @property
    def without(self) -> float:
        """The median step without delays."""
        return statistics.median(self.base)

    @property
    def predicted(self) -> float:
        """The median step without delays plus the mean of each step's largest delay."""
        return self.without + statistics.mean(self.largest)

    @property
    def expected(self) -> float:
        """The median step without delays plus mean x H_N (the expectation)."""
        return self.without + self.mean_s * harmonic(self.world_size)

    @property
    def measured(self) -> float:
        return statistics.mean(self.delayed)


def measure_stragglers(world_sizes: Sequence[int] = (2, 4, 8),
                       config: StragglerSettings = StragglerSettings(),
                       timeout: float = 120.0) -> list[StragglerRow]:
    """Each world size twice on ``config.link``: without delays, then with them."""
    bad = [n for n in world_sizes if isinstance(n, bool) or not isinstance(n, int) or n < 2]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be ints >= 2, got {list(world_sizes)}.")
    rows = []
    for n in world_sizes:
        steps = {}
        for delayed in (False, True):
            per_rank = launch(straggler_worker, n, args=(config, delayed), link=config.link,
                              device="cpu", timeout=timeout, echo=False)
            steps[delayed] = tuple(max(r[k] for r in per_rank) for k in range(config.steps))
        largest = tuple(max(row) for row in config.delays(n)[1:])
        rows.append(StragglerRow(n, steps[False], steps[True], largest, config.mean_s))
    return rows


def expected_largest(mean_s: float, world_size: int) -> float:
    """``mean_s`` x H_N."""
    if world_size < 1 or not mean_s >= 0 or math.isinf(mean_s):
        raise ValueError("world_size must be >= 1 and mean_s a finite number >= 0.")
    return mean_s * harmonic(world_size)




def straggler_table(rows: Sequence[StragglerRow]) -> str:
    """Each world size: the step without delays, with them, and the two predictions (ms)."""
    return format_table(
        ["ranks", "step without delays (ms)", "mean step with delays",
         "without + each step's largest delay", "without + mean x H_N", "H_N"],
        [[r.world_size, f"{r.without * 1e3:.1f}", f"{r.measured * 1e3:.1f}",
          f"{r.predicted * 1e3:.1f}", f"{r.expected * 1e3:.1f}", f"{harmonic(r.world_size):.2f}"]
         for r in rows])


# --- where the wait shows -----------------------------------------------------------------------


@dataclass(frozen=True)
class RankTimeline:
    """One rank's step, in seconds since every rank left the same barrier."""

    rank: int
    late_s: float
    """How long this rank slept before its forward (its delay)."""
    forward: tuple[float, float]
    backward: tuple[float, float]
    allreduces: tuple[tuple[float, float], ...]
    """Each bucket's all-reduce, from launch to completion, in launch order."""
    synchronised: float
    """When every gradient held its average."""


def timeline_worker(rank: int, world_size: int, width: int, layers: int, batch: int,
                    bucket_cap_mb: float, delays: tuple[float, ...]) -> RankTimeline:
    """One step of labs' DDP after a warm-up step: a barrier, this rank's delay, forward,
    backward (buckets all-reduced as they fill), the wait for the last bucket. Times count
    from the barrier (every rank leaves it within a fraction of a millisecond, and
    ``time.perf_counter`` is one clock for every process of a machine)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]),
                bucket_cap_mb=bucket_cap_mb)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    for warm in (True, False):
        model.zero_grad()
        model.timeline = t = StepTimeline()
        dist.barrier()
        zero = time.perf_counter()
        if not warm:
            time.sleep(delays[rank])
        f0 = time.perf_counter()
        loss = model(x).square().mean()
        b0 = time.perf_counter()
        loss.backward()
        b1 = time.perf_counter()
        model.finish_gradient_synchronization()
        done = time.perf_counter()
    t = t.resolved()
    spans = tuple((t.launched[i] - zero, t.done[i] - zero) for i in sorted(t.launched))
    return RankTimeline(rank, delays[rank], (f0 - zero, b0 - zero), (b0 - zero, b1 - zero),
                        spans, done - zero)


def measure_straggler_timeline(world_size: int = 2, late_rank: int = 1, late_s: float = 0.05,
                               width: int = 512, layers: int = 4, batch: int = 64,
                               bucket_cap_mb: float = 1.0) -> list[RankTimeline]:
    """Every rank's timeline of one step with ``late_rank`` ``late_s`` seconds late."""
    if not 0 <= late_rank < world_size or not late_s >= 0:
        raise ValueError(f"late_rank must be a rank (0 to {world_size - 1}) and late_s >= 0, "
                         f"got {late_rank!r} and {late_s!r}.")
    delays = tuple(late_s if r == late_rank else 0.0 for r in range(world_size))
    return list(launch(timeline_worker, world_size,
                       args=(width, layers, batch, bucket_cap_mb, delays),
                       backend="gloo", device="cpu", timeout=60, echo=False))
