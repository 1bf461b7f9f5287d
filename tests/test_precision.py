"""Mixed precision on real ranks: fp16's underflow and loss scaling, the sharded grad scaler
(an inf on one rank's shard skips the step on every rank), bf16 FSDP against fp32 (bytes,
dtypes, accuracy), and torch's fully_shard with a MixedPrecisionPolicy beside labs' FSDP.

The oracles: one process trained in fp32 on the whole batch (parity.reference_run and
labs.experiments.precision.reference_run), and the run without a scaler (a power-of-two scale
is exact, so scaled steps equal unscaled ones bit for bit). The tolerance bf16 reaches after
3 SGD steps of lr 0.1 on TiedNet, measured on torch 2.13 CPU: 3.0e-4 on the parameters,
1.2e-3 on the loss; the tests allow 1e-3 and 5e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from labs.collectives import Algorithm
from labs.experiments.precision import (
    Agreement,
    FeatureClassifier,
    MixedSettings,
    Precision,
    ScalerSettings,
    UnderflowSettings,
    fully_shard_on_ranks,
    max_parameter_difference,
    mean_loss,
    mixed_on_ranks,
    mixed_table,
    out_of_step,
    reference_run,
    scaler_on_ranks,
    scaler_table,
    side_by_side_table,
    trainable_names,
    underflow_rows,
    underflow_table,
)
from labs.fsdp import FSDP
from labs.fsdp_torch import fully_shard_available
from labs.precision import (
    ShardedGradScaler,
    format_range,
    round_trip,
)
from labs.wrappers import Wrapper
from labs.zero import shard_numel

from parity import TiedNet, launch, loss_of, rank_batch
from parity import reference_run as fp32_reference

BF16_PARAM_TOLERANCE = 1e-3
BF16_LOSS_TOLERANCE = 5e-3
MIXED = MixedSettings()
SCALER = ScalerSettings()

# --- the fact: fp16 underflows, a loss scale saves it, bf16 does not need one --------------------


def test_a_gradient_of_1e_8_is_zero_in_fp16_and_survives_a_loss_scale():
    assert format_range(torch.float16).smallest_subnormal == 2.0**-24
    assert format_range(torch.float16).largest == 65504.0
    tiny = torch.tensor([1e-8])
    assert round_trip(tiny, torch.float16).item() == 0.0
    torch.testing.assert_close(round_trip(tiny, torch.float16, 2.0**16), tiny, rtol=1e-3, atol=0)
    torch.testing.assert_close(round_trip(tiny, torch.bfloat16), tiny, rtol=2**-8, atol=0)
    # and a scale too large overflows: 1.0 x 2^17 is beyond fp16's largest, 65504
    assert math.isinf(round_trip(torch.tensor([1.0]), torch.float16, 2.0**17).item())


def test_part_of_the_mlps_gradient_is_lost_in_fp16_unless_the_loss_is_scaled():
    fp16, scaled, bf16 = underflow_rows(UnderflowSettings())
    assert (fp16.dtype, fp16.scale, scaled.scale, bf16.dtype) == (
        torch.float16, 1.0, 2.0**16, torch.bfloat16)
    assert fp16.elements == scaled.elements == bf16.elements > 0
    assert fp16.flushed > 0 and fp16.subnormal > fp16.elements // 2
    assert scaled.flushed == 0 and scaled.subnormal < fp16.subnormal // 100
    assert bf16.flushed == 0 and bf16.subnormal == 0
    assert all(r.overflowed == 0 for r in (fp16, scaled, bf16))
    assert scaled.median_relative_error < fp16.median_relative_error
    assert "flushed to 0" in underflow_table([fp16, scaled, bf16])


# --- the scaler's arguments and its order of calls (no ranks: one process, nothing sent) -------


@pytest.mark.parametrize("kwargs, match", [
    ({"init_scale": 0.0}, "init_scale must be a positive finite"),
    ({"init_scale": math.inf}, "init_scale must be a positive finite"),
    ({"growth_factor": 1.0}, "growth_factor must be a finite number > 1"),
    ({"backoff_factor": 1.0}, "backoff_factor must be between 0 and 1"),
    ({"growth_interval": 0}, "growth_interval must be a positive int"),
    ({"growth_interval": 2.5}, "growth_interval must be a positive int"),
])
def test_scaler_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedGradScaler(**kwargs)


def test_scaler_calls_out_of_order_are_refused():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = ShardedGradScaler()
    with pytest.raises(RuntimeError, match="found no inf/NaN check"):
        scaler.update()
    with pytest.raises(RuntimeError, match="no inf/NaN check for this optimizer"):
        scaler.found_inf(optimizer)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match="lacks"):
        scaler.load_state_dict({"scale": 2.0})
    with pytest.raises(TypeError, match="takes the loss tensor"):
        scaler.scale(1.0)


# --- the scaler on real ranks: nothing overflows ------------------------------------------------


def scaler_parity_worker(rank: int, world_size: int) -> dict[str, object]:
    """TiedNet under FSDP in fp32 (a frozen layer, a tied weight), SGD with momentum, three
    steps with a ShardedGradScaler (unscale_ called before step, as before clipping) and three
    without; and the scaler's schedule."""
    x, y = rank_batch(rank, world_size)
    out: dict[str, object] = {}
    for scaled in (True, False):
        model = FSDP(TiedNet(seed=rank), collectives=Algorithm.RING)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        scaler = ShardedGradScaler(growth_interval=2)
        states, scales = [], []
        for _ in range(3):
            optimizer.zero_grad()
            loss = loss_of(model, x, y)
            (scaler.scale(loss) if scaled else loss).backward()
            model.finish_gradient_synchronization()
            if scaled:
                scaler.unscale_(optimizer)
                assert not scaler.found_inf(optimizer)
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                optimizer.step()
            states.append(model.gather_full_params())
        out["scaled" if scaled else "plain"] = states
        if scaled:
            out["scales"] = scales
            resumed = ShardedGradScaler()
            resumed.load_state_dict(scaler.state_dict())
            out["resumed"] = (resumed.get_scale(), resumed.get_growth_tracker())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_scaled_steps_equal_plain_steps_and_one_process_when_nothing_overflows(world_size):
    want = fp32_reference("sgd")
    for rank, got in enumerate(launch(scaler_parity_worker, world_size, echo=False)):
        for step, (scaled, plain) in enumerate(zip(got["scaled"], got["plain"], strict=True)):
            for name in plain:  # a power-of-two scale: bit for bit
                assert torch.equal(scaled[name], plain[name]), (rank, step, name)
            for name in want[step]:
                torch.testing.assert_close(scaled[name], want[step][name],
                                           msg=f"rank {rank} step {step} {name}")
        # growth_interval=2: two good steps, then the scale doubles; the tracker restarts
        assert got["scales"] == [2.0**16, 2.0**17, 2.0**17]
        assert got["resumed"] == (2.0**17, 1)


