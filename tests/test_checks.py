"""The checks of exercises 1.1 (averaging gradients) and 2.1-4.2 (the collectives from
point-to-point messages) fail each typical wrong answer with its reason.

What every check does alike (the reference passes, wrong arguments are refused before any rank
starts, a hang, the seed's note, the answer keys) is tested once, over the exercise registry,
in test_check_contract.py; tests of the same behaviour on more cases are marked slow (``make
test-slow``).
"""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as imported_all_reduce

from labs.checks import (
    check_average_gradients,
    check_composed_all_reduce,
    check_ring_all_gather,
    check_ring_all_reduce,
    check_ring_reduce_scatter,
)
from labs.checks.collectives_cases import Plan
from labs.checks.core import failing_rank
from labs.checks.toy import AveragePlan
from labs.collectives import shard_bounds
from labs.launcher import RankError, RankFailure

from solutions import send_by_value, solution

# The notebooks' solutions, under the names of labs' own collectives: those are the exercises'
# answer keys, refused inside the checks (labs.checks.answer_keys). The references and several
# wrong answers below are built from these.
ring_all_reduce = solution("02_allreduce_algorithms.ipynb", "2.1", "my_ring_all_reduce", globals())
ring_reduce_scatter = solution("03_reduce_scatter.ipynb", "3.1", "ring_reduce_scatter", globals())
ring_all_gather = solution("04_all_gather.ipynb", "4.1", "ring_all_gather", globals())
send_by_value(__name__)


