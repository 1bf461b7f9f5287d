"""Chapter 7: FSDP's step on the emulated link, timed unit by unit, beside a model of it.

labs' FSDP with ``collectives=Algorithm.RING`` and ``prefetch=k`` runs every all-gather and
reduce-scatter on one communication stream (:class:`labs.ddp.CommStream`: one thread, jobs in
the order they were handed over) while the rank computes. :func:`measure` trains a stack of
equal blocks, one FSDP unit each, with every setting asked for, and keeps each timed step's
:class:`~labs.fsdp_timeline.FSDPTimeline` and rank 0's peak.

The model (:func:`simulate`) replays what the wrapper does, in its order, with the compute
measured and the communication priced:

* forward, unit by unit: wait for its all-gather (hand it to the stream now if nobody did),
  hand over the all-gathers of the next ``k`` units, compute, and free the gathered
  parameters when ``reshard_after_forward``;
* backward, in the reverse order: the same, except that a unit kept from forward needs no
  all-gather; after its backward, wait for the previous unit's reduce-scatter to land (one in
  flight, as the wrapper does), then hand this unit's to the stream;
* the step ends when the last reduce-scatter has landed.

The stream serves jobs in order, each for its port-model price on the link
(:func:`collective_seconds`: (N-1) steps of one chunk). Compute is what the same step measured:
each unit's forward and backward intervals, and the time between them that was neither
computing nor waiting for a collective (hooks, the loss, autograd's engine), all medians over
the timed steps of the slower rank. Nothing is fitted: the step's waits, hence the exposed
communication, are the model's to predict.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from labs.collectives import Algorithm
from labs.experiments.recipe import held_tensors
from labs.fsdp import FSDP
from labs.fsdp_timeline import Activity, FSDPTimeline
from labs.launcher import launch
from labs.link import Link
from labs.memory import AllocationTracker
from labs.ring_schedule import DEFAULT_SEGMENT_BYTES

#: (prefetch, reshard_after_forward) of one run.
Setting = tuple[int, bool]

#: The chapter's communication-bound link: an all-gather of one block (4 MiB, half of it
#: sent at N = 2) costs 18.8 ms, a little more than the block's forward at 768 tokens on one
#: core.
SLOW_LINK = Link(alpha=2e-3, bandwidth=125e6)


class Block(nn.Module):
    """One unit: a ``width x width`` linear layer and a tanh."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


