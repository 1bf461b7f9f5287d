"""The model of DDP's step on a link (labs.experiments.overlap), on records written by hand:
the recurrence against schedules worked out on paper, a wrong schedule caught by the check,
NaiveDDP's account, and the tables and figures. No ranks start here (one test shows that a
bad input is refused before any would)."""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import pytest

from labs import Link
from labs.experiments.ddp import Case, StepTimeRow
from labs.experiments.overlap import (
    CallTiming,
    account_for_naive,
    allreduce_seconds,
    compare_to_model,
    measure_call_times,
    model_step,
    pairs_by_cap,
    serve_in_order,
    within,
)
from labs.experiments.sync_record import SyncRecord
from labs.viz.ddp import (
    naive_account_table,
    overlap_table,
    plot_bucket_sweep,
    plot_overlap_timeline,
    plot_step_times,
)
from labs.wrappers import Wrapper

#: 1 ms per message, 1 MB/s: an all-reduce of S bytes on 2 ranks costs 2 ms + S microseconds.
LINK = Link(alpha=1e-3, bandwidth=1e6)


@pytest.mark.parametrize("ready, seconds, expected", [
    # the wire is the bottleneck: each bucket waits for the one before it
    ([0, 1, 2], [3, 3, 3], [(0, 3), (3, 6), (6, 9)]),
    # backward is: each bucket starts when it is ready, the wire idles between them
    ([0, 10, 20], [1, 1, 1], [(0, 1), (10, 11), (20, 21)]),
    # a bucket ready before the one ahead of it still waits its turn
    ([5, 0], [1, 1], [(5, 6), (6, 7)]),
    # mixed: bucket 1 queues behind 0, bucket 2 finds the wire idle
    ([1, 2, 9], [2, 3, 1], [(1, 3), (3, 6), (9, 10)]),
    ([], [], []),
])
def test_one_server_takes_the_buckets_in_order(ready, seconds, expected):
    assert serve_in_order(ready, seconds) == expected


def test_a_duration_per_ready_time_or_an_error():
    with pytest.raises(ValueError, match="one duration per ready time"):
        serve_in_order([0, 1], [1])


@pytest.mark.parametrize("world_size, expected", [(2, 2e-3 + 1000e-6),
                                                  (4, 6 * (1e-3 + 250e-6))])
def test_the_price_of_an_all_reduce_is_labs_lock_step_ring(world_size, expected):
    # 2(N-1) messages of S/N bytes: at N = 2, 2 alpha + S / bandwidth
    assert allreduce_seconds(1000, world_size, LINK) == pytest.approx(expected)


def record(start: float, backward_end: float, ready: list[float], nbytes: list[int],
           schedule: list[tuple[float, float]], tail: float) -> SyncRecord:
    """A rank's record whose all-reduces ran as ``schedule`` says."""
    return SyncRecord(start, backward_end, tuple(ready), tuple(s for s, _ in schedule),
                      tuple(e for _, e in schedule), schedule[-1][1] + tail, tuple(nbytes))


def flat(spans: tuple[tuple[float, float], ...]) -> list[float]:
    return [t for span in spans for t in span]


#: Two buckets of 1000 bytes: 3 ms each on LINK.
NBYTES = [1000, 1000]


