"""Chapter 8, part 5: tensor parallelism of a transformer MLP, Megatron style, from scratch.

Data parallelism (chapters 5-7) splits the *batch* and keeps, or gathers, whole layers.
Tensor parallelism (TP; Shoeybi et al., "Megatron-LM", arXiv:1909.08053) splits the *layers*:
each of t ranks holds a slice of every weight matrix of the MLP and computes a slice of its
output, on the same full batch. For ``mlp(x) = gelu(x A) B`` with ``A`` of shape (D, H)
and ``B`` of shape (H, D) (H = 4D in a transformer):

* ``A`` is split by its *columns* (output features): rank i holds ``A_i`` (D, H_i), and
  ``gelu(x A_i)`` is exactly the slice i of ``gelu(x A)``: GELU acts element by element, so
  no communication is needed between the two layers (:class:`ColumnParallelLinear`);
* ``B`` is split by its *rows* (input features): rank i holds ``B_i`` (H_i, D), and
  ``x A B = sum_i gelu(x A_i) B_i``: each rank holds one term of the sum, and one all-reduce
  adds them up (:class:`RowParallelLinear`); the bias of ``B`` is added once, after it.

Two autograd functions carry the communication (the paper's ``f`` and ``g``):
:class:`CopyToTensorParallel` (``f``: identity forward, all-reduce backward) in front of the
column-parallel layer and :class:`ReduceFromTensorParallel` (``g``: all-reduce forward,
identity backward) after the row-parallel one. So :class:`ParallelMLP` costs **one all-reduce
in forward and one in backward**, each of an activation of B x T x D elements.

Cost per rank for t ranks, batch B, sequence T, model width D, e bytes per element:

* each all-reduce sends 2(t-1)/t x B x T x D x e bytes (ring), two per MLP per step;
* each rank holds 1/t of the MLP's weights (2DH/t + H/t, plus the D of B's bias, kept whole)
  and 1/t of the hidden activation (B x T x H/t), but the whole input and output (B x T x D).

Where TP sits in a mesh: **inside a node**. Its all-reduces carry activations, not
gradients: they sit on the critical path of every forward and backward (the next layer needs
the sum before it can start, so nothing overlaps them), twice per MLP and twice per attention
block per step, and their size grows with the batch, not with the model. Data parallelism's
gradient all-reduce happens once per step and overlaps the backward. So the mesh puts TP on
its innermost dimension, among the GPUs of one node joined by the fast link (NVLink), and
data parallelism (or HSDP's replicate dimension) across nodes: for 8 GPUs in 4 nodes of 2, a
mesh of shape (4, 2), dim names ("replicate", "shard") or, for TP, ("dp", "tp"), where the
"tp" groups are ranks {2i, 2i+1} (a :class:`labs.grid.GridLayout`;
:mod:`labs.experiments.mesh` builds and draws them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from labs.collectives import Algorithm, Recorder, all_reduce, shard_bounds

__all__ = [
    "AllReduceRecord",
    "ColumnParallelLinear",
    "CommLog",
    "CopyToTensorParallel",
    "ParallelMLP",
    "Pass",
    "ReduceFromTensorParallel",
    "RowParallelLinear",
    "all_reduce_bytes",
    "copy_to_tensor_parallel",
    "feature_slice",
    "reduce_from_tensor_parallel",
]

#: The elementwise activations :class:`ParallelMLP` accepts between its two linears: acting on
#: each element alone is what lets each rank apply it to its own slice of the hidden features.
ELEMENTWISE_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Identity)


class Pass(enum.Enum):
    """Which half of a step an all-reduce of TP belongs to."""

    FORWARD = "forward"  #: ``g``'s all-reduce: the sum of the row-parallel partial outputs
    BACKWARD = "backward"  #: ``f``'s all-reduce: the sum of the partial input gradients


@dataclass(frozen=True)
class AllReduceRecord:
    """One all-reduce of TP, as one rank saw it."""

    pass_: Pass
    shape: tuple[int, ...]  #: the activation (or its gradient) all-reduced: (B, T, D)
    payload_bytes: int  #: S = numel x element size of that tensor
    bytes_sent: int | None  #: what this rank sent (labs' collectives; None for torch's own)


@dataclass
class CommLog:
    """The all-reduces one :class:`ParallelMLP` (or one parallel linear) ran, in order.

    Owned by the module that writes it; :meth:`clear` between steps to count one step."""

    records: list[AllReduceRecord] = field(default_factory=list)

    def count(self, pass_: Pass) -> int:
        """How many all-reduces ran in ``pass_``."""
        return sum(1 for r in self.records if r.pass_ is pass_)

    def bytes_sent(self, pass_: Pass | None = None) -> int | None:
        """Bytes this rank sent in ``pass_`` (both when None), as labs' Recorder counted them;
        None when one of those all-reduces was torch's own, which no Recorder sees."""
        sent = [r.bytes_sent for r in self.records if pass_ in (None, r.pass_)]
        return None if None in sent else sum(s for s in sent if s is not None)

    def clear(self) -> None:
        self.records.clear()


