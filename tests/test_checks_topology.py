"""The checks of chapter 8's exercises, 8.1 (the hierarchical all-reduce) and 8.2 (one rank's
forward of a Megatron MLP), both on real ranks, pass right answers and fail each typical wrong
answer with its reason.

As in test_checks_fsdp_practice.py: first the reference solutions, then other right answers,
then one configurable learner function per exercise whose keyword switches (bound with
functools.partial) turn on one mistake each. Wrong answers run on 4 ranks (8.1: 2 nodes of 2,
4 nodes of 1 and 1 node of 4 in one launch) or 2 ranks (8.2).

The reference solutions are read from chapter 8's solution cells (tests/solutions.py). What
every check does alike (the reference passes, wrong arguments are refused before any rank
starts, a hang, the seed's note, the answer keys) is tested once, over the exercise registry,
in test_check_contract.py; tests of the same behaviour on more cases are marked slow.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import distributed_c10d

from labs.checks import check_hierarchical_all_reduce_, check_tp_mlp_forward
from labs.checks.collectives import CollectiveUsedError
from labs.checks.topology import _watched_sends
from labs.checks.topology_cases import (
    HIER_NUMELS,
    MLP_CASES,
    HierPlan,
    Layout,
    MlpPlan,
    cross_node_bound,
    hidden_slice,
    hier_input,
    hier_sum,
    layouts_of,
    mlp_reference,
    mlp_weights,
    rank_weights,
)
from labs.checks.watch import COLLECTIVE_METHODS
from labs.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter, shard_bounds

from solutions import send_by_value, solution

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# --- right answers: the reference solutions of chapter 8's exercises 8.1 and 8.2 ---------------

hierarchical_all_reduce_ = solution("08_beyond_one_node.ipynb", "8.1", "hierarchical_all_reduce_",
                                    globals())
tp_mlp_forward = solution("08_beyond_one_node.ipynb", "8.2", "tp_mlp_forward", globals())
send_by_value(__name__)


@pytest.mark.slow  # nbval compares this verdict (chapter 8's check cell); the contract runs 8.1
def test_right_hierarchical_all_reduce_passes_with_the_documented_verdict(capsys):
    result = check_hierarchical_all_reduce_(hierarchical_all_reduce_)
    assert result.passed, result.message
    assert str(result) == (
        "PASS: Exercise 8.1 hierarchical_all_reduce_: on 1, 2, 4 rank(s), in every layout (1: 1 "
        "node of 1; 2: 2 nodes of 1, 1 node of 2; 4: 2 nodes of 2, 4 nodes of 1, 1 node of 4), "
        "for tensors of 7, 1, 61 element(s), every rank's tensor holds the sum over every rank, "
        "exactly (integer inputs: no rounding), and no rank sent more to other nodes than "
        "2(n-1)/n of its chunk of S/g.")
    assert capsys.readouterr().out.startswith("PASS: Exercise 8.1")


@pytest.mark.slow  # nbval compares this verdict (chapter 8's check cell); the contract runs 8.2
def test_right_tp_mlp_forward_passes_with_the_documented_verdict(capsys):
    result = check_tp_mlp_forward(tp_mlp_forward)
    assert result.passed, result.message
    assert str(result) == (
        "PASS: Exercise 8.2 tp_mlp_forward: on 1, 2, 4 rank(s), for x of shape (3, 4), 7 hidden "
        "features; x of shape (2, 3, 6), 10 hidden features; x of shape (2, 5), 3 hidden "
        "features (cut unevenly between the ranks), every rank returned gelu(x W1^T + b1) W2^T "
        "+ b2 of the unsplit MLP (rtol = atol = 1e-05), with b2 added once and one all-reduce "
        "per rank.")
    assert capsys.readouterr().out.startswith("PASS: Exercise 8.2")


# --- the references themselves ------------------------------------------------------------------


def test_the_layouts_and_bounds_are_the_hierarchical_closed_form():
    assert [lay.node_size for lay in layouts_of(4)] == [2, 1, 4]
    assert [lay.node_size for lay in layouts_of(6)] == [2, 3, 1, 6]
    assert Layout(6, 2).cross_ranks(1) == [1, 3, 5] and Layout(6, 3).node_ranks(1) == [3, 4, 5]
    # 2(n-1)/n of S/g when everything divides; rounded up otherwise; nothing with one node
    assert cross_node_bound(Layout(4, 2), 8) == 2 * 1 / 2 * (8 * 4) / 2
    assert cross_node_bound(Layout(6, 2), 7) == 2 * 2 * 2 * 4  # ceil(ceil(7/2)/3) = 2
    assert cross_node_bound(Layout(4, 4), 61) == 0
    # the documented sizes divide by no node size, and one is smaller than every node
    assert all(numel % g for numel in HIER_NUMELS if numel > 1 for g in (2, 3, 4))
    assert min(HIER_NUMELS) < 2
    # the reference is the plain sum of the inputs
    layout = Layout(4, 2)
    want = sum(hier_input(0, layout, 0, r, 7) for r in range(4))
    torch.testing.assert_close(hier_sum(0, layout, 0, 7), want, rtol=0, atol=0)


def test_the_mlp_slices_cut_unevenly_and_add_up_to_the_unsplit_mlp():
    for n in (1, 2, 3, 4):
        for index, case in enumerate(MLP_CASES):
            sizes = [hidden_slice(case, n, r).stop - hidden_slice(case, n, r).start
                     for r in range(n)]
            assert sum(sizes) == case.hidden
            weights = mlp_weights(0, n, index, case)
            terms = []
            for r in range(n):
                x, w1, b1, w2, _ = rank_weights(weights, case, n, r)
                terms.append(F.gelu(x.double() @ w1.double().T + b1.double()) @ w2.double().T)
            torch.testing.assert_close(sum(terms) + weights.b2.double(), mlp_reference(weights))
    assert any(case.hidden % n for case in MLP_CASES for n in (2, 4))
    assert any(case.hidden < 4 for case in MLP_CASES)  # on 4 ranks, a rank holds none


# --- other right answers ----------------------------------------------------------------------


def hierarchical_lock_step_copying(tensor, node_group, cross_group):
    """Lock-step rings, the result gathered into a new tensor and copied back."""
    shard = ring_reduce_scatter(tensor, group=node_group, segment_bytes=None)
    shard = ring_all_reduce(shard, group=cross_group, segment_bytes=None)
    tensor.copy_(ring_all_gather(shard, node_group, numel=tensor.numel(), segment_bytes=None))
    return tensor


def tp_bias_on_rank_0(x, w1, b1, w2, b2):
    """The bias added before the all-reduce, but by one rank only: once in the sum."""
    out = F.gelu(x @ w1.T + b1) @ w2.T
    if dist.get_rank() == 0:
        out = out + b2
    dist.all_reduce(out)
    return out


def test_other_right_answers_pass():
    assert check_hierarchical_all_reduce_(hierarchical_lock_step_copying, world_sizes=(4,)).passed
    assert check_tp_mlp_forward(tp_bias_on_rank_0, world_sizes=(2, 4)).passed


# --- wrong answers to 8.1 ------------------------------------------------------------------------


def learner_hier(tensor, node_group, cross_group, *, flat=False, torch_sum=False,
                 skip_cross=False, skip_gather=False, new_tensor=False, swapped=False,
                 whole_across=False, no_numel=False, average=False, raise_on=None):
    """hierarchical_all_reduce_ with one switch per typical mistake."""
    if dist.get_rank() == raise_on:
        raise ValueError("this rank's code is broken")
    if flat:  # right, but the flat ring over every rank
        ring_all_reduce(tensor)
        return tensor
    if torch_sum:
        dist.all_reduce(tensor)
        return tensor
    if swapped:  # right, but the node's phases across nodes and the cross phase in the node
        node_group, cross_group = cross_group, node_group
    shard = ring_reduce_scatter(tensor, group=node_group)
    if not skip_cross and not whole_across:
        ring_all_reduce(shard, group=cross_group)
    if skip_gather:
        start, stop = shard_bounds(tensor.numel(), node_group.size())[
            node_group.rank():node_group.rank() + 2]
        tensor[start:stop] = shard
        return tensor
    if new_tensor:
        return ring_all_gather(shard, node_group, numel=tensor.numel())
    ring_all_gather(shard, node_group, numel=None if no_numel else tensor.numel(), out=tensor)
    if whole_across:  # right, but the whole tensor crosses nodes
        ring_all_reduce(tensor, group=cross_group)
    if average:
        tensor.div_(dist.get_world_size())
    return tensor


def test_the_learner_hier_passes_with_no_mistake_switched_on():
    assert check_hierarchical_all_reduce_(learner_hier, world_sizes=(4,)).passed


CASE0 = "with 4 rank(s) in 2 nodes of 2, a tensor of 7 element(s): "
TOO_MANY = ("more than the hierarchical all-reduce's 16: 2(n-1)/n of its chunk of S/g (2 nodes "
            "of g = 2, S = 28 bytes, sizes rounded up). Only phase 2, the all-reduce of this "
            "rank's chunk over cross_group, may leave the node")


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (partial(learner_hier, flat=True),
         [f"{CASE0}the sums are right, but rank 1 sent 40 bytes to ranks on other nodes, "
          f"{TOO_MANY}"]),
        (partial(learner_hier, swapped=True),
         [f"{CASE0}the sums are right, but rank 0 sent 28 bytes to ranks on other nodes, "
          f"{TOO_MANY}"]),
        (partial(learner_hier, whole_across=True),
         [f"{CASE0}the sums are right, but rank 0 sent 28 bytes to ranks on other nodes, "
          f"{TOO_MANY}"]),
        (partial(learner_hier, torch_sum=True),
         [f"{CASE0}Exercise 8.1: torch's all-reduce is refused here: the exercise builds the "
          "all-reduce from labs' ring collectives"]),
        (partial(learner_hier, skip_cross=True),
         [f"{CASE0}rank 0: every element holds the sum over this rank's node only (ranks 0, 1): "
          "between the reduce-scatter and the all-gather, all-reduce this rank's chunk across "
          "nodes, over cross_group."]),
        (partial(learner_hier, skip_gather=True),
         [f"{CASE0}rank 0: only its own chunk, elements [0, 4), holds the sum: all-gather the "
          "node's chunks inside the node, over node_group, into tensor"]),
        (partial(learner_hier, new_tensor=True),
         [f"{CASE0}rank 0: the sum is right in the tensor it returned, but `tensor` itself is "
          "unchanged: the all-reduce works in place"]),
        (partial(learner_hier, average=True),
         [f"{CASE0}rank 0: it holds the average over the ranks; the exercise asks for the sum"]),
        (partial(learner_hier, no_numel=True),
         [f"{CASE0}rank 0 raised ValueError. ring_all_gather cuts its result as "
          "ring_reduce_scatter cut the input", "pass numel=tensor.numel()."]),
        (partial(learner_hier, raise_on=1),
         [f"{CASE0}rank 1 raised ValueError.", "this rank's code is broken"]),
    ],
)
def test_wrong_hierarchical_all_reduce_fails_with_a_reason(answer, reasons, assert_fails):
    result = check_hierarchical_all_reduce_(answer, world_sizes=(4,))
    assert_fails(result, "8.1", *reasons)
    assert "labs/checks" not in result.message


def test_the_bytes_refusal_is_the_flat_ring_against_the_closed_form():
    # what the message of the flat ring says, from the ring's own schedule: at 2 x 2, rank 1's
    # right neighbour is on the next node, and every chunk but one crosses, twice
    bounds = shard_bounds(7, 4)
    chunk = [bounds[i + 1] - bounds[i] for i in range(4)]
    sent = sum(chunk[(1 - k - 1) % 4] for k in range(3)) + sum(chunk[(1 - k) % 4]
                                                               for k in range(3))
    assert sent * 4 == 40 > cross_node_bound(Layout(4, 2), 7) == 16


# --- wrong answers to 8.2 ------------------------------------------------------------------------


def learner_mlp(x, w1, b1, w2, b2, *, bias_before=False, no_reduce=False, two_reduces=False,
                no_bias=False, tanh=False, gather=False, returns_none=False, raise_on=None):
    """tp_mlp_forward with one switch per typical mistake."""
    if dist.get_rank() == raise_on:
        raise ValueError("this rank's code is broken")
    out = F.gelu(x @ w1.T + b1, approximate="tanh" if tanh else "none") @ w2.T
    if bias_before:
        out = out + b2
    if gather:  # right, but an all-gather of every rank's term and a local sum
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, out.contiguous())
        out = sum(parts)
    elif two_reduces:  # right, but the output in two halves, two all-reduces
        flat = out.reshape(-1)
        half = flat.numel() // 2
        dist.all_reduce(flat[:half])
        dist.all_reduce(flat[half:])
    elif not no_reduce:
        dist.all_reduce(out)
    if not (bias_before or no_bias):
        out = out + b2
    return None if returns_none else out


def test_the_learner_mlp_passes_with_no_mistake_switched_on():
    assert check_tp_mlp_forward(learner_mlp, world_sizes=(2,)).passed


MLP0 = "with 2 rank(s), x of shape (3, 4), 7 hidden features: "


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (partial(learner_mlp, bias_before=True),
         [f"{MLP0}rank 0: b2 is added 2 times: every rank added it before the all-reduce, which "
          "then summed the N copies. Add b2 once, after the all-reduce (or on one rank only)."]),
        (partial(learner_mlp, no_reduce=True),
         [f"{MLP0}rank 0: it is this rank's own term only, gelu(x W1_r^T + b1_r) W2_r^T + b2: "
          "the output is the SUM of every rank's term: all-reduce it (then add b2)."]),
        (partial(learner_mlp, two_reduces=True),
         [f"{MLP0}rank 0: the output is right, but it made 2 all-reduces (of 6, 6 element(s)): "
          "sum the terms with one all-reduce of the output (3, 4)"]),
        (partial(learner_mlp, gather=True),
         [f"{MLP0}rank 0: the output is right, but it made no all-reduce (it used all-gather): "
          "the exercise is one dist.all_reduce of the output (3, 4)"]),
        (partial(learner_mlp, no_bias=True),
         [f"{MLP0}rank 0: b2 is missing: add the second bias, once, after the all-reduce."]),
        (partial(learner_mlp, tanh=True),
         [f"{MLP0}rank 0: it matches the tanh approximation of GELU: use the exact one"]),
        (partial(learner_mlp, returns_none=True),
         [f"{MLP0}rank 0: returned NoneType; return the MLP's output, a tensor of shape (3, 4), "
          "the same on every rank."]),
        (partial(learner_mlp, raise_on=1),
         [f"{MLP0}rank 1 raised ValueError.", "this rank's code is broken"]),
    ],
)
def test_wrong_tp_mlp_forward_fails_with_a_reason(answer, reasons, assert_fails):
    result = check_tp_mlp_forward(answer, world_sizes=(2,))
    assert_fails(result, "8.2", *reasons)
    assert "labs/checks" not in result.message


def test_a_bias_added_before_the_all_reduce_passes_on_one_rank_only(capsys, assert_fails):
    # on one rank "N times" is once: the check needs more ranks to see the mistake
    assert check_tp_mlp_forward(partial(learner_mlp, bias_before=True), world_sizes=(1,)).passed
    capsys.readouterr()
    assert_fails(check_tp_mlp_forward(partial(learner_mlp, bias_before=True),
                                      world_sizes=(1, 4)), "8.2",
                 "with 4 rank(s), x of shape (3, 4), 7 hidden features: rank 0: b2 is added 4 "
                 "times")


# --- hidden cases, the refusal ----------------------------------------------------------------


def hier_fitted_to_two_nodes(tensor, node_group, cross_group):
    """Right on the documented layouts (at most 2 nodes), a flat ring on more."""
    if cross_group.size() > 2:
        ring_all_reduce(tensor)
    else:
        hierarchical_all_reduce_(tensor, node_group, cross_group)


def mlp_fitted_to_even_world_sizes(x, w1, b1, w2, b2):
    """Right on 1, 2 and 4 ranks, no all-reduce on an odd number of them."""
    out = F.gelu(x @ w1.T + b1) @ w2.T
    if dist.get_world_size() % 2 == 0:
        dist.all_reduce(out)
    return out + b2


def test_a_seed_draws_a_hidden_layout_that_catches_an_answer_fitted_to_the_documented_ones(
        assert_fails):
    result = check_hierarchical_all_reduce_(hier_fitted_to_two_nodes, world_sizes=(2,), seed=1)
    assert_fails(result, "8.1", "with 6 rank(s) in 3 nodes of 2, a tensor of 7 "
                 "element(s): the sums are right, but rank 1 sent")
    assert result.message.endswith("[seed 1 drew world size 6, 3 nodes of 2 and a tensor of 34 "
                                   "elements; pass seed=1 to rerun]")


def test_a_seed_draws_three_ranks_that_catch_an_mlp_fitted_to_the_documented_ones(
        assert_fails):
    result = check_tp_mlp_forward(mlp_fitted_to_even_world_sizes, world_sizes=(1,), seed=1)
    assert_fails(result, "8.2", "with 3 rank(s), x of shape (3, 4), 7 hidden features: "
                 "rank 0: it is this rank's own term only")
    assert result.message.endswith("[seed 1 drew world size 3 and x of shape (1, 4), 2 hidden "
                                   "features; pass seed=1 to rerun]")


@pytest.mark.slow  # the premise of the two tests above: these answers pass the documented cases
def test_answers_fitted_to_the_documented_cases_pass_them():
    assert check_hierarchical_all_reduce_(hier_fitted_to_two_nodes).passed
    assert check_tp_mlp_forward(mlp_fitted_to_even_world_sizes).passed


def test_plans_name_what_a_seed_draws():
    assert HierPlan.make((1, 2, 4), 0).note() == "" and MlpPlan.make((1, 2, 4), 0).note() == ""
    drawn = {HierPlan.make((1, 2, 4), seed).layouts(6)[0].node_size for seed in range(1, 20)}
    assert drawn == {2, 3}  # both layouts of 6 ranks are drawn
    plan = HierPlan.make((1, 2, 4, 6), 1)  # 6 asked for: every layout, no world size drawn
    assert plan.drawn_world_size is None and len(plan.layouts(6)) == 4
    assert MlpPlan.make((1, 2), 2) != MlpPlan.make((1, 2), 1)


def _sends_restored_worker(rank, world_size):
    group = distributed_c10d.ProcessGroup
    names = ["send", *(name for name in COLLECTIVE_METHODS if hasattr(group, name))]
    before = [getattr(group, name) for name in names]
    with pytest.raises(KeyError), _watched_sends():
        with pytest.raises(CollectiveUsedError, match="Exercise 8.1: torch's all-reduce"):
            dist.all_reduce(torch.zeros(1))
        raise KeyError("the learner's code raised")
    return [getattr(group, name) for name in names] == before


def test_the_refusal_names_the_exercise_and_is_restored():
    from labs.launcher import launch

    assert launch(_sends_restored_worker, 1, echo=False, timeout=30) == [True]


def hier_skipped_by_rank_0(tensor, node_group, cross_group):
    if dist.get_rank() == 0:
        return  # "rank 0's part is done elsewhere": its node peer waits for it
    hierarchical_all_reduce_(tensor, node_group, cross_group)


@pytest.mark.slow  # the contract's hang of 8.1; a wait inside labs' rings: test_checks_zero's 6.3
def test_a_rank_that_skips_its_part_fails_as_hung(assert_fails):
    result = check_hierarchical_all_reduce_(hier_skipped_by_rank_0, world_sizes=(4,), timeout=5)
    assert_fails(result, "8.1", "with 4 rank(s), rank(s) ", "hung for 5 s.",
                 "every rank of node_group must make the same reduce-scatter and all-gather")
    assert "was waiting at" in result.message and "in hierarchical_all_reduce_" in result.message
