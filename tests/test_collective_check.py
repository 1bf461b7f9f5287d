"""``launch(..., check_collectives=True)`` (labs.collective_check) on real ranks: each kind of
desynchronized collective is named, with its sequence number, the ranks on each side, what
each issued and where, before any rank blocks; matching collectives pass with the results of
an unchecked run; without checking the same jobs hang, crash or sum the wrong tensors."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.collectives import ring_all_reduce
from labs.rank_errors import LaunchTimeout, RankError


def _line(fn, text: str) -> int:
    """The line number of ``text`` in ``fn``'s source."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def skips_one(rank: int, world_size: int) -> torch.Tensor:
    x = torch.ones(4)
    if rank != 1:
        dist.all_reduce(x)  # rank 1 skips this one
    dist.barrier()
    return x


def swaps_two(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.full((4,), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
    if rank == 0:
        dist.all_reduce(a)
        dist.all_reduce(b)
    else:
        dist.all_reduce(b)  # the same shapes, in the other order
        dist.all_reduce(a)
    return a, b


def other_shape(rank: int, world_size: int) -> torch.Tensor:
    x = torch.ones(4 + rank)
    ring_all_reduce(x)  # labs' ring, one element more on rank 1
    return x


def returns_early(rank: int, world_size: int) -> torch.Tensor:
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 0:
        dist.all_reduce(x)  # rank 1 has returned
    return x


def all_agree(rank: int, world_size: int) -> list[torch.Tensor]:
    x = torch.arange(6.0) + rank
    dist.all_reduce(x)
    ring_all_reduce(x)
    dist.broadcast(x, src=1)
    gathered = torch.empty(6 * world_size)
    dist.all_gather_into_tensor(gathered, x)
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(x, group=pair)  # a group of its own: its own sequence
    dist.barrier()
    return [x, gathered]


def test_a_skipped_collective_is_named_before_any_rank_blocks():
    with pytest.raises(RankError) as caught:
        launch(skips_one, 2, timeout=20, echo=False, check_collectives=True)
    text = str(caught.value)
    assert "collective #1 of ranks 0, 1 differs" in text
    assert "rank(s) 0 issued all_reduce of float32[4]" in text
    assert "rank(s) 1 issued barrier" in text
    assert f"line {_line(skips_one, 'rank 1 skips')}" in text
    assert f"line {_line(skips_one, 'dist.barrier()')}" in text


def test_two_collectives_swapped_sum_the_wrong_tensors_unchecked_and_are_named_checked():
    a, b = launch(swaps_two, 2, timeout=20, echo=False)[0]
    assert a.tolist() != [3.0] * 4  # rank 0's a was summed with rank 1's b: no error at all
    with pytest.raises(RankError) as caught:
        launch(swaps_two, 2, timeout=20, echo=False, check_collectives=True)
    text = str(caught.value)
    assert "collective #1" in text and "come from different lines" in text
    assert f"line {_line(swaps_two, 'dist.all_reduce(a)')}" in text
    assert f"line {_line(swaps_two, 'in the other order')}" in text
    # leaving the call sites out, the check cannot see it: the shapes agree
    launch(swaps_two, 2, timeout=20, echo=False, check_collectives="shapes")


def test_another_shape_in_labs_ring_and_a_rank_that_returned_are_named():
    with pytest.raises(RankError) as caught:
        launch(other_shape, 2, timeout=20, echo=False, check_collectives=True)
    text = str(caught.value)
    assert "ring_all_reduce of float32[4]" in text and "ring_all_reduce of float32[5]" in text
    with pytest.raises(RankError) as caught:
        launch(returns_early, 3, timeout=20, echo=False, check_collectives=True)
    text = str(caught.value)
    assert caught.value.rank == 0 and "collective #2" in text
    assert "rank 1 returned from its worker after 1 collective(s)" in text \
        or "rank 2 returned from its worker after 1 collective(s)" in text


def test_matching_collectives_pass_with_the_results_of_an_unchecked_run():
    checked = launch(all_agree, 3, timeout=30, echo=False, check_collectives=True)
    plain = launch(all_agree, 3, timeout=30, echo=False)
    for mine, theirs in zip(checked, plain, strict=True):
        assert all(torch.equal(m, t) for m, t in zip(mine, theirs, strict=True))


def test_a_bad_setting_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="check_collectives must be True, False or 'shapes'"):
        launch(all_agree, 2, check_collectives="yes")


@pytest.mark.slow
def test_without_checking_a_skipped_collective_hangs_until_the_timeout():
    with pytest.raises(LaunchTimeout) as caught:
        launch(skips_one, 2, timeout=3, echo=False)
    assert sorted(caught.value.ranks) == [0, 1]
