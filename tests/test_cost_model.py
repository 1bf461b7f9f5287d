"""labs.cost_model and its fit (labs.experiments.cost_fit) and plot (labs.viz.cost_model): the
fit recovers known parameters and shows a bad fit, the closed forms match hand-derived values
and the message counts of the real collectives, crossovers are where the predictions meet, and
one real-rank measurement runs end to end."""

from __future__ import annotations

import math
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from labs import launch
from labs.collectives import Algorithm, Collective, Recorder
from labs.cost_model import AlphaBeta, coefficients, crossover_bytes, predict
from labs.experiments.cost_fit import (
    FittedAlphaBeta,
    alpha_beta_from_points,
    fit_alpha_beta,
    fit_line,
    fitted_statistic,
    measured_over_predicted,
)
from labs.experiments.p2p_timing import P2PPattern, PointTiming, time_p2p
from labs.experiments.timing import CollectiveCase, CollectiveTiming, Statistic

# The rank function below travels by value (the ranks need not import pytest).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIZES = [4, 64, 1024, 16384, 65536, 262144, 1 << 20, 1 << 22]
#: Round numbers that make hand derivations easy.
EASY = AlphaBeta(alpha_s=1.0, beta_s_per_byte=0.01, gamma_s_per_byte=0.001)


# --- fitting --------------------------------------------------------------------------------------


def test_fit_recovers_known_alpha_and_beta():
    alpha, beta = 30e-6, 2e-10
    fit = fit_line(SIZES, [alpha + beta * m for m in SIZES])
    assert fit.intercept == pytest.approx(alpha, rel=1e-9)
    assert fit.slope == pytest.approx(beta, rel=1e-9)
    assert fit.r_squared == pytest.approx(1.0) and fit.max_relative_residual < 1e-9


def test_fit_with_noise_stays_close_and_a_wrong_answer_is_told_apart():
    rng = np.random.default_rng(0)
    alpha, beta = 30e-6, 2e-10
    noisy = [(alpha + beta * m) * (1 + rng.uniform(-0.03, 0.03)) for m in SIZES]
    fit = fit_line(SIZES, noisy)
    assert fit.intercept == pytest.approx(alpha, rel=0.05)
    assert fit.slope == pytest.approx(beta, rel=0.05)
    # the same test against wrong parameters fails: the fit is not vacuous
    assert fit.intercept != pytest.approx(2 * alpha, rel=0.05)
    assert fit.slope != pytest.approx(beta / 2, rel=0.05)


def test_a_relative_fit_keeps_alpha_when_large_messages_are_noisy():
    # 20% noise on the two largest sizes is more than alpha itself in absolute terms; an
    # ordinary least-squares fit would put the intercept anywhere.
    alpha, beta = 30e-6, 2e-10
    times = [alpha + beta * m for m in SIZES]
    times[-1] *= 1.2
    times[-2] *= 0.8
    fit = fit_line(SIZES, times)
    assert fit.intercept == pytest.approx(alpha, rel=0.05)
    ordinary = np.polyfit(SIZES, times, 1)
    assert abs(ordinary[1] - alpha) / alpha > 0.25  # the reason for the relative fit


def test_a_bad_model_shows_in_the_fit_quality():
    # a curve that is not a line: quadratic in m
    times = [30e-6 + 1e-16 * m * m for m in SIZES]
    fit = fit_line(SIZES, times)
    assert fit.max_relative_residual > 0.3 and fit.r_squared < 0.9
    good = fit_line(SIZES, [30e-6 + 2e-10 * m for m in SIZES])
    assert good.max_relative_residual < fit.max_relative_residual


def test_fit_never_returns_a_negative_alpha():
    # points on a line through a negative intercept
    fit = fit_line([1000, 2000, 4000], [1e-6, 3e-6, 7e-6])
    assert fit.intercept == 0.0 and fit.slope > 0
    assert fit.max_relative_residual > 0.1  # and says it does not fit


