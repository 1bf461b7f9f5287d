"""What the checks of exercises 6.4 and 6.5 run, and the answers the parent computes on its
own: the cases (chains of ``nn.Linear`` layers), what a seed draws, each case's inputs (a pure
function of the case, so that the parent and the ranks agree on them), and one process's
gradients on the concatenated batch, the reference both exercises are compared with.

Both exercises produce gradient shards in ZeRO's layout (:mod:`labs.checks.zero_cases`):
rank r owns elements ``[r*k, (r+1)*k)`` of the flattened gradient, zero-padded to ``N*k``
elements, ``k = ceil(numel / N)``.

* 6.4 (ZeRO-2's hook): every rank holds the same chain of Linear layers and its own
  ``BATCH`` rows ``x_r`` and targets ``t_r``; its loss is ``(model(x_r) * t_r).sum()``. The
  mean over ranks of the gradients is the gradient of ``sum_r loss_r / N``: one process's
  backward on the concatenated batch, divided by N.
* 6.5 (FSDP's backward of one Linear): rank r holds the gradient ``grad_out_r`` of its
  output ``x_r @ weight.T + bias``. Its input gradient is ``grad_out_r @ weight``, its own;
  the parameters' gradient is the mean over ranks, again one process's backward on the
  concatenated batch (output gradient ``cat_r grad_out_r``), divided by N.

Every input is a small integer stored as float32, so every gradient is an exact integer and
only the division by N rounds.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from labs.checks.core import CheckPlan, case_values, with_drawn_world_size
from labs.checks.zero_cases import BATCH, LINEARS, ZeroExercise, pad_flat

#: 6.4's models, as (in_features, out_features) per Linear layer. The first: parameters of
#: numel 12 (divisible by 1, 2, 3, 4, 6), 3, 6, 2, 2 and 1 (< N for every N >= 2).
CHAINS = (((4, 3), (3, 2), (2, 1)), ((5, 4),))
_DRAWN_WORLD_SIZES = (5, 6)


@dataclass(frozen=True)
class GradCase:
    """One case: a chain of Linear layers (6.5: a single one), as (in, out) per layer."""

    layers: tuple[tuple[int, int], ...]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every parameter's shape, in ``model.parameters()`` order: weight, bias, ..."""
        return tuple(s for i, o in self.layers for s in ((o, i), (o,)))

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter's name in the ``nn.Sequential``: ``0.weight``, ``0.bias``, ..."""
        return tuple(f"{j}.{kind}" for j in range(len(self.layers)) for kind in ("weight", "bias"))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(_numel(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def describe(self, exercise: ZeroExercise) -> str:
        linears = " -> ".join(f"Linear({i}, {o})" for i, o in self.layers)
        if exercise is ZeroExercise.FSDP_BACKWARD:
            return f"{linears} (flat numel {self.numel})"
        return f"the model {linears}"

    def param_text(self, i: int) -> str:
        return f"parameter {self.names[i]} (shape {self.shapes[i]}, numel {self.numels[i]})"


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


@dataclass(frozen=True)
class GradPlan(CheckPlan):
    """What one check of 6.4 or 6.5 runs: the world sizes and the cases of every launch."""

    exercise: ZeroExercise
    drawn: tuple[GradCase, ...]

    @classmethod
    def make(cls, exercise: ZeroExercise, world_sizes: Sequence[int], seed: int) -> GradPlan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, exercise, ())
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_WORLD_SIZES)
        if exercise is ZeroExercise.FSDP_BACKWARD:
            drawn = GradCase(((rng.randint(2, 9), rng.randint(2, 9)),))
        else:
            width = rng.randint(2, 7)
            drawn = GradCase(((rng.randint(2, 7), width), (width, rng.randint(1, 4))))
        return cls(seed, sizes, extra, exercise, (drawn,))

    @property
    def cases(self) -> tuple[GradCase, ...]:
        if self.exercise is ZeroExercise.FSDP_BACKWARD:
            return (*(GradCase(((i, o),)) for i, o in LINEARS), *self.drawn)
        return (*(GradCase(c) for c in CHAINS), *self.drawn)

    def draws(self) -> list[str]:
        return [self.drawn[0].describe(self.exercise).split(" (")[0]]


# --- the inputs, a pure function of their arguments (parent and ranks agree) ------------------


def chain_values(seed: int, n: int, index: int, case: GradCase) -> list[torch.Tensor]:
    """6.4: the values of every parameter, the same on every rank."""
    return [case_values(seed, n, index, -10 - i, _numel(s)).view(s)
            for i, s in enumerate(case.shapes)]


def build_chain(case: GradCase, values: Sequence[torch.Tensor]) -> nn.Sequential:
    """6.4's model: the case's Linear layers, holding ``values``."""
    model = nn.Sequential(*(nn.Linear(i, o) for i, o in case.layers))
    with torch.no_grad():
        for p, value in zip(model.parameters(), values, strict=True):
            p.copy_(value)
    return model


