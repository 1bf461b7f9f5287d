"""Chapter 8's HSDP measurements on real ranks: for DDP, FSDP and HSDP, what each rank holds
(parameters + gradients + optimizer state, as chapter 6 counts them) and the bytes one step
sends inside a group of ``shard_size`` consecutive ranks (a node) and across groups, each
beside its closed form.

How the bytes are split: every collective here is labs' ring, counted by a
:class:`~labs.collectives.Recorder`. A flat ring over N ranks (DDP's all-reduce, FSDP's
all-gathers and reduce-scatters) sends every message of rank r to rank r+1 (mod N), so all of
rank r's bytes cross groups when r+1 is in another group (r % g = g-1) and none otherwise.
HSDP runs its all-gathers and reduce-scatters on the shard group (consecutive ranks: inside)
and its all-reduce on the replicate group (one rank per group: across), each counted by its
own recorder (``FSDP(recorder=..., replicate_recorder=...)``).

Every ``*_worker`` runs inside a rank; ranks import this module, so it imports no plotting.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.collectives import Algorithm, Recorder, ring_all_reduce
from labs.ddp import DDP
from labs.experiments.ddp import StepSettings, mlp
from labs.experiments.zero import Group, holdings
from labs.fsdp import FSDP, check_shard_size
from labs.launcher import launch, rank_device
from labs.memory import MemoryTimeline
from labs.tables import format_table
from labs.wrappers import Wrapper


class Strategy(enum.Enum):
    """How the training state is spread over the N ranks (the value is its table label)."""

    DDP = "DDP"
    """:class:`labs.ddp.DDP`: everything replicated, the gradients all-reduced over all N."""
    FSDP = "FSDP"
    """:class:`labs.fsdp.FSDP`: everything sharded over all N ranks."""
    HSDP = "HSDP"
    """``FSDP(shard_size=g)``: sharded inside each group of g, replicated across groups."""


@dataclass(frozen=True)
class HsdpSettings:
    """The experiment: an MLP of ``layers`` Linear(width, width) layers, ``batch`` rows per
    rank, trained with Adam for ``steps`` steps at ``world_size`` ranks, HSDP sharding over
    groups of ``shard_size`` consecutive ranks."""

    width: int = 64
    layers: int = 4
    batch: int = 8
    steps: int = 2
    world_size: int = 4
    shard_size: int = 2

    def __post_init__(self) -> None:
        for name in ("width", "layers", "batch", "steps", "world_size", "shard_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        check_shard_size(self.shard_size, self.world_size)

    @property
    def groups(self) -> int:
        """n = N / g: the number of groups (nodes), each holding one copy of the shards."""
        return self.world_size // self.shard_size

    @property
    def step_settings(self) -> StepSettings:
        return StepSettings(width=self.width, layers=self.layers, batch=self.batch,
                            steps=self.steps, warmup=0)


#: The chapter's setting: 4 ranks in 2 groups (nodes) of 2.
LAB_SETTINGS = HsdpSettings()


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's numbers for one strategy."""

    strategy: Strategy
    rank: int
    held: int
    """Bytes of parameters + gradients + optimizer state after the last optimizer step."""
    inside: int
    """Bytes this rank sent in one step to ranks of its own group."""
    across: int
    """Bytes this rank sent in one step to ranks of other groups."""
    size: int
    """S: bytes of the fp32 parameters as this strategy lays them out (padded to a multiple
    of the shard count for FSDP and HSDP)."""


def _model(strategy: Strategy, settings: HsdpSettings, collectives: Algorithm = Algorithm.TORCH,
           recorder: Recorder | None = None, across: Recorder | None = None) -> nn.Module:
    net = mlp(settings.step_settings).to(rank_device())
    if strategy is Strategy.DDP:
        return DDP(net)
    shard_size = settings.shard_size if strategy is Strategy.HSDP else None
    return FSDP(net, collectives=collectives, recorder=recorder, shard_size=shard_size,
                replicate_recorder=across)


def _batch(rank: int, settings: HsdpSettings) -> torch.Tensor:
    return torch.randn(settings.batch, settings.width,
                       generator=torch.Generator().manual_seed(rank)).to(rank_device())


