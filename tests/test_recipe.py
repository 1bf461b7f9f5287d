"""Chapter 7's whole recipe (labs.experiments.recipe): the memory budget against a measured
step, a run saved on 4 ranks and resumed on 2, and the command line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from labs.experiments.recipe import (
    RecipeConfig,
    RecipeResult,
    budget_error,
    budget_table,
    build,
    memory_budget,
    peak_budget,
    peak_moment,
    recipe_worker,
    recomputed_block_bytes,
    unit_sizes,
)
from labs.rank_errors import RankError
from tests.parity import launch

SMALL = RecipeConfig(steps=2, d_model=32, n_heads=2, n_layers=3, seq_len=16)


def units_worker(rank: int, world_size: int, config: RecipeConfig) -> list[int]:
    model, _ = build(config, world_size)
    return [u.numel for u in model.units]


def test_the_budget_counts_the_units_that_fsdp_builds():
    assert launch(units_worker, 2, args=(SMALL,), echo=False)[0] == unit_sizes(SMALL)


def _budget_within_three_percent(accumulation: int, checkpointing: bool) -> None:
    # the recipe's own model (8 blocks of width 64), as the chapter measures it
    config = RecipeConfig(steps=2, accumulation=accumulation,
                          activation_checkpointing=checkpointing, measure_memory=True)
    result = launch(recipe_worker, 2, args=(config,), echo=False, timeout=120)[0]
    assert abs(budget_error(result)) <= 0.03, budget_table(result)
    # the check can fail: leave out the largest transient row and the sum falls short
    left_out = "recomputed block" if checkpointing else "activations"
    short = dataclasses.replace(result, budget=tuple(
        r for r in result.budget if r.name != left_out))
    assert budget_error(short) > 0.03


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_budget_rows_add_up_to_the_measured_peak_within_three_percent(checkpointing):
    _budget_within_three_percent(2, checkpointing)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_budget_holds_for_one_and_four_micro_batches(accumulation, checkpointing):
    _budget_within_three_percent(accumulation, checkpointing)


def test_on_cuda_the_budget_counts_float32_statistics_and_shows_the_allocators_peak():
    """Arithmetic, and the table a GPU run prints (tests/test_gpu.py runs it there): in bf16
    the activations grow by CUDA's float32 LayerNorm statistics, and the allocator's peak is
    set beside the tracked one with what lies between them."""
    config = RecipeConfig(dtype="bf16")
    rows = {r.name: r.model_bytes for r in peak_budget(config, 2, device_type="cuda")}
    cpu = {r.name: r.model_bytes for r in peak_budget(config, 2)}
    assert rows["activations"] > cpu["activations"]
    assert rows["parameters"] == cpu["parameters"]
    result = RecipeResult(rank=0, world_size=2, start_step=0, losses=(1.0,), grad_norms=(1.0,),
                          seconds=1.0, saved_steps=(), peak_bytes=3 * 2**20,
                          budget=tuple(peak_budget(config, 2, device_type="cuda")),
                          cuda_peak_bytes=4 * 2**20)
    lines = budget_table(result).splitlines()
    assert lines[-2].split()[:2] == ["torch.cuda.max_memory_allocated", "4.000"]
    assert lines[-1].split()[:5] == ["allocator", "-", "measured", "peak", "1.000"]
    assert "max_memory_allocated" not in budget_table(
        dataclasses.replace(result, cuda_peak_bytes=None))


def test_the_peak_budget_names_what_each_setting_holds():
    # arithmetic only: the moment the closed forms pick, and the rows that exist there
    on = RecipeConfig()  # k = 2, checkpointing
    names = {r.name: r.model_bytes for r in peak_budget(on, 2)}
    assert names["recomputed block"] > 0 and names["reduce-scatter in flight"] > 0
    assert peak_moment(on, 2) == 1  # the first reduce-scatter in flight, the rest unlanded
    off = dataclasses.replace(on, activation_checkpointing=False)
    assert "recomputed block" not in {r.name for r in peak_budget(off, 2)}
    # the calculator's rows (memory_budget) carry the same recomputed block
    large = {r.name: r.model_bytes for r in memory_budget(on, 2)}
    assert large["recomputed block"] == names["recomputed block"] == recomputed_block_bytes(on)
    assert "recomputed block" not in {r.name for r in memory_budget(off, 2)}
    assert peak_moment(off, 2) == 0  # the start of backward: every block's activations
    one = dataclasses.replace(on, accumulation=1)
    assert peak_moment(one, 2) == on.n_layers - 2  # landed shards outgrow the freed inputs


def test_a_run_saved_on_four_ranks_resumes_on_two_with_twice_the_accumulation(tmp_path):
    config = dataclasses.replace(SMALL, checkpoint=str(tmp_path / "run"))
    first = launch(recipe_worker, 4, args=(config,), echo=False, timeout=120)[0]
    assert first.saved_steps == (2,) and first.start_step == 0
    resumed = dataclasses.replace(config, steps=4, accumulation=2 * config.accumulation,
                                  resume=True)
    second = launch(recipe_worker, 2, args=(resumed,), echo=False, timeout=120)[0]
    assert second.start_step == 2 and len(second.losses) == 2
    assert second.losses[-1] < first.losses[0]  # it goes on learning from where it stopped
    # the same directory, resumed as another model: refused, naming what differs
    with pytest.raises(ValueError, match=r"holds another model: d_model=32 \(now 64\)"):
        dataclasses.replace(resumed, d_model=64, n_heads=2).check(2)


def test_a_crashed_run_resumed_from_its_checkpoint_has_every_loss_of_one_that_never_failed(
        tmp_path):
    whole = launch(recipe_worker, 2, args=(dataclasses.replace(
        SMALL, steps=5, checkpoint=str(tmp_path / "whole"), checkpoint_every=2),),
        echo=False, timeout=120)[0]
    crashing = dataclasses.replace(SMALL, steps=5, checkpoint=str(tmp_path / "crash"),
                                   checkpoint_every=2, fail_at_step=4)
    with pytest.raises(RankError) as caught:
        launch(recipe_worker, 2, args=(crashing,), echo=False, timeout=120)
    assert caught.value.rank == 1 and caught.value.exc_type == "InjectedFailure"
    assert "the last checkpoint holds step 2" in str(caught.value)
    resumed = launch(recipe_worker, 2, args=(dataclasses.replace(crashing, resume=True),),
                     echo=False, timeout=120)[0]
    assert resumed.start_step == 2  # step 3 was lost: at most checkpoint_every steps
    assert resumed.losses == whole.losses[2:]  # bit for bit


@pytest.mark.parametrize("change, world_size, message", [
    ({"fail_at_step": 0}, 2, "fail_at_step must be a step of the run"),
    ({"fail_at_step": 3}, 2, "fail_at_step must be a step of the run, 1 to steps=2"),
    ({"fail_at_step": 1}, 1, "needs at least 2 ranks"),
])
def test_a_failure_the_run_cannot_have_is_refused_before_any_process_starts(
        change, world_size, message, refuse_processes):
    with refuse_processes(), pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change).check(world_size)


@pytest.mark.slow
def test_torchrun_restarts_a_crashed_run_which_resumes_and_ends_with_the_same_loss(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    lab = ["-m", "labs", "fsdp", "--steps", "5", "--d-model", "32", "--layers", "2",
           "--checkpoint-every", "2"]
    whole = subprocess.run([sys.executable, *lab, "--world-size", "2", "--checkpoint",
                            str(tmp_path / "whole")], capture_output=True, text=True,
                           timeout=300, check=True).stdout
    crashed = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "--max-restarts=1",
                              *lab, "--checkpoint", str(tmp_path / "crash"), "--fail-at-step",
                              "4"], capture_output=True, text=True, timeout=300, check=False)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "torchrun restart 1: resumed from the checkpoint of step 2" in crashed.stdout
    assert "InjectedFailure" in crashed.stderr  # the first attempt's rank 1

    def final(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("final loss"))
    assert final(crashed.stdout).split(" on ")[0] == final(whole).split(" on ")[0]


def test_resuming_another_model_is_refused_before_any_process_starts(tmp_path,
                                                                     refuse_processes):
    with pytest.raises(Exception, match="index.json"):
        dataclasses.replace(SMALL, checkpoint=str(tmp_path), resume=True).check(2)


@pytest.mark.parametrize("change, message", [
    ({"dtype": "fp16"}, "dtype must be one of"),
    ({"max_norm": 0.0}, "max_norm must be positive"),
    ({"resume": True}, "need a checkpoint directory"),
    ({"d_model": 30, "n_heads": 4}, "must divide into n_heads"),
])
def test_bad_settings_are_refused_with_what_to_do(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change)


def test_the_command_line_trains_and_prints_the_budget():
    out = subprocess.run(
        [sys.executable, "-m", "labs", "fsdp", "--world-size", "2", "--steps", "2",
         "--d-model", "32", "--layers", "2", "--memory"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert "final loss" in out and "measured peak" in out
