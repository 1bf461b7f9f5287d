"""Chapter 6, part 3: PyTorch's own FSDP2, ``fully_shard``, beside :class:`labs.fsdp.FSDP`.

``fully_shard`` is ZeRO stage 3 (arXiv 1910.02054) like :mod:`labs.fsdp`, with the same
lifecycle per unit: all-gather before forward, free after, all-gather again before backward,
reduce-scatter the gradient and free after. It differs in how a shard looks:

* :class:`labs.fsdp.FSDP` flattens a unit's parameters into one vector, pads it to a
  multiple of N and gives rank r elements ``[r*k, (r+1)*k)``, ``k = ceil(numel / N)``;
* ``fully_shard`` keeps every parameter as its own ``DTensor`` with placement ``Shard(0)``:
  rank r holds rows ``[r*c, (r+1)*c)`` of dim 0, ``c = ceil(rows / N)`` (``torch.chunk``),
  so the last ranks may hold fewer rows, or none. The storage behind each local shard is
  allocated padded to ``c`` rows on every rank, so the all-gather moves equal chunks.
  Gradients are DTensors of the same layout; Adam's state, made by ``zeros_like`` of a
  DTensor, is *not* padded: a rank whose shard has fewer rows holds less of it.

What ``fully_shard`` does with the awkward parts (``tests/test_fsdp_torch.py`` checks each
against the torch it runs on):

* **Initialisation.** It does not broadcast: each rank keeps *its own* rows of *its own*
  initial values, so ranks built from different seeds silently train a stitched model.
  :func:`compare_worker` broadcasts parameters and buffers from rank 0 first
  (:func:`labs.ddp.broadcast_state`), as :class:`labs.fsdp.FSDP` and DDP do.
* **Tied weights** (an embedding tied to the output layer). Wrapping the two modules in two
  ``fully_shard`` calls is refused at the first forward ("Parameter 'head.weight' is shared
  with a parameter already managed by another FSDP group") and torch suggests one call on
  both, ``fully_shard([embed, head])``. Here, as in labs.fsdp, a unit that shares a trainable
  parameter with another unit (or with the root) is not wrapped on its own and the root's
  ``fully_shard`` manages the parameter (:func:`fully_shard_units`); one DTensor then serves
  both attributes, it is all-gathered once and its gradient is the sum of both uses.
* **A frozen parameter** is sharded like the others (a ``Shard(0)`` DTensor with
  ``requires_grad=False``), all-gathered for forward, and gets no gradient and no
  reduce-scatter. labs.fsdp keeps frozen parameters whole on every rank instead.
* **A buffer** is left alone: not sharded, not broadcast, not kept in sync; it stays a plain
  tensor on every rank (moved to the mesh's device).
* **numel not divisible by N**: see the rows above. For ``nn.Linear(6, 6)`` at N = 4, ranks
  0-2 hold 2 rows of the weight and rank 3 holds a ``(0, 6)`` shard whose storage still has
  2 rows (48 bytes). Gradients of one ``fully_shard`` group share one padded flat buffer.

On gloo, ``fully_shard``'s reduce-scatter is ``reduce_scatter_tensor``, which ProcessGroupGloo
emulates with an all-reduce and a chunk: twice the traffic of a real reduce-scatter. The ring of
:mod:`labs.collectives` moves what the formulas say.

Whether this torch can run it: :func:`fully_shard_available` answers, with what is missing
(README's "Another torch" lists the versions).

What is counted as memory (:class:`HeldBytes`): the bytes of the tensor storages a rank holds
after each optimizer step, as :mod:`labs.memory` counts them (each storage once, at its
size); for a DTensor, the storage of its local shard. ``peak`` is the most storage bytes held
at once during the step, read after every operator by a
:class:`labs.memory.AllocationTracker`: shards, gathered parameters, activations, gradients,
optimizer state and temporaries, but not the batch itself nor what gloo allocates inside a
collective. With asynchronous collectives the peak can differ between runs: gloo completes
them on its own thread, so whether a collective's input (for ``fully_shard`` at N = 4, the
224-byte unsharded gradient of a unit) is still alive at a given operator depends on timing.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from labs.ddp import broadcast_state
from labs.fsdp import FSDP, default_units
from labs.launcher import launch, rank_device
from labs.memory import (
    AllocationTracker,
    MemorySnapshot,
    MemoryTimeline,
    is_dtensor,
    local_tensor,
)
from labs.models import TiedNet
from labs.tables import format_table
from labs.wrappers import Wrapper

#: The first torch with ``fully_shard`` at all (as torch.distributed._composable.fsdp).
FULLY_SHARD_MIN_TORCH = (2, 4)
#: The first torch whose ``fully_shard`` runs on the CPU (device-generic streams).
FULLY_SHARD_CPU_MIN_TORCH = (2, 7)
#: Where ``fully_shard`` lives, newest first.
_FULLY_SHARD_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


#: What the comparison calls each run: by the code that holds the model.
_LABELS = {Wrapper.LOCAL: "one process, full batch", Wrapper.FSDP: "labs.fsdp.FSDP",
           Wrapper.FULLY_SHARD: "torch fully_shard (FSDP2)"}


def label(wrapper: Wrapper) -> str:
    """The comparison's name for a run: ``Wrapper.LOCAL`` is the reference (one process, the
    whole batch), ``Wrapper.FSDP`` the course's ZeRO-3 (one flat fp32 shard per unit),
    ``Wrapper.FULLY_SHARD`` PyTorch's (every parameter a DTensor sharded on dim 0)."""
    return _LABELS[wrapper]


