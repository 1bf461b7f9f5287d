"""What the check of exercise 5.3 runs, and the answers the parent computes on its own: the
exercise, the cases and what a seed draws, the reference, and the usual wrong formulas.

5.3 (when data parallelism pays): one rank's step computes for ``T1(b) = c b + f`` (``c`` =
``per_sample_s`` seconds per sample, ``f`` = ``fixed_s`` for what does not grow with the
batch ``b``). N ranks of ``b`` samples each add one ring all-reduce of the ``S`` =
``model_bytes`` bytes of gradients after backward (nothing overlaps it), chapter 2's lock-step
ring: ``2(N-1)`` steps, each one message of ``S/N`` bytes, ``R = 2(N-1)(alpha + S/(N bw))``.
N ranks train ``N b`` samples per ``T1 + R`` seconds, one rank ``b`` per ``T1``; the
reference solves ``N b / (T1 + R) = b / T1`` for ``b`` from these two throughputs, as the
chapter does for two ranks: it shares no code with :func:`labs.cost_model.crossover_batch`,
the chapter's own answer (a test holds the two together).
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass

from labs.checks.core import CheckPlan
from labs.checks.exercises import ExerciseRow

#: How close an answer must be to the reference: relative, and absolute for answers near 0 (a
#: fixed cost that outlasts the all-reduce gives exactly 0).
RTOL, ATOL = 1e-6, 1e-9


class ScalingExercise(ExerciseRow, enum.Enum):
    """The exercise of chapter 5 that this check runs."""

    #: ``crossover_batch(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s) ->
    #: b*``: the per-rank batch above which N ranks train more samples per second than one.
    CROSSOVER_BATCH = "5.3"


@dataclass(frozen=True)
class CrossoverCase:
    """One call of 5.3: a link, a model, N ranks and one rank's compute per step, in seconds
    and bytes."""

    alpha: float  #: seconds per message
    bandwidth: float  #: bytes per second
    model_bytes: float  #: S, the bytes of gradients all-reduced
    world_size: int  #: N >= 2
    per_sample_s: float  #: c
    fixed_s: float  #: f
    what: str = ""
    """What the case is for, in words (e.g. alpha dominates), for the verdict."""

    @property
    def arguments(self) -> tuple[float, float, float, int, float, float]:
        """What the check passes, in the order of the exercise's parameters."""
        return (self.alpha, self.bandwidth, self.model_bytes, self.world_size,
                self.per_sample_s, self.fixed_s)

    @property
    def allreduce_s(self) -> float:
        """R: 2(N-1) steps of the ring, each one message of S/N bytes."""
        n = self.world_size
        return 2 * (n - 1) * (self.alpha + self.model_bytes / n / self.bandwidth)

    def describe(self) -> str:
        what = f" ({self.what})" if self.what else ""
        return (f"alpha = {self.alpha:g} s, bandwidth = {self.bandwidth:g} B/s, model_bytes = "
                f"{self.model_bytes:g} B, world_size = {self.world_size}, per_sample_s = "
                f"{self.per_sample_s:g} s, fixed_s = {self.fixed_s:g} s{what}")

    def draw_text(self) -> str:
        """The call itself, to paste: ``crossover_batch(1e-05, 1e+10, 4e+08, 2, 0.001,
        0.005)`` (a drawn case's values have 4 significant digits, all shown)."""
        name = ScalingExercise.CROSSOVER_BATCH.function
        return f"{name}({', '.join(f'{v:g}' for v in self.arguments)})"


def expected_crossover(case: CrossoverCase) -> float:
    """b*, from the two throughputs: ``N b / (T1 + R) > b / T1`` holds when ``(N-1) T1 > R``,
    ``T1 = c b + f``, that is for ``b > (R / (N-1) - f) / c``; 0 when ``f`` alone is enough
    (N ranks then win at every batch)."""
    per_extra_rank = case.allreduce_s / (case.world_size - 1)
    return max(0.0, (per_extra_rank - case.fixed_s) / case.per_sample_s)


# --- the usual wrong formulas --------------------------------------------------------------------