@pytest.mark.parametrize(("sizes", "seconds"), [([1, 2], [1.0]), ([4], [1.0]),
                                                ([4, 4], [1.0, 2.0]), ([4, 8], [1.0, 0.0]),
                                                ([4, 8], [1.0, math.nan])])
def test_fit_refuses_unusable_points(sizes, seconds):
    with pytest.raises(ValueError):
        fit_line(sizes, seconds)


def test_statistic_chooses_what_is_fitted():
    alpha, beta = 30e-6, 2e-10
    points = [PointTiming(m, 0.0, (alpha + beta * m, 5 * (alpha + beta * m), 9e-3))
              for m in SIZES]
    best = alpha_beta_from_points(points, statistic=Statistic.MIN)
    assert best.alpha_s == pytest.approx(alpha) and best.beta_s_per_byte == pytest.approx(beta)
    typical = alpha_beta_from_points(points, statistic=Statistic.MEDIAN)
    assert typical.alpha_s == pytest.approx(5 * alpha)


def test_alpha_beta_refuses_negative_parameters():
    with pytest.raises(ValueError, match="alpha_s"):
        AlphaBeta(alpha_s=-1e-6, beta_s_per_byte=1e-10)


# --- the closed forms -----------------------------------------------------------------------------


@pytest.mark.parametrize(("algorithm", "world_size", "expected"), [
    # S = 400 bytes, alpha = 1, beta = 0.01, gamma = 0.001 (so S beta = 4, S gamma = 0.4)
    (Algorithm.RING, 4, 2 * 3 * (1 + 1) + 3 * 0.1),  # 2(N-1)(a + S/N b) + (N-1) S/N g
    (Algorithm.RING, 2, 2 * 1 * (1 + 2) + 1 * 0.2),
    (Algorithm.RECURSIVE_DOUBLING, 4, 2 * (1 + 4 + 0.4)),  # log2 N (a + S b + S g)
    (Algorithm.RECURSIVE_DOUBLING, 3, 3 * (1 + 4) + 2 * 0.4),  # (1 + 2)(a + S b) + 2 S g
    (Algorithm.RECURSIVE_DOUBLING, 6, 4 * (1 + 4) + 3 * 0.4),
    (Algorithm.NAIVE, 4, 6 * (1 + 4) + 3 * 0.4),  # 2(N-1)(a + S b) + (N-1) S g
    (Algorithm.WHOLE_TENSOR_RING, 4, 3 * (1 + 4 + 0.4)),  # (N-1)(a + S b + S g)
    (Algorithm.HALVING_DOUBLING, 4, 4 * 1 + 1.5 * 4 + 0.75 * 0.4),  # 2 log2 N a + 2(N-1)/N S b
    (Algorithm.HALVING_DOUBLING, 6, 6 * 1 + 3.5 * 4 + 1.75 * 0.4),  # P = 4, fold: +2 a, +2 S b
    (Algorithm.RING, 1, 0.0),
])
def test_predict_matches_hand_derived_all_reduce(algorithm, world_size, expected):
    assert predict(algorithm, 400, world_size, EASY) == pytest.approx(expected)


def test_predict_reduce_scatter_and_all_gather():
    rs = predict(Algorithm.RING, 400, 4, EASY, collective=Collective.REDUCE_SCATTER)
    ag = predict(Algorithm.RING, 400, 4, EASY, collective=Collective.ALL_GATHER)
    assert rs == pytest.approx(3 * (1 + 1) + 3 * 0.1)
    assert ag == pytest.approx(3 * (1 + 1))
    assert rs + ag == pytest.approx(predict(Algorithm.RING, 400, 4, EASY))


def test_predict_refuses_what_it_cannot_model():
    with pytest.raises(ValueError, match="closed form"):
        predict(Algorithm.TORCH, 400, 4, EASY)
    with pytest.raises(ValueError, match="not implemented"):
        predict(Algorithm.NAIVE, 400, 4, EASY, collective=Collective.ALL_GATHER)
    with pytest.raises(ValueError, match="size_bytes"):
        predict(Algorithm.RING, -1, 4, EASY)


