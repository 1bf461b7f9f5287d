"""Tensor parallelism of a transformer MLP (labs.tensor_parallel) on real ranks: parity of
the output and of every gradient (the input's included) with the unsplit MLP and the unsplit
transformer block, one all-reduce per pass and its bytes against the closed form, and the
mistakes the checks must catch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labs import launch, rank_device
from labs.collectives import Algorithm, shard_bounds
from labs.experiments.mesh import (
    SLICES,
    TPResult,
    TPSettings,
    rank_slice,
    reference,
    run_tp,
    tp_errors,
    tp_loss,
    tp_table,
)
from labs.tensor_parallel import (
    ColumnParallelLinear,
    CommLog,
    ParallelMLP,
    Pass,
    RowParallelLinear,
    all_reduce_bytes,
    copy_to_tensor_parallel,
    feature_slice,
    reduce_from_tensor_parallel,
)
from labs.train import Block

#: H = 10 splits unevenly over 4 ranks (3, 3, 2, 2); mlp[0].bias frozen.
AWKWARD = TPSettings(hidden=10, frozen_first_bias=True)


def assert_matches_reference(reports, settings: TPSettings) -> None:
    want = reference(settings)
    covered = []
    for r in reports:
        features = slice(*r.features)
        covered.append(r.features)
        torch.testing.assert_close(r.result.output, want.output)
        torch.testing.assert_close(r.result.input_grad, want.input_grad)
        assert set(r.result.grads) == set(SLICES)
        for name, grad in r.result.grads.items():
            full = want.grads[SLICES[name][0]]
            if full is None:
                assert grad is None, f"{name} is frozen but got a gradient on rank {r.rank}"
                continue
            torch.testing.assert_close(grad, rank_slice(full, name, features),
                                       msg=lambda m, n=name, k=r.rank: f"{n} rank {k}: {m}")
        assert r.max_output_error < 1e-5 and r.max_grad_error < 1e-5
    # inside each TP group, the ranks' slices tile the hidden features, in rank order
    t = settings.tp_size or len(reports)
    bounds = shard_bounds(settings.hidden_features, t)
    assert covered == [(bounds[i % t], bounds[i % t + 1]) for i in range(len(reports))]
    assert [r.tp_group for r in reports] == [tuple(range(i - i % t, i - i % t + t))
                                             for i in range(len(reports))]


@pytest.mark.parametrize("settings", [TPSettings(), AWKWARD], ids=["H=4D", "H=10,frozen"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parallel_mlp_matches_the_unsplit_mlp(world_size, settings, no_leftover_processes):
    reports = run_tp(settings, world_size)
    assert_matches_reference(reports, settings)


def test_tp_inside_groups_of_two_of_four_ranks(no_leftover_processes):
    """TP inside a node: ranks {0, 1} and {2, 3} each split the MLP between themselves."""
    settings = dataclasses.replace(AWKWARD, tp_size=2)
    reports = run_tp(settings, 4)
    assert_matches_reference(reports, settings)
    payload = 2 * 3 * 8 * 4
    for r in reports:
        assert r.bytes_sent == {Pass.FORWARD: payload, Pass.BACKWARD: payload}  # 2(2-1)/2 S
        assert r.closed_form_bytes == payload
    assert "{0, 1}" in tp_table(reports) and "{2, 3}" in tp_table(reports)


def test_torch_all_reduce_gives_the_same_answer_uncounted(no_leftover_processes):
    settings = dataclasses.replace(AWKWARD, algorithm=Algorithm.TORCH)
    reports = run_tp(settings, 2)
    assert_matches_reference(reports, settings)
    for r in reports:
        assert (r.forward_all_reduces, r.backward_all_reduces) == (1, 1)
        assert r.bytes_sent == {Pass.FORWARD: None, Pass.BACKWARD: None}  # no Recorder sees it
    assert " - " in tp_table(reports)


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_all_reduce_per_pass_sending_the_closed_form(world_size, no_leftover_processes):
    settings = TPSettings(d_model=8, batch=2, seq_len=3)  # S = 48 floats: divides by 2 and 4
    reports = run_tp(settings, world_size)
    payload = 2 * 3 * 8 * 4
    expected = all_reduce_bytes(2 * 3 * 8, world_size, 4)
    assert expected == 2 * (world_size - 1) / world_size * payload
    for r in reports:
        assert (r.forward_all_reduces, r.backward_all_reduces) == (1, 1)
        assert r.payload_bytes == payload
        assert r.bytes_sent == {Pass.FORWARD: expected, Pass.BACKWARD: expected}
        assert r.closed_form_bytes == expected
    table = tp_table(reports)
    assert f"{expected:g}" in table and "NO" not in table


def test_bytes_when_the_activation_does_not_split_evenly(no_leftover_processes):
    world_size = 4
    settings = TPSettings(d_model=5, batch=1, seq_len=3)  # S = 15 floats over 4 ranks
    reports = run_tp(settings, world_size)
    numel, e = 15, 4
    chunks = [b - a for a, b in zip(shard_bounds(numel, world_size)[:-1],
                                    shard_bounds(numel, world_size)[1:], strict=True)]
    for r in reports:
        # rank r sends every chunk but r (reduce-scatter) and every chunk but r+1 (all-gather)
        mine = (2 * numel - chunks[r.rank] - chunks[(r.rank + 1) % world_size]) * e
        assert r.bytes_sent == {Pass.FORWARD: mine, Pass.BACKWARD: mine}
    total = sum(r.bytes_sent[Pass.FORWARD] for r in reports)
    assert total == world_size * all_reduce_bytes(numel, world_size, e)  # the mean is exact
    assert_matches_reference(reports, settings)


# --- the unsplit transformer block ----------------------------------------------------------


def block_worker(rank, world_size, d_model, heads, seed):
    """labs.train.Block with its MLP replaced by a ParallelMLP; returns output, input grad,
    every gradient of the parameters that stay whole, and the MLP's gradients."""
    torch.manual_seed(seed)
    device = rank_device()  # nccl carries CUDA tensors only; the results come back on the CPU
    block = Block(d_model, heads).to(device)
    block.mlp = ParallelMLP(block.mlp)
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(seed + 1)
                    ).to(device).requires_grad_(True)
    block(x).pow(2).mean().backward()
    grads = {n: p.grad.cpu() for n, p in block.named_parameters()}
    return (block(x).detach().cpu(), x.grad.cpu(), grads, block.mlp.features,
            len(block.mlp.log.records))