def all_reduce_bytes(numel: int, world_size: int, element_size: int) -> float:
    """The ring's closed form: each of t ranks sends 2(t-1)/t x S bytes, S = numel x e.

    Exact per rank when t divides numel; otherwise rank r sends 2S minus its two chunks
    r and r+1 (:func:`labs.collectives.shard_bounds`), and the ranks' mean is still exact."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return 2 * (world_size - 1) / world_size * numel * element_size


def _group_rank_size(group: ProcessGroup | None) -> tuple[int, int]:
    """This rank's place in ``group``; one process alone when torch.distributed is not
    initialised (a notebook cell trying the module outside a launch)."""
    if not dist.is_initialized():
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not "
                               "initialised: build the module inside a worker run by "
                               "labs.launch.")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def feature_slice(features: int, group: ProcessGroup | None = None) -> slice:
    """The features this rank of ``group`` holds when ``features`` are split over its ranks:
    chunk r of :func:`labs.collectives.shard_bounds` (the first ``features % t`` ranks hold
    one more), so any size splits, as ``torch.tensor_split`` cuts."""
    rank, size = _group_rank_size(group)
    bounds = shard_bounds(features, size)
    return slice(bounds[rank], bounds[rank + 1])


def _all_reduce(tensor: torch.Tensor, pass_: Pass, group: ProcessGroup | None,
                algorithm: Algorithm, log: CommLog | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` into a new tensor (the input is left alone: autograd may
    have saved it) and append what it cost to ``log``."""
    out = tensor.detach().contiguous().clone()  # same shape as tensor: (..., D)
    if not dist.is_initialized():  # one process alone: the sum over one rank
        size, recorder = 1, None
    else:
        size = dist.get_world_size(group)
        recorder = Recorder() if log is not None and algorithm is not Algorithm.TORCH else None
        if size > 1:
            all_reduce(out, ReduceOp.SUM, group, algorithm=algorithm, recorder=recorder)
    if log is not None:
        sent = recorder.stats.bytes_sent if recorder is not None else (
            0 if size == 1 else None)
        log.records.append(AllReduceRecord(pass_, tuple(out.shape),
                                           out.numel() * out.element_size(), sent))
    return out


