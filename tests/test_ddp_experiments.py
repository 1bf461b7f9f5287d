"""Chapter 5's experiments on real ranks: what they count and record (never how fast)."""

from __future__ import annotations

import pytest
import torch

from labs import RankError, launch
from labs.ddp import assign_buckets, trainable_parameters
from labs.experiments.ddp import (
    Case,
    SamplerSettings,
    StepSettings,
    bucket_plan,
    bucket_sweep_cases,
    coverage,
    default_cases,
    evaluation_worker,
    measure_accumulation,
    measure_step_times,
    measure_timelines,
    mlp,
    sampler_views,
    torch_bucket_counts,
)
from labs.experiments.pitfalls import (
    ChangeAfterWrapping,
    Logging,
    TwoHeads,
    change_after_wrapping_worker,
    checkpoint_worker,
    logging_worker,
    seeding_worker,
    unused_parameter_first_step_worker,
    unused_parameter_worker,
)
from labs.viz.ddp import accumulation_table, sampler_table, step_time_table
from labs.wrappers import Wrapper

SMALL = StepSettings(width=32, layers=3, batch=8, steps=2, warmup=1,
                     bucket_cap_mb=(32 * 32 + 32) * 4 / 2**20)  # one layer per bucket


@pytest.mark.parametrize("build", [lambda seed: mlp(SMALL, seed), TwoHeads],
                         ids=["mlp", "TwoHeads"])
def test_models_follow_their_seed_and_leave_the_callers_random_state_alone(build):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = [p.detach().clone() for p in build(5).parameters()]
    assert torch.equal(torch.rand(3), expected)  # as if the model had not been built
    again, other = list(build(5).parameters()), list(build(6).parameters())
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("field, value", [("width", 0), ("steps", -1), ("warmup", -1),
                                          ("accumulation", 0), ("bucket_cap_mb", 0.0),
                                          ("layers", 2.5)])
def test_step_settings_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        StepSettings(**{field: value})


def test_step_times_cover_every_case_and_count_its_all_reduces():
    cases = default_cases(SMALL.bucket_cap_mb)
    rows = measure_step_times(2, SMALL, cases, launches=2)
    assert [r.case for r in rows] == cases
    buckets = {r.case.wrapper: r.buckets for r in rows}
    assert buckets == {Wrapper.LOCAL: 0, Wrapper.NAIVE: 6,
                       Wrapper.DDP: 3, Wrapper.TORCH_DDP: 3}
    assert all(r.seconds > 0 for r in rows)
    table = step_time_table(rows)
    assert "1.00x" in table and "NaiveDDP" in table


def torch_buckets_per_iteration(rank: int, world_size: int, cap_mb: float) -> list[int]:
    return torch_bucket_counts(SMALL, cap_mb, iterations=3)


@pytest.mark.parametrize("cap_mb", [SMALL.bucket_cap_mb, 1.0])
def test_torch_ddp_starts_with_one_bucket_then_rebuilds_to_the_labs_plan(cap_mb):
    planned = len(assign_buckets(trainable_parameters(mlp(SMALL)), cap_mb))
    for counts in launch(torch_buckets_per_iteration, 2, args=(cap_mb,), echo=False):
        assert counts == [1, planned, planned]
    assert planned == (3 if cap_mb < 1 else 1)


def test_a_bucket_sweep_has_both_bucketed_implementations_at_every_cap():
    cases = bucket_sweep_cases([0.01, 1.0])
    assert Case(Wrapper.DDP, 1.0) in cases and Case(Wrapper.TORCH_DDP, 0.01) in cases
    assert len(cases) == 6


