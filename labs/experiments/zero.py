"""Chapter 6's measurements on real ranks: what each rank holds under DDP, ZeRO-1, ZeRO-2 and
FSDP (bytes of the tensors it holds, at every moment of a step), the bytes each rank sends,
and the memory arithmetic (bytes per parameter) they are compared with.

Every ``*_worker`` runs inside a rank; ranks import this module, so it imports no plotting.
The model is chapter 5's MLP (:class:`labs.models.StepSettings`), trained with Adam.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.collectives import Algorithm, Recorder, ring_all_reduce
from labs.ddp import DDP
from labs.fsdp import FSDP, Event, default_units
from labs.launcher import launch, rank_device
from labs.memory import MemorySnapshot, MemoryTimeline
from labs.models import StepSettings, mlp
from labs.wrappers import ZERO_STAGES, Wrapper, build
from labs.zero import ShardedOptimizer, ZeroStage, shard_numel

#: Chapter 6's experiment: an MLP of 8 x Linear(64, 64), 8 rows per rank, 2 Adam steps (the
#: last one measured). The notebook, its panel and ``python -m labs zero`` start from it.
LAB_SETTINGS = StepSettings(width=64, layers=8, batch=8, steps=2, warmup=0)


class Group(enum.Enum):
    """The groups a rank's bytes are counted in."""

    PARAMETERS = "parameters"
    """Parameter storage: full, a shard, or a shard plus what is gathered."""
    GRADIENTS = "gradients"
    """Full gradients and gradient shards, whichever exist at the moment."""
    OPTIMIZER = "optimizer state"
    """The optimizer's state (Adam: two moments and a step count per tensor), for the
    parameters this rank updates."""
    BUFFERS = "communication buffers"
    """DDP's gradient buckets; what FSDP's in-flight reduce-scatters receive into."""


@dataclass(frozen=True)
class MemoryReport:
    """One rank's snapshots of one training step (the last of ``settings.steps``)."""

    strategy: Wrapper
    world_size: int
    parameters: int
    """Trainable parameters of the model (P)."""
    snapshots: tuple[MemorySnapshot, ...]

    def bytes(self, snapshot: MemorySnapshot, groups: Sequence[Group] = (
            Group.PARAMETERS, Group.GRADIENTS, Group.OPTIMIZER)) -> int:
        by_group = snapshot.bytes_by_group()
        return sum(by_group.get(g.value, 0) for g in groups)

    @property
    def peak(self) -> MemorySnapshot:
        """The snapshot where parameters + gradients + optimizer state were largest."""
        return max(self.snapshots, key=self.bytes)

    @property
    def peak_bytes(self) -> int:
        return self.bytes(self.peak)

    @property
    def final(self) -> MemorySnapshot:
        return self.snapshots[-1]


#: Told an event and the name of the unit (FSDP) or parameter (ZeRO-2) it concerns.
Observer = Callable[[enum.Enum, str], None]


def _build(strategy: Wrapper, settings: StepSettings, lr: float = 1e-3,
           observer: Observer | None = None) -> tuple[nn.Module, object]:
    """(model, optimizer) for ``strategy``; ``observer`` is handed to FSDP or ZeRO-2, which
    tell it an event (:class:`~labs.fsdp.Event` or :class:`~labs.zero.GradientEvent`) and the
    unit's or parameter's name."""
    return build(strategy, mlp(settings), torch.optim.Adam, lr=lr,
                 bucket_cap_mb=settings.bucket_cap_mb, observer=observer)


def holdings(strategy: Wrapper, model: nn.Module, optimizer: object) -> dict[str, object]:
    """What a rank holds, by :class:`Group`, for :class:`~labs.memory.MemoryTimeline`.

    Parameters are registered detached (the same storage, without ``.grad``), so that the
    gradients can be counted in their own group."""
    if strategy is Wrapper.FSDP:
        assert isinstance(model, FSDP)
        params = [u.shard.detach() for u in model.units] + [u.full.detach() for u in model.units]
        params += [p.detach() for p in model.module.parameters()]  # frozen ones stay whole
        grads = [u.shard.grad for u in model.units] + [u.full.grad for u in model.units]
        in_flight = [u.reduce for u in model.units if u.reduce is not None]
        grads += [r.full_grad for r in in_flight]  # full gradients until their reduce lands
        buffers = [r.received for r in in_flight]
        state = optimizer
    elif strategy is Wrapper.DDP:
        assert isinstance(model, DDP)
        params = [p.detach() for p in model.module.parameters()]
        grads = [p.grad for p in model.module.parameters()]
        buffers = [b.buffer for b in model.buckets]
        state = optimizer
    else:
        assert isinstance(optimizer, ShardedOptimizer)
        params = [s.padded for s in optimizer.sharded]  # the parameters live in these
        grads = [s.param.grad for s in optimizer.sharded] + [s.shard.grad
                                                              for s in optimizer.sharded]
        state = optimizer.optimizer
        buffers = []  # ZeRO-1/2 reduce-scatter with the ring, one gradient at a time
    return {Group.PARAMETERS.value: params,
            Group.GRADIENTS.value: [g for g in grads if g is not None],
            Group.OPTIMIZER.value: state, Group.BUFFERS.value: buffers}


