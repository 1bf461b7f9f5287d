"""Chapter 2's cost model fitted on this machine's real transport.

:mod:`labs.cost_model` holds the closed forms, priced by an :class:`~labs.cost_model.AlphaBeta`;
this module measures those parameters. :func:`fit_alpha_beta`: ranks 0 and 1 exchange m bytes
(each sends and receives at once, as in a ring step) for m from 4 B to 4 MiB, and a line is
fitted to the best time of each size (:func:`fit_line`); reducing m bytes that arrived costs
``gamma * m`` more (the slope of ``torch.add`` times). On one machine the "link" is a memory
copy made by the CPUs over loopback, so alpha is mostly CPU time that every message pays in
turn, and an exchange costs about twice a one-way message. The result, a
:class:`FittedAlphaBeta`, keeps the points and the quality of the fit beside the parameters;
:func:`measured_over_predicted` (and :func:`labs.viz.cost_model.plot_cost_model`) show where
the model is wrong.

Ranks import this module to find :func:`_cost_points`, so it imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from labs.claims import Claim, Estimate
from labs.collectives import Algorithm, Collective
from labs.cost_model import AlphaBeta, predict
from labs.experiments.p2p_timing import P2PPattern, PointTiming, time_p2p, time_reduction
from labs.experiments.timing import (
    COMM_THREADS,
    CollectiveCase,
    CollectiveTiming,
    Statistic,
    measure_collectives,
)
from labs.launcher import cpu_cores, launch

#: Message sizes of the point-to-point fit: 4 B to 4 MiB.
DEFAULT_P2P_SIZES: tuple[int, ...] = (4, 64, 1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
#: Chunk sizes of the reduction (gamma) fit: 4 KiB to 4 MiB, large enough that the per-call
#: overhead of torch.add does not dominate.
DEFAULT_REDUCE_SIZES: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)


@dataclass(frozen=True)
class LineFit:
    """``seconds = intercept + slope * bytes``, fitted to measured points.

    ``r_squared`` is the usual 1 - SS_res / SS_tot on the seconds themselves (dominated by the
    largest sizes); ``max_relative_residual`` is the worst |measured - fitted| / measured over
    the points, which is what shows a poor fit at small sizes.
    """

    intercept: float
    slope: float
    r_squared: float
    max_relative_residual: float


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> LineFit:
    """Least-squares fit of ``seconds = intercept + slope * size`` in relative terms.

    Minimises sum(((t_i - intercept - slope * m_i) / t_i) ** 2): the sizes span six orders of
    magnitude, and an ordinary fit would let the largest message decide the intercept alone
    (a 4 MiB message's noise is larger than a 4 B message's whole time). A negative intercept
    or slope has no physical meaning; when the unconstrained fit gives one, that term is fixed
    at 0 and the other refitted (so the fit stays usable, and its residuals show the misfit).
    """
    m = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if m.ndim != 1 or m.shape != t.shape or len(m) < 2:
        raise ValueError("fit_line needs at least two (size, seconds) points of equal count.")
    if not (np.all(np.isfinite(m)) and np.all(np.isfinite(t)) and np.all(t > 0)
            and np.all(m >= 0)):
        raise ValueError("sizes must be >= 0 and seconds > 0 and finite to fit a line.")
    if len(np.unique(m)) < 2:
        raise ValueError("fit_line needs at least two different sizes.")
    weights = 1.0 / t
    design = np.stack([np.ones_like(m), m], axis=1) * weights[:, None]
    target = t * weights  # = 1
    (intercept, slope), *_ = np.linalg.lstsq(design, target, rcond=None)
    if intercept < 0:
        intercept = 0.0
        slope = float(np.sum(m * t * weights**2) / np.sum((m * weights) ** 2))
    elif slope < 0:
        slope = 0.0
        intercept = float(np.sum(weights) / np.sum(weights**2))
    fitted = intercept + slope * m
    ss_res = float(np.sum((t - fitted) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r_squared = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return LineFit(float(intercept), float(slope), r_squared,
                   float(np.max(np.abs(t - fitted) / t)))


@dataclass(frozen=True)
class FittedAlphaBeta(AlphaBeta):
    """Parameters fitted to measurements, with how well they fit and what they were fitted on.

    ``points`` are the point-to-point times the alpha-beta line was fitted to (measured with
    ``pattern``), ``reduce_points`` the add times gamma was fitted to, each summarised by
    ``statistic`` (min or median over iterations); ``fit`` and ``gamma_fit`` are those lines.
    ``world_size`` is how many ranks were running during the fit and ``cores`` how many CPU
    cores they had: predictions for more ranks than cores leave the waiting for a core out.
    """

    fit: LineFit | None = None
    gamma_fit: LineFit | None = None
    points: tuple[PointTiming, ...] = ()
    reduce_points: tuple[PointTiming, ...] = ()
    statistic: Statistic = Statistic.MIN
    pattern: P2PPattern = P2PPattern.EXCHANGE
    world_size: int = 2
    cores: int = 0
    backend: str = "gloo"

    @property
    def r_squared(self) -> float:
        """R^2 of the alpha-beta line (nan when it was not fitted to measurements)."""
        return math.nan if self.fit is None else self.fit.r_squared

    @property
    def max_relative_residual(self) -> float:
        """Worst |measured - fitted| / measured over the message points (nan if not fitted)."""
        return math.nan if self.fit is None else self.fit.max_relative_residual

    def oversubscribed(self, world_size: int) -> bool:
        """True when ``world_size`` ranks would outnumber the cores the fit ran on."""
        return self.cores > 0 and world_size > self.cores

    def summary(self) -> str:
        """One line: the parameters and the fit quality."""
        text = super().summary()
        if self.fit is not None:
            text += (f"; fit: R^2 = {self.fit.r_squared:.4f}, worst relative residual "
                     f"{self.fit.max_relative_residual:.0%} over {len(self.points)} sizes")
        return text


def _cost_points(
    rank: int, world_size: int, sizes: Sequence[int], reduce_sizes: Sequence[int], iters: int,
    pattern: P2PPattern,
) -> tuple[list[PointTiming], list[PointTiming]]:
    """The fit's worker: message times, then (if asked) every rank timing torch.add."""
    p2p = time_p2p(rank, world_size, sizes, iters=iters, pattern=pattern)
    adds = time_reduction(rank, world_size, reduce_sizes, iters=iters) if reduce_sizes else []
    return p2p, adds


