"""Chapter 5's answer to "do N ranks train N times faster?": samples per second of one rank
and of N ranks with labs' DDP on the emulated link, at per-rank batches chosen around the
batch where :func:`labs.cost_model.crossover_batch` says N ranks overtake one.

Every rank computes on one core (``threads=1``), one rank as much as each of the N: a rank
stands for one device, so N ranks have N times the compute of one, as N GPUs do. The N ranks
all-reduce their gradients in one bucket (a cap larger than the model), which fills when
backward ends: nothing overlaps the all-reduce, the case the closed form prices. One rank
trains the same model without any wrapper (:attr:`labs.wrappers.Wrapper.LOCAL`).

Each batch is timed in alternating launches of one rank and of N, so that a slow moment of
the machine does not land on one side only; a step of N ranks is the slowest rank's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from labs.claims import Claim, Estimate
from labs.experiments.ddp import Case, StepSettings, step_times_worker
from labs.launcher import launch
from labs.link import Link
from labs.wrappers import Wrapper


@dataclass(frozen=True)
class ScalingPoint:
    """One per-rank batch: every timed step of one rank and of N ranks (seconds)."""

    batch: int
    world_size: int
    one: tuple[float, ...]
    many: tuple[float, ...]

    @property
    def one_rank(self) -> Estimate:
        """Seconds per step of one rank."""
        return Estimate.of(self.one, "s")

    @property
    def n_ranks(self) -> Estimate:
        """Seconds per step of N ranks (the slowest rank's)."""
        return Estimate.of(self.many, "s")

    @property
    def speedup(self) -> Estimate:
        """Samples per second of N ranks over one rank's: N T1 / TN."""
        ratio = self.one_rank.over(self.n_ranks)
        n = self.world_size
        return Estimate(n * ratio.median, n * ratio.low, n * ratio.high, ratio.repeats, "x")

    @property
    def efficiency(self) -> Estimate:
        """The speed-up over N: 1 is perfect scaling."""
        s, n = self.speedup, self.world_size
        return Estimate(s.median / n, s.low / n, s.high / n, s.repeats, "")

    def samples_per_second(self) -> tuple[float, float]:
        """(one rank, N ranks), from the medians."""
        return (self.batch / self.one_rank.median,
                self.world_size * self.batch / self.n_ranks.median)


def one_bucket_cap_mb(settings: StepSettings) -> float:
    """A bucket cap larger than the whole model: one bucket, sent after backward."""
    return 2 * settings.gradient_bytes / 2**20


def measure_scaling(world_size: int, settings: StepSettings, batches: Sequence[int],
                    link: Link, launches: int = 2, timeout: float = 300.0
                    ) -> list[ScalingPoint]:
    """Time one rank and ``world_size`` ranks at each per-rank batch of ``batches`` on
    ``link``: ``launches`` launches of each, alternating which goes first, each
    ``settings.steps`` timed steps after ``settings.warmup``."""
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2 to compare with one rank, got "
                         f"{world_size}.")
    cap = one_bucket_cap_mb(settings)
    points = []
    for batch in batches:
        s = replace(settings, batch=batch, bucket_cap_mb=cap)
        one: list[float] = []
        many: list[float] = []
        for repeat in range(launches):
            order = (1, world_size) if repeat % 2 == 0 else (world_size, 1)
            for n in order:
                case = Case(Wrapper.LOCAL if n == 1 else Wrapper.DDP, cap)
                per_rank = launch(step_times_worker, n, args=(s, [case]), timeout=timeout,
                                  echo=False, link=link, device="cpu", threads=1)
                slowest = [max(r[0].seconds[k] for r in per_rank) for k in range(s.steps)]
                (one if n == 1 else many).extend(slowest)
        points.append(ScalingPoint(batch, world_size, tuple(one), tuple(many)))
    return points