def memory_worker(rank: int, world_size: int, settings: StepSettings,
                  strategy: Wrapper) -> MemoryReport:
    """Train ``settings.steps`` Adam steps; snapshot the last one at every moment the
    strategy exposes: after forward, at each gather/free/reduce-scatter (FSDP) or each
    gradient's reduce-scatter (ZeRO-2), after backward, after the optimizer step."""
    timeline = MemoryTimeline(rank)
    recording = [False]
    box: list[object] = []

    def observe(event: enum.Enum, name: str) -> None:
        if recording[0]:
            label = f"{event.value} {name}"
            timeline.record(label, **holdings(strategy, *box))  # type: ignore[arg-type]

    model, optimizer = _build(strategy, settings, observer=observe)
    box += [model, optimizer]
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(rank)).to(rank_device())
    for step in range(settings.steps):
        recording[0] = step == settings.steps - 1
        optimizer.zero_grad()  # type: ignore[attr-defined]
        if recording[0]:
            timeline.record("start of step", **holdings(strategy, model, optimizer))
        loss = model(x).square().mean()
        if recording[0] and strategy is not Wrapper.FSDP:
            timeline.record("after forward", **holdings(strategy, model, optimizer))
        loss.backward()
        if isinstance(model, (DDP, FSDP)):
            model.finish_gradient_synchronization()
        if recording[0]:
            timeline.record("after backward", **holdings(strategy, model, optimizer))
        optimizer.step()  # type: ignore[attr-defined]
        if recording[0]:
            timeline.record("after optimizer step", **holdings(strategy, model, optimizer))
    return MemoryReport(strategy, world_size, settings.parameters, timeline.snapshots)


def measure_memory(world_sizes: Sequence[int], settings: StepSettings,
                   strategies: Sequence[Wrapper] = ZERO_STAGES, timeout: float = 300.0
                   ) -> dict[tuple[Wrapper, int], MemoryReport]:
    """Rank 0's report for every strategy and world size (one launch each)."""
    return {(s, n): launch(memory_worker, n, args=(settings, s), echo=False,
                           timeout=timeout)[0]
            for n in world_sizes for s in strategies}


# --- FSDP's peak, term by term ------------------------------------------------------------------


@dataclass(frozen=True)
class PeakTerm:
    """One kind of tensor FSDP holds at a moment of backward, and its bytes in all."""

    what: str
    group: Group
    nbytes: int


def fsdp_units(settings: StepSettings, world_size: int) -> list[tuple[str, int]]:
    """(name, padded numel) of every unit :class:`~labs.fsdp.FSDP` makes of the experiment's
    MLP, in forward order: one per Linear layer, ``N * ceil(numel / N)`` elements each."""
    model = mlp(settings)
    units = default_units(model)
    return [(name, world_size * shard_numel(sum(p.numel() for p in child.parameters()),
                                            world_size))
            for name, child in model.named_children() if any(child is u for u in units)]


