"""Chapter 5's measurements on real ranks: step times, bucket sizes, the backward timeline,
gradient accumulation with and without ``no_sync()``, and the DistributedSampler.

Every function named ``*_worker`` runs inside a rank (``launch(worker, N, args=(...))``); the
others run in the notebook and launch them. Ranks import this module to find the workers, so
it imports nothing heavy (plots live in :mod:`labs.viz.ddp`).

The step-time experiments time the same model and batch under several implementations, in
one launch, alternating their order every iteration so that a slow moment of the machine does
not land on one of them only. Given ``link=`` (a :class:`labs.Link`), they run on that emulated
network, where labs' wrappers all-reduce with labs' ring (:mod:`labs.ddp`) and torch's DDP,
whose collectives the link does not carry, is refused. Beside labs' DDP at a cap they can run
its control, ``DDP(..., overlap=False)``, and for NaiveDDP and labs' DDP they keep every rank's
:class:`labs.experiments.sync_record.SyncRecord` of each timed step, which
:mod:`labs.experiments.overlap` sets beside its model.
"""

from __future__ import annotations

import contextlib
import enum
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs.clock import synchronize
from labs.ddp import (
    DDP,
    DEFAULT_BUCKET_CAP_MB,
    NaiveDDP,
    StepTimeline,
    assign_buckets,
    trainable_parameters,
)
from labs.experiments.sync_record import BackwardTimes, SyncRecord, sync_record
from labs.launcher import launch, rank_device
from labs.link import Link

# The experiment's model and loop are labs.models' (chapters 6-8 time the same MLP); they are
# named here too, where chapter 5 and its notebook first meet them.
from labs.models import Optimizer as Optimizer
from labs.models import StepSettings as StepSettings
from labs.models import mlp as mlp
from labs.wrappers import Wrapper, synchronise, wrap


@dataclass(frozen=True)
class Case:
    """One timed configuration: an implementation at a bucket cap, whether the micro-batches
    before the last of an optimizer step run inside ``no_sync()``, and (labs' DDP only)
    whether the buckets are all-reduced during backward or, as a control, only after it
    (``DDP(..., overlap=False)``)."""

    wrapper: Wrapper
    bucket_cap_mb: float
    no_sync: bool = True
    overlap: bool = True

    def __post_init__(self) -> None:
        if not self.overlap and self.wrapper is not Wrapper.DDP:
            raise ValueError(f"overlap=False is a setting of labs' DDP (Wrapper.DDP), not of "
                             f"{self.wrapper.value}: use Case(Wrapper.DDP, cap, overlap=False).")

    @property
    def label(self) -> str:
        label = self.wrapper.value
        if self.wrapper in (Wrapper.DDP, Wrapper.TORCH_DDP):
            label += f" ({cap_text(self.bucket_cap_mb)}"
            label += ")" if self.overlap else ", after backward)"
        return label if self.no_sync else f"{label} without no_sync()"

    def build(self, settings: StepSettings) -> nn.Module:
        """This case's wrapper around the experiment's model, on this rank's device."""
        if not self.overlap:
            return DDP(mlp(settings).to(rank_device()), bucket_cap_mb=self.bucket_cap_mb,
                       overlap=False)
        return wrap(self.wrapper, mlp(settings), self.bucket_cap_mb)


def cap_text(cap_mb: float) -> str:
    """A bucket cap for people: ``256 KiB``, ``25 MiB``."""
    return f"{cap_mb:g} MiB" if cap_mb >= 1 else f"{cap_mb * 1024:g} KiB"


class Measure(enum.Enum):
    """Which part of an optimizer step a timing covers."""

    STEP = "milliseconds per step"
    """The whole optimizer step: zero_grad, forward, backward, synchronisation, the update."""
    BACKWARD = "milliseconds from backward() to averaged gradients"
    """From ``loss.backward()`` until every gradient holds its average (summed over the
    micro-batches): the part a bucket cap changes. Forward cannot overlap with the
    gradients' communication: they do not exist yet."""


