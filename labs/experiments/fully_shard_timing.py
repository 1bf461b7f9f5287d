"""Chapter 7: labs' FSDP beside torch's ``fully_shard`` on gloo's own transport, timed.

The emulated link prices labs' ring; ``fully_shard`` calls torch's collectives, which the link
does not touch. So the two are set side by side on what gloo itself does between two
processes on this machine, with the model of :mod:`labs.experiments.fsdp_overlap` (equal
blocks, one unit each) and these settings (:data:`TRANSPORT_SETTINGS`):

* ``labs.fsdp.FSDP`` with torch's asynchronous collectives, ``prefetch`` 0 and 1 (1 is its
  default there), ``reshard_after_forward=True``;
* ``fully_shard`` on every block and on the root, as its documentation writes it, with its
  defaults: ``reshard_after_forward=None`` (True for the blocks; False for the root on torch
  >= 2.6, which holds no parameter here), and its implicit prefetching: in backward it issues
  the next block's all-gather (in reverse forward order) before this block's backward; in
  forward it prefetches nothing explicitly and counts on the CPU running ahead of the GPU,
  which issues the next all-gather while the GPU still computes. On the CPU, compute runs in
  the calling thread: there is no running ahead, and the forward all-gathers are not
  overlapped unless asked for;
* ``fully_shard`` with ``set_modules_to_forward_prefetch`` (each block prefetches the next in
  forward: what labs' prefetch 1 does);
* ``fully_shard`` with ``reshard_after_forward=False``.

Beside them, on the same ranks in the same launch: the step with no communication (each
rank trains the whole model alone, same shapes) and the step's collectives with no compute
(the all-gathers and reduce-scatters one step issues at prefetch 0, one after another, torch's
collectives on the same group). If the transport ran beside compute for free, a step would
take max(compute, collectives); if not at all, their sum. The measured step says where this
machine is between the two.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from labs.experiments.fsdp_overlap import Block, OverlapSettings, train_step
from labs.fsdp import FSDP
from labs.fsdp_collectives import all_gather_into, reduce_scatter_from
from labs.fsdp_torch import fully_shard_available, load_fully_shard
from labs.launcher import launch

LABS_PREFETCH_0 = "labs FSDP, prefetch 0"
LABS_PREFETCH_1 = "labs FSDP, prefetch 1 (its default)"
FULLY_SHARD_DEFAULT = "fully_shard, defaults"
FULLY_SHARD_FORWARD_PREFETCH = "fully_shard, + forward prefetch 1"
FULLY_SHARD_KEEP = "fully_shard, reshard_after_forward=False"
#: Every setting :func:`measure_transport` runs, in the table's order.
TRANSPORT_SETTINGS = (LABS_PREFETCH_0, LABS_PREFETCH_1, FULLY_SHARD_DEFAULT,
                      FULLY_SHARD_FORWARD_PREFETCH, FULLY_SHARD_KEEP)
COMPUTE_ALONE = "compute alone (no communication)"
LABS_COLLECTIVES = "labs' collectives alone (no compute)"
FULLY_SHARD_COLLECTIVES = "fully_shard's collectives alone (no compute)"
#: What runs beside the settings: no communication, then no compute.
ALONE = (COMPUTE_ALONE, LABS_COLLECTIVES, FULLY_SHARD_COLLECTIVES)

#: The chapter's shapes, on gloo's transport instead of the emulated link.
TRANSPORT = OverlapSettings(tokens=256, steps=5)


@dataclass(frozen=True)
class TransportRow:
    """One setting: each timed step, the slower rank's (seconds)."""

    name: str
    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _timed(config: OverlapSettings, step: Callable[[], None]) -> list[float]:
    """One untimed step, then ``config.steps`` timed ones, a barrier before each."""
    step()
    seconds = []
    for _ in range(config.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return seconds


def _blocks(config: OverlapSettings) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(config.width) for _ in range(config.units)))


