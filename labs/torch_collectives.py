"""torch.distributed's conventions, which every collective of :mod:`labs.collectives` follows,
and torch's own collectives called under them (``Algorithm.TORCH``, the baseline).

The conventions: a tensor is cut into N chunks as ``torch.tensor_split`` cuts it
(:func:`shard_bounds`: the first ``numel % N`` chunks one element longer, so any numel works);
``op`` is ``ReduceOp.SUM`` or ``ReduceOp.AVG`` (:func:`check_tensor_and_op`); an all-reduce
works in place, on a flat contiguous view of the tensor (:func:`in_place`), and AVG is the SUM
divided by N at the end (:func:`finish`).

torch's own collectives (:func:`torch_all_reduce`, :func:`torch_reduce_scatter`,
:func:`torch_all_gather`) take any numel too: where the chunks are uneven they go through a
zero-padded copy cut into N equal chunks, since ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` need equal ones. The layering: :mod:`labs.p2p` (the point-to-point
calls) -> :mod:`labs.ring_schedule` (how a ring pass runs) -> this module ->
:mod:`labs.collectives` (the algorithms).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from labs import staging
from labs.p2p import Peers, backend_for_device
from labs.ring_schedule import RingBuffers

# --- chunking -------------------------------------------------------------------------------


def shard_bounds(numel: int, world_size: int) -> list[int]:
    """The N+1 offsets that cut ``numel`` elements into N chunks, as ``torch.tensor_split``
    does: chunk i is ``[bounds[i], bounds[i+1])`` and the first ``numel % N`` chunks hold one
    element more than the rest."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    base, extra = divmod(numel, world_size)
    bounds = [0]
    for i in range(world_size):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


# --- the op, and working in place -------------------------------------------------------------


def is_avg(op: ReduceOp) -> bool:
    """Whether ``op`` (SUM or AVG, as :func:`check_tensor_and_op` lets through) is AVG. By
    identity first: ``==`` on torch's ReduceOp values is a pybind11 call, over ten times
    slower, and on the ring's hot path every microsecond before the first send counts."""
    return op is ReduceOp.AVG or (op is not ReduceOp.SUM and op == ReduceOp.AVG)


def is_supported_op(op: object) -> bool:
    """SUM or AVG, given as torch spells them: ``ReduceOp.SUM`` (a ``ReduceOp.RedOpType``) or
    a ``ReduceOp`` object made from one, ``ReduceOp(ReduceOp.SUM)``, which torch's own
    collectives accept too. Not the plain integers the enum compares equal to. The ``ReduceOp``
    object goes on the left of ``==``: ``ReduceOp.SUM == ReduceOp(ReduceOp.SUM)`` is False."""
    if op is ReduceOp.SUM or op is ReduceOp.AVG:
        return True
    return isinstance(op, (ReduceOp, ReduceOp.RedOpType)) and (
        op == ReduceOp.SUM or op == ReduceOp.AVG)


def check_tensor_and_op(tensor: torch.Tensor, op: ReduceOp) -> None:
    """Refuse what no collective here reduces: a non-tensor, an op other than SUM or AVG, an
    AVG of integers."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not is_supported_op(op):
        raise ValueError(f"op must be ReduceOp.SUM or ReduceOp.AVG, got {op!r}")
    if is_avg(op) and not tensor.is_floating_point():
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")


def in_place(tensor: torch.Tensor, body: Callable[[torch.Tensor], None],
             buffers: RingBuffers | None = None) -> torch.Tensor:
    """Run ``body`` on a flat contiguous view of ``tensor`` (through a copy if need be: kept in
    ``buffers``, when given, so that a kept ring pass finds the same memory next call)."""
    if tensor.is_contiguous():
        body(tensor.view(-1))
    else:
        flat = tensor.contiguous().view(-1) if buffers is None else buffers.stage(tensor)
        body(flat)
        tensor.copy_(flat.view_as(tensor))
    return tensor


def finish(tensor: torch.Tensor, op: ReduceOp, world_size: int) -> torch.Tensor:
    """The SUM over ``world_size`` ranks in ``tensor`` made the AVG when ``op`` asks for it."""
    if world_size > 1 and is_avg(op):
        tensor.div_(world_size)
    return tensor


# --- torch's own collectives ------------------------------------------------------------------


def sum_then_divide(op: ReduceOp, peers: Peers, tensor: torch.Tensor) -> bool:
    """Whether torch's built-in is asked for a SUM that is then divided by N, instead of AVG:
    on gloo. gloo in torch 2.4 refuses AVG ("Cannot use ReduceOp.AVG with Gloo"); later
    releases accept it and compute that SUM and division (bit for bit the same on torch 2.13,
    ``tests/test_collectives.py``), except torch 2.8's reduce-scatter, which ignores AVG and
    returns the SUM. So the two steps here change nothing where gloo averages right and give
    the mean where it does not. NCCL averages natively."""
    return is_avg(op) and backend_for_device(peers.backend, tensor.device.type) == "gloo"


def builtin_reduce_scatter(
    out: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup | None
) -> None:
    """torch.distributed's own reduce-scatter of ``tensor`` (numel = N x ``out``'s) into ``out``.

    torch 2.13 renamed ``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old name
    warns on every call); torch 2.4 has only the old one."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if staging.needed(tensor, str(dist.get_backend(group))):
        staging.staged(fn, out, tensor, op=op, group=group)
    else:
        fn(out, tensor, op=op, group=group)