def alpha_beta_from_points(
    points: Sequence[PointTiming], reduce_points: Sequence[PointTiming] = (), *,
    statistic: Statistic = Statistic.MIN, pattern: P2PPattern = P2PPattern.EXCHANGE,
    world_size: int = 2, cores: int = 0, backend: str = "gloo",
) -> FittedAlphaBeta:
    """Fit alpha and beta to message points and gamma (the slope only: the add's fixed
    per-call cost is small next to alpha and is left out) to reduction points.

    ``statistic`` summarises each size's iterations. The minimum is the default: on a
    machine shared with other work a message's median includes waiting for a core to wake
    the receiver (milliseconds, at random), which is not a property of the link.
    """
    fit = fit_line([p.size_bytes for p in points], [p.summary(statistic) for p in points])
    gamma_fit = (fit_line([p.size_bytes for p in reduce_points],
                          [p.summary(statistic) for p in reduce_points])
                 if reduce_points else None)
    return FittedAlphaBeta(
        alpha_s=fit.intercept, beta_s_per_byte=fit.slope,
        gamma_s_per_byte=0.0 if gamma_fit is None else gamma_fit.slope,
        fit=fit, gamma_fit=gamma_fit, points=tuple(points), reduce_points=tuple(reduce_points),
        statistic=statistic, pattern=pattern, world_size=world_size, cores=cores,
        backend=backend,
    )