@dataclass(frozen=True)
class CaseTiming:
    """Seconds per optimizer step of one case on one rank (whole, and backward through
    synchronisation), its bucket count, and (NaiveDDP and labs' DDP) each timed step's
    :class:`SyncRecord`."""

    case: Case
    seconds: tuple[float, ...]
    buckets: int
    backward: tuple[float, ...] = ()
    records: tuple[SyncRecord | None, ...] = ()


def step_times_worker(rank: int, world_size: int, settings: StepSettings,
                      cases: Sequence[Case]) -> list[CaseTiming]:
    """Time ``settings.steps`` SGD steps of every case, alternating the case order each
    iteration; a barrier before each step so every rank starts it together."""
    device = rank_device()
    models = [c.build(settings) for c in cases]
    optimizers = [settings.optimizer.build(m.parameters()) for m in models]
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(settings.batch, settings.width, generator=generator).to(device)
    seconds: list[list[float]] = [[] for _ in cases]
    backward: list[list[float]] = [[] for _ in cases]
    records: list[list[SyncRecord | None]] = [[] for _ in cases]
    order = list(range(len(cases)))
    for iteration in range(settings.warmup + settings.steps):
        for i in order if iteration % 2 == 0 else reversed(order):
            if isinstance(models[i], (NaiveDDP, DDP)):
                models[i].timeline = StepTimeline()
            dist.barrier()
            synchronize(rank_device())
            start = time.perf_counter()
            optimizers[i].zero_grad()
            timed = _accumulate(models[i], x, settings.accumulation,
                                use_no_sync=cases[i].no_sync)
            optimizers[i].step()
            synchronize(rank_device())
            if iteration >= settings.warmup:
                seconds[i].append(time.perf_counter() - start)
                backward[i].append(timed.spent)
                records[i].append(sync_record(models[i], timed))
    return [CaseTiming(c, tuple(s), _bucket_count(c, settings), tuple(b), tuple(r))
            for c, s, b, r in zip(cases, seconds, backward, records, strict=True)]


def _accumulate(model: nn.Module, x: torch.Tensor, micro_batches: int, use_no_sync: bool
                ) -> BackwardTimes:
    """Forward and backward ``micro_batches`` times, each loss divided by their number, then
    synchronise. With ``use_no_sync`` every micro-batch but the last runs inside
    ``model.no_sync()`` (forward and backward), so only the last one communicates."""
    spent, start, backward_end, end = 0.0, 0.0, 0.0, 0.0
    for micro in range(micro_batches):
        last = micro == micro_batches - 1
        quiet = use_no_sync and not last and hasattr(model, "no_sync")
        with model.no_sync() if quiet else contextlib.nullcontext():
            loss = model(x).square().mean() / micro_batches
            start = time.perf_counter()
            loss.backward()
            # the host's clock: on a GPU, when backward's kernels were queued (a device
            # synchronize here would also wait for the all-reduces in flight)
            backward_end = time.perf_counter()
            synchronise(model)
            synchronize(rank_device())
            end = time.perf_counter()
            spent += end - start
    return BackwardTimes(spent, start, backward_end, end)


def torch_bucket_counts(settings: StepSettings, bucket_cap_mb: float,
                        iterations: int = 2) -> list[int]:
    """How many buckets torch's DDP all-reduces in each of its first ``iterations``
    iterations on the experiment's model, at ``bucket_cap_mb``. Every rank must call it.

    torch's DDP makes its all-reduces in C++, where a counter of ours cannot see them, so a
    fresh, untimed copy of the model gets a communication hook (public API) that counts its
    calls and then does what the default hook does. Its first iteration has one bucket: the
    order in which gradients arrive is not known yet. Before the second forward it rebuilds
    them in the order they arrived, up to the cap.
    """
    model = wrap(Wrapper.TORCH_DDP, mlp(settings), bucket_cap_mb)
    hook = _HookCalls()
    model.register_comm_hook(hook, _counting_hook)
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(0)).to(rank_device())
    counts = []
    for _ in range(iterations):
        hook.calls = 0
        model(x).square().mean().backward()
        counts.append(hook.calls)
    return counts