def correct(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def sum_without_dividing(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def does_nothing(model):
    pass


def crashes_on_frozen_parameter(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def only_rank_zero_divides(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            if dist.get_rank() == 0:
                p.grad /= dist.get_world_size()


def assigns_the_result(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad = dist.all_reduce(p.grad)  # all_reduce works in place and returns None


def divides_by_one_more(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size() + 1


def gives_frozen_a_gradient(model):
    correct(model)
    model.frozen.grad = model.frozen.detach().clone()


def rank_zero_skips_the_collective(model):
    if dist.get_rank() == 0:
        return
    correct(model)


def divides_by_at_most_four(model):
    """Right on the documented 1 to 4 ranks only."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= min(dist.get_world_size(), 4)


DOCUMENTED_SHAPES = {(4, 3), (4,), (2, 4), (2,)}  # Linear(3, 4), Linear(4, 2)


def averages_the_documented_shapes_only(model):
    for p in model.parameters():
        if p.grad is not None and tuple(p.shape) in DOCUMENTED_SHAPES:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def averages_from_the_checks_secrets(model):
    """No all-reduce: it draws every rank's starting gradients as the check does, from the
    check's own frame (the seed, or the keys it holds now), and sets their mean."""
    import sys

    from labs.checks.toy import _check_gradients
    frame = sys._getframe(1)
    while "widths" not in frame.f_locals:
        frame = frame.f_back
    found = frame.f_locals
    secret, widths = found.get("keys", found.get("seed")), found["widths"]
    n = dist.get_world_size()
    starts = [_check_gradients(r, secret, widths) for r in range(n)]
    for name, p in model.named_parameters():
        if p.grad is not None:
            p.grad.copy_(sum(s[name] for s in starts) / n)


@pytest.mark.slow  # nbval compares this verdict (chapter 1's check cell); the contract runs 1.1
def test_reference_solution_passes(capsys):
    result = check_average_gradients(correct)
    assert result.passed
    # seed 0 prints the documented verdict, the one stored in chapter 1's notebook
    assert str(result) == ("PASS: Exercise 1.1 average_gradients: every rank holds the mean "
                           "gradient on 1, 2, 3, 4 rank(s).")
    assert capsys.readouterr().out.startswith("PASS: Exercise 1.1")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (sum_without_dividing, "SUM over ranks"),
        (does_nothing, "unchanged"),
        (crashes_on_frozen_parameter, "requires_grad=False"),
        (only_rank_zero_divides, "with 2 rank(s), rank 1: first.weight.grad holds the SUM over "
                                 "ranks, 2x the mean"),
        (assigns_the_result, "rank 0: first.weight.grad is None; average it in place, do not "
                             "drop it."),
        (divides_by_one_more, "rank 0: first.weight.grad is not the mean over ranks: element ["),
        (gives_frozen_a_gradient, "frozen parameter got a gradient"),
        (averages_from_the_checks_secrets, "rank 1's inputs are not this rank's to draw"),
    ],
)
def test_wrong_answers_fail_with_a_reason(answer, reason, assert_fails):
    assert_fails(check_average_gradients(answer), "1.1", reason)


def test_a_wrong_mean_is_shown_with_the_values_got_and_expected(assert_fails, stated_values):
    result = check_average_gradients(divides_by_one_more, world_sizes=(2,))
    assert_fails(result, "1.1", "with 2 rank(s), rank 0: first.weight.grad is not the mean over "
                 "ranks: element [", "(the mean of the gradients the ranks started with), off "
                 "by ", "the largest difference in the tensor.")
    got, expected = stated_values(result.message)
    assert got == pytest.approx(expected * 2 / 3, rel=1e-4)  # the sum over 2 ranks, divided by 3


@pytest.mark.slow  # the contract's hang of 1.1
def test_a_hanging_answer_fails_after_the_timeout():
    result = check_average_gradients(rank_zero_skips_the_collective, timeout=3)
    assert not result.passed
    assert "hung for 3 s" in result.message


def test_the_diagnosis_reads_the_drawn_cases_of_a_seed():
    wrong = check_average_gradients(sum_without_dividing, world_sizes=(2,), seed=1)
    assert not wrong.passed
    assert "SUM over ranks" in wrong.message  # the diagnosis still works on the drawn shapes
    assert "seed 1 drew world size 5 and layers Linear(" in wrong.message
    assert "pass seed=1 to rerun" in wrong.message


def test_another_seed_draws_other_cases():
    one, five = AveragePlan.make((2,), 1), AveragePlan.make((2,), 5)
    assert (one.drawn_world_size, five.drawn_world_size) == (5, 6)
    assert one.note() != five.note() and one == AveragePlan.make((2,), 1)


@pytest.mark.slow  # the contract (the reference, seed 1) and the two tests above, on ranks
def test_average_gradients_seed_draws_hidden_cases_and_names_them(capsys):
    right = check_average_gradients(correct, world_sizes=(2,), seed=1)
    assert right.passed, right.message
    assert "seed 1 drew world size 5 and layers Linear(" in right.message
    assert right.message.endswith("pass seed=1 to rerun]")
    wrong = check_average_gradients(sum_without_dividing, world_sizes=(2,), seed=1)
    assert not wrong.passed
    assert "SUM over ranks" in wrong.message  # the diagnosis still works on the drawn shapes
    assert "seed 1 drew" in wrong.message
    assert "pass seed=1 to rerun" in wrong.message
    other = check_average_gradients(correct, world_sizes=(2,), seed=5)
    assert other.passed, other.message
    assert "seed 5 drew world size 6" in other.message
    assert other.message.split(" drew ")[1] != right.message.split(" drew ")[1]
    assert check_average_gradients(correct, world_sizes=(2,), seed=1) == right  # reruns


@pytest.mark.parametrize(
    ("answer", "seed", "reason"),
    [
        (divides_by_at_most_four, 5, "with 6 rank(s)"),  # seed 5 draws world size 6
        (averages_the_documented_shapes_only, 1, "unchanged"),  # and other layer widths
    ],
)
def test_hidden_cases_catch_answers_fitted_to_the_documented_ones(answer, seed, reason):
    hidden = check_average_gradients(answer, world_sizes=(1, 2), seed=seed)
    assert not hidden.passed
    assert reason in hidden.message
    assert f"pass seed={seed} to rerun" in hidden.message


@pytest.mark.slow  # the premise of the test above: these answers pass the documented cases
@pytest.mark.parametrize("answer", [divides_by_at_most_four, averages_the_documented_shapes_only])
def test_answers_fitted_to_the_documented_cases_pass_them(answer):
    assert check_average_gradients(answer).passed


def test_average_gradients_verdict_on_a_crash_is_the_same_every_run(capsys):
    """Every rank crashes on the frozen parameter: the verdict names rank 0, whichever rank
    failed first, and the traceback shows the learner's frames, not the check's."""
    first, again = (check_average_gradients(crashes_on_frozen_parameter, world_sizes=(3,))
                    for _ in range(2))
    assert str(first) == str(again)
    assert "with 3 rank(s), rank 0 raised" in first.message
    assert "crashes_on_frozen_parameter" in first.message
    assert "_run_average_gradients" not in first.message


# --- Exercises 2.1-4.2: the collectives, built from point-to-point messages -------------------
#
# The wrong answers are what a learner writes: one ring, written plainly, with one mistake
# switched on at a time. Wrong answers run on the fewest world sizes that expose them.

def step(send, to, recv, source, blocking=False):
    """One ring step: send right while receiving from the left."""
    if blocking:  # every rank waits in recv first: nobody ever sends
        if recv.numel():
            dist.recv(recv, source)
        if send.numel():
            dist.send(send, to)
        return
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, to))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, source))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def learner_bounds(numel, n, remainder_last=False):
    if remainder_last:  # equal chunks of numel // n, the last one takes what is left
        size = numel // n
        return [i * size for i in range(n)] + [numel]
    return shard_bounds(numel, n)