def test_the_model_of_a_step_by_hand():
    # rank 0 starts at 10.000 and has bucket 0 at 10.001, bucket 1 at 10.004 (backward ends
    # there); rank 1 starts at 10.0005 and is later with bucket 0 (10.002), earlier with 1.
    # Bucket 0 starts at 10.002 (the later rank), ends 10.005; bucket 1 is ready at 10.004,
    # waits for the wire until 10.005 and ends 10.008. Rank 0 then takes 1 ms to finish,
    # rank 1 0.5 ms: averaged at 10.009 and 10.0085.
    spans = [(10.002, 10.005), (10.005, 10.008)]
    records = [record(10.0, 10.004, [10.001, 10.004], NBYTES, spans, 1e-3),
               record(10.0005, 10.0035, [10.002, 10.003], NBYTES, spans, 0.5e-3)]
    step = model_step(records, LINK)
    assert step.ready == pytest.approx((2e-3, 4e-3))
    assert flat(step.modelled) == pytest.approx([2e-3, 5e-3, 5e-3, 8e-3])
    assert step.predicted == pytest.approx(9e-3)  # rank 0: 10.009 - 10.000
    assert step.measured == pytest.approx(9e-3)
    assert step.tail == pytest.approx(1e-3)
    assert step.on_the_wire == pytest.approx(6e-3) and step.idle == pytest.approx(0.0)
    # bucket 0 began at 10.002 on both ranks: 1 ms after rank 0's hook, at once on rank 1
    assert step.handoff == pytest.approx(1e-3)
    # the control: both buckets wait for the later end of backward (10.004): 10.004 + 6 ms
    after = model_step(records, LINK, after_backward=True)
    assert after.ready == pytest.approx((4e-3, 4e-3))
    assert flat(after.modelled) == pytest.approx([4e-3, 7e-3, 7e-3, 10e-3])
    assert after.predicted == pytest.approx(11e-3)
    assert after.handoff == 0.0


def test_backward_that_outlasts_the_wire_ends_the_step():
    # bucket 0 is done long before backward ends; finishing cannot start before it does
    spans = [(0.001, 0.004)]
    records = [record(0.0, 0.020, [0.001], [1000], spans, 0.0)]
    records = [dataclasses.replace(records[0], synchronised=0.0205)]
    step = model_step(records, LINK)
    assert step.tail == pytest.approx(0.5e-3)
    assert step.predicted == pytest.approx(0.0205)


