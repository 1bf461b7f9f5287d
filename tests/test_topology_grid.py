"""Chapter 8's map of where the hierarchy wins (labs.experiments.topology.GridSettings,
model_grid, measure_grid) and the model of DDP / FSDP / HSDP's step on a topology
(labs.experiments.hsdp.model_step_seconds): the forms against hand derivations, the regions
the chapter names, bad settings refused before any process starts, and one latency-bound
cell timed on real ranks (slow)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from timing_bounds import follows  # noqa: E402

from labs import Link  # noqa: E402
from labs.cost_model import TopologyAlgorithm, predict_on_topology  # noqa: E402
from labs.experiments.hsdp import (  # noqa: E402
    LINK_SETTINGS,
    HsdpLinkSettings,
    HsdpSettings,
    backward_gather_seconds,
    model_step_seconds,
)
from labs.experiments.topology import (  # noqa: E402
    GridPoint,
    GridSettings,
    TopologyRow,
    TopologySettings,
    grid_table,
    measure_grid,
    model_grid,
)
from labs.viz.topology import plot_ratio_grid  # noqa: E402
from labs.wrappers import Wrapper  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

MULTI, HIER = TopologyAlgorithm.MULTI_RING, TopologyAlgorithm.HIERARCHICAL


# --- the grid ---------------------------------------------------------------------------------


def test_the_grid_is_the_cost_model_at_every_cell():
    settings = GridSettings()
    grid = model_grid(settings)
    assert [row[0].alpha for row in grid] == list(settings.inter_alphas)
    assert [p.bandwidth for p in grid[0]] == list(settings.inter_bandwidths)
    for row in grid:
        for p in row:
            topology = settings.topology(p.alpha, p.bandwidth)
            for a in (MULTI, HIER):
                assert p.model[a] == predict_on_topology(a, settings.size_bytes, 8, topology)
            assert p.measured is None


def test_the_grid_shows_the_three_regions_the_chapter_names():
    """Latency-bound (high alpha_e): the hierarchy wins by more than the bytes could give
    (7/6 at 4 nodes of 2); a slow network at low latency: close to 1; a network nearly as
    fast as the node's link at low latency: the channels win."""
    grid = model_grid(GridSettings())
    ratio = {(p.alpha, p.bandwidth): p.model_ratio for row in grid for p in row}
    assert ratio[(30e-3, 50e6)] > 1.5 > 7 / 6
    assert 1.0 < ratio[(1e-3, 5e6)] < 7 / 6
    assert ratio[(1e-3, 25e6)] < 0.85
    # more network latency always helps the hierarchy, at every bandwidth
    for j in range(4):
        column = [row[j].model_ratio for row in grid]
        assert column == sorted(column)


def test_the_saving_in_latencies_is_the_difference_of_the_forms():
    """Where the node's link is free and the network pays latency only, the channels cost
    2(N-1) alpha_e and the hierarchy 2(n-1) alpha_e: 14 against 6 at 4 nodes of 2."""
    settings = GridSettings(intra=Link(0.0, 1e15), inter_alphas=(1e-2,),
                            inter_bandwidths=(1e15,), measured=())
    (row,) = model_grid(settings)
    assert row[0].model[MULTI] == pytest.approx(14e-2)
    assert row[0].model[HIER] == pytest.approx(6e-2)


def test_a_measured_row_of_the_timed_table_is_reused_without_a_launch(refuse_processes):
    settings = GridSettings(measured=((1e-3, 5e6),))
    timed = TopologySettings(nodes=(2, 4), size_bytes=2 << 20, intra=Link(1e-3, 50e6),
                             inter=Link(1e-3, 5e6))
    calls = {a: [0.4, 0.39, 0.41] for a in TopologyAlgorithm}
    rows = [TopologyRow(n, 2 * n, calls, dict.fromkeys(TopologyAlgorithm, 1.0)) for n in (2, 4)]
    with refuse_processes():
        (point,) = measure_grid(settings, timed=(timed, rows))
    assert point.ratio == 1.0
    assert point.model_ratio == pytest.approx(
        model_grid(settings)[0][0].model_ratio)
    assert "channels / hier." in grid_table([point])
    fig = plot_ratio_grid(model_grid(settings), [point])
    plt.close(fig)


