"""Chapter 2's algorithm map (labs.experiments.algorithm_map): which cases it leaves out, how a
cell is read (a disagreement must hold both ways, and a wrong winner is caught), the start
spread that makes naive calls look faster than their model, and a small map on real ranks
(slow)."""

from __future__ import annotations

import math
import re

import pytest

from labs import Link
from labs.collectives import Algorithm
from labs.experiments import algorithm_map as am
from labs.experiments import link_sweep as ls

RD, HD, RING, NAIVE = (Algorithm.RECURSIVE_DOUBLING, Algorithm.HALVING_DOUBLING, Algorithm.RING,
                       Algorithm.NAIVE)


def _timings(settings: am.MapSettings, factor: dict[tuple[int, int, Algorithm], float]
             ) -> list[ls.LinkTiming]:
    """Every case the map runs, measured at its model's time times ``factor`` (1 if absent)."""
    sweep = settings.sweep
    return [ls.LinkTiming(n, a, s, (p * factor.get((n, s, a), 1.0),), p, True, (0.0,))
            for n in sweep.world_sizes for s in sweep.sizes for a in sweep.algorithms
            if sweep.runs(a, s, n) for p in [sweep.predict(a, s, n)]]


def test_a_run_that_equals_the_model_agrees_in_every_cell():
    settings = am.MapSettings()
    cells = am.cells(_timings(settings, {}), settings)
    assert len(cells) == 3 * 7
    assert all(c.agrees for c in cells)
    assert all(c.measured in c.contenders for c in cells)


def test_a_winner_the_model_does_not_pick_fails_its_cell():
    settings = am.MapSettings()
    # N = 8, 64 KiB: the model picks recursive doubling alone (18.9 ms, HD 32.3 ms). Make
    # halving-doubling the measured winner, recursive doubling 10 % behind it.
    size = 1 << 16
    rd, hd = (settings.sweep.predict(a, size, 8) for a in (RD, HD))
    factor = {(8, size, HD): 0.5 * rd / hd, (8, size, RD): 0.55}
    cell = next(c for c in am.cells(_timings(settings, factor), settings)
                if (c.world_size, c.size_bytes) == (8, size))
    assert cell.predicted is RD and cell.contenders == (RD,)
    assert cell.measured is HD
    assert not cell.agrees
    assert "NO" in am.map_table([cell])


def test_a_winner_within_near_of_the_models_pick_is_no_disagreement():
    settings = am.MapSettings()
    size = 1 << 16
    rd, hd = (settings.sweep.predict(a, size, 8) for a in (RD, HD))
    # HD measured 3 % ahead of recursive doubling: within 5 % of the model's pick, measured.
    factor = {(8, size, HD): 0.97 * rd / hd}
    cell = next(c for c in am.cells(_timings(settings, factor), settings)
                if (c.world_size, c.size_bytes) == (8, size))
    assert cell.measured is HD and HD not in cell.contenders
    assert cell.agrees


def test_cases_far_behind_by_the_model_are_not_run_and_the_rest_are():
    sweep = am.MapSettings().sweep
    assert not sweep.runs(NAIVE, 1 << 24, 8)  # 7.6x the fastest
    assert sweep.repeats_of(NAIVE, 1 << 24, 8) == 0
    assert sweep.runs(RING, 1 << 24, 8) and sweep.repeats_of(RING, 1 << 24, 8) == 3
    everything = ls.LinkSweepSettings(algorithms=am.MAP_ALGORITHMS)
    assert everything.runs(NAIVE, 1 << 24, 8)  # skip_beyond None: every case runs


def test_the_model_map_names_the_models_choices():
    rows = {cells[0]: cells[1:] for line in am.model_map().splitlines()[2:]
            for cells in [re.split(r"\s{2,}", line.strip())]}
    assert rows["8"][0] == "naive"  # 4 KiB: two latencies in all
    assert rows["8"][-1] == "HD"  # 16 MiB
    assert rows["4"][-1] == "ring = HD"  # the ring's pipeline hides its latencies
    assert all(cell == "RD" for cell in rows["2"][:4])  # one swap: one latency


@pytest.mark.parametrize("settings, message", [
    (am.MapSettings(near=1.5), "near must lie"),
    (am.MapSettings(sweep=ls.LinkSweepSettings(skip_beyond=1.01)), "at least 1 \\+ near"),
    (am.MapSettings(sweep=ls.LinkSweepSettings(skip_beyond=0.5)), "skip_beyond must be"),
])
def test_bad_map_settings_are_refused_before_any_rank_starts(settings, message):
    with pytest.raises(ValueError, match=message):
        am.measure_map(settings)


def test_counted_from_the_first_start_a_call_adds_its_spread():
    t = ls.LinkTiming(4, NAIVE, 4096, (0.010, 0.012), 0.0105, True, (0.002, 0.0))
    assert t.ratio < 1  # timed from the last start: faster than the model
    assert t.from_first_start == pytest.approx((0.012, 0.012))
    assert min(t.from_first_start) >= t.predicted


def test_the_map_figure_marks_a_disagreement():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.patches import Rectangle

    from labs.viz.collectives import plot_algorithm_map

    settings = am.MapSettings()
    good = am.cells(_timings(settings, {}), settings)
    size = 1 << 16
    rd, hd = (settings.sweep.predict(a, size, 8) for a in (RD, HD))
    bad = am.cells(_timings(settings, {(8, size, HD): 0.5 * rd / hd, (8, size, RD): 0.55}),
                   settings)

    def red_frames(cells: list[am.MapCell]) -> int:
        fig = plot_algorithm_map(cells)
        return sum(isinstance(p, Rectangle) and p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)
                   for p in fig.axes[0].patches)

    assert red_frames(good) == 0
    assert red_frames(bad) == 1


@pytest.mark.slow
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_small_map_on_real_ranks_agrees_with_the_model():
    """Four ranks, three sizes, on a slow link (so that a late wake-up stays small): the
    measured winner is the model's in every cell, and every call gave the exact sum."""
    sweep = ls.LinkSweepSettings(link=Link(alpha=20e-3, bandwidth=12.5e6),
                                 sizes=(1 << 12, 1 << 20, 1 << 22), world_sizes=(4,),
                                 algorithms=am.MAP_ALGORITHMS, skip_beyond=2.0, repeats=2,
                                 min_seconds=0.0)
    timings, cells = am.measure_map(am.MapSettings(sweep=sweep))
    assert all(t.correct for t in timings)
    assert all(c.agrees for c in cells), am.map_table(cells)
    assert not math.isinf(cells[0].margin)
