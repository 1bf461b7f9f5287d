"""labs.tree_all_reduce, NCCL's double binary tree all-reduce, checked four ways:

1. the trees as pure data (N = 1..16): each spans every rank once with one root and no cycle,
   is NCCL's ``ncclGetBtree``/``ncclGetDtree`` (a literal port of src/graph/trees.cc here, up
   to N = 64), has depth ceil(log2 N), and no rank is interior in both trees at even N, one
   (rank 0) at odd N >= 3;
2. on real ranks (N = 1, 2, 3, 5, 8): torch's ``dist.all_reduce`` answer, bit for bit on
   integer-valued inputs, the same bits on every rank, for numel 0, 1, N-1, N+1, 1000, 12345,
   float32/float64/bfloat16, SUM and AVG, several segments or one; and the traffic a
   ``Recorder`` counts equals the closed form computed here from the trees (a tree that
   forgets a child fails both checks);
3. ``double_tree_on_link`` equals a message-by-message run of the port model written here
   (N = 2..12), and hand derivations for N = 2 and 3;
4. real ranks on the emulated link take what the model says (one-sided: tests/timing_bounds.py).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from timing_bounds import fastest_of_slowest, follows

from labs import Link, launch
from labs.p2p import CommStats, Recorder
from labs.tree_all_reduce import (
    DEFAULT_TREE_SEGMENT_BYTES,
    Tree,
    double_tree_all_reduce,
    double_tree_on_link,
    tree_pair,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

#: Round numbers for hand derivations: half of S = 400 B is 2 s on the wire, alpha 1 s.
EASY = Link(alpha=1.0, bandwidth=100.0)
LINK = Link(alpha=50e-3, bandwidth=5e6)  #: the real-rank link of tests/test_link_model.py
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


# --- 1. the trees as data ------------------------------------------------------------------------


def _nccl_btree(nranks: int, rank: int) -> tuple[int, int, int]:
    """ncclGetBtree, line by line: (up, down0, down1), -1 for none."""
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, (bit >> 1 if nranks > 1 else -1), -1
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1


def _nccl_dtree(nranks: int) -> list[tuple[list[int], list[list[int]]]]:
    """ncclGetDtree for every rank: [(parents, children)] of tree 0 and tree 1."""
    out = []
    for which in range(2):
        parents, children = [], []
        for rank in range(nranks):
            def back(r: int, which: int = which) -> int:  # tree 1: shift (odd N), mirror
                return r if which == 0 else (r + 1) % nranks if nranks % 2 else nranks - 1 - r

            source = rank if which == 0 else (
                (rank - 1 + nranks) % nranks if nranks % 2 else nranks - 1 - rank)
            up, d0, d1 = _nccl_btree(nranks, source)
            parents.append(-1 if up == -1 else back(up))
            children.append(sorted(back(d) for d in (d0, d1) if d != -1))
        out.append((parents, children))
    return out


def _depths(parents: Sequence[int]) -> list[int]:
    """Hops from each rank up to the root; fails on a cycle."""
    out = []
    for rank in range(len(parents)):
        hops, at = 0, rank
        while parents[at] != -1:
            at, hops = parents[at], hops + 1
            assert hops <= len(parents), f"cycle through rank {rank}"
        out.append(hops)
    return out


#: Ranks interior in both trees: none at even N, rank 0 at odd N >= 3 (one child in each).
BOTH_INTERIOR = {n: (set() if n % 2 == 0 or n == 1 else {0}) for n in range(1, 17)}


@pytest.mark.parametrize("n", range(1, 17))
def test_each_tree_spans_every_rank_once_with_one_root_and_depth_ceil_log2(n):
    trees = tree_pair(n)
    for tree in trees:
        assert [r for r in range(n) if tree.parent[r] == -1] == [tree.root]
        for r in range(n):  # parent and children agree, every rank is someone's child once
            assert all(tree.parent[c] == r for c in tree.children[r])
            assert 1 <= len(tree.children[r]) <= 2 or r not in tree.interior()
        assert sorted(c for kids in tree.children for c in kids) == \
            sorted(set(range(n)) - {tree.root})
        depths = _depths(tree.parent)  # no cycle
        assert max(depths) == tree.depth() == math.ceil(math.log2(n))
        assert tree.depth() <= math.ceil(math.log2(n)) + 1
    assert trees[0].root == 0 and trees[1].root == (n - 1 if n % 2 == 0 or n == 1 else 1)
    assert set(trees[0].interior() & trees[1].interior()) == BOTH_INTERIOR[n]
    if n > 1:  # every other rank is a leaf in at least one tree
        assert set(trees[0].interior()) == {r for r in range(n) if r % 2 == 0}


@pytest.mark.parametrize("n", range(1, 65))
def test_the_trees_are_ncclGetDtree(n):
    for tree, (parents, children) in zip(tree_pair(n), _nccl_dtree(n), strict=True):
        assert list(tree.parent) == parents
        assert [sorted(kids) for kids in tree.children] == children


def test_tree_pair_refuses_a_bad_world_size():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            tree_pair(bad)


# --- 2. on real ranks: the answer, the bits, the traffic -----------------------------------------


def _broken_pair(n: int) -> tuple[Tree, Tree]:
    """The double tree with one child forgotten: in tree 0 the last child of the root's child
    is cut off and becomes a root of its own (so nothing hangs, and its subtree's half of the
    sum is lost)."""
    first, second = tree_pair(n)
    top = first.children[first.root][0]
    lost = first.children[top][-1]
    parent = list(first.parent)
    parent[lost] = -1
    children = list(first.children)
    children[top] = first.children[top][:-1]
    return Tree(tuple(parent), tuple(children)), second


def _cases(n: int) -> list[tuple[int, torch.dtype, str, int | None]]:
    """(numel, dtype, op, segment_bytes) for a world of n ranks."""
    numels = sorted({0, 1, max(n - 1, 0), n + 1, 1000, 12345})
    # 1 KiB segments: 2-4 per half at numel 1000, 25-50 at 12345; None: one per half
    return [(numel, dtype, op, segment) for numel in numels for dtype in DTYPES
            for op in ("sum", "avg") for segment in (None, 1024)
            if op == "sum" or segment is None]


def _parity_worker(rank: int, world_size: int, broken: bool) -> dict:
    """Every case of _cases: our all-reduce and torch's on the same integer-valued input
    (exact in every dtype), a random float32 one, a non-contiguous one, and the traffic of
    recorded calls."""
    if broken:
        import labs.tree_all_reduce as module

        module.tree_pair = _broken_pair  # this rank's copy only
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}
    out: dict = {"cases": {}, "stats": {}}
    cases = _cases(world_size) if not broken else [(1000, torch.float32, "sum", 256)]
    for index, case in enumerate(cases):
        numel, dtype, op, segment = case
        gen = torch.Generator().manual_seed(index + 7919 * rank)
        x = torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected, op=dist.ReduceOp.SUM)  # gloo: SUM, then divide
        if op == "avg":
            expected.div_(world_size)
        ours = double_tree_all_reduce(x, ops[op], segment_bytes=segment)
        assert ours is x
        out["cases"][case] = (x, expected)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(12345, generator=gen)
    expected = x.clone()
    dist.all_reduce(expected)
    double_tree_all_reduce(x, segment_bytes=512)
    out["random"] = (x, expected)
    grid = torch.arange(6 * 7, dtype=torch.float64).reshape(6, 7).mul(rank + 1).t()  # a view
    double_tree_all_reduce(grid, segment_bytes=16)
    out["transposed"] = grid
    for numel, segment in ((1000, 256), (1001, 512), (1000, None)):
        recorder = Recorder()
        double_tree_all_reduce(torch.ones(numel), recorder=recorder, segment_bytes=segment)
        out["stats"][numel, segment] = recorder.stats
    return out


def _segments(numel: int, segment: int | None, element: int = 4) -> tuple[list[int], list[int]]:
    """Elements of each half (ceil, floor) and the segments they are cut into."""
    halves = [(numel + 1) // 2, numel // 2]
    per = numel if segment is None else max(1, segment // element)
    return halves, [-(-h // per) for h in halves]


def expected_stats(n: int, numel: int, segment: int | None, element: int = 4
                   ) -> list[CommStats]:
    """The closed form, from the trees of ncclGetDtree (not labs'): along every edge of tree t,
    one message per segment up and one down, so rank r sends and receives K_t (c_t + p_t)
    messages and H_t (c_t + p_t) bytes, c_t its children, p_t 1 unless it is the root."""
    halves, segments = _segments(numel, segment, element)
    stats = [CommStats() for _ in range(n)]
    for t, (parents, children) in enumerate(_nccl_dtree(n)):
        for r in range(n):
            edges = len(children[r]) + (parents[r] != -1)
            for s in (stats[r],):
                s.messages_sent += segments[t] * edges
                s.messages_received += segments[t] * edges
                s.bytes_sent += halves[t] * element * edges
                s.bytes_received += halves[t] * element * edges
    return stats


def _check_parity(per_rank: list[dict], n: int) -> None:
    for case in per_rank[0]["cases"]:
        reference = per_rank[0]["cases"][case][0]
        for rank, result in enumerate(per_rank):
            ours, expected = result["cases"][case]
            assert torch.equal(ours, expected), (n, case, rank)
            assert torch.equal(ours.view(torch.uint8) if ours.numel() else ours,
                               reference.view(torch.uint8) if ours.numel() else reference), \
                (n, case, rank, "bits differ between ranks")
    for rank, result in enumerate(per_rank):
        ours, expected = result["random"]
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(ours, per_rank[0]["random"][0]), rank
        grid = torch.arange(42, dtype=torch.float64).reshape(6, 7).t() * (n * (n + 1) / 2)
        assert torch.equal(result["transposed"], grid)


def _check_traffic(per_rank: list[dict], n: int) -> None:
    for (numel, segment), _ in per_rank[0]["stats"].items():
        expected = expected_stats(n, numel, segment)
        measured = [result["stats"][numel, segment] for result in per_rank]
        assert measured == expected, (n, numel, segment)


@pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.slow) if n in (1, 2, 5) else n
                               for n in (1, 2, 3, 5, 8)])  # 3 and 8: odd N and two levels
def test_torch_answer_same_bits_everywhere_and_the_closed_form_traffic(n):
    per_rank = launch(_parity_worker, n, args=(False,), backend="gloo", echo=False, timeout=120)
    _check_parity(per_rank, n)
    _check_traffic(per_rank, n)


def test_a_tree_that_forgets_a_child_fails_both_checks():
    n = 5
    per_rank = launch(_parity_worker, n, args=(True,), backend="gloo", echo=False, timeout=120)
    with pytest.raises(AssertionError):
        _check_parity(per_rank, n)
    with pytest.raises(AssertionError):
        _check_traffic(per_rank, n)


def test_the_traffic_closed_form_of_the_busiest_rank():
    """One segment per half: the busiest rank sends (and receives) 4 messages and 2S from
    N = 4 on, 3 and 3/2 S at N = 3, 2 and S at N = 2; 4(N-1) messages in all."""
    for n in range(2, 17):
        stats = expected_stats(n, 840, None)
        busiest = max(stats, key=lambda s: s.bytes_sent)
        want = (2, 840 * 4) if n == 2 else (3, 840 * 6) if n == 3 else (4, 840 * 8)
        assert (busiest.messages_sent, busiest.bytes_sent) == want, n
        assert all(s.bytes_sent == s.bytes_received for s in stats)
        assert sum(s.messages_sent for s in stats) == 4 * (n - 1)


def test_bad_arguments_are_refused_before_any_message():
    with pytest.raises(ValueError, match="op must be"):
        double_tree_all_reduce(torch.ones(3), op="max")
    with pytest.raises(ValueError, match="AVG"):
        double_tree_all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match="segment_bytes"):
        double_tree_all_reduce(torch.ones(3), segment_bytes=0)
    with pytest.raises(RuntimeError, match="not initialised"):
        double_tree_all_reduce(torch.ones(3))


# --- 3. the model against a message-by-message run of the port model ------------------------------


class _Ports:
    """The port model of labs.link for one schedule (as tests/test_link_model.py's)."""

    def __init__(self, n: int, link: Link) -> None:
        self.link, self.out_free, self.in_free = link, [0.0] * n, [0.0] * n

    def send(self, rank: int, at: float, nbytes: float) -> float:
        leaves = max(at, self.out_free[rank])
        self.out_free[rank] = leaves + nbytes / self.link.bandwidth
        return leaves

    def receive(self, rank: int, leaves: float, nbytes: float) -> float:
        start = max(leaves + self.link.alpha, self.in_free[rank])
        self.in_free[rank] = start + nbytes / self.link.bandwidth
        return self.in_free[rank]


def _program(n: int, rank: int, k: int) -> list[tuple[str, int, int, int]]:
    """Rank's (op, tree, segment, peer) in order, from the docstring of rank_program: reduce
    tree by tree, lower-first; broadcast tree by tree, higher-first; ties to tree 0."""
    trees = _nccl_dtree(n)

    def height(t: int, r: int) -> int:
        return max((1 + height(t, c) for c in trees[t][1][r]), default=0)

    up = sorted(range(2), key=lambda t: (height(t, rank), t))
    steps = []
    for t in up:
        parents, children = trees[t]
        for j in range(k):
            steps += [("wait", t, j, c) for c in children[rank]]
            targets = children[rank] if parents[rank] == -1 else [parents[rank]]
            steps += [("send", t, j, p) for p in targets]
    for t in up[::-1] if height(0, rank) != height(1, rank) else up:
        parents, children = trees[t]
        if parents[rank] != -1:
            for j in range(k):
                steps.append(("wait", t, j, parents[rank]))
                steps += [("send", t, j, c) for c in children[rank]]
    return steps


def _simulate(size: float, n: int, link: Link, segment: float | None) -> float:
    half = size / 2
    cut = half if segment is None else min(segment, half)
    pieces = [cut] * int(half // cut) + ([half % cut] if half % cut > 0 else [])
    programs = [_program(n, r, len(pieces)) for r in range(n)]
    ports, clock, at = _Ports(n, link), [0.0] * n, [0] * n
    left: dict[tuple[int, int, int, int], float] = {}
    while any(at[r] < len(programs[r]) for r in range(n)):
        for r in range(n):  # every rank as far as it can go; a wait needs the send posted
            while at[r] < len(programs[r]):
                op, t, j, peer = programs[r][at[r]]
                if op == "send":
                    left[t, j, r, peer] = ports.send(r, clock[r], pieces[j])
                elif (t, j, peer, r) in left:
                    clock[r] = max(clock[r], ports.receive(r, left[t, j, peer, r], pieces[j]))
                else:
                    break
                at[r] += 1
    return max(clock + ports.out_free)


def test_the_model_equals_a_message_by_message_run():
    rng = random.Random(0)
    for n in range(2, 13):
        for _ in range(6):
            link = Link(alpha=rng.choice([1e-3, 2e-2, 5e-2]), bandwidth=rng.choice([5e6, 5e7]))
            size = rng.choice([1e3, 3e5, 8e6, 1 << 20])
            segment = rng.choice([None, 1 << 14, DEFAULT_TREE_SEGMENT_BYTES, 1 << 18])
            model = double_tree_on_link(size, n, link, segment_bytes=segment)
            run = _simulate(size, n, link, segment)
            assert model == pytest.approx(run, rel=1e-9), (n, link, size, segment)


@pytest.mark.parametrize(("n", "segment", "expected"), [
    # S = 400 B: a half is 200 B = 2 s on the wire; alpha = 1 s
    (2, None, 2 * (1 + 2)),  # each rank's half goes up one hop, then back: 2(alpha + S/2bw)
    (2, 100, 1 + 4 * 1),  # 4 segments of 1 s through each in port, after one alpha
    (3, None, 4 * (1 + 2)),  # depth 2: four hops of a half, one after the other
    (1, None, 0.0),
])
def test_hand_derivations(n, segment, expected):
    assert double_tree_on_link(400, n, EASY, segment_bytes=segment) == pytest.approx(expected)


def test_a_wrong_form_is_told_apart():
    """The run is not the ring's form, nor a lock-step tree's 2D (alpha + S/(2 bw)) once the
    tensor is cut into segments."""
    n, size = 8, float(1 << 20)
    run = _simulate(size, n, LINK, DEFAULT_TREE_SEGMENT_BYTES)
    lock_step = 2 * 3 * LINK.seconds(size / 2)
    assert abs(run - lock_step) > 0.15 * run
    assert abs(run - _simulate(size, n, LINK, None)) > 0.15 * run


def test_the_model_refuses_what_it_cannot_price():
    with pytest.raises(TypeError, match="labs.Link"):
        double_tree_on_link(400, 4, (1.0, 100.0))
    with pytest.raises(ValueError, match="size_bytes"):
        double_tree_on_link(-1, 4, EASY)
    with pytest.raises(ValueError, match="world_size"):
        double_tree_on_link(400, 0, EASY)


# --- 4. on real ranks over the emulated link ------------------------------------------------------


def _timed_trees(rank: int, world_size: int, nbytes: int, segment: int | None) -> list[float]:
    """Three calls from a common start on the shared monotonic clock: from when the last rank
    started to when this rank returned."""
    times = []
    for _ in range(3):
        tensor = torch.full((nbytes // 4,), float(rank + 1))
        now = torch.tensor([time.monotonic()], dtype=torch.float64)
        dist.all_reduce(now, op=dist.ReduceOp.MAX)  # torch's own: not on the emulated link
        agreed = float(now) + 0.02
        time.sleep(max(0.0, agreed - time.monotonic()))
        started = torch.tensor([time.monotonic() - agreed], dtype=torch.float64)
        double_tree_all_reduce(tensor, segment_bytes=segment)
        ended = time.monotonic() - agreed
        dist.all_reduce(started, op=dist.ReduceOp.MAX)
        times.append(ended - float(started))
        assert float(tensor.min()) == float(tensor.max()) == world_size * (world_size + 1) / 2
    return times


@pytest.mark.slow  # 4-12 s: three calls of ~0.3 s per N, and two launches on a busy machine
@pytest.mark.parametrize("n", [3, 4])
def test_real_ranks_on_the_link_take_what_the_model_says(n):
    nbytes = 1 << 19  # halves of 256 KiB: four 64 KiB segments each
    per_rank = launch(_timed_trees, n, args=(nbytes, DEFAULT_TREE_SEGMENT_BYTES), link=LINK,
                      backend="gloo", echo=False, timeout=120)
    measured = fastest_of_slowest(per_rank)
    model = double_tree_on_link(nbytes, n, LINK)
    print(f"N = {n}: measured {measured * 1e3:.1f} ms, model {model * 1e3:.1f} ms")
    assert follows(measured, model), (n, measured, model)
