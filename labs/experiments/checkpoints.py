"""Chapter 7's sharded checkpoints on real ranks: train :class:`~labs.models.TiedNet` with
:class:`~labs.fsdp.FSDP` on N ranks, save (:func:`labs.checkpoint.save`), resume on W ranks
(:func:`labs.checkpoint.load`), and check what the chapter claims:

* the parameters (frozen ones and the buffer included) and the optimizer state gathered
  after loading are bit-identical to those gathered before saving, whatever W;
* the next step on W ranks (the same global batch split W ways) equals the next step on N
  ranks, up to fp32's order of summation;
* each rank writes its own share, and reads about as much as it will hold.

Then torch's own: ``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load`` with
``get_state_dict``/``set_state_dict``) for a ``fully_shard`` model, saved on N and loaded on
W. Every ``*_worker`` runs inside a rank (run with :func:`labs.launch`); ranks import this
module, so it imports no plotting.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs.checkpoint import (
    INDEX,
    REPLICATED,
    CheckpointIndex,
    inspect,
    load,
    save,
    shard_file_name,
    shard_pieces,
)
from labs.clock import now
from labs.collectives import ring_all_gather
from labs.ddp import broadcast_state
from labs.fsdp import FSDP
from labs.fsdp_torch import apply_fully_shard, full_value, fully_shard_available
from labs.launcher import MAX_WORLD_SIZE, launch, rank_device
from labs.models import TiedNet
from labs.tables import format_table

#: Full tensors by name: a model's parameters and buffers, or ``"<unit>.<key>"`` optimizer state.
State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CheckpointSettings:
    """One save-and-resume experiment: :class:`TiedNet` (an embedding tied to the output
    layer, a frozen layer, a buffer), trained with Adam for ``steps`` steps on
    ``save_world_size`` ranks, saved, then loaded on each of ``load_world_sizes`` ranks for
    one more step. Step s's batch is drawn from ``data_seed + s``; rank r of N takes rows
    ``[r*B/N, (r+1)*B/N)``.

    The defaults make the awkward cases appear: units of 42 and 66 elements, which 4 does not
    divide, and a batch of 12 that splits over 1, 2, 3 and 4 ranks.
    """

    vocab: int = 11
    dim: int = 6
    batch: int = 12  #: sequences in the global batch; must divide by every world size
    seq_len: int = 4
    steps: int = 3  #: Adam steps before saving
    lr: float = 0.05
    seed: int = 0  #: rank r builds its model from seed + r; FSDP broadcasts rank 0's values
    data_seed: int = 123
    save_world_size: int = 4
    load_world_sizes: tuple[int, ...] = (2, 1)

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "batch", "seq_len", "steps", "save_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}; try 0.05.")
        if not isinstance(self.load_world_sizes, tuple) or not self.load_world_sizes:
            raise ValueError("load_world_sizes must be a non-empty tuple of world sizes, e.g. "
                             f"(2, 1); got {self.load_world_sizes!r}.")
        for world_size in (self.save_world_size, *self.load_world_sizes):
            self.check_world_size(world_size)

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size the batch does not split into equal shares."""
        if (isinstance(world_size, bool) or not isinstance(world_size, int)
                or not 1 <= world_size <= MAX_WORLD_SIZE):
            raise ValueError(f"a world size must be an int in 1..{MAX_WORLD_SIZE}, got "
                             f"{world_size!r}.")
        if self.batch % world_size:
            raise ValueError(f"the batch of {self.batch} sequences cannot be split into "
                             f"{world_size} equal shares: pick a batch that divides by every "
                             "world size (CheckpointSettings(batch=12) fits 1, 2, 3 and 4).")

    def tokens(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s global batch: inputs and next-token targets, (batch, seq_len) int64."""
        generator = torch.Generator().manual_seed(self.data_seed + step)
        ids = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    def rank_tokens(self, step: int, rank: int, world_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s equal share of step ``step``'s batch, on its device."""
        share = self.batch // world_size
        x, y = self.tokens(step)
        rows = slice(rank * share, (rank + 1) * share)
        return x[rows].to(rank_device()), y[rows].to(rank_device())

    def model(self, rank: int, fresh: bool = False) -> TiedNet:
        """The model a rank builds: from ``seed + rank``, or (``fresh``, for a run that is
        about to load a checkpoint) from another seed, so that loading must overwrite every
        value, frozen ones and the buffer included."""
        return TiedNet(self.vocab, self.dim, self.seed + rank + (1000 if fresh else 0)).to(
            rank_device())


@dataclass(frozen=True)
class SaveReport:
    """What one rank of the saving run reports."""

    rank: int
    world_size: int
    losses: tuple[float, ...]  #: this rank's loss on its share, per step before saving
    saved: State  #: full parameters and buffers, gathered just before saving
    saved_optimizer: State  #: full optimizer state, gathered just before saving
    continued: State  #: full parameters after one more step on the same ranks
    bytes_written: int  #: bytes of the files this rank wrote
    seconds: float  #: wall time of save() on this rank
    #: tensor bytes of this rank's shards of the parameters and optimizer state, real
    #: elements only (the files hold no padding): the unit of a load's ``bytes_read``
    tensor_bytes_written: int = 0


@dataclass(frozen=True)
class LoadReport:
    """What one rank of a resumed run reports."""

    rank: int
    world_size: int
    saved_world_size: int
    loaded: State  #: full parameters and buffers, gathered just after loading
    loaded_optimizer: State  #: full optimizer state, gathered just after loading
    next_step: State  #: full parameters after the first step of the resumed run
    bytes_read: int  #: tensor bytes this rank copied from shard files
    files_read: int  #: shard files this rank opened
    seconds: float  #: wall time of load() on this rank


def gather_optimizer_state(model: FSDP, optimizer: torch.optim.Optimizer) -> State:
    """The optimizer state of every unit in full (collective: every rank calls it), as
    ``"<unit>.<key>"``: sharded tensors all-gathered, padding dropped; scalars as they are.
    For checking only: it puts the whole state on every rank."""
    state: State = {}
    for unit in model.units:
        for key, value in optimizer.state.get(unit.shard, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == unit.shard.shape:
                value = ring_all_gather(value.detach(), group=model.group)[:unit.numel]
            elif isinstance(value, torch.Tensor):
                value = value.detach()
            else:
                value = torch.tensor(value)
            state[f"{unit.name}.{key}"] = value.clone().cpu()
    return state


def _on_cpu(state: Mapping[str, torch.Tensor]) -> State:
    return {name: tensor.detach().cpu().clone() for name, tensor in state.items()}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               settings: CheckpointSettings, step: int, rank: int, world_size: int) -> float:
    """One Adam step on this rank's share of step ``step``'s batch; returns its loss."""
    x, y = settings.rank_tokens(step, rank, world_size)
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, settings.vocab), y.reshape(-1))
    loss.backward()
    if isinstance(model, FSDP):
        model.finish_gradient_synchronization()
    optimizer.step()
    return loss.item()


