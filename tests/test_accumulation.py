"""Chapter 7's gradient accumulation under FSDP (labs.experiments.accumulation), on real ranks:
both ways (no_sync, reduce-scatter every micro-batch) end at the one-process step on the whole
batch, and send and hold exactly the bytes of the closed forms.

The model has a tied embedding and head and a frozen position embedding; d_model = 9 makes
every unit's size odd (1089 per block, 117 for the root), so no unit divides by 2 or 4 and
every shard is padded."""

from __future__ import annotations

import dataclasses

import matplotlib
import pytest
import torch

from labs.experiments.accumulation import (
    Accumulation,
    AccumulationRow,
    AccumulationSettings,
    StepBytes,
    accumulation_step,
    accumulation_table,
    batch,
    build_model,
    closed_form,
    loss_of,
    measure_accumulation,
    mismatches,
    padded_numel,
    plot_accumulation,
    unit_numels,
)

from parity import launch

SMALL = AccumulationSettings(micro_batch=2, ks=(1, 4), vocab=11, d_model=9, n_heads=3,
                             seq_len=5)


def reference(settings: AccumulationSettings, k: int, world_size: int
              ) -> dict[str, torch.Tensor]:
    """One process, the whole batch of k micro-batches on N ranks, one SGD step."""
    model = build_model(settings)
    x, y = batch(settings, k, world_size)
    loss_of(model, x, y).backward()
    with torch.no_grad():
        for p in model.parameters():  # the tied weight once
            if p.grad is not None:
                p -= settings.lr * p.grad
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def steps_worker(rank: int, world_size: int, settings: AccumulationSettings
                 ) -> dict[tuple[int, Accumulation], object]:
    return {(k, way): accumulation_step(rank, world_size, settings, k, way)
            for k in settings.ks for way in Accumulation}


def test_the_model_has_a_tied_and_a_frozen_parameter_and_units_that_need_padding():
    model = build_model(SMALL)
    assert model.head.weight is model.tok_emb.weight
    assert not model.pos_emb.weight.requires_grad
    assert unit_numels(SMALL) == (1089, 1089, 117)
    assert padded_numel(SMALL, 2) == 1090 + 1090 + 118
    assert padded_numel(SMALL, 4) == 1092 + 1092 + 120


@pytest.mark.parametrize("world_size", [1, 2])
def test_both_ways_match_one_process_and_send_and_hold_the_closed_form(world_size,
                                                                       no_leftover_processes):
    results = launch(steps_worker, world_size, args=(SMALL,), echo=False, timeout=120)
    for k in SMALL.ks:
        want = reference(SMALL, k, world_size)
        for rank, per_rank in enumerate(results):
            for way in Accumulation:
                outcome = per_rank[(k, way)]
                what = f"N = {world_size}, rank {rank}, k = {k}, {way.value}"
                assert outcome.measured == closed_form(SMALL, world_size, k, way), what
                assert set(outcome.parameters) == set(want), what
                for name, value in want.items():
                    torch.testing.assert_close(outcome.parameters[name], value,
                                               msg=lambda m, w=what, n=name: f"{w} {n}: {m}")
                assert outcome.peak_bytes >= outcome.measured.gradient_bytes
    if world_size == 1:
        return
    # The measurement tells the ways apart: at k = 4 each disagrees with the other's formula.
    by_way = {way: results[0][(4, way)].measured for way in Accumulation}
    assert by_way[Accumulation.NO_SYNC] != closed_form(SMALL, 2, 4,
                                                       Accumulation.REDUCE_SCATTER_EACH)
    assert by_way[Accumulation.REDUCE_SCATTER_EACH] != closed_form(SMALL, 2, 4,
                                                                   Accumulation.NO_SYNC)
    # Holding the full gradients costs the rank S_r - S_r/N in its peak, too.
    peak = {way: results[0][(4, way)].peak_bytes for way in Accumulation}
    assert peak[Accumulation.NO_SYNC] > peak[Accumulation.REDUCE_SCATTER_EACH]


def test_the_closed_forms_are_those_of_the_chapter():
    p = padded_numel(SMALL, 2)  # fp32: S = 4P
    no_sync = closed_form(SMALL, 2, 4, Accumulation.NO_SYNC)
    each = closed_form(SMALL, 2, 4, Accumulation.REDUCE_SCATTER_EACH)
    assert no_sync.all_gather == each.all_gather == 2 * 4 * 4 * p // 2  # 2k (N-1)/N S_c
    assert no_sync.reduce_scatter == 4 * p // 2  # (N-1)/N S_r, once
    assert each.reduce_scatter == 4 * 4 * p // 2  # k times
    assert no_sync.gradient_bytes == 4 * p  # S_r whole
    assert each.gradient_bytes == 4 * p // 2  # S_r / N
    assert closed_form(SMALL, 2, 1, Accumulation.NO_SYNC) == closed_form(
        SMALL, 2, 1, Accumulation.REDUCE_SCATTER_EACH)  # k = 1: nothing to accumulate
    assert closed_form(SMALL, 1, 4, Accumulation.NO_SYNC).sent == 0