def builtin_all_gather(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None) -> None:
    """torch.distributed's own all-gather of equal ``shard``s into ``out`` (``all_gather_single``
    on torch 2.13, ``all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if staging.needed(shard, str(dist.get_backend(group))):
        staging.staged(fn, out, shard, group=group)
    else:
        fn(out, shard, group=group)


def torch_all_reduce(tensor: torch.Tensor, op: ReduceOp, peers: Peers) -> torch.Tensor:
    """``dist.all_reduce`` of ``tensor`` in place over ``peers.group`` (``op`` checked by the
    caller); AVG as a SUM then a division where :func:`sum_then_divide` says so."""
    group = peers.group
    if sum_then_divide(op, peers, tensor):
        def body(flat: torch.Tensor) -> None:
            dist.all_reduce(flat, op=ReduceOp.SUM, group=group)
            finish(flat, op, peers.size)

        return in_place(tensor, body)
    return in_place(tensor, lambda flat: dist.all_reduce(flat, op=op, group=group))


def torch_reduce_scatter(tensor: torch.Tensor, op: ReduceOp, peers: Peers) -> torch.Tensor:
    """Chunk r (:func:`shard_bounds`) of the reduction of the flattened ``tensor`` over
    ``peers.group``, a new 1-D tensor, by torch's reduce-scatter (on a zero-padded copy when
    numel does not divide by N); ``op`` checked by the caller."""
    group = peers.group
    n, r = peers.size, peers.rank
    wire_op = ReduceOp.SUM if sum_then_divide(op, peers, tensor) else op
    flat = tensor.detach().reshape(-1)
    bounds = shard_bounds(flat.numel(), n)
    longest = bounds[1] - bounds[0]
    out = torch.empty(longest, dtype=flat.dtype, device=flat.device)
    if longest * n == flat.numel():  # even chunks: no padded copy
        builtin_reduce_scatter(out, flat.contiguous(), wire_op, group)
    else:
        padded = torch.zeros(longest * n, dtype=flat.dtype, device=flat.device)
        for i in range(n):  # chunk i at i*longest, so torch's even split matches ours
            padded[i * longest: i * longest + bounds[i + 1] - bounds[i]] = (
                flat[bounds[i]:bounds[i + 1]])
        builtin_reduce_scatter(out, padded, wire_op, group)
        out = out[: bounds[r + 1] - bounds[r]].clone()
    return finish(out, op, n) if wire_op is not op else out


def torch_all_gather(shard: torch.Tensor, peers: Peers, numel: int | None = None
                     ) -> torch.Tensor:
    """Every rank's ``shard`` of ``peers.group`` concatenated in rank order, a new 1-D tensor
    of ``numel`` elements (None: N x this shard's), by torch's all-gather (through padded
    shards when they are uneven). Rank i must hold chunk i of :func:`shard_bounds`."""
    group = peers.group
    n = peers.size
    flat = shard.detach().reshape(-1)
    total = flat.numel() * n if numel is None else numel
    bounds = shard_bounds(total, n)
    expected = bounds[peers.rank + 1] - bounds[peers.rank]
    if flat.numel() != expected:  # the same refusal as ring_all_gather's
        raise ValueError(
            f"rank {peers.rank}: shard has {flat.numel()} elements but chunk {peers.rank} of "
            f"{total} over {n} ranks has {expected} (shard_bounds)."
        )
    longest = bounds[1] - bounds[0]
    if longest * n == total:  # even shards: gather straight into the result
        out = torch.empty(total, dtype=flat.dtype, device=flat.device)
        builtin_all_gather(out, flat.contiguous(), group)
        return out
    padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    gathered = torch.empty(longest * n, dtype=flat.dtype, device=flat.device)
    builtin_all_gather(gathered, padded, group)
    return torch.cat([gathered[i * longest: i * longest + bounds[i + 1] - bounds[i]]
                      for i in range(n)])
