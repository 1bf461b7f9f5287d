"""Chapter 9's faults on real ranks (labs.experiments.faults): a killed rank ends the launch
with a RankError naming it, within the group's timeout plus 5 s, and its peers see it within
that timeout; a stopped rank is seen only when the timeout runs out; stragglers' delays are
drawn before the run. Times are bounds here, not targets (the chapter shows them)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from labs.experiments.faults import (
    CostRow,
    DeathSettings,
    cost_table,
    cost_verdicts,
    first_desync,
    measure_death,
    run_desync,
)
from labs.experiments.recipe import RecipeConfig
from labs.experiments.recovery import torchrun_command
from labs.experiments.stragglers import (
    StragglerSettings,
    expected_largest,
    harmonic,
    measure_stragglers,
)


# make test-slow: chapter 9's stored run checks a killed rank under both all-reduces (nbval)
@pytest.mark.slow
@pytest.mark.parametrize("collective", ["torch", "ring"])
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


@pytest.mark.slow  # chapter 9 runs the stragglers at 2, 4 and 8 ranks, checked by nbval
def test_a_small_straggler_run_keeps_every_step_and_its_largest_delay():
    config = StragglerSettings(mean_s=0.005, steps=3)
    (row,) = measure_stragglers((2,), config, timeout=60)
    assert len(row.base) == len(row.delayed) == len(row.largest) == 3
    assert row.largest == tuple(max(r) for r in config.delays(2)[1:])
    assert row.predicted > 0 and row.expected > 0
    with pytest.raises(ValueError, match="world_sizes must be ints >= 2"):
        measure_stragglers((1,), config)


# --- desynchronized collectives and recovery (chapter 9's runs; nbval shows the rest) --------


def test_swapped_all_reduces_of_one_shape_sum_wrong_without_an_error_and_leave_logs():
    row = run_desync("swap", "none")
    assert [o.sums_right for o in row.outcomes] == [False, False]
    assert not any(o.error for o in row.outcomes) and not row.crash
    found = first_desync([list(o.log) for o in row.outcomes])
    assert found is not None and found[0] == 1  # the first entries differ in their lines
    assert sorted(found[1].values()) == [(0,), (1,)]


def test_bad_desync_settings_say_what_to_pass():
    with pytest.raises(ValueError, match="kind must be one of"):
        run_desync("late", "none")
    with pytest.raises(ValueError, match="watcher one of"):
        run_desync("skip", "gdb")


def test_the_torchrun_command_holds_the_run_or_says_what_it_cannot_hold(tmp_path):
    config = RecipeConfig(steps=8, d_model=32, n_layers=2, dtype="fp32",
                          activation_checkpointing=False)
    command = torchrun_command(config, str(tmp_path), fail_at_step=6, checkpoint_every=3)
    assert command[:4] == ["torchrun", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=1"]
    assert command[command.index("--fail-at-step") + 1] == "6"
    assert "--no-checkpointing" in command
    with pytest.raises(ValueError, match="no --heads or --seq-len"):
        torchrun_command(dataclasses.replace(config, seq_len=16), str(tmp_path), 6, 3)


def test_a_watchers_cost_is_read_against_the_machines_own_spread():
    """Arithmetic of the cost table: fastest blocks against fastest, and a verdict that says
    whether the difference stands above the unchecked blocks' spread (median - fastest)."""
    ms = 1e-3
    row = CostRow("all_reduce of 4 KiB", {"none": (1.0 * ms, 1.5 * ms, 1.2 * ms),
                                          "detail": (3.0 * ms, 3.1 * ms, 3.3 * ms),
                                          "labs": (1.1 * ms, 1.0 * ms, 1.4 * ms)})
    assert row.seconds == {"none": 1.0 * ms, "detail": 3.0 * ms, "labs": 1.0 * ms}
    assert row.spread("none") == pytest.approx(0.2 * ms)
    assert cost_verdicts([row]) == [
        "all_reduce of 4 KiB: DETAIL adds +2000 µs, more than the unchecked blocks' spread "
        "(200 µs)",
        "all_reduce of 4 KiB: check_collectives adds +0 µs, not more than the unchecked "
        "blocks' spread (200 µs)"]
    assert "1000 / 1200" in cost_table([row]) and "+2000" in cost_table([row])