def test_bf16_compute_with_fp32_reduce_rows_table_and_figure(no_leftover_processes):
    """All-gathers carry S_c (2 bytes an element), reduce-scatters and kept gradients S_r
    (4 bytes): a formula that mixed them up would disagree with the measurement."""
    settings = dataclasses.replace(SMALL, compute_dtype=torch.bfloat16,
                                   reduce_dtype=torch.float32)
    per_rank = measure_accumulation(settings, timeout=120)
    assert len(per_rank) == settings.world_size
    rows = [row for rows in per_rank for row in rows]
    assert mismatches(rows) == []
    p = padded_numel(settings, 2)
    for row in rows:
        assert row.measured.all_gather == 2 * row.k * 2 * p // 2
        assert row.measured.reduce_scatter == (1 if row.way is Accumulation.NO_SYNC
                                               else row.k) * 4 * p // 2
        assert row.max_difference < 1e-2  # bf16 compute: the ways sum in different orders
    assert [(r.k, r.way) for r in per_rank[0]] == [
        (k, way) for k in settings.ks for way in Accumulation]

    table = accumulation_table(per_rank[0])
    assert len(table.splitlines()) == 2 + len(per_rank[0])
    kept = next(r for r in per_rank[0] if r.k == 4 and r.way is Accumulation.NO_SYNC)
    assert f"{4 * p} / {4 * p}" in table  # the full fp32 gradients NO_SYNC held
    assert kept.measured.gradient_bytes == 4 * p

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_accumulation(per_rank[0], title="N = 2")
    try:
        assert len(fig.axes) == 2
        assert all(len(ax.lines) == 2 * len(Accumulation) for ax in fig.axes)
    finally:
        plt.close(fig)


def test_mismatches_names_a_measurement_that_differs_from_its_closed_form():
    model = closed_form(SMALL, 2, 4, Accumulation.NO_SYNC)
    good = AccumulationRow(0, 2, 4, Accumulation.NO_SYNC, model, model, 0, 0.0)
    assert mismatches([good]) == []
    # reduce-scattering every micro-batch while claiming no_sync's one reduce-scatter
    wrong = dataclasses.replace(good, measured=dataclasses.replace(
        model, reduce_scatter=4 * model.reduce_scatter))
    (message,) = mismatches([good, wrong])
    assert "k = 4" in message and "no_sync" in message and "reduce scatter" in message
    held = dataclasses.replace(good, measured=StepBytes(model.all_gather, model.reduce_scatter,
                                                        model.gradient_bytes // 2))
    assert "gradient bytes" in mismatches([held])[0]


def test_accumulating_changes_the_step_so_the_parity_above_can_fail():
    one, four = reference(SMALL, 1, 2), reference(SMALL, 4, 2)
    assert not torch.equal(one["blocks.0.mlp.0.weight"], four["blocks.0.mlp.0.weight"])
    untouched = build_model(SMALL).state_dict()
    assert not torch.equal(four["tok_emb.weight"], untouched["tok_emb.weight"])
    assert torch.equal(four["pos_emb.weight"], untouched["pos_emb.weight"])  # frozen


@pytest.mark.parametrize("ks", [(0,), (1, -2), (1, 2.0), (True,)])
def test_settings_refuse_a_k_below_one(ks):
    with pytest.raises(ValueError, match=r"every k in ks must be an int >= 1 \(micro-batches"):
        AccumulationSettings(ks=ks)


@pytest.mark.parametrize(("changes", "message"), [
    ({"ks": ()}, "ks is empty"),
    ({"ks": 4}, "ks must be a sequence of ints"),
    ({"ks": (1, 2, 1)}, "lists a k twice"),
    ({"world_size": 0}, "world_size must be an int >= 1"),
    ({"micro_batch": 0}, "micro_batch must be an int >= 1"),
    ({"d_model": 10, "n_heads": 3}, "must be a multiple of n_heads"),
    ({"compute_dtype": torch.int32}, "compute_dtype must be None or a floating-point"),
    ({"reduce_dtype": "bf16"}, "reduce_dtype must be None or a floating-point"),
    ({"lr": 0.0}, "lr must be a positive number"),
])
def test_settings_refuse_what_cannot_run(changes, message):
    with pytest.raises(ValueError, match=message):
        AccumulationSettings(**changes)


def test_settings_keep_ks_as_a_tuple_and_the_closed_form_refuses_k_zero():
    assert AccumulationSettings(ks=[1, 2]).ks == (1, 2)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        closed_form(SMALL, 2, 0, Accumulation.NO_SYNC)
