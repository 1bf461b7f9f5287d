"""NaiveDDP and DDP on real ranks: parity with one process on the full batch, buckets, hooks,
no_sync, unused parameters, and the errors that say what to do.

The oracle is a single-process model trained on the whole batch with the same seed: after
every step, every rank's parameters must equal it (``torch.testing.assert_close``). Each rank
starts from a *different* initialisation, so the broadcast at construction is tested too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labs import RankError
from labs.ddp import DDP, NaiveDDP, assign_buckets, params_in_graph, trainable_parameters

from parity import (
    OPTIMIZERS,
    TiedNet,
    assert_states_match,
    ddp_parity_worker,
    launch,
    reference_run,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_matches_one_process_on_the_full_batch(world_size):
    results = launch(ddp_parity_worker, world_size, echo=False)
    references = {name: reference_run(name) for name in OPTIMIZERS}
    keys = list(results[0])
    # tiny cap: one bucket per trainable parameter (embed/head tied, frozen excluded: 3);
    # one big bucket otherwise
    assert any(k.endswith("-3buckets") for k in keys) and any(k.endswith("-1buckets")
                                                               for k in keys)
    assert any(k.endswith("-2buckets") for k in keys), keys
    for rank, per_rank in enumerate(results):
        for key, states in per_rank.items():
            assert_states_match(states, references[key.split("-")[0]], f"{key} rank {rank}")


def test_buckets_follow_reverse_registration_order_and_the_cap():
    model = TiedNet(seed=0)
    params = trainable_parameters(model)
    assert [n for n, _ in params] == ["embed.weight", "hidden.weight", "hidden.bias"]
    tiny = assign_buckets(params, 1e-9)
    assert [[n for n, _ in b] for b in tiny] == [["hidden.bias"], ["hidden.weight"],
                                                 ["embed.weight"]]
    # 42 (hidden.w+b) elements fill a 42-element cap; embed (66) goes alone
    cap = 42 * 4 / 2**20
    assert [[n for n, _ in b] for b in assign_buckets(params, cap)] == [
        ["hidden.bias", "hidden.weight"], ["embed.weight"]]
    assert len(assign_buckets(params, 25.0)) == 1
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        assign_buckets(params, 0)


def test_params_in_graph_finds_what_forward_used():
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    out = model["a"](torch.ones(1, 2))
    reached = params_in_graph({"out": [out]})
    assert reached == {id(model["a"].weight), id(model["a"].bias)}


# --- overlap, call counts and no_sync ----------------------------------------------------------


def overlap_worker(rank: int, world_size: int) -> dict[str, object]:
    """Counts the all-reduce calls of one DDP step and when they were made; then the same
    for the control, ``DDP(..., overlap=False)``, on a copy of the model."""
    calls: list[tuple[int, bool, bool]] = []
    real = dist.all_reduce
    in_backward = [False]

    def counting(tensor, *args, **kwargs):
        calls.append((tensor.numel(), bool(kwargs.get("async_op")), in_backward[0]))
        return real(tensor, *args, **kwargs)

    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    twin = copy.deepcopy(net)  # the same weights on this rank
    model = DDP(net, bucket_cap_mb=(32 * 32 + 32) * 4 / 2**20)  # one layer per bucket
    control = DDP(twin, bucket_cap_mb=(32 * 32 + 32) * 4 / 2**20, overlap=False)
    dist.all_reduce = counting
    try:
        x = torch.randn(4, 32)
        steps = []
        for wrapped in (control, model):
            calls.clear()
            in_backward[0] = True
            wrapped(x).sum().backward()
            in_backward[0] = False
            wrapped.finish_gradient_synchronization()
            steps.append(list(calls))
        control_step, first_step = steps
        same_gradients = all(torch.equal(p.grad, q.grad)
                             for p, q in zip(net.parameters(), twin.parameters(), strict=True))
        timeline = model.timeline.resolved()
        calls.clear()
        for _ in range(3):  # accumulation: no communication
            with model.no_sync():
                model(x).sum().backward()
                model.finish_gradient_synchronization()
        in_no_sync = list(calls)
        model(x).sum().backward()
        model.finish_gradient_synchronization()
        after = list(calls)
    finally:
        dist.all_reduce = real
    return {"first": first_step, "control": control_step, "same": same_gradients,
            "no_sync": in_no_sync, "after": after,
            "launched": dict(timeline.launched), "done": dict(timeline.done),
            "ready": dict(timeline.grad_ready), "finished": timeline.finished,
            "grad": net[0].weight.grad.clone()}


def test_buckets_are_launched_async_during_backward_and_no_sync_sends_nothing():
    results = launch(overlap_worker, 2, echo=False)
    for r in results:
        assert r["first"] == [(1056, True, True)] * 4  # 4 buckets, launched inside backward
        # the control: the same 4 buckets, launched only after backward, the same averages
        assert r["control"] == [(1056, True, False)] * 4
        assert r["same"]
        assert r["no_sync"] == []
        assert len(r["after"]) == 4
        # bucket 0 (the last layer) was launched before the first layer's gradient was ready
        assert r["launched"][0] < r["ready"]["0.weight"]
        assert sorted(r["done"]) == [0, 1, 2, 3]
        assert all(r["launched"][i] <= r["done"][i] <= r["finished"] for i in range(4))
    # the accumulated gradient (4 backward passes) is the same on both ranks
    torch.testing.assert_close(results[0]["grad"], results[1]["grad"])


# --- unused parameters -------------------------------------------------------------------------


class Branchy(nn.Module):
    """Rank-dependent control flow: ``skip`` is not used when ``use_skip`` is False."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.main = nn.Linear(4, 4)
        self.skip = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_skip: bool) -> torch.Tensor:
        y = self.main(x)
        return y + self.skip(x) if use_skip else y


