"""The chapter 5 checks pass right answers and fail each typical wrong answer with its reason.

Answers are written as a learner writes them in the notebook: first the right ones (the
notebook's own solutions, read from it, and others), then one configurable learner class per
exercise whose subclasses switch on one mistake each. Wrong answers run on the fewest world
sizes that expose them. What every check does alike (the reference passes, wrong arguments are
refused before any rank starts, a hang, the seed's note, the answer keys) is tested once, over
the exercise registry, in test_check_contract.py; tests of the same behaviour on more cases
are marked slow.
"""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import all_reduce as imported_all_reduce
from torch.distributed import distributed_c10d

from labs.checks import check_bucketed_ddp, check_simple_ddp
from labs.checks.watch import watched_all_reduces

from solutions import send_by_value, solution

# --- right answers: the notebook's solutions, then others a learner may write ----------------


SimpleDDP = solution("05_ddp.ipynb", "5.1", "SimpleDDP", globals())
BucketedDDP = solution("05_ddp.ipynb", "5.2", "BucketedDDP", globals())
send_by_value(__name__)


class PlainSimpleDDP:
    """Not an nn.Module at all: the check needs only .module, calling it, and the method."""

    def __init__(self, module):
        self.module = module
        for tensor in module.state_dict().values():  # tied and frozen included, buffers too
            dist.broadcast(tensor, src=0)

    def __call__(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad = p.grad / dist.get_world_size()
                dist.all_reduce(p.grad)


class LibraryBucketedDDP(BucketedDDP):
    """The notebook's BucketedDDP under another name (labs' DDP is the answer key: refused)."""


@pytest.mark.slow  # nbval compares this verdict (chapter 5's check cell); the contract runs 5.1
def test_right_simple_ddp_passes_with_the_documented_verdict(capsys):
    result = check_simple_ddp(SimpleDDP)
    assert result.passed, result.message
    assert str(result) == (
        "PASS: Exercise 5.1 SimpleDDP: parameters match one process on the full batch on 1, 2, "
        "3, 4 rank(s), after each of 3 steps (tied weights, a frozen parameter and a buffer "
        "included).")
    assert capsys.readouterr().out.startswith("PASS: Exercise 5.1")


@pytest.mark.slow  # nbval compares this verdict (chapter 5's check cell); the contract runs 5.2
def test_right_bucketed_ddp_passes_with_the_documented_verdict(capsys):
    result = check_bucketed_ddp(BucketedDDP)
    assert result.passed, result.message
    assert str(result) == (
        "PASS: Exercise 5.2 BucketedDDP: parameters match one process on the full batch on 1, "
        "2, 3 rank(s); bucket caps of 1 B, 400 B and 25 MiB gave 8, 4 and 1 all-reduces per "
        "step, in bucket order, all launched asynchronously during backward.")
    assert capsys.readouterr().out.startswith("PASS: Exercise 5.2")


@pytest.mark.parametrize(
    ("check", "answer"),
    [
        (check_simple_ddp, PlainSimpleDDP),
        (check_bucketed_ddp, LibraryBucketedDDP),
    ],
)
def test_other_right_answers_pass(check, answer):
    result = check(answer, world_sizes=(1, 3))
    assert result.passed, result.message


# --- wrong answers to 5.1 -------------------------------------------------------------------


class LearnerSimpleDDP(nn.Module):
    """SimpleDDP with one switch per typical mistake."""

    broadcast = "all"  # "all", "none", "trainable" (no frozen, no buffers), "parameters"
    divide = True
    skip_frozen = True
    frozen_gets_zero_grad = False
    rank_zero_skips = False
    divide_at_most = None

    def __init__(self, module):
        super().__init__()
        self.module = module
        tensors = {
            "all": [*module.parameters(), *module.buffers()],
            "none": [],
            "trainable": [p for p in module.parameters() if p.requires_grad],
            "parameters": list(module.parameters()),
        }[self.broadcast]
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        if self.rank_zero_skips and dist.get_rank() == 0:
            return
        n = dist.get_world_size()
        if self.divide_at_most:
            n = min(n, self.divide_at_most)
        for p in self.module.parameters():
            if self.skip_frozen and p.grad is None:
                continue
            dist.all_reduce(p.grad)
            if self.divide:
                p.grad /= n
        if self.frozen_gets_zero_grad:
            self.module.frozen.grad = torch.zeros_like(self.module.frozen)


class NoBroadcast(LearnerSimpleDDP):
    broadcast = "none"


class BroadcastsTrainableOnly(LearnerSimpleDDP):
    broadcast = "trainable"


class BroadcastsNoBuffers(LearnerSimpleDDP):
    broadcast = "parameters"


class SumsWithoutDividing(LearnerSimpleDDP):
    divide = False


class AllReducesFrozenGrads(LearnerSimpleDDP):
    skip_frozen = False


class GivesFrozenAGradient(LearnerSimpleDDP):
    frozen_gets_zero_grad = True


class RankZeroSkipsTheAllReduces(LearnerSimpleDDP):
    rank_zero_skips = True


class DividesByAtMostFour(LearnerSimpleDDP):
    """Right on the documented 1 to 4 ranks only."""

    divide_at_most = 4


class NeverSynchronises(LearnerSimpleDDP):
    def finish_gradient_synchronization(self):
        pass


class OnlyRankZeroDivides(LearnerSimpleDDP):
    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                if dist.get_rank() == 0:
                    p.grad /= dist.get_world_size()


class KeepsNoModule(LearnerSimpleDDP):
    def __init__(self, module):
        super().__init__(module)
        self.net = self.module
        del self.module


class TakesNoModule(LearnerSimpleDDP):
    def __init__(self):
        super().__init__(nn.Linear(1, 1))


class NamesTheMethodOtherwise(nn.Module):
    """Averages in ``sync_gradients``: the training loop calls another name."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def sync_gradients(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def test_the_learner_class_passes_with_no_mistake_switched_on():
    assert check_simple_ddp(LearnerSimpleDDP, world_sizes=(2,)).passed


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (NoBroadcast, ["with 2 rank(s), after __init__: rank 1 still has its own initial "
                       "values of 'gain'",
                       "broadcast every parameter and buffer from rank 0 in __init__"]),
        (BroadcastsTrainableOnly, ["rank 1 still has its own initial values of the frozen "
                                   "parameter",
                                   "frozen parameters too"]),
        (BroadcastsNoBuffers, ["rank 1 still has its own initial values of the buffer 'scale'",
                               "buffers too"]),
        (SumsWithoutDividing, ["with 2 rank(s), step 1: rank 0: gain.grad holds the SUM over "
                               "ranks (2 x the mean)", "divide by the world size"]),
        (OnlyRankZeroDivides, ["step 1: rank 1: gain.grad holds the SUM"]),
        (NeverSynchronises, ["step 1: rank 0: gain.grad is unchanged, still this rank's own"]),
        (AllReducesFrozenGrads, ["rank 0 raised TypeError", "requires_grad=False have .grad "
                                 "None: skip them", "finish_gradient_synchronization"]),
        (GivesFrozenAGradient, ["step 1: rank 0: the frozen parameter 'frozen' got a .grad "
                                "(frozen parameter touched)"]),
        (KeepsNoModule, ["must keep the model it wraps as self.module (got NoneType)"]),
        (TakesNoModule, ["SimpleDDP must be built as SimpleDDP(module)"]),
        (NamesTheMethodOtherwise, ["SimpleDDP has no method finish_gradient_synchronization(self)"
                                   "; the training loop calls it after loss.backward()."]),
    ],
)
def test_wrong_simple_ddp_fails_with_a_reason(answer, reasons, assert_fails):
    assert_fails(check_simple_ddp(answer, world_sizes=(2,)), "5.1", *reasons)


class AddsOne(LearnerSimpleDDP):
    """Right, then adds 1, on the ranks in ``ranks``, to ``what``: "grads" every gradient after
    the average, "gain" or "frozen" that parameter before the optimizer step, "init" gain after
    the broadcast. The verdict must state the value got and the one expected, 1 apart."""

    what = "grads"
    ranks = (0, 1)

    def __init__(self, module):
        super().__init__(module)
        if self.what == "init" and dist.get_rank() in self.ranks:
            with torch.no_grad():
                self.module.gain.add_(1)

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        if dist.get_rank() not in self.ranks:
            return
        with torch.no_grad():
            if self.what == "grads":
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad += 1
            elif self.what in ("gain", "frozen"):
                getattr(self.module, self.what).add_(1)


class AddsOneToTheMeanOnRankOne(AddsOne):
    ranks = (1,)


class MovesGain(AddsOne):
    what = "gain"


class MovesGainOnRankOne(AddsOne):
    what, ranks = "gain", (1,)


class MovesFrozen(AddsOne):
    what = "frozen"


class ShiftsRankOneAfterTheBroadcast(AddsOne):
    what, ranks = "init", (1,)


class ShiftsRankZeroAfterTheBroadcast(AddsOne):
    what, ranks = "init", (0,)


_OFF_BY_ONE = "off by 1, the largest difference in the tensor"


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (AddsOne, ["with 2 rank(s), step 1: rank 0: gain.grad is not the mean over ranks of the "
                   "ranks' gradients: element ", "(the mean over ranks), " + _OFF_BY_ONE]),
        (MovesGain, ["with 2 rank(s), step 1: rank 0: 'gain' differs from one process after the "
                     "optimizer step, though the gradients were right: element ",
                     "(one process's), " + _OFF_BY_ONE + ". Change only p.grad"]),
        (AddsOneToTheMeanOnRankOne, [
            "step 1: ranks disagree: rank 1 and rank 0 hold different gain.grad (rank 1's "
            "element ", "(the mean over ranks), " + _OFF_BY_ONE + "); every rank must end"]),
        (MovesGainOnRankOne, [
            "step 1: ranks disagree: rank 1 and rank 0 hold different 'gain' after the optimizer "
            "step, though the gradients were right (rank 1's element ",
            "(one process's), " + _OFF_BY_ONE + ")."]),
        (MovesFrozen, [
            "step 1: rank 0: the frozen parameter 'frozen' changed (frozen parameter touched): "
            "element ", "(its value before the step), " + _OFF_BY_ONE + ". Leave parameters"]),
        (ShiftsRankOneAfterTheBroadcast, [
            "after __init__: rank 1's 'gain' after __init__ is neither rank 0's nor its own: "
            "element ", "(rank 0's), " + _OFF_BY_ONE + ". Broadcast every"]),
        (ShiftsRankZeroAfterTheBroadcast, [
            "after __init__: rank 0's 'gain' changed in __init__: element ",
            "(its value before __init__), " + _OFF_BY_ONE + ". Rank 0 is the source"]),
    ],
)
def test_wrong_values_are_shown_with_the_values_expected(answer, reasons, assert_fails,
                                                         stated_values):
    result = check_simple_ddp(answer, world_sizes=(2,))
    assert_fails(result, "5.1", *reasons)
    got, expected = stated_values(result.message)
    assert got == pytest.approx(expected + 1, abs=1e-4)


@pytest.mark.slow  # the contract's hang of 5.1
def test_a_rank_that_skips_the_all_reduces_fails_as_hung():
    result = check_simple_ddp(RankZeroSkipsTheAllReduces, world_sizes=(2,), timeout=3)
    assert not result.passed
    assert "with 2 rank(s), rank(s) 1 hung for 3 s" in result.message
    assert "in finish_gradient_synchronization" in result.message  # where rank 1 waited
    assert "same collectives" in result.message


# --- wrong answers to 5.2 -------------------------------------------------------------------


class LearnerBucketedDDP(BucketedDDP):
    """BucketedDDP with one switch per typical mistake."""

    broadcast = True
    divide = True
    reverse = True
    strictly_more = False
    launch = "in order"  # "in order", "when full" (out of order), "in finish"
    blocking = False
    wait_in_hook = False
    hook_every_parameter = False
    rank_one_never_launches = False
    divide_at_most = None

    def __init__(self, module, bucket_cap_mb):
        nn.Module.__init__(self)
        self.module = module
        if self.broadcast:
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(tensor, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, current, size = [], [], 0
        for p in reversed(params) if self.reverse else params:
            current.append(p)
            size += p.numel() * p.element_size()
            cap = bucket_cap_mb * 2**20
            if size > cap if self.strictly_more else size >= cap:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.slot = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.slot[id(p)] = (i, offset)
                offset += p.numel()
        self.reset()
        for p in module.parameters() if self.hook_every_parameter else params:
            p.register_post_accumulate_grad_hook(self.hook)

    def start(self, i):
        if self.rank_one_never_launches and dist.get_rank() == 1:
            return
        if self.blocking == "imported":
            imported_all_reduce(self.flat[i])  # imported by name: seen at ProcessGroup level
        elif self.blocking:
            torch.distributed.all_reduce(self.flat[i])
        else:
            self.works[i] = dist.all_reduce(self.flat[i], async_op=True)
            if self.wait_in_hook:
                self.works[i].wait()

    def hook(self, p):
        i, offset = self.slot[id(p)]
        self.flat[i][offset:offset + p.numel()].copy_(p.grad.view(-1))
        self.arrived[i] += 1
        if self.launch == "when full" and self.arrived[i] == len(self.buckets[i]):
            self.start(i)
        elif self.launch == "in order":
            while (self.next_bucket < len(self.buckets)
                   and self.arrived[self.next_bucket] == len(self.buckets[self.next_bucket])):
                self.start(self.next_bucket)
                self.next_bucket += 1

    def finish_gradient_synchronization(self):
        n = dist.get_world_size()
        if self.divide_at_most:
            n = min(n, self.divide_at_most)
        for i, bucket in enumerate(self.buckets):
            if self.launch == "in finish":
                self.start(i)
            if self.works[i] is not None:
                self.works[i].wait()
            if self.divide:
                self.flat[i] /= n
            offset = 0
            for p in bucket:
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.reset()


class BucketsWithoutBroadcast(LearnerBucketedDDP):
    broadcast = False


class BucketsSumWithoutDividing(LearnerBucketedDDP):
    divide = False


class AllReducesInFinish(LearnerBucketedDDP):
    launch = "in finish"


class BlockingAllReduceInHook(LearnerBucketedDDP):
    blocking = True


class BlockingImportedAllReduceInHook(LearnerBucketedDDP):
    blocking = "imported"


class WaitsInTheHook(LearnerBucketedDDP):
    wait_in_hook = True


class NeverWaits(LearnerBucketedDDP):
    def finish_gradient_synchronization(self):
        self.works = [None] * len(self.buckets)  # forgets the works instead of waiting
        super().finish_gradient_synchronization()


class BucketsInRegistrationOrder(LearnerBucketedDDP):
    reverse = False


class ClosesAboveTheCap(LearnerBucketedDDP):
    strictly_more = True


class LaunchesWhenFull(LearnerBucketedDDP):
    launch = "when full"


class HooksTheFrozenParameter(LearnerBucketedDDP):
    hook_every_parameter = True


class RankOneNeverLaunches(LearnerBucketedDDP):
    rank_one_never_launches = True


class BucketsDivideByAtMostThree(LearnerBucketedDDP):
    """Right on the documented 1 to 3 ranks only."""

    divide_at_most = 3


class NaiveInsteadOfBucketed(SimpleDDP):
    """The notebook's SimpleDDP, one blocking all-reduce per parameter after backward."""

    def __init__(self, module, bucket_cap_mb):
        super().__init__(module)


CAP_1 = "bucket cap 1 B (bucket_cap_mb = 1 / 2**20)"
CAP_400 = "bucket cap 400 B (bucket_cap_mb = 400 / 2**20)"


def test_the_bucketed_learner_class_passes_with_no_mistake_switched_on():
    assert check_bucketed_ddp(LearnerBucketedDDP, world_sizes=(2,)).passed


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (BucketsWithoutBroadcast, [f"with 2 rank(s), {CAP_1}, after __init__: rank 1 still has "
                                   "its own initial values of 'gain'"]),
        (BucketsSumWithoutDividing, [f"{CAP_1}, step 1: rank 0: gain.grad holds the SUM over "
                                     "ranks (2 x the mean)"]),
        (AllReducesInFinish, [f"{CAP_1}, step 1: rank 0: all 8 all-reduces were made in "
                              "finish_gradient_synchronization(), after loss.backward() "
                              "returned: no overlap", "register_post_accumulate_grad_hook"]),
        (NaiveInsteadOfBucketed, ["all 8 all-reduces were made in finish_gradient_"
                                  "synchronization()", "no overlap"]),
        (BlockingAllReduceInHook, [f"{CAP_1}, step 1: rank 0: the all-reduce of 4 elements was "
                                   "blocking (async_op=False)", "no overlap", "async_op=True"]),
        (BlockingImportedAllReduceInHook, ["the all-reduce of 4 elements was blocking "
                                           "(async_op=False)"]),
        (WaitsInTheHook, ["was waited for (work.wait()) while backward was still running",
                          "no overlap"]),
        (NeverWaits, [f"{CAP_1}, step 1: rank 0: the all-reduce of 4 elements was never "
                      "waited for", "before reading it"]),
        (BucketsInRegistrationOrder, [f"{CAP_1}, step 1: rank 0: expected 8 all-reduce(s) of "
                                      "4, 64, 16, 16, 256, 16, 128, 4 elements in this order",
                                      "got 8 of 4, 128, 16, 256, 16, 16, 64, 4",
                                      "walk them in REVERSE"]),
        (ClosesAboveTheCap, [f"{CAP_400}, step 1: rank 0: expected 4 all-reduce(s) of 100, 256, "
                             "144, 4 elements in this order", "got 3 of 356, 144, 4",
                             "or more (>=)"]),
        (LaunchesWhenFull, [f"{CAP_1}, step 1: rank 0: expected 8 all-reduce(s)",
                            "got 8 of 4, 4, 64, 16, 16, 256, 16, 128",
                            "launched out of bucket order", "'gain'", "same order"]),
        (HooksTheFrozenParameter, [f"with 2 rank(s), {CAP_1}: rank 0 raised RuntimeError",
                                   "Register hooks only on parameters with requires_grad=True"]),
    ],
)
def test_wrong_bucketed_ddp_fails_with_a_reason(answer, reasons, assert_fails):
    assert_fails(check_bucketed_ddp(answer, world_sizes=(2,)), "5.2", *reasons)