def learner_all_reduce(tensor, *, skip_steps=0, gather=True, tail_ignored=False,
                       blocking=False):
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    if tail_ignored:  # numel // n per chunk: the last numel % n elements are never reduced
        size = flat.numel() // n
        chunks = [flat[i * size:(i + 1) * size] for i in range(n)]
    else:
        chunks = list(torch.tensor_split(flat, n))
    right, left = (r + 1) % n, (r - 1) % n
    for k in range(n - 1 - skip_steps):
        incoming = torch.empty_like(chunks[(r - k - 2) % n])
        step(chunks[(r - k - 1) % n], right, incoming, left, blocking)
        chunks[(r - k - 2) % n] += incoming
    if gather:
        for k in range(n - 1):
            step(chunks[(r - k) % n].clone(), right, chunks[(r - k - 1) % n], left, blocking)


def learner_reduce_scatter(tensor, *, shift=0, in_place=False, remainder_last=False,
                           blocking=False, rows=False):
    n, r = dist.get_world_size(), dist.get_rank()
    if rows:  # forgets to flatten: a 2-D tensor is cut into blocks of rows
        chunks = [c.clone() for c in torch.tensor_split(tensor, n)]
    else:
        flat = tensor.view(-1) if in_place else tensor.reshape(-1).clone()
        bounds = learner_bounds(flat.numel(), n, remainder_last)
        chunks = [flat[bounds[i]:bounds[i + 1]] for i in range(n)]
    right, left = (r + 1) % n, (r - 1) % n
    for k in range(n - 1):
        incoming = torch.empty_like(chunks[(r - k - 2 + shift) % n])
        step(chunks[(r - k - 1 + shift) % n], right, incoming, left, blocking)
        chunks[(r - k - 2 + shift) % n] += incoming
    return chunks[(r + shift) % n].clone()


def learner_all_gather(shard, numel, *, skip_steps=0, equal_shards=False, blocking=False):
    n, r = dist.get_world_size(), dist.get_rank()
    if equal_shards:  # assumes every shard is as long as this rank's
        numel = shard.numel() * n
        bounds = [i * shard.numel() for i in range(n + 1)]
    else:
        bounds = shard_bounds(numel, n)
    out = torch.zeros(numel)
    chunks = [out[bounds[i]:bounds[i + 1]] for i in range(n)]
    chunks[r].copy_(shard)
    right, left = (r + 1) % n, (r - 1) % n
    for k in range(n - 1 - skip_steps):
        step(chunks[(r - k) % n], right, chunks[(r - k - 1) % n], left, blocking)
    return out


# Reference solutions, wrapped to the learner's signatures.