@pytest.mark.parametrize("world_size", [2, 4])
def test_block_with_a_parallel_mlp_matches_the_unsplit_block(world_size, no_leftover_processes):
    d_model, heads, seed = 6, 2, 3  # H = 24
    torch.manual_seed(seed)
    block = Block(d_model, heads)
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(seed + 1),
                    requires_grad=True)
    block(x).pow(2).mean().backward()
    want = {n: p.grad for n, p in block.named_parameters()}
    out_want = block(x).detach()
    names = {"mlp.fc.weight": "mlp.0.weight", "mlp.fc.bias": "mlp.0.bias",
             "mlp.proj.weight": "mlp.2.weight", "mlp.proj.bias": "mlp.2.bias"}
    results = launch(block_worker, world_size, args=(d_model, heads, seed), echo=False,
                     timeout=60)
    for rank, (out, x_grad, grads, features, all_reduces) in enumerate(results):
        torch.testing.assert_close(out, out_want)
        torch.testing.assert_close(x_grad, x.grad)
        assert all_reduces == 3  # forward, backward, and the second forward for the output
        for name, grad in grads.items():
            if name in names:
                expected = rank_slice(want[names[name]], name.removeprefix("mlp."), features)
            else:
                expected = want[name]
            torch.testing.assert_close(grad, expected, msg=lambda m, n=name, r=rank: f"{n} "
                                       f"rank {r}: {m}")


# --- mistakes the checks catch --------------------------------------------------------------