class CopyToTensorParallel(torch.autograd.Function):
    """The paper's ``f``: identity in forward, all-reduce (sum) of the gradient in backward.

    Every rank feeds the *same* input x (B, T, D) to its slice of a column-parallel layer, so
    x is copied t times, once per rank: y_i = x A_i. The loss depends on x through every copy,
    so by the chain rule its gradient is the sum of the copies' gradients,
    dL/dx = sum_i dL/dy_i A_i^T, and each rank knows only its own term: the backward of a
    copy is a sum, here an all-reduce. Cost: one all-reduce of B x T x D x e bytes, each rank
    sending 2(t-1)/t of it (ring).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None,
                algorithm: Algorithm, log: CommLog | None) -> torch.Tensor:
        ctx.group, ctx.algorithm, ctx.log = group, algorithm, log
        return x.view_as(x)  # a new autograd node over the same storage, no copy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_reduce(grad, Pass.BACKWARD, ctx.group, ctx.algorithm, ctx.log), None, None, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """The paper's ``g``: all-reduce (sum) in forward, identity in backward.

    Rank i holds one term of the row-parallel product, z_i = h_i B_i, and the output is their
    sum z = sum_i z_i. The gradient of a sum with respect to each term is the gradient of the
    sum itself, dL/dz_i = dL/dz, which every rank already holds whole after the all-reduce:
    so backward passes it through untouched. Cost: one all-reduce of B x T x D x e bytes,
    each rank sending 2(t-1)/t of it (ring).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None,
                algorithm: Algorithm, log: CommLog | None) -> torch.Tensor:
        return _all_reduce(x, Pass.FORWARD, group, algorithm, log)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None, None


def copy_to_tensor_parallel(x: torch.Tensor, group: ProcessGroup | None = None, *,
                            algorithm: Algorithm = Algorithm.RING,
                            log: CommLog | None = None) -> torch.Tensor:
    """``f(x)``: x unchanged; its gradient is all-reduced over ``group`` in backward."""
    return CopyToTensorParallel.apply(x, group, algorithm, log)


def reduce_from_tensor_parallel(x: torch.Tensor, group: ProcessGroup | None = None, *,
                                algorithm: Algorithm = Algorithm.RING,
                                log: CommLog | None = None) -> torch.Tensor:
    """``g(x)``: the sum of x over ``group`` (a new tensor); the gradient passes unchanged."""
    return ReduceFromTensorParallel.apply(x, group, algorithm, log)


def _slice_parameter(full: torch.Tensor | None, rows: slice | None, cols: slice | None
                     ) -> nn.Parameter | None:
    """A new parameter holding ``full[rows, cols]`` (its own storage, 1/t of the bytes), with
    ``full``'s requires_grad, so a frozen weight stays frozen."""
    if full is None:
        return None
    part = full.detach()
    if rows is not None:
        part = part[rows]
    if cols is not None:
        part = part[:, cols]
    return nn.Parameter(part.clone(), requires_grad=full.requires_grad)