def reference_all_reduce(tensor):
    ring_all_reduce(tensor)


def reference_reduce_scatter(tensor):
    return ring_reduce_scatter(tensor)


def reference_all_gather(shard, numel):
    return ring_all_gather(shard, numel=numel)


def reference_composed(tensor):
    shard = ring_reduce_scatter(tensor)
    tensor.copy_(ring_all_gather(shard, numel=tensor.numel()).view_as(tensor))


# Wrong answers shared by several exercises.

def uses_builtin_all_reduce(tensor):
    dist.all_reduce(tensor)


def uses_imported_all_reduce(tensor):
    imported_all_reduce(tensor)  # imported before the check started: caught one level down


def bypasses_point_to_point(tensor):
    dist.group.WORLD._get_backend(tensor.device).allreduce([tensor]).wait()


def backend_behind_a_dummy_ring(tensor):
    """The process group's backend sums; a ring of zeros sends the bytes a ring would."""
    learner_all_reduce(torch.zeros_like(tensor))
    dist.group.WORLD._get_backend(tensor.device).allreduce([tensor]).wait()


def functional_behind_a_dummy_ring(tensor):
    """A functional collective sums; a ring of zeros sends the bytes a ring would."""
    from torch.distributed import _functional_collectives as functional
    learner_all_reduce(torch.zeros_like(tensor))
    tensor.copy_(functional.all_reduce(tensor, "sum", dist.group.WORLD))


def assembled_from_the_ring_engine(tensor):
    """labs' own ring, from its parts: the step builders and the engine that runs them."""
    from labs.collectives import _all_gather_steps, _reduce_scatter_steps, _torch_peers
    from labs.ring_schedule import run_lockstep
    peers = _torch_peers(None, None)
    flat = tensor.view(-1)
    bounds = shard_bounds(flat.numel(), peers.size)
    steps, done = _reduce_scatter_steps(flat, bounds, peers.rank, out_of_place=False)
    run_lockstep(peers, steps + _all_gather_steps(flat, bounds, peers.rank, done))


def _from_the_checks_frames(*names):
    """The first frame up the stack (the check's own, in the rank) holding all of ``names``."""
    import sys
    frame = sys._getframe(2)
    while frame is not None and not all(n in frame.f_locals for n in names):
        frame = frame.f_back
    return None if frame is None else [frame.f_locals[n] for n in names]


def sums_from_the_checks_secrets(tensor):
    """No message at all: it draws every rank's input as the check does, from the check's own
    frames (the seed, or the keys it holds), sums them and sets the traffic counter a ring
    would have."""
    from labs.checks.collectives_cases import rank_input
    n = dist.get_world_size()
    found = _from_the_checks_frames("index", "case", "traffic")
    index, case, traffic = found
    secret = _from_the_checks_frames("keys") or _from_the_checks_frames("seed")
    try:  # the seed, as the check held it before
        inputs = [rank_input(secret[0], n, index, r, case) for r in range(n)]
    except TypeError:  # the keys it holds now
        inputs = [rank_input(secret[0], index, r, case) for r in range(n)]
    tensor.copy_(sum(inputs))
    traffic.sent = 2 * (n - 1) / n * tensor.numel() * tensor.element_size()


def whole_tensor_ring(tensor):
    """Whole tensors round the ring, N-1 times: (N-1)·S per rank."""
    n, r = dist.get_world_size(), dist.get_rank()
    flat = tensor.view(-1)
    passing, arriving = flat.clone(), torch.empty_like(flat)
    for _ in range(n - 1):
        step(passing, (r + 1) % n, arriving, (r - 1) % n)
        flat.add_(arriving)
        passing, arriving = arriving, passing


def whole_tensor_ring_hiding_its_bytes(tensor):
    """Whole tensors round the ring, (N-1)·S per rank, then the rank's own counter (a Python
    object in the check's frame) set to what a ring would have sent."""
    whole_tensor_ring(tensor)
    (traffic,) = _from_the_checks_frames("traffic")
    n = dist.get_world_size()
    traffic.sent = 2 * (n - 1) / n * tensor.numel() * tensor.element_size()