def _bucket_count(case: Case, settings: StepSettings) -> int:
    """All-reduces per optimizer step of ``case`` once its buckets are settled: one round per
    backward, or one per optimizer step with ``no_sync()`` around the other micro-batches."""
    rounds = 1 if case.no_sync else settings.accumulation
    if case.wrapper is Wrapper.TORCH_DDP:
        return rounds * torch_bucket_counts(settings, case.bucket_cap_mb)[-1]
    if case.wrapper in (Wrapper.FSDP, Wrapper.LOCAL):
        return 0  # FSDP: all-gathers and reduce-scatters, no all-reduce
    if case.wrapper is Wrapper.NAIVE:
        return rounds * 2 * settings.layers  # one all-reduce per parameter
    return rounds * len(assign_buckets(trainable_parameters(mlp(settings)), case.bucket_cap_mb))


@dataclass(frozen=True)
class StepTimeRow:
    """A case's step time: the median over steps of the slowest rank, and every sample."""

    case: Case
    seconds: float
    """The median of ``samples``."""
    buckets: int
    samples: tuple[float, ...] = ()
    """Seconds per step, the slowest rank's, every timed step of every launch."""
    backward: tuple[float, ...] = ()
    """The same steps' seconds from backward() to averaged gradients (:attr:`Measure.BACKWARD`),
    the slowest rank's."""
    records: tuple[tuple[SyncRecord, ...], ...] = ()
    """NaiveDDP and labs' DDP: the same steps' :class:`SyncRecord`, every rank's (only the
    steps whose record is whole on every rank)."""

    def of(self, measure: Measure = Measure.STEP) -> tuple[float, ...]:
        """The samples of ``measure`` (the median alone if none were kept)."""
        kept = self.samples if measure is Measure.STEP else self.backward
        return kept or (self.seconds,)

    def median(self, measure: Measure = Measure.STEP) -> float:
        return statistics.median(self.of(measure))

    def quartiles(self, measure: Measure = Measure.STEP) -> tuple[float, float]:
        """The first and third quartiles of ``measure`` (the median twice if one sample)."""
        samples = self.of(measure)
        if len(samples) < 2:
            return samples[0], samples[0]
        first, _, third = statistics.quantiles(samples, n=4, method="inclusive")
        return first, third

    @property
    def low(self) -> float:
        return min(self.of())

    @property
    def high(self) -> float:
        return max(self.of())


def measure_step_times(world_size: int, settings: StepSettings, cases: Sequence[Case],
                       launches: int = 1, timeout: float = 300.0, link: Link | None = None
                       ) -> list[StepTimeRow]:
    """Launch :func:`step_times_worker` ``launches`` times (on ``link``, if given) and reduce
    it to one row per case: per step, the slowest rank's time (a step ends when the last rank
    ends it), then the median over every step of every launch."""
    _refuse_torch_on_link(cases, link)
    slowest: list[list[float]] = [[] for _ in cases]
    backward: list[list[float]] = [[] for _ in cases]
    records: list[list[tuple[SyncRecord, ...]]] = [[] for _ in cases]
    buckets = [0] * len(cases)
    for _ in range(launches):
        per_rank = launch(step_times_worker, world_size, args=(settings, list(cases)),
                          timeout=timeout, echo=False, link=link, device=_device(link))
        for i in range(len(cases)):
            slowest[i] += [max(r[i].seconds[k] for r in per_rank) for k in range(settings.steps)]
            backward[i] += [max(r[i].backward[k] for r in per_rank)
                            for k in range(settings.steps)]
            for k in range(settings.steps):
                step = tuple(r[i].records[k] for r in per_rank if r[i].records)
                if len(step) == world_size and None not in step:
                    records[i].append(step)  # type: ignore[arg-type]
            buckets[i] = per_rank[0][i].buckets
    return [StepTimeRow(case, statistics.median(s), b, tuple(s), tuple(w), tuple(r))
            for case, s, b, w, r in zip(cases, slowest, buckets, backward, records,
                                        strict=True)]