def _count_messages(rank, world_size, numel):
    """Every rank's traffic in each all-reduce (lock-step ring: one message per step)."""
    from labs.collectives import (
        halving_doubling_all_reduce,
        naive_all_reduce,
        recursive_doubling_all_reduce,
        ring_all_reduce,
        whole_tensor_ring_all_reduce,
    )

    counts = {}
    for name, run in [("ring", lambda t, r: ring_all_reduce(t, recorder=r, segment_bytes=None)),
                      ("recursive doubling", lambda t, r: recursive_doubling_all_reduce(
                          t, recorder=r)),
                      ("halving-doubling", lambda t, r: halving_doubling_all_reduce(
                          t, recorder=r)),
                      ("naive", lambda t, r: naive_all_reduce(t, recorder=r)),
                      ("whole-tensor ring", lambda t, r: whole_tensor_ring_all_reduce(
                          t, recorder=r))]:
        recorder = Recorder()
        run(torch.ones(numel), recorder)
        counts[name] = recorder.stats
    return counts


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_model_counts_what_the_collectives_send(world_size):
    """The critical path of each closed form, checked against the real collectives: the rank
    that sends and receives the most has as many messages and bytes as the formula says."""
    numel = 12 * world_size
    size = numel * 4
    per_rank = launch(_count_messages, world_size, args=(numel,), backend="gloo", echo=False)
    for algorithm in (Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, Algorithm.NAIVE,
                      Algorithm.WHOLE_TENSOR_RING, Algorithm.HALVING_DOUBLING):
        model = coefficients(algorithm, world_size)
        stats = [counts[algorithm.value] for counts in per_rank]
        if algorithm in (Algorithm.RING, Algorithm.WHOLE_TENSOR_RING):
            # a send and a receive at once per step: the critical path counts each step once
            busiest = max(s.messages_sent for s in stats)
            traffic = max(s.bytes_sent for s in stats)
        elif algorithm is Algorithm.RECURSIVE_DOUBLING:
            # rounds are swaps (one step each); the fold-in and hand-back are one-way
            busiest = max(s.messages_received + s.messages_sent
                          - _swaps(world_size) for s in stats)
            traffic = max(s.bytes_received + s.bytes_sent - _swaps(world_size) * size
                          for s in stats)
        elif algorithm is Algorithm.HALVING_DOUBLING:
            # the same, with 2 log2 P swaps that move 2(P-1)/P·S in all
            power = 1 << _swaps(world_size)
            swapped = 2 * (power - 1) * size // power
            busiest = max(s.messages_received + s.messages_sent
                          - 2 * _swaps(world_size) for s in stats)
            traffic = max(s.bytes_received + s.bytes_sent - swapped for s in stats)
        else:  # the naive root receives N-1 and then sends N-1, one after the other
            busiest = max(s.messages_sent + s.messages_received for s in stats)
            traffic = max(s.bytes_sent + s.bytes_received for s in stats)
        assert busiest == model.messages, algorithm
        assert traffic == pytest.approx(model.bytes_per_byte * size), algorithm


def _swaps(world_size):
    return world_size.bit_length() - 1


def test_crossover_is_where_the_predictions_meet():
    params = AlphaBeta(alpha_s=30e-6, beta_s_per_byte=2e-10, gamma_s_per_byte=1e-10)
    for world_size in (3, 4, 8):
        cross = crossover_bytes(Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, world_size,
                                params)
        assert cross is not None and cross > 0
        ring = predict(Algorithm.RING, cross, world_size, params)
        doubling = predict(Algorithm.RECURSIVE_DOUBLING, cross, world_size, params)
        assert ring == pytest.approx(doubling, rel=1e-9)
        # fewer latencies win below, fewer bytes above
        assert predict(Algorithm.RECURSIVE_DOUBLING, cross / 2, world_size, params) < \
            predict(Algorithm.RING, cross / 2, world_size, params)
        assert predict(Algorithm.RING, cross * 2, world_size, params) < \
            predict(Algorithm.RECURSIVE_DOUBLING, cross * 2, world_size, params)
        assert crossover_bytes(Algorithm.RECURSIVE_DOUBLING, Algorithm.RING, world_size,
                               params) == pytest.approx(cross)


