"""Chapter 7, part 2, on real ranks: what bf16 saves under FSDP and what it costs in accuracy,
and torch's ``fully_shard`` with a ``MixedPrecisionPolicy`` beside :class:`labs.fsdp.FSDP`.

fp16's loss scaling (a gradient that underflows, a sharded grad scaler when one rank
overflows) is :mod:`labs.experiments.loss_scaling`; its names are imported here too, so that
the chapter reads every experiment of its part 2 as ``precision.*``.

Every ``*_worker`` runs inside a rank (run it with :func:`labs.launch`); ranks import this
module, so it imports no plotting. Each experiment has one frozen settings dataclass, checked
before any process starts, and a table formatter (:func:`labs.tables.format_table`).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from labs.collectives import Algorithm, Recorder
from labs.ddp import broadcast_state
from labs.experiments.loss_scaling import (
    Agreement,
    FeatureClassifier,
    ScalerReport,
    ScalerRun,
    ScalerSettings,
    ScalerStep,
    UnderflowSettings,
    check_positive_world_size,
    out_of_step,
    scaler_on_ranks,
    scaler_table,
    scaler_worker,
    underflow_rows,
    underflow_table,
)
from labs.experiments.zero import Group, holdings
from labs.fsdp import FSDP, Event
from labs.fsdp_torch import full_value, fully_shard_available, fully_shard_units, load_fully_shard
from labs.launcher import launch, rank_device
from labs.memory import AllocationTracker, MemoryTimeline
from labs.models import TiedNet
from labs.tables import format_table
from labs.wrappers import Wrapper

#: Chapter 7's part 2 reads every experiment as ``precision.*``: this module's (bf16) and those
#: of :mod:`labs.experiments.loss_scaling` (fp16), imported above.
__all__ = [
    "MixedReport", "MixedRun", "MixedSettings", "Precision", "ReferenceRun", "SideBySide",
    "cast_frozen_and_buffers", "fully_shard_on_ranks", "fully_shard_worker",
    "max_parameter_difference", "mean_loss", "mixed_on_ranks", "mixed_precision_policy",
    "mixed_table", "mixed_worker", "reference_run", "side_by_side_table", "trainable_names",
    # fp16 and its loss scale
    "Agreement", "FeatureClassifier", "ScalerReport", "ScalerRun", "ScalerSettings", "ScalerStep",
    "UnderflowSettings", "out_of_step", "scaler_on_ranks", "scaler_table", "scaler_worker",
    "underflow_rows", "underflow_table",
]

# --- 1. bf16 against fp32 under FSDP -------------------------------------------------------------


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
        check_positive_world_size(world_size)
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


# --- 2. torch's fully_shard with a MixedPrecisionPolicy ------------------------------------------

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