def _refuse_torch_on_link(cases: Sequence[Case], link: Link | None) -> None:
    if link is not None and any(c.wrapper is Wrapper.TORCH_DDP for c in cases):
        raise ValueError("torch's DDP all-reduces with gloo's own collective, which the "
                         "emulated link does not carry: time it without link=.")


def _device(link: Link | None) -> str:
    """On an emulated link the ranks compute on the CPU (see :mod:`labs.link`); without one,
    where the launcher's rule puts them."""
    return "cpu" if link is not None else "auto"


#: Chapter 5's four ways to synchronise gradients (FSDP is chapter 6's).
TIMED_WRAPPERS = (Wrapper.LOCAL, Wrapper.NAIVE, Wrapper.DDP, Wrapper.TORCH_DDP)


def default_cases(bucket_cap_mb: float) -> list[Case]:
    """Chapter 5's four implementations, the bucketed two at ``bucket_cap_mb``."""
    return [Case(i, bucket_cap_mb) for i in TIMED_WRAPPERS]


def bucket_sweep_cases(caps_mb: Sequence[float],
                       bucketed: Sequence[Wrapper] = (Wrapper.DDP, Wrapper.TORCH_DDP),
                       after_backward: bool = False) -> list[Case]:
    """The ``bucketed`` wrappers (labs' DDP and torch's) at every cap, plus NaiveDDP and the
    no-sync floor once. With ``after_backward``, labs' DDP also runs at every cap as the
    no-overlap control (``Case(Wrapper.DDP, cap, overlap=False)``), beside its overlapped run."""
    cases = [Case(Wrapper.LOCAL, DEFAULT_BUCKET_CAP_MB),
             Case(Wrapper.NAIVE, DEFAULT_BUCKET_CAP_MB)]
    for cap in caps_mb:
        cases += [Case(wrapper, cap) for wrapper in bucketed]
        if after_backward:
            cases.append(Case(Wrapper.DDP, cap, overlap=False))
    return cases


# --- the timeline of one backward pass --------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """Something that happened between two times (seconds since backward started)."""

    label: str
    start: float
    end: float


@dataclass(frozen=True)
class BackwardTimeline:
    """One rank's backward pass and its gradient synchronisation, measured."""

    wrapper: Wrapper
    backward_end: float
    grad_ready: dict[str, float]
    """Parameter name -> when its gradient was ready."""
    allreduces: tuple[Span, ...]
    """Each all-reduce (a bucket, or one parameter for NaiveDDP): from its launch (on an
    emulated link, from when the communication thread began sending it) to completion."""
    synchronised: float
    """When every gradient held its average (finish_gradient_synchronization returned)."""

    def in_flight(self, until: float = float("inf")) -> float:
        """Seconds of [0, ``until``] during which at least one all-reduce was in flight."""
        total, reach = 0.0, 0.0
        for span in sorted(self.allreduces, key=lambda s: s.start):
            start, end = max(span.start, reach), min(span.end, until)
            total += max(end - start, 0.0)
            reach = max(reach, span.end)
        return total

    @property
    def overlap_efficiency(self) -> float:
        """The share of the communication's time that ran while backward computed (0 when
        nothing was sent), as a profiler reports it. It is not the time saved: backward may
        itself run slower beside the communication (chapter 5 measures by how much)."""
        total = self.in_flight()
        return self.in_flight(self.backward_end) / total if total else 0.0