def fit_compute(points: Sequence[ScalingPoint]) -> tuple[float, float]:
    """One rank's step as ``c b + f``: (c, f), the least-squares line through the medians of
    its step times against the batch (at least two batches)."""
    if len({p.batch for p in points}) < 2:
        raise ValueError("fitting c b + f needs one rank's times at two batches at least.")
    xs = [float(p.batch) for p in points]
    ys = [p.one_rank.median for p in points]
    slope, intercept = statistics.linear_regression(xs, ys)
    return slope, intercept


# --- predict, run, judge ------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """Chapter 5's prediction from one rank's times: its compute per step ``c b + f``, the
    link's price ``R = 2 alpha + S/bandwidth`` of one all-reduce on two ranks, and the batch
    ``b* = (R - f)/c`` at which two ranks should start to beat one."""

    per_sample_s: float
    fixed_s: float
    allreduce_s: float

    @property
    def crossover(self) -> float:
        return (self.allreduce_s - self.fixed_s) / self.per_sample_s

    def batches(self) -> list[int]:
        """The batches that test it: b*/2, b* and 2b*."""
        return [max(1, round(self.crossover * k)) for k in (0.5, 1, 2)]

    def speedup(self, batch: float) -> float:
        """The model's speed-up of two ranks at ``batch``: 2 T1 / (T1 + R)."""
        t1 = self.per_sample_s * batch + self.fixed_s
        return 2 * t1 / (t1 + self.allreduce_s)


def predict(points: Sequence[ScalingPoint], settings: StepSettings, link: Link) -> Prediction:
    """The prediction from the one-rank times of ``points`` (two ranks only)."""
    if any(p.world_size != 2 for p in points):
        raise ValueError("the prediction prices an all-reduce on two ranks: measure N = 2.")
    c, f = fit_compute(points)
    return Prediction(c, f, 2 * link.alpha + settings.gradient_bytes / link.bandwidth)


def small_batch_claim(point: ScalingPoint) -> Claim:
    """At a small batch two ranks are slower than one."""
    return Claim.below(
        "ch5.small-batch-slower", point.speedup, 1.0,
        held="At {batch} samples per rank, two ranks train {value:.2f}x the samples per "
             "second of one: slower than one rank, as predicted.",
        opposite="At {batch} samples per rank, two ranks train {value:.2f}x the samples per "
                 "second of one: faster, against the prediction.",
        batch=point.batch)


def crossover_claims(around: Sequence[ScalingPoint]) -> tuple[Claim, Claim, Claim]:
    """At b*/2 two ranks are slower, at 2b* faster; at b* itself the text needs no side."""
    below, at, above = around
    return (
        Claim.below(
            "ch5.below-crossover-slower", below.speedup, 1.0,
            held="At b\\*/2 ({batch} per rank) two ranks train {value:.2f}x one rank's "
                 "samples per second: slower.",
            opposite="At b\\*/2 ({batch} per rank) two ranks train {value:.2f}x one rank's "
                     "samples per second: already faster.", batch=below.batch),
        Claim.above(
            "ch5.above-crossover-faster", above.speedup, 1.0,
            held="At 2b\\* ({batch} per rank) they train {value:.2f}x: faster, a scaling "
                 "efficiency of {eff:.2f}.",
            opposite="At 2b\\* ({batch} per rank) they train {value:.2f}x: still slower.",
            batch=above.batch, eff=above.efficiency.median),
        Claim.above(
            "ch5.at-crossover", at.speedup, 1.0, needs=None,
            held="At b\\* itself ({batch}) two ranks were already faster ({value:.2f}x): the "
                 "crossover came a little earlier than the model put it.",
            opposite="At b\\* itself ({batch}) two ranks were still slower ({value:.2f}x): "
                     "the all-reduce took longer than R, by what the next line measures.",
            unsure="At b\\* itself ({batch}) the two are as fast as each other within the "
                   "spread ({low:.2f}-{high:.2f}x), as the model says.", batch=at.batch),
    )