def test_the_timeline_shows_ddp_launching_during_backward_and_naive_after_it():
    timelines = measure_timelines(2, SMALL)
    for t in timelines[Wrapper.DDP]:
        assert [s.label for s in t.allreduces] == ["bucket 0", "bucket 1", "bucket 2"]
        assert t.allreduces[0].start < t.backward_end  # launched while backward ran
        assert len(t.grad_ready) == 6
        assert all(s.start <= s.end <= t.synchronised for s in t.allreduces)
    for t in timelines[Wrapper.NAIVE]:
        assert len(t.allreduces) == 6
        assert all(s.start >= t.backward_end for s in t.allreduces)  # only after backward
        assert {s.label for s in t.allreduces} == set(t.grad_ready)
        assert t.in_flight(t.backward_end) == 0.0 and t.overlap_efficiency == 0.0
    ddp = timelines[Wrapper.DDP][0]
    assert 0.0 < ddp.in_flight(ddp.backward_end) <= ddp.in_flight()
    assert 0.0 < ddp.overlap_efficiency <= 1.0


def test_the_overlap_efficiency_counts_communication_under_backward_once():
    from labs.experiments.ddp import BackwardTimeline, Span

    spans = (Span("bucket 0", 1.0, 3.0), Span("bucket 1", 2.0, 5.0), Span("bucket 2", 6.0, 7.0))
    t = BackwardTimeline(Wrapper.DDP, 4.0, {}, spans, 7.5)
    assert t.in_flight() == 5.0  # 1-5 and 6-7: the overlapping buckets counted once
    assert t.in_flight(t.backward_end) == 3.0 and t.overlap_efficiency == 0.6


def test_no_sync_makes_k_micro_batches_cost_one_all_reduce_per_bucket():
    settings = StepSettings(width=32, layers=3, batch=8, steps=2, warmup=1, accumulation=4,
                            bucket_cap_mb=SMALL.bucket_cap_mb)
    rows = measure_accumulation(2, settings)
    calls = {(r.wrapper, r.no_sync): r.allreduces for r in rows}
    for impl in (Wrapper.DDP, Wrapper.TORCH_DDP):
        assert calls[(impl, False)] == 4 * 3  # every micro-batch all-reduces every bucket
        assert calls[(impl, True)] == 3
    assert "all-reduces per step" in accumulation_table(rows)


def test_the_sampler_partitions_pads_and_reshuffles_per_epoch():
    views = sampler_views(4, SamplerSettings(size=10, shuffle=True, epochs=2))
    padded = coverage(views, 10)
    assert padded.read == 12 and padded.distinct == 10 and len(padded.duplicated) == 2
    assert views[0].epochs[0] != views[0].epochs[1]  # set_epoch reshuffles
    frozen = sampler_views(4, SamplerSettings(size=10, set_epoch=False, epochs=2))
    assert all(v.epochs[0] == v.epochs[1] for v in frozen)  # without it: the same order
    ordered = sampler_views(2, SamplerSettings(size=6, shuffle=False, epochs=1))
    assert [v.epochs[0] for v in ordered] == [(0, 2, 4), (1, 3, 5)]  # interleaved
    dropped = coverage(sampler_views(4, SamplerSettings(size=10, drop_last=True)), 10)
    assert dropped.read == 8 and not dropped.duplicated and len(dropped.missing) == 2
    own_seed = coverage(sampler_views(4, SamplerSettings(size=40, per_rank_seed=True)), 40)
    assert own_seed.duplicated and own_seed.missing
    assert "epoch 1" in sampler_table(views)


def test_padding_double_counts_in_evaluation():
    per_rank = launch(evaluation_worker, 4, args=(10, False), echo=False)
    correct, seen = map(sum, zip(*per_rank, strict=True))
    assert (correct, seen) == (5, 12)  # samples 0 and 1 are read twice; the truth is 4/10


def test_bucket_plan_names_what_each_bucket_holds():
    plan = bucket_plan(mlp(SMALL), SMALL.bucket_cap_mb)
    assert plan.buckets[0] == (("4.bias", "4.weight"), (32 * 32 + 32) * 4)


# --- pitfalls ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl, message", [
    (Wrapper.TORCH_DDP, "Expected to have finished reduction in the prior iteration"),
    (Wrapper.DDP, r"aux_head.*find_unused_parameters=True"),
])
def test_an_unused_parameter_is_an_error_without_find_unused_parameters(impl, message):
    with pytest.raises(RankError, match=message):
        launch(unused_parameter_worker, 2, args=(impl, False), echo=False, timeout=30)
    ok = launch(unused_parameter_worker, 2, args=(impl, True), echo=False, timeout=30)
    assert all("aux_head.weight.grad is None" in r for r in ok)