@pytest.mark.slow  # the contract's hang of 5.2
def test_a_rank_that_never_launches_fails_as_hung():
    result = check_bucketed_ddp(RankOneNeverLaunches, world_sizes=(2,), timeout=3)
    assert not result.passed
    assert "with 2 rank(s), rank(s) 0, 1 hung for 3 s. Rank 0 was waiting at" in result.message
    assert "in finish_gradient_synchronization" in result.message


# --- hidden cases, determinism, the largest world size -----------------------------------------


@pytest.mark.parametrize(
    ("check", "answer", "seed", "reasons"),
    [
        # seed 5 draws world size 6 for 5.1; seed 1 draws world size 4 for 5.2
        (check_simple_ddp, DividesByAtMostFour, 5,
         ["with 6 rank(s), step 1: rank 0: gain.grad holds the sum over ranks divided by 4, "
          "not by the world size 6", "[seed 5 drew world size 6 and widths 11 -> 15 -> 2; "
          "pass seed=5 to rerun]"]),
        (check_bucketed_ddp, BucketsDivideByAtMostThree, 1,
         ["with 4 rank(s), bucket cap 1 B", "divided by 3, not by the world size 4",
          "[seed 1 drew world size 4, widths 10 -> 11 -> 5 and bucket cap 224 B; pass seed=1 "
          "to rerun]"]),
    ],
)
def test_hidden_cases_catch_answers_fitted_to_the_documented_ones(check, answer, seed, reasons):
    hidden = check(answer, world_sizes=(2,), seed=seed)
    assert not hidden.passed
    for reason in reasons:
        assert reason in hidden.message, hidden.message


