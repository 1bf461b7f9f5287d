"""labs' ``DDP.join()`` on real ranks with uneven data: the same parameters as torch DDP's
``join()`` on the same data (world sizes 2 and 4, both divisors), every rank equal at the end;
without it the rank that runs out leaves its peers waiting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labs import launch
from labs.ddp import DDP
from labs.experiments.recovery import join_worker, train_batches, uneven_batches, uneven_net
from labs.rank_errors import LaunchTimeout


def _batches(rank: int) -> list[torch.Tensor]:
    """Rank r holds 1 + r batches: rank 0 runs out first."""
    return uneven_batches(rank, 1 + rank)


@pytest.mark.parametrize("world_size, initial", [(2, True), (4, False),
                                                 pytest.param(4, True, marks=pytest.mark.slow),
                                                 pytest.param(2, False, marks=pytest.mark.slow)])
def test_join_trains_uneven_data_as_torch_ddp_join_does(world_size, initial):
    batches = tuple(1 + r for r in range(world_size))
    results = launch(join_worker, world_size, args=(batches, initial), timeout=60, echo=False)
    for ours, theirs in results:
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    first = results[0][0]
    for ours, _ in results[1:]:  # the last to leave broadcast its parameters to every rank
        assert all(torch.equal(a, b) for a, b in zip(first, ours, strict=True))


def shadow_missing(rank: int, world_size: int) -> list[torch.Tensor]:
    """The step a joined rank must shadow, not shadowed: a DDP without join()."""
    model = DDP(uneven_net())
    train_batches(model, _batches(rank))
    return [p.detach() for p in model.module.parameters()]


@pytest.mark.slow
def test_without_join_the_rank_that_runs_out_leaves_its_peers_waiting():
    with pytest.raises(LaunchTimeout) as caught:
        launch(shadow_missing, 2, timeout=3, echo=False)
    assert caught.value.ranks == [1]


def wrong_divisor(rank: int, world_size: int) -> list[torch.Tensor]:
    """join() as it would be if finishing divided by N while dividing by the ranks still
    training was asked for."""
    model = DDP(uneven_net())
    with model.join(divide_by_initial_world_size=False):
        model._joining = True  # noqa: SLF001 - the bug under test: the divisor stays N
        train_batches(model, _batches(rank))
    theirs = nn.parallel.DistributedDataParallel(uneven_net())
    with theirs.join(divide_by_initial_world_size=False):
        train_batches(theirs, _batches(rank), sync=False)
    return [float((a - b).abs().max()) for a, b in zip(model.module.parameters(),
                                                       theirs.module.parameters(), strict=True)]


def test_a_join_that_divides_by_the_wrong_count_would_fail_the_comparison():
    differences = launch(wrong_divisor, 2, timeout=60, echo=False)
    assert max(max(d) for d in differences) > 1e-4
