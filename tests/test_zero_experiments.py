"""Chapter 6's measurements: bytes held per rank against the closed forms, bytes sent against
2(N-1)/N and 3(N-1)/N, and the bytes-per-parameter arithmetic."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from labs import __main__ as labs_cli
from labs.experiments.zero import (
    LAB_SETTINGS,
    Group,
    Recipe,
    bytes_per_parameter,
    max_parameters,
    measure_memory,
    measure_traffic,
)
from labs.models import StepSettings
from labs.wrappers import ZERO_STAGES, Wrapper

# 8 layers of Linear(64, 64): 4160 parameters each, a multiple of 4, so no padding.
SETTINGS = StepSettings(width=64, layers=8, batch=8, steps=2, warmup=0)
P = SETTINGS.parameters


@pytest.mark.parametrize("world_size", [1, 4])
def test_steady_state_bytes_per_parameter_follow_the_stage(world_size):
    reports = measure_memory([world_size], SETTINGS)
    n = world_size
    expected = {  # bytes per parameter after the optimizer step: parameters, gradients, Adam
        Wrapper.DDP: (4, 4, 8),
        Wrapper.ZERO1: (4, 4 / n, 8 / n),
        Wrapper.ZERO2: (4, 4 / n, 8 / n),
        Wrapper.FSDP: (4 / n, 4 / n, 8 / n),
    }
    for strategy, (params, grads, state) in expected.items():
        final = reports[(strategy, n)].final.bytes_by_group()
        assert final[Group.PARAMETERS.value] == params * P, strategy
        assert final[Group.GRADIENTS.value] == grads * P, strategy
        # Adam also keeps a 4-byte step count per tensor it updates (16 at most here)
        assert final[Group.OPTIMIZER.value] == pytest.approx(state * P, abs=4 * 16)
    ddp = reports[(Wrapper.DDP, n)]
    assert ddp.final.bytes_by_group()[Group.BUFFERS.value] == 4 * P
    # the peaks: DDP holds everything at once; ZeRO-1 holds full gradients until the step;
    # ZeRO-2 and FSDP add what is in flight to 1/N of the rest
    assert ddp.peak_bytes == pytest.approx(16 * P, abs=4 * 16)
    assert reports[(Wrapper.ZERO1, n)].peak_bytes == pytest.approx((8 + 8 / n) * P, abs=64)
    if n == 4:  # (on one rank, FSDP's gathered copies make it the largest)
        assert (reports[(Wrapper.FSDP, n)].peak_bytes
                < reports[(Wrapper.ZERO2, n)].peak_bytes
                < reports[(Wrapper.ZERO1, n)].peak_bytes < ddp.peak_bytes)
        assert reports[(Wrapper.FSDP, n)].peak_bytes < 0.4 * ddp.peak_bytes


def test_fsdp_snapshots_see_every_gather_free_and_reduce_scatter():
    report = measure_memory([2], SETTINGS, [Wrapper.FSDP])[(Wrapper.FSDP, 2)]
    moments = [s.moment for s in report.snapshots]
    assert moments[0] == "start of step" and moments[-1] == "after optimizer step"
    assert sum(m.startswith("all-gather for forward") for m in moments) == SETTINGS.layers
    assert sum(m.startswith("reduce-scatter gradient") for m in moments) == SETTINGS.layers
    gathered = [report.bytes(s, (Group.PARAMETERS,)) for s in report.snapshots]
    assert max(gathered) > gathered[0] == gathered[-1] == 4 * P // 2  # back to the shard


def test_bytes_sent_follow_the_closed_forms():
    for row in measure_traffic([2, 4], SETTINGS):
        assert row.measured == pytest.approx(row.expected), row


@pytest.mark.parametrize("recipe, total", [(Recipe.FP32, 16), (Recipe.MIXED, 16),
                                           (Recipe.MIXED_FP32_GRADS, 18),
                                           (Recipe.MIXED_BOTH_GRADS, 20)])
def test_the_recipes_give_16_18_and_20_bytes_per_parameter(recipe, total):
    assert bytes_per_parameter(recipe, 0, 8).total == total
    assert bytes_per_parameter(recipe, 3, 8).total == total / 8


def test_stages_divide_what_the_zero_paper_says():
    one, two = bytes_per_parameter(Recipe.MIXED, 1, 4), bytes_per_parameter(Recipe.MIXED, 2, 4)
    assert (one.parameters, one.gradients, one.optimizer) == (2, 2, 3)
    assert (two.parameters, two.gradients, two.optimizer) == (2, 0.5, 3)
    with pytest.raises(ValueError):
        bytes_per_parameter(Recipe.FP32, 4, 2)


def test_max_parameters_on_four_8_gb_gpus():
    gb = 8 * 10**9
    assert max_parameters(gb, Recipe.FP32, 0, 4) == 500_000_000  # not the 2 B of the text
    assert max_parameters(gb, Recipe.FP32, 3, 4) == 2_000_000_000  # not 8 B


# --- python -m labs zero -----------------------------------------------------------------------


def _after_step(printed: str) -> dict[str, tuple[float, ...]]:
    """strategy -> bytes per parameter after the step (params, grads, Adam), from the
    memory table (the first table printed)."""
    found: dict[str, tuple[float, ...]] = {}
    for line in printed.splitlines():
        cells = re.search(r"(\d+\.\d+) / (\d+\.\d+) / (\d+\.\d+)", line)
        strategy = next((s.value for s in ZERO_STAGES if line.strip().startswith(s.value)), None)
        if cells and strategy and strategy not in found:
            found[strategy] = tuple(float(c) for c in cells.groups())
    return found


def test_lab_zero_prints_memory_and_traffic_per_strategy(capsys):
    labs_cli.main(["zero", "--world-size", "2", "--width", "64", "--layers", "2",
                   "--strategies", "ddp", "fsdp"])
    printed = capsys.readouterr().out
    held = _after_step(printed)
    assert held == {"DDP": (4.0, 4.0, 8.0), "FSDP (ZeRO-3)": (2.0, 2.0, 4.0)}, printed
    traffic = [line.split() for line in printed.splitlines() if line.startswith("FSDP")]
    assert traffic[-1][-2:] == ["1.5000", "1.5000"]  # 3(N-1)/N, measured and closed form


@pytest.mark.slow  # make test runs labs under torchrun in test_toy_allreduce (one node and two)
def test_lab_zero_runs_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "labs", "zero", "--width", "32",
         "--layers", "2", "--strategies", "zero2", "--backend", "gloo"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("rank 0 of 2") == 1, out.stdout  # printed once, by rank 0
    params, grads, adam = _after_step(out.stdout)["ZeRO-2"]
    assert (params, grads) == (4.0, 2.0) and adam == pytest.approx(4.0, abs=0.02), out.stdout


def test_lab_zero_refuses_bad_settings_before_any_rank_starts(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a launch started although the settings were bad")
    monkeypatch.setattr(labs_cli, "launch", refuse)
    with pytest.raises(SystemExit) as exit_info:
        labs_cli.main(["zero", "--width", "0"])
    assert exit_info.value.code == 2
    assert "width must be a positive int" in capsys.readouterr().err


def test_lab_zero_defaults_to_chapter_6s_experiment(monkeypatch):
    seen = []
    monkeypatch.setattr(labs_cli, "_run", lambda fn, n, args, *rest, **kw: seen.append(args))
    labs_cli.main(["zero", "--world-size", "2"])
    labs_cli.main(["zero", "--world-size", "2", "--width", "32", "--steps", "3"])
    assert seen[0][0] == LAB_SETTINGS
    assert seen[1][0] == dataclasses.replace(LAB_SETTINGS, width=32, steps=3)
