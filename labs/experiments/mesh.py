"""Chapter 8, parts 3 and 5: process groups and 2-D meshes, and tensor parallelism inside a
node, on real ranks.

**Meshes.** 8 ranks in 4 nodes of 2 are laid out as a mesh of shape (4, 2): rank
``r = 2i + j`` sits at row i (its node) and column j (its place in the node). Each mesh
dimension cuts the ranks into groups: along "shard" (dim 1) the ranks of one node,
{2i, 2i+1}; along "replicate" (dim 0) the ranks with the same place in their node,
{j, j+2, j+4, j+6}. :func:`mesh_worker` builds these groups twice, by hand with
``dist.new_group`` and with torch's ``init_device_mesh``, finds which global ranks each group
joins by all-gathering every member's rank over it (so a group is shown by what it connects,
not by what it was asked for), and places a DTensor with placements
``(Replicate(), Shard(0))`` on the mesh: copies along "replicate", rows split along "shard".

**Tensor parallelism.** :func:`tp_worker` splits chapter 8's transformer MLP over the ranks
(:class:`labs.tensor_parallel.ParallelMLP`) and compares its output and every gradient with
the unsplit MLP in one process, and counts its all-reduces and their bytes.

Workers run inside ranks; this module imports no plotting (:mod:`labs.viz.mesh` draws).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from labs.collectives import Algorithm
from labs.grid import GridLayout, ProcessGrid
from labs.launcher import MAX_WORLD_SIZE, launch, rank_device
from labs.tables import format_table
from labs.tensor_parallel import ParallelMLP, Pass, all_reduce_bytes

# --- meshes -------------------------------------------------------------------------------------

#: Where DTensor and its placements live, newest first (torch.distributed._tensor in 2.4).
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def _dtensor_api() -> tuple[Callable[..., Any], type, type] | None:
    """``(distribute_tensor, Replicate, Shard)`` from this torch, or None."""
    for module in _DTENSOR_MODULES:
        try:
            found = __import__(module, fromlist=["distribute_tensor", "Replicate", "Shard"])
        except ImportError:
            continue
        names = ("distribute_tensor", "Replicate", "Shard")
        if all(hasattr(found, name) for name in names):
            return found.distribute_tensor, found.Replicate, found.Shard
    return None


def device_mesh_available() -> tuple[bool, str]:
    """Can this torch build a named 2-D ``DeviceMesh`` and a DTensor on it?

    Returns ``(True, "init_device_mesh and DTensor (torch X)")`` or ``(False, "skipped: ...")``
    for a notebook to print and for tests to skip with."""
    have = str(torch.__version__)
    try:
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        return False, (f"skipped: this torch ({have}) has no torch.distributed.device_mesh."
                       "init_device_mesh; install torch >= 2.4 (see README) to build meshes.")
    if "mesh_dim_names" not in inspect.signature(init_device_mesh).parameters:
        return False, f"skipped: init_device_mesh of torch {have} takes no mesh_dim_names."
    if _dtensor_api() is None:
        return False, f"skipped: no DTensor in torch {have} (tried {', '.join(_DTENSOR_MODULES)})."
    return True, f"init_device_mesh and DTensor (torch {have})"


@dataclass(frozen=True)
class MeshSettings:
    """A 2-D mesh of ``shape[0] x shape[1]`` ranks: ``shape[0]`` nodes of ``shape[1]`` ranks,
    rank ``r = i * shape[1] + j`` at row i, column j (torch's layout, ``arange().view``), and
    a DTensor of ``rows x cols`` float32 values ``0, 1, 2, ...`` placed on it."""

    shape: tuple[int, int] = (4, 2)
    dim_names: tuple[str, str] = ("replicate", "shard")
    rows: int = 5  #: rows of the DTensor; 5 does not split evenly over 2 ranks (3 + 2)
    cols: int = 3

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or any(not isinstance(s, int) or s < 1 for s in self.shape):
            raise ValueError(f"shape must be two positive ints (nodes, ranks per node), got "
                             f"{self.shape!r}.")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"shape {self.shape} needs {self.world_size} ranks; launch allows "
                             f"at most {MAX_WORLD_SIZE}: pick a smaller mesh.")
        if (len(self.dim_names) != 2 or len(set(self.dim_names)) != 2
                or not all(isinstance(n, str) and n for n in self.dim_names)):
            raise ValueError(f"dim_names must be two different non-empty names, one per mesh "
                             f"dimension, e.g. ('replicate', 'shard'); got {self.dim_names!r}.")
        if self.rows < 1 or self.cols < 1:
            raise ValueError(f"the DTensor needs at least one row and one column, got "
                             f"{self.rows} x {self.cols}.")

    @property
    def world_size(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def layout(self) -> GridLayout:
        """The mesh as a :class:`labs.grid.GridLayout`: dims ``dim_names`` of sizes ``shape``."""
        return GridLayout(self.dim_names, self.shape)

    def coordinate(self, rank: int) -> tuple[int, int]:
        """(row, column) of ``rank`` on the mesh: its node and its place in the node."""
        row, column = self.layout.coordinate(rank)
        return row, column

    def groups(self, dim: int) -> list[tuple[int, ...]]:
        """The groups of global ranks along mesh dimension ``dim``: ranks that differ only in
        their coordinate on ``dim``. Dim 1: the rows, {i*s, ..., i*s + s-1}; dim 0: the
        columns, {j, j+s, j+2s, ...} (s = shape[1])."""
        if dim not in (0, 1):
            raise ValueError(f"a 2-D mesh has dims 0 and 1, got {dim}")
        return self.layout.groups(self.dim_names[dim])

    def full_tensor(self) -> torch.Tensor:
        """The DTensor's global value: (rows, cols) float32, ``0, 1, 2, ...`` row by row."""
        return torch.arange(self.rows * self.cols, dtype=torch.float32).view(self.rows, self.cols)


@dataclass(frozen=True)
class DTensorShard:
    """What one rank holds of the DTensor ``(Replicate(), Shard(0))``."""

    placements: str  #: as torch prints them
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    local: torch.Tensor  #: this rank's local tensor (a copy)
    full_matches: bool  #: ``full_tensor()`` (an all-gather) gave back the global value

    @property
    def rows_held(self) -> tuple[int, ...]:
        """Which global rows this rank holds (the values are 0, 1, 2, ... row by row)."""
        cols = self.global_shape[1]
        return tuple(int(v) // cols for v in self.local[:, 0].tolist())


@dataclass(frozen=True)
class MeshReport:
    """One rank's view of the mesh, built both ways."""

    rank: int
    coordinate: tuple[int, int]  #: (node, place in the node), from the layout
    new_group: dict[str, tuple[int, ...]]  #: dim name -> global ranks of its group (measured)
    device_mesh: dict[str, tuple[int, ...]] | None  #: the same from init_device_mesh, or None
    mesh_coordinate: tuple[int, ...] | None  #: ``DeviceMesh.get_coordinate()``
    dtensor: DTensorShard | None
    skipped: str | None  #: why the torch half did not run, where it did not


def members(group: ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks ``group`` connects, in group-rank order, found by all-gathering every
    member's global rank over it: a collective, so a wrong group shows here."""
    size = dist.get_world_size(group)
    # on the rank's device: nccl carries nothing else
    mine = torch.tensor([dist.get_rank()], dtype=torch.int64, device=rank_device())
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    return tuple(int(t) for t in gathered)


def new_group_mesh(settings: MeshSettings) -> dict[str, ProcessGroup]:
    """This rank's group along each mesh dim, built with ``dist.new_group`` by
    :class:`labs.grid.ProcessGrid`: every rank creates every group, in the same order
    (new_group is collective over the whole world), and keeps the one it belongs to."""
    grid = ProcessGrid.build(settings.layout)
    return {name: grid[name] for name in settings.dim_names}


def mesh_worker(rank: int, world_size: int, settings: MeshSettings) -> MeshReport:
    """Build the mesh's groups with ``new_group`` and with ``init_device_mesh``, all-gather
    each group's members over it, and place ``settings.full_tensor()`` on the mesh as a
    DTensor ``(Replicate(), Shard(0))``. Collective over all ``settings.world_size`` ranks."""
    if world_size != settings.world_size:
        raise ValueError(f"a mesh of shape {settings.shape} needs {settings.world_size} ranks, "
                         f"this launch has {world_size}.")
    by_hand = {name: members(group) for name, group in new_group_mesh(settings).items()}
    available, why = device_mesh_available()
    if not available:
        return MeshReport(rank, settings.coordinate(rank), by_hand, None, None, None, why)
    from torch.distributed.device_mesh import init_device_mesh

    api = _dtensor_api()
    assert api is not None  # device_mesh_available checked it
    distribute_tensor, replicate, shard = api
    mesh = init_device_mesh("cpu", settings.shape, mesh_dim_names=settings.dim_names)
    by_torch = {name: members(mesh.get_group(name)) for name in settings.dim_names}
    coordinate = mesh.get_coordinate()
    full = settings.full_tensor()  # (rows, cols), the same on every rank
    placed = distribute_tensor(full, mesh, [replicate(), shard(0)])
    local = placed.to_local().clone()  # (rows on this shard, cols)
    gathered = placed.full_tensor()
    view = DTensorShard(str(tuple(placed.placements)), tuple(placed.shape), tuple(local.shape),
                        local, bool(torch.equal(gathered, full)))
    return MeshReport(rank, settings.coordinate(rank), by_hand, by_torch,
                      tuple(coordinate) if coordinate is not None else None, view, None)


def run_mesh(settings: MeshSettings = MeshSettings(), *, timeout: float = 120.0
             ) -> list[MeshReport]:
    """:func:`mesh_worker` on ``settings.world_size`` ranks (gloo, CPU)."""
    return list(launch(mesh_worker, settings.world_size, args=(settings,), backend="gloo",
                       device="cpu", echo=False, timeout=timeout))


def measured_groups(reports: Sequence[MeshReport], name: str, *, torch_mesh: bool = False
                    ) -> list[tuple[int, ...]]:
    """The distinct groups along dim ``name`` that the ranks measured (by ``new_group``, or by
    ``init_device_mesh`` when ``torch_mesh``), in the order of their lowest rank."""
    seen: dict[tuple[int, ...], None] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        source = report.device_mesh if torch_mesh else report.new_group
        if source is not None:
            seen.setdefault(source[name], None)
    return list(seen)


def groups_agree(reports: Sequence[MeshReport], settings: MeshSettings) -> bool:
    """Whether every rank found, along every dim, the same group by ``new_group`` as by
    ``init_device_mesh``, and the group the layout says (False where the mesh half was
    skipped: nothing to agree with)."""
    for report in reports:
        if report.device_mesh is None:
            return False
        for dim, name in enumerate(settings.dim_names):
            expected = next(g for g in settings.groups(dim) if report.rank in g)
            if not report.new_group[name] == report.device_mesh[name] == expected:
                return False
    return True


def group_table(reports: Sequence[MeshReport], settings: MeshSettings = MeshSettings()) -> str:
    """One row per group along each mesh dim: the ranks it joins by ``new_group`` and by
    ``init_device_mesh``, and whether they agree."""
    rows = []
    for dim, name in enumerate(settings.dim_names):
        torch_groups = measured_groups(reports, name, torch_mesh=True)
        for k, group in enumerate(measured_groups(reports, name)):
            theirs = torch_groups[k] if k < len(torch_groups) else None
            rows.append([f"{dim} ({name})", k, _ranks(group),
                         _ranks(theirs) if theirs is not None else "skipped",
                         "yes" if theirs == group else "NO"])
    return format_table(["mesh dim", "group", "ranks by new_group", "ranks by init_device_mesh",
                         "agree"], rows)


def dtensor_table(reports: Sequence[MeshReport]) -> str:
    """What each rank holds of the DTensor: its mesh coordinate, local shape, the global rows
    and the values."""
    rows = []
    for r in sorted(reports, key=lambda r: r.rank):
        if r.dtensor is None:
            rows.append([r.rank, str(r.coordinate), "-", "-", r.skipped or "-"])
            continue
        values = "; ".join(" ".join(f"{v:g}" for v in row) for row in r.dtensor.local.tolist())
        rows.append([r.rank, str(r.mesh_coordinate), str(r.dtensor.local_shape),
                     _ranks(r.dtensor.rows_held), values or "-"])
    return format_table(["rank", "mesh coordinate", "local shape", "rows held", "values"], rows)


def _ranks(ranks: Sequence[int]) -> str:
    return "{" + ", ".join(map(str, ranks)) + "}"


# --- tensor parallelism -------------------------------------------------------------------------


@dataclass(frozen=True)
class TPSettings:
    """One transformer MLP, ``Linear(D, H) -> GELU -> Linear(H, D)`` (H = 4D by default, as
    :class:`labs.train.Block`), one batch of B x T x D inputs and a squared-error loss."""

    d_model: int = 8
    hidden: int | None = None  #: H; None: 4 x d_model
    batch: int = 2
    seq_len: int = 3
    seed: int = 0
    algorithm: Algorithm = Algorithm.RING  #: whose all-reduce: labs' ring counts its bytes
    frozen_first_bias: bool = False  #: freeze mlp[0].bias: its slices get no gradient
    #: ranks per TP group: consecutive ranks {k t, ..., k t + t-1}, a node of a mesh
    #: ("dp", "tp") of shape (N / t, t); None: all the ranks form one group
    tp_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("d_model", "batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.hidden is not None and self.hidden < 1:
            raise ValueError(f"hidden must be at least 1 (or None for 4 x d_model), got "
                             f"{self.hidden}.")
        if self.tp_size is not None and self.tp_size < 1:
            raise ValueError(f"tp_size must be at least 1 (or None for all ranks), got "
                             f"{self.tp_size}.")
        if not isinstance(self.algorithm, Algorithm):
            raise TypeError(f"algorithm must be a labs.collectives.Algorithm, got "
                            f"{self.algorithm!r}.")

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size that ``tp_size`` does not divide (before any rank starts)."""
        if self.tp_size is not None and (world_size < 1 or world_size % self.tp_size):
            raise ValueError(f"tp_size {self.tp_size} must divide the world size "
                             f"{world_size}: TP groups are whole nodes of tp_size ranks.")

    def mesh(self, world_size: int) -> MeshSettings:
        """The ("dp", "tp") mesh of ``world_size`` ranks whose "tp" groups run the MLP."""
        self.check_world_size(world_size)
        tp = world_size if self.tp_size is None else self.tp_size
        return MeshSettings(shape=(world_size // tp, tp), dim_names=("dp", "tp"))

    @property
    def hidden_features(self) -> int:
        return 4 * self.d_model if self.hidden is None else self.hidden

    def mlp(self) -> nn.Sequential:
        """The full MLP, drawn from ``seed`` (the same on every rank)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            mlp = nn.Sequential(nn.Linear(self.d_model, self.hidden_features), nn.GELU(),
                                nn.Linear(self.hidden_features, self.d_model))
        if self.frozen_first_bias:
            mlp[0].bias.requires_grad_(False)
        return mlp

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Input x and target, both (B, T, D) float32, the same on every rank."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.batch, self.seq_len, self.d_model)
        return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def tp_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The experiment's loss: mean squared error, so every output element gets a gradient."""
    return ((y - target) ** 2).mean()


@dataclass(frozen=True)
class TPResult:
    """A forward and backward of the MLP: its output, the input's gradient, and the
    gradients of the parameters (None for a frozen one), by name."""

    output: torch.Tensor  #: (B, T, D)
    input_grad: torch.Tensor  #: (B, T, D)
    grads: dict[str, torch.Tensor | None]


def reference(settings: TPSettings) -> TPResult:
    """The unsplit MLP in one process: the oracle. Parameters named as ``nn.Sequential``
    names them (``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``)."""
    mlp = settings.mlp()
    x, target = settings.data()
    x.requires_grad_(True)
    y = mlp(x)
    tp_loss(y, target).backward()
    assert x.grad is not None
    return TPResult(y.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()})


#: ParallelMLP's parameter -> (the full MLP's parameter, the dim its slice is cut along, or
#: None where the rank holds it whole).
SLICES: dict[str, tuple[str, int | None]] = {
    "fc.weight": ("0.weight", 0), "fc.bias": ("0.bias", 0),
    "proj.weight": ("2.weight", 1), "proj.bias": ("2.bias", None),
}


def rank_slice(full: torch.Tensor, name: str, features: slice) -> torch.Tensor:
    """The part of the full MLP's tensor that ParallelMLP's parameter ``name`` holds on the
    rank that holds hidden ``features``."""
    dim = SLICES[name][1]
    if dim is None:
        return full
    return full[features] if dim == 0 else full[:, features]


def tp_errors(result: TPResult, features: slice, settings: TPSettings) -> tuple[float, float]:
    """How far one rank's :class:`TPResult` (gradients named as :class:`ParallelMLP` names
    them) is from :func:`reference`: max |output error| and max |gradient error| over the
    input and this rank's slice of every parameter. A parameter frozen in one and not the
    other counts as an infinite error."""
    want = reference(settings)
    errors = [float((result.input_grad - want.input_grad).abs().max())]
    for name, grad in result.grads.items():
        full = want.grads[SLICES[name][0]]
        if (grad is None) != (full is None):
            errors.append(math.inf)
        elif grad is not None and full is not None:
            errors.append(float((grad - rank_slice(full, name, features)).abs().max()))
    return float((result.output - want.output).abs().max()), max(errors)


@dataclass(frozen=True)
class TPReport:
    """One rank's forward and backward of :class:`ParallelMLP`, against the unsplit MLP."""

    rank: int
    world_size: int
    tp_group: tuple[int, ...]  #: the global ranks of this rank's TP group (t of them)
    features: tuple[int, int]  #: the hidden features [start, stop) this rank holds
    result: TPResult  #: this rank's output, input gradient, and gradients of its slices
    forward_all_reduces: int
    backward_all_reduces: int
    payload_bytes: int  #: S: bytes of one all-reduced activation, B x T x D x e
    bytes_sent: dict[Pass, int | None]  #: what this rank sent per pass (None: torch's own)
    max_output_error: float  #: max |output - the unsplit MLP's|
    max_grad_error: float  #: max over the input and every parameter of |grad - reference|

    @property
    def closed_form_bytes(self) -> float:
        """2(t-1)/t x S, what each rank sends per all-reduce (ring), t = its TP group's size."""
        return all_reduce_bytes(self.payload_bytes, len(self.tp_group), 1)


def tp_worker(rank: int, world_size: int, settings: TPSettings) -> TPReport:
    """Split ``settings.mlp()`` over the ranks (:class:`ParallelMLP`), run one forward and
    backward on the whole batch, and compare with :func:`reference` (run here too). With
    ``settings.tp_size`` the MLP is split inside each group of ``tp_size`` consecutive ranks
    (every group computes the same thing: there is no data parallelism here to differ)."""
    mesh = settings.mesh(world_size)
    group = None if mesh.shape[0] == 1 else new_group_mesh(mesh)["tp"]
    device = rank_device()
    model = ParallelMLP(settings.mlp().to(device), group, algorithm=settings.algorithm)
    x, target = (t.to(device) for t in settings.data())
    x.requires_grad_(True)
    y = model(x)
    tp_loss(y, target).backward()
    assert x.grad is not None
    # on the CPU, beside the reference computed there
    result = TPResult(y.detach().cpu(), x.grad.cpu(),
                      {n: None if p.grad is None else p.grad.cpu()
                       for n, p in model.named_parameters()})
    output_error, grad_error = tp_errors(result, model.features, settings)
    log = model.log
    return TPReport(
        rank, world_size, members(group), (model.features.start, model.features.stop),
        result, log.count(Pass.FORWARD), log.count(Pass.BACKWARD),
        log.records[0].payload_bytes, {p: log.bytes_sent(p) for p in Pass},
        output_error, grad_error)


def run_tp(settings: TPSettings = TPSettings(), world_size: int = 2, *,
           timeout: float = 60.0) -> list[TPReport]:
    """:func:`tp_worker` on ``world_size`` ranks."""
    settings.check_world_size(world_size)
    return list(launch(tp_worker, world_size, args=(settings,), echo=False, timeout=timeout))


def tp_table(reports: Sequence[TPReport]) -> str:
    """Per rank: the hidden features it holds, its errors against the unsplit MLP, and its
    all-reduces per pass with the bytes it sent beside the closed form 2(t-1)/t x S."""
    rows = [[r.rank, _ranks(r.tp_group), f"{r.features[0]}:{r.features[1]}",
             f"{r.max_output_error:.1e}",
             f"{r.max_grad_error:.1e}", r.forward_all_reduces, r.backward_all_reduces,
             r.payload_bytes, _or_dash(r.bytes_sent[Pass.FORWARD]),
             _or_dash(r.bytes_sent[Pass.BACKWARD]),
             f"{r.closed_form_bytes:g}"] for r in reports]
    return format_table(["rank", "TP group", "hidden features", "max |out err|", "max |grad err|",
                         "all-reduces fwd", "bwd", "S (bytes)", "sent fwd", "sent bwd",
                         "2(t-1)/t x S"], rows)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)
