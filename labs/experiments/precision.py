"""Chapter 7, part 2, on real ranks: what bf16 saves under FSDP and what it costs in accuracy,
why fp16 needs loss scaling (a gradient that underflows), what a sharded grad scaler must
agree on (one rank overflows), and torch's ``fully_shard`` with a ``MixedPrecisionPolicy``
beside :class:`labs.fsdp.FSDP`.

Every ``*_worker`` runs inside a rank (run it with :func:`labs.launch`); ranks import this
module, so it imports no plotting. Each experiment has one frozen settings dataclass, checked
before any process starts, and a table formatter (:func:`labs.tables.format_table`).
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labs.collectives import Algorithm, Recorder
from labs.ddp import broadcast_state
from labs.experiments.ddp import StepSettings, mlp
from labs.experiments.zero import LAB_SETTINGS, Group, holdings
from labs.fsdp import FSDP, Event
from labs.fsdp_torch import full_value, fully_shard_available, fully_shard_units, load_fully_shard
from labs.launcher import launch, rank_device
from labs.memory import AllocationTracker, MemoryTimeline
from labs.models import TiedNet
from labs.precision import LocalGradScaler, ShardedGradScaler, Underflow, gradient_underflow
from labs.tables import format_table
from labs.wrappers import Wrapper

# --- 1. a gradient that underflows in fp16 ------------------------------------------------------


@dataclass(frozen=True)
class UnderflowSettings:
    """The gradient of chapter 6's MLP (``layers`` x Linear(width, width) + ReLU, the mean
    of the squared output over a random batch), computed in fp32, fp16, fp16 with the loss
    scaled by ``scale``, and bf16. Runs in the calling process (no ranks)."""

    width: int = LAB_SETTINGS.width
    layers: int = LAB_SETTINGS.layers
    batch: int = LAB_SETTINGS.batch
    scale: float = 2.0**16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("width", "layers", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if not (isinstance(self.scale, (int, float)) and self.scale > 0
                and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a positive finite number (e.g. 2.**16), "
                             f"got {self.scale!r}.")

    def cases(self) -> list[tuple[torch.dtype, float]]:
        """fp16 unscaled, fp16 scaled, bf16 unscaled."""
        return [(torch.float16, 1.0), (torch.float16, float(self.scale)),
                (torch.bfloat16, 1.0)]


def underflow_rows(settings: UnderflowSettings = UnderflowSettings()) -> list[Underflow]:
    """:func:`labs.precision.gradient_underflow` of the MLP, for :meth:`UnderflowSettings.cases`."""
    steps = StepSettings(width=settings.width, layers=settings.layers, batch=settings.batch)
    model = mlp(steps, seed=settings.seed)
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(settings.seed + 1))

    def loss_fn(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        return module(x.to(dtype)).float().square().mean()

    return gradient_underflow(model, loss_fn, settings.cases())


def underflow_table(rows: Sequence[Underflow]) -> str:
    """One row per (dtype, scale): how many of the non-zero fp32 gradient elements are lost
    (0), subnormal (fewer bits) or overflowed, and the median relative error of the rest."""
    header = ["dtype", "loss scale", "elements", "flushed to 0", "fraction", "subnormal",
              "fraction", "inf/NaN", "median rel. error"]
    body = [[_dtype_name(r.dtype), f"{r.scale:g}", r.elements, r.flushed,
             f"{r.flushed_fraction:.2%}", r.subnormal, f"{r.subnormal_fraction:.2%}",
             r.overflowed, f"{r.median_relative_error:.2e}"] for r in rows]
    return format_table(header, body)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else {torch.float32: "fp32", torch.bfloat16: "bf16",
                                         torch.float16: "fp16"}.get(dtype, str(dtype))


# --- 2. bf16 against fp32 under FSDP -------------------------------------------------------------


class Precision(enum.Enum):
    """The precisions FSDP runs in; the shards, their gradients and the optimizer are fp32
    in every one."""

    FP32 = "fp32"
    """Everything in fp32: the baseline."""
    BF16_REDUCE_FP32 = "bf16 compute, fp32 reduce"
    """bf16 all-gather, forward and backward; the bf16 gradients cast to fp32 and
    reduce-scattered in fp32 (torch's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)``)."""
    BF16 = "bf16 compute and reduce"
    """bf16 all-gather, forward, backward and reduce-scatter: the fewest bytes, and each
    partial sum of the gradient rounded to bf16."""

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None if self is Precision.FP32 else torch.bfloat16

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return torch.float32 if self is Precision.BF16_REDUCE_FP32 else None


@dataclass(frozen=True)
class MixedSettings:
    """One comparison: :class:`labs.models.TiedNet` (an embedding tied to the output layer, a
    frozen layer, a buffer) on a fixed batch of token ids split into equal shares, ``steps``
    SGD steps in each of ``precisions``, with chapter 3's ring collectives so that every
    byte is counted. The defaults give units of 1530 and 930 elements, which 4 does not
    divide."""

    vocab: int = 51
    dim: int = 30
    batch: int = 8  #: sequences in the whole batch; must divide by the world size
    seq_len: int = 16
    steps: int = 3
    lr: float = 0.1  #: plain SGD: a parameter's error is lr x its gradient's error
    seed: int = 0  #: rank r builds its model from seed + r; rank 0's values are broadcast
    data_seed: int = 123
    precisions: tuple[Precision, ...] = tuple(Precision)

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "batch", "seq_len", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        if not self.precisions or any(not isinstance(p, Precision) for p in self.precisions):
            raise ValueError(f"precisions must be a non-empty tuple of Precision members "
                             f"(e.g. tuple(Precision)), got {self.precisions!r}.")

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size the batch does not split into equal shares."""
        _check_world_size(world_size)
        if self.batch % world_size:
            raise ValueError(f"the batch of {self.batch} sequences cannot be split into "
                             f"{world_size} equal shares: pick a batch that divides by it "
                             f"(MixedSettings(batch=...)).")

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch: inputs and next-token targets, each (batch, seq_len) int64."""
        generator = torch.Generator().manual_seed(self.data_seed)
        ids = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class MixedRun:
    """One rank's run of one precision: per step, what it sent, held and computed."""

    precision: Precision
    rank: int
    world_size: int
    padded_numel: int
    """Elements of all units' flat vectors, padded to N equal shards."""
    all_gather_bytes: tuple[int, ...]
    """Per step, bytes this rank sent in all-gathers (two per unit: forward, backward)."""
    reduce_scatter_bytes: tuple[int, ...]
    """Per step, bytes this rank sent in reduce-scatters (one per unit)."""
    peak_bytes: tuple[int, ...]
    """Per step, the most tensor-storage bytes alive at once (labs.memory's
    AllocationTracker): shards, gathered parameters, activations, gradients, optimizer state,
    the ring's buffers; not the batch."""
    model_state_peak: tuple[int, ...]
    """Per step, the largest parameters + gradients + optimizer state at any gather, free or
    reduce-scatter of the step (chapter 6's MemoryTimeline, by group)."""
    losses: tuple[float, ...]
    """Per step, this rank's loss on its share (in fp32, from the logits of its dtype)."""
    states: tuple[dict[str, torch.Tensor], ...]
    """Per step, after the optimizer step, every full parameter (fp32) and buffer."""
    shard_dtypes: tuple[torch.dtype, ...]
    """The dtypes of the shards, of their gradients and of the optimizer's state tensors
    (plain SGD keeps none): fp32 in every precision."""
    compute_dtypes: tuple[torch.dtype, ...]
    """The dtypes of the gathered full vectors and of the logits."""


@dataclass(frozen=True)
class MixedReport:
    """What :func:`mixed_worker` returns from one rank."""

    rank: int
    world_size: int
    runs: dict[Precision, MixedRun]


def cast_frozen_and_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the frozen floating-point parameters and the floating-point buffers of
    ``module`` to ``dtype``, in place, before wrapping. Both :class:`labs.fsdp.FSDP` and
    torch's ``fully_shard`` hold frozen parameters in the compute dtype and cast each unit's
    inputs to it, but leave buffers alone: TiedNet's ``embed(ids) * scale`` would then be
    computed in fp32 and rounded at the next unit. Casting the buffer once makes every
    operation of the forward a bf16 one, the same in both wrappers."""
    with torch.no_grad():
        for param in module.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(dtype)
        for buffer in module.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(dtype)


def _loss(logits: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """Cross-entropy in fp32, whatever dtype the logits are in."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))


def _share(settings: MixedSettings, rank: int, world_size: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = settings.tokens()
    per = settings.batch // world_size
    return (x[rank * per:(rank + 1) * per].to(rank_device()),
            y[rank * per:(rank + 1) * per].to(rank_device()))


def _fsdp_tiednet(settings: MixedSettings, rank: int, precision: Precision,
                  **kwargs: Any) -> FSDP:
    """TiedNet from ``seed + rank`` (FSDP broadcasts rank 0's), wrapped in ``precision``."""
    net = TiedNet(settings.vocab, settings.dim, settings.seed + rank).to(rank_device())
    if precision.compute_dtype is not None:
        cast_frozen_and_buffers(net, precision.compute_dtype)
    return FSDP(net, precision.compute_dtype, reduce_dtype=precision.reduce_dtype, **kwargs)


def _mixed_run(settings: MixedSettings, precision: Precision, rank: int,
               world_size: int) -> MixedRun:
    x, y = _share(settings, rank, world_size)
    recorder = Recorder()
    timeline = MemoryTimeline(rank)
    reduce_started: list[int] = []
    reduce_bytes = [0]
    box: list[Any] = []

    def observe(event: Event, name: str) -> None:
        del name
        if event is Event.REDUCE_SCATTER:  # the ring reduce-scatter runs between these two
            reduce_started.append(recorder.stats.bytes_sent)
        elif event is Event.RESHARD_BACKWARD:
            reduce_bytes[0] += recorder.stats.bytes_sent - reduce_started.pop()
        if box:
            timeline.record(event.value, **holdings(Wrapper.FSDP, *box))

    model = _fsdp_tiednet(settings, rank, precision, collectives=Algorithm.RING,
                          recorder=recorder, observer=observe)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    box += [model, optimizer]
    tracker = AllocationTracker()
    tracker.track([*model.parameters(), *model.module.buffers()])
    tracker.track(unit.full for unit in model.units)  # empty now, regrown by every unshard
    gathers, reduces, peaks, state_peaks, losses, states = [], [], [], [], [], []
    logits_dtype = torch.float32
    for _ in range(settings.steps):
        recorder.stats.bytes_sent = reduce_bytes[0] = 0  # this step's bytes only
        first = len(timeline.snapshots)
        with tracker:
            tracker.reset_peak()
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            logits_dtype = logits.dtype
            loss = _loss(logits, y, settings.vocab)
            loss.backward()
            model.finish_gradient_synchronization()
            optimizer.step()
            del logits
        gathers.append(recorder.stats.bytes_sent - reduce_bytes[0])
        reduces.append(reduce_bytes[0])
        peaks.append(tracker.peak_bytes)
        state_groups = (Group.PARAMETERS, Group.GRADIENTS, Group.OPTIMIZER)
        state_peaks.append(max(sum(s.bytes_by_group().get(g.value, 0) for g in state_groups)
                               for s in timeline.snapshots[first:]))
        losses.append(loss.item())
        states.append(model.gather_full_params())
    optimizer_state = [t for s in optimizer.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor)]
    shard_dtypes = {u.shard.dtype for u in model.units}
    shard_dtypes |= {u.shard.grad.dtype for u in model.units if u.shard.grad is not None}
    shard_dtypes |= {t.dtype for t in optimizer_state}
    return MixedRun(precision, rank, world_size, sum(u.padded_numel for u in model.units),
                    tuple(gathers), tuple(reduces), tuple(peaks), tuple(state_peaks),
                    tuple(losses), tuple(states), tuple(sorted(shard_dtypes, key=str)),
                    tuple(sorted({u.full.dtype for u in model.units} | {logits_dtype},
                                 key=str)))


def mixed_worker(rank: int, world_size: int,
                 settings: MixedSettings = MixedSettings()) -> MixedReport:
    """Worker: train TiedNet under :class:`labs.fsdp.FSDP` with the ring collectives in each
    of ``settings.precisions``, from the same start, on this rank's share of the batch;
    count the bytes all-gathered and reduce-scattered and measure each step's memory."""
    settings.check_world_size(world_size)  # under torchrun nothing checked it before
    return MixedReport(rank, world_size, {p: _mixed_run(settings, p, rank, world_size)
                                          for p in settings.precisions})


def mixed_on_ranks(world_size: int, settings: MixedSettings = MixedSettings(),
                   timeout: float = 120.0) -> list[MixedReport]:
    """:func:`mixed_worker` on ``world_size`` real ranks, one report per rank; a batch that
    does not split is refused before any process starts."""
    settings.check_world_size(world_size)
    return list(launch(mixed_worker, world_size, args=(settings,), echo=False,
                       timeout=timeout))


@dataclass(frozen=True)
class ReferenceRun:
    """One process, fp32, the whole batch: the oracle."""

    losses: tuple[float, ...]
    states: tuple[dict[str, torch.Tensor], ...]


def reference_run(settings: MixedSettings = MixedSettings()) -> ReferenceRun:
    """TiedNet (rank 0's seed) trained in fp32 on the whole batch, in the calling process."""
    net = TiedNet(settings.vocab, settings.dim, settings.seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=settings.lr)
    x, y = settings.tokens()
    losses, states = [], []
    for _ in range(settings.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(net(x), y, settings.vocab)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        states.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    return ReferenceRun(tuple(losses), tuple(states))


def trainable_names(settings: MixedSettings = MixedSettings()) -> tuple[str, ...]:
    """TiedNet's trainable parameters by their state_dict names (the tied weight under both
    of its names): what the optimizer updates, and what the comparisons compare. The frozen
    layer is left out: :func:`cast_frozen_and_buffers` rounds it to bf16 once, for good."""
    net = TiedNet(settings.vocab, settings.dim, settings.seed)
    return tuple(n for n, p in net.named_parameters(remove_duplicate=False) if p.requires_grad)


def max_parameter_difference(states: Sequence[Mapping[str, torch.Tensor]],
                             reference: Sequence[Mapping[str, torch.Tensor]],
                             names: Sequence[str]) -> tuple[float, ...]:
    """Per step, the largest |difference| over the parameters ``names``, in fp32."""
    return tuple(max((got[name].float() - want[name].float()).abs().max().item()
                     for name in names)
                 for got, want in zip(states, reference, strict=True))


def mean_loss(runs: Sequence[Any]) -> tuple[float, ...]:
    """Per step, the mean over ranks of their losses: equal shares of a mean loss, so the
    loss of the whole batch."""
    return tuple(sum(values) / len(values) for values in zip(*(r.losses for r in runs),
                                                             strict=True))


def mixed_table(reference: ReferenceRun, reports: Sequence[MixedReport],
                settings: MixedSettings = MixedSettings(), rank: int = 0) -> str:
    """Per precision, for ``rank`` (the bytes) and over all ranks (the loss), after the last
    step: bytes sent per step, memory, and the distance to one fp32 process (the trainable
    parameters)."""
    header = ["precision", "all-gather B/step", "vs fp32", "reduce-scatter B/step",
              "step peak B", "model state peak B", "|loss - fp32|", "max |param - fp32|"]
    runs = reports[rank].runs
    base = runs.get(Precision.FP32)
    names = trainable_names(settings)
    rows = []
    for precision, run in runs.items():
        per_rank = [r.runs[precision] for r in reports]
        ratio = (f"{run.all_gather_bytes[-1] / base.all_gather_bytes[-1]:.3g}"
                 if base is not None and base.all_gather_bytes[-1] else "-")
        rows.append([precision.value, run.all_gather_bytes[-1], ratio,
                     run.reduce_scatter_bytes[-1], run.peak_bytes[-1],
                     run.model_state_peak[-1],
                     f"{abs(mean_loss(per_rank)[-1] - reference.losses[-1]):.2e}",
                     f"{max_parameter_difference(run.states, reference.states, names)[-1]:.2e}"])
    return format_table(header, rows)


# --- 3. fp16 with a loss scale: one rank overflows ----------------------------------------------


class Agreement(enum.Enum):
    """How the ranks decide to skip a step (the value is the label in tables)."""

    ALL_RANKS = "all ranks (ShardedGradScaler)"
    """One all-reduce (MAX) of the found-inf flag: every rank skips if any found one."""
    EACH_RANK = "each rank alone (LocalGradScaler)"
    """Each rank from its own shard: wrong under sharding, shown to see why."""


class FeatureClassifier(nn.Module):
    """Softmax regression, ``logits = x @ weight + bias``, with ``weight`` stored as
    (features, classes): feature j's gradient, ``x[:, j]^T @ dlogits``, is row j, contiguous
    in the flat vector, so one bad feature overflows a short run of elements that one rank's
    shard holds. (``nn.Linear`` stores (classes, features); the same feature would be a
    column, spread over every rank's shard.) The gradient of the logits of a cross-entropy is
    (softmax - one-hot) / rows, at most 1 / rows in size however large the logits are, so a
    feature scaled up makes its own row's gradient large and nothing else."""

    def __init__(self, features: int, classes: int, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
            torch.manual_seed(seed)
            bound = features ** -0.5
            self.weight = nn.Parameter(torch.empty(features, classes).uniform_(-bound, bound))
            self.bias = nn.Parameter(torch.zeros(classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


@dataclass(frozen=True)
class ScalerSettings:
    """fp16 FSDP (compute in fp16, gradients reduce-scattered in fp32, fp32 shards and SGD)
    of a :class:`FeatureClassifier` with a loss scale. At step ``overflow_step``, rank
    ``overflow_rank``'s batch has feature ``overflow_feature`` multiplied by
    ``overflow_factor`` (a column of its data in other units): its fp16 gradient of that
    feature's row overflows; after the reduce-scatter the inf sits in the shard of the rank
    that owns the row. Each of ``agreements`` is run from the same start.

    The scale starts at 2^12 (``torch.amp.GradScaler``'s default is 2^16): this model's
    largest gradients are near 1 (a real model's are far smaller), so at 2^16 they come close
    to fp16's largest value, and once the scale has grown to 2^17 they overflow on every
    rank (``ScalerSettings(init_scale=2.**16, steps=6)``: every rank skips step 5). From 2^12
    the scale has room to grow during the run."""

    features: int = 12
    classes: int = 5
    batch: int = 4  #: rows per rank
    steps: int = 4
    lr: float = 0.1
    init_scale: float = 2.0**12
    growth_interval: int = 2
    overflow_rank: int = 1
    overflow_step: int = 0
    overflow_feature: int = 1
    overflow_factor: float = 1000.0
    seed: int = 0
    data_seed: int = 1000
    agreements: tuple[Agreement, ...] = tuple(Agreement)

    def __post_init__(self) -> None:
        for name in ("features", "classes", "batch", "steps", "growth_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        for name in ("overflow_rank", "overflow_step", "overflow_feature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}.")
        if self.overflow_step >= self.steps:
            raise ValueError(f"overflow_step ({self.overflow_step}) must be one of the "
                             f"{self.steps} steps: pick overflow_step < steps.")
        if self.overflow_feature >= self.features:
            raise ValueError(f"overflow_feature ({self.overflow_feature}) must be one of the "
                             f"{self.features} features.")
        for name in ("lr", "init_scale", "overflow_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
        if not self.agreements or any(not isinstance(a, Agreement) for a in self.agreements):
            raise ValueError(f"agreements must be a non-empty tuple of Agreement members, "
                             f"got {self.agreements!r}.")

    @property
    def numel(self) -> int:
        """Elements of the model: the weight, then the bias, in one flat vector (one unit)."""
        return self.features * self.classes + self.classes

    def owner(self, world_size: int) -> int:
        """The rank whose shard holds the overflowing row: FSDP's flat vector, zero-padded
        to N equal shards of ceil(numel / N) elements, row j at ``j * classes``."""
        shard = -(-self.numel // world_size)
        return self.overflow_feature * self.classes // shard

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size without the overflowing rank, or one that cuts the row in
        two (then two ranks would see the inf)."""
        _check_world_size(world_size)
        if self.overflow_rank >= world_size:
            raise ValueError(f"overflow_rank {self.overflow_rank} is not a rank of "
                             f"{world_size}: pick ScalerSettings(overflow_rank=...) < "
                             f"{world_size}.")
        shard = -(-self.numel // world_size)
        start = self.overflow_feature * self.classes
        if start // shard != (start + self.classes - 1) // shard:
            raise ValueError(f"with {world_size} ranks, feature {self.overflow_feature}'s row "
                             f"(elements {start}..{start + self.classes - 1}) is cut between "
                             f"two shards of {shard}: pick another overflow_feature.")

    def rows(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch at ``step``: features (batch, features) and classes (batch,)."""
        generator = torch.Generator().manual_seed(self.data_seed + 10 * step + rank)
        x = torch.randn(self.batch, self.features, generator=generator)
        y = torch.randint(0, self.classes, (self.batch,), generator=generator)
        if rank == self.overflow_rank and step == self.overflow_step:
            x[:, self.overflow_feature] *= self.overflow_factor
        return x, y


@dataclass(frozen=True)
class ScalerStep:
    """One rank's view of one step."""

    step: int
    inf_elements: int
    """Non-finite elements in this rank's shard gradient, before unscaling."""
    found_inf_locally: bool
    """Whether this rank's own shard held an inf or NaN."""
    skipped: bool
    """Whether this rank skipped its optimizer step (``scaler.step`` returned None)."""
    scale: float
    """The loss scale this step used."""
    next_scale: float
    """The scale after ``scaler.update()``."""
    shard_moved: bool
    """Whether this rank's shard changed in the step."""


@dataclass(frozen=True)
class ScalerRun:
    """One rank's run with one :class:`Agreement`."""

    agreement: Agreement
    rank: int
    world_size: int
    owner: int
    """The rank whose shard holds the overflowing row."""
    steps: tuple[ScalerStep, ...]
    initial: dict[str, torch.Tensor]
    """The full parameters before the first step."""
    states: tuple[dict[str, torch.Tensor], ...]
    """Per step, the full parameters all-gathered from the ranks' shards after it."""


@dataclass(frozen=True)
class ScalerReport:
    rank: int
    world_size: int
    runs: dict[Agreement, ScalerRun]


def _scaler_run(settings: ScalerSettings, agreement: Agreement, rank: int,
                world_size: int) -> ScalerRun:
    device = rank_device()
    net = FeatureClassifier(settings.features, settings.classes, settings.seed + rank)
    model = FSDP(net.to(device), torch.float16, reduce_dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    kind = ShardedGradScaler if agreement is Agreement.ALL_RANKS else LocalGradScaler
    scaler = kind(init_scale=settings.init_scale, growth_interval=settings.growth_interval)
    initial = model.gather_full_params()
    steps, states = [], []
    for step in range(settings.steps):
        x, y = (t.to(device) for t in settings.rows(rank, step))
        before = [u.shard.detach().clone() for u in model.units]
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        loss = nn.functional.cross_entropy(model(x).float(), y)  # fp32 loss of fp16 logits
        scaler.scale(loss).backward()
        model.finish_gradient_synchronization()
        bad = sum(int((~u.shard.grad.isfinite()).sum()) for u in model.units
                  if u.shard.grad is not None)
        scaler.step(optimizer)  # None both when skipped and from SGD.step: ask the scaler
        skipped = scaler.found_inf(optimizer)
        found_here = scaler.found_inf_locally(optimizer)
        scaler.update()
        moved = any(not torch.equal(b, u.shard.detach()) for b, u in zip(before, model.units,
                                                                          strict=True))
        steps.append(ScalerStep(step, bad, found_here, skipped, scale, scaler.get_scale(),
                                moved))
        states.append(model.gather_full_params())
    return ScalerRun(agreement, rank, world_size, settings.owner(world_size), tuple(steps),
                     initial, tuple(states))


def scaler_worker(rank: int, world_size: int,
                  settings: ScalerSettings = ScalerSettings()) -> ScalerReport:
    """Worker: the fp16 run of :class:`ScalerSettings` with each of its agreements."""
    settings.check_world_size(world_size)
    return ScalerReport(rank, world_size, {a: _scaler_run(settings, a, rank, world_size)
                                           for a in settings.agreements})


def scaler_on_ranks(world_size: int, settings: ScalerSettings = ScalerSettings(),
                    timeout: float = 120.0) -> list[ScalerReport]:
    """:func:`scaler_worker` on ``world_size`` real ranks; a world size the settings do not
    fit is refused before any process starts."""
    settings.check_world_size(world_size)
    return list(launch(scaler_worker, world_size, args=(settings,), echo=False,
                       timeout=timeout))


def out_of_step(runs: Sequence[ScalerRun]) -> list[str]:
    """Where the ranks' runs (one per rank, same agreement) stopped being one model: a step
    that some ranks skipped and others took, or scales that differ, in words; [] when the
    ranks stayed in step throughout."""
    problems = []
    for step in zip(*(r.steps for r in runs), strict=True):
        skipped = [s.skipped for s in step]
        if any(skipped) and not all(skipped):
            problems.append(f"step {step[0].step}: ranks {[i for i, s in enumerate(skipped) if s]} "
                            f"skipped, ranks {[i for i, s in enumerate(skipped) if not s]} "
                            "stepped")
        scales = [s.next_scale for s in step]
        if len(set(scales)) > 1:
            problems.append(f"after step {step[0].step}: the ranks' scales differ: {scales}")
    return problems


def scaler_table(reports: Sequence[ScalerReport], agreement: Agreement) -> str:
    """Per step and rank, for one agreement: infs in the shard, what the rank decided, the
    scale, whether its shard moved; and the largest change of the gathered model."""
    header = ["step", "rank", "inf in my shard", "found locally", "skipped", "scale",
              "next scale", "shard moved", "max |param change|"]
    runs = [r.runs[agreement] for r in reports]
    rows = []
    for rank, run in enumerate(runs):
        previous = run.initial
        for step, state in zip(run.steps, run.states, strict=True):
            change = max((state[k] - previous[k]).abs().max().item() for k in state)
            rows.append([step.step, rank, step.inf_elements, _yes(step.found_inf_locally),
                         _yes(step.skipped), f"{step.scale:g}", f"{step.next_scale:g}",
                         _yes(step.shard_moved), f"{change:.3g}"])
            previous = state
    rows.sort(key=lambda row: (row[0], row[1]))
    return format_table(header, rows)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# --- 4. torch's fully_shard with a MixedPrecisionPolicy ------------------------------------------

#: Where ``MixedPrecisionPolicy`` lives, newest first (the package of ``fully_shard``).
_POLICY_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def mixed_precision_policy(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> Any:
    """torch's ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)`` from wherever
    this torch keeps it."""
    for module in _POLICY_MODULES:
        try:
            policy = getattr(__import__(module, fromlist=["MixedPrecisionPolicy"]),
                             "MixedPrecisionPolicy", None)
        except ImportError:
            continue
        if policy is not None:
            return policy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    raise RuntimeError(f"this torch {torch.__version__} has no MixedPrecisionPolicy in "
                       f"{' or '.join(_POLICY_MODULES)}.")


@dataclass(frozen=True)
class SideBySide:
    """One rank's bf16 runs (bf16 compute, fp32 reduce) of the same TiedNet and batch:
    labs.fsdp.FSDP and torch's fully_shard with a MixedPrecisionPolicy."""

    rank: int
    world_size: int
    losses: dict[Wrapper, tuple[float, ...]]
    """Per wrapper (``Wrapper.FSDP``, ``Wrapper.FULLY_SHARD``), per step, this rank's loss."""
    states: dict[Wrapper, tuple[dict[str, torch.Tensor], ...]]
    """Per wrapper, per step, the full parameters (fp32) and buffer after the step."""
    skipped: str | None = None
    """Why fully_shard did not run (this torch or device), or None."""
    dtypes: dict[Wrapper, tuple[torch.dtype, ...]] = field(default_factory=dict)
    """Per wrapper: the dtypes of the logits and of the parameters the optimizer holds."""


def _train_bf16(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: MixedSettings,
                full_state: Any) -> tuple[tuple[float, ...], tuple[dict[str, torch.Tensor], ...],
                                         tuple[torch.dtype, ...]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    losses, states = [], []
    dtype = torch.float32
    for _ in range(settings.steps):
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        dtype = logits.dtype
        loss = _loss(logits, y, settings.vocab)
        loss.backward()
        if isinstance(model, FSDP):
            model.finish_gradient_synchronization()
        optimizer.step()
        losses.append(loss.item())
        states.append(full_state())
    params = {p.dtype for p in model.parameters() if p.requires_grad}
    return tuple(losses), tuple(states), (dtype, *sorted(params, key=str))


def fully_shard_worker(rank: int, world_size: int,
                       settings: MixedSettings = MixedSettings()) -> SideBySide:
    """Worker: TiedNet in bf16 compute and fp32 reduce, under labs.fsdp.FSDP and under
    torch's ``fully_shard`` (each unit of :func:`labs.fsdp_torch.fully_shard_units`, then the
    root, with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)``), from rank 0's initial values, on this rank's share."""
    settings.check_world_size(world_size)
    x, y = _share(settings, rank, world_size)
    losses, states, dtypes = {}, {}, {}
    model = _fsdp_tiednet(settings, rank, Precision.BF16_REDUCE_FP32)
    losses[Wrapper.FSDP], states[Wrapper.FSDP], dtypes[Wrapper.FSDP] = _train_bf16(
        model, x, y, settings, model.gather_full_params)
    device = rank_device()
    ok, why = fully_shard_available(device.type)
    if not ok:
        return SideBySide(rank, world_size, losses, states, why, dtypes)
    from torch.distributed.device_mesh import init_device_mesh  # with fully_shard only

    net = TiedNet(settings.vocab, settings.dim, settings.seed + rank).to(device)
    broadcast_state(net)  # fully_shard does not broadcast
    fully_shard = load_fully_shard(device.type)
    mesh = init_device_mesh(device.type, (world_size,))
    policy = mixed_precision_policy(torch.bfloat16, torch.float32)
    for unit in fully_shard_units(net):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)

    def full_state() -> dict[str, torch.Tensor]:
        gathered: dict[int, torch.Tensor] = {}
        for tensor in net.state_dict(keep_vars=True).values():
            gathered.setdefault(id(tensor), full_value(tensor))
        return {name: gathered[id(t)] for name, t in net.state_dict(keep_vars=True).items()}

    with warnings.catch_warnings():
        # fully_shard warns when a unit returns a view (nn.Linear on 3-D input does); an
        # in-place op on it would skip the pre-backward all-gather. TiedNet does none.
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        result = _train_bf16(net, x, y, settings, full_state)
    losses[Wrapper.FULLY_SHARD], states[Wrapper.FULLY_SHARD], dtypes[Wrapper.FULLY_SHARD] = (
        result)
    return SideBySide(rank, world_size, losses, states, None, dtypes)


def fully_shard_on_ranks(world_size: int, settings: MixedSettings = MixedSettings(),
                         timeout: float = 120.0) -> list[SideBySide]:
    """:func:`fully_shard_worker` on ``world_size`` real ranks."""
    settings.check_world_size(world_size)
    return list(launch(fully_shard_worker, world_size, args=(settings,), echo=False,
                       timeout=timeout))


def side_by_side_table(reference: ReferenceRun, reports: Sequence[SideBySide],
                       settings: MixedSettings = MixedSettings()) -> str:
    """Per step: the fp32 loss of one process, the bf16 losses (mean over ranks) of
    labs.fsdp.FSDP and of fully_shard, and the largest parameter difference between them;
    a note where fully_shard was skipped."""
    wrappers = list(reports[0].losses)
    header = ["step", "fp32, one process", *(f"bf16 {w.value}" for w in wrappers)]
    both = Wrapper.FULLY_SHARD in reports[0].states
    if both:
        header.append("max |param labs - torch|")
        gap = max_parameter_difference(reports[0].states[Wrapper.FSDP],
                                       reports[0].states[Wrapper.FULLY_SHARD],
                                       trainable_names(settings))
    rows = []
    for step, want in enumerate(reference.losses):
        row: list[object] = [step, f"{want:.6f}"]
        for wrapper in wrappers:
            values = [r.losses[wrapper][step] for r in reports]
            row.append(f"{sum(values) / len(values):.6f}")
        if both:
            row.append(f"{gap[step]:.2e}")
        rows.append(row)
    note = [f"fully_shard {reports[0].skipped}"] if reports[0].skipped else []
    return "\n".join([format_table(header, rows), *note])


def _check_world_size(world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