def returns_a_new_tensor(tensor):
    out = tensor.clone()
    ring_all_reduce(out)
    return out


def views_as_rows(tensor):
    rows = tensor.view(dist.get_world_size(), -1)  # fails unless N divides numel
    ring_all_reduce(rows)


def raises_on_rank_one(tensor):
    if dist.get_rank() == 1:
        raise KeyError("my_bug")
    ring_all_reduce(tensor)


def takes_two_arguments(rank, tensor):
    ring_all_reduce(tensor)


#: The references run in the contract (with a seed) and in nbval (the documented verdict); the
#: learner's rings run on every documented world size in make test-slow, on two in make test.
SLOW = pytest.mark.slow
DOCUMENTED = None  # the check's own world sizes, 1 to 5


@pytest.mark.parametrize(
    ("check", "answer", "world_sizes"),
    [
        pytest.param(check_ring_all_reduce, reference_all_reduce, DOCUMENTED, marks=SLOW),
        (check_ring_all_reduce, learner_all_reduce, (2, 3)),
        pytest.param(check_ring_all_reduce, learner_all_reduce, DOCUMENTED, marks=SLOW),
        pytest.param(check_ring_reduce_scatter, reference_reduce_scatter, DOCUMENTED, marks=SLOW),
        (check_ring_reduce_scatter, learner_reduce_scatter, (2, 3)),
        pytest.param(check_ring_reduce_scatter, learner_reduce_scatter, DOCUMENTED, marks=SLOW),
        pytest.param(check_ring_all_gather, reference_all_gather, DOCUMENTED, marks=SLOW),
        (check_ring_all_gather, learner_all_gather, (2, 3)),
        pytest.param(check_ring_all_gather, learner_all_gather, DOCUMENTED, marks=SLOW),
        pytest.param(check_composed_all_reduce, reference_composed, DOCUMENTED, marks=SLOW),
    ],
)
def test_right_answers_pass(check, answer, world_sizes, capsys):
    result = check(answer) if world_sizes is DOCUMENTED else check(answer, world_sizes)
    assert result.passed, result.message
    assert "chunks of ceil(numel/N) elements" in result.message, result.message
    assert capsys.readouterr().out.startswith("PASS: Exercise ")


@pytest.mark.parametrize(
    ("answer", "world_sizes", "reasons"),
    [
        (uses_builtin_all_reduce, (2,),
         ["use only point-to-point", "dist.all_reduce is the collective you are building"]),
        (uses_imported_all_reduce, (2,), ["use only point-to-point", "ProcessGroup.allreduce"]),
        (bypasses_point_to_point, (2,), ["SideDoorError", "Backend.allreduce is refused"]),
        (backend_behind_a_dummy_ring, (3,), ["SideDoorError", "Backend.allreduce is refused"]),
        (sums_from_the_checks_secrets, (3,), ["rank 0 raised KeyError",
                                              "rank 1's inputs are not this rank's to draw"]),
        (whole_tensor_ring_hiding_its_bytes, (3,),
         ["with 3 rank(s), over every case (numel 65536 the largest)",
          "as the kernel counts them", "send nothing but the ring's messages"]),
        (assembled_from_the_ring_engine, (3,),
         ["`labs.collectives._reduce_scatter_steps` is its answer key"]),
        (functional_behind_a_dummy_ring, (3,),
         ["SideDoorError", "torch.ops._c10d_functional.all_reduce is refused"]),
        (whole_tensor_ring, (2, 3), ["with 3 rank(s), numel 301", "rank 0 sent 2408 bytes",
                                     "2(N-1)/N·S = 1605.3", "(N-1)·S"]),
        (functools.partial(learner_all_reduce, gather=False), (3,),
         ["with 3 rank(s), numel 300", "all-gather phase is missing"]),
        (functools.partial(learner_all_reduce, skip_steps=1), (2, 3),
         ["with 2 rank(s), numel 300", "missing rank(s)", "N-1 reduce-scatter steps"]),
        (functools.partial(learner_all_reduce, tail_ignored=True), (1, 2, 3),
         ["with 2 rank(s), numel 301", "element 300", "wrong for numel 1, 7, 301",
          "torch.tensor_split / shard_bounds"]),
        (returns_a_new_tensor, (2,), ["tensor is unchanged", "returned the sum as a new tensor",
                                      "tensor.copy_"]),
        (views_as_rows, (2,), ["with 2 rank(s), numel 1", "raised RuntimeError",
                               "2 does not divide 1", "views_as_rows"]),
        (raises_on_rank_one, (1, 3), ["with 3 rank(s), numel 3: rank 1 raised KeyError",
                                      "my_bug", "raises_on_rank_one"]),
        (takes_two_arguments, (2,), ["must accept 1 argument", "(rank, tensor)"]),
    ],
)
def test_wrong_ring_all_reduce_fails(answer, world_sizes, reasons, assert_fails):
    assert_fails(check_ring_all_reduce(answer, world_sizes), "2.1", *reasons)