class Formula(enum.Enum):
    """5.3's answer and the mistakes a learner makes with it, each a formula of the case."""

    RIGHT = "right"
    """``max(0, (2 alpha + 2 S/(N bw) - f) / c)``."""
    NO_CLAMP = "no clamp"
    """Leaves out the ``max(0, ...)``: a negative batch when ``f`` outlasts the all-reduce."""
    WHOLE_BANDWIDTH = "whole bandwidth"
    """``S/bw`` for the bandwidth term, chapter 5's two-rank form: right at N = 2 only."""
    RING_BYTES = "ring bytes"
    """The whole ring's bandwidth term, ``2(N-1)/N S/bw``, with ``2 alpha``: right at N = 2
    only."""
    WHOLE_ALLREDUCE = "whole all-reduce"
    """All of ``R = 2(N-1)(alpha + S/(N bw))``, not divided by N-1: right at N = 2 only."""
    ALPHA_ONCE = "alpha once"
    """``alpha`` where one extra rank's share of the ring's messages is ``2 alpha``."""
    NO_FIXED = "no fixed cost"
    """Leaves out ``f``, the part of a step that does not grow with the batch."""

    def value(self, case: CrossoverCase) -> float:
        """What this formula answers for ``case``."""
        alpha, bw, s, n = case.alpha, case.bandwidth, case.model_bytes, case.world_size
        latency, bandwidth, fixed = 2 * alpha, 2 * s / (n * bw), case.fixed_s
        if self is Formula.WHOLE_BANDWIDTH:
            bandwidth = s / bw
        elif self is Formula.RING_BYTES:
            bandwidth = 2 * (n - 1) * s / (n * bw)
        elif self is Formula.WHOLE_ALLREDUCE:
            latency, bandwidth = 2 * (n - 1) * alpha, 2 * (n - 1) * s / (n * bw)
        elif self is Formula.ALPHA_ONCE:
            latency = alpha
        elif self is Formula.NO_FIXED:
            fixed = 0.0
        b = (latency + bandwidth - fixed) / case.per_sample_s
        return b if self is Formula.NO_CLAMP else max(0.0, b)

    def hint(self, case: CrossoverCase) -> str:
        """What to look at again, for a learner whose answer is this formula's."""
        at_two = (f"it is right at N = 2 only (this case has N = {case.world_size}): the ring's "
                  f"2(N-1) steps each send S/N bytes, so R = 2(N-1)(alpha + S/(N bw)) = "
                  f"{case.allreduce_s:g} s here, and the N-1 ranks beyond the first share it. "
                  "How much of R must one rank's T1 outlast?")
        return {
            Formula.NO_CLAMP: "a batch is never negative: when the fixed cost f alone outlasts "
            "one extra rank's share of the all-reduce, N ranks train faster than one at "
            "every batch, and b* is 0.",
            Formula.WHOLE_BANDWIDTH: f"that is (2 alpha + S/bw - f) / c, the two-rank form of "
            f"this chapter; {at_two}",
            Formula.RING_BYTES: "that is (2 alpha + 2(N-1)/N S/bw - f) / c, the whole ring's "
            f"bandwidth term with 2 alpha; {at_two}",
            Formula.WHOLE_ALLREDUCE: "that is (R - f) / c, one rank's T1 set against the whole "
            f"all-reduce R; {at_two}",
            Formula.ALPHA_ONCE: f"that counts the latency alpha = {case.alpha:g} s once; the "
            "ring's 2(N-1) messages, shared by the N-1 ranks beyond the first, make how many "
            "alphas each?",
            Formula.NO_FIXED: f"that leaves out the fixed cost f = {case.fixed_s:g} s of one "
            "rank's step, T1(b) = c b + f, which counts towards outlasting the all-reduce.",
        }.get(self, "")


#: The wrong formulas, in the order the judge tries them: the likeliest first.
MISTAKES = tuple(f for f in Formula if f is not Formula.RIGHT)

# --- the cases ---------------------------------------------------------------------------------

#: A 100-million-parameter fp32 model's gradients on a 10 GB/s link of 10 us: S/bw dominates.
_LINK = {"alpha": 10e-6, "bandwidth": 10e9, "model_bytes": 400e6}

#: 5.3's documented cases: N = 2, 4 and 8 where S/bw dominates (the two-rank forms are right at
#: N = 2 only), a fixed cost that outlasts the all-reduce (the answer 0, not negative), alpha =
#: 0, and a small model on a link of 2 ms, where alpha dominates.
CROSSOVER_CASES = (
    CrossoverCase(**_LINK, world_size=2, per_sample_s=1e-3, fixed_s=5e-3, what="S/bw dominates"),
    CrossoverCase(**_LINK, world_size=4, per_sample_s=1e-3, fixed_s=5e-3),
    CrossoverCase(**_LINK, world_size=8, per_sample_s=1e-3, fixed_s=5e-3),
    CrossoverCase(**_LINK, world_size=8, per_sample_s=1e-3, fixed_s=20e-3,
                  what="the fixed cost outlasts the all-reduce's share"),
    CrossoverCase(0.0, 50e9, 2e9, 4, 5e-4, 1e-3, what="alpha = 0"),
    CrossoverCase(2e-3, 100e9, 10e6, 16, 1e-4, 1e-4, what="alpha dominates"),
)


def _rounded(x: float) -> float:
    """``x`` to 4 significant digits: what the verdict shows of a drawn case is what ran."""
    return float(f"{x:.4g}")


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return _rounded(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_case(rng: random.Random) -> CrossoverCase:
    """A link of 1 us to 5 ms and 1 to 400 GB/s, a model of 1 MB to 10 GB, N = 2 to 1024 (all
    log-uniform), and a rank's compute such that b* is 1 to 1e6 (log-uniform), or 0 a quarter
    of the time. ``f`` stays at least 5 % away from the all-reduce's share, so that the
    reference's rounding stays far inside :data:`RTOL`."""
    alpha, bandwidth = _log_uniform(rng, 1e-6, 5e-3), _log_uniform(rng, 1e9, 400e9)
    model_bytes = _log_uniform(rng, 1e6, 10e9)
    world_size = round(2 ** rng.uniform(1, 10))
    share = 2 * alpha + 2 * model_bytes / (world_size * bandwidth)
    zero = rng.random() < 0.25
    fixed = _rounded(share * (rng.uniform(1.05, 3.0) if zero else rng.uniform(0.0, 0.95)))
    target = math.exp(rng.uniform(0.0, math.log(1e6)))
    per_sample = _rounded((share if zero else share - fixed) / target)
    return CrossoverCase(alpha, bandwidth, model_bytes, world_size, per_sample, fixed)


@dataclass(frozen=True)
class CrossoverPlan(CheckPlan):
    """What one check of 5.3 runs (in one rank of its own: no world sizes)."""

    drawn: tuple[CrossoverCase, ...]

    @classmethod
    def make(cls, seed: int) -> CrossoverPlan:
        if seed == 0:
            return cls(seed, (), None, ())
        rng = random.Random(seed)
        return cls(seed, (), None, tuple(draw_case(rng) for _ in range(3)))

    @property
    def cases(self) -> tuple[CrossoverCase, ...]:
        return (*CROSSOVER_CASES, *self.drawn)

    def draws(self) -> list[str]:
        return [case.draw_text() for case in self.drawn]