def crossover_experiment(settings: StepSettings, link: Link, small: Sequence[int] = (32, 256),
                         launches: int = 2) -> tuple[Claim, ...]:
    """The whole of chapter 5's "does it get faster?", as ``python -m labs.bench claims``
    repeats it: measure at ``small``, predict, measure around b*, and judge."""
    small_points = measure_scaling(2, settings, small, link, launches)
    prediction = predict(small_points, settings, link)
    around = measure_scaling(2, settings, prediction.batches(), link, launches)
    return (small_batch_claim(small_points[0]), *crossover_claims(around))


# --- the same condition on published hardware ----------------------------------------------------


@dataclass(frozen=True)
class PublishedSystem:
    """A GPU system by its vendors' published peak figures (not measured here)."""

    name: str
    world_size: int
    flops: float
    """Dense bf16 FLOP/s of one GPU, the datasheet's peak."""
    link: float
    """Bytes per second of one GPU's slowest link of the ring, per direction, nominal."""
    source: str


#: H100 SXM5: 989 TFLOP/s dense bf16 and NVLink 4 at 900 GB/s in both directions together
#: (NVIDIA H100 Tensor Core GPU datasheet); across nodes one 400 Gb/s NDR InfiniBand NIC per
#: GPU (ConnectX-7, as in DGX H100); Ethernet at its line rate.
PUBLISHED: tuple[PublishedSystem, ...] = (
    PublishedSystem("8 x H100, NVLink 4 (one node)", 8, 989e12, 450e9,
                    "H100 datasheet: NVLink 900 GB/s bidirectional"),
    PublishedSystem("64 x H100, 8 nodes, NDR InfiniBand", 64, 989e12, 50e9,
                    "ConnectX-7: 400 Gb/s per GPU"),
    PublishedSystem("64 x H100, 8 nodes, 100 GbE per node", 64, 989e12, 12.5e9 / 8,
                    "100 Gb/s shared by a node's 8 GPUs"),
)


@dataclass(frozen=True)
class HardwareCrossover:
    """What :func:`on_published` gives for one system."""

    system: PublishedSystem
    allreduce_s: float
    """R: one ring all-reduce of the gradients, bandwidth term only."""
    per_token_s: float
    """c: the seconds one GPU computes per token (6 FLOPs per parameter per token)."""
    break_even_tokens: float
    """Tokens per GPU per step at which N GPUs train as fast as one (b*)."""
    efficient_tokens: float
    """Tokens per GPU per step for the given scaling efficiency, nothing overlapped."""


def on_published(system: PublishedSystem, parameters: float, mfu: float = 0.4,
                 efficiency: float = 0.9, gradient_bytes: int = 2) -> HardwareCrossover:
    """Chapter 5's condition on ``system`` for a model of ``parameters`` parameters with
    gradients of ``gradient_bytes`` bytes each, the GPUs computing at ``mfu`` of their peak.

    ``R = 2(N-1)/N S / link`` (the latency term is left out: for gigabytes it is microseconds
    against seconds), ``c = 6 P / (mfu F)``. N GPUs break even at ``T1 = R/(N-1)``; they reach
    scaling efficiency E when ``T1/(T1 + R) = E``, ``T1 = E/(1-E) R``. Both in tokens: T1 / c.
    With S = 2P the parameters cancel: the efficient batch is ``E/(1-E) 2(N-1)/N 2/6 mfu F /
    link`` tokens, a ratio of compute rate to link rate."""
    if not 0 < efficiency < 1 or not 0 < mfu <= 1:
        raise ValueError(f"efficiency must lie in (0, 1) and mfu in (0, 1], got {efficiency} "
                         f"and {mfu}.")
    n = system.world_size
    r = 2 * (n - 1) / n * parameters * gradient_bytes / system.link
    c = 6 * parameters / (mfu * system.flops)
    return HardwareCrossover(system, r, c, r / (n - 1) / c,
                             efficiency / (1 - efficiency) * r / c)