def test_torchs_first_step_with_an_unused_parameter_averages_nothing():
    drift = {find_unused: max(d.max_difference for d in launch(
        unused_parameter_first_step_worker, 2, args=(find_unused,), echo=False, timeout=30))
        for find_unused in (False, True)}
    assert drift[False] > 1e-4  # each rank stepped on its own gradients
    assert drift[True] == 0.0  # averaged gradients: the same step, bit for bit


def test_editing_weights_on_one_rank_after_wrapping_makes_ranks_drift():
    for impl in (Wrapper.DDP, Wrapper.TORCH_DDP):
        edited = launch(change_after_wrapping_worker, 2,
                        args=(ChangeAfterWrapping.RANK0_EDITS_WEIGHTS, impl), echo=False)
        assert edited[1].max_difference > 0.1
        kept = launch(change_after_wrapping_worker, 2, args=(ChangeAfterWrapping.NOTHING, impl),
                      echo=False)
        assert kept[1].max_difference == 0.0
    with pytest.raises(RankError, match=r"head\.(weight|bias)"):
        launch(change_after_wrapping_worker, 2,
               args=(ChangeAfterWrapping.NEW_LAYER, Wrapper.DDP), echo=False, timeout=30)


def test_logging_from_rank_zero_prints_once_and_the_average_needs_every_rank(capsys):
    every = launch(logging_worker, 4, args=(Logging.EVERY_RANK,), echo=False)
    assert sum(bool(s) for s in every.stdout) == 4
    averaged = launch(logging_worker, 4, args=(Logging.RANK_ZERO_AVERAGED,), echo=False)
    assert averaged.stdout[0] == "step 10: loss 0.625\n" and not any(averaged.stdout[1:])


def test_checkpoint_from_rank_zero_loads_on_every_rank(tmp_path):
    reports = launch(checkpoint_worker, 2, args=(str(tmp_path / "ckpt.pt"),), echo=False)
    for r in reports:
        assert r.differed_before and r.loaded_equal and r.storage_device == "cpu"
        assert r.wrapper_keys[0] == "module.trunk.weight" and r.module_keys[0] == "trunk.weight"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temp file left
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert list(state) == list(reports[0].module_keys)


def test_wrapping_broadcasts_rank_zeros_weights_whatever_the_seed():
    assert launch(seeding_worker, 2, args=(Wrapper.LOCAL,), echo=False)[1] > 0
    for impl in (Wrapper.DDP, Wrapper.TORCH_DDP):
        assert launch(seeding_worker, 2, args=(impl,), echo=False) == [0.0, 0.0]


def test_the_chrome_trace_has_a_process_per_rank_and_two_tracks():
    import base64
    import json
    import re

    from labs.experiments.ddp import BackwardTimeline, Span
    from labs.viz.trace import COMMUNICATION, COMPUTE, ddp_trace, download_link

    t = BackwardTimeline(Wrapper.DDP, 0.004, {"w": 0.001, "b": 0.0005},
                         (Span("bucket 0", 0.002, 0.003),), 0.0035)
    trace = ddp_trace({Wrapper.DDP: [t, t], Wrapper.NAIVE: [t]})
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"DDP, rank 0", "DDP, rank 1", "NaiveDDP, rank 0"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 3 * 2  # backward and one bucket per process
    bucket = next(e for e in spans if e["name"] == "bucket 0")
    assert bucket["tid"] == COMMUNICATION and bucket["ts"] == 2000 and bucket["dur"] == 1000
    assert {e["tid"] for e in spans if e["name"] == "backward"} == {COMPUTE}
    assert sum(e["ph"] == "i" and e["cat"] == "gradient" for e in events) == 2 * 3
    link = download_link(trace, "ddp.json", "the trace").data
    data = re.search(r"base64,([^\"]+)", link).group(1)
    assert json.loads(base64.b64decode(data)) == json.loads(json.dumps(trace))
    assert 'download="ddp.json"' in link