def mistake_worker(rank, world_size, settings, mistake):
    """A wrong split: ``"bias before reduce"`` adds the row-parallel bias on every rank before
    the all-reduce (so it is summed t times); ``"no f"`` leaves out f, so the input's gradient
    is this rank's term only. Returns tp_errors' verdict and the result."""
    device = rank_device()
    model = ParallelMLP(settings.mlp().to(device))
    fc, proj = model.fc, model.proj
    x, target = (t.to(device) for t in settings.data())
    x.requires_grad_(True)
    if mistake == "bias before reduce":
        h = model.act(fc(x))
        y = reduce_from_tensor_parallel(F.linear(h, proj.weight, proj.bias))
    else:
        h = model.act(F.linear(x, fc.weight, fc.bias))
        y = proj(h)
    tp_loss(y, target).backward()
    result = TPResult(y.detach().cpu(), x.grad.cpu(),
                      {n: None if p.grad is None else p.grad.cpu()
                       for n, p in model.named_parameters()})
    return tp_errors(result, model.features, settings)


def test_a_bias_added_before_the_reduce_fails_parity(no_leftover_processes):
    errors = launch(mistake_worker, 2, args=(TPSettings(), "bias before reduce"), echo=False,
                    timeout=60)
    assert all(out > 1e-3 for out, _ in errors)


def test_leaving_out_f_gives_a_wrong_input_gradient(no_leftover_processes):
    errors = launch(mistake_worker, 2, args=(TPSettings(), "no f"), echo=False, timeout=60)
    assert all(out < 1e-5 and grad > 1e-3 for out, grad in errors)  # forward still right


def test_a_frozen_parameter_that_gets_a_gradient_is_an_error():
    settings = AWKWARD
    model = ParallelMLP(dataclasses.replace(settings, frozen_first_bias=False).mlp())
    x, target = settings.data()
    x.requires_grad_(True)
    y = model(x)
    tp_loss(y, target).backward()
    result = TPResult(y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()})
    assert tp_errors(result, model.features, settings)[1] == float("inf")


# --- one process, bad input -----------------------------------------------------------------


def test_outside_a_launch_it_is_one_rank_holding_everything():
    torch.manual_seed(0)
    mlp = Block(8, 2).mlp
    model = ParallelMLP(mlp)
    assert model.features == slice(0, 32) and feature_slice(32) == slice(0, 32)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), mlp(x), rtol=0, atol=0)
    assert model.log.count(Pass.FORWARD) == 1 and model.log.bytes_sent() == 0
    model.log.clear()
    assert model.log.records == []


def test_f_and_g_alone_in_one_process():
    log = CommLog()
    x = torch.randn(4, requires_grad=True)
    y = reduce_from_tensor_parallel(copy_to_tensor_parallel(x, log=log), log=log)
    (2 * y).sum().backward()
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
    assert [r.pass_ for r in log.records] == [Pass.FORWARD, Pass.BACKWARD]


def test_bad_modules_are_refused(refuse_processes):
    with refuse_processes():
        with pytest.raises(TypeError, match="nn.Sequential"):
            ParallelMLP(nn.Sequential(nn.Linear(4, 8), nn.GELU()))
        with pytest.raises(TypeError, match="element by element"):
            ParallelMLP(nn.Sequential(nn.Linear(4, 8), nn.Softmax(-1), nn.Linear(8, 4)))
        with pytest.raises(ValueError, match="hidden size"):
            ParallelMLP(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(6, 4)))
        with pytest.raises(TypeError, match="nn.Linear"):
            ColumnParallelLinear(nn.Conv1d(2, 2, 1))
        with pytest.raises(TypeError, match="nn.Linear"):
            RowParallelLinear(nn.GELU())
        with pytest.raises(ValueError, match="d_model"):
            TPSettings(d_model=0)
        with pytest.raises(ValueError, match="hidden"):
            TPSettings(hidden=0)
        with pytest.raises(TypeError, match="Algorithm"):
            TPSettings(algorithm="ring")
        with pytest.raises(ValueError, match="world_size"):
            all_reduce_bytes(10, 0, 4)
        with pytest.raises(ValueError, match="tp_size"):
            TPSettings(tp_size=0)
        with pytest.raises(ValueError, match="must divide"):
            run_tp(TPSettings(tp_size=3), 4)
