"""What the checks of chapter 6 run, and the answers the parent computes on its own: the
exercises, ZeRO's layout (Rajbhandari et al., arXiv 1910.02054: a tensor of ``numel``
elements flattened and zero-padded to ``N * k`` elements, ``k = ceil(numel / N)``, rank r
owning elements ``[r*k, (r+1)*k)``), the cases and what a seed draws, each case's inputs (a
pure function of the case, so that the parent and the ranks agree on them), one process's
SGD with momentum (6.1) and ``F.linear`` read from the flat vector (6.2).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labs.checks.core import CheckPlan, case_values, with_drawn_world_size
from labs.checks.exercises import ExerciseRow
from labs.zero import shard_numel

STEPS = 3  #: steps of exercise 6.1 per case
LR, BETA = 0.25, 0.5  #: powers of two: every value of 6.1 stays exact in float32
BATCH = 3  #: rows of 6.2's input x
#: Parameter and gradient shapes of 6.1 and 6.3: 24 elements (divisible by 1, 2, 3, 4, 6) first,
#: then numels that 2, 3 or 4 do not divide, 2-D ones, and numel 1 (< N for every N >= 2).
SHAPES = ((4, 6), (7,), (5, 3), (3,), (1,))
#: The parameters 6.1 also passes in one call: one even, one uneven, numel 1.
TOGETHER = (SHAPES[0], SHAPES[1], SHAPES[-1])
#: (in_features, out_features) of 6.2: flat numels 2 (< 3 and 4), 8, 15 and 35.
LINEARS = ((1, 1), (3, 2), (4, 3), (6, 5))
_DRAWN_WORLD_SIZES = (5, 6)


class ZeroExercise(ExerciseRow, enum.Enum):
    """The exercises of chapter 6 that these checks run."""

    #: ``sharded_sgd_step(params, momentum_shards, lr, beta)``: ZeRO-1's step.
    SHARDED_STEP = "6.1"
    #: ``fsdp_linear_forward(shard, in_features, out_features, x) -> Tensor``: gather, free.
    FSDP_FORWARD = "6.2"
    #: ``reduce_scatter_grad(grad) -> Tensor``: this rank's shard of the mean gradient.
    REDUCE_SCATTER_GRAD = "6.3"
    #: ``zero2_grad_hook(param, grad_shards)``: ZeRO-2's post-accumulate-grad hook
    #: (:mod:`labs.checks.zero_grad`).
    GRAD_HOOK = "6.4"
    #: ``fsdp_linear_backward(shard, in_features, out_features, x, grad_out) -> (grad_x,
    #: grad_shard)``: one FSDP unit's backward (:mod:`labs.checks.zero_grad`).
    FSDP_BACKWARD = "6.5"


    @property
    def collective(self) -> str:
        """The collective(s) the exercise makes, per tensor."""
        return {ZeroExercise.REDUCE_SCATTER_GRAD: "a reduce-scatter",
                ZeroExercise.GRAD_HOOK: "a reduce-scatter",
                ZeroExercise.FSDP_BACKWARD: "an all-gather and a reduce-scatter"}.get(
                    self, "an all-gather")


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def pad_flat(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded to N·k elements, k = ceil(numel / N)."""
    flat = tensor.reshape(-1)
    return F.pad(flat, (0, n * shard_numel(flat.numel(), n) - flat.numel()))


