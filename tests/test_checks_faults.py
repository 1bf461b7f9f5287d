"""The checks of chapter 9's exercises, 9.1 (the first collective at which the ranks' logs
differ, a pure function called in one rank) and 9.2 (one step of a join for uneven data, on
real ranks), pass right answers and fail each typical wrong answer with its reason.

As in test_checks_fsdp_practice.py: first the references, then the reference solutions and
other right answers, then one configurable learner function per exercise whose keyword
switches (bound with functools.partial) turn on one mistake each. What every check does alike
(the reference passes with a seed, wrong arguments are refused before any rank starts, a hang,
the answer keys) is tested once, over the exercise registry, in test_check_contract.py; tests
of the same behaviour on more cases are marked slow.
"""

import dataclasses
import itertools
import threading
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs import launch
from labs.checks import check_find_desync, check_join_step
from labs.checks.faults_cases import (
    DESYNC_CASES,
    DOCUMENTED_BATCHES,
    JOIN_LR,
    Desync,
    DesyncPlan,
    Divisor,
    JoinPlan,
    expected_desync,
    join_model,
    join_reference,
    rank_batches,
)
from labs.ddp import DDP
from labs.experiments.faults import first_desync

from solutions import send_by_value, solution

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

find_desync = solution("09_when_it_goes_wrong.ipynb", "9.1", "find_desync", globals())
join_step = solution("09_when_it_goes_wrong.ipynb", "9.2", "join_step", globals())
send_by_value(__name__)


# --- the references ------------------------------------------------------------------------------


def test_the_desync_reference_is_labs_first_desync_on_every_case():
    cases = [*DESYNC_CASES, *(c for seed in range(1, 30) for c in DesyncPlan.make(seed).drawn)]
    for case in cases:
        assert expected_desync(case.logs) == first_desync(case.logs), case.describe()
        for log in case.logs:
            assert [e.seq for e in log] == list(range(1, len(log) + 1))


def sides_of(case_index: int) -> Desync:
    found = expected_desync(DESYNC_CASES[case_index].logs)
    assert found is not None
    return found


def test_the_documented_desync_cases_are_the_awkward_ones():
    assert sorted({len(c.logs) for c in DESYNC_CASES}) == [2, 3, 4, 5, 6, 7, 8]
    answers = [expected_desync(c.logs) for c in DESYNC_CASES]
    assert sum(a is None for a in answers) == 2  # logs that agree, empty logs
    found = [a for a in answers if a is not None]
    assert any(None in sides for _, sides in found)  # a log that ended (or one more at the end)
    assert any(len(sides) == 3 for _, sides in found)
    # the swap: the two entries differ in their call site only
    (k, swap) = sides_of(2)
    first, second = swap
    assert first is not None and second is not None
    assert dataclasses.replace(first, where="") == dataclasses.replace(second, where="")
    # the root: in its src only
    (_, root) = sides_of(6)
    assert {e.root for e in root if e is not None} == {0, 1}
    assert len({(e.op, e.shape, e.dtype, e.where) for e in root if e is not None}) == 1


def test_the_join_reference_divides_by_the_ranks_that_had_a_batch():
    batches = rank_batches(0, (3, 1))
    # with one rank left, its own step is the whole update: training alone after step 1
    ref = join_reference(batches)
    assert set(ref) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    alone = join_reference([batches[0][:1], batches[1]])
    model = join_model()
    model.load_state_dict(alone)
    for x, y in batches[0][1:]:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= JOIN_LR * p.grad
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name])
    # every rank alike: both divisors agree
    even = rank_batches(0, DOCUMENTED_BATCHES[4])
    for name, p in join_reference(even).items():
        torch.testing.assert_close(p, join_reference(even, Divisor.WORLD)[name])


def ddp_join_worker(rank: int, world_size: int, counts: tuple[int, ...]
                    ) -> dict[str, torch.Tensor]:
    """labs' own DDP.join, dividing by the ranks still training, on the check's batches."""
    model = DDP(join_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=JOIN_LR)
    with model.join(divide_by_initial_world_size=False):
        for x, y in rank_batches(0, counts)[rank]:
            F.mse_loss(model(x), y).backward()
            model.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {name: p.detach() for name, p in model.module.named_parameters()}


