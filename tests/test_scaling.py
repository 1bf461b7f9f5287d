"""Chapter 5's "does it get faster?": the closed form of the crossover batch, and one rank
against two on real ranks over the emulated link."""

from __future__ import annotations

import math

import pytest

from labs import Link
from labs.cost_model import crossover_batch
from labs.experiments.ddp import StepSettings
from labs.experiments.scaling import ScalingPoint, fit_compute, measure_scaling, one_bucket_cap_mb
from labs.viz.ddp import plot_scaling, scaling_table


def model_speedup(n: int, b: float, alpha: float, bw: float, s: float, c: float,
                  f: float) -> float:
    t1 = c * b + f
    return n * t1 / (t1 + 2 * (n - 1) * (alpha + s / (n * bw)))


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_at_the_crossover_batch_n_ranks_are_exactly_as_fast_as_one(n):
    alpha, bw, s, c, f = 1e-3, 1e8, 4e7, 2e-4, 3e-3
    b = crossover_batch(alpha, bw, s, n, c, f)
    assert b > 0
    assert model_speedup(n, b, alpha, bw, s, c, f) == pytest.approx(1.0, rel=1e-12)
    assert model_speedup(n, 0.9 * b, alpha, bw, s, c, f) < 1 < model_speedup(n, 1.1 * b, alpha,
                                                                               bw, s, c, f)


def test_two_ranks_is_the_chapters_formula_and_a_large_fixed_cost_gives_zero():
    alpha, bw, s, c, f = 2.5e-3, 125e6, 8.4e6, 8e-5, 5e-3
    assert crossover_batch(alpha, bw, s, 2, c, f) == pytest.approx((2 * alpha + s / bw - f) / c)
    assert crossover_batch(alpha, bw, s, 2, c, 1.0) == 0.0


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=1), "world_size must be an int >= 2"),
    (dict(world_size=2.0), "world_size must be an int >= 2"),
    (dict(bandwidth=0.0), "bandwidth must be a finite number > 0"),
    (dict(per_sample_s=-1.0), "per_sample_s must be a finite number > 0"),
    (dict(alpha=math.nan), "alpha must be a finite number >= 0"),
])
def test_crossover_batch_refuses_what_has_no_answer(kwargs, words):
    args = dict(alpha=1e-3, bandwidth=1e9, model_bytes=1e6, world_size=2, per_sample_s=1e-4,
                fixed_s=0.0) | kwargs
    with pytest.raises(ValueError, match=words):
        crossover_batch(**args)


def test_the_fit_recovers_a_line_and_the_speedup_is_n_t1_over_tn():
    c, f = 1e-4, 2e-3
    points = [ScalingPoint(b, 2, (c * b + f,) * 4, (c * b + f + 0.05,) * 4) for b in (10, 100)]
    fitted_c, fitted_f = fit_compute(points)
    assert fitted_c == pytest.approx(c) and fitted_f == pytest.approx(f)
    p = points[1]
    assert p.speedup.median == pytest.approx(2 * 0.012 / 0.062)
    assert p.efficiency.median == pytest.approx(p.speedup.median / 2)
    one, many = p.samples_per_second()
    assert many / one == pytest.approx(p.speedup.median)
    with pytest.raises(ValueError, match="two batches"):
        fit_compute(points[:1])


def test_one_bucket_holds_the_whole_model():
    s = StepSettings(width=64, layers=2)
    assert one_bucket_cap_mb(s) * 2**20 > s.gradient_bytes


def test_one_rank_against_two_on_real_ranks():
    link = Link(alpha=2e-3, bandwidth=50e6)
    settings = StepSettings(width=64, layers=2, steps=3, warmup=1)
    points = measure_scaling(2, settings, [8, 64], link, launches=2)
    assert [p.batch for p in points] == [8, 64]
    for p in points:
        assert len(p.one) == len(p.many) == 6  # 2 launches x 3 steps, each side
        # two ranks wait for the link (2 alpha at least); one rank never does
        assert min(p.many) > 2 * link.alpha
        assert p.one_rank.median < p.n_ranks.median
    text = scaling_table(points, [0.5, 0.6])
    assert "speed-up (middle half)" in text and len(text.splitlines()) == 4
    fig = plot_scaling(points, [(8, 0.5), (64, 0.6)], 100.0)
    assert fig.axes[0].get_xscale() == "log"


