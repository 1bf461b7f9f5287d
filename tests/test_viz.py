"""Chapter 2's figures, tables and panel, drawn from real ranks.

The ring frames are replayed from real traces (``Recorder(trace=True)`` on every rank): one
frame per ring step plus the start, for an all-reduce and for each phase alone, and a tampered
trace is refused. The traffic table's measured counts are checked against the closed forms,
and a wrong count is shown to be flagged. The collective panel is built and its default run
and a click both print a timing table.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from fractions import Fraction

import ipywidgets as w
import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labs.bench import collectives as bench_collectives  # noqa: E402
from labs.collectives import Algorithm, Collective, Phase, shard_bounds  # noqa: E402
from labs.experiments import sweep  # noqa: E402
from labs.experiments.collectives import (  # noqa: E402
    AgreementSettings,
    PlanningSettings,
    TraceSettings,
    Traffic,
    TrafficRow,
    TrafficSettings,
    compare_algorithms,
    expected_traffic,
    measure_planning,
    measure_traffic,
    run_ring_trace,
)
from labs.launcher import Backend  # noqa: E402
from labs.tables import ring_trace_table, traffic_table  # noqa: E402
from labs.viz import widgets  # noqa: E402
from labs.viz.collectives import plot_traffic, ring_animation, ring_frames, ring_steps_figure  # noqa: E402
from labs.wrappers import Wrapper


@pytest.fixture(scope="module")
def trace3():
    return run_ring_trace(3, TraceSettings(numel=7))


def _jshtml_frames(html: str) -> int:
    match = re.search(r"var frames = new Array\((\d+)\)", html)
    assert match, "no jshtml frame array in the animation"
    assert html.count("data:image/png;base64") == int(match.group(1))
    return int(match.group(1))


# --- ring frames and the animation ------------------------------------------------------------


def test_all_reduce_frames_replay_the_real_trace(trace3):
    n, numel = 3, 7
    frames = ring_frames(trace3.steps, n, numel)
    assert len(trace3.steps) == n * 2 * (n - 1)  # every rank, every step of both phases
    assert len(frames) == 2 * (n - 1) + 1
    assert [f.title for f in frames] == [
        "start", "reduce-scatter step 0", "reduce-scatter step 1",
        "all-gather step 0", "all-gather step 1",
    ]
    bounds = shard_bounds(numel, n)
    start = frames[0]
    for rank in range(n):
        assert torch.equal(torch.tensor([v for c in start.cells[rank] for v in c.values]),
                           TraceSettings(numel=numel).tensor(rank))  # read back from the trace
        assert all(c.contributors == {rank} for c in start.cells[rank])
    total = sum(TraceSettings(numel=numel).tensor(r) for r in range(n))
    for row in frames[-1].cells:
        assert all(c.contributors == set(range(n)) for c in row)
        assert torch.equal(torch.tensor([v for c in row for v in c.values]), total)
    after_scatter = frames[n - 1]
    for rank in range(n):  # rank r owns finished chunk r after the reduce-scatter
        own = after_scatter.cells[rank][rank]
        assert own.contributors == set(range(n))
        assert own.values == tuple(total[bounds[rank]:bounds[rank + 1]].tolist())
    for frame in frames[1:]:  # one message per rank per step, each to its right neighbour
        assert sorted((t.source, t.dest) for t in frame.transfers) == [
            (r, (r + 1) % n) for r in range(n)]


def test_partial_sums_grow_by_one_rank_per_step(trace3):
    frames = ring_frames(trace3.steps, 3, 7)
    for k, frame in enumerate(frames[1:3]):  # reduce-scatter steps 0 and 1
        for t in frame.transfers:
            assert len(frame.cells[t.dest][t.chunk].contributors) == k + 2


def test_animation_has_one_frame_per_step_plus_the_start(trace3):
    html = ring_animation(trace3.steps, 3, 7).data
    assert _jshtml_frames(html) == 2 * (3 - 1) + 1
    assert not re.search(r"https?://|<link|fa-", html)  # offline: no CDN icons or styles


@pytest.mark.parametrize("collective", [Collective.REDUCE_SCATTER, Collective.ALL_GATHER])
def test_one_phase_traces(collective):
    n, numel = 3, 5
    trace = run_ring_trace(n, TraceSettings(collective, numel))
    assert {s.phase for s in trace.steps} == {
        Phase.REDUCE_SCATTER if collective is Collective.REDUCE_SCATTER else Phase.ALL_GATHER}
    frames = ring_frames(trace.steps, n, numel)
    assert len(frames) == n  # N-1 steps plus the start
    assert _jshtml_frames(ring_animation(trace.steps, n, numel, dpi=40).data) == n
    everyone = set(range(n))
    if collective is Collective.ALL_GATHER:
        for rank, row in enumerate(frames[0].cells):  # only its own shard at the start
            assert [c is not None for c in row] == [c == rank for c in range(n)]
            assert row[rank].values == trace.inputs[rank]
        for row in frames[-1].cells:
            assert all(c is not None and c.contributors == everyone for c in row)
            assert tuple(v for c in row for v in c.values) == trace.outputs[0]
    else:
        for rank, row in enumerate(frames[-1].cells):
            assert row[rank].contributors == everyone
            assert row[rank].values == trace.outputs[rank]
            assert all(len(c.contributors) < n for i, c in enumerate(row) if i != rank)
    fig = ring_steps_figure(trace.steps, n, numel)
    assert len([ax for ax in fig.axes if ax.patches]) == len(frames)
    matplotlib.pyplot.close(fig)


def test_explicit_initial_values_give_the_same_frames(trace3):
    derived = ring_frames(trace3.steps, 3, 7)
    given = ring_frames(trace3.steps, 3, 7, initial=trace3.inputs)
    assert derived == given


def test_a_tampered_trace_is_refused(trace3):
    steps = list(trace3.steps)
    i = next(i for i, s in enumerate(steps) if s.phase is Phase.ALL_GATHER and s.rank == 1)
    steps[i] = dataclasses.replace(steps[i], received=tuple(v + 1 for v in steps[i].received))
    with pytest.raises(ValueError, match="not one ring run"):
        ring_frames(steps, 3, 7)
    with pytest.raises(ValueError, match="ranks"):
        ring_frames([s for s in trace3.steps if s.rank != 2], 3, 7)
    with pytest.raises(ValueError, match="empty"):
        ring_frames([], 1, 7)


def test_trace_table_has_a_row_per_step_and_a_column_per_rank(trace3):
    table = ring_trace_table(trace3.steps).splitlines()
    assert len(table) == 2 + 2 * (3 - 1)  # two phases of N-1 steps, N = 3
    assert table[0].split()[-2:] == ["rank", "2"]
    # rank 0 sends its own chunk 2 (elements 6 and 7 of 1..7) at reduce-scatter step 0 and
    # gets chunk 1 from rank 2, to which it adds its part
    first = table[2]
    assert re.search(r"reduce-scatter\s+0\s+sent 2, got 1 = ", first)


def test_trace_settings_refuse_unreadable_traces():
    with pytest.raises(ValueError, match="1..9 elements"):
        TraceSettings(numel=10).validate(4)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        run_ring_trace(8, TraceSettings(numel=8))


# --- traffic beside the closed forms ----------------------------------------------------------


def test_measured_traffic_equals_the_closed_forms():
    rows = measure_traffic(range(2, 9))
    assert len(rows) == 7 * 6  # N = 2..8, six algorithms
    assert all(row.matches for row in rows), traffic_table([r for r in rows if not r.matches])
    table = traffic_table(rows)
    assert "NO" not in table
    ring8 = next(r for r in rows if r.world_size == 8 and r.algorithm is Algorithm.RING)
    assert ring8.measured.sent == Fraction(7, 4)
    assert ring8.measured.group_messages == 2 * 8 * 7
    naive8 = next(r for r in rows if r.world_size == 8 and r.algorithm is Algorithm.NAIVE)
    assert naive8.measured == Traffic(7, Fraction(7), Fraction(7), 14)
    fig = plot_traffic(rows)
    assert [len(ax.lines) for ax in fig.axes] == [6, 6]
    matplotlib.pyplot.close(fig)


def test_a_wrong_count_is_flagged():
    right = expected_traffic(Algorithm.RING, 4)
    wrong = dataclasses.replace(right, sent=Fraction(3))
    row = TrafficRow(4, Algorithm.RING, wrong, right)
    assert not row.matches
    assert traffic_table([row]).splitlines()[-1].endswith("NO")


def test_closed_forms_of_recursive_doubling():
    assert expected_traffic(Algorithm.RECURSIVE_DOUBLING, 8) == Traffic(3, 3, 3, 24)
    # N = 6: P = 4, R = 2: ranks 1 and 3 also fold in and answer a neighbour
    assert expected_traffic(Algorithm.RECURSIVE_DOUBLING, 6) == Traffic(3, 3, 3, 4 * 2 + 4)
    with pytest.raises(ValueError, match="torch"):
        expected_traffic(Algorithm.TORCH, 4)


def test_halving_doubling_sends_what_its_closed_form_says():
    assert expected_traffic(Algorithm.HALVING_DOUBLING, 8) == \
        Traffic(6, Fraction(7, 4), Fraction(7, 4), 2 * 8 * 3)  # the ring's bytes, 2 log2 N steps
    # N = 6: P = 4, R = 2: ranks 1 and 3 also fold in and answer a neighbour (S each way)
    assert expected_traffic(Algorithm.HALVING_DOUBLING, 6) == \
        Traffic(5, Fraction(5, 2), Fraction(5, 2), 2 * 4 * 2 + 4)
    rows = measure_traffic((3, 6, 8), TrafficSettings(algorithms=(Algorithm.HALVING_DOUBLING,)))
    assert [r.world_size for r in rows] == [3, 6, 8]
    assert all(row.matches for row in rows), traffic_table(rows)


def test_the_double_tree_sends_what_its_closed_form_says():
    # from N = 4 the busiest rank is interior in one tree (two children) and a leaf in the other
    assert expected_traffic(Algorithm.DOUBLE_TREE, 8) == \
        Traffic(4, Fraction(2), Fraction(2), 4 * 7)
    rows = measure_traffic((2, 3, 5), TrafficSettings(algorithms=(Algorithm.DOUBLE_TREE,)))
    assert all(row.matches for row in rows), traffic_table(rows)


def test_traffic_settings_are_checked_before_launching():
    with pytest.raises(ValueError, match="does not divide"):
        measure_traffic([4], TrafficSettings(numel=10))
    with pytest.raises(ValueError, match="cannot be counted"):
        measure_traffic([2], TrafficSettings(algorithms=(Algorithm.TORCH,)))


def test_only_the_whole_tensor_ring_leaves_ranks_disagreeing():
    rows = compare_algorithms([3, 5], AgreementSettings(numel=512))
    assert {row.algorithm for row in rows} >= {Algorithm.WHOLE_TENSOR_RING, Algorithm.RING}
    for row in rows:
        if row.algorithm is Algorithm.WHOLE_TENSOR_RING:
            assert row.differing > 0
        else:
            assert row.differing == 0, row
        assert row.from_torch < 1e-5 and row.error < 1e-5


def test_planning_runs_the_kept_schedule_and_plans_the_dropped_one_again():
    found = measure_planning(3, PlanningSettings(size_bytes=4 * 301, iters=6, warmup=1))
    assert found.compiled == (0, 6)
    assert (found.world_size, found.size_bytes) == (3, 4 * 301)
    assert found.kept > 0 and found.planned > 0 and found.ratio > 0


@pytest.mark.parametrize("world_size, settings, match", [
    (1, PlanningSettings(), "out of range 2"),
    (33, PlanningSettings(), "out of range 2"),
    (2, PlanningSettings(size_bytes=6), "multiple of 4"),
    (2, PlanningSettings(size_bytes=0), "multiple of 4"),
    (2, PlanningSettings(iters=0), "iters must be at least 1"),
    (2, PlanningSettings(warmup=-1), "warmup at least 0"),
])
def test_planning_settings_are_checked_before_launching(world_size, settings, match,
                                                        refuse_processes):
    with refuse_processes(), pytest.raises(ValueError, match=match):
        measure_planning(world_size, settings)


# --- the collective panel ---------------------------------------------------------------------


def _recorded(monkeypatch):
    """What recorded_panel displays, kept (outside IPython nothing is shown)."""
    from labs.viz import recorded

    shown = []
    monkeypatch.setattr(recorded, "display", lambda obj, **_: shown.append(obj))
    return shown


def _parts(panel):
    controls = [c for c in panel.children if isinstance(c, w.ToggleButtons)]
    stack = next(c for c in panel.children if isinstance(c, w.Stack))
    live_row = panel.children[-2]
    return controls, stack, live_row.children[:-1], live_row.children[-1]


@pytest.mark.slow  # make test's budget (10 s): the zero panel's click runs its setting too
def test_collective_panel_records_its_grid_and_a_click_runs_the_chosen_setting(monkeypatch,
                                                                              capsys):
    shown = _recorded(monkeypatch)
    widgets.collective_panel(Collective.ALL_REDUCE, world_size=2, size_bytes=4096,
                             world_sizes=(2, 3), sizes=(4096,), iters=1)
    (panel,) = [s for s in shown if isinstance(s, w.VBox)]
    (world, size), stack, _extra, button = _parts(panel)
    assert world.options == (("2", 2), ("3", 3)) and len(size.options) == 1 and world.index == 0
    texts = [stack.children[i].children[0].outputs[0]["text"] for i in range(2)]
    for n, text in zip((2, 3), texts, strict=True):
        assert f"on {n} real ranks" in text and f"--world-sizes {n}" in text
        for algorithm in Algorithm:
            assert re.search(rf"all-reduce\s+{algorithm.value}\s+4K\s+[\d.]+", text), text
    world.index = 1
    button.click()
    clicked = capsys.readouterr().out
    assert re.search(r"on 3 real ranks", clicked) and "--world-sizes 3" in clicked


def test_panel_settings_refuse_bad_choices():
    with pytest.raises(ValueError, match="not one of them"):
        widgets.panel_settings(Collective.ALL_GATHER, 4, 4096, [Algorithm.NAIVE])
    with pytest.raises(ValueError, match="world"):
        widgets.panel_settings(Collective.ALL_REDUCE, 1, 4096)
    one = widgets.panel_settings(Collective.REDUCE_SCATTER, 4, 1 << 20)
    assert one.algorithms_of(Collective.REDUCE_SCATTER) == (Algorithm.RING, Algorithm.TORCH)
    assert "--collectives reduce-scatter" in widgets.sweep_command(one)


@pytest.mark.parametrize("changes", [
    {},
    {"min_bytes": 0},
    {"min_bytes": 3 << 20, "launches": 3, "threads": 2, "iters": 7, "warmup": 0},
    {"collectives": (Collective.ALL_REDUCE,), "algorithms": (Algorithm.RING, Algorithm.TORCH),
     "sizes": (1 << 20, 1 << 26), "world_sizes": (2, 4)},
    {"dtype": torch.bfloat16, "segment_bytes": (None, 1 << 20), "window": 4,
     "backends": (Backend.GLOO, Backend.NCCL), "timeout_s": 90.5},
])
def test_sweep_command_parses_back_into_the_same_settings(changes):
    settings = dataclasses.replace(sweep.SweepSettings(), **changes)
    words = shlex.split(widgets.sweep_command(settings))
    assert words[:4] == ["python", "-m", "labs.bench", "collectives"]
    parser = argparse.ArgumentParser()
    bench_collectives.add_collectives_parser(parser.add_subparsers())
    opts = parser.parse_args(words[3:])
    back = bench_collectives.settings_from_args(
        opts, world_sizes=tuple(opts.world_sizes), launches=opts.launches,
        backends=tuple(opts.backends), timeout_s=opts.timeout)
    assert back == settings


def test_toy_panel_records_each_world_size_and_a_click_uses_the_seed(monkeypatch, capsys):
    shown = _recorded(monkeypatch)
    widgets.toy_allreduce_panel(world_size=2, seed=0, world_sizes=(1, 2))
    (panel,) = [s for s in shown if isinstance(s, w.VBox)]
    (world,), stack, (seed_box,), button = _parts(panel)
    assert world.index == 1
    assert [leaf.outputs[0]["text"].split(":")[0] for leaf in stack.children] == [
        "world size 1, seed 0", "world size 2, seed 0"]
    world.index, seed_box.value = 0, 5
    button.click()
    assert "world size 1, seed 5" in capsys.readouterr().out
    assert not button.disabled and button.description == "Run on real ranks"


def test_zero_panel_offers_the_width_it_was_given_and_runs_the_chosen_one(monkeypatch):
    from labs.models import StepSettings

    shown, runs = _recorded(monkeypatch), []
    monkeypatch.setattr(widgets.zero, "show_zero_run", lambda *args: runs.append(args))
    base = StepSettings(width=48, layers=2, batch=8, steps=1, warmup=0)
    widgets.zero_panel(world_size=2, strategy=Wrapper.ZERO1, settings=base, world_sizes=(2,))
    assert runs == []  # the grid is recorded from measure_memory, not from a live run
    (panel,) = [s for s in shown if isinstance(s, w.VBox)]
    (_world, stage), stack, (width,), button = _parts(panel)
    assert stage.value is Wrapper.ZERO1
    recorded = stack.children[0].children[stage.index].outputs[0]["text"]
    assert recorded.startswith(f"{Wrapper.ZERO1.value}, world size 2,"), recorded
    assert width.value == 48 and 48 in width.options
    width.value = 128
    button.click()
    assert runs[-1] == (2, Wrapper.ZERO1, dataclasses.replace(base, width=128))