def test_crossover_is_none_when_lines_never_cross():
    params = AlphaBeta(alpha_s=30e-6, beta_s_per_byte=2e-10)
    assert crossover_bytes(Algorithm.RING, Algorithm.RING, 4, params) is None
    # at N = 2 the naive and ring all-reduce send as many messages, the ring fewer bytes
    assert crossover_bytes(Algorithm.NAIVE, Algorithm.RING, 2, params) is None
    # the naive all-reduce is slower than the ring at every size for N = 4
    assert crossover_bytes(Algorithm.NAIVE, Algorithm.RING, 4, params) is None


# --- the plot -------------------------------------------------------------------------------------


def _fake_timings(world_size, params):
    timings = []
    for size in (1 << 10, 1 << 16, 1 << 20):
        for algorithm in Collective.ALL_REDUCE.algorithms():
            seconds = (2e-3 if algorithm is Algorithm.TORCH
                       else 1.5 * predict(algorithm, size, world_size, params))
            timings.append(CollectiveTiming(CollectiveCase(Collective.ALL_REDUCE, algorithm,
                                                           size), world_size, "gloo", seconds,
                                            (seconds,), True))
    return timings


def test_plot_cost_model_overlays_model_and_measurements():
    import matplotlib

    matplotlib.use("Agg")
    from labs.viz.cost_model import plot_cost_model

    params = FittedAlphaBeta(alpha_s=30e-6, beta_s_per_byte=2e-10, gamma_s_per_byte=1e-10,
                             cores=2)
    timings = _fake_timings(4, params)
    fig = plot_cost_model(timings, params, 4)
    left, right = fig.axes
    labels = [line.get_label() for line in left.get_lines()]
    assert "ring (model)" in labels and "torch (measured)" in labels
    assert "torch (model)" not in labels
    crossover = [label for label in labels if label.startswith("model: ring = rec. doubling at")]
    assert len(crossover) == 1  # the dashed line is named in the legend
    ratios = [y for line in right.get_lines() if not line.get_label().startswith("_")
              for y in line.get_ydata()]
    assert len(ratios) == 3 * (len(Algorithm) - 1)  # three sizes of each with a closed form
    assert ratios == pytest.approx([1.5] * len(ratios))
    assert "4 ranks on 2 cores" in right.get_title()
    assert measured_over_predicted(timings[0], params) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="world size 8"):
        plot_cost_model(timings, params, 8)


# --- on real ranks --------------------------------------------------------------------------------


def test_fit_alpha_beta_on_real_ranks():
    params = fit_alpha_beta(2, sizes=(4, 4096, 65536), iters=3, reduce_sizes=(4096, 65536))
    assert [p.size_bytes for p in params.points] == [4, 4096, 65536]
    assert all(len(p.all_seconds) == 3 and p.seconds > 0 for p in params.points)
    assert params.alpha_s + params.beta_s_per_byte > 0
    # the reported residual is the fitted line's, at the points it was fitted to
    fitted = [params.fit.intercept + params.fit.slope * p.size_bytes for p in params.points]
    measured = [p.summary(params.statistic) for p in params.points]
    worst = max(abs(m - f) / m for m, f in zip(measured, fitted, strict=True))
    assert worst == pytest.approx(params.max_relative_residual)
    assert math.isfinite(params.max_relative_residual) and params.cores >= 1
    assert params.backend == "gloo" and "alpha =" in params.summary()