def held_bytes(rank: int, strategy: Strategy, settings: HsdpSettings) -> int:
    """Train ``settings.steps`` Adam steps; the bytes of parameters, gradients and optimizer
    state this rank holds after the last step (chapter 6's accounting:
    :func:`labs.experiments.zero.holdings`; DDP's buckets are communication buffers, not
    counted). Closed form, P parameters: DDP 16P; FSDP 16P/N; HSDP 16P/g, plus padding and
    Adam's 4-byte step counts."""
    model = _model(strategy, settings)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = _batch(rank, settings)
    for _ in range(settings.steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()  # type: ignore[operator]
        optimizer.step()
    wrapper = Wrapper.DDP if strategy is Strategy.DDP else Wrapper.FSDP
    snapshot = MemoryTimeline(rank).record("after optimizer step",
                                           **holdings(wrapper, model, optimizer))
    by_group = snapshot.bytes_by_group()
    return sum(by_group.get(g.value, 0) for g in (Group.PARAMETERS, Group.GRADIENTS,
                                                  Group.OPTIMIZER))


def step_traffic(rank: int, world_size: int, strategy: Strategy, settings: HsdpSettings
                 ) -> tuple[int, int, int]:
    """(bytes sent inside the group, across groups, S) in one step with labs' ring.

    DDP's traffic is the ring all-reduce of its gradients (flattened, as chapter 6 measures
    it: :class:`~labs.ddp.DDP` uses torch's all-reduce, which no Recorder sees)."""
    g = settings.shard_size
    right_is_across = (rank + 1) % world_size // g != rank // g
    x = _batch(rank, settings)
    if strategy is Strategy.DDP:
        recorder = Recorder()
        net = mlp(settings.step_settings).to(rank_device())
        net(x).square().mean().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
        ring_all_reduce(flat, recorder=recorder)
        sent, size = recorder.stats.bytes_sent, 4 * flat.numel()
        return (0, sent, size) if right_is_across else (sent, 0, size)
    inside, across = Recorder(), Recorder()
    model = _model(strategy, settings, Algorithm.RING, inside,
                   across if strategy is Strategy.HSDP else None)
    assert isinstance(model, FSDP)
    model(x).square().mean().backward()
    model.finish_gradient_synchronization()
    size = sum(4 * u.padded_numel for u in model.units)
    if strategy is Strategy.HSDP:
        return inside.stats.bytes_sent, across.stats.bytes_sent, size
    sent = inside.stats.bytes_sent
    return (0, sent, size) if right_is_across else (sent, 0, size)


def hsdp_worker(rank: int, world_size: int, settings: HsdpSettings
                ) -> list[RankMeasurement]:
    """Every strategy's :func:`held_bytes` and :func:`step_traffic` on this rank."""
    if world_size != settings.world_size:
        raise ValueError(f"launched on {world_size} ranks, settings say {settings.world_size}.")
    out = []
    for strategy in Strategy:
        held = held_bytes(rank, strategy, settings)
        out.append(RankMeasurement(strategy, rank, held,
                                   *step_traffic(rank, world_size, strategy, settings)))
    return out


@dataclass(frozen=True)
class HsdpRow:
    """One strategy over all ranks, with the closed forms."""

    strategy: Strategy
    settings: HsdpSettings
    held: int
    """Rank 0's bytes of parameters + gradients + optimizer state."""
    inside: int
    """Bytes sent inside groups in one step, all ranks together."""
    across: int
    """Bytes sent across groups in one step, all ranks together."""
    across_max: int
    """The most one rank sent across groups (the slowest link waits for it)."""
    size: int
    """S for this strategy (bytes, fp32, padded as it pads)."""

    @property
    def shards(self) -> int:
        """How many shards each tensor is cut into: 1, N or g."""
        return {Strategy.DDP: 1, Strategy.FSDP: self.settings.world_size,
                Strategy.HSDP: self.settings.shard_size}[self.strategy]

    @property
    def expected_inside(self) -> float:
        """Closed form of :attr:`inside`. Flat rings (DDP: 2(N-1)/N·S per rank, FSDP:
        3(N-1)/N·S) send inside from the N - n ranks whose right neighbour shares their
        group; HSDP: every rank, 3(g-1)/g·S."""
        n_ranks, g, n = self.settings.world_size, self.settings.shard_size, self.settings.groups
        if self.strategy is Strategy.HSDP:
            return n_ranks * 3 * (g - 1) / g * self.size
        per_rank = (2 if self.strategy is Strategy.DDP else 3) * (n_ranks - 1) / n_ranks
        boundary = n if n > 1 else 0
        return (n_ranks - boundary) * per_rank * self.size

    @property
    def expected_across(self) -> float:
        """Closed form of :attr:`across`. Flat rings: the n ranks at the end of a group
        send everything across (DDP n·2(N-1)/N·S, FSDP n·3(N-1)/N·S); HSDP: every rank
        all-reduces S/g over the n groups, N·2(n-1)/n·S/g = 2(n-1)·S."""
        n_ranks, n = self.settings.world_size, self.settings.groups
        if n == 1:
            return 0.0
        if self.strategy is Strategy.HSDP:
            return 2 * (n - 1) * self.size
        per_rank = (2 if self.strategy is Strategy.DDP else 3) * (n_ranks - 1) / n_ranks
        return n * per_rank * self.size


def rows_from(settings: HsdpSettings, per_rank: Sequence[Sequence[RankMeasurement]]
              ) -> list[HsdpRow]:
    """Sum the ranks' measurements into one row per strategy."""
    rows = []
    for strategy in Strategy:
        mine = [m for ms in per_rank for m in ms if m.strategy is strategy]
        rank0 = next(m for m in mine if m.rank == 0)
        rows.append(HsdpRow(strategy, settings, rank0.held, sum(m.inside for m in mine),
                            sum(m.across for m in mine), max(m.across for m in mine),
                            rank0.size))
    return rows


def measure_hsdp(settings: HsdpSettings = LAB_SETTINGS, timeout: float = 300.0
                 ) -> list[HsdpRow]:
    """One launch of ``settings.world_size`` ranks: a row per strategy."""
    per_rank = launch(hsdp_worker, settings.world_size, args=(settings,), echo=False,
                      timeout=timeout)
    return rows_from(settings, per_rank)


def hsdp_table(rows: Sequence[HsdpRow]) -> str:
    """Bytes held per rank (and as a fraction of DDP's) and bytes sent per step inside and
    across groups, measured beside the closed forms."""
    ddp = next((r.held for r in rows if r.strategy is Strategy.DDP), None)
    header = ["strategy", "shards", "held per rank (B)", "/ DDP", "inside (B)", "closed form",
              "across (B)", "closed form", "across, max rank (B)"]
    body = [[r.strategy.value, r.shards, r.held, f"{r.held / ddp:.3f}" if ddp else "-",
             r.inside, round(r.expected_inside), r.across, round(r.expected_across),
             r.across_max] for r in rows]
    return format_table(header, body)
