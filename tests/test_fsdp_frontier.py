"""Chapter 7's FSDP beside DDP as the link gets faster (labs.experiments.fsdp_frontier) and
labs' FSDP beside fully_shard on gloo's transport (labs.experiments.fully_shard_timing): the
crossover and both models against values worked by hand, bad input refused, and one small
run of each on real ranks (their times are the chapter's to show, not a test's)."""

from __future__ import annotations

import math
import statistics

import matplotlib.pyplot as plt
import pytest

from labs import Link
from labs.experiments import fully_shard_timing
from labs.experiments.fsdp_frontier import (
    CallCosts,
    Curve,
    FrontierPoint,
    crossover,
    curves,
    measure_frontier,
)
from labs.experiments.fsdp_overlap import OverlapSettings, Profile, simulate
from labs.experiments.sync_record import SyncRecord
from labs.viz.fsdp_overlap import frontier_table, plot_frontier, transport_table

BANDS = (1.0, 2.0, 4.0, 8.0, 16.0)


def _curve(fsdp: tuple[float, ...], ddp: tuple[float, ...]) -> Curve:
    # with free communication FSDP's step is 110, DDP's 100: each waits for the rest
    return Curve(BANDS, fsdp, ddp, fsdp_free=110.0, ddp_free=100.0)


def test_the_crossover_is_where_fsdp_stops_waiting_longer_than_ddp():
    # FSDP waits 140, 109, 130, 110, 110; DDP 100 each time: the extra waits are 40, 9, 30,
    # 10, 10, and from 8 on they stay within 10 % of DDP's step (20)
    curve = _curve((250.0, 219.0, 240.0, 220.0, 220.0), (200.0,) * 5)
    assert crossover(curve) == 8.0
    # 10 % of DDP's step is the slack: an extra wait of 19 is met, 21 is not
    assert crossover(_curve((229.0,) * 5, (200.0,) * 5)) == 1.0
    assert crossover(_curve((231.0,) * 5, (200.0,) * 5)) == math.inf


def test_a_crossover_that_took_the_first_meeting_point_would_fail():
    """The wrong reading (the first bandwidth where they meet, though they part again)."""
    curve = _curve((250.0, 219.0, 240.0, 220.0, 220.0), (200.0,) * 5)

    def first_meeting(c: Curve) -> float:
        return next(b for b, f, d in zip(c.bandwidths, c.fsdp, c.ddp, strict=True)
                    if (f - c.fsdp_free) - (d - c.ddp_free) <= 0.10 * d)
    assert first_meeting(curve) != crossover(curve)


#: One unit's profile (seconds): forward 0.02, backward 0.04, nothing between.
ONE = Profile(forward=(0.02, 0.02), backward=(0.04, 0.04), before_forward=(0.0, 0.0),
              before_backward=(0.0, 0.0), tail=0.0)
SMALL = OverlapSettings(units=2, width=64, tokens=16, steps=2)
LINK = Link(alpha=1e-3, bandwidth=1e6)


def _record(ready: tuple[float, ...], backward_end: float) -> SyncRecord:
    done = tuple(r + 0.001 for r in ready)
    return SyncRecord(0.0, backward_end, ready, ready, done, max(backward_end, done[-1]) + 0.002,
                      (4000,) * len(ready))


def _point(costs: CallCosts) -> FrontierPoint:
    records = ((_record((0.01, 0.05), 0.06), _record((0.012, 0.05), 0.061)),)
    return FrontierPoint(LINK, (0.15,), 0.12, (0.093,), 0.002, ONE, records, 0.03, costs, SMALL)