def save_worker(rank: int, world_size: int, settings: CheckpointSettings,
                path: str) -> SaveReport:
    """Train ``settings.steps`` steps with FSDP, gather the state, :func:`save` it into the
    directory ``path``, then take one more step (what resuming must reproduce)."""
    model = FSDP(settings.model(rank))
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    losses = tuple(train_step(model, optimizer, settings, step, rank, world_size)
                   for step in range(settings.steps))
    saved = _on_cpu(model.gather_full_params())
    saved_optimizer = gather_optimizer_state(model, optimizer)
    started = now(rank_device())
    save(path, model, optimizer, extra={"step": settings.steps})
    seconds = now(rank_device()) - started
    directory = Path(path)
    mine = [shard_file_name(rank, world_size)] + ([REPLICATED, INDEX] if rank == 0 else [])
    written = sum((directory / name).stat().st_size for name in mine)
    tensor_bytes = 0  # the real elements of each shard and its optimizer state (no padding)
    for unit in model.units:
        k = unit.shard.numel()
        real = max(0, min(k, unit.numel - rank * k))
        sharded = [v for v in optimizer.state.get(unit.shard, {}).values()
                   if isinstance(v, torch.Tensor) and v.shape == unit.shard.shape]
        tensor_bytes += sum(real * t.element_size() for t in [unit.shard, *sharded])
    train_step(model, optimizer, settings, settings.steps, rank, world_size)
    return SaveReport(rank, world_size, losses, saved, saved_optimizer,
                      _on_cpu(model.gather_full_params()), written, seconds, tensor_bytes)


