"""labs.wrappers: every wrapper the one factory builds trains like one process (on real ranks),
its ZeRO stage, and the choices it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labs import launch, rank_device
from labs.fsdp import FSDP
from labs.train import TrainConfig
from labs.wrappers import DDP_WRAPPERS, HSDP_STRATEGIES, ZERO_STAGES, Wrapper, build, wrap
from labs.zero import ShardedOptimizer, ZeroStage

#: Every wrapper that shares the training state and that `build` makes.
BUILT = [w for w in Wrapper if w not in (Wrapper.LOCAL, Wrapper.FULLY_SHARD)]


def two_steps(rank: int, world_size: int, wrappers: list[Wrapper]) -> dict[Wrapper, object]:
    """Per wrapper: the classes built and the loss of the second SGD step on this rank's share
    of a batch of 6 rows (one process takes all 6)."""
    out = {}
    share = 6 // world_size
    x = (torch.arange(24, dtype=torch.float32).reshape(6, 4) / 10 - 1).sin()
    x = x[rank * share:(rank + 1) * share].to(rank_device())  # where build puts the model
    for wrapper in wrappers:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model, optimizer = build(wrapper, net, torch.optim.SGD, lr=0.5, bucket_cap_mb=1.0,
                                 shard_size=1)  # HSDP: shards of 1 rank, replicated on 2
        losses = []
        for _ in range(2):
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            finish = getattr(model, "finish_gradient_synchronization", None)
            if finish is not None:
                finish()
            optimizer.step()
            losses.append(loss.detach())
        if world_size > 1:  # the loss of the whole batch: the mean of the shares' losses
            torch.distributed.all_reduce(losses[1])
        stage = getattr(optimizer, "stage", None)
        out[wrapper] = (type(model).__name__, type(optimizer).__name__, stage,
                        losses[1].item() / world_size)
    return out


def test_every_wrapper_trains_like_one_process_on_two_ranks():
    local = launch(two_steps, 1, args=([Wrapper.LOCAL],), echo=False)[0][Wrapper.LOCAL]
    per_rank = launch(two_steps, 2, args=(BUILT,), echo=False, timeout=120)
    for results in per_rank:
        for wrapper, (*_, loss) in results.items():
            assert loss == pytest.approx(local[-1], rel=1e-5), wrapper
    classes = {w: r[:3] for w, r in per_rank[0].items()}
    assert classes[Wrapper.NAIVE][0] == "NaiveDDP" and classes[Wrapper.DDP][0] == "DDP"
    assert classes[Wrapper.TORCH_DDP][0] == "DistributedDataParallel"
    assert classes[Wrapper.FSDP][0] == classes[Wrapper.HSDP][0] == FSDP.__name__
    assert classes[Wrapper.ZERO1] == ("Sequential", ShardedOptimizer.__name__, ZeroStage.OPTIMIZER)
    assert classes[Wrapper.ZERO2] == ("Sequential", ShardedOptimizer.__name__, ZeroStage.GRADIENTS)


def test_stages_and_groups():
    assert [w.stage for w in ZERO_STAGES] == [0, 1, 2, 3]
    assert Wrapper.LOCAL.stage is None and Wrapper.FULLY_SHARD.stage == 3
    assert all(w.stage == 0 for w in DDP_WRAPPERS)
    assert [w.stage for w in HSDP_STRATEGIES] == [0, 3, 3]


def test_hsdp_needs_its_group_size():
    with pytest.raises(ValueError, match="shard_size"):
        wrap(Wrapper.HSDP, nn.Linear(2, 2))


def test_fully_shard_is_built_by_fsdp_torch_not_wrap():
    with pytest.raises(ValueError, match="fsdp_torch"):
        wrap(Wrapper.FULLY_SHARD, nn.Linear(2, 2))


@pytest.mark.parametrize("wrapper", [Wrapper.ZERO1, Wrapper.FSDP, Wrapper.LOCAL, "ours"])
def test_the_training_lab_takes_only_the_ddp_wrappers(wrapper):
    with pytest.raises(ValueError, match="Wrapper.NAIVE"):
        TrainConfig(wrapper=wrapper)
