"""labs.memory: what the timeline counts (storages once, views not twice, freed tensors not at
all), what the allocation tracker sees, the chapter 3/4 workers on real ranks, a wrong claim
failing the check, and labs.viz.memory's table and figure."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from labs import launch
from labs.checks.claims import check_held_bytes
from labs.collectives import Algorithm, shard_bounds
from labs.memory import (
    AllGatherMoment,
    AllocationTracker,
    MemoryTimeline,
    ReduceScatterMoment,
    ShardMemorySettings,
    all_gather_memory,
    find,
    named_tensors,
    reduce_scatter_memory,
)
from labs.viz.memory import describe_allocations, memory_table, plot_memory_timeline

# --- the timeline, in one process --------------------------------------------------------------


def test_a_storage_registered_twice_counts_once():
    timeline = MemoryTimeline()
    a = torch.zeros(100)
    snap = timeline.record("twice", first=a, second=a)
    assert snap.held_bytes == 400
    assert snap.held_elements == 100
    assert [t.shares_with for t in snap.tensors] == [None, "first"]
    assert snap.bytes_by_group() == {"first": 400, "second": 0}


def test_views_count_their_whole_storage_once():
    timeline = MemoryTimeline()
    matrix = torch.zeros(4, 4, dtype=torch.float64)
    row, col = matrix[1], matrix[:, 2]
    snap = timeline.record("views", matrix=matrix, row=row, col=col)
    assert snap.held_bytes == 16 * 8
    rows = {t.name: t for t in snap.tensors}
    assert rows["row"].nbytes == 4 * 8 and rows["row"].storage_bytes == 16 * 8
    assert rows["row"].shares_with == rows["col"].shares_with == "matrix"


def test_a_view_alone_keeps_its_whole_storage_alive():
    timeline = MemoryTimeline()
    big = torch.zeros(1000)
    piece = big[:10]
    timeline.track(piece=piece)
    del big
    assert timeline.record("only the view left").held_bytes == 4000


def test_distinct_tensors_add_up():
    timeline = MemoryTimeline()
    snap = timeline.record("two", a=torch.zeros(10), b=torch.zeros(3, dtype=torch.int64))
    assert snap.held_bytes == 40 + 24
    assert snap.held_elements == 13


def test_a_freed_tensor_leaves_the_count():
    timeline = MemoryTimeline()
    keep, drop = torch.zeros(10), torch.zeros(20)
    assert timeline.record("both", keep=keep, drop=drop).held_bytes == 120
    del drop
    after = timeline.record("after del")
    assert after.held_bytes == 40
    assert [t.name for t in after.tensors] == ["keep"]


def test_the_timeline_does_not_keep_tensors_alive():
    timeline = MemoryTimeline()
    t = torch.zeros(10)
    timeline.record("registered", t=t)
    storage_ref = torch.multiprocessing.reductions.StorageWeakRef(t.untyped_storage())
    del t
    assert storage_ref.expired()


def test_a_storage_resized_to_zero_counts_as_empty():
    timeline = MemoryTimeline()
    flat = torch.zeros(64)
    timeline.record("full", flat=flat)
    flat.untyped_storage().resize_(0)  # how PyTorch FSDP frees an unsharded parameter
    assert timeline.record("resized").held_bytes == 0


def test_snapshots_are_kept_in_order_and_found_by_enum_or_label():
    timeline = MemoryTimeline(rank=3)
    timeline.record(AllGatherMoment.BEFORE, x=torch.zeros(1))
    timeline.record("later")
    snaps = timeline.snapshots
    assert [s.moment for s in snaps] == ["before all-gather", "later"]
    assert find(snaps, AllGatherMoment.BEFORE).rank == 3
    with pytest.raises(KeyError, match="the moments recorded are"):
        find(snaps, "never")


def test_no_cuda_numbers_for_cpu_tensors():
    snap = MemoryTimeline().record("cpu", x=torch.zeros(3))
    assert snap.allocator_bytes is None


@pytest.mark.gpu
def test_cuda_tensors_report_the_allocator_too():
    x = torch.zeros(256, device="cuda")
    snap = MemoryTimeline().record("cuda", x=x)
    assert snap.held_bytes == 1024
    assert snap.allocator_bytes is not None and snap.allocator_bytes >= 1024


# --- what counts as "held" ---------------------------------------------------------------------


def test_modules_bring_their_gradients_buffers_and_optimizer_state():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model(torch.randn(4, 3)).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    names = [name for name, _ in named_tensors({"model": model, "opt": opt}, "m")]
    assert "m.model.0.weight" in names and "m.model.0.weight.grad" in names
    assert "m.model.1.running_mean" in names
    assert "m.opt.state[0].exp_avg" in names and "m.opt.state[0].exp_avg_sq" in names
    snap = MemoryTimeline().record("training state", model=model, opt=opt)
    params = sum(p.numel() for p in model.parameters())
    # weights + grads + Adam's two moments, float32, plus BatchNorm's buffers and Adam's steps
    assert snap.bytes_by_group()["model"] >= 2 * 4 * params
    assert snap.bytes_by_group()["opt"] >= 2 * 4 * params


def test_unknown_objects_are_refused_with_a_hint():
    with pytest.raises(TypeError, match="cannot find tensors in a str"):
        MemoryTimeline().record("bad", x="not a tensor")


def test_sparse_tensors_are_refused_with_a_hint():
    with pytest.raises(TypeError, match="values"):
        MemoryTimeline().record("sparse", x=torch.eye(3).to_sparse())


# --- allocations inside a region ---------------------------------------------------------------


def test_tracker_counts_new_storages_not_views_or_in_place_results():
    base = torch.zeros(100)
    with AllocationTracker() as during:
        view = base[10:20]  # no new storage
        base.add_(1)  # in place
        torch.add(base, 1, out=base)  # out= an existing tensor
        copy = base.clone()  # 400 bytes
        del view
    assert [(a.op, a.nbytes) for a in during.allocations] == [("clone", 400)]
    assert during.peak_bytes == during.live_bytes == 400
    del copy
    assert during.live_bytes == 0


def test_tracker_peak_is_the_most_alive_at_once():
    with AllocationTracker() as during:
        a = torch.empty(100)  # 400
        b = torch.empty(50)  # 200 -> 600 alive
        del a
        c = torch.empty(25)  # 100 -> 300 alive
    assert during.peak_bytes == 600
    assert during.allocated_bytes == 700
    assert during.live_bytes == 300
    del b, c


def test_tracker_sees_a_storage_freed_and_regrown_in_place():
    with AllocationTracker() as during:
        full = torch.empty(100)  # 400
        full.untyped_storage().resize_(0)  # freed, as FSDP's reshard does
        torch.zeros(50)  # 200, dropped at once: the peak is still 400
        full.untyped_storage().resize_(400)
        full.add_(1)  # an operator after the regrowth: 400 alive again
    assert during.peak_bytes == 400
    assert during.live_bytes == 400
    full.untyped_storage().resize_(0)
    assert during.live_bytes == 0  # read at the present size, after the block too
    assert [(a.op, a.nbytes) for a in during.allocations] == [("empty", 400), ("zeros", 200)]


def test_an_empty_storage_is_watched_not_listed():
    with AllocationTracker() as during:
        buffer = torch.empty(0)
        buffer.untyped_storage().resize_(40)
        buffer.add_(1)
    assert during.allocations == []
    assert during.peak_bytes == during.live_bytes == 40
    del buffer


def test_tracker_counts_torch_tensor_from_python_data():
    with AllocationTracker() as during:
        made = torch.tensor([1.0, 2.0, 3.0])  # filled outside the dispatcher, then lift_fresh
    assert during.live_bytes == 12
    del made


def test_tracked_tensors_count_and_untracked_ones_stop_counting():
    params = [torch.zeros(10), torch.zeros(20)]  # 40 + 80, made before the block
    during = AllocationTracker()
    during.track([params[0], params[0][2:]])  # a storage counts once
    assert during.peak_bytes == during.live_bytes == 40
    with during:
        result = params[1] * 2  # 80; params[1] itself is not tracked
        scratch = torch.ones(5)  # 20
    assert during.live_bytes == 40 + 80 + 20
    during.untrack([result])
    assert during.live_bytes == 40 + 20
    del scratch
    assert during.live_bytes == 40
    assert during.peak_bytes == 140


def test_tracker_can_be_entered_again_and_its_peak_reset():
    during = AllocationTracker()
    with during:
        first = torch.empty(100)  # 400
        del first
    assert during.peak_bytes == 400 and during.live_bytes == 0
    during.reset_peak()
    with during:
        second = torch.empty(10)  # 40
    assert during.peak_bytes == 40
    assert [a.nbytes for a in during.allocations] == [400, 40]
    del second


# --- the chapter 3 and 4 workers on real ranks -------------------------------------------------


def test_settings_refuse_bad_input_before_any_rank_starts():
    with pytest.raises(ValueError, match="positive int"):
        ShardMemorySettings(numel=0)
    with pytest.raises(ValueError, match="Algorithm.RING"):
        ShardMemorySettings(algorithm=Algorithm.NAIVE)
    with pytest.raises(TypeError, match="torch.dtype"):
        ShardMemorySettings(dtype="float32")


@pytest.mark.parametrize(("world_size", "algorithm"),
                         [(1, Algorithm.RING), (3, Algorithm.RING), (4, Algorithm.TORCH)])
def test_reduce_scatter_memory_on_real_ranks(world_size, algorithm):
    settings = ShardMemorySettings(numel=10, dtype=torch.float64, algorithm=algorithm)
    per_rank = launch(reduce_scatter_memory, world_size, args=(settings,), echo=False)
    bounds = shard_bounds(10, world_size)
    for rank, snaps in enumerate(per_rank):
        shard = (bounds[rank + 1] - bounds[rank]) * 8
        assert find(snaps, ReduceScatterMoment.GRADIENT).held_bytes == 80
        assert find(snaps, ReduceScatterMoment.AFTER).held_bytes == 80 + shard
        assert find(snaps, ReduceScatterMoment.FREED).held_bytes == shard
        during = find(snaps, ReduceScatterMoment.DURING)
        assert during.held_bytes == 80
        assert during.transient_bytes >= shard  # at least the result was allocated


@pytest.mark.parametrize("world_size", [2, 5])
def test_all_gather_memory_on_real_ranks(world_size):
    settings = ShardMemorySettings(numel=13)
    per_rank = launch(all_gather_memory, world_size, args=(settings,), echo=False)
    bounds = shard_bounds(13, world_size)
    for rank, snaps in enumerate(per_rank):
        shard = (bounds[rank + 1] - bounds[rank]) * 4
        assert find(snaps, AllGatherMoment.BEFORE).held_bytes == shard
        assert find(snaps, AllGatherMoment.AFTER).held_bytes == shard + 52
        assert find(snaps, AllGatherMoment.FREED).held_bytes == shard
        assert find(snaps, AllGatherMoment.DURING).transient_bytes >= 52


# --- checking a claim: the right one passes, wrong ones fail ------------------------------------


@pytest.fixture(scope="module")
def reduce_scatter_runs():
    settings = ShardMemorySettings(numel=12)
    return {n: launch(reduce_scatter_memory, n, args=(settings,), echo=False) for n in (1, 2, 3)}


def test_the_right_claim_passes(reduce_scatter_runs):
    result = check_held_bytes(reduce_scatter_runs, ReduceScatterMoment.FREED,
                              lambda n, r: 48 // n, "shard is S/N")
    assert result.passed
    assert str(result).startswith("PASS: shard is S/N")


@pytest.mark.parametrize(("moment", "wrong", "where"), [
    # the full gradient was never dropped: S + S/N, not S/N
    (ReduceScatterMoment.AFTER, lambda n, r: 48 // n, "N = 1, rank 0 held 96"),
    # the seed's "every rank stores 1 value" in elements, not bytes
    (ReduceScatterMoment.FREED, lambda n, r: 12 // n, "N = 1, rank 0 held 48"),
    # right at N = 1 and 2, wrong for one rank at N = 3
    (ReduceScatterMoment.FREED, lambda n, r: 48 // n if n < 3 or r < 2 else 0,
     "N = 3, rank 2 held 16"),
])
def test_wrong_claims_fail_and_say_where(reduce_scatter_runs, moment, wrong, where):
    result = check_held_bytes(reduce_scatter_runs, moment, wrong, "a claim")
    assert not result.passed
    assert where in result.message
    assert str(result).startswith("FAIL: a claim")


# --- tables and figures ------------------------------------------------------------------------


def test_table_and_figure(reduce_scatter_runs):
    table = memory_table(reduce_scatter_runs[3], ranks=(0, 2))
    assert "full gradient freed" in table and "shard (elements)" in table
    fig = plot_memory_timeline(reduce_scatter_runs[3])
    assert isinstance(fig, Figure)
    assert len(fig.axes[0].patches) > 0
    # every bar says whose it is: the ranks 0..2 under each of the moments
    moments = len(reduce_scatter_runs[3][0])
    ranks = [t.get_text() for t in fig.axes[0].get_xticklabels(minor=True)]
    assert ranks == ["0", "1", "2"] * moments


def test_plot_refuses_ranks_with_different_moments():
    a, b = MemoryTimeline(0), MemoryTimeline(1)
    a.record("x")
    b.record("y")
    with pytest.raises(ValueError, match="other moments"):
        plot_memory_timeline([a.snapshots, b.snapshots])


def test_allocations_are_described_by_operator_and_size():
    with AllocationTracker() as during:
        a, b = torch.empty(4), torch.empty(4)
        c = a.clone()
    assert describe_allocations(during.allocations) == "empty 16 B x2, clone 16 B"
    assert describe_allocations(()) == "nothing"
    del a, b, c
