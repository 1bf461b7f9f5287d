"""Chapter 7, part 2, on real ranks: fp16 and its loss scale. Why fp16 needs loss scaling (a
gradient that underflows, in the calling process), and what a sharded grad scaler must agree
on (one rank's shard overflows; :class:`labs.precision.ShardedGradScaler` against
:class:`labs.precision.LocalGradScaler`).

bf16 under FSDP and torch's ``MixedPrecisionPolicy`` are :mod:`labs.experiments.precision`,
which re-exports this module's names (the chapter reads them all as ``precision.*``); fp16's
scaling is a topic of its own, with its own model and settings, so it has its own module.

Every ``*_worker`` runs inside a rank (run it with :func:`labs.launch`); ranks import this
module, so it imports no plotting. Each experiment has one frozen settings dataclass, checked
before any process starts, and a table formatter (:func:`labs.tables.format_table`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.experiments.zero import LAB_SETTINGS
from labs.fsdp import FSDP
from labs.launcher import launch, rank_device
from labs.models import StepSettings, mlp
from labs.precision import LocalGradScaler, ShardedGradScaler, Underflow, gradient_underflow
from labs.tables import format_table

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


# --- 2. fp16 with a loss scale: one rank overflows ----------------------------------------------


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
        check_positive_world_size(world_size)
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


def check_positive_world_size(world_size: object) -> None:
    """Refuse a world size that is not an int >= 1 (the settings of both modules ask)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