@pytest.mark.slow  # the reference solution passing the check holds the reference too
def test_the_join_reference_is_labs_ddp_join_on_the_check_batches():
    counts = DOCUMENTED_BATCHES[3]
    want = join_reference(rank_batches(0, counts))
    for got in launch(ddp_join_worker, 3, args=(counts,), timeout=60, echo=False):
        for name, p in got.items():
            torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6)


# --- right answers ------------------------------------------------------------------------------


@pytest.mark.slow  # nbval compares this verdict (chapter 9's check cell)
def test_right_find_desync_passes_with_the_documented_verdict(capsys):
    result = check_find_desync(find_desync)
    assert result.passed, result.message
    assert str(result) == (
        "PASS: Exercise 9.1 find_desync: on 12 sets of logs of 2 to 8 ranks (a skipped "
        "collective (the later entries shift), two all-reduces of one shape swapped (only the "
        "call sites differ), another shape, dtype, op and root, a log that ended early, one "
        "collective more at the end, three sides at once, logs that agree and empty logs), "
        "every answer was the first 1-based sequence number at which the logs differ, with "
        "each distinct entry there (None for a log that had ended) and the tuple of ranks "
        "holding it, ascending, or None where the logs agree.")
    assert capsys.readouterr().out == f"{result}\n"


@pytest.mark.slow  # nbval compares this verdict (chapter 9's check cell); the contract runs 9.2
def test_right_join_step_passes_with_the_documented_verdict(capsys):
    result = check_join_step(join_step)
    assert result.passed, result.message
    assert str(result) == (
        "PASS: Exercise 9.2 join_step: on 2 rank(s) holding 3, 1 batch(es); 3 rank(s) holding "
        "2, 0, 4 batch(es); 4 rank(s) holding 2, 2, 2, 2 batch(es), every rank called join_step "
        "max(batches) + 1 times, the last returning False, and ended with the parameters of one "
        "process applying at each step the mean gradient of the ranks that had a batch "
        "(F.mse_loss, plain SGD, lr 0.1; rtol 1e-5, atol 1e-6).")
    assert capsys.readouterr().out == f"{result}\n"


def desync_by_zip_longest(logs):
    """Another right answer: itertools' zip_longest pads with None."""
    for k, column in enumerate(itertools.zip_longest(*logs), 1):
        if len(set(column)) > 1:
            return k, {e: tuple(r for r, c in enumerate(column) if c == e) for e in set(column)}
    return None


def join_step_per_parameter(model, batch, lr):
    """Another right answer: one all-reduce per parameter, the count in float64."""
    count = torch.tensor([0.0 if batch is None else 1.0], dtype=torch.float64)
    dist.all_reduce(count)
    if count.item() == 0:
        return False
    if batch is not None:
        model.zero_grad()
        x, y = batch
        F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        g = torch.zeros_like(p) if batch is None else p.grad.clone()
        dist.all_reduce(g)
        with torch.no_grad():
            p -= lr * g / count.item()
    return True


@pytest.mark.slow  # more right answers; the references pass in make test and the contract
def test_other_right_answers_pass():
    assert check_find_desync(desync_by_zip_longest).passed
    assert check_join_step(join_step_per_parameter, world_sizes=(3,)).passed


# --- wrong answers to 9.1 -----------------------------------------------------------------------


def learner_desync(logs, *, start=1, fields=None, shortest=False, lump=False, by_rank=False,
                   as_list=False):
    """find_desync, column by column, with one switch per typical mistake."""
    longest = max((len(log) for log in logs), default=0)
    columns = (zip(*logs, strict=False) if shortest else
               ([log[i] if i < len(log) else None for log in logs] for i in range(longest)))
    for index, column in enumerate(columns):
        seen = [e if fields is None or e is None else tuple(getattr(e, f) for f in fields)
                for e in column]
        if len(set(seen)) == 1:
            continue
        k = index + start
        if by_rank:
            return k, dict(enumerate(column))
        if lump:
            other = next(e for e in column if e != column[0])
            return k, {column[0]: tuple(r for r, e in enumerate(column) if e == column[0]),
                       other: tuple(r for r, e in enumerate(column) if e != column[0])}
        sides = {}
        for rank, entry in enumerate(column):
            sides.setdefault(entry, []).append(rank)
        return k, {e: ranks if as_list else tuple(ranks) for e, ranks in sides.items()}
    return None