def _sharded(config: OverlapSettings, name: str) -> nn.Module:
    """The blocks wrapped as ``name`` says."""
    net = _blocks(config)
    if name in (LABS_PREFETCH_0, LABS_PREFETCH_1):
        return FSDP(net, prefetch=0 if name == LABS_PREFETCH_0 else 1)
    fully_shard = load_fully_shard("cpu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    keep = {"reshard_after_forward": False} if name == FULLY_SHARD_KEEP else {}
    for block in net:
        fully_shard(block, mesh=mesh, **keep)
    fully_shard(net, mesh=mesh, **keep)
    if name == FULLY_SHARD_FORWARD_PREFETCH:
        for block, following in zip(net[:-1], net[1:], strict=True):
            block.set_modules_to_forward_prefetch([following])
    return net


def _collectives_step(config: OverlapSettings, fully_shards: bool) -> Callable[[], None]:
    """What one step at prefetch 0 sends, with no compute: per block two all-gathers (forward,
    backward) and one reduce-scatter, each waited for before the next. ``fully_shards``:
    torch's ``reduce_scatter_tensor``, which gloo runs as an all-reduce and a chunk; else
    labs' (:func:`labs.fsdp_collectives.reduce_scatter_from`: one all-to-all and a sum)."""
    n = dist.get_world_size()
    full = torch.empty(config.unit_bytes // 4)
    shard = torch.empty(full.numel() // n)

    def reduce() -> None:
        if fully_shards:
            dist.reduce_scatter_tensor(shard, full)
        else:
            reduction = reduce_scatter_from(full, n, None)
            reduction.work.wait()  # not land(): it frees the input, used again next call
            reduction.received.view(reduction.pieces, -1).sum(0)

    def step() -> None:
        for _ in range(config.units):
            all_gather_into(full, shard, None).wait()
        for _ in range(config.units):
            all_gather_into(full, shard, None).wait()
            reduce()
    return step


def transport_worker(rank: int, world_size: int, config: OverlapSettings,
                     names: Sequence[str]) -> dict[str, list[float]]:
    """Every setting in ``names``, then compute alone and the collectives alone: each one's
    timed steps on this rank."""
    torch.manual_seed(rank)
    x = torch.randn(config.tokens, config.width)
    out = {}
    for name in names:
        model = _sharded(config, name)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        if isinstance(model, FSDP):
            out[name] = _timed(config, lambda m=model, o=optimizer: train_step(m, o, x))
        else:
            out[name] = _timed(config, lambda m=model, o=optimizer: _plain_step(m, o, x))
    alone = _blocks(config)
    optimizer = torch.optim.SGD(alone.parameters(), lr=1e-3)
    out[COMPUTE_ALONE] = _timed(config, lambda: _plain_step(alone, optimizer, x))
    out[LABS_COLLECTIVES] = _timed(config, _collectives_step(config, fully_shards=False))
    out[FULLY_SHARD_COLLECTIVES] = _timed(config, _collectives_step(config, fully_shards=True))
    return out


def _plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_transport(config: OverlapSettings = TRANSPORT,
                      names: Sequence[str] = TRANSPORT_SETTINGS, timeout: float = 300.0
                      ) -> list[TransportRow]:
    """Run every setting on ``config.world_size`` ranks over gloo (no link), then compute
    alone and the collectives alone. The ``fully_shard`` settings are left out, with what is
    missing printed, on a torch whose ``fully_shard`` cannot run on the CPU."""
    unknown = [n for n in names if n not in TRANSPORT_SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; choose from {list(TRANSPORT_SETTINGS)}.")
    ok, why = fully_shard_available("cpu")
    if not ok:
        print(why)
        names = [n for n in names if not n.startswith("fully_shard")]
    per_rank = launch(transport_worker, config.world_size, args=(config, list(names)),
                      backend="gloo", device="cpu", timeout=timeout, echo=False)
    rows = []
    for name in [*names, *ALONE]:
        steps = zip(*(r[name] for r in per_rank), strict=True)
        rows.append(TransportRow(name, tuple(max(s) for s in steps)))
    return rows
