"""Chapter 9's faults on real ranks (labs.experiments.faults): a killed rank ends the launch
with a RankError naming it, within the group's timeout plus 5 s, and its peers see it within
that timeout; a stopped rank is seen only when the timeout runs out; stragglers' delays are
drawn before the run. Times are bounds here, not targets (the chapter shows them)."""

from __future__ import annotations

import statistics

import pytest

from labs.experiments.faults import (
    DeathSettings,
    StragglerSettings,
    expected_largest,
    harmonic,
    measure_death,
    measure_stragglers,
)


@pytest.mark.parametrize("collective", ["torch", pytest.param("ring", marks=pytest.mark.slow)])
def test_a_killed_rank_is_named_and_its_peers_see_it_before_the_timeout(collective):
    config = DeathSettings(world_size=3, victim=1, after_s=0.3, how="killed",
                           collective=collective, group_timeout_s=5.0)
    row = measure_death(config, timeout=60)
    assert row.named_rank == 1 and row.named_type == "RankDied"
    assert "killed by signal 9" in row.report
    assert len(row.detected_s) == 2  # both survivors saw it, as an error of their collective
    assert all(0 <= s < config.group_timeout_s for s in row.detected_s)
    assert row.launch_s < config.group_timeout_s + 5


@pytest.mark.parametrize("collective", [pytest.param("torch", marks=pytest.mark.slow), "ring"])
def test_a_stopped_rank_is_seen_only_when_the_groups_timeout_runs_out(collective):
    config = DeathSettings(world_size=2, victim=1, after_s=0.2, how="stopped",
                           collective=collective, group_timeout_s=1.5)
    row = measure_death(config, timeout=60)
    assert row.named_type == "PeerLost" and row.named_rank == 0  # the stopped rank says nothing
    (seen,) = row.detected_s
    assert config.group_timeout_s - 0.2 <= seen <= config.group_timeout_s + 3
    assert row.launch_s < config.group_timeout_s + 5


@pytest.mark.parametrize("change, message", [
    ({"world_size": 1}, "world_size must be an int >= 2"),
    ({"victim": 3}, "victim must be a rank, 0 to 2"),
    ({"how": "crashed"}, "how must be one of"),
    ({"collective": "nccl"}, "collective must be one of"),
    ({"group_timeout_s": 0}, "group_timeout_s > 0"),
])
def test_bad_fault_settings_say_what_to_pass(change, message):
    with pytest.raises(ValueError, match=message):
        DeathSettings(**{"world_size": 3, **change})


def test_the_largest_of_n_delays_is_drawn_before_the_run_and_expected_as_mean_times_h_n():
    config = StragglerSettings(mean_s=0.01, steps=4)
    assert config.delays(3) == config.delays(3)  # the same draws every time
    assert config.delays(3)[0] == [0.0, 0.0, 0.0]  # the untimed step has none
    assert harmonic(1) == 1.0 and harmonic(2) == 1.5
    assert expected_largest(0.01, 4) == pytest.approx(0.01 * (1 + 1 / 2 + 1 / 3 + 1 / 4))
    # many draws: the mean largest of 4 approaches 4's expectation, not 1's
    many = StragglerSettings(mean_s=1.0, steps=4000).delays(4)[1:]
    assert statistics.mean(max(row) for row in many) == pytest.approx(harmonic(4), rel=0.05)


def test_a_small_straggler_run_keeps_every_step_and_its_largest_delay():
    config = StragglerSettings(mean_s=0.005, steps=3)
    (row,) = measure_stragglers((2,), config, timeout=60)
    assert len(row.base) == len(row.delayed) == len(row.largest) == 3
    assert row.largest == tuple(max(r) for r in config.delays(2)[1:])
    assert row.predicted > 0 and row.expected > 0
    with pytest.raises(ValueError, match="world_sizes must be ints >= 2"):
        measure_stragglers((1,), config)