def test_the_learner_desync_passes_with_no_mistake_switched_on():
    assert check_find_desync(learner_desync).passed


SKIP = ("case 2 (4 ranks, rank 2 skipped collective 5): returned (4, {#5 all_reduce of "
        "float32[1] at train.py:44: (0, 1, 3), #5 all_reduce of float32[8, 8] at train.py:41: "
        "(2,)}), expected (5, {#5 all_reduce of float32[1] at train.py:44: (0, 1, 3), #5 "
        "all_reduce of float32[8, 8] at train.py:41: (2,)}): k is 1-based: a log's first entry "
        "is collective 1 (its seq is 1), so entry log[i] is collective i + 1.")
ENDED = ("case 8 (6 ranks, rank 4 died or hung after collective 5): returned None, expected "
         "(6, {#6 all_reduce of float32[8, 8] at train.py:41: (0, 1, 2, 3, 5), None: (4,)}): at "
         "collective 6 the log of rank(s) 4 had ended: a log that has ended counts as None "
         "there (zip stops at the shortest log: go on to the end of the longest).")
SWAP = ("case 3 (3 ranks, rank 1 issued collectives 6 and 7, two all-reduces of one shape, in "
        "the other order): returned None, expected (6, {#6 all_reduce of float32[8, 8] at "
        "train.py:41: (0, 2), #6 all_reduce of float32[8, 8] at train.py:42: (1,)}): the entries "
        "at collective 6 differ only in where (the call site): compare whole entries (==), not "
        "op, shape and dtype alone.")
THREE = "case 10 (8 ranks, rank 2 skipped collective 4, rank 5 skipped collective 4 and rank 7's "


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (partial(learner_desync, start=0), [SKIP]),
        (partial(learner_desync, shortest=True), [ENDED]),
        pytest.param(partial(learner_desync, fields=("op", "shape", "dtype")), [SWAP],
                     marks=pytest.mark.slow),
        pytest.param(partial(learner_desync, fields=("op", "shape", "dtype", "where")),
                     ["case 7 (4 ranks, rank 3's broadcast 2 comes from another src): returned "
                      "None, expected (2, {#2 broadcast of float32[8], root 0 at train.py:23: "
                      "(0, 1, 2), #2 broadcast of float32[8], root 1 at train.py:23: (3,)}): the "
                      "entries at collective 2 differ only in root: compare whole entries"],
                     marks=pytest.mark.slow),
        pytest.param(partial(learner_desync, lump=True),
                     [THREE, "collective 4 has another shape): returned (4, {#4 all_reduce of "
                      "float32[8, 8] at train.py:42: (0, 1, 3, 4, 6), #4 all_reduce of "
                      "float32[1] at train.py:44: (2, 5, 7)}), expected (4, {",
                      "every rank that differs from rank 0 is in one side, but ranks 2, 5, 7 "
                      "issued 2 different collectives: each distinct entry is a side of its "
                      "own."], marks=pytest.mark.slow),
        pytest.param(partial(learner_desync, by_rank=True),
                     ["case 2 (4 ranks, rank 2 skipped collective 5): returned (5, {0: #5 "
                      "all_reduce", "sides is keyed by rank: key each side by the entry the "
                      "ranks issued as collective 5 (log[5 - 1], a CollectiveCall), or None"],
                     marks=pytest.mark.slow),
        pytest.param(partial(learner_desync, as_list=True),
                     ["case 2 (4 ranks, rank 2 skipped collective 5): returned (5, {#5 "
                      "all_reduce of float32[1] at train.py:44: [0, 1, 3], ",
                      "the ranks of a side are a list: make them a tuple of ints, ascending "
                      "(tuple(ranks))."], marks=pytest.mark.slow),
    ],
)
def test_wrong_find_desync_fails_with_a_reason(answer, reasons, assert_fails):
    assert_fails(check_find_desync(answer), "9.1", *reasons)


def desync_without_a_return(logs):
    learner_desync(logs)


def desync_with_descending_ranks(logs):
    found = find_desync(logs)
    return found and (found[0], {e: tuple(sorted(r, reverse=True)) for e, r in found[1].items()})