def test_scaling_needs_two_ranks():
    with pytest.raises(ValueError, match="at least 2"):
        measure_scaling(1, StepSettings(), [8], Link(alpha=1e-3, bandwidth=1e8))


def test_on_published_hardware_the_efficient_batch_is_a_ratio_of_rates():
    from labs.experiments.scaling import PUBLISHED, on_published

    nvlink = PUBLISHED[0]
    small, large = on_published(nvlink, 1e9), on_published(nvlink, 70e9)
    assert small.efficient_tokens == pytest.approx(large.efficient_tokens)  # P cancels
    t1 = small.efficient_tokens * small.per_token_s
    assert t1 / (t1 + small.allreduce_s) == pytest.approx(0.9)
    t1 = small.break_even_tokens * small.per_token_s
    n = nvlink.world_size
    assert n * t1 / (t1 + small.allreduce_s) == pytest.approx(1.0)
    # a slower link needs a larger batch, in proportion
    ib = on_published(PUBLISHED[1], 1e9)
    assert ib.efficient_tokens > 8 * small.efficient_tokens
    with pytest.raises(ValueError, match="efficiency must lie"):
        on_published(nvlink, 1e9, efficiency=1.0)


def test_the_claims_bench_counts_each_claim_over_repeats_and_conditions():
    import re

    from labs.bench.claims import TimingExperiment, claims_table, tally
    from labs.experiments.scaling import crossover_experiment

    link, settings = Link(alpha=2e-3, bandwidth=50e6), StepSettings(width=64, layers=2, steps=2,
                                                                    warmup=1)
    experiment = TimingExperiment("test.crossover", "05_ddp",
                                  lambda: crossover_experiment(settings, link, (4, 32), 1))
    results = {experiment.name: {0: tally(experiment, 1), 1: tally(experiment, 1, busy=1)}}
    names = set(results[experiment.name][0])
    assert names == {"ch5.small-batch-slower", "ch5.below-crossover-slower",
                     "ch5.above-crossover-faster", "ch5.at-crossover"}
    for tallies in results[experiment.name].values():
        assert all(sum(t.outcomes.values()) == 1 for t in tallies.values())
    text = claims_table(results, 1)
    assert "quiet: as needed" in text and "1 burners: as needed" in text
    assert re.search(r"ch5\.at-crossover +any +1/1", text)


def test_the_bench_runs_chapter_2s_own_sweep():
    """The bench's chapter-2 sweep is the one the chapter's source runs."""
    import re
    from pathlib import Path

    from labs.bench.claims import CHAPTER2_SWEEP
    from labs.experiments import link_sweep

    source = (Path(__file__).resolve().parents[1] / "notebooks" / "02_cost_model.md").read_text()
    [line] = re.findall(r"^settings = link_sweep\.LinkSweepSettings\(.*$", source, re.M)
    namespace = {"link_sweep": link_sweep}
    exec(line, namespace)  # noqa: S102
    assert namespace["settings"] == CHAPTER2_SWEEP
    assert "LINK = link_sweep.CHAPTER_LINK" in source and CHAPTER2_SWEEP.link == namespace[
        "link_sweep"].CHAPTER_LINK


def test_the_bench_runs_the_chapters_own_link_and_model():
    """The bench's chapter-5 settings are the ones the chapter's source defines."""
    import re
    from pathlib import Path

    from labs.bench.claims import CHAPTER5_LINK, CHAPTER5_WIDE
    from labs.experiments import ddp as ex

    source = (Path(__file__).resolve().parents[1] / "notebooks" / "05_ddp.md").read_text()
    namespace = {"Link": Link, "ex": ex}
    for name in ("LINK", "WIDE"):
        [line] = re.findall(rf"^{name} = .*$", source, re.M)
        exec(line, namespace)  # noqa: S102
    assert namespace["LINK"] == CHAPTER5_LINK and namespace["WIDE"] == CHAPTER5_WIDE