# --- the scaler on real ranks: one rank overflows -----------------------------------------------


@pytest.fixture(scope="module")
def overflow_reports():
    """One launch per world size, both agreements in each."""
    return {n: scaler_on_ranks(n, SCALER) for n in (2, 4)}


def runs_of(reports, agreement):
    return [report.runs[agreement] for report in reports]


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(overflow_reports, world_size):
    runs = runs_of(overflow_reports[world_size], Agreement.ALL_RANKS)
    owner = SCALER.owner(world_size)
    assert owner != SCALER.overflow_rank  # rank 1's overflow landed in another rank's shard
    step = SCALER.overflow_step
    for rank, run in enumerate(runs):
        seen = run.steps[step]
        # only the owner of the row sees the inf, in (some of) the row's elements
        if rank == owner:
            assert 0 < seen.inf_elements <= SCALER.classes
        else:
            assert seen.inf_elements == 0, rank
        assert seen.found_inf_locally is (rank == owner)
        assert seen.skipped and not seen.shard_moved
        assert (seen.scale, seen.next_scale) == (SCALER.init_scale, SCALER.init_scale / 2)
        for name, value in run.states[step].items():  # the whole model, unchanged everywhere
            assert torch.equal(value, run.initial[name]), (rank, name)
        # the next steps proceed: nothing skipped, the scale grows back after 2 good steps
        later = run.steps[step + 1:]
        assert all(s.shard_moved and not s.skipped for s in later)
        assert [s.next_scale for s in later] == [2.0**11, 2.0**12, 2.0**12]
    for step_index in range(SCALER.steps):  # every rank holds the same gathered model
        for run in runs[1:]:
            for name, value in run.states[step_index].items():
                assert torch.equal(value, runs[0].states[step_index][name])
    assert out_of_step(runs) == []


