"""FSDP's prefetching on labs' own ring (issue 41): ``prefetch=k`` and ``reshard_after_forward``
with ``collectives=Algorithm.RING``, whose collectives then run on a communication stream.

The oracle is chapter 5's: one process trained on the whole batch (:mod:`parity`), equal after
every step, with a frozen layer, a tied embedding and a buffer (``TiedNet``). Overlap is read
from the timeline FSDP records (which interval started before which ended), never from how
long a step took: on a loaded machine the order of two events on one rank still holds.
"""

from __future__ import annotations

import time

import pytest
import torch
from collective_counter import calls_before_refusal
from torch import nn

import labs
from labs.collectives import Algorithm, Recorder
from labs.fsdp import FSDP, Activity, FSDPTimeline, check_prefetch

from parity import (
    OPTIMIZERS,
    Deep,
    TiedNet,
    assert_states_match,
    launch,
    rank_batch,
    reference_run,
    train_sharded,
)

#: (prefetch, reshard_after_forward) of the fast parity test; the others run in the slow one.
FAST_CASES = [(1, False)]
ALL_CASES = [(k, keep) for k in (0, 1, 2) for keep in (True, False)]


def parity_worker(rank: int, world_size: int, cases: list[tuple[int, bool]],
                  shard_size: int | None = None) -> dict[str, list[dict[str, torch.Tensor]]]:
    """TiedNet trained for :data:`STEPS` steps with every optimizer and every case, on the
    ring with a communication stream; ``"{optimizer}-{prefetch}-{reshard}"`` -> the full
    parameters after each step."""
    x, y = rank_batch(rank, world_size)
    out = {}
    for optimizer, (cls, kwargs) in OPTIMIZERS.items():
        for prefetch, reshard in cases:
            model = FSDP(TiedNet(seed=rank), collectives=Algorithm.RING, prefetch=prefetch,
                         reshard_after_forward=reshard, shard_size=shard_size)
            out[f"{optimizer}-{prefetch}-{reshard}"] = train_sharded(
                model, cls(model.parameters(), **kwargs), x, y)
    return out


def check_parity(world_size: int, cases: list[tuple[int, bool]],
                 shard_size: int | None = None) -> None:
    results = launch(parity_worker, world_size, args=(cases, shard_size), echo=False)
    expected = {name: reference_run(name) for name in OPTIMIZERS}
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(OPTIMIZERS) * len(cases)
        for key, states in per_rank.items():
            assert_states_match(states, expected[key.split("-")[0]], f"{key} rank {rank}")