def desync_raising_on_empty_logs(logs):
    return learner_desync(logs) if logs[0] else logs[0][0]


def desync_looping_on_empty_logs(logs):
    while not logs[0]:
        pass
    return learner_desync(logs)


@pytest.mark.slow  # more wrong answers of 9.1
@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (desync_without_a_return,
         ["case 2 (4 ranks, rank 2 skipped collective 5): returned None, expected (5, {",
          "the logs differ at collective 5."]),
        (desync_with_descending_ranks,
         ["case 2 (4 ranks, rank 2 skipped collective 5): returned (5, {#5 all_reduce of "
          "float32[1] at train.py:44: (3, 1, 0), #5 all_reduce of float32[8, 8] at train.py:41: "
          "(2,)})",
          "the ranks of each side must be in ascending order."]),
        (lambda logs: [1, 2, 3],
         ["case 1 (2 ranks, the logs agree): returned list [1, 2, 3]; return None when every "
          "log is the same, else a pair (k, sides)."]),
        (desync_raising_on_empty_logs,
         ["case 12 (3 ranks, every log empty): find_desync raised IndexError.\nTraceback",
          "in desync_raising_on_empty_logs"]),
    ],
)
def test_more_wrong_find_desync_fail_with_a_reason(answer, reasons, assert_fails):
    result = check_find_desync(answer)
    assert_fails(result, "9.1", *reasons)
    assert "labs/checks" not in result.message


@pytest.mark.slow  # the contract's hang of 9.1
def test_a_find_desync_that_never_returns_is_stopped_and_named(assert_fails):
    result = check_find_desync(desync_looping_on_empty_logs, timeout=1)
    assert_fails(result, "9.1", "case 12 (3 ranks, every log empty): find_desync did not return "
                 "within 1 s, and was stopped at File", "in desync_looping_on_empty_logs",
                 "A loop that never ends?")
    threads = [t for t in threading.enumerate() if t.name == "labs check 9.1"]
    for t in threads:
        t.join(2.0)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.slow  # the documented cases run above; the seed adds three drawn sets of logs
def test_hidden_logs_catch_answers_fitted_to_the_documented_ones(capsys, assert_fails):
    known = {tuple(tuple(log) for log in c.logs): expected_desync(c.logs) for c in DESYNC_CASES}

    def memorised(logs):
        return known.get(tuple(tuple(log) for log in logs))

    assert check_find_desync(memorised).passed
    capsys.readouterr()
    result = check_find_desync(memorised, seed=1)
    assert_fails(result, "9.1", "case 13 (3 ranks, rank 1 skipped collective 2): returned None")
    assert result.message.endswith(
        "[seed 1 drew logs of 3 ranks (rank 1 skipped collective 2), logs of 5 ranks (rank 3 "
        "died or hung after collective 3) and logs of 2 ranks (the logs agree); pass seed=1 to "
        "rerun]")
    assert str(check_find_desync(memorised, seed=1)) == str(result)  # the same every run


# --- wrong answers to 9.2 -----------------------------------------------------------------------