@pytest.mark.parametrize("world_size", [2, 4])
def test_deciding_from_each_ranks_own_shard_leaves_the_ranks_out_of_step(overflow_reports,
                                                                           world_size):
    runs = runs_of(overflow_reports[world_size], Agreement.EACH_RANK)
    owner = SCALER.owner(world_size)
    step = SCALER.overflow_step
    skipped = [run.steps[step].skipped for run in runs]
    moved = [run.steps[step].shard_moved for run in runs]
    assert skipped == [rank == owner for rank in range(world_size)]
    assert moved == [rank != owner for rank in range(world_size)]
    # the gathered model is neither the skip (unchanged) nor a step: part of it moved
    state, initial = runs[0].states[step], runs[0].initial
    weight_moved = (state["weight"] != initial["weight"]).any(dim=1)  # per feature row
    assert weight_moved.any() and not weight_moved.all()
    assert not weight_moved[SCALER.overflow_feature]
    # and the scales differ from then on
    problems = out_of_step(runs)
    assert problems[0] == (f"step {step}: ranks [{owner}] skipped, ranks "
                           f"{[r for r in range(world_size) if r != owner]} stepped")
    assert any("scales differ" in p for p in problems)
    right = runs_of(overflow_reports[world_size], Agreement.ALL_RANKS)[0].states[-1]
    assert not torch.equal(runs[0].states[-1]["weight"], right["weight"])
    table = scaler_table(overflow_reports[world_size], Agreement.EACH_RANK)
    assert table.count("\n") == 1 + SCALER.steps * world_size  # header, rule, a row each


def test_one_rank_skips_alone(no_leftover_processes):
    # world size 1: the overflow is this rank's own; both agreements skip the same step
    settings = ScalerSettings(overflow_rank=0, steps=2,
                              agreements=(Agreement.ALL_RANKS, Agreement.EACH_RANK))
    (report,) = scaler_on_ranks(1, settings)
    for run in report.runs.values():
        assert [s.skipped for s in run.steps] == [True, False]
        assert 0 < run.steps[0].inf_elements <= settings.classes


# --- bf16 against fp32 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return reference_run(MIXED)