def timeline_worker(rank: int, world_size: int, settings: StepSettings,
                    wrapper: Wrapper) -> BackwardTimeline:
    """One measured step of NaiveDDP or DDP, after ``max(1, settings.warmup)`` untimed ones
    (the first step allocates the gradients). Both wrappers keep a
    :class:`labs.ddp.StepTimeline`; the times here count from the start of backward."""
    device = rank_device()
    model = wrap(wrapper, mlp(settings), settings.bucket_cap_mb)
    if not isinstance(model, (NaiveDDP, DDP)):
        raise ValueError(f"the timeline is NaiveDDP's or DDP's, not {wrapper.value}'s.")
    net = model.module
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(rank)).to(device)
    names = [n for n, _ in trainable_parameters(net)]
    ready: dict[str, float] = {}
    if isinstance(model, NaiveDDP):  # DDP records its own; NaiveDDP has no hooks
        index = {id(p): n for n, p in trainable_parameters(net)}
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(
                lambda q: ready.__setitem__(index[id(q)], time.perf_counter()))
    for _ in range(max(1, settings.warmup) + 1):
        model.zero_grad()
        model.timeline = t = StepTimeline()
        loss = model(x).square().mean()
        dist.barrier()
        ready.clear()
        start = time.perf_counter()
        loss.backward()
        synchronize(rank_device())
        backward_end = time.perf_counter()
        synchronise(model)
        synchronize(rank_device())
        synchronised = time.perf_counter()
    t = t.resolved()  # on a GPU: when the GPU got to each point
    if isinstance(model, DDP):
        ready = dict(t.grad_ready)
        labels = {i: f"bucket {i}" for i in t.launched}
    else:
        labels = {i: names[i] for i in t.launched}
    # a bucket on the link may wait behind earlier ones: its bar starts when it starts sending
    allreduces = [Span(labels[i], t.started.get(i, t.launched[i]), t.done[i])
                  for i in sorted(t.launched)]
    return BackwardTimeline(
        wrapper, backward_end - start,
        {n: v - start for n, v in ready.items()},
        tuple(Span(s.label, s.start - start, s.end - start) for s in allreduces),
        synchronised - start)


def measure_timelines(world_size: int, settings: StepSettings, timeout: float = 120.0,
                      link: Link | None = None) -> dict[Wrapper, list[BackwardTimeline]]:
    """The timeline of one step under NaiveDDP and under DDP, every rank's (on ``link``, if
    given)."""
    return {impl: list(launch(timeline_worker, world_size, args=(settings, impl),
                              timeout=timeout, echo=False, link=link, device=_device(link)))
            for impl in (Wrapper.NAIVE, Wrapper.DDP)}


# --- gradient accumulation ---------------------------------------------------------------------


@dataclass(frozen=True)
class AccumulationRow:
    """All-reduce calls per optimizer step with ``accumulation`` micro-batches."""

    wrapper: Wrapper
    no_sync: bool
    accumulation: int
    allreduces: float
    """All-reduce calls per optimizer step (rank 0)."""


@dataclass
class _HookCalls:
    calls: int = 0


# No annotations: torch checks the hook's annotations against dist.GradBucket, and this
# module's postponed (string) annotations would fail that check.
def _counting_hook(state, bucket):  # noqa: ANN001, ANN201
    """A torch DDP communication hook that counts its calls, then does what the default
    hook does: divide the bucket by N and all-reduce it asynchronously."""
    state.calls += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


def accumulation_worker(rank: int, world_size: int, settings: StepSettings,
                        cases: Sequence[tuple[Wrapper, bool]]) -> list[float]:
    """For each (wrapper, use ``no_sync()``): run ``settings.steps`` optimizer steps of
    ``settings.accumulation`` micro-batches each, after ``settings.warmup`` untimed ones,
    and count the all-reduces. Returns all-reduces per optimizer step, per case."""
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(rank)).to(rank_device())
    calls = [0]
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    counted = []
    for wrapper, use_no_sync in cases:
        model = wrap(wrapper, mlp(settings), settings.bucket_cap_mb)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        hook = None
        if wrapper is Wrapper.TORCH_DDP:  # its all-reduces are made in C++: count here
            hook = _HookCalls()
            model.register_comm_hook(hook, _counting_hook)
        dist.all_reduce = counting
        try:
            for step in range(settings.warmup + settings.steps):
                if step == settings.warmup:
                    calls[0] = 0
                    if hook:
                        hook.calls = 0
                optimizer.zero_grad()
                _accumulate(model, x, settings.accumulation, use_no_sync)
                optimizer.step()
        finally:
            dist.all_reduce = real
        counted.append((hook.calls if hook else calls[0]) / settings.steps)
    return counted