@pytest.mark.slow  # make test keeps the Recorder's count of the same mode on ranks below
def test_prefetching_on_the_ring_trains_like_one_process():
    check_parity(2, FAST_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, shard_size", [(2, None), (4, None), (4, 2)])
def test_every_prefetch_and_reshard_mode_trains_like_one_process(world_size, shard_size):
    check_parity(world_size, [c for c in ALL_CASES if world_size != 2 or c not in FAST_CASES],
                 shard_size)


def test_the_parity_oracle_catches_a_wrong_step():
    """The check above can fail: states one step late (a step whose gradient was lost) do
    not pass."""
    right = reference_run("sgd")
    with pytest.raises(AssertionError):
        assert_states_match([right[0], *right[:-1]], right, "one step late")


# --- what backward gathers ---------------------------------------------------------------------


def traffic_worker(rank: int, world_size: int) -> dict[bool, dict[str, int]]:
    """reshard_after_forward -> bytes this rank sent in forward and in backward (second
    step), and the padded parameters' bytes."""
    out = {}
    for reshard in (True, False):
        recorder = Recorder()
        model = FSDP(Deep(), units=None, collectives=Algorithm.RING, recorder=recorder,
                     prefetch=1, reshard_after_forward=reshard)
        for _ in range(2):
            before = recorder.stats.bytes_sent
            loss = model(torch.ones(2, 10)).sum()
            forward = recorder.stats.bytes_sent - before  # the forward waited for its gathers
            loss.backward()
            model.finish_gradient_synchronization()
        out[reshard] = {"forward": forward,
                        "backward": recorder.stats.bytes_sent - before - forward,
                        "padded": sum(u.padded_numel for u in model.units) * 4}
    return out


def test_keeping_parameters_after_forward_runs_no_all_gather_in_backward():
    for per_rank in launch(traffic_worker, 2, echo=False):
        for reshard, sent in per_rank.items():
            half = sent["padded"] // 2  # (N-1)/N of S at N = 2, for one collective
            assert sent["forward"] == half, reshard  # one all-gather per unit
            # backward: a reduce-scatter, and an all-gather again unless the gather was kept
            assert sent["backward"] == (2 * half if reshard else half), reshard


# --- overlap on the emulated link --------------------------------------------------------------

#: Seconds of "compute" in every block's forward and again in its backward. A collective on
#: :data:`LINK` takes about alpha (the units are tiny), half of it, which leaves both timing
#: checks a margin of about alpha against a stall of a loaded machine: unit 2's reduce-scatter
#: still travels when unit 1's backward starts, and unit 0's prefetched gather, queued behind
#: it on the one stream, still starts inside unit 1's backward. (With alpha = 5 ms the first
#: margin fell to 0.4 ms with three busy processes beside the test, and CI once saw it lost.)
COMPUTE = 0.15
LINK = labs.Link(alpha=COMPUTE / 2, bandwidth=12.5e6)


class Busy(torch.autograd.Function):
    """The identity, that sleeps :data:`COMPUTE` seconds in forward and in backward: compute
    that releases the GIL, like a kernel, and takes a known time."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE)
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(COMPUTE)
        return grad


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Busy.apply(self.linear(x))


def timeline_worker(rank: int, world_size: int) -> dict[int, FSDPTimeline]:
    """prefetch -> the second step's timeline, three blocks, on the emulated link."""
    out = {}
    for prefetch in (0, 1):
        torch.manual_seed(0)
        net = nn.Sequential(Block(), Block(), Block())
        model = FSDP(net, collectives=Algorithm.RING, prefetch=prefetch)
        for _ in range(2):
            model(torch.ones(2, 10)).square().sum().backward()
            model.finish_gradient_synchronization()
        out[prefetch] = model.timeline
    return out


def gathers_ahead(timeline: FSDPTimeline, order: list[str], compute: Activity) -> list[bool]:
    """For each unit but the last of ``order``: did the next unit's all-gather of that pass
    travel while this unit computed (the two intervals overlap)? A prefetch run synchronously
    before the compute, or a gather started after it, does not count."""
    ahead = []
    for this, following in zip(order, order[1:], strict=False):
        busy = timeline.first(compute, this)
        gathers = [g for g in timeline.of(Activity.ALL_GATHER, following)
                   if (g.start > timeline.first(Activity.FORWARD, following).end)
                   == (compute is Activity.BACKWARD)]
        ahead.append(gathers[0].start < busy.end and gathers[0].end > busy.start)
    return ahead


@pytest.mark.slow  # a stall of a loaded machine longer than COMPUTE would read as no overlap
def test_prefetch_starts_the_next_units_all_gather_while_this_one_computes_on_the_link():
    results = launch(timeline_worker, 2, link=LINK, echo=False)
    names = ["0", "1", "2"]
    for per_rank in results:
        # prefetch=1: each unit's all-gather starts while the unit ahead of it computes
        assert gathers_ahead(per_rank[1], names, Activity.FORWARD) == [True, True]
        assert gathers_ahead(per_rank[1], names[::-1], Activity.BACKWARD) == [True, True]
        # prefetch=0, the same check failing: every gather waits for the unit that needs it
        assert gathers_ahead(per_rank[0], names, Activity.FORWARD) == [False, False]
        assert gathers_ahead(per_rank[0], names[::-1], Activity.BACKWARD) == [False, False]
        # unit 2's reduce-scatter is still travelling when unit 1's backward starts; without
        # prefetch, unit 1's gather queues behind it on the one stream, so it has landed
        for prefetch, timeline in per_rank.items():
            in_flight = (timeline.first(Activity.REDUCE_SCATTER, "2").end
                         > timeline.first(Activity.BACKWARD, "1").start)
            assert in_flight == (prefetch == 1), prefetch


# --- bad arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch, reshard, message", [
    (-1, True, "prefetch must be None .* or an int >= 0"),
    (1.0, True, "prefetch must be None"),
    (True, True, "prefetch must be None"),
    ("1", True, "prefetch must be None"),
    (1, 1, "reshard_after_forward must be True .* or False"),
    (None, None, "reshard_after_forward must be"),
])
def test_bad_prefetch_arguments_say_what_to_pass(prefetch, reshard, message):
    with pytest.raises(ValueError, match=message):
        check_prefetch(prefetch, reshard)


@pytest.mark.parametrize("prefetch, reshard", [(None, True), (0, False), (3, True)])
def test_good_prefetch_arguments_pass(prefetch, reshard):
    check_prefetch(prefetch, reshard)


def refused_worker(rank: int, world_size: int, prefetch: int) -> tuple[int, str]:
    """(collectives called before FSDP refused ``prefetch``, its message)."""
    return calls_before_refusal(
        lambda: FSDP(Deep(), collectives=Algorithm.RING, prefetch=prefetch))


def test_fsdp_refuses_a_bad_prefetch_before_any_collective():
    for calls, text in launch(refused_worker, 2, args=(-1,), echo=False, timeout=30):
        assert "prefetch must be None" in text
        assert calls == 0


def test_the_collective_counter_sees_a_right_fsdp_broadcast():
    """The counter above is live: with a right prefetch, FSDP broadcasts when built."""
    for calls, text in launch(refused_worker, 2, args=(1,), echo=False, timeout=30):
        assert text == "no error" and calls > 0