def fsdp_reduce_scatter_terms(settings: StepSettings, world_size: int, unit: str
                              ) -> tuple[PeakTerm, ...]:
    """What rank 0 holds, by the schedule of :class:`~labs.fsdp.FSDP` (torch collectives,
    a step after the first, so prefetching), the moment ``unit``'s full gradient is complete
    and about to be reduce-scattered (``Event.REDUCE_SCATTER``), with Adam in fp32.

    With the units in backward order u_0, u_1, ... and ``unit`` = u_j, each of N·k_u
    elements: every unit's fp32 shard (4 k_u bytes), Adam's m and v of it (8 k_u) and its
    4-byte step count; u_j's full parameters (4 N k), and u_{j+1}'s, whose all-gather was
    prefetched when u_j's backward began; u_j's full gradient, and u_{j-1}'s, whose
    reduce-scatter is in flight until this one starts; the gradient shards of u_0 ..
    u_{j-2}, whose reduce-scatters have landed (4 k_u each). The receive buffer of the
    in-flight reduce-scatter (gloo: an all-to-all) is a communication buffer, not counted."""
    n = world_size
    order = list(reversed(fsdp_units(settings, n)))  # backward order
    names = [name for name, _ in order]
    if unit not in names:
        raise ValueError(f"no unit {unit!r}; the units are {', '.join(names)}")
    j = names.index(unit)
    full = dict(order)
    shard_bytes = sum(4 * padded // n for _, padded in order)
    terms = [
        PeakTerm(f"fp32 shards of all {len(order)} units", Group.PARAMETERS, shard_bytes),
        PeakTerm(f"full parameters of unit {unit}, computing its gradient", Group.PARAMETERS,
                 4 * full[unit]),
    ]
    if j + 1 < len(order):
        terms.append(PeakTerm(f"full parameters of unit {names[j + 1]}, prefetched",
                              Group.PARAMETERS, 4 * full[names[j + 1]]))
    terms.append(PeakTerm(f"full gradient of unit {unit}, about to be reduce-scattered",
                          Group.GRADIENTS, 4 * full[unit]))
    if j >= 1:
        terms.append(PeakTerm(f"full gradient of unit {names[j - 1]}, reduce-scatter in flight",
                              Group.GRADIENTS, 4 * full[names[j - 1]]))
    if j >= 2:
        landed = names[:j - 1]
        terms.append(PeakTerm(f"gradient shards of the {len(landed)} units reduce-scattered "
                              f"before ({', '.join(landed)})", Group.GRADIENTS,
                              sum(4 * full[u] // n for u in landed)))
    terms += [PeakTerm("Adam's m and v of the shards", Group.OPTIMIZER, 2 * shard_bytes),
              PeakTerm(f"Adam's step counts (one 4-byte tensor per shard, {len(order)})",
                       Group.OPTIMIZER, 4 * len(order))]
    return tuple(terms)


def reduce_scatter_unit(moment: str) -> str | None:
    """The unit a snapshot label names when it is taken at ``Event.REDUCE_SCATTER``."""
    prefix = f"{Event.REDUCE_SCATTER.value} "
    return moment.removeprefix(prefix) if moment.startswith(prefix) else None


def fsdp_term_mismatches(report: MemoryReport, settings: StepSettings) -> list[str]:
    """Every reduce-scatter moment of an FSDP report at which the bytes of a kind
    (parameters, gradients, optimizer state) differ from the sum of that kind's terms of
    :func:`fsdp_reduce_scatter_terms`, in words; [] when every one adds up exactly."""
    wrong = []
    for snap in report.snapshots:
        unit = reduce_scatter_unit(snap.moment)
        if unit is None:
            continue
        terms = fsdp_reduce_scatter_terms(settings, report.world_size, unit)
        measured = snap.bytes_by_group()
        for group in (Group.PARAMETERS, Group.GRADIENTS, Group.OPTIMIZER):
            want = sum(t.nbytes for t in terms if t.group is group)
            if measured.get(group.value, 0) != want:
                wrong.append(f"N = {report.world_size}, {snap.moment}: {group.value} "
                             f"{measured.get(group.value, 0)} bytes measured, {want} by the terms")
    return wrong


# --- traffic -----------------------------------------------------------------------------------


def traffic_worker(rank: int, world_size: int, settings: StepSettings,
                   strategy: Wrapper) -> tuple[int, int]:
    """One training step with chapter 3 and 4's ring collectives and a Recorder; returns
    (bytes this rank sent, S). S is the bytes of the fp32 parameters, zero-padded to N equal
    shards for the sharded strategies; DDP is its all-reduce of the gradients (the ring, on
    the same gradients, flattened), and its S is not padded."""
    recorder = Recorder()
    net = mlp(settings).to(rank_device())
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(rank)).to(rank_device())
    padded = sum(4 * world_size * shard_numel(p.numel(), world_size) for p in net.parameters())
    if strategy is Wrapper.DDP:
        net(x).square().mean().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        ring_all_reduce(flat, recorder=recorder)
        return recorder.stats.bytes_sent, 4 * flat.numel()
    if strategy is Wrapper.FSDP:
        model = FSDP(net, collectives=Algorithm.RING, recorder=recorder)
        padded = sum(4 * u.padded_numel for u in model.units)
        recorder.stats.bytes_sent = 0  # not the broadcast at construction
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        return recorder.stats.bytes_sent, padded
    stage = ZeroStage.OPTIMIZER if strategy is Wrapper.ZERO1 else ZeroStage.GRADIENTS
    optimizer = ShardedOptimizer(net.parameters(), torch.optim.SGD, stage=stage, lr=1e-3,
                                 recorder=recorder)
    net(x).square().mean().backward()
    optimizer.step()
    return recorder.stats.bytes_sent, padded


@dataclass(frozen=True)
class TrafficRow:
    strategy: Wrapper
    world_size: int
    sent: int
    """Bytes rank 0 sent in one step."""
    size: int
    """S: bytes of the (padded) fp32 parameters."""

    @property
    def measured(self) -> float:
        return self.sent / self.size

    @property
    def expected(self) -> float:
        """The closed form, in multiples of S: 3(N-1)/N for ZeRO-3, 2(N-1)/N otherwise."""
        n = self.world_size
        return (3 if self.strategy is Wrapper.FSDP else 2) * (n - 1) / n


def measure_traffic(world_sizes: Sequence[int], settings: StepSettings,
                    strategies: Sequence[Wrapper] = ZERO_STAGES) -> list[TrafficRow]:
    rows = []
    for n in world_sizes:
        for strategy in strategies:
            sent, size = launch(traffic_worker, n, args=(settings, strategy), echo=False)[0]
            rows.append(TrafficRow(strategy, n, sent, size))
    return rows


def lab_worker(rank: int, world_size: int, settings: StepSettings,
               strategies: Sequence[Wrapper]) -> tuple[dict[Wrapper, MemoryReport],
                                                        list[TrafficRow]]:
    """Chapter 6 in one launch (``python -m labs zero``, under torchrun too): for each
    strategy, this rank's memory report (:func:`memory_worker`) and one step's traffic
    (:func:`traffic_worker`), all on the same process group."""
    reports = {s: memory_worker(rank, world_size, settings, s) for s in strategies}
    traffic = [TrafficRow(s, world_size, *traffic_worker(rank, world_size, settings, s))
               for s in strategies]
    return reports, traffic


# --- the arithmetic: bytes per parameter ---------------------------------------------------------


class Recipe(enum.Enum):
    """Precision recipes for Adam and the bytes per parameter each keeps (see
    :func:`bytes_per_parameter`)."""

    FP32 = "fp32"
    """fp32 parameters (4), gradients (4), Adam's m and v (4 + 4): 16."""
    MIXED = "bf16 + fp32 master (ZeRO paper: fp16)"
    """bf16 or fp16 parameters (2) and gradients (2), fp32 master parameters (4), m and v (8):
    16. The ZeRO paper's count (arXiv 1910.02054, section 3.1: 2 + 2 + K with K = 12), made
    for fp16 with loss scaling; bf16 keeps fp32's exponent range, needs no loss scaling, and
    holds the same bytes."""
    MIXED_FP32_GRADS = "bf16 + fp32 master, fp32 gradients"
    """bf16 parameters (2), gradients accumulated in fp32 (4), master (4), m and v (8): 18."""
    MIXED_BOTH_GRADS = "bf16 + fp32 master, bf16 and fp32 gradients"
    """bf16 parameters (2) and gradients (2), an fp32 gradient accumulation buffer (4),
    master (4), m and v (8): 20."""


@dataclass(frozen=True)
class BytesPerParameter:
    """Bytes per parameter a rank holds, by kind, for a recipe, a ZeRO stage and N ranks."""

    parameters: float
    gradients: float
    optimizer: float
    """Optimizer state, fp32 master parameters included."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


_RECIPE_BYTES = {  # (parameters, gradients, master + optimizer state) per parameter, for Adam
    Recipe.FP32: (4, 4, 8),
    Recipe.MIXED: (2, 2, 4 + 8),
    Recipe.MIXED_FP32_GRADS: (2, 4, 4 + 8),
    Recipe.MIXED_BOTH_GRADS: (2, 2 + 4, 4 + 8),
}


def bytes_per_parameter(recipe: Recipe, stage: int, world_size: int) -> BytesPerParameter:
    """Stage 1 divides the optimizer state (master weights included) by N, stage 2 the
    gradients too, stage 3 the parameters too. Activations, buffers, communication buffers
    and the full parameters a stage-3 rank gathers for one unit at a time are not counted."""
    if stage not in range(4) or world_size < 1:
        raise ValueError(f"stage must be 0-3 and world_size >= 1, got {stage}, {world_size}.")
    params, grads, state = _RECIPE_BYTES[recipe]
    n = world_size
    return BytesPerParameter(params / n if stage >= 3 else params,
                             grads / n if stage >= 2 else grads,
                             state / n if stage >= 1 else state)


def max_parameters(memory_bytes: float, recipe: Recipe, stage: int, world_size: int) -> int:
    """The most parameters whose training state fits in ``memory_bytes`` per rank (model
    state only: activations need room too)."""
    return math.floor(memory_bytes / bytes_per_parameter(recipe, stage, world_size).total)