def unused_worker(rank: int, world_size: int, find_unused: bool) -> dict[str, object]:
    model = DDP(Branchy(), bucket_cap_mb=1e-9, find_unused_parameters=find_unused)
    x = torch.ones(2, 4) * (rank + 1)
    model(x, use_skip=(rank == 0)).sum().backward()
    model.finish_gradient_synchronization()
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in model.module.named_parameters()}


def test_find_unused_parameters_syncs_what_any_rank_used_and_leaves_the_rest_none():
    results = launch(unused_worker, 2, args=(True,), echo=False)
    for grads in results:
        assert grads["never.weight"] is None and grads["never.bias"] is None
        # skip was used by rank 0 only: its gradient is rank 0's over 2 on both ranks
        torch.testing.assert_close(grads["skip.bias"], torch.full((4,), 2 / 2))
        torch.testing.assert_close(grads["main.bias"], torch.full((4,), (2 + 2) / 2))


def test_an_unused_parameter_without_find_unused_is_an_error_naming_it():
    with pytest.raises(RankError, match=r"never\.(weight|bias).*find_unused_parameters=True"):
        launch(unused_worker, 2, args=(False,), echo=False, timeout=30)


def forgot_to_finish(rank: int, world_size: int) -> None:
    model = DDP(nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    model(torch.ones(1, 2))


def naive_unused(rank: int, world_size: int) -> None:
    model = NaiveDDP(Branchy())
    model(torch.ones(1, 4), use_skip=False).sum().backward()
    model.finish_gradient_synchronization()


@pytest.mark.parametrize("worker, message", [
    (forgot_to_finish, r"finish_gradient_synchronization\(\) after loss.backward\(\)"),
    (naive_unused, r"NaiveDDP: parameter\(s\) \['skip.weight'"),
])
def test_misuse_is_an_error_that_says_what_to_do(worker, message):
    with pytest.raises(RankError, match=message):
        launch(worker, 2, echo=False, timeout=30)


def buffers_worker(rank: int, world_size: int, broadcast: bool) -> torch.Tensor:
    torch.manual_seed(rank)
    net = nn.BatchNorm1d(3)
    model = DDP(net, broadcast_buffers=broadcast)
    model(torch.randn(4, 3) + 10 * rank)  # each rank's running mean moves differently ...
    model(torch.ones(4, 3))  # ... and with broadcast_buffers, rank 0's wins before this one
    return net.running_mean.clone()


def test_buffers_are_broadcast_before_each_forward():
    same = launch(buffers_worker, 2, args=(True,), echo=False)
    torch.testing.assert_close(same[0], same[1])
    apart = launch(buffers_worker, 2, args=(False,), echo=False)
    assert not torch.allclose(apart[0], apart[1])


def accumulated_unused_worker(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """``skip`` is used in the first micro-batch (inside no_sync) and not in the last."""
    model = DDP(Branchy(), bucket_cap_mb=1e-9, find_unused_parameters=True)
    x = torch.ones(2, 4) * (rank + 1)
    with model.no_sync():
        model(x, use_skip=True).sum().backward()
    model(x, use_skip=False).sum().backward()
    model.finish_gradient_synchronization()
    return {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}


def test_find_unused_keeps_what_no_sync_accumulated():
    results = launch(accumulated_unused_worker, 2, echo=False)
    for grads in results:
        # rank r's skip.bias gradient is 2 (a sum over 2 rows); the mean over ranks is 2
        torch.testing.assert_close(grads["skip.bias"], torch.full((4,), 2.0))
        torch.testing.assert_close(grads["skip.weight"], torch.full((4, 4), (2 + 4) / 2))
        assert "never.weight" not in grads


def rewrap_worker(rank: int, world_size: int) -> str:
    net = nn.Linear(2, 2)
    first = DDP(net)
    try:
        DDP(net)
    except ValueError as err:
        message = str(err)
    first.remove_hooks()
    second = DDP(net)
    second(torch.ones(1, 2)).sum().backward()
    second.finish_gradient_synchronization()  # only one wrapper's hooks fired
    return message


def test_wrapping_a_hooked_module_again_is_refused_until_the_old_hooks_are_removed():
    message = launch(rewrap_worker, 1, echo=False)[0]
    assert "already hooked by another DDP wrapper" in message and "remove_hooks()" in message
