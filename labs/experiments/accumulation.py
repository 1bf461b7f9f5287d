"""Chapter 7, part 3: gradient accumulation under FSDP, two ways, measured on real ranks.

One optimizer step of k micro-batches on N ranks, the chapter's small transformer
(:class:`labs.train.TinyTransformer`, tied embedding and head, a frozen position embedding)
wrapped in :class:`labs.fsdp.FSDP` with chapter 3 and 4's ring collectives, so that a
:class:`~labs.collectives.Recorder` counts every byte a rank sends:

* :attr:`Accumulation.NO_SYNC`: the first k-1 backward passes run inside ``no_sync()``: each
  unit keeps its full (unsharded) gradient and adds the next micro-batch's to it; the last
  backward reduce-scatters the sum, once per unit;
* :attr:`Accumulation.REDUCE_SCATTER_EACH`: every backward reduce-scatters, and the fp32
  gradient shards add up.

Both gather the parameters twice per micro-batch (forward and backward), so they send the
same all-gather bytes; they differ in the reduce-scatters (1 or k per unit) and in the
gradient bytes held between micro-batches (S_r whole, or S_r/N as fp32 shards). For P
elements of trainable parameters padded to N equal shards per unit, S_c = P * (bytes of an
element in the compute dtype) and S_r = P * (bytes in the reduce dtype), each rank sends
per step::

    all-gathers      2k (N-1)/N S_c                        (both ways)
    reduce-scatters  (N-1)/N S_r   (NO_SYNC)  or  k (N-1)/N S_r   (REDUCE_SCATTER_EACH)

and holds at most, in gradients, S_r (NO_SYNC, k > 1: every unit's full gradient) or 4P/N
(the fp32 shard gradients). :func:`closed_form` is that arithmetic, :func:`accumulation_worker`
the measurement; the two ways must end at the same parameters
(:attr:`AccumulationRow.max_difference`). Ranks import this module, so matplotlib is imported
only by :func:`plot_accumulation`.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from labs.collectives import Algorithm, Recorder
from labs.fsdp import FSDP, Event
from labs.launcher import launch, rank_device
from labs.memory import AllocationTracker
from labs.tables import format_table
from labs.train import CHARS, TinyTransformer
from labs.zero import shard_numel

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class Accumulation(enum.Enum):
    """How the gradients of k micro-batches are added up before the optimizer step."""

    NO_SYNC = "no_sync"
    """The first k-1 backward passes inside ``FSDP.no_sync()``: full gradients kept (S_r
    bytes held between micro-batches), one reduce-scatter per unit per step."""
    REDUCE_SCATTER_EACH = "reduce-scatter each"
    """Every backward reduce-scatters (k per unit per step) and the fp32 gradient shards add
    up: 4P/N bytes held."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")


@dataclass(frozen=True)
class AccumulationSettings:
    """One accumulation experiment: the model, the micro-batches, the ranks.

    Attributes:
        world_size: N, the ranks :func:`measure_accumulation` launches.
        micro_batch: sequences per rank per micro-batch; a step sees k * N * micro_batch.
        ks: the micro-batches per optimizer step to measure, each >= 1 (1: no accumulation).
        vocab, d_model, n_heads, n_layers, seq_len: the :class:`~labs.train.TinyTransformer`
            (the defaults are the chapter's: its text's characters, width 32, 2 blocks).
        compute_dtype: FSDP's ``compute_dtype`` (None: fp32): the dtype of the all-gathers.
        reduce_dtype: FSDP's ``reduce_dtype`` (None: the compute dtype): the dtype of the
            reduce-scatters and of the full gradients NO_SYNC keeps.
        lr: the SGD step's learning rate.
        seed: the model's initialisation; the batch is drawn from ``seed + 1``.
    """

    world_size: int = 2
    micro_batch: int = 4
    ks: tuple[int, ...] = (1, 2, 4, 8)
    vocab: int = len(CHARS)
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    seq_len: int = 16
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    lr: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.ks, (str, bytes)) or not isinstance(self.ks, Sequence):
            raise ValueError(f"ks must be a sequence of ints, e.g. (1, 2, 4, 8); "
                             f"got {self.ks!r}.")
        object.__setattr__(self, "ks", tuple(self.ks))  # hashable, whatever was given
        if not self.ks:
            raise ValueError("ks is empty: give at least one k, e.g. ks=(1, 2, 4, 8).")
        for k in self.ks:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(
                    f"every k in ks must be an int >= 1 (micro-batches per optimizer step; "
                    f"k = 1 is a step without accumulation), got ks={self.ks!r}.")
        if len(set(self.ks)) != len(self.ks):
            raise ValueError(f"ks lists a k twice: {self.ks!r}.")
        for name in ("world_size", "micro_batch", "vocab", "d_model", "n_heads", "n_layers",
                     "seq_len"):
            _positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads "
                             f"({self.n_heads}): each head gets d_model / n_heads features.")
        for name in ("compute_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype)
                                          and dtype.is_floating_point):
                raise ValueError(f"{name} must be None or a floating-point torch.dtype (e.g. "
                                 f"torch.bfloat16), got {dtype!r}.")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}.")

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element in the compute dtype (what the all-gathers carry)."""
        return (self.compute_dtype or torch.float32).itemsize

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one element in the reduce dtype (what the reduce-scatters carry)."""
        return (self.reduce_dtype or self.compute_dtype or torch.float32).itemsize