@pytest.mark.slow  # the premise of the test above: these answers pass the documented cases
@pytest.mark.parametrize(("check", "answer"), [(check_simple_ddp, DividesByAtMostFour),
                                               (check_bucketed_ddp, BucketsDivideByAtMostThree)])
def test_answers_fitted_to_the_documented_cases_pass_them(check, answer):
    assert check(answer).passed


@pytest.mark.slow  # the contract (the reference, seed 1); a rerun: test_checks_fsdp_practice's 7.2
def test_a_nonzero_seed_names_what_it_drew_and_reruns_the_same():
    first = check_bucketed_ddp(BucketedDDP, world_sizes=(2,), seed=3)
    assert first.passed, first.message
    assert first.message.endswith(
        "[seed 3 drew world size 4, widths 10 -> 19 -> 3 and bucket cap 708 B; pass seed=3 to "
        "rerun]")
    assert check_bucketed_ddp(BucketedDDP, world_sizes=(2,), seed=3) == first


@pytest.mark.parametrize(
    ("check", "answer"),
    [
        (check_simple_ddp, SumsWithoutDividing),
        # one rerun per check module in make test; the others in make test-slow
        pytest.param(check_simple_ddp, AllReducesFrozenGrads, marks=pytest.mark.slow),
        pytest.param(check_bucketed_ddp, LaunchesWhenFull, marks=pytest.mark.slow),
    ],
)
def test_verdicts_are_deterministic(check, answer):
    first, again = (check(answer, world_sizes=(2,)) for _ in range(2))
    assert str(first) == str(again)


@pytest.mark.parametrize("check", [check_simple_ddp, check_bucketed_ddp])
@pytest.mark.parametrize("world_sizes", [(9,), (2, 9)])
def test_more_ranks_than_the_batch_splits_into_are_refused_before_any_rank_starts(
        check, world_sizes, refuse_processes):
    why = re.escape("1..8 (the check's batch of 840 splits equally)")
    with refuse_processes(), pytest.raises(ValueError, match=why):
        check(SimpleDDP, world_sizes=world_sizes)


def test_watching_all_reduces_restores_what_it_patched():
    group, work = distributed_c10d.ProcessGroup, distributed_c10d.Work
    before = (group.allreduce, group.allreduce_coalesced, work.wait)
    with pytest.raises(KeyError), watched_all_reduces():
        assert (group.allreduce, group.allreduce_coalesced, work.wait) != before
        raise KeyError("the learner's code raised")
    assert (group.allreduce, group.allreduce_coalesced, work.wait) == before