@pytest.fixture(scope="module")
def mixed_reports():
    return {n: mixed_on_ranks(n, MIXED) for n in (2, 4)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_all_gathers_exactly_half_the_bytes_of_fp32(mixed_reports, world_size):
    units = [MIXED.vocab * MIXED.dim, MIXED.dim * MIXED.dim + MIXED.dim]  # root (tied), hidden
    padded = sum(world_size * shard_numel(n, world_size) for n in units)
    per_phase = (world_size - 1) * padded // world_size  # elements one ring collective sends
    for report in mixed_reports[world_size]:
        runs = report.runs
        fp32, mixed, bf16 = (runs[p] for p in Precision)
        assert fp32.padded_numel == padded
        for step in range(MIXED.steps):
            # two all-gathers per unit and step (forward, backward), one reduce-scatter
            assert fp32.all_gather_bytes[step] == 2 * per_phase * 4
            assert mixed.all_gather_bytes[step] == bf16.all_gather_bytes[step] == 2 * per_phase * 2
            assert 2 * bf16.all_gather_bytes[step] == fp32.all_gather_bytes[step]
            assert fp32.reduce_scatter_bytes[step] == mixed.reduce_scatter_bytes[step]
            assert bf16.reduce_scatter_bytes[step] == per_phase * 2
            assert bf16.peak_bytes[step] < fp32.peak_bytes[step]
            assert bf16.model_state_peak[step] < fp32.model_state_peak[step]


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_keeps_fp32_master_shards_and_stays_within_tolerance_of_fp32(
        mixed_reports, reference, world_size):
    names = trainable_names(MIXED)
    reports = mixed_reports[world_size]
    for report in reports:
        for precision, run in report.runs.items():
            assert run.shard_dtypes == (torch.float32,)  # shards, their grads, SGD's state
            want = torch.float32 if precision is Precision.FP32 else torch.bfloat16
            assert run.compute_dtypes == (want,)  # the gathered vectors and the logits
        for step, want in enumerate(reference.states):  # fp32: the usual parity
            for name in names:
                torch.testing.assert_close(report.runs[Precision.FP32].states[step][name],
                                           want[name])
        for precision in (Precision.BF16_REDUCE_FP32, Precision.BF16):
            run = report.runs[precision]
            gaps = max_parameter_difference(run.states, reference.states, names)
            assert max(gaps) < BF16_PARAM_TOLERANCE, (precision, gaps)
            assert gaps[0] > 0  # bf16 did round: the tolerance is not vacuous
    for precision in Precision:
        losses = mean_loss([r.runs[precision] for r in reports])
        for got, want in zip(losses, reference.losses, strict=True):
            assert abs(got - want) < BF16_LOSS_TOLERANCE
    table = mixed_table(reference, reports, MIXED)
    assert "0.5" in table and Precision.BF16.value in table


def test_the_tolerance_check_fails_a_wrong_answer(reference):
    # a model whose parameters are off by 1e-2 is caught by the check the test above uses
    names = trainable_names(MIXED)
    wrong = [{k: v + 1e-2 for k, v in state.items()} for state in reference.states]
    assert min(max_parameter_difference(wrong, reference.states, names)) > BF16_PARAM_TOLERANCE


# --- torch's fully_shard with a MixedPrecisionPolicy ---------------------------------------------

AVAILABLE, WHY = fully_shard_available()


def test_fully_shard_in_bf16_matches_labs_fsdp_in_bf16(reference):
    reports = fully_shard_on_ranks(2, MIXED)
    if not AVAILABLE:
        assert all(r.skipped == WHY for r in reports)
        pytest.skip(WHY)
    names = trainable_names(MIXED)
    for report in reports:
        assert report.skipped is None
        assert report.dtypes[Wrapper.FSDP] == report.dtypes[Wrapper.FULLY_SHARD] == (
            torch.bfloat16, torch.float32)  # bf16 logits, fp32 parameters in the optimizer
        for ours, theirs in zip(report.states[Wrapper.FSDP], report.states[Wrapper.FULLY_SHARD],
                                strict=True):
            for name in names:
                torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-4)
        torch.testing.assert_close(report.losses[Wrapper.FSDP],
                                   report.losses[Wrapper.FULLY_SHARD], rtol=0, atol=1e-4)
    assert "fully_shard" in side_by_side_table(reference, reports, MIXED)


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: MixedSettings(batch=0), "batch must be a positive int"),
    (lambda: MixedSettings(lr=0), "lr must be a positive number"),
    (lambda: MixedSettings(precisions=()), "precisions must be a non-empty tuple"),
    (lambda: MixedSettings(precisions=("bf16",)), "precisions must be a non-empty tuple"),
    (lambda: ScalerSettings(steps=2, overflow_step=2), "overflow_step \\(2\\) must be one of"),
    (lambda: ScalerSettings(overflow_feature=12), "overflow_feature \\(12\\) must be one of"),
    (lambda: ScalerSettings(init_scale=math.nan), "init_scale must be a positive finite"),
    (lambda: ScalerSettings(agreements=()), "agreements must be a non-empty tuple"),
    (lambda: UnderflowSettings(scale=-1.0), "scale must be a positive finite"),
    (lambda: UnderflowSettings(layers=0), "layers must be a positive int"),
])
def test_bad_settings_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("run, match", [
    (lambda: mixed_on_ranks(3, MIXED), "cannot be split into 3 equal shares"),
    (lambda: scaler_on_ranks(1, SCALER), "overflow_rank 1 is not a rank of 1"),
    # 65 elements over 3 ranks: shards of 22; feature 4's row is elements 20..24
    (lambda: scaler_on_ranks(3, ScalerSettings(overflow_feature=4)), "is cut between two"),
    (lambda: scaler_on_ranks(0, SCALER), "world_size must be an int >= 1"),
])
def test_settings_that_do_not_fit_the_world_size_are_refused_before_any_rank_starts(
        refuse_processes, run, match):
    with refuse_processes(), pytest.raises(ValueError, match=match):
        run()


def test_the_overflowing_row_is_where_the_owner_says():
    # the flat vector is the weight (features x classes) then the bias; row j at j * classes
    model = FeatureClassifier(SCALER.features, SCALER.classes, seed=0)
    assert model.weight.shape == (SCALER.features, SCALER.classes)
    assert SCALER.numel == sum(p.numel() for p in model.parameters())
    assert [SCALER.owner(n) for n in (1, 2, 4)] == [0, 0, 0]
    assert ScalerSettings(overflow_feature=10).owner(2) == 1  # elements 50..54, shard of 33