def learner_join(model, batch, lr, *, divide_by_world=False, leave=False, shadow_update=True,
                 never_false=False, forget_zero_grad=False):
    """join_step with one switch per typical mistake."""
    if leave and batch is None:
        return False  # "nothing to do": but the peers wait in their all-reduces
    params = list(model.parameters())
    still = torch.tensor([0.0 if batch is None else 1.0])
    dist.all_reduce(still)
    if still.item() == 0:
        return never_false  # False: every rank stops here
    if batch is None:
        flat = torch.zeros(sum(p.numel() for p in params))
    else:
        if not forget_zero_grad:
            model.zero_grad()
        x, y = batch
        F.mse_loss(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= dist.get_world_size() if divide_by_world else still
    if batch is not None or shadow_update:
        with torch.no_grad():
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p -= lr * g.view_as(p)
    return True


@pytest.mark.slow  # the reference passes in the contract; make test runs one wrong answer
def test_the_learner_join_passes_with_no_mistake_switched_on():
    assert check_join_step(learner_join).passed


AT_2 = "with 2 rank(s) holding 3, 1 batch(es)"


def test_dividing_by_the_world_size_fails_with_a_reason(assert_fails):
    assert_fails(check_join_step(partial(learner_join, divide_by_world=True)), "9.2",
                 f"{AT_2}: every rank divided the sum of the gradients by the world size: the "
                 "mean is over the ranks that had a batch that step (the sum divided by how many "
                 "still train).")


def join_step_nudging_a_weight(model, batch, lr):
    """Right, but adds 1 to one weight when it ends: the same on every rank."""
    going = learner_join(model, batch, lr)
    if not going:
        with torch.no_grad():
            model[0].weight[1, 2] += 1
    return going


def test_parameters_off_one_process_are_shown_with_the_values_expected(assert_fails,
                                                                      stated_values):
    result = check_join_step(join_step_nudging_a_weight, world_sizes=(2,))
    assert_fails(result, "9.2", f"{AT_2}: every rank ends with the same parameters, but not one "
                 "process's: 0.weight's element [1, 2] is ", "(one process's), off by 1, the "
                 "largest difference in the tensor. Each step")
    got, expected = stated_values(result.message)
    assert got == pytest.approx(expected + 1, abs=1e-4)


def join_step_unpacking_none(model, batch, lr):
    x, y = batch  # the mistake: None once this rank has run out
    return learner_join(model, (x, y), lr)


@pytest.mark.slow  # more wrong answers of 9.2
@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (partial(learner_join, shadow_update=False),
         [f"{AT_2}: rank(s) 0 end with one process's parameters, rank 1 (1 batch(es)) does not: "
          "0.weight's element [", "(one process's), off by ", "A rank without a batch must "
          "still apply every update its peers apply (the mean of their gradients), so that "
          "every rank's model stays the same."]),
        (partial(learner_join, never_false=True),
         [f"{AT_2}, rank 0: join_step returned a true value in each of 6 calls, never False. "
          "Return False once no rank has a batch left"]),
        (partial(learner_join, forget_zero_grad=True),
         [f"{AT_2}: every rank ends with the same parameters, but not one process's: "
          "0.weight's element [", "(zero the gradients before backward)."]),
        (lambda model, batch, lr: None,
         [f"{AT_2}, rank 0: its loop ended at call 1 (join_step returned None), but rank 0 "
          "had 3 batch(es), so every rank must make 4 calls"]),
        (lambda model, batch, lr: model(batch[0]),
         [f"{AT_2}, rank 0: its loop ended at call 1 (join_step returned a Tensor, neither True "
          "nor False)"]),
        (join_step_unpacking_none,
         [f"{AT_2}, rank 1 raised TypeError. batch is None on a rank that has run out of data: "
          "test for None before unpacking x, y.", "in join_step_unpacking_none"]),
    ],
)
def test_more_wrong_join_steps_fail_with_a_reason(answer, reasons, assert_fails):
    assert_fails(check_join_step(answer, world_sizes=(2,)), "9.2", *reasons)


@pytest.mark.slow  # the contract's hang of 9.2
def test_a_rank_that_leaves_without_its_collectives_fails_as_hung(assert_fails):
    result = check_join_step(partial(learner_join, leave=True), world_sizes=(3,), timeout=3)
    assert_fails(result, "9.2", "with 3 rank(s) holding 2, 0, 4 batch(es), rank(s) 0, 2 hung for "
                 "3 s. Rank 0 was waiting at File", "in learner_join",
                 "A rank without a batch must still issue every collective its peers issue, with "
                 "zeros in place of its gradient (a shadow step)")


@pytest.mark.slow  # the contract runs the reference with seed 1
def test_a_seed_draws_another_world_size_and_its_batches():
    plan = JoinPlan.make((2, 3, 4), 3)
    assert plan.world_sizes[:3] == (2, 3, 4) and plan.drawn_world_size in (5, 6)
    assert plan.batches[-1] == plan.drawn and len(plan.drawn) == plan.drawn_world_size
    assert max(plan.drawn) >= 1
    assert plan.note() == (f" [seed 3 drew world size {plan.drawn_world_size} and batches "
                           f"{', '.join(map(str, plan.drawn))}; pass seed=3 to rerun]")
    every = JoinPlan.make((5, 6), 3)  # no candidate left: the last world size's are drawn
    assert every.world_sizes == (5, 6) and every.batches[-1] == every.drawn
    assert len(every.drawn) == 6