# --- the model and the data -------------------------------------------------------------------


def build_model(settings: AccumulationSettings) -> TinyTransformer:
    """The experiment's transformer, the same for the same seed: its head is tied to the token
    embedding (one parameter, two uses) and its position embedding is frozen."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
        torch.manual_seed(settings.seed)
        model = TinyTransformer(settings.vocab, settings.d_model, settings.n_heads,
                                settings.n_layers, settings.seq_len)
    model.pos_emb.weight.requires_grad_(False)
    return model


def units_of(model: TinyTransformer) -> list[nn.Module]:
    """FSDP's units: the blocks; the rest (tied embedding and head, final LayerNorm) is the
    root unit."""
    return list(model.blocks)


def unit_numels(settings: AccumulationSettings) -> tuple[int, ...]:
    """Trainable elements of each FSDP unit, unpadded: every block, then the root (the tied
    embedding counted once, the final LayerNorm); the frozen position embedding is in none."""
    model = build_model(settings)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    blocks = [sum(p.numel() for p in block.parameters() if p.requires_grad)
              for block in units_of(model)]
    root = sum(p.numel() for p in model.parameters()  # each parameter once, tied or not
               if p.requires_grad and id(p) not in in_blocks)
    return (*blocks, root)


def padded_numel(settings: AccumulationSettings, world_size: int) -> int:
    """P: trainable elements, each unit zero-padded to N equal shards: sum of N ceil(P_u / N)."""
    return sum(world_size * shard_numel(n, world_size) for n in unit_numels(settings))


def batch(settings: AccumulationSettings, k: int, world_size: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step: k N micro_batch random sequences (inputs, next-token
    targets), each (k N micro_batch, seq_len) long."""
    rows = k * world_size * settings.micro_batch
    ids = torch.randint(0, settings.vocab, (rows, settings.seq_len + 1),
                        generator=torch.Generator().manual_seed(settings.seed + 1))
    return ids[:, :-1], ids[:, 1:]