def test_fit_alpha_beta_refuses_bad_input_before_launching():
    with pytest.raises(ValueError, match="world_size"):
        fit_alpha_beta(1)
    with pytest.raises(ValueError, match="sizes"):
        fit_alpha_beta(2, sizes=(4,))
    with pytest.raises(ValueError, match="sizes"):
        fit_alpha_beta(2, sizes=(4, 6))
    with pytest.raises(ValueError, match="iters"):
        fit_alpha_beta(2, iters=0)


def test_plot_says_nothing_about_cores_when_there_are_enough():
    import matplotlib

    matplotlib.use("Agg")
    from labs.viz.cost_model import plot_cost_model

    params = FittedAlphaBeta(alpha_s=30e-6, beta_s_per_byte=2e-10, cores=8)
    fig = plot_cost_model(_fake_timings(4, params), params, 4)
    assert "cores" not in fig.axes[1].get_title()
    by_hand = AlphaBeta(alpha_s=30e-6, beta_s_per_byte=2e-10)  # no cores to speak of
    fig = plot_cost_model(_fake_timings(4, by_hand), by_hand, 4)
    assert "cores" not in fig.axes[1].get_title()


def test_parameters_by_hand_compare_with_the_fastest_call():
    """A hand-chosen AlphaBeta has no fit statistic: the closed forms price an idle network,
    so a measurement is summarised by its best call; a fitted one by the fit's own."""
    by_hand = AlphaBeta(alpha_s=30e-6, beta_s_per_byte=2e-10)
    assert fitted_statistic(by_hand) is Statistic.MIN
    assert fitted_statistic(FittedAlphaBeta(1e-6, 1e-10, statistic=Statistic.MEDIAN)) \
        is Statistic.MEDIAN
    case = CollectiveCase(Collective.ALL_REDUCE, Algorithm.RING, 1 << 20)
    fastest = predict(Algorithm.RING, 1 << 20, 4, by_hand)
    timing = CollectiveTiming(case, 4, "gloo", 3 * fastest, (fastest, 3 * fastest, 5 * fastest),
                              True)
    assert measured_over_predicted(timing, by_hand) == pytest.approx(1.0)
    assert by_hand.summary() == ("alpha = 30.0 us, beta = 0.200 ns/B (5.00 GB/s), "
                                 "gamma = 0.000 ns/B")


@pytest.mark.parametrize("pattern", list(P2PPattern))
def test_time_p2p_delivers_each_pattern_s_messages(pattern):
    """On 3 ranks: every pattern's messages arrive from the rank they should (time_p2p checks
    the values it received), the third rank of a ring step included."""
    points = launch(time_p2p, 3, args=((4, 4096), 2, 1, pattern))[0]
    assert [p.size_bytes for p in points] == [4, 4096]
    assert all(len(p.all_seconds) == 2 and min(p.all_seconds) > 0 for p in points)


def test_fit_alpha_beta_with_every_rank_stepping_a_ring():
    params = fit_alpha_beta(3, sizes=(4, 4096, 65536), iters=3, reduce_sizes=(),
                            pattern=P2PPattern.RING_STEP)
    assert params.pattern is P2PPattern.RING_STEP and params.world_size == 3
    assert params.alpha_s + params.beta_s_per_byte > 0


def test_the_loopback_claims_compare_four_ranks_with_two_case_by_case():
    from labs.claims import Outcome
    from labs.experiments.cost_fit import loopback_claims

    two = {("ring", s): r for s, r in zip(range(4), (1.0, 1.3, 1.2, 1.4), strict=True)}
    fit_misses, worse = loopback_claims({2: two, 4: {c: 2 * r for c, r in two.items()}})
    assert fit_misses.outcome is Outcome.HELD and fit_misses.needs is None
    assert worse.outcome is Outcome.HELD and "2.00 times" in worse.sentence
    _, worse = loopback_claims({2: two, 4: {c: 0.5 * r for c, r in two.items()}})
    assert worse.outcome is Outcome.OPPOSITE