def load_worker(rank: int, world_size: int, settings: CheckpointSettings,
                path: str) -> LoadReport:
    """Build a fresh model (other values everywhere) with FSDP on ``world_size`` ranks,
    :func:`load` the checkpoint, gather the state, take the next step."""
    model = FSDP(settings.model(rank, fresh=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    started = now(rank_device())
    load(path, model, optimizer)
    seconds = now(rank_device()) - started
    index = inspect(path)
    files = {saved_rank for unit in index.units
             for saved_rank, _, _ in shard_pieces(unit.numel, index.world_size, world_size,
                                                  rank)}
    loaded = _on_cpu(model.gather_full_params())
    loaded_optimizer = gather_optimizer_state(model, optimizer)
    step = int(index.extra["step"])
    train_step(model, optimizer, settings, step, rank, world_size)
    return LoadReport(rank, world_size, index.world_size, loaded, loaded_optimizer,
                      _on_cpu(model.gather_full_params()),
                      index.bytes_to_read(world_size, rank), len(files), seconds)


@dataclass(frozen=True)
class ResumeResult:
    """A save on N ranks and loads on each W (:func:`save_and_resume`)."""

    settings: CheckpointSettings
    index: CheckpointIndex
    saves: tuple[SaveReport, ...]  #: per rank of the saving run
    loads: Mapping[int, tuple[LoadReport, ...]]  #: per W, per rank

    def mismatches(self, world_size: int) -> list[str]:
        """Names whose loaded value on W ranks is not bit-identical to the saved one."""
        saved, got = self.saves[0], self.loads[world_size][0]
        return [name for want, have in ((saved.saved, got.loaded),
                                        (saved.saved_optimizer, got.loaded_optimizer))
                for name in sorted(want.keys() | have.keys())
                if name not in want or name not in have or not torch.equal(want[name],
                                                                            have[name])]

    def next_step_difference(self, world_size: int) -> float:
        """Largest |difference| between the parameters after the resumed run's first step on
        W ranks and after the same step on the N ranks that saved."""
        want, have = self.saves[0].continued, self.loads[world_size][0].next_step
        return max((want[n] - have[n]).abs().max().item() for n in want)

    def table(self) -> str:
        """Per run and rank: bytes written or read, files read, seconds, and the checks."""
        header = ["run", "N", "rank", "file bytes written", "tensor bytes written",
                  "tensor bytes read", "shard files read", "seconds", "bit-identical",
                  "next step max |diff|"]
        n = self.settings.save_world_size
        rows: list[list[object]] = [[f"save on {n}", n, r.rank, r.bytes_written,
                                     r.tensor_bytes_written, "", "", round(r.seconds, 4), "",
                                     ""] for r in self.saves]
        for w, reports in self.loads.items():
            same = "yes" if not self.mismatches(w) else "NO"
            diff = self.next_step_difference(w)
            rows += [[f"load on {w}", w, r.rank, "", "", r.bytes_read, r.files_read,
                      round(r.seconds, 4), same, diff] for r in reports]
        return format_table(header, rows)


def save_and_resume(settings: CheckpointSettings, directory: str | Path,
                    timeout: float = 120.0) -> ResumeResult:
    """Save on ``settings.save_world_size`` ranks into ``directory``, check the checkpoint in
    this process (:func:`labs.checkpoint.inspect`), then load it on each of
    ``settings.load_world_sizes`` ranks, one launch each."""
    path = str(directory)
    saves = launch(save_worker, settings.save_world_size, args=(settings, path), echo=False,
                   timeout=timeout)
    index = inspect(path)
    loads = {w: tuple(launch(load_worker, w, args=(settings, path), echo=False,
                             timeout=timeout)) for w in settings.load_world_sizes}
    return ResumeResult(settings, index, tuple(saves), loads)


def resume_on_ranks(settings: CheckpointSettings, directory: str | Path, world_size: int,
                    timeout: float = 120.0) -> list[LoadReport]:
    """Load an existing checkpoint on ``world_size`` ranks (:func:`load_worker`); a missing
    or broken checkpoint, or a batch that does not split, is refused before any process
    starts."""
    settings.check_world_size(world_size)
    inspect(directory)
    return list(launch(load_worker, world_size, args=(settings, str(directory)), echo=False,
                       timeout=timeout))


# --- torch.distributed.checkpoint, side by side --------------------------------------------------


def dcp_available(device_type: str = "cpu") -> tuple[bool, str]:
    """Can this torch run the side by side: ``fully_shard`` on ``device_type``
    (:func:`labs.fsdp_torch.fully_shard_available`) and ``torch.distributed.checkpoint``
    with its ``state_dict`` helpers (torch >= 2.2)? ``(ok, why)``: why says what is missing."""
    ok, why = fully_shard_available(device_type)
    if not ok:
        return ok, why
    try:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: F401
    except ImportError as error:
        return False, (f"skipped: this torch {torch.__version__} has no "
                       f"torch.distributed.checkpoint state_dict helpers ({error})")
    return True, f"torch.distributed.checkpoint with {why}"


@dataclass(frozen=True)
class DcpReport:
    """What one rank of a ``torch.distributed.checkpoint`` run reports."""

    rank: int
    world_size: int
    state: State  #: full parameters and buffers: before saving, or just after loading
    optimizer_state: State  #: full optimizer state, ``"<fqn>.<key>"``, same moment
    bytes_written: int  #: bytes of the files this rank wrote (0 when loading)
    seconds: float  #: wall time of dcp.save (with get_state_dict) or dcp.load (with set)


def _dcp_model(settings: CheckpointSettings, rank: int, world_size: int, fresh: bool
               ) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh

    net = settings.model(rank, fresh)
    broadcast_state(net)  # fully_shard does not broadcast (labs.fsdp_torch)
    apply_fully_shard(net, init_device_mesh(rank_device().type, (world_size,)))
    return net, torch.optim.Adam(net.parameters(), lr=settings.lr)


def _dcp_full(model: nn.Module, optim_state: Mapping[str, Any]) -> tuple[State, State]:
    """Full values (DTensors all-gathered; collective) of the model's state dict and of the
    optimizer state dict that ``get_state_dict`` returned."""
    state = {name: full_value(t).cpu() for name, t in model.state_dict().items()}
    optimizer = {f"{fqn}.{key}": full_value(value).cpu()
                 for fqn, per_param in optim_state["state"].items()
                 for key, value in per_param.items() if isinstance(value, torch.Tensor)}
    return state, optimizer


def dcp_save_worker(rank: int, world_size: int, settings: CheckpointSettings,
                    path: str) -> DcpReport:
    """Train ``settings.steps`` steps with ``fully_shard``, then ``dcp.save`` model and
    optimizer (``get_state_dict``: DTensors, each rank writing its own shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _dcp_model(settings, rank, world_size, fresh=False)
    with warnings.catch_warnings():
        # TiedNet returns views from nn.Linear; it modifies none in place (labs.fsdp_torch)
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        for step in range(settings.steps):
            train_step(model, optimizer, settings, step, rank, world_size)
    started = now(rank_device())
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    seconds = now(rank_device()) - started
    dist.barrier()  # every rank's files are complete before they are measured
    written = sum(f.stat().st_size for f in Path(path).glob(f"__{rank}_*.distcp"))
    if rank == 0:
        written += (Path(path) / ".metadata").stat().st_size
    state, optimizer_state = _dcp_full(model, optim_state)
    return DcpReport(rank, world_size, state, optimizer_state, written, seconds)


def dcp_load_worker(rank: int, world_size: int, settings: CheckpointSettings,
                    path: str) -> DcpReport:
    """A fresh ``fully_shard`` model on ``world_size`` ranks; ``dcp.load`` the checkpoint
    into its state dict (resharded to this mesh) and ``set_state_dict`` it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = _dcp_model(settings, rank, world_size, fresh=True)
    started = now(rank_device())
    # get_state_dict makes the optimizer's state (a step with zero gradients and lr 0), so
    # that dcp.load has tensors of the right layout to load into.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    seconds = now(rank_device()) - started
    _, optim_state = get_state_dict(model, optimizer)
    full, optimizer_state = _dcp_full(model, optim_state)
    return DcpReport(rank, world_size, full, optimizer_state, 0, seconds)


@dataclass(frozen=True)
class DcpResult:
    """A ``torch.distributed.checkpoint`` save on N ranks and load on W (or why skipped)."""

    saves: tuple[DcpReport, ...]
    loads: tuple[DcpReport, ...]
    skipped: str = ""  #: why it did not run, where this torch cannot

    def mismatches(self) -> list[str]:
        """Names whose loaded value is not bit-identical to the saved one."""
        if self.skipped:
            return []
        saved, got = self.saves[0], self.loads[0]
        return [name for want, have in ((saved.state, got.state),
                                        (saved.optimizer_state, got.optimizer_state))
                for name in sorted(want.keys() | have.keys())
                if name not in want or name not in have or not torch.equal(want[name],
                                                                            have[name])]


def dcp_side_by_side(settings: CheckpointSettings, directory: str | Path, load_world_size: int,
                     timeout: float = 180.0) -> DcpResult:
    """``torch.distributed.checkpoint`` for a ``fully_shard`` model: save on
    ``settings.save_world_size`` ranks into ``directory``, load on ``load_world_size``. Where
    this torch cannot, nothing is launched and :attr:`DcpResult.skipped` says why."""
    settings.check_world_size(load_world_size)
    ok, why = dcp_available()
    if not ok:
        return DcpResult((), (), why)
    path = str(directory)
    # gloo: dcp_available asked about fully_shard on the CPU
    saves = launch(dcp_save_worker, settings.save_world_size, args=(settings, path),
                   echo=False, timeout=timeout, backend="gloo")
    loads = launch(dcp_load_worker, load_world_size, args=(settings, path), echo=False,
                   timeout=timeout, backend="gloo")
    return DcpResult(tuple(saves), tuple(loads))