def micro_batch_rows(settings: AccumulationSettings, world_size: int, rank: int,
                     micro: int) -> slice:
    """The rows of :func:`batch` that ``rank`` computes in micro-batch ``micro``."""
    start = (micro * world_size + rank) * settings.micro_batch
    return slice(start, start + settings.micro_batch)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 whatever the model computes in."""
    logits = model(x).float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# --- the closed forms -------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """What one rank sends and holds in one optimizer step (measured, or by the closed form)."""

    all_gather: int
    """Bytes sent by the all-gathers (forward and backward, every micro-batch)."""
    reduce_scatter: int
    """Bytes sent by the reduce-scatters of the gradients."""
    gradient_bytes: int
    """The most bytes of gradients held at once: full gradients kept by ``no_sync`` plus the
    fp32 gradient shards (not the full gradient of the unit whose backward is running)."""

    @property
    def sent(self) -> int:
        return self.all_gather + self.reduce_scatter


def closed_form(settings: AccumulationSettings, world_size: int, k: int,
                way: Accumulation) -> StepBytes:
    """The arithmetic of the module docstring, with P = :func:`padded_numel`: all-gathers
    2k (N-1)/N S_c; reduce-scatters (N-1)/N S_r once (NO_SYNC) or k times; gradients held
    max(S_r, 4P/N) for NO_SYNC with k > 1 (every unit's full gradient between micro-batches;
    the last backward trades each for its shard), else 4P/N (the fp32 shards)."""
    _positive_int("k", k)
    n = world_size
    shard = padded_numel(settings, n) // n  # elements of one rank's shards, all units
    reduce_scatters = 1 if way is Accumulation.NO_SYNC else k
    shard_grads = 4 * shard
    held = (max(n * shard * settings.reduce_bytes, shard_grads)
            if way is Accumulation.NO_SYNC and k > 1 else shard_grads)
    return StepBytes(all_gather=2 * k * (n - 1) * shard * settings.compute_bytes,
                     reduce_scatter=reduce_scatters * (n - 1) * shard * settings.reduce_bytes,
                     gradient_bytes=held)


# --- the measurement, inside a rank -------------------------------------------------------------


def _gradient_bytes(model: FSDP) -> int:
    """Bytes of the gradients held now: kept full gradients and shard gradients, each storage
    once."""
    storages = {}
    for unit in model.units:
        for grad in (unit.unsharded_grad, unit.shard.grad):
            if grad is not None:
                storage = grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass
class _Probe:
    """FSDP's observer: splits the recorder's bytes into reduce-scatters (sent between a
    unit's REDUCE_SCATTER and RESHARD_BACKWARD events, where only its ring reduce-scatter runs)
    and the rest (all-gathers), and keeps the most gradient bytes seen at any event."""

    recorder: Recorder
    model: FSDP | None = None
    reduce_scatter: int = 0
    gradient_bytes: int = 0
    started: int | None = field(default=None, repr=False)

    def __call__(self, event: Event, unit: str) -> None:
        del unit
        if event is Event.REDUCE_SCATTER:
            self.started = self.recorder.stats.bytes_sent
        elif event is Event.RESHARD_BACKWARD and self.started is not None:
            self.reduce_scatter += self.recorder.stats.bytes_sent - self.started
            self.started = None
        self.look()

    def look(self) -> None:
        if self.model is not None:
            self.gradient_bytes = max(self.gradient_bytes, _gradient_bytes(self.model))


@dataclass(frozen=True)
class StepOutcome:
    """One rank's measurement of one step, and the parameters after it."""

    measured: StepBytes
    peak_bytes: int
    """The most tensor bytes held at once during the step (AllocationTracker): shards, gathered
    parameters, activations, gradients, temporaries (the batch itself not counted)."""
    parameters: dict[str, torch.Tensor]
    """The full state dict after the step (``FSDP.gather_full_params``), on the CPU."""


def accumulation_step(rank: int, world_size: int, settings: AccumulationSettings, k: int,
                      way: Accumulation) -> StepOutcome:
    """Worker: build the model, run one SGD step of k micro-batches accumulated ``way``, and
    measure the bytes this rank sent (split by collective), the gradient bytes held and the
    peak of every tensor. Each micro-batch's loss is divided by k (and FSDP divides the sum
    over ranks by N), so the step is the one-process step on the whole :func:`batch`."""
    _positive_int("k", k)
    device = rank_device()
    net = build_model(settings).to(device)
    recorder = Recorder()
    probe = _Probe(recorder)
    model = FSDP(net, settings.compute_dtype, reduce_dtype=settings.reduce_dtype,
                 units=units_of(net), collectives=Algorithm.RING, recorder=recorder,
                 observer=probe)
    probe.model = model
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    x, y = (t.to(device) for t in batch(settings, k, world_size))
    before = recorder.stats.bytes_sent
    with AllocationTracker() as tracker:
        # Held before the step and counted in it: the shards, the (empty) full vectors that
        # every gather regrows, the frozen position embedding.
        tracker.track([u.shard for u in model.units] + [u.full for u in model.units]
                      + list(net.parameters()))
        for micro in range(k):
            rows = micro_batch_rows(settings, world_size, rank, micro)
            keep = way is Accumulation.NO_SYNC and micro < k - 1
            with model.no_sync() if keep else contextlib.nullcontext():
                (loss_of(model, x[rows], y[rows]) / k).backward()
            probe.look()
        model.finish_gradient_synchronization()
        probe.look()
        optimizer.step()
    sent = recorder.stats.bytes_sent - before
    measured = StepBytes(all_gather=sent - probe.reduce_scatter,
                         reduce_scatter=probe.reduce_scatter,
                         gradient_bytes=probe.gradient_bytes)
    parameters = {name: t.cpu() for name, t in model.gather_full_params().items()}
    model.remove_hooks()
    return StepOutcome(measured, tracker.peak_bytes, parameters)


@dataclass(frozen=True)
class AccumulationRow:
    """One rank, one k, one way: measured beside the closed form."""

    rank: int
    world_size: int
    k: int
    way: Accumulation
    measured: StepBytes
    model: StepBytes
    """:func:`closed_form` for this k, way and world size."""
    peak_bytes: int
    """Most tensor bytes held at once during the step (measured; see :class:`StepOutcome`)."""
    max_difference: float
    """Largest |difference| between the parameters after this way's step and after the other
    way's, same k (0 where floating-point addition in either order agrees)."""


def accumulation_worker(rank: int, world_size: int, settings: AccumulationSettings
                        ) -> list[AccumulationRow]:
    """Worker: for every k of ``settings.ks``, one step each way (:func:`accumulation_step`),
    this rank's rows in the order (k, way)."""
    rows = []
    for k in settings.ks:
        outcomes = {way: accumulation_step(rank, world_size, settings, k, way)
                    for way in Accumulation}
        a, b = (outcomes[way].parameters for way in Accumulation)
        difference = max((float((a[name] - b[name]).abs().max()) for name in a), default=0.0)
        rows += [AccumulationRow(rank, world_size, k, way, outcome.measured,
                                 closed_form(settings, world_size, k, way),
                                 outcome.peak_bytes, difference)
                 for way, outcome in outcomes.items()]
    return rows


def measure_accumulation(settings: AccumulationSettings, timeout: float = 300.0
                         ) -> list[list[AccumulationRow]]:
    """Every rank's rows (index: rank), from one launch of ``settings.world_size`` ranks."""
    return list(launch(accumulation_worker, settings.world_size, args=(settings,),
                       echo=False, timeout=timeout))


def mismatches(rows: Sequence[AccumulationRow]) -> list[str]:
    """Every row where a measurement differs from its closed form, in words; [] when all of
    them agree to the byte."""
    wrong = []
    for r in rows:
        for what in ("all_gather", "reduce_scatter", "gradient_bytes"):
            got, want = getattr(r.measured, what), getattr(r.model, what)
            if got != want:
                wrong.append(f"N = {r.world_size}, rank {r.rank}, k = {r.k}, {r.way.value}: "
                             f"{what.replace('_', ' ')} {got} bytes measured, {want} by the "
                             "closed form")
    return wrong


# --- the table and the figure -----------------------------------------------------------------


def accumulation_table(rows: Sequence[AccumulationRow]) -> str:
    """Per k and way: bytes sent (all-gathers + reduce-scatters), and the most gradient bytes
    held, measured / closed form; the step's peak (measured); how far the parameters ended
    from the other way's."""
    body = [[r.k, r.way.value,
             f"{r.measured.all_gather} / {r.model.all_gather}",
             f"{r.measured.reduce_scatter} / {r.model.reduce_scatter}",
             f"{r.measured.sent} / {r.model.sent}",
             f"{r.measured.gradient_bytes} / {r.model.gradient_bytes}",
             r.peak_bytes, f"{r.max_difference:.1e}"]
            for r in rows]
    return format_table(["k", "way", "all-gather bytes", "reduce-scatter bytes",
                         "bytes sent (measured / model)", "gradient bytes held (measured / model)",
                         "peak bytes", "max |Δ param|"], body)


def plot_accumulation(rows: Sequence[AccumulationRow], title: str = "") -> Figure:
    """Two panels against k, both ways: bytes sent per step and the most gradient bytes held;
    measured as markers, the closed form as a dashed line."""
    import matplotlib.pyplot as plt  # here, not at the top: ranks import this module

    fig, (sent_ax, held_ax) = plt.subplots(1, 2, figsize=(8, 3.2), layout="constrained")
    for way, colour in zip(Accumulation, ("tab:blue", "tab:orange"), strict=True):
        mine = sorted((r for r in rows if r.way is way), key=lambda r: r.k)
        ks = [r.k for r in mine]
        for ax, what in ((sent_ax, "sent"), (held_ax, "gradient_bytes")):
            ax.plot(ks, [getattr(r.measured, what) / 1024 for r in mine], "o", color=colour,
                    label=f"{way.value}, measured")
            ax.plot(ks, [getattr(r.model, what) / 1024 for r in mine], "--", color=colour,
                    label=f"{way.value}, closed form")
    for ax, label in ((sent_ax, "KiB sent per rank per step"),
                      (held_ax, "most gradient KiB held")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.k for r in rows}), [str(k) for k in sorted({r.k for r in rows})])
        ax.set_xlabel("micro-batches per step (k)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    held_ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig
