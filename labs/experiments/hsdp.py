"""Chapter 8's HSDP measurements on real ranks: for DDP, FSDP and HSDP, what each rank holds
(parameters + gradients + optimizer state, as chapter 6 counts them) and the bytes one step
sends inside a group of ``shard_size`` consecutive ranks (a node) and across groups, each
beside its closed form.

How the bytes are split: every collective here is labs' ring, counted by a
:class:`~labs.collectives.Recorder`. DDP all-reduces its gradients with the node-aware
all-reduce HSDP's gradient path is made of (:func:`labs.collectives.hierarchical_all_reduce`:
reduce-scatter inside the group, all-reduce across groups, all-gather inside), so that DDP and
HSDP differ in sharding alone, not in the choice of all-reduce. FSDP's all-gathers and
reduce-scatters run on labs' single flat ring over all N ranks (labs' FSDP has no other ring),
which sends every message of rank r to rank r+1 (mod N): all of rank r's bytes cross groups
when r+1 is in another group (r % g = g-1) and none otherwise. HSDP runs its all-gathers and
reduce-scatters on the shard group (consecutive ranks: inside) and its all-reduce on the
replicate group (one rank per group: across), each counted by its own recorder
(``FSDP(recorder=..., replicate_recorder=...)``).

**On the emulated topology** (:class:`HsdpLinkSettings`, :func:`measure_hsdp_on_topology`):
one Adam step of the same MLP per strategy, every message of labs' ring over a
:class:`labs.Topology` whose nodes are the groups (``node_size = shard_size``): the step time
(median of the slowest rank over a few steps, and its range) beside a model of it
(:func:`model_step_seconds`: the step's computation, timed on the same ranks without a
message, plus the port model of every collective the strategy issues), and the bytes each
rank sends to other nodes (``Recorder(node_size=g)``), beside their exact closed forms
(:func:`expected_across_per_rank`).

torch's HSDP (``fully_shard`` on a 2-D mesh) beside labs' is in
:mod:`labs.experiments.torch_hsdp`.

Every ``*_worker`` runs inside a rank; ranks import this module, so it imports no plotting.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from labs.collectives import (
    Algorithm,
    HierarchicalGroups,
    Recorder,
    hierarchical_all_reduce,
    shard_bounds,
)
from labs.cost_model import (
    TopologyAlgorithm,
    bytes_across_nodes,
    predict_on_topology,
    ring_step_times,
)
from labs.ddp import DDP
from labs.experiments.zero import Group, holdings
from labs.fsdp import FSDP, check_shard_size
from labs.launcher import launch, rank_device
from labs.link import Link, Topology
from labs.memory import MemoryTimeline
from labs.models import StepSettings, mlp
from labs.tables import format_table
from labs.wrappers import HSDP_STRATEGIES, Wrapper


def label(strategy: Wrapper) -> str:
    """A strategy's name in this chapter's tables: the member's name ("FSDP"), since the three
    stand side by side here (the enum's value, "FSDP (ZeRO-3)", names chapter 6's stage)."""
    return strategy.name


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

    strategy: Wrapper
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


def _model(strategy: Wrapper, settings: HsdpSettings, collectives: Algorithm = Algorithm.TORCH,
           recorder: Recorder | None = None, across: Recorder | None = None) -> nn.Module:
    net = mlp(settings.step_settings).to(rank_device())
    if strategy is Wrapper.DDP:
        return DDP(net)
    shard_size = settings.shard_size if strategy is Wrapper.HSDP else None
    return FSDP(net, collectives=collectives, recorder=recorder, shard_size=shard_size,
                replicate_recorder=across)


def batch_of(rank: int, settings: HsdpSettings) -> torch.Tensor:
    """Rank ``rank``'s batch: (batch, width), the same on every run."""
    return torch.randn(settings.batch, settings.width,
                       generator=torch.Generator().manual_seed(rank)).to(rank_device())


def held_bytes(rank: int, strategy: Wrapper, settings: HsdpSettings) -> int:
    """Train ``settings.steps`` Adam steps; the bytes of parameters, gradients and optimizer
    state this rank holds after the last step (chapter 6's accounting:
    :func:`labs.experiments.zero.holdings`; DDP's buckets are communication buffers, not
    counted). Closed form, P parameters: DDP 16P; FSDP 16P/N; HSDP 16P/g, plus padding and
    Adam's 4-byte step counts."""
    model = _model(strategy, settings)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = batch_of(rank, settings)
    for _ in range(settings.steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()  # type: ignore[operator]
        optimizer.step()
    wrapper = Wrapper.DDP if strategy is Wrapper.DDP else Wrapper.FSDP  # HSDP holds as FSDP
    snapshot = MemoryTimeline(rank).record("after optimizer step",
                                           **holdings(wrapper, model, optimizer))
    by_group = snapshot.bytes_by_group()
    return sum(by_group.get(g.value, 0) for g in (Group.PARAMETERS, Group.GRADIENTS,
                                                  Group.OPTIMIZER))


def step_traffic(rank: int, world_size: int, strategy: Wrapper, settings: HsdpSettings
                 ) -> tuple[int, int, int]:
    """(bytes sent inside the group, across groups, S) in one step with labs' ring.

    DDP's traffic is the hierarchical all-reduce of its gradients (flattened, as chapter 6
    measures it: :class:`~labs.ddp.DDP` uses torch's all-reduce, which no Recorder sees),
    the all-reduce HSDP's gradient path is made of."""
    g = settings.shard_size
    right_is_across = (rank + 1) % world_size // g != rank // g
    x = batch_of(rank, settings)
    if strategy is Wrapper.DDP:
        recorder = Recorder(node_size=g)
        net = mlp(settings.step_settings).to(rank_device())
        net(x).square().mean().backward()
        flat = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
        hierarchical_all_reduce(flat, g, recorder=recorder)
        across = recorder.stats.bytes_sent_across_nodes
        return recorder.stats.bytes_sent - across, across, 4 * flat.numel()
    inside, across = Recorder(), Recorder()
    model = _model(strategy, settings, Algorithm.RING, inside,
                   across if strategy is Wrapper.HSDP else None)
    assert isinstance(model, FSDP)
    model(x).square().mean().backward()
    model.finish_gradient_synchronization()
    size = sum(4 * u.padded_numel for u in model.units)
    if strategy is Wrapper.HSDP:
        return inside.stats.bytes_sent, across.stats.bytes_sent, size
    sent = inside.stats.bytes_sent
    return (0, sent, size) if right_is_across else (sent, 0, size)


def hsdp_worker(rank: int, world_size: int, settings: HsdpSettings
                ) -> list[RankMeasurement]:
    """Every strategy's :func:`held_bytes` and :func:`step_traffic` on this rank."""
    if world_size != settings.world_size:
        raise ValueError(f"launched on {world_size} ranks, settings say {settings.world_size}.")
    out = []
    for strategy in HSDP_STRATEGIES:
        held = held_bytes(rank, strategy, settings)
        out.append(RankMeasurement(strategy, rank, held,
                                   *step_traffic(rank, world_size, strategy, settings)))
    return out


@dataclass(frozen=True)
class HsdpRow:
    """One strategy over all ranks, with the closed forms."""

    strategy: Wrapper
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
        return {Wrapper.DDP: 1, Wrapper.FSDP: self.settings.world_size,
                Wrapper.HSDP: self.settings.shard_size}[self.strategy]

    @property
    def expected_inside(self) -> float:
        """Closed form of :attr:`inside` (shards that divide evenly). DDP's hierarchical
        all-reduce: every rank reduce-scatters and all-gathers inside its group, 2(g-1)/g·S;
        HSDP: every rank, 3(g-1)/g·S (two all-gathers, one reduce-scatter); FSDP's flat ring
        (3(N-1)/N·S per rank) sends inside from the N - n ranks whose right neighbour
        shares their group."""
        n_ranks, g, n = self.settings.world_size, self.settings.shard_size, self.settings.groups
        if self.strategy is not Wrapper.FSDP:
            return n_ranks * (2 if self.strategy is Wrapper.DDP else 3) * (g - 1) / g * self.size
        boundary = n if n > 1 else 0
        return (n_ranks - boundary) * 3 * (n_ranks - 1) / n_ranks * self.size

    @property
    def expected_across(self) -> float:
        """Closed form of :attr:`across`. DDP and HSDP: every rank all-reduces its S/g over
        the n groups, N·2(n-1)/n·S/g = 2(n-1)·S (the same for both: the all-reduce is the
        same); FSDP's flat ring: the n ranks at the end of a group send everything across,
        n·3(N-1)/N·S."""
        n_ranks, n = self.settings.world_size, self.settings.groups
        if n == 1:
            return 0.0
        if self.strategy is not Wrapper.FSDP:
            return 2 * (n - 1) * self.size
        return n * 3 * (n_ranks - 1) / n_ranks * self.size


def rows_from(settings: HsdpSettings, per_rank: Sequence[Sequence[RankMeasurement]]
              ) -> list[HsdpRow]:
    """Sum the ranks' measurements into one row per strategy."""
    rows = []
    for strategy in HSDP_STRATEGIES:
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
    ddp = next((r.held for r in rows if r.strategy is Wrapper.DDP), None)
    header = ["strategy", "shards", "held per rank (B)", "/ DDP", "inside (B)", "closed form",
              "across (B)", "closed form", "across, max rank (B)"]
    body = [[label(r.strategy), r.shards, r.held, f"{r.held / ddp:.3f}" if ddp else "-",
             r.inside, round(r.expected_inside), r.across, round(r.expected_across),
             r.across_max] for r in rows]
    return format_table(header, body)


# --- step time and bytes across nodes on the emulated topology ---------------------------------


@dataclass(frozen=True)
class HsdpLinkSettings:
    """One step of each strategy on an emulated :class:`labs.Topology` whose nodes are the
    HSDP groups (``node_size = model.shard_size``): ``warmup`` untimed steps, then
    ``model.steps`` timed ones.

    The defaults make bandwidth, not latency, the cost: an MLP of 4 Linear(256, 256) layers
    (S = 1.05 MB of fp32 parameters) on 2 nodes of 2, 50 MB/s inside a node and 5 MB/s
    between nodes (1 ms latency on both); a step takes a few tenths of a second."""

    model: HsdpSettings = HsdpSettings(width=256, layers=4, batch=8, steps=3)
    intra: Link = Link(alpha=1e-3, bandwidth=50e6)
    inter: Link = Link(alpha=1e-3, bandwidth=5e6)
    warmup: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, HsdpSettings):
            raise TypeError(f"model must be an HsdpSettings, got {type(self.model).__name__}.")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"{name} must be a labs.Link, got "
                                f"{type(getattr(self, name)).__name__}; e.g. "
                                f"{name}=Link(alpha=1e-3, bandwidth=5e6).")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (untimed steps), got {self.warmup!r}.")

    @property
    def topology(self) -> Topology:
        """Nodes of ``shard_size`` ranks: HSDP's shard groups are the nodes."""
        return Topology(self.model.shard_size, self.intra, self.inter)


#: The chapter's setting: 4 ranks in 2 nodes of 2, the inter-node link 10x slower.
LINK_SETTINGS = HsdpLinkSettings()


@dataclass(frozen=True)
class StepOnLink:
    """One rank's timed steps of one strategy on the topology."""

    strategy: Wrapper
    rank: int
    seconds: list[float]  #: per timed step, from a barrier to after optimizer.step()
    sent: list[int]  #: per timed step, bytes this rank sent
    across: list[int]  #: per timed step, of ``sent``, the bytes sent to other nodes
    losses: list[float]  #: per timed step, this rank's loss
    compute: list[float] = field(default_factory=list)
    """Per timed step, the seconds of the same step with no message (the unwrapped MLP and
    Adam on this rank's batch): the computation the model adds to the collectives."""


def _unit_numels(settings: HsdpSettings) -> list[int]:
    """Trainable elements of each FSDP unit of the MLP (one per Linear; the root holds
    none), in the order FSDP builds them."""
    net = mlp(settings.step_settings)
    return [sum(p.numel() for p in m.parameters()) for m in net.children()
            if any(True for _ in m.parameters())]


def _sizes(total: int, parts: int) -> list[int]:
    bounds = shard_bounds(total, parts)
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


def expected_across_per_rank(strategy: Wrapper, settings: HsdpSettings) -> list[int]:
    """Exact bytes each rank sends to other nodes in one step (nodes = groups of g
    consecutive ranks, n = N/g of them), fp32, index = global rank:

    * DDP, one hierarchical all-reduce of the P gradients (the all-reduce HSDP's gradient
      path is made of): every rank sends its cross-node ring's traffic on its S/g, about
      2(n-1)/n·S/g (:func:`labs.cost_model.bytes_across_nodes`);
    * FSDP, per unit of padded size P_u (a multiple of N) two all-gathers and a
      reduce-scatter over the flat ring of N: a node's last rank sends 3(N-1)·P_u/N·4 bytes,
      the others none;
    * HSDP, per unit of shard k = P_u/g: the all-reduce across the n nodes among the ranks
      holding that shard, ``2k - d_j - d_(j+1)`` elements (d: the shard cut into n chunks,
      j = r // g), about 2(n-1)/n·S/g on *every* rank; the gathers and reduce-scatters stay
      inside the node."""
    n_ranks, g = settings.world_size, settings.shard_size
    n = n_ranks // g
    numels = _unit_numels(settings)
    if n == 1:
        return [0] * n_ranks
    if strategy is Wrapper.DDP:
        return bytes_across_nodes(TopologyAlgorithm.HIERARCHICAL, sum(numels), 4, n_ranks, g)
    out = [0] * n_ranks
    for numel in numels:
        if strategy is Wrapper.FSDP:
            padded = -(-numel // n_ranks) * n_ranks
            for r in range(g - 1, n_ranks, g):
                out[r] += 3 * (n_ranks - 1) * (padded // n_ranks) * 4
        else:
            shard = -(-numel // g)
            chunks = _sizes(shard, n)
            for r in range(n_ranks):
                j = r // g
                out[r] += (2 * shard - chunks[j] - chunks[(j + 1) % n]) * 4
    return out


def _ring_phase_seconds(size_bytes: float, world_size: int, topology: Topology) -> float:
    """Seconds of one lock-step ring all-gather or reduce-scatter of ``size_bytes`` (the whole
    gathered tensor) over ``world_size`` consecutive ranks on ``topology``: the first N-1 of
    the flat ring all-reduce's steps (:func:`labs.cost_model.ring_step_times`), each a chunk
    of S/N."""
    times = ring_step_times(size_bytes, world_size, topology)
    return max(times[world_size - 2]) if times else 0.0


def model_step_seconds(strategy: Wrapper, settings: HsdpLinkSettings, compute: float = 0.0
                       ) -> float:
    """The model of one step of ``strategy`` on ``settings.topology``: ``compute`` (the step
    without messages, timed) plus every collective it issues, one after another (labs' rings
    block), each priced by the port model from all ranks starting together. N ranks, n nodes
    of g, T_i and T_e the links inside and between nodes, P_u the elements of unit u, S =
    4·sum(P_u):

    * DDP: one hierarchical all-reduce of S,
      ``2(g-1) T_i(S/g) + 2(n-1) T_e(S/(gn))`` (:func:`labs.cost_model.predict_on_topology`);
    * FSDP: per unit, two all-gathers (forward, backward) and a reduce-scatter of its padded
      4·P_u on the flat ring over all N (:func:`_ring_phase_seconds`);
    * HSDP: per unit of shard k_u = ceil(P_u/g), two all-gathers and a reduce-scatter inside
      the node, ``3 (g-1) T_i(4 k_u)``, and the all-reduce of the shard across the n nodes,
      ``2(n-1) T_e(4 k_u/n)``.

    Against DDP, HSDP sends the same bytes between nodes and (g-1)/g·S more inside (the
    backward all-gather), and pays every latency once per unit instead of once per step."""
    model_settings = settings.model
    n_ranks, g = model_settings.world_size, model_settings.shard_size
    n, topology = n_ranks // g, settings.topology
    numels = _unit_numels(model_settings)
    if strategy is Wrapper.DDP:
        return compute + predict_on_topology(TopologyAlgorithm.HIERARCHICAL, 4 * sum(numels),
                                             n_ranks, topology)
    total = compute
    for numel in numels:
        if strategy is Wrapper.FSDP:
            padded = -(-numel // n_ranks) * n_ranks
            total += 3 * _ring_phase_seconds(4 * padded, n_ranks, topology)
        else:
            shard = -(-numel // g)
            total += 3 * (g - 1) * topology.intra.seconds(4 * shard)
            if n > 1:
                total += 2 * (n - 1) * topology.inter.seconds(4 * shard / n)
    return total


def backward_gather_seconds(settings: HsdpLinkSettings) -> float:
    """The model's seconds of HSDP's all-gathers before backward, one per unit inside the
    node, ``sum_u (g-1) T_i(4 k_u)``: the collective HSDP issues that DDP's hierarchical
    all-reduce has no counterpart for. The rest of :func:`model_step_seconds`' difference
    between HSDP and DDP is latencies (HSDP pays them per unit)."""
    g = settings.model.shard_size
    return sum((g - 1) * settings.topology.intra.seconds(4 * -(-numel // g))
               for numel in _unit_numels(settings.model))


def _ddp_step(net: nn.Module, recorder: Recorder, world_size: int,
              groups: HierarchicalGroups) -> None:
    """DDP's gradient synchronisation with labs' lock-step hierarchical all-reduce (every
    message over the link, counted), the all-reduce HSDP's gradient path is made of:
    all-reduce the flattened gradients, divide by N, put them back."""
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    flat = torch.cat([gr.reshape(-1) for gr in grads])  # 1-D float32, P elements
    hierarchical_all_reduce(flat, groups.node_size, recorder=recorder, groups=groups,
                            segment_bytes=None)
    flat /= world_size
    offset = 0
    for gr in grads:
        gr.copy_(flat[offset:offset + gr.numel()].view_as(gr))
        offset += gr.numel()


def hsdp_step_worker(rank: int, world_size: int, settings: HsdpLinkSettings
                     ) -> list[StepOnLink]:
    """Worker (launch it with ``link=settings.topology``): for each strategy, Adam steps of
    the MLP on this rank's batch, every collective labs' ring, counted by a
    ``Recorder(node_size=g)``; per timed step the seconds from a barrier, the bytes sent and
    those sent to other nodes, and the loss."""
    model_settings = settings.model
    if world_size != model_settings.world_size:
        raise ValueError(f"launched on {world_size} ranks, settings say "
                         f"{model_settings.world_size}.")
    g = model_settings.shard_size
    x = batch_of(rank, model_settings)
    groups = HierarchicalGroups.build(g)
    compute = _local_steps(x, settings)
    out = []
    for strategy in HSDP_STRATEGIES:
        recorder = Recorder(node_size=g)
        net = mlp(model_settings.step_settings).to(rank_device())
        model: nn.Module = net
        if strategy is not Wrapper.DDP:  # one recorder for inside and across
            model = FSDP(net, collectives=Algorithm.RING, recorder=recorder,
                         shard_size=g if strategy is Wrapper.HSDP else None)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        seconds, sent, across, losses = [], [], [], []
        for step in range(settings.warmup + model_settings.steps):
            before = (recorder.stats.bytes_sent, recorder.stats.bytes_sent_across_nodes)
            dist.barrier()
            start = time.monotonic()
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            if isinstance(model, FSDP):
                model.finish_gradient_synchronization()
            else:
                _ddp_step(net, recorder, world_size, groups)
            optimizer.step()
            elapsed = time.monotonic() - start
            if step >= settings.warmup:
                seconds.append(elapsed)
                sent.append(recorder.stats.bytes_sent - before[0])
                across.append(recorder.stats.bytes_sent_across_nodes - before[1])
                losses.append(loss.item())
        out.append(StepOnLink(strategy, rank, seconds, sent, across, losses, compute))
    return out


def _local_steps(x: torch.Tensor, settings: HsdpLinkSettings) -> list[float]:
    """Seconds of each timed step of the unwrapped MLP and Adam on this rank, no message
    sent, each from a barrier (all ranks compute at once, as in a real step)."""
    net = mlp(settings.model.step_settings).to(rank_device())
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    seconds = []
    for step in range(settings.warmup + settings.model.steps):
        dist.barrier()
        start = time.monotonic()
        optimizer.zero_grad()
        net(x).square().mean().backward()
        optimizer.step()
        if step >= settings.warmup:
            seconds.append(time.monotonic() - start)
    return seconds


@dataclass(frozen=True)
class HsdpLinkRow:
    """One strategy on the topology, over all ranks."""

    strategy: Wrapper
    seconds: list[float]  #: per timed step, the slowest rank's
    across: list[int]  #: per rank, bytes sent to other nodes in one step (the last one)
    expected_across: list[int]  #: :func:`expected_across_per_rank`
    inside: list[int]  #: per rank, bytes sent inside its node in one step
    losses: list[float]  #: per timed step, the mean loss over ranks
    compute: float = 0.0
    """The step without messages: median over timed steps of the slowest rank's seconds."""
    model: float = 0.0
    """:func:`model_step_seconds` with :attr:`compute`."""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> tuple[float, float]:
        """(fastest, slowest) timed step."""
        return min(self.seconds), max(self.seconds)


def link_rows_from(settings: HsdpLinkSettings, per_rank: Sequence[Sequence[StepOnLink]]
                   ) -> list[HsdpLinkRow]:
    """Combine the ranks' :class:`StepOnLink` into one row per strategy."""
    rows = []
    for strategy in HSDP_STRATEGIES:
        mine = sorted((m for ms in per_rank for m in ms if m.strategy is strategy),
                      key=lambda m: m.rank)
        seconds = [max(t) for t in zip(*(m.seconds for m in mine), strict=True)]
        losses = [statistics.fmean(v) for v in zip(*(m.losses for m in mine), strict=True)]
        local = [max(t) for t in zip(*(m.compute for m in mine), strict=True)]
        compute = statistics.median(local) if local else 0.0
        rows.append(HsdpLinkRow(
            strategy, seconds, [m.across[-1] for m in mine],
            expected_across_per_rank(strategy, settings.model),
            [m.sent[-1] - m.across[-1] for m in mine], losses, compute,
            model_step_seconds(strategy, settings, compute)))
    return rows


def measure_hsdp_on_topology(settings: HsdpLinkSettings = LINK_SETTINGS,
                             timeout: float = 300.0) -> list[HsdpLinkRow]:
    """One launch of ``settings.model.world_size`` ranks on ``settings.topology``: a row per
    strategy."""
    per_rank = launch(hsdp_step_worker, settings.model.world_size, args=(settings,),
                      link=settings.topology, device="cpu", echo=False, timeout=timeout)
    return link_rows_from(settings, per_rank)


#: What each strategy's gradient path runs, for the tables.
COLLECTIVES = {Wrapper.DDP: "hierarchical all-reduce",
               Wrapper.FSDP: "flat ring AG, AG, RS",
               Wrapper.HSDP: "AG, AG, RS inside + all-reduce across"}


def hsdp_link_table(rows: Sequence[HsdpLinkRow]) -> str:
    """Step time (median of the slowest rank, and the range) beside the model
    (:func:`model_step_seconds`, of which the computation), and bytes sent across nodes per
    step (all ranks, the busiest rank), measured beside the closed form."""
    header = ["strategy", "collectives", "step (s)", "range (s)", "model (s)",
              "of which compute", "across, all ranks (B)", "closed form",
              "across, max rank (B)", "inside, all ranks (B)"]
    body = [[label(r.strategy), COLLECTIVES[r.strategy], f"{r.median:.3f}",
             f"{r.spread[0]:.3f}-{r.spread[1]:.3f}", f"{r.model:.3f}", f"{r.compute:.3f}",
             sum(r.across), sum(r.expected_across), max(r.across), sum(r.inside)]
            for r in rows]
    return format_table(header, body)