@dataclass(frozen=True)
class OverlapSettings:
    """What :func:`measure` runs: ``units`` blocks of ``width``, ``tokens`` rows per rank."""

    world_size: int = 2
    units: int = 4
    width: int = 1024
    tokens: int = 768
    link: Link = SLOW_LINK
    steps: int = 5
    """Timed steps per setting (after one untimed step that records the order)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "units", "width", "tokens", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OverlapSettings.{name} must be an int >= 1, got {value!r}.")
        if self.world_size < 2:
            raise ValueError(f"OverlapSettings.world_size must be >= 2 (FSDP shards over "
                             f"ranks), got {self.world_size}.")
        if not isinstance(self.link, Link):
            raise ValueError(f"OverlapSettings.link must be a labs.Link, got {self.link!r}; "
                             f"e.g. Link(alpha=2e-3, bandwidth=25e6).")

    @property
    def unit_bytes(self) -> int:
        """One block's parameters, fp32, padded to a multiple of N (what a gather moves)."""
        numel = self.width * self.width + self.width
        return -(-numel // self.world_size) * self.world_size * 4


def check_settings(settings: Sequence[Setting]) -> list[Setting]:
    """``settings`` as a list, or a ValueError saying what one should look like."""
    out = list(settings)
    for s in out:
        if (not isinstance(s, tuple) or len(s) != 2 or isinstance(s[0], bool)
                or not isinstance(s[0], int) or s[0] < 0 or not isinstance(s[1], bool)):
            raise ValueError(f"each setting is (prefetch, reshard_after_forward), an int >= 0 "
                             f"and a bool, e.g. (1, True); got {s!r}.")
    if not out:
        raise ValueError("measure needs at least one (prefetch, reshard_after_forward).")
    return out


# --- the run ------------------------------------------------------------------------------------

#: One interval, plain: (unit, activity value, start, end), seconds from the step's start.
Span = tuple[str, str, float, float]


@dataclass(frozen=True)
class RankSteps:
    """One rank's timed steps of one setting."""

    seconds: tuple[float, ...]
    spans: tuple[tuple[Span, ...], ...]
    peak_bytes: int | None
    """Rank 0's peak over one more step (tensor storages, :mod:`labs.memory`); None elsewhere."""


def overlap_worker(rank: int, world_size: int, config: OverlapSettings,
                   settings: list[Setting]) -> list[RankSteps]:
    """Every setting in turn: one untimed step, ``config.steps`` timed ones (a barrier before
    each), then one step under an :class:`AllocationTracker` on rank 0."""
    torch.manual_seed(rank)
    x = torch.randn(config.tokens, config.width)
    out = []
    for prefetch, reshard in settings:
        torch.manual_seed(0)
        net = nn.Sequential(*(Block(config.width) for _ in range(config.units)))
        model = FSDP(net, collectives=Algorithm.RING, prefetch=prefetch,
                     reshard_after_forward=reshard)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        train_step(model, optimizer, x)  # records the order that prefetching follows
        seconds, spans = [], []
        for _ in range(config.steps):
            dist.barrier()
            start = time.perf_counter()
            train_step(model, optimizer, x)
            seconds.append(time.perf_counter() - start)
            spans.append(rebase(model.timeline, start))
        peak = None
        dist.barrier()
        if rank == 0:
            with AllocationTracker() as tracker:
                tracker.track(held_tensors(model, optimizer))
                train_step(model, optimizer, x)
            peak = tracker.peak_bytes
        else:
            train_step(model, optimizer, x)
        out.append(RankSteps(tuple(seconds), tuple(spans), peak))
    return out


def train_step(model: FSDP, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One SGD step on the mean square of the output, gradients synchronized."""
    model(x).square().mean().backward()
    model.finish_gradient_synchronization()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def rebase(timeline: FSDPTimeline, origin: float) -> tuple[Span, ...]:
    """The timeline's intervals as plain tuples, seconds from ``origin``, in order of start."""
    return tuple((i.unit, i.activity.value, i.start - origin, i.end - origin)
                 for i in timeline.resolved())


# --- the model ----------------------------------------------------------------------------------


def collective_seconds(nbytes: int, world_size: int, link: Link) -> float:
    """The link's price of labs' ring all-gather (or reduce-scatter) of a unit of ``nbytes``:
    N-1 steps, each one chunk of S/N through every port. A step's chunk is cut into segments
    of at most :data:`DEFAULT_SEGMENT_BYTES` and pipelined: the first step costs
    ``alpha + c/bw``, each later one ``max(c/bw, alpha + s/bw)``."""
    chunk = nbytes / world_size
    segment = min(chunk, DEFAULT_SEGMENT_BYTES)
    later = max(chunk / link.bandwidth, link.seconds(segment))
    return link.seconds(chunk) + (world_size - 2) * later


@dataclass(frozen=True)
class Profile:
    """What the model takes from a measured run: seconds, medians over the timed steps of the
    slower rank, units in forward order."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    """Each unit's backward, in forward order (unit 0's is the last to run)."""
    before_forward: tuple[float, ...]
    """Before each unit's forward, neither computing nor waiting for its gather (the model
    puts it after the wait: a gather nobody prefetched is handed over as the unit is
    reached)."""
    before_backward: tuple[float, ...]
    """Before each unit's backward (forward order), likewise: the loss and autograd's start
    for the last unit, hooks and waking for the others."""
    tail: float
    """After the last reduce-scatter landed, or the last backward, to the step's end
    (the shards' gradients, the optimizer)."""


@dataclass(frozen=True)
class Prediction:
    """The model's account of one step: when everything starts and ends, from the start."""

    step: float
    compute: tuple[tuple[str, str, float, float], ...]
    """(unit, "forward" / "backward", start, end)."""
    stream: tuple[tuple[str, str, float, float], ...]
    """(unit, "all-gather" / "reduce-scatter", start, end), in the stream's order."""

    @property
    def busy(self) -> float:
        """Seconds of compute and measured overheads: what a free link would leave."""
        return sum(e - s for _, _, s, e in self.compute)


def simulate(profile: Profile, prefetch: int, reshard: bool, gather: float, reduce: float
             ) -> Prediction:
    """One step of FSDP as the wrapper runs it (module docstring), with ``gather`` and
    ``reduce`` seconds per collective on the one stream."""
    units = len(profile.forward)
    stream_free = 0.0
    stream: list[tuple[str, str, float, float]] = []
    compute: list[tuple[str, str, float, float]] = []

    def submit(now: float, unit: int, what: str, seconds: float) -> float:
        nonlocal stream_free
        start = max(now, stream_free)
        stream_free = start + seconds
        stream.append((str(unit), what, start, stream_free))
        return stream_free

    gathered: dict[int, float] = {}  # unit -> when its parameters are there
    t = 0.0
    for i in range(units):
        if i not in gathered:
            gathered[i] = submit(t, i, Activity.ALL_GATHER.value, gather)
        t = max(t, gathered[i]) + profile.before_forward[i]
        for j in range(i + 1, min(i + 1 + prefetch, units)):
            if j not in gathered:
                gathered[j] = submit(t, j, Activity.ALL_GATHER.value, gather)
        compute.append((str(i), Activity.FORWARD.value, t, t + profile.forward[i]))
        t += profile.forward[i]
        if reshard:
            del gathered[i]
    landed = 0.0  # when the reduce-scatter in flight lands
    for i in reversed(range(units)):
        if i not in gathered:
            gathered[i] = submit(t, i, Activity.ALL_GATHER.value, gather)
        t = max(t, gathered[i]) + profile.before_backward[i]
        for j in range(i - 1, max(i - 1 - prefetch, -1), -1):
            if j not in gathered:
                gathered[j] = submit(t, j, Activity.ALL_GATHER.value, gather)
        compute.append((str(i), Activity.BACKWARD.value, t, t + profile.backward[i]))
        t = max(t + profile.backward[i], landed)  # one reduce-scatter in flight
        landed = submit(t, i, Activity.REDUCE_SCATTER.value, reduce)
        del gathered[i]
    t = max(t, landed) + profile.tail
    return Prediction(t, tuple(compute), tuple(stream))


def profile_of(spans: Sequence[Span], step_seconds: float, units: int) -> Profile:
    """One rank's step read into a :class:`Profile`: each gap between two compute intervals
    less the wait for what the second needed (its all-gather; before a backward, also the
    previous unit's reduce-scatter landing)."""
    def of(unit: int, activity: Activity) -> list[Span]:
        return [s for s in spans if s[0] == str(unit) and s[1] == activity.value]

    forward = [of(i, Activity.FORWARD)[0] for i in range(units)]
    backward = [of(i, Activity.BACKWARD)[0] for i in range(units)]
    reduces = [of(i, Activity.REDUCE_SCATTER)[0] for i in range(units)]

    def gather_end(unit: int, before: float, after: float) -> float:
        ends = [s[3] for s in of(unit, Activity.ALL_GATHER) if after <= s[2] and s[3] <= before]
        return max(ends, default=-float("inf"))

    before_forward, previous = [], 0.0
    for i in range(units):
        ready = gather_end(i, forward[i][2] + 1e-9, -float("inf"))
        before_forward.append(max(0.0, forward[i][2] - max(previous, ready)))
        previous = forward[i][3]
    before_backward = [0.0] * units
    for i in reversed(range(units)):
        ready = gather_end(i, backward[i][2] + 1e-9, forward[i][3])
        landed = reduces[i + 2][3] if i + 2 < units else -float("inf")
        before_backward[i] = max(0.0, backward[i][2] - max(previous, ready, landed))
        previous = backward[i][3]
    tail = max(0.0, step_seconds - max(previous, reduces[0][3]))
    return Profile(tuple(s[3] - s[2] for s in forward), tuple(s[3] - s[2] for s in backward),
                   tuple(before_forward), tuple(before_backward), tail)


def median_profile(profiles: Sequence[Profile]) -> Profile:
    """Each field's median over ``profiles``."""
    def med(values: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
        return tuple(statistics.median(v) for v in zip(*values, strict=True))
    return Profile(med([p.forward for p in profiles]), med([p.backward for p in profiles]),
                   med([p.before_forward for p in profiles]),
                   med([p.before_backward for p in profiles]),
                   statistics.median(p.tail for p in profiles))


# --- the rows -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverlapRow:
    """One setting: measured beside the model."""

    prefetch: int
    reshard: bool
    seconds: tuple[float, ...]
    """Each timed step, the slower rank's."""
    busy: float
    """Median over steps of the slower rank's compute and overheads (no waiting): measured."""
    prediction: Prediction
    peak_bytes: int
    spans: tuple[Span, ...] = field(repr=False)
    """Rank 0's median step, for the timeline figure."""

    @property
    def measured(self) -> float:
        return statistics.median(self.seconds)

    @property
    def exposed(self) -> float:
        """Measured step minus measured busy time: the seconds spent waiting for the wire."""
        return self.measured - self.busy

    @property
    def ratio(self) -> float:
        """Model over measured."""
        return self.prediction.step / self.measured

    @property
    def label(self) -> str:
        return f"prefetch {self.prefetch}, reshard {'on' if self.reshard else 'off'}"


def busy_seconds(profile: Profile) -> float:
    """Compute and overheads of one step: the sum of every field of ``profile``."""
    return (sum(profile.forward) + sum(profile.backward) + sum(profile.before_forward)
            + sum(profile.before_backward) + profile.tail)


def measure(config: OverlapSettings, settings: Sequence[Setting] = ((0, True), (1, True)),
            timeout: float = 300.0) -> list[OverlapRow]:
    """Run every setting on ``config.world_size`` ranks over ``config.link`` (one launch) and
    set each beside the model."""
    settings = check_settings(settings)
    per_rank = launch(overlap_worker, config.world_size, args=(config, settings),
                      link=config.link, device="cpu", timeout=timeout, echo=False)
    gather = collective_seconds(config.unit_bytes, config.world_size, config.link)
    rows = []
    for k, (prefetch, reshard) in enumerate(settings):
        ranks = [r[k] for r in per_rank]
        steps = len(ranks[0].seconds)
        slower = [max(range(len(ranks)), key=lambda r, s=s: ranks[r].seconds[s])
                  for s in range(steps)]
        profiles = [profile_of(ranks[r].spans[s], ranks[r].seconds[s], config.units)
                    for s, r in enumerate(slower)]
        seconds = tuple(ranks[r].seconds[s] for s, r in enumerate(slower))
        median_step = sorted(range(steps), key=lambda s: seconds[s])[steps // 2]
        profile = median_profile(profiles)
        rows.append(OverlapRow(
            prefetch, reshard, seconds, statistics.median(busy_seconds(p) for p in profiles),
            simulate(profile, prefetch, reshard, gather, gather),
            ranks[0].peak_bytes or 0, ranks[0].spans[median_step]))
    return rows