def fit_alpha_beta(
    world_size: int = 2, sizes: Sequence[int] = DEFAULT_P2P_SIZES, iters: int = 20,
    timeout: float = 120.0, *, reduce_sizes: Sequence[int] = DEFAULT_REDUCE_SIZES,
    statistic: Statistic = Statistic.MIN, pattern: P2PPattern = P2PPattern.EXCHANGE,
    backend: str = "auto", threads: int = COMM_THREADS,
) -> FittedAlphaBeta:
    """Measure on ``world_size`` real ranks and fit the model (one launch).

    Ranks 0 and 1 exchange messages of each size in ``sizes`` (the other ranks wait; see
    :func:`labs.experiments.p2p_timing.time_p2p` for ``pattern``: an exchange, each rank sending
    and receiving m bytes at once, is what one step of a ring or of recursive doubling does, and
    ``P2PPattern.RING_STEP`` has all ranks do it at once, the load of an N-rank collective);
    then every rank times ``torch.add`` on each of ``reduce_sizes`` (pass ``()`` to leave
    gamma at 0).
    Each size is summarised by ``statistic`` (see :func:`alpha_beta_from_points`), and
    :func:`fit_line` says how the line is fitted and what its quality numbers mean.
    ``threads`` is each rank's intra-op threads, as when collectives are timed
    (:data:`labs.experiments.timing.COMM_THREADS`), so that gamma is the additions' cost there.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (a message needs two ranks), got "
                         f"{world_size!r}.")
    for name, values, least in (("sizes", sizes, 2), ("reduce_sizes", reduce_sizes, 0)):
        found = list(values)
        if len(set(found)) < least or any(isinstance(s, bool) or not isinstance(s, int)
                                          or s < 4 or s % 4 for s in found):
            raise ValueError(f"{name} must hold {'at least two different ' if least else ''}"
                             f"byte counts, each a multiple of 4 (float32), got {values!r}.")
        if least == 0 and len(found) == 1:
            raise ValueError("reduce_sizes needs two sizes or more to fit gamma, or () for none.")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}.")
    results = launch(_cost_points, world_size,
                     args=(tuple(sizes), tuple(reduce_sizes), iters, pattern),
                     backend=backend, timeout=timeout, echo=False, threads=threads)
    p2p, adds = results[0]
    return alpha_beta_from_points(p2p, adds, statistic=statistic, pattern=pattern,
                                  world_size=world_size, cores=cpu_cores(),
                                  backend=results.backend.value)


def fitted_statistic(params: AlphaBeta) -> Statistic:
    """How measurements are summarised to compare with ``params``: as its points were when it
    was fitted (:attr:`FittedAlphaBeta.statistic`), the minimum for parameters chosen by hand
    (the closed forms price an idle network: the best call is the closest to it)."""
    return params.statistic if isinstance(params, FittedAlphaBeta) else Statistic.MIN


def measured_over_predicted(
    timing: CollectiveTiming, params: AlphaBeta, statistic: Statistic | None = None,
) -> float | None:
    """How far a measurement is from the model: measured / predicted seconds (None for torch's
    built-in, which has no closed form). The measurement is summarised with ``statistic``,
    by default :func:`fitted_statistic`."""
    case = timing.case
    if case.algorithm is Algorithm.TORCH:
        return None
    predicted = predict(case.algorithm, case.size_bytes, timing.world_size, params,
                        collective=case.collective)
    measured = timing.summary(fitted_statistic(params) if statistic is None else statistic)
    return measured / predicted if predicted > 0 else None


def loopback_claims(ratios: dict[int, dict[object, float]]) -> tuple[Claim, Claim]:
    """What chapter 2 says of the fit on this machine's own transport, from measured /
    predicted per case (``ratios[N][case]``, N = 2 and 4): whether the cases took more than
    1.1 times their predictions at N = 2, where the fit ran (the text reads right either way),
    and whether, case by case, 4 ranks missed the predictions by more than 2 did."""
    cases = list(ratios[2])
    fit_misses = Claim.above(
        "ch2.loopback-fit-underprices-its-own-ranks",
        Estimate.of([ratios[2][c] for c in cases], "x", counts="cases"), 1.1, needs=None,
        held="Even at N = 2, where the fit ran, the algorithms took {value:.2f} times its "
             "predictions (the median over the {repeats} cases): an algorithm's step is more "
             "than the fit's bare exchange. It slices the tensor, posts its messages from "
             "Python and adds, and a copy between processes costs what the CPUs and their "
             "caches allow at that moment.",
        opposite="At N = 2, where the fit ran, the algorithms took {value:.2f} times its "
                 "predictions (the median over the {repeats} cases): there the straight line "
                 "prices them.",
        unsure="At N = 2, where the fit ran, the algorithms took {value:.2f} times its "
               "predictions (the median over the {repeats} cases), and 1.1 lies inside the "
               "spread of the cases: this run cannot say whether the fit underprices them.")
    four_vs_two = Claim.above(
        "ch2.loopback-four-ranks-worse-than-two",
        Estimate.of([ratios[4][c] / ratios[2][c] for c in cases], "x", counts="cases"), 1.0,
        held="On 4 ranks each case took {value:.2f} times as long, against its prediction, as "
             "on 2 (the median over the cases).",
        opposite="On 4 ranks each case took {value:.2f} times as long, against its prediction, "
                 "as on 2: no worse than on the ranks the fit ran on.",
        unsure="On 4 ranks each case took {value:.2f} times as long, against its prediction, "
               "as on 2: this run cannot tell 4 ranks from 2.")
    return fit_misses, four_vs_two


def loopback_experiment(sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 22),
                        algorithms: Sequence[Algorithm] = (Algorithm.RING,
                                                           Algorithm.RECURSIVE_DOUBLING),
                        iters: int = 20) -> tuple[FittedAlphaBeta,
                                                  dict[int, list[CollectiveTiming]],
                                                  dict[int, dict[tuple[Algorithm, int], float]]]:
    """Chapter 2's run on the loopback: the fit on two ranks, then every algorithm and size
    timed on 2 and 4 ranks (``iters`` calls each); the fit, the timings and measured /
    predicted per (algorithm, size)."""
    params = fit_alpha_beta(world_size=2, backend="gloo")
    cases = [CollectiveCase(Collective.ALL_REDUCE, a, s) for s in sizes for a in algorithms]
    loop = {n: measure_collectives(cases, n, iters=iters, backend="gloo") for n in (2, 4)}
    ratios = {n: {(t.case.algorithm, t.case.size_bytes): measured_over_predicted(t, params)
                  for t in timings} for n, timings in loop.items()}
    return params, loop, ratios  # type: ignore[return-value]