def test_the_models_add_each_calls_measured_cost_to_its_price():
    free = _point(CallCosts(0.0, 0.0, 0.0))
    costly = _point(CallCosts(0.002, 0.003, 0.008))
    price = (SMALL.unit_bytes / 2) / LINK.bandwidth + LINK.alpha  # N = 2: one chunk
    assert free.fsdp_model() == simulate(ONE, 1, True, price, price).step
    assert costly.fsdp_model() == simulate(ONE, 1, True, price + 0.002, price + 0.003).step
    # DDP: two buckets of 4000 bytes, each 2 (alpha + 2000 / bw) = 6 ms on the link; ready at
    # 12 and 50 ms (the later rank's), backward ends at 61 ms; the second ends at 56 (free:
    # hidden) or 64 ms (+8 ms each), then the 2 ms tail and the 30 ms outside the backward
    assert free.ddp_model() == pytest.approx(0.03 + 0.061 + 0.002)
    assert costly.ddp_model() == pytest.approx(0.03 + 0.064 + 0.002)


def test_the_models_meet_on_a_fast_link_and_not_on_a_slow_one():
    point = _point(CallCosts(0.0, 0.0, 0.0))
    # free communication: FSDP's profile alone; DDP's backward (61 ms), tail and the rest
    assert point.fsdp_model_free() == pytest.approx(0.12)
    assert point.ddp_model_free() == pytest.approx(0.03 + 0.061 + 0.002)
    curve = curves(point, low=1e4, high=1e9, count=30)
    assert curve.fsdp[0] > 2 * curve.ddp[0]  # 1.5 x the bytes, and less to hide behind
    assert 1e4 < crossover(curve) < 1e9


def test_bad_links_and_settings_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="labs.Link"):
        measure_frontier(SMALL, links=[])
    with pytest.raises(ValueError, match="labs.Link"):
        measure_frontier(SMALL, links=[25e6])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="unknown settings"):
        fully_shard_timing.measure_transport(SMALL, names=["fully_shard, prefetch 3"])


def test_a_small_frontier_runs_on_real_ranks_and_draws():
    points = measure_frontier(SMALL, links=[Link(alpha=1e-4, bandwidth=1e9)], timeout=60)
    (point,) = points
    assert len(point.fsdp_seconds) == len(point.ddp_seconds) == SMALL.steps
    assert 0 < point.fsdp_busy <= point.fsdp and 0 <= point.ddp_exposed <= point.ddp
    assert len(point.ddp_records) == SMALL.steps
    assert all(len(step) == SMALL.world_size for step in point.ddp_records)
    assert len(point.ddp_records[0][0].nbytes) == SMALL.units  # a bucket per block
    assert point.fsdp_model() > 0 and point.ddp_model() > 0
    assert "FSDP/DDP" in frontier_table(points)
    curve = curves(point, count=5)
    plt.close(plot_frontier(points, curve, crossover(curve)))


def test_fully_shard_runs_beside_labs_on_gloos_transport():
    ok, why = fully_shard_timing.fully_shard_available("cpu")
    if not ok:
        pytest.skip(why)
    rows = fully_shard_timing.measure_transport(SMALL, timeout=90)
    names = [r.name for r in rows]
    assert names == [*fully_shard_timing.TRANSPORT_SETTINGS, *fully_shard_timing.ALONE]
    assert all(len(r.seconds) == SMALL.steps and r.median > 0 for r in rows)
    assert statistics.median(rows[0].seconds) == rows[0].median
    table = transport_table(rows)
    assert "fully_shard, defaults" in table and "compute alone" in table


def test_without_fully_shard_on_the_cpu_its_rows_are_left_out_and_said_so(monkeypatch,
                                                                           capsys):
    monkeypatch.setattr(fully_shard_timing, "fully_shard_available",
                        lambda device: (False, "skipped: fully_shard needs torch >= 2.7"))
    rows = fully_shard_timing.measure_transport(
        SMALL, names=[fully_shard_timing.LABS_PREFETCH_1, fully_shard_timing.FULLY_SHARD_KEEP],
        timeout=60)
    assert [r.name for r in rows] == [fully_shard_timing.LABS_PREFETCH_1,
                                      *fully_shard_timing.ALONE]
    assert "needs torch >= 2.7" in capsys.readouterr().out