class FullyShardUnavailable(RuntimeError):
    """This torch cannot run ``fully_shard`` on this device; the message says what is needed."""


# --- which torch has it -------------------------------------------------------------------------


def _major_minor(version: str) -> tuple[int, int]:
    """``"2.6.0+cpu"`` -> ``(2, 6)``; a nightly ``"2.6.0.dev20241201"`` counts as 2.6."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _find_fully_shard() -> tuple[Callable[..., Any] | None, str]:
    """``fully_shard`` and the name of the module it came from, or None and the names tried."""
    for module in _FULLY_SHARD_MODULES:
        try:
            found = getattr(__import__(module, fromlist=["fully_shard"]), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return found, module
    return None, " or ".join(_FULLY_SHARD_MODULES)


def fully_shard_available(device_type: str = "cpu", *, version: str | None = None
                          ) -> tuple[bool, str]:
    """Can this torch run ``fully_shard`` on ``device_type`` ("cpu" under gloo, "cuda")?

    Returns ``(True, "fully_shard from <module> (torch X)")`` or ``(False, "skipped: ...
    needs torch >= X ...")``, for a notebook to print and for tests to skip with. ``version``
    asks about another torch (``"2.5.1"``) by its version alone; by default the answer is
    about this one, whose ``fully_shard`` is imported to be sure (about a second, in a
    process that has not imported ``torch.distributed.tensor`` yet).
    """
    have = str(torch.__version__) if version is None else version
    if _major_minor(have) < FULLY_SHARD_MIN_TORCH:
        needed = ".".join(map(str, FULLY_SHARD_MIN_TORCH))
        return False, f"skipped: fully_shard needs torch >= {needed} (this is torch {have})"
    if device_type == "cpu" and _major_minor(have) < FULLY_SHARD_CPU_MIN_TORCH:
        needed = ".".join(map(str, FULLY_SHARD_CPU_MIN_TORCH))
        return False, (f"skipped: fully_shard on the CPU (gloo) needs torch >= {needed}; torch "
                       f"{have} fails in its first forward on the CPU (2.4 and 2.5: 'FSDP "
                       "requires CUDA for streams'; 2.6: 'Stream' object has no attribute "
                       "'record_event')")
    if version is not None:
        where = _FULLY_SHARD_MODULES[0 if _major_minor(have) >= (2, 6) else 1]
        return True, f"fully_shard from {where} (torch {have})"
    if not dist.is_available():
        return False, "skipped: this torch build has no torch.distributed"
    found, where = _find_fully_shard()
    if found is None:
        return False, f"skipped: this torch {have} has no {where}.fully_shard"
    return True, f"fully_shard from {where} (torch {have})"


def load_fully_shard(device_type: str = "cpu") -> Callable[..., Any]:
    """``fully_shard`` from wherever this torch keeps it; :class:`FullyShardUnavailable`
    (with :func:`fully_shard_available`'s message) where it cannot run on ``device_type``."""
    ok, message = fully_shard_available(device_type)
    if not ok:
        raise FullyShardUnavailable(message)
    found, _ = _find_fully_shard()
    assert found is not None
    return found


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor: DTensors are all-gathered (``full_tensor()``, a collective:
    every rank must call it, in the same order).

    Copied even after ``full_tensor()``: on a one-rank mesh it returns the local shard itself,
    so a value kept from step k would change with the optimizer's next in-place update."""
    if is_dtensor(tensor):
        tensor = tensor.detach().full_tensor()
    return tensor.detach().clone()


# --- the experiment -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CompareSettings:
    """One comparison: the model of :class:`TiedNet`, a fixed batch of token ids split into
    equal shares (rank r gets rows ``[r*B/N, (r+1)*B/N)``), ``steps`` Adam steps.

    The defaults make every awkward case appear at N = 2 and 4: 11 x 6 embedding rows, a
    6 x 6 hidden layer and 42-element units, none divisible by 4.
    """

    vocab: int = 11
    dim: int = 6
    batch: int = 8  #: sequences in the whole batch; must divide by the world size
    seq_len: int = 4
    steps: int = 3
    lr: float = 0.05
    seed: int = 0  #: rank r builds its model from seed + r; rank 0's values are broadcast
    data_seed: int = 123
    wrappers: tuple[Wrapper, ...] = (Wrapper.FSDP, Wrapper.FULLY_SHARD)

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "batch", "seq_len", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if any(w not in (Wrapper.FSDP, Wrapper.FULLY_SHARD) for w in self.wrappers):
            raise ValueError("wrappers must be Wrapper.FSDP and/or Wrapper.FULLY_SHARD (the "
                             f"reference runs in reference_run), got {self.wrappers!r}")

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size the batch does not split into equal shares."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if self.batch % world_size:
            raise ValueError(f"the batch of {self.batch} sequences cannot be split into "
                             f"{world_size} equal shares; pick a batch that divides by it "
                             f"(CompareSettings(batch=...))")

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch: inputs and next-token targets, each (batch, seq_len) int64."""
        generator = torch.Generator().manual_seed(self.data_seed)
        ids = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class HeldBytes:
    """Bytes of tensor storage one rank holds after an optimizer step (each storage once;
    a DTensor's local shard, padding included), and the step's peak."""

    parameters: int  #: shards of the trainable parameters, and frozen ones (whole or sharded)
    gradients: int
    optimizer_state: int  #: Adam's exp_avg and exp_avg_sq, and its 4-byte ``step`` tensors
    buffers: int
    peak: int  #: most storage bytes held at once during the step, read after every operator


@dataclass(frozen=True)
class RunResult:
    """One rank's run of one wrapper (:func:`label` names it)."""

    wrapper: Wrapper
    rank: int
    world_size: int
    units: tuple[str, ...]  #: what was sharded as a unit ("root" last); () for the reference
    states: tuple[dict[str, torch.Tensor], ...]  #: per step, every full parameter and buffer
    losses: tuple[float, ...]  #: per step, this rank's loss on its share of the batch
    held: tuple[HeldBytes, ...]  #: per step
    snapshots: tuple[MemorySnapshot, ...] = ()  #: per step, the tensors behind ``held``


@dataclass(frozen=True)
class RankReport:
    """What :func:`compare_worker` returns from one rank."""

    rank: int
    world_size: int
    runs: dict[Wrapper, RunResult]
    skipped: dict[Wrapper, str] = field(default_factory=dict)  #: why a wrapper did not run


def fully_shard_units(module: nn.Module) -> list[nn.Module]:
    """The units to ``fully_shard`` one by one before the root: :func:`labs.fsdp.default_units`
    less every unit that shares a trainable parameter with another unit or with the root's own
    modules (``fully_shard`` refuses a parameter in two groups; the root takes it, as the root
    unit does in labs.fsdp). Such a unit's other parameters go to the root too."""
    units = default_units(module)
    unit_of = {id(m): i for i, unit in enumerate(units) for m in unit.modules()}
    holders: dict[int, set[int | None]] = {}
    for mod in module.modules():
        for param in mod.parameters(recurse=False):
            if param.requires_grad:
                holders.setdefault(id(param), set()).add(unit_of.get(id(mod)))
    shared = {i for held in holders.values() if len(held) > 1 for i in held}
    return [unit for i, unit in enumerate(units) if i not in shared]


def apply_fully_shard(module: nn.Module, mesh: DeviceMesh) -> tuple[str, ...]:
    """``fully_shard`` every unit of :func:`fully_shard_units`, then the root (which takes
    every parameter left). Returns the unit names, "root" last. Does not broadcast: call
    :func:`labs.ddp.broadcast_state` first when ranks may differ."""
    fully_shard = load_fully_shard(mesh.device_type)
    names = {id(m): name for name, m in module.named_modules()}
    units = fully_shard_units(module)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return (*(names[id(u)] for u in units), "root")


# --- measuring memory ---------------------------------------------------------------------------


def _named_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]
                 ) -> dict[str, torch.Tensor]:
    return {f"{names[id(p)]}.{key}": local_tensor(value).detach()
            for p, state in optimizer.state.items() for key, value in state.items()
            if isinstance(value, torch.Tensor)}


def _record(timeline: MemoryTimeline, step: int, model: nn.Module,
            optimizer: torch.optim.Optimizer, peak: int) -> tuple[MemorySnapshot, HeldBytes]:
    """Snapshot what the rank holds now, by group. Detached local tensors: a DTensor counts
    as its shard, and a parameter's ``.grad`` goes to the gradients group, not parameters."""
    params = dict(model.named_parameters())
    snap = timeline.record(
        f"after step {step}",
        parameters={n: local_tensor(p).detach() for n, p in params.items()},
        gradients={n: local_tensor(p.grad).detach() for n, p in params.items()
                   if p.grad is not None},
        optimizer_state=_named_state(optimizer, {id(p): n for n, p in params.items()}),
        buffers={n: local_tensor(b).detach() for n, b in model.named_buffers()},
    )
    groups = snap.bytes_by_group()
    return snap, HeldBytes(
        parameters=groups.get("parameters", 0), gradients=groups.get("gradients", 0),
        optimizer_state=groups.get("optimizer_state", 0), buffers=groups.get("buffers", 0),
        peak=peak)


def _full_state(model: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` in full, by its state_dict name (a tied
    parameter under each name, gathered once)."""
    if isinstance(model, FSDP):
        return model.gather_full_params()
    gathered: dict[int, torch.Tensor] = {}
    state = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in gathered:
            gathered[id(tensor)] = full_value(tensor)
        state[name] = gathered[id(tensor)]
    return state


def _train(wrapper: Wrapper, model: nn.Module, module: nn.Module, units: tuple[str, ...],
           x: torch.Tensor, y: torch.Tensor, settings: CompareSettings, rank: int,
           world_size: int) -> RunResult:
    """Adam steps on (x, y); after each, the full state, the loss and the bytes held."""
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    timeline = MemoryTimeline(rank)
    # What the rank holds at the start (the batch aside), then all that the step makes.
    peak = AllocationTracker()
    peak.track([*model.parameters(), *model.buffers()])
    if isinstance(model, FSDP):  # the full vectors: empty now, regrown by every unshard
        peak.track(unit.full for unit in model.units)
    states, losses, held, snapshots = [], [], [], []
    for step in range(settings.steps):
        with peak:
            peak.reset_peak()
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, settings.vocab), y.reshape(-1))
            loss.backward()
            if isinstance(model, FSDP):
                model.finish_gradient_synchronization()
            optimizer.step()
            del logits
        snap, bytes_held = _record(timeline, step, model, optimizer, peak.peak_bytes)
        states.append(_full_state(model, module))
        losses.append(loss.item())
        held.append(bytes_held)
        snapshots.append(snap)
    return RunResult(wrapper, rank, world_size, units, tuple(states), tuple(losses),
                     tuple(held), tuple(snapshots))


def reference_run(settings: CompareSettings = CompareSettings()) -> RunResult:
    """The oracle, in the calling process: the whole model (rank 0's seed) trained on the
    whole batch, measured the same way as the ranks."""
    net = TiedNet(settings.vocab, settings.dim, settings.seed)
    x, y = settings.tokens()
    return _train(Wrapper.LOCAL, net, net, (), x, y, settings, rank=0, world_size=1)


def compare_on_ranks(world_size: int, settings: CompareSettings = CompareSettings(),
                     timeout: float = 120.0) -> list[RankReport]:
    """:func:`compare_worker` on ``world_size`` real ranks, one report per rank; a batch that
    does not split into equal shares is refused before any process starts."""
    settings.check_world_size(world_size)
    return list(launch(compare_worker, world_size, args=(settings,), echo=False,
                       timeout=timeout))


def compare_worker(rank: int, world_size: int,
                   settings: CompareSettings = CompareSettings()) -> RankReport:
    """Worker (run it with :func:`labs.launch`): train :class:`TiedNet` with each of
    ``settings.wrappers`` on this rank's equal share of the batch, from the same start.

    Every rank builds its model from ``seed + rank`` (so they differ), then rank 0's values
    are broadcast: by ``FSDP`` itself, and by :func:`labs.ddp.broadcast_state` before
    ``fully_shard``, which does not broadcast. Where ``fully_shard`` cannot run on this torch
    and device, it is skipped and ``RankReport.skipped`` says why.
    """
    settings.check_world_size(world_size)  # under torchrun nothing checked it before
    device = rank_device()
    x, y = settings.tokens()
    share = settings.batch // world_size
    x, y = (t[rank * share:(rank + 1) * share].to(device) for t in (x, y))
    runs: dict[Wrapper, RunResult] = {}
    skipped: dict[Wrapper, str] = {}
    for wrapper in settings.wrappers:
        net = TiedNet(settings.vocab, settings.dim, settings.seed + rank).to(device)
        if wrapper is Wrapper.FSDP:
            model = FSDP(net)
            units = tuple(unit.name for unit in model.units)
        else:
            ok, why = fully_shard_available(device.type)
            if not ok:
                skipped[wrapper] = why
                continue
            broadcast_state(net)
            mesh = init_device_mesh(device.type, (world_size,))
            units = apply_fully_shard(net, mesh)
            model = net
        with warnings.catch_warnings():
            # fully_shard warns when a unit returns a view (nn.Linear on 3-D input does):
            # an in-place op on it would skip the pre-backward all-gather. TiedNet does none.
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            runs[wrapper] = _train(wrapper, model, net, units, x, y, settings, rank,
                                    world_size)
    return RankReport(rank, world_size, runs, skipped)


# --- reading the results ------------------------------------------------------------------------


def max_abs_difference(run: RunResult, reference: RunResult) -> tuple[float, ...]:
    """Per step, the largest |difference| between ``run``'s full state and the reference's."""
    return tuple(max((got[name] - want[name]).abs().max().item() for name in want)
                 for got, want in zip(run.states, reference.states, strict=True))


def held_table(reference: RunResult, reports: Mapping[int, Sequence[RankReport]],
               ranks: Sequence[int] = (0,)) -> str:
    """Bytes held after the last step: the reference, then per world size and rank each
    wrapper; ``reports`` maps a world size to the per-rank reports of one launch."""
    header = ["N", "rank", "wrapper", "parameters", "gradients", "optimizer state",
              "buffers", "peak during step"]

    def row(n: int, rank: int, run: RunResult) -> list[object]:
        h = run.held[-1]
        return [n, rank, label(run.wrapper), h.parameters, h.gradients, h.optimizer_state,
                h.buffers, h.peak]

    rows = [row(1, 0, reference)]
    skipped: dict[str, str] = {}
    for n, per_rank in sorted(reports.items()):
        for rank in ranks:
            if rank < len(per_rank):
                rows += [row(n, rank, run) for run in per_rank[rank].runs.values()]
                skipped.update((label(s), why) for s, why in per_rank[rank].skipped.items())
    notes = [f"{name}: {why}" for name, why in skipped.items()]
    return "\n".join([format_table(header, rows), *notes])
