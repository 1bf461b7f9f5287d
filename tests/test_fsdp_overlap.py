"""Chapter 7's FSDP step on the link (labs.experiments.fsdp_overlap): the model against steps
worked by hand, the profile read back from a timeline, bad settings refused, and one small
run on real ranks whose memory is exact (its times are the chapter's to show, not a test's)."""

from __future__ import annotations

import pytest

from labs import Link
from labs.experiments.fsdp_overlap import (
    OverlapSettings,
    Profile,
    check_settings,
    collective_seconds,
    measure,
    profile_of,
    simulate,
)

#: Two units, forward 10, backward 20, nothing between them; every collective costs 5.
TWO = Profile(forward=(10.0, 10.0), backward=(20.0, 20.0), before_forward=(0.0, 0.0),
              before_backward=(0.0, 0.0), tail=0.0)


@pytest.mark.parametrize("prefetch, reshard, step, stream", [
    # every gather waits for its unit; backward's gather of unit 0 queues behind unit 1's
    # reduce-scatter on the one stream
    (0, True, 90.0, [("0", "all-gather", 0, 5), ("1", "all-gather", 15, 20),
                     ("1", "all-gather", 30, 35), ("1", "reduce-scatter", 55, 60),
                     ("0", "all-gather", 60, 65), ("0", "reduce-scatter", 85, 90)]),
    # unit 1's gather travels while unit 0 computes, in forward and in backward
    (1, True, 75.0, [("0", "all-gather", 0, 5), ("1", "all-gather", 5, 10),
                     ("1", "all-gather", 25, 30), ("0", "all-gather", 30, 35),
                     ("1", "reduce-scatter", 50, 55), ("0", "reduce-scatter", 70, 75)]),
    # kept from forward: no gather in backward
    (0, False, 75.0, [("0", "all-gather", 0, 5), ("1", "all-gather", 15, 20),
                      ("1", "reduce-scatter", 50, 55), ("0", "reduce-scatter", 70, 75)]),
])
def test_the_model_replays_a_step_worked_by_hand(prefetch, reshard, step, stream):
    predicted = simulate(TWO, prefetch, reshard, 5.0, 5.0)
    assert predicted.step == step
    assert [(u, w, s, e) for u, w, s, e in predicted.stream] == stream
    assert predicted.busy == 60.0


def test_one_reduce_scatter_in_flight_holds_the_next_backward():
    """A reduce-scatter longer than a backward: unit 0's backward waits for unit 1's to land
    before its own is handed over (the wrapper lands one before starting the next)."""
    predicted = simulate(TWO, 1, False, 5.0, 30.0)
    # forward ends at 25; unit 1: backward 25-45, reduce 45-75; unit 0: backward 45-65, waits
    # to 75, reduce 75-105
    assert predicted.stream[-1] == ("0", "reduce-scatter", 75.0, 105.0)
    assert predicted.step == 105.0


def test_the_profile_is_read_back_from_a_timeline_without_its_waits():
    """A timeline made by the model, with 1 s of overhead before every unit and 2 s of tail:
    profile_of finds the compute and the overheads, not the waits."""
    with_gaps = Profile(TWO.forward, TWO.backward, (1.0, 1.0), (1.0, 1.0), 2.0)
    for prefetch, reshard in [(0, True), (1, True), (0, False)]:
        predicted = simulate(with_gaps, prefetch, reshard, 5.0, 5.0)
        spans = [*predicted.compute, *predicted.stream]
        assert profile_of(spans, predicted.step, 2) == with_gaps, (prefetch, reshard)


def test_a_collective_costs_one_chunk_per_step():
    link = Link(alpha=1e-3, bandwidth=1e6)
    assert collective_seconds(4000, 2, link) == pytest.approx(1e-3 + 2000 / 1e6)
    assert collective_seconds(4000, 4, link) == pytest.approx(3 * (1e-3 + 1000 / 1e6))


@pytest.mark.parametrize("bad, message", [
    ([(1, 1)], "an int >= 0 and a bool"),
    ([(-1, True)], "an int >= 0 and a bool"),
    ([(True, True)], "an int >= 0 and a bool"),
    ([], "at least one"),
])
def test_bad_settings_say_what_to_pass(bad, message):
    with pytest.raises(ValueError, match=message):
        check_settings(bad)


@pytest.mark.parametrize("field, value", [("world_size", 1), ("units", 0), ("tokens", 1.5),
                                          ("link", None)])
def test_bad_overlap_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"OverlapSettings.{field}"):
        OverlapSettings(**{field: value})


def test_a_small_run_on_real_ranks_holds_more_when_it_keeps_or_prefetches():
    config = OverlapSettings(units=3, width=64, tokens=256, steps=1,
                             link=Link(alpha=1e-4, bandwidth=1e9))
    rows = measure(config, [(0, True), (1, True), (0, False)], timeout=60)
    p0, p1, kept = rows
    # where the peak falls depends on the shape (the chapter's shows one unit more per unit
    # prefetched); at any shape prefetching holds no less, and keeping every unit's gathered
    # parameters from forward to backward holds more than one unit's more
    assert p1.peak_bytes >= p0.peak_bytes
    assert kept.peak_bytes - p0.peak_bytes >= config.unit_bytes
    for row in rows:
        gathers = sum(1 for s in row.spans if s[1] == "all-gather")
        assert gathers == (2 if row.reshard else 1) * config.units
        assert len(row.prediction.stream) == gathers + config.units
