"""HSDP, ``FSDP(module, shard_size=g)``, on real ranks: parity with one process on the full
batch (a tied embedding, a frozen layer, a buffer; shard sizes 1, 2 and 4 at 4 ranks, units
that do not divide by 4), the gradient clipping, no_sync and bf16 under HSDP, the groups,
memory per rank and the bytes sent across groups against their closed forms, and a shard
size that does not divide the world size refused before any collective."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from collective_counter import COMMUNICATION, calls_before_refusal
from torch import nn

from labs import RankError
from labs.collectives import Algorithm, Recorder
from labs.experiments.hsdp import HsdpSettings, measure_hsdp
from labs.fsdp import FSDP
from labs.wrappers import Wrapper

from parity import (
    OPTIMIZERS,
    STEPS,
    TiedNet,
    assert_states_match,
    batch,
    launch,
    loss_of,
    rank_batch,
    reference_run,
    train_sharded,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

#: (shard size, collectives) of every parity case at 4 ranks
CASES = [(g, algo) for g in (1, 2, 4) for algo in (Algorithm.TORCH, Algorithm.RING)]


def parity_worker(rank: int, world_size: int, shard_sizes: list[int]
                  ) -> dict[str, object]:
    """Adam for STEPS steps per (shard size, collectives); the full parameters after each
    step, the groups, and (ring) the bytes sent inside and across groups."""
    x, y = rank_batch(rank, world_size)
    cls, kwargs = OPTIMIZERS["adam"]
    out: dict[str, object] = {}
    for g in shard_sizes:
        for algo in (Algorithm.TORCH, Algorithm.RING):
            inside, across = Recorder(), Recorder()
            ring = algo is Algorithm.RING
            model = FSDP(TiedNet(seed=rank), collectives=algo, shard_size=g,
                         recorder=inside if ring else None,
                         replicate_recorder=across if ring else None)
            key = f"{g}-{algo.name}"
            out[key] = train_sharded(model, cls(model.parameters(), **kwargs), x, y)
            out[f"{key} shards"] = [u.shard.numel() for u in model.units]
            out[f"{key} padded bytes"] = sum(4 * u.padded_numel for u in model.units)
            out[f"{key} shard rank"] = model.shard_rank
            out[f"{key} replicate"] = model.replicate_group is not None
            out[f"{key} sent"] = (inside.stats.bytes_sent, across.stats.bytes_sent)
    return out


def test_hsdp_matches_one_process_for_every_shard_size_at_four_ranks():
    results = launch(parity_worker, 4, args=([1, 2, 4],), echo=False, timeout=180)
    want = reference_run("adam")
    numels = [42, 66]  # hidden (weight and bias), the tied embedding
    for rank, got in enumerate(results):
        for g, algo in CASES:
            key = f"{g}-{algo.name}"
            assert_states_match(got[key], want, f"shard_size {g} {algo.name} rank {rank}")
            assert got[f"{key} shards"] == [math.ceil(n / g) for n in numels]  # 42/4: padded
            assert got[f"{key} shard rank"] == rank % g
            assert got[f"{key} replicate"] == (g < 4)


def test_bytes_across_groups_are_the_all_reduce_of_the_shards():
    """Ring: across groups only the all-reduce of S/g among n = N/g ranks, 2(n-1)/n·S/g per
    rank, 2(n-1)·S for all N ranks (exact even where a shard does not split into n equal
    chunks); inside, two all-gathers and a reduce-scatter of S per step and their sum."""
    results = launch(parity_worker, 4, args=([2, 1],), echo=False, timeout=120)
    for g in (2, 1):
        key, n = f"{g}-RING", 4 // g
        size = results[0][f"{key} padded bytes"]
        inside = sum(r[f"{key} sent"][0] for r in results)
        across = sum(r[f"{key} sent"][1] for r in results)
        assert across == STEPS * 2 * (n - 1) * size, (g, across, size)
        # two all-gathers and a reduce-scatter per rank and step (gather_full_params is not
        # counted: it has no recorder)
        assert inside == STEPS * 4 * 3 * (g - 1) / g * size, (g, inside, size)


def test_one_rank_with_shard_size_one_matches_one_process():
    got = launch(parity_worker, 1, args=([1],), echo=False, timeout=60)[0]
    for algo in (Algorithm.TORCH, Algorithm.RING):
        assert_states_match(got[f"1-{algo.name}"], reference_run("adam"), algo.name)


# --- clipping, no_sync, bf16 under HSDP --------------------------------------------------------

LR, MAX_NORM = 0.5, 0.05


def sgd_reference(clip: bool) -> tuple[dict[str, torch.Tensor], float]:
    """One process, the whole batch, one SGD step (after clipping); the total norm."""
    model = TiedNet(seed=0)
    x, y = batch()
    loss_of(model, x, y).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM if clip else math.inf)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(norm)


def feature_worker(rank: int, world_size: int, feature: str, algo: Algorithm
                   ) -> dict[str, object]:
    """One SGD step of HSDP (shard_size 2) with ``feature``: "clip", "accumulate" (two
    micro-batches, the first under no_sync) or "bf16" (compute; fp32 reduce)."""
    model = FSDP(TiedNet(seed=rank), torch.bfloat16 if feature == "bf16" else None,
                 reduce_dtype=torch.float32, collectives=algo, shard_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = rank_batch(rank, world_size)
    k = 2 if feature == "accumulate" else 1
    for micro in range(k):
        with model.no_sync() if micro < k - 1 else contextlib.nullcontext():
            (loss_of(model, x[micro::k], y[micro::k]) / k).backward()
    model.finish_gradient_synchronization()
    # The wrong total norm: the sum of squares over all N ranks counts every shard N/g times
    local = sum(float(u.shard.grad.square().sum()) for u in model.units)
    everyone = torch.tensor([local])
    dist.all_reduce(everyone)
    norm = model.clip_grad_norm_(MAX_NORM if feature == "clip" else math.inf)
    opt.step()
    return {"params": model.gather_full_params(), "norm": float(norm),
            "norm over all ranks": float(everyone[0].sqrt())}


@pytest.mark.parametrize("feature, algo", [
    ("clip", Algorithm.TORCH), ("clip", Algorithm.RING), ("accumulate", Algorithm.TORCH),
    ("bf16", Algorithm.TORCH), ("bf16", Algorithm.RING)])
def test_clip_no_sync_and_bf16_under_hsdp_match_one_process(feature, algo):
    want, norm = sgd_reference(clip=feature == "clip")
    tol = {"atol": 2e-3, "rtol": 2e-2} if feature == "bf16" else {}
    for got in launch(feature_worker, 4, args=(feature, algo), echo=False, timeout=120):
        assert got["norm"] == pytest.approx(norm, rel=2e-2 if tol else 1e-5)
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name].float(), value, **tol, msg=name)


def test_summing_the_norm_over_every_rank_is_wrong_by_the_square_root_of_the_groups():
    """The check above can fail: two groups hold the same shards, so a sum of squares over
    all 4 ranks counts every element twice."""
    _, norm = sgd_reference(clip=True)
    for got in launch(feature_worker, 4, args=("clip", Algorithm.TORCH), echo=False,
                      timeout=60):
        assert got["norm over all ranks"] == pytest.approx(math.sqrt(2) * norm, rel=1e-5)
        assert got["norm over all ranks"] != pytest.approx(norm, rel=1e-2)


def test_clipping_changes_the_step_so_the_parity_above_can_fail():
    clipped, norm = sgd_reference(clip=True)
    plain, _ = sgd_reference(clip=False)
    assert norm > 10 * MAX_NORM
    assert not torch.equal(clipped["hidden.weight"], plain["hidden.weight"])


# --- memory and traffic: the experiment ----------------------------------------------------------


def test_hsdp_holds_one_shard_size_th_of_ddp_and_sends_the_closed_form_across_groups():
    settings = HsdpSettings(width=16, layers=3, batch=4, steps=2, world_size=4, shard_size=2)
    rows = {r.strategy: r for r in measure_hsdp(settings, timeout=120)}
    ddp = rows[Wrapper.DDP].held
    # parameters + gradients + Adam's state: 1/g of DDP's, 10 % allowed for padding and
    # Adam's step counts; and measured, so a wrong layout would show
    assert ddp / 2 <= rows[Wrapper.HSDP].held <= 1.1 * ddp / 2
    assert ddp / 4 <= rows[Wrapper.FSDP].held <= 1.1 * ddp / 4
    for row in rows.values():
        assert row.across == row.expected_across, row
        assert row.inside == row.expected_inside, row
    # DDP runs the hierarchical all-reduce HSDP's gradient path is made of: the same bytes
    # across groups, and (g-1)/g·S fewer inside (no all-gather before backward); FSDP's flat
    # ring sends more across, so the closed forms can tell them apart
    assert rows[Wrapper.HSDP].across == rows[Wrapper.DDP].across < rows[Wrapper.FSDP].across
    assert rows[Wrapper.DDP].inside * 3 == rows[Wrapper.HSDP].inside * 2
    assert rows[Wrapper.FSDP].across != 2 * (settings.groups - 1) * rows[Wrapper.FSDP].size


# --- refusals -------------------------------------------------------------------------------

def refused_worker(rank: int, world_size: int, shard_size: object) -> tuple[int, str]:
    """(calls to any collective, or to ``new_group``, before FSDP refused, its message)."""
    return calls_before_refusal(lambda: FSDP(TiedNet(seed=0), shard_size=shard_size),
                                names=(*COMMUNICATION, "new_group"))


@pytest.mark.parametrize("shard_size", [3, 8, 0, True])
def test_a_shard_size_that_does_not_divide_the_world_is_refused_before_any_collective(
        shard_size):
    for calls, text in launch(refused_worker, 4, args=(shard_size,), echo=False, timeout=30):
        assert "shard_size must be a positive int that divides the world size" in text, text
        assert "Pick one of 1, 2, 4" in text
        assert calls == 0


def test_the_counter_sees_the_sub_groups_and_the_broadcast():
    """The counter above is live: a right shard size makes groups and broadcasts."""
    assert all(calls > 0 and text == "no error"
               for calls, text in launch(refused_worker, 4, args=(2,), echo=False, timeout=30))


def test_the_settings_refuse_a_shard_size_before_any_process_starts(refuse_processes):
    with refuse_processes(), pytest.raises(ValueError, match="Pick one of 1, 2, 4"):
        measure_hsdp(HsdpSettings(world_size=4, shard_size=3))


def test_a_recorder_without_the_ring_is_refused():
    def worker(rank: int, world_size: int) -> None:
        FSDP(TiedNet(seed=0), shard_size=1, replicate_recorder=Recorder())
    with pytest.raises(RankError, match="pass collectives=Algorithm.RING"):
        launch(worker, 2, echo=False, timeout=30)