def _check_linear(linear: object, what: str) -> nn.Linear:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{what} must be an nn.Linear, got {type(linear).__name__}.")
    return linear


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` split by output features: ``y_i = f(x) A_i^T + b_i``.

    Built from a full ``linear`` (the same on every rank: same seed, or a broadcast), this
    rank keeps rows ``feature_slice(out_features)`` of its weight (out, in) and of its bias.
    Input: the whole x (..., in), the same on every rank. Output: this rank's slice of the
    output features (..., out_i); nothing is gathered, the next layer takes the slice as it
    is. Cost: no communication in forward; ``f``'s all-reduce of the input's gradient
    (numel(x) x e, 2(t-1)/t of it sent per rank) in backward. Holds 1/t of the weight.
    """

    def __init__(self, linear: nn.Linear, group: ProcessGroup | None = None, *,
                 algorithm: Algorithm = Algorithm.RING, log: CommLog | None = None) -> None:
        super().__init__()
        linear = _check_linear(linear, "linear")
        self.group, self.algorithm, self.log = group, algorithm, log
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.features = feature_slice(linear.out_features, group)  # rows of weight held here
        self.weight = _slice_parameter(linear.weight, self.features, None)  # (out_i, in)
        self.bias = _slice_parameter(linear.bias, self.features, None)  # (out_i,) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.group, algorithm=self.algorithm, log=self.log)
        return F.linear(x, self.weight, self.bias)  # (..., out_i)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"holds features {self.features.start}:{self.features.stop}")


class RowParallelLinear(nn.Module):
    """``nn.Linear`` split by input features: ``z = g(sum_i x_i B_i^T) + b``.

    This rank keeps columns ``feature_slice(in_features)`` of the full weight (out, in) and the
    whole bias. Input: this rank's slice of the input features (..., in_i), as a
    :class:`ColumnParallelLinear` leaves it. Output: the whole (..., out), the same on every
    rank. The bias is added once, after the all-reduce (added before it, it would be summed t
    times); its gradient is then the same on every rank. Cost: ``g``'s all-reduce of the
    output (numel(z) x e, 2(t-1)/t of it sent per rank) in forward, none in backward. Holds
    1/t of the weight and the whole bias.
    """

    def __init__(self, linear: nn.Linear, group: ProcessGroup | None = None, *,
                 algorithm: Algorithm = Algorithm.RING, log: CommLog | None = None) -> None:
        super().__init__()
        linear = _check_linear(linear, "linear")
        self.group, self.algorithm, self.log = group, algorithm, log
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.features = feature_slice(linear.in_features, group)  # columns of weight held here
        self.weight = _slice_parameter(linear.weight, None, self.features)  # (out, in_i)
        self.bias = _slice_parameter(linear.bias, None, None)  # (out,), whole, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (..., out): this rank's term of the sum
        z = reduce_from_tensor_parallel(partial, self.group, algorithm=self.algorithm,
                                        log=self.log)
        return z if self.bias is None else z + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"holds features {self.features.start}:{self.features.stop}")


class ParallelMLP(nn.Module):
    """A transformer MLP ``Linear(D, H) -> activation -> Linear(H, D)`` split over the ranks
    of ``group``: column-parallel, activation on the slice, row-parallel.

    Built from the full ``nn.Sequential`` (e.g. :attr:`labs.train.Block.mlp`, H = 4D), the
    same on every rank; this rank keeps hidden features ``self.features`` of both linears.
    ``forward(x)`` with x (..., D), the same on every rank, returns the unsplit MLP's output
    (..., D) on every rank. Per step: one all-reduce in forward (``g``), one in backward
    (``f``), each of numel(x) x e bytes, 2(t-1)/t of it sent by each rank with labs' ring.
    ``self.log`` records them (:class:`CommLog`).
    """

    def __init__(self, mlp: nn.Sequential, group: ProcessGroup | None = None, *,
                 algorithm: Algorithm = Algorithm.RING) -> None:
        super().__init__()
        if not isinstance(mlp, nn.Sequential) or len(mlp) != 3:
            raise TypeError("mlp must be nn.Sequential(Linear(D, H), activation, Linear(H, D)) "
                            f"(like labs.train.Block.mlp), got {type(mlp).__name__} "
                            f"of {len(mlp) if isinstance(mlp, nn.Sequential) else '?'} modules.")
        first, activation, second = mlp
        first = _check_linear(first, "mlp[0]")
        second = _check_linear(second, "mlp[2]")
        if not isinstance(activation, ELEMENTWISE_ACTIVATIONS):
            names = ", ".join(a.__name__ for a in ELEMENTWISE_ACTIVATIONS)
            raise TypeError(f"mlp[1] must act element by element ({names}), so that each rank "
                            f"can apply it to its slice alone; got {type(activation).__name__}.")
        if first.out_features != second.in_features:
            raise ValueError(f"mlp[0] has {first.out_features} output features but mlp[2] "
                             f"takes {second.in_features}: they must be the same hidden size.")
        self.log = CommLog()
        self.fc = ColumnParallelLinear(first, group, algorithm=algorithm, log=self.log)
        self.act = activation
        self.proj = RowParallelLinear(second, group, algorithm=algorithm, log=self.log)

    @property
    def features(self) -> slice:
        """The hidden features this rank holds (the same slice in both linears)."""
        return self.fc.features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))  # hidden (..., H_i) on this rank only