def shard_of(flat: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's k elements of ``flat``, a padded tensor of N·k elements."""
    k = flat.numel() // n
    return flat[r * k:(r + 1) * k]


@dataclass(frozen=True)
class Case:
    """The shapes one case passes: 6.1's parameters, 6.2's ``(weight, bias)``, 6.3's gradient."""

    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def linear(cls, in_features: int, out_features: int) -> Case:
        return cls(((out_features, in_features), (out_features,)))

    @property
    def numel(self) -> int:
        return sum(map(_numel, self.shapes))

    def numels(self, exercise: ZeroExercise) -> tuple[int, ...]:
        """The numel of each padded tensor: one flat vector for 6.2, one per shape otherwise."""
        if exercise is ZeroExercise.FSDP_FORWARD:
            return (self.numel,)
        return tuple(map(_numel, self.shapes))

    def uneven(self, exercise: ZeroExercise, n: int) -> bool:
        return any(numel % n for numel in self.numels(exercise))

    def describe(self, exercise: ZeroExercise) -> str:
        if exercise is ZeroExercise.FSDP_FORWARD:
            (out_features, in_features), _ = self.shapes
            return f"Linear({in_features}, {out_features}) (flat numel {self.numel})"
        if len(self.shapes) > 1:
            return f"{len(self.shapes)} parameters at once ({shapes_text(self.shapes)})"
        what = "a parameter" if exercise is ZeroExercise.SHARDED_STEP else "a gradient"
        return f"{what} of shape {self.shapes[0]} (numel {self.numel})"


def shapes_text(shapes: Sequence[tuple[int, ...]]) -> str:
    return ", ".join(map(str, shapes))


@dataclass(frozen=True)
class Plan(CheckPlan):
    """What one check runs: the world sizes and the cases of every launch."""

    exercise: ZeroExercise
    drawn: tuple[Case, ...]

    @classmethod
    def make(cls, exercise: ZeroExercise, world_sizes: Sequence[int], seed: int) -> Plan:
        if seed == 0:
            return cls(seed, tuple(world_sizes), None, exercise, ())
        rng = random.Random(seed)
        sizes, extra = with_drawn_world_size(world_sizes, rng, _DRAWN_WORLD_SIZES)
        if exercise is ZeroExercise.FSDP_FORWARD:
            drawn = (Case.linear(rng.randint(2, 9), rng.randint(2, 9)),)
        else:
            drawn = (Case(((rng.randint(8, 60),),)),
                     Case(((rng.randint(2, 7), rng.randint(2, 7)),)))
        return cls(seed, sizes, extra, exercise, drawn)

    @property
    def cases(self) -> tuple[Case, ...]:
        if self.exercise is ZeroExercise.FSDP_FORWARD:
            return (*(Case.linear(i, o) for i, o in LINEARS), *self.drawn)
        singles = (*(Case((s,)) for s in SHAPES), *self.drawn)
        if self.exercise is ZeroExercise.SHARDED_STEP:  # and several in one call
            return (*singles, Case(TOGETHER))
        return singles

    def draws(self) -> list[str]:
        if self.exercise is ZeroExercise.FSDP_FORWARD:
            return [self.drawn[0].describe(self.exercise).split(" (")[0]]
        return ["shapes " + " and ".join(str(c.shapes[0]) for c in self.drawn)]


# The inputs, a pure function of their arguments (parent and ranks agree): integers in [1, 9].


def start_param(seed: int, n: int, index: int, i: int, shape: tuple[int, ...]) -> torch.Tensor:
    return case_values(seed, n, index, 100 + i, _numel(shape)).view(shape)


def step_grad(seed: int, n: int, index: int, step: int, i: int,
              shape: tuple[int, ...]) -> torch.Tensor:
    return case_values(seed, n, index, 1000 * (step + 1) + i, _numel(shape)).view(shape)


def linear_inputs(seed: int, n: int, index: int, case: Case
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded flat vector ``cat(weight.flatten(), bias)`` of 6.2 and its input x."""
    (out_features, in_features), _ = case.shapes
    flat = case_values(seed, n, index, -1, case.numel)
    return pad_flat(flat, n), case_values(seed, n, index, -2, BATCH * in_features).view(BATCH, -1)


def rank_grad(seed: int, n: int, index: int, rank: int, case: Case) -> torch.Tensor:
    return case_values(seed, n, index, rank, case.numel).view(case.shapes[0])


def sgd_reference(seed: int, n: int, index: int, case: Case
                  ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """One process's SGD with momentum: per step, the parameters and the padded momenta."""
    params = [start_param(seed, n, index, i, s) for i, s in enumerate(case.shapes)]
    momenta = [torch.zeros(n * shard_numel(p.numel(), n)) for p in params]
    states = []
    for step in range(STEPS):
        grads = [step_grad(seed, n, index, step, i, p.shape) for i, p in enumerate(params)]
        momenta = [BETA * m + pad_flat(g, n) for m, g in zip(momenta, grads, strict=True)]
        params = [p - LR * m[:p.numel()].view_as(p) for p, m in zip(params, momenta, strict=True)]
        states.append((params, momenta))
    return states


def flat_linear(x: torch.Tensor, flat: torch.Tensor, in_features: int, out_features: int,
                bias_first: bool = False) -> torch.Tensor:
    """F.linear with the weight and bias read from ``flat``, in either order."""
    w = out_features * in_features
    if bias_first:
        return F.linear(x, flat[out_features:out_features + w].view(out_features, in_features),
                        flat[:out_features])
    return F.linear(x, flat[:w].view(out_features, in_features), flat[w:w + out_features])