def row_of(case: Case, steps: list[list[SyncRecord]]) -> StepTimeRow:
    measured = [max(r.synchronised - r.backward_start for r in step) for step in steps]
    return StepTimeRow(case, sorted(measured)[len(measured) // 2], len(steps[0][0].nbytes),
                       tuple(measured), tuple(measured), tuple(tuple(s) for s in steps))


def ideal_steps(ready: list[float], after_backward: bool, steps: int = 3
                ) -> list[list[SyncRecord]]:
    """Records of steps that ran exactly as one in-order server says, on two ranks: backward
    ends with the last bucket's gradient (overlapped) or at 10 ms (the control)."""
    backward_end = 0.010 if after_backward else max(ready)
    start_at = [backward_end] * len(ready) if after_backward else ready
    seconds = [allreduce_seconds(n, 2, LINK) for n in NBYTES]
    spans = serve_in_order(start_at, seconds)
    return [[record(0.0, backward_end, ready, NBYTES, spans, 0.2e-3)] * 2
            for _ in range(steps)]


def sweep_of_ideal_steps() -> list[StepTimeRow]:
    return [row_of(Case(Wrapper.DDP, 1.0), ideal_steps([0.001, 0.002], False)),
            row_of(Case(Wrapper.DDP, 1.0, overlap=False), ideal_steps([0.001, 0.002], True)),
            row_of(Case(Wrapper.DDP, 2.0), ideal_steps([0.005, 0.006], False)),
            row_of(Case(Wrapper.DDP, 2.0, overlap=False), ideal_steps([0.005, 0.006], True))]


def test_steps_that_ran_as_the_model_says_are_predicted_exactly():
    rows = compare_to_model(sweep_of_ideal_steps(), LINK)
    assert [r.after_backward for r in rows] == [False, True, False, True]
    assert all(r.error == pytest.approx(0.0, abs=1e-12) for r in rows)
    assert within(rows, 0.15) == [True] * 4
    (fast, control), _ = pairs_by_cap(rows)
    # overlapped: 1 ms + 6 ms of wire + 0.2 ms; after backward: 10 ms + 6 ms + 0.2 ms
    assert fast.measured == pytest.approx(7.2e-3) and control.measured == pytest.approx(16.2e-3)


def every_job_at_once(ready, seconds):  # noqa: ANN001, ANN201 - a Schedule
    """A wrong model: as if every all-reduce had a wire of its own."""
    return [(r, r + s) for r, s in zip(ready, seconds, strict=True)]


def test_a_model_that_ignores_the_order_fails_the_check():
    rows = compare_to_model(sweep_of_ideal_steps(), LINK, schedule=every_job_at_once)
    overlapped = [r for r in rows if not r.after_backward]
    # at 1 MiB: buckets from 1 and 2 ms, 3 ms each at once, + 0.2 ms: 5.2 ms for 7.2 measured
    assert within(overlapped, 0.15) == [False, False]
    assert all(r.error < -0.15 for r in rows)


def test_naive_ddps_time_taken_apart_by_hand():
    # 2 all-reduces of 1000 bytes (3 ms each on LINK) and 1 of 4000 (6 ms), after a
    # backward of 10 ms; in the steps each took 0.5 ms more than its price, and 0.1 ms went
    # between and after them. Timed alone: 0.4 ms and 0.7 ms more than the price.
    nbytes = [1000, 4000, 1000]
    spans, t = [], 0.010
    for n in nbytes:
        spans.append((t, t + allreduce_seconds(n, 2, LINK) + 0.5e-3))
        t = spans[-1][1] + 0.05e-3
    steps = [[record(0.0, 0.010, [0.010] * 3, nbytes, spans, 0.0)] * 2] * 3
    row = compare_to_model([row_of(Case(Wrapper.NAIVE, 25.0), steps)], LINK)[0]
    calls = [CallTiming(1000, 3e-3, (3.4e-3, 3.4e-3)), CallTiming(4000, 6e-3, (6.7e-3,))]
    account = account_for_naive(row, calls)
    assert [(s.nbytes, s.calls) for s in account.sizes] == [(1000, 2), (4000, 1)]
    assert account.sizes[0].overhead == pytest.approx(0.4e-3)
    assert account.sizes[1].in_run == pytest.approx(0.5e-3)
    assert account.backward == pytest.approx(0.010)
    assert account.between == pytest.approx(0.1e-3)
    assert account.link_price == pytest.approx(12e-3)
    assert account.overhead == pytest.approx(1.5e-3)
    # measured: 10 + 12 + 3 * 0.5 + 0.1 = 23.6 ms; accounted: 10 + 12 + 1.5 + 0.1
    assert account.measured == pytest.approx(23.6e-3)
    assert account.unaccounted == pytest.approx(0.0, abs=1e-12)
    table = naive_account_table(account)
    assert "all-reduces of 3.90625 KiB" in table and "+0.0" in table
    with pytest.raises(ValueError, match="no call timed"):
        account_for_naive(row, calls[:1])
    with pytest.raises(ValueError, match="NaiveDDP's row"):
        account_for_naive(compare_to_model(sweep_of_ideal_steps(), LINK)[0], calls)


def test_the_control_is_a_setting_of_labs_ddp_only():
    assert Case(Wrapper.DDP, 2.0, overlap=False).label == "DDP (2 MiB, after backward)"
    assert Case(Wrapper.DDP, 0.25).label == "DDP (256 KiB)"
    with pytest.raises(ValueError, match="overlap=False is a setting of labs' DDP"):
        Case(Wrapper.TORCH_DDP, 2.0, overlap=False)


@pytest.mark.parametrize("sizes, repeats", [([3], 4), ([0], 4), ([4.0], 4), ([8], 0)])
def test_bad_call_sizes_are_refused_before_any_process_starts(refuse_processes, sizes,
                                                              repeats):
    with refuse_processes(), pytest.raises(ValueError, match="sizes must be byte counts"):
        measure_call_times(2, sizes, LINK, repeats=repeats)


def test_the_tables_and_figures_draw_the_model_beside_the_measurement():
    rows = sweep_of_ideal_steps()
    models = compare_to_model(rows, LINK)
    table = overlap_table(models)
    assert table.count("+0.0 %") == 4 and "after backward" in table
    fast, control = pairs_by_cap(models)[0]
    for fig in (plot_overlap_timeline({"overlapped": fast.typical(),
                                       "after backward": control.typical()}),
                plot_bucket_sweep(rows, models=models), plot_step_times(rows)):
        plt.close(fig)