def chain_batch(seed: int, n: int, index: int, rank: int, case: GradCase
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """6.4: rank r's rows ``x_r`` (BATCH, in) and targets ``t_r`` (BATCH, out)."""
    first, last = case.layers[0][0], case.layers[-1][1]
    x = case_values(seed, n, index, rank, BATCH * first).view(BATCH, first)
    return x, case_values(seed, n, index, 100 + rank, BATCH * last).view(BATCH, last)


def linear_flat(seed: int, n: int, index: int, case: GradCase) -> torch.Tensor:
    """6.5: the zero-padded flat vector ``cat(weight.flatten(), bias)`` (N*k elements)."""
    return pad_flat(case_values(seed, n, index, -1, case.numel), n)


def linear_batch(seed: int, n: int, index: int, rank: int, case: GradCase
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """6.5: rank r's input ``x_r`` (BATCH, in) and output gradient ``grad_out_r``."""
    (in_features, out_features), = case.layers
    x = case_values(seed, n, index, rank, BATCH * in_features).view(BATCH, in_features)
    grad_out = case_values(seed, n, index, 100 + rank, BATCH * out_features)
    return x, grad_out.view(BATCH, out_features)


# --- one process's answers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Gradients:
    """Per parameter (6.4) or for the one flat vector (6.5), flattened and zero-padded to N*k:
    the mean over ranks (the answer), the sum, and each rank's own gradient."""

    mean: tuple[torch.Tensor, ...]
    summed: tuple[torch.Tensor, ...]
    local: tuple[tuple[torch.Tensor, ...], ...]
    """``local[r][i]``: rank r's own gradient of parameter i."""


def _chain_grads(case: GradCase, values: Sequence[torch.Tensor], x: torch.Tensor,
                 t: torch.Tensor) -> list[torch.Tensor]:
    model = build_chain(case, values)
    (model(x) * t).sum().backward()
    return [p.grad.detach() for p in model.parameters()]  # type: ignore[union-attr]


def hook_reference(seed: int, n: int, index: int, case: GradCase) -> Gradients:
    """6.4: the gradients, from one process's backward on the concatenated batch (the mean
    and the sum) and on each rank's rows alone (to recognise a gradient never reduced)."""
    values = chain_values(seed, n, index, case)
    batches = [chain_batch(seed, n, index, r, case) for r in range(n)]
    x, t = (torch.cat(parts) for parts in zip(*batches, strict=True))
    summed = _chain_grads(case, values, x, t)
    local = [_chain_grads(case, values, *batch) for batch in batches]
    return Gradients(tuple(pad_flat(g / n, n) for g in summed),
                     tuple(pad_flat(g, n) for g in summed),
                     tuple(tuple(pad_flat(g, n) for g in grads) for grads in local))


@dataclass(frozen=True)
class BackwardReference:
    """6.5's answers: each rank's input gradient and the flat parameter gradients."""

    grad_x: tuple[torch.Tensor, ...]  #: per rank, ``grad_out_r @ weight``
    grads: Gradients
    transposed: torch.Tensor
    """The mean with the weight's gradient computed as ``x.T @ grad_out`` (in, out) and
    flattened so: a transposed weight gradient."""


def _linear_grads(flat: torch.Tensor, case: GradCase, x: torch.Tensor,
                  grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, flat parameter gradient zero-padded like ``flat``), by autograd."""
    (in_features, out_features), = case.layers
    full = flat.clone().requires_grad_()
    w = in_features * out_features
    x = x.clone().requires_grad_()
    out = torch.nn.functional.linear(x, full[:w].view(out_features, in_features),
                                     full[w:w + out_features])
    out.backward(grad_out)
    assert x.grad is not None and full.grad is not None
    return x.grad, full.grad


def backward_reference(seed: int, n: int, index: int, case: GradCase) -> BackwardReference:
    """6.5: one process's backward on the concatenated batch, and on each rank's rows."""
    (in_features, out_features), = case.layers
    flat = linear_flat(seed, n, index, case)
    batches = [linear_batch(seed, n, index, r, case) for r in range(n)]
    x, grad_out = (torch.cat(parts) for parts in zip(*batches, strict=True))
    grad_x, summed = _linear_grads(flat, case, x, grad_out)
    local = [_linear_grads(flat, case, *batch)[1] for batch in batches]
    w = in_features * out_features
    transposed = summed.clone()
    transposed[:w] = (x.T @ grad_out).reshape(-1)
    return BackwardReference(tuple(grad_x.split(BATCH)),
                             Gradients((summed / n,), (summed,), tuple((g,) for g in local)),
                             transposed / n)