def measure_accumulation(world_size: int, settings: StepSettings,
                         wrappers: Sequence[Wrapper] = (Wrapper.DDP, Wrapper.TORCH_DDP),
                         timeout: float = 300.0) -> list[AccumulationRow]:
    """Per implementation, with and without ``no_sync()`` around all but the last
    micro-batch: all-reduce calls per optimizer step (one launch; the time it takes is
    measured on an emulated link with :func:`measure_step_times`)."""
    cases = [(wrapper, use_no_sync) for wrapper in wrappers for use_no_sync in (False, True)]
    counts = launch(accumulation_worker, world_size, args=(settings, cases), timeout=timeout,
                    echo=False)[0]
    return [AccumulationRow(wrapper, use_no_sync, settings.accumulation, count)
            for (wrapper, use_no_sync), count in zip(cases, counts, strict=True)]


# --- DistributedSampler -----------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerSettings:
    """A dataset of ``size`` samples (sample i is the number i) read by N ranks."""

    size: int = 10
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0
    epochs: int = 2
    set_epoch: bool = True
    per_rank_seed: bool = False
    """The mistake: each rank gives the sampler its own seed (so each shuffles differently)."""


@dataclass(frozen=True)
class SamplerView:
    """What one rank read: its indices in every epoch."""

    rank: int
    epochs: tuple[tuple[int, ...], ...]


def sampler_worker(rank: int, world_size: int, settings: SamplerSettings) -> SamplerView:
    """Each rank builds its own DistributedSampler, as a training script does."""
    from torch.utils.data import DistributedSampler

    dataset = list(range(settings.size))
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=dist.get_rank(), shuffle=settings.shuffle,
        seed=settings.seed + (rank if settings.per_rank_seed else 0),
        drop_last=settings.drop_last)
    epochs = []
    for epoch in range(settings.epochs):
        if settings.set_epoch:
            sampler.set_epoch(epoch)
        epochs.append(tuple(int(i) for i in sampler))
    return SamplerView(rank, tuple(epochs))


def sampler_views(world_size: int, settings: SamplerSettings) -> list[SamplerView]:
    return list(launch(sampler_worker, world_size, args=(settings,), echo=False))


@dataclass(frozen=True)
class Coverage:
    """How an epoch's samples were spread over the ranks."""

    read: int
    """Samples read, all ranks together."""
    distinct: int
    duplicated: tuple[int, ...]
    """Samples read more than once."""
    missing: tuple[int, ...]
    """Samples no rank read."""


def coverage(views: Sequence[SamplerView], size: int, epoch: int = 0) -> Coverage:
    counts = [0] * size
    for view in views:
        for i in view.epochs[epoch]:
            counts[i] += 1
    return Coverage(sum(counts), sum(c > 0 for c in counts),
                    tuple(i for i, c in enumerate(counts) if c > 1),
                    tuple(i for i, c in enumerate(counts) if c == 0))


def evaluation_worker(rank: int, world_size: int, size: int, drop_last: bool
                      ) -> tuple[int, int]:
    """Evaluate a 'model' that is right on the samples whose number is a multiple of 3,
    reading through a DistributedSampler (no shuffle); return (correct, seen) on this rank."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(list(range(size)), num_replicas=world_size,
                                 rank=dist.get_rank(), shuffle=False, drop_last=drop_last)
    seen = list(sampler)
    return sum(i % 3 == 0 for i in seen), len(seen)


# --- small helpers for the chapter ------------------------------------------------------------


@dataclass(frozen=True)
class BucketPlan:
    """How :func:`labs.ddp.assign_buckets` splits a model: names and bytes per bucket."""

    cap_mb: float
    buckets: tuple[tuple[tuple[str, ...], int], ...] = field(default=())


def bucket_plan(model: nn.Module, cap_mb: float) -> BucketPlan:
    buckets = assign_buckets(trainable_parameters(model), cap_mb)
    return BucketPlan(cap_mb, tuple(
        (tuple(n for n, _ in b), sum(p.numel() * p.element_size() for _, p in b))
        for b in buckets))