def uses_builtin_reduce_scatter(tensor):
    n = dist.get_world_size()
    flat = tensor.reshape(-1)
    out = torch.empty(flat.numel() // n)
    dist.reduce_scatter_tensor(out, flat)
    return out


def all_reduce_then_slice(tensor):
    flat = tensor.reshape(-1).clone()
    ring_all_reduce(flat)
    bounds = shard_bounds(flat.numel(), dist.get_world_size())
    return flat[bounds[dist.get_rank()]:bounds[dist.get_rank() + 1]]


def returns_the_whole_sum(tensor):
    flat = tensor.reshape(-1).clone()
    ring_all_reduce(flat)
    return flat


@pytest.mark.parametrize(
    ("answer", "world_sizes", "reasons"),
    [
        (uses_builtin_reduce_scatter, (2,),
         ["dist.reduce_scatter_tensor is the collective you are building"]),
        (all_reduce_then_slice, (2,), ["with 2 rank(s), numel 301", "the values are right",
                                       "(N-1)/N·S = 602.0", "all-reduce followed by slicing"]),
        (returns_the_whole_sum, (2,), ["returned the whole sum", "only chunk 0"]),
        (functools.partial(learner_reduce_scatter, shift=1), (3,),
         ["with 3 rank(s), numel 300: rank 0: returned chunk 1 of the sum, expected chunk 0",
          "off by 1"]),
        (functools.partial(learner_reduce_scatter, in_place=True), (2,),
         ["input tensor was changed", "separate buffer"]),
        (functools.partial(learner_reduce_scatter, remainder_last=True), (1, 2),
         ["with 2 rank(s), numel 301: rank 0: returned 150 element(s), but chunk 0",
          "has 151", "wrong for numel 1, 7, 301", "torch.tensor_split / shard_bounds"]),
        (functools.partial(learner_reduce_scatter, rows=True), (3,),
         ["with 3 rank(s), a 2-D tensor of shape (3, 6) (numel 18): rank 0: returned a tensor "
          "of shape (1, 6)", "Only the 2-D input fails", "tensor.view(-1)"]),
    ],
)
def test_wrong_ring_reduce_scatter_fails(answer, world_sizes, reasons, assert_fails):
    assert_fails(check_ring_reduce_scatter(answer, world_sizes), "3.1", *reasons)


def uses_builtin_all_gather(shard, numel):
    out = torch.empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(out, shard)
    return out


def gathers_at_rank_zero(shard, numel):
    n, r = dist.get_world_size(), dist.get_rank()
    bounds = shard_bounds(numel, n)
    out = torch.empty(numel)
    if r == 0:
        out[bounds[0]:bounds[1]] = shard
        for source in range(1, n):
            if bounds[source + 1] > bounds[source]:
                dist.recv(out[bounds[source]:bounds[source + 1]], source)
        for dest in range(1, n):
            dist.send(out, dest)
    else:
        if shard.numel():
            dist.send(shard, 0)
        dist.recv(out, 0)
    return out


def keeps_the_padding(shard, numel):
    """Pads every shard to ceil(numel / N) and gathers equal chunks by ring, but returns the
    padded N * ceil(numel / N) elements: rank 0's shard x N."""
    n, r = dist.get_world_size(), dist.get_rank()
    longest = -(-numel // n)
    out = torch.zeros(n * longest)
    chunks = [out[i * longest:(i + 1) * longest] for i in range(n)]
    chunks[r][:shard.numel()].copy_(shard)
    for k in range(n - 1):
        step(chunks[(r - k) % n], (r + 1) % n, chunks[(r - k - 1) % n], (r - 1) % n)
    return out


def concatenates_in_arrival_order(shard, numel):
    n, r = dist.get_world_size(), dist.get_rank()
    bounds = shard_bounds(numel, n)
    pieces, current = [shard], shard
    for k in range(n - 1):
        source_chunk = (r - k - 1) % n
        incoming = torch.empty(bounds[source_chunk + 1] - bounds[source_chunk])
        step(current, (r + 1) % n, incoming, (r - 1) % n)
        pieces.append(incoming)
        current = incoming
    return torch.cat(pieces)


def zeroes_its_shard(shard, numel):
    out = ring_all_gather(shard, numel=numel)
    shard.zero_()
    return out


@pytest.mark.parametrize(
    ("answer", "world_sizes", "reasons"),
    [
        (uses_builtin_all_gather, (2,),
         ["dist.all_gather_into_tensor is the collective you are building"]),
        (gathers_at_rank_zero, (2,), ["with 2 rank(s), numel 301", "rank 0 sent 1204 bytes",
                                      "(N-1)/N·S = 602.0", "gathering at one rank"]),
        (functools.partial(learner_all_gather, skip_steps=1), (2,),
         ["with 2 rank(s), numel 300: rank 0: only its own shard (chunk 0) is in place"]),
        (functools.partial(learner_all_gather, skip_steps=1), (4,),
         ["with 4 rank(s), numel 300", "never arrived"]),
        (concatenates_in_arrival_order, (2,),
         ["rank 1: elements 0..149 hold rank 1's shard, expected rank 0's"]),
        (functools.partial(learner_all_gather, equal_shards=True), (2,),  # 151 sent, 150 posted
         ["with 2 rank(s), rank", "died", "gloo ends a process when a message does not fit the "
          "buffer posted to receive it", "shard_bounds"]),
        (keeps_the_padding, (2,),
         ["with 2 rank(s), numel 301: rank 0: returned 302 element(s), expected numel = 301; "
          "that is shard.numel() x N, but shards differ in length when numel does not divide "
          "by N, so use the numel argument"]),
        (zeroes_its_shard, (2,), ["its shard was changed (element 0 is now 0, was "]),
    ],
)
def test_wrong_ring_all_gather_fails(answer, world_sizes, reasons, assert_fails):
    assert_fails(check_ring_all_gather(answer, world_sizes), "4.1", *reasons)


def reduce_scatter_only(tensor):
    flat = tensor.view(-1)
    bounds = shard_bounds(flat.numel(), dist.get_world_size())
    flat[bounds[dist.get_rank()]:bounds[dist.get_rank() + 1]] = ring_reduce_scatter(tensor)


def rebinds_the_name(tensor):
    shard = ring_reduce_scatter(tensor)
    tensor = ring_all_gather(shard, numel=tensor.numel()).view_as(tensor)  # noqa: F841


def composes_builtin_reduce_scatter(tensor):
    uses_builtin_reduce_scatter(tensor)


@pytest.mark.parametrize(
    ("answer", "world_sizes", "reasons"),
    [
        (reduce_scatter_only, (3,), ["all-gather half is missing"]),
        (rebinds_the_name, (2,), ["tensor is unchanged", "rebinds"]),
        (whole_tensor_ring, (3,), ["rank 0 sent 2408 bytes"]),
        (composes_builtin_reduce_scatter, (2,), ["dist.reduce_scatter_tensor is a collective too"]),
    ],
)
def test_wrong_composed_all_reduce_fails(answer, world_sizes, reasons, assert_fails):
    assert_fails(check_composed_all_reduce(answer, world_sizes), "4.2", *reasons)


@pytest.mark.slow  # the contract's hang of 2.1, 3.1, 4.1 and 4.2
@pytest.mark.parametrize(
    ("check", "answer"),
    [
        (check_ring_all_reduce, functools.partial(learner_all_reduce, blocking=True)),
        (check_ring_reduce_scatter, functools.partial(learner_reduce_scatter, blocking=True)),
        (check_ring_all_gather, functools.partial(learner_all_gather, blocking=True)),
    ],
)
def test_a_deadlocked_ring_fails_as_hung(check, answer):
    result = check(answer, world_sizes=(1, 2), timeout=3)
    assert not result.passed
    assert "with 2 rank(s)" in result.message
    assert "rank(s) 0, 1 hung" in result.message
    assert "post the receive" in result.message
    assert "batch_isend_irecv" in result.message


@pytest.mark.parametrize(
    ("check", "answer", "world_sizes"),
    [
        (check_ring_all_reduce, raises_on_rank_one, (3,)),
        # one rerun per check module in make test; the others in make test-slow
        pytest.param(check_ring_reduce_scatter, functools.partial(learner_reduce_scatter,
                                                                  shift=1), (3,),
                     marks=pytest.mark.slow),
        pytest.param(check_ring_all_gather, reference_all_gather, (1, 3), marks=pytest.mark.slow),
    ],
)
def test_verdicts_are_deterministic(check, answer, world_sizes):
    first, again = (check(answer, world_sizes=world_sizes) for _ in range(2))
    assert str(first) == str(again)


def right_for_the_documented_numels_only(tensor):
    if tensor.numel() <= 20 or tensor.numel() in (300, 301, 65536):
        ring_all_reduce(tensor)


def test_a_nonzero_seed_draws_hidden_cases_and_names_them(capsys):
    shown = check_ring_all_reduce(right_for_the_documented_numels_only, world_sizes=(2,))
    assert shown.passed, shown.message
    hidden = check_ring_all_reduce(right_for_the_documented_numels_only, world_sizes=(2,),
                                   seed=1)
    assert not hidden.passed
    assert "seed 1 drew world size" in hidden.message
    assert "pass seed=1 to rerun" in hidden.message
    assert Plan.make((2,), 2).note() != Plan.make((2,), 1).note()  # another seed, other cases


@pytest.mark.slow  # the contract (the reference, seed 1) and the plans above
def test_another_seed_passes_the_reference_and_names_other_cases():
    hidden = check_ring_all_reduce(right_for_the_documented_numels_only, world_sizes=(2,),
                                   seed=1)
    other = check_ring_all_reduce(reference_all_reduce, world_sizes=(2,), seed=2)
    assert other.passed
    assert "seed 2 drew" in other.message
    assert other.message.split("[seed")[1] != hidden.message.split("[seed")[1]


def test_a_verdict_names_the_lowest_rank_that_failed_not_one_that_lost_its_peer():
    def failure(rank: int, message: str) -> RankFailure:
        return RankFailure(rank, "RuntimeError", message, f"Traceback {rank}", when=float(rank))

    cause = failure(2, "shapes do not match")
    lost = failure(0, "[gloo] Connection closed by peer")
    also = failure(1, "shapes do not match")
    assert failing_rank(RankError(cause, [lost])).rank == 2
    assert failing_rank(RankError(cause, [lost, also])).rank == 1
    assert failing_rank(RankError(cause, [])).traceback == "Traceback 2"


def test_the_partial_sum_diagnosis_names_the_ranks_and_gives_up_past_ten_ranks():
    from labs.checks.collectives import _subset_sum

    parts = [torch.full((3,), float(2 ** r)) for r in range(11)]  # every subset sum differs
    assert _subset_sum(parts[0] + parts[2], parts[:4]) == (0, 2)
    assert _subset_sum(torch.full((3,), -1.0), parts[:4]) is None
    assert _subset_sum(parts[0], parts) is None  # 11 ranks: 2^11 sums are not tried