def test_an_unmeasured_point_says_so():
    point = GridPoint(1e-3, 5e6, {MULTI: 1.0, HIER: 1.0})
    with pytest.raises(ValueError, match="not measured"):
        _ = point.ratio


def test_bad_grids_are_refused_before_any_process_starts(refuse_processes):
    with refuse_processes():
        with pytest.raises(ValueError, match="inter_alphas"):
            GridSettings(inter_alphas=())
        with pytest.raises(ValueError, match="inter_alphas"):
            GridSettings(inter_alphas=(-1e-3,))
        with pytest.raises(ValueError, match="inter_bandwidths"):
            GridSettings(inter_bandwidths=(0.0,))
        with pytest.raises(ValueError, match="measured"):
            GridSettings(measured=((2e-3, 5e6),))
        with pytest.raises(ValueError, match="nodes"):
            GridSettings(nodes=0)
        with pytest.raises(TypeError, match="labs.Link"):
            GridSettings(intra=(1e-3, 50e6))
        with pytest.raises(ValueError, match="repeats"):
            GridSettings(repeats=0)


@pytest.mark.slow
def test_a_latency_bound_cell_on_real_ranks_follows_the_model():
    """2 nodes of 2, 20 ms between nodes, 64 KiB: latency-bound, the hierarchy about twice as
    fast as the channels (6 network latencies against 2 and two in the node)."""
    settings = GridSettings(nodes=2, size_bytes=64 << 10, inter_alphas=(20e-3,),
                            inter_bandwidths=(50e6,), measured=((20e-3, 50e6),), repeats=2)
    (point,) = measure_grid(settings, timeout=120)
    for a in (MULTI, HIER):
        assert follows(point.fastest(a), point.model[a]), (a, point)
    assert point.model_ratio > 1.8
    assert point.ratio > 1.5


# --- the model of a training step -----------------------------------------------------------


def test_the_step_model_is_the_sum_of_the_collectives():
    """The chapter's setting (4 Linear(256, 256) units of 65,792 elements, 2 nodes of 2,
    1 ms on both links, 50 MB/s inside, 5 MB/s between), by hand."""
    t_i = LINK_SETTINGS.intra.seconds
    t_e = LINK_SETTINGS.inter.seconds
    unit, size = 65792 * 4, 4 * 65792 * 4
    ddp = 2 * t_i(size / 2) + 2 * t_e(size / 4)
    hsdp = 4 * (3 * t_i(unit / 2) + 2 * t_e(unit / 4))
    assert model_step_seconds(Wrapper.DDP, LINK_SETTINGS) == pytest.approx(ddp)
    assert model_step_seconds(Wrapper.HSDP, LINK_SETTINGS, 0.01) == pytest.approx(hsdp + 0.01)
    # HSDP - DDP: the all-gather before backward, and latencies paid per unit (3 more units'
    # worth of 2 intra-node and 2 inter-node latencies)
    gather = backward_gather_seconds(LINK_SETTINGS)
    assert gather == pytest.approx(4 * t_i(unit / 2))
    latencies = 3 * (2 * LINK_SETTINGS.intra.alpha + 2 * LINK_SETTINGS.inter.alpha)
    assert hsdp - ddp == pytest.approx(gather + latencies)
    # FSDP: per unit three lock-step rings of 4 over the topology, each at least the
    # network's bytes of its three steps at the edge
    fsdp = model_step_seconds(Wrapper.FSDP, LINK_SETTINGS)
    assert fsdp > 4 * 3 * 3 * (unit / 4) / LINK_SETTINGS.inter.bandwidth
    assert fsdp > hsdp > ddp


def test_with_one_node_the_step_model_has_no_network_term():
    settings = HsdpLinkSettings(model=HsdpSettings(width=8, layers=2, world_size=2,
                                                   shard_size=2))
    t_i = settings.intra.seconds
    unit = (8 * 8 + 8) * 4
    assert model_step_seconds(Wrapper.HSDP, settings) == pytest.approx(2 * 3 * t_i(unit / 2))
    assert model_step_seconds(Wrapper.DDP, settings) == pytest.approx(
        predict_on_topology(HIER, 2 * unit, 2, settings.topology))
