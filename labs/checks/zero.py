"""Exercise checks for chapter 6: ZeRO-1's sharded step, FSDP's gather and free, and the
gradient reduce-scatter, each run on real ranks.

All three exercises share ZeRO's layout (Rajbhandari et al., arXiv 1910.02054): a tensor of
``numel`` elements is flattened and zero-padded to ``N * k`` elements, ``k = ceil(numel / N)``,
and rank r owns elements ``[r*k, (r+1)*k)`` (:mod:`labs.checks.zero_cases`, with the cases).

* 6.1 ``sharded_sgd_step(params, momentum_shards, lr, beta)``: rank r updates only its shard of
  every parameter (``m = beta * m + g_shard``, ``p_shard -= lr * m``, with ``m`` its k-element
  momentum shard, updated in place), then all-gathers the updated shards into the parameter.
  3 steps, against plain SGD with momentum in one process.
* 6.2 ``fsdp_linear_forward(shard, in_features, out_features, x)``: all-gather the flat vector
  ``cat(weight.flatten(), bias)`` of a ``Linear(in_features, out_features)``, return
  ``x @ weight.T + bias``, and free the gathered vector before returning (FSDP's reshard).
* 6.3 ``reduce_scatter_grad(grad)``: rank r's shard of the mean over ranks of the flattened,
  zero-padded gradients, by a reduce-scatter.

Inputs are small integers stored as float32, ``lr = 0.25`` and ``beta = 0.5``, so 6.1 and 6.2
are compared exactly (``torch.equal``); 6.3 divides by N and is compared with rtol=1e-6,
atol=1e-6. The learner's function is called under ``torch.no_grad()`` (as an optimizer step and
an inference forward run) inside an :class:`~labs.memory.AllocationTracker`, which tells which
storages made during the call are still alive after it (read once every case has run: gloo
lets go of a finished collective's tensors a little after ``wait()`` returns). Inside every
rank each collective (and each send of :mod:`labs.collectives`) is counted at its ring cost
(:func:`labs.checks.watch.counted_collectives`): an all-gather or a reduce-scatter of the
padded tensor (S = N·k·4 bytes) costs exactly (N-1)/N·S; each rank may send no more.
Exercise 6.3 refuses all-reduces outright.

What runs inside every rank is in :mod:`labs.checks.zero_ranks`; this module judges what
the ranks send back and explains it. ``seed=0`` runs the documented cases; any other seed also
draws one more world size (5 or 6) and other shapes from ``random.Random(seed)``, and the
verdict names them. Exercises 6.4 and 6.5, the gradients' side of ZeRO-2 and FSDP, are checked
in :mod:`labs.checks.zero_grad`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from labs.checks.collectives import CollectiveUsedError
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CheckResult,
    failed_case,
    failing_rank,
    first_change,
    first_difference,
    largest_difference,
    listed,
    raised,
    run_check,
    signature_problem,
    validate_check_call,
)
from labs.checks.zero_cases import (
    LINEARS,
    SHAPES,
    STEPS,
    TOGETHER,
    Case,
    Plan,
    ZeroExercise,
    flat_linear,
    linear_inputs,
    pad_flat,
    rank_grad,
    sgd_reference,
    shapes_text,
    shard_of,
    start_param,
)
from labs.checks.zero_ranks import Call, rank_inputs, rank_run
from labs.launcher import LaunchTimeout, RankError
from labs.zero import shard_numel

RTOL = ATOL = 1e-6  #: 6.3's tolerance (a mean over 3 ranks is not exact in binary)
_F32 = 4  #: bytes per element: every tensor of these checks is float32


# --- judging values ---------------------------------------------------------------------------


def elements_text(q: int, k: int) -> str:
    """Shard q of k elements, in words."""
    return f"shard {q}, elements [{q * k}, {(q + 1) * k})"


def _judge_step(n: int, index: int, case: Case, seed: int, calls: Sequence[list[Call]]) -> str:
    reference = sgd_reference(seed, n, index, case)
    count = len(case.shapes)
    for step, (params, momenta) in enumerate(reference):
        at = f"step {step + 1}: rank"
        for r in range(n):
            if calls[r][step].problem:
                return f"{at} {r}: {calls[r][step].problem}"
        for i, want in enumerate(momenta):
            before = reference[step - 1][1][i] if step else torch.zeros_like(want)
            for r in range(n):
                wrong = _judge_momentum(n, r, i, calls[r][step].state[count + i], want, before)
                if wrong:
                    return f"{at} {r}: {wrong}"
        for i, want in enumerate(params):
            before = reference[step - 1][0][i] if step else start_param(
                seed, n, index, i, case.shapes[i])
            for r in range(n):
                wrong = _judge_param(n, r, i, calls[r][step].state[i], want, before)
                if wrong:
                    return f"{at} {r}: {wrong}"
    return ""


def _judge_momentum(n: int, r: int, i: int, got: torch.Tensor, want: torch.Tensor,
                    before: torch.Tensor) -> str:
    k = want.numel() // n
    if torch.equal(got, shard_of(want, n, r)):
        return ""
    if torch.equal(got, shard_of(before, n, r)):
        return (f"momentum_shards[{i}] was not updated. Update it in place, "
                f"m.mul_(beta).add_(g_shard), g_shard being this rank's {elements_text(r, k)} "
                "of the flattened, zero-padded gradient. (A full-size momentum kept elsewhere "
                "is the N-fold memory that ZeRO-1 saves.)")
    other = [q for q in range(n) if q != r and torch.equal(got, shard_of(want, n, q))]
    if other:
        return (f"momentum_shards[{i}] holds the momentum of {elements_text(other[0], k)}, not "
                f"of this rank's {elements_text(r, k)}: rank r owns elements [r*k, (r+1)*k) of "
                f"the flattened, zero-padded parameter, k = ceil(numel / N) = {k}.")
    return (f"momentum_shards[{i}]: " + first_difference(got, shard_of(want, n, r), (
        f"m = beta * m + g_shard on {elements_text(r, k)}")) + ".")


def _judge_param(n: int, r: int, i: int, got: torch.Tensor, want: torch.Tensor,
                 before: torch.Tensor) -> str:
    if torch.equal(got, want):
        return ""
    if torch.equal(got, before):
        return (f"parameter {i} is unchanged: write the gathered values into it in place, "
                "p.copy_(full[:p.numel()].view_as(p)).")
    k = shard_numel(want.numel(), n)
    flat, ok, old = got.reshape(-1), want.reshape(-1), before.reshape(-1)
    spans = [(q, q * k, min((q + 1) * k, ok.numel())) for q in range(n) if q * k < ok.numel()]
    wrong = [(q, a, b) for q, a, b in spans if not torch.equal(flat[a:b], ok[a:b])]
    if (n > 1 and r not in [q for q, _, _ in wrong]
            and all(torch.equal(flat[a:b], old[a:b]) for _, a, b in wrong)):
        return (f"only this rank's own shard of parameter {i} ({elements_text(r, k)}) was "
                "updated; the other shards still hold the old values. All-gather the updated "
                "shards, so that every rank holds the whole updated parameter.")
    q, a, b = wrong[0]
    return (f"parameter {i}, {elements_text(q, k)}: " + first_difference(
        flat[a:b], ok[a:b], f"after the all-gather, shard {q} holds rank {q}'s update") + ".")


def _judge_forward(n: int, index: int, case: Case, seed: int,
                   calls: Sequence[list[Call]]) -> str:
    (out_features, in_features), _ = case.shapes
    padded, x = linear_inputs(seed, n, index, case)
    w = out_features * in_features
    want = flat_linear(x, padded, in_features, out_features)
    k = padded.numel() // n
    for r in range(n):
        call = calls[r][0]
        if not torch.equal(call.state[0], shard_of(padded, n, r)):
            return (f"rank {r}: the shard it was given was changed ("
                    f"{first_change(call.state[0], shard_of(padded, n, r))}); gather from it, "
                    "but leave it as it is (it is the rank's only copy of the parameters).")
        got = call.returned
        if got is None or got.shape != want.shape:
            what = call.returned_type if got is None else f"a tensor of shape {tuple(got.shape)}"
            return (f"rank {r}: returned {what}; it must return x @ weight.T + bias, of shape "
                    f"{tuple(want.shape)} (x has shape {tuple(x.shape)}).")
        if torch.equal(got, want):
            continue
        own = torch.zeros_like(padded)
        shard_of(own, n, r).copy_(shard_of(padded, n, r))
        reversed_ = torch.cat([shard_of(padded, n, q) for q in reversed(range(n))])
        candidates = (
            (flat_linear(x, padded, in_features, out_features, bias_first=True),
             "weight and bias are swapped: the flat vector is cat(weight.flatten(), bias), so "
             f"weight = full[:{w}].view({out_features}, {in_features}) comes first, then bias "
             f"= full[{w}:{w + out_features}]."),
            (F.linear(x, padded[:w].view(out_features, in_features), padded[-out_features:]),
             f"the bias was read from the end of the gathered vector, which ends with "
             f"{padded.numel() - case.numel} element(s) of padding: bias = "
             f"full[{w}:{w + out_features}], right after the weight."),
            (x @ padded[:w].view(in_features, out_features) + padded[w:w + out_features],
             f"the weight was viewed as ({in_features}, {out_features}); it is stored "
             f"row-major as (out_features, in_features): weight = full[:{w}]"
             f".view({out_features}, {in_features}), and the output is x @ weight.T + bias."),
            (flat_linear(x, reversed_, in_features, out_features),
             "the shards were put together in the wrong order: shard q (rank q's) belongs at "
             f"elements [q*k, (q+1)*k), k = {k}; all-gathers return them in rank order."),
            (flat_linear(x, own, in_features, out_features),
             "only this rank's shard was used, the rest of the vector left at zero: all-gather "
             "every rank's shard first."),
            (x @ padded[:w].view(out_features, in_features).T, "the bias was not added."),
        )
        hint = next((h for value, h in candidates if torch.equal(got, value)
                     and not torch.equal(value, want)), "")
        return f"rank {r}: " + (hint or first_difference(
            got.reshape(-1), want.reshape(-1), "F.linear(x, weight, bias) with the gathered "
            "weight and bias") + ".")
    return ""


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _judge_grad(n: int, index: int, case: Case, seed: int, calls: Sequence[list[Call]]) -> str:
    grads = [rank_grad(seed, n, index, r, case) for r in range(n)]
    total = sum(grads)
    assert isinstance(total, torch.Tensor)
    summed, mean = pad_flat(total, n), pad_flat(total, n) / n
    k = mean.numel() // n
    for r in range(n):
        call = calls[r][0]
        if not torch.equal(call.state[0], grads[r]):
            return (f"rank {r}: grad was changed ({first_change(call.state[0], grads[r])}); "
                    "reduce_scatter_grad must leave it as it is (pad and divide a copy: "
                    "reshape(-1) is a view when it can be).")
        got, want = call.returned, shard_of(mean, n, r)
        if got is None or got.dim() != 1:
            what = call.returned_type if got is None else f"a tensor of shape {tuple(got.shape)}"
            return (f"rank {r}: returned {what}; it must return a 1-D tensor of k = ceil(numel / "
                    f"N) = {k} element(s), {elements_text(r, k)} of the mean.")
        if _close(got, want):
            continue
        chunk = torch.tensor_split(total.reshape(-1) / n, n)[r]
        if n > 1 and _close(got, mean):
            return (f"rank {r}: returned the whole mean ({got.numel()} elements); return only "
                    f"this rank's {elements_text(r, k)}: 1/N of the memory, for (N-1)/N·S bytes.")
        if _close(got, chunk):
            return (f"rank {r}: returned chunk {r} of torch.tensor_split (shard_bounds: the first "
                    "numel % N chunks one element longer), not the ZeRO shard: zero-pad the "
                    f"flattened gradient to N*k = {n * k} elements first (k = ceil(numel / N)), "
                    "then reduce-scatter it.")
        if got.numel() != k:
            return (f"rank {r}: returned {got.numel()} element(s); a shard has k = ceil(numel / "
                    f"N) = {k}.")
        if n > 1 and _close(got, shard_of(summed, n, r)):
            return (f"rank {r}: returned the SUM over ranks ({n} x the mean): a reduce-scatter "
                    "sums; divide by the world size.")
        other = [q for q in range(n) if q != r and _close(got, shard_of(mean, n, q))]
        if other:
            return (f"rank {r}: returned {elements_text(other[0], k)} of the mean, not its own "
                    f"{elements_text(r, k)}: rank r owns elements [r*k, (r+1)*k).")
        divisor = next((d for d in range(1, 2 * n + 1) if d != n
                        and _close(got, shard_of(summed, n, r) / d)), 0)
        if n > 1 and divisor:
            return (f"rank {r}: returned the sum divided by {divisor}, not by the world size {n}: "
                    "divide by dist.get_world_size().")
        return f"rank {r}: " + largest_difference(
            got, want, f"{elements_text(r, k)} of the mean") + "."
    return ""


# --- judging memory and traffic -------------------------------------------------------------------


def _judge_cost(exercise: ZeroExercise, n: int, case: Case,
                calls: Sequence[list[Call]]) -> str:
    """Nothing made during a call may outlive it (but the result), and each rank sends at most
    the ring cost of one all-gather or reduce-scatter of every padded tensor."""
    numels = case.numels(exercise)
    ks = [shard_numel(numel, n) for numel in numels]
    full = n * sum(ks) * _F32  # S: the padded tensors, in bytes
    steps = len(calls[0])
    for step in range(steps):
        at = f"step {step + 1}: " if exercise is ZeroExercise.SHARDED_STEP else ""
        for r in range(n):
            call = calls[r][step]
            if call.returned is not None and call.returned_storage > call.returned.numel() * _F32:
                return (f"{at}rank {r}: the returned tensor is a view of a larger one "
                        f"({call.returned_storage} bytes), which it keeps alive: return a "
                        "tensor of its own (.clone() the shard).")
            if call.held:
                what = {ZeroExercise.SHARDED_STEP: (
                            "sharded_sgd_step must keep nothing between calls but "
                            "momentum_shards: a full-size momentum or a cached gathered "
                            "parameter is the N-fold memory that ZeRO-1 removes"),
                        ZeroExercise.FSDP_FORWARD: (
                            "the gathered vector must be freed before returning (FSDP's "
                            "reshard): keep no reference to it, or to a view of it (weight, "
                            "bias), in a global, a cache or an attribute"),
                        ZeroExercise.REDUCE_SCATTER_GRAD: (
                            "keep nothing but the returned shard: a rank holds 1/N of the "
                            "gradient")}[exercise]
                return (f"{at}rank {r}: {call.held} bytes allocated during the call were still "
                        f"alive after it returned, once every case had run (the padded "
                        f"tensor(s) hold {full} bytes): {what}.")
    if n == 1:
        return ""
    bound = (n - 1) * sum(ks) * _F32
    for step in range(steps):
        at = f"step {step + 1}: " if exercise is ZeroExercise.SHARDED_STEP else ""
        sent = [calls[r][step].sent for r in range(n)]
        worst = max(range(n), key=lambda r: (sent[r], -r))
        call = calls[worst][step]
        if call.all_reduced:
            return (f"{at}rank {worst}: the values are right, but it made an all-reduce of "
                    f"{call.all_reduced} elements, which sends 2(N-1)/N·S, twice what "
                    f"{exercise.collective} sends ((N-1)/N·S = {bound} bytes here): each rank "
                    f"has only its own shard to contribute, so {exercise.collective} of the "
                    "shards is all it takes.")
        if sent[worst] > bound:
            return (f"{at}rank {worst}: the values are right, but it sent {sent[worst]:g} bytes, "
                    f"more than {exercise.collective} of the padded tensor(s): (N-1)/N·S = "
                    f"{bound} bytes (S = N·k·4 = {full}). Make {exercise.collective} per "
                    "tensor, of k = ceil(numel / N) elements per rank, and nothing else.")
        lower = (n - 1) * sum(numels) * _F32
        if sum(sent) < lower:
            return (f"{at}the values are right, but the ranks sent only {sum(sent):g} bytes in "
                    f"all, less than the (N-1)·numel·4 = {lower} bytes that {n} ranks must "
                    f"exchange: every rank must send its shard ({exercise.collective}), not "
                    "compute the others' itself.")
    return ""


# --- judging failures ---------------------------------------------------------------------------


#: What a shard is, for messages about padding.
PADDING_HINT = ("k = ceil(numel / N) elements per shard, the flattened tensor zero-padded to "
                 "N*k elements, rank r owning elements [r*k, (r+1)*k)")


def shard_size_died(n: int, rank: int) -> str:
    """Why a rank of a chapter 6 check died: gloo ends a process whose message does not fit
    the receive buffer, which unequal shards cause."""
    return (f"with {n} rank(s), rank {rank} died. gloo ends a process when a message does not "
            "fit the buffer posted to receive it: every rank must pass shards of the same size "
            f"to the collective ({PADDING_HINT}).")


def all_reduce_refused(where: str, traceback: str, err: RankError) -> str:
    """The verdict when a chapter 6 check refused the learner's all-reduce."""
    called = re.search(r"Exercise [\d.]+: no all-reduce.*", traceback)
    return f"{where}: {called.group(0) if called else str(err).splitlines()[0]}."


def _explain_error(plan: Plan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    if err.exc_type == "RankDied":
        return shard_size_died(n, named.rank)
    case = failed_case(named.traceback, plan.cases)
    where = f"with {n} rank(s), {case.describe(plan.exercise)}" if case else f"with {n} rank(s)"
    if err.exc_type == CollectiveUsedError.__name__:
        return all_reduce_refused(where, named.traceback, err)
    hint = ""
    if case is not None and case.uneven(plan.exercise, n):
        numels = " and ".join(str(m) for m in case.numels(plan.exercise) if m % n)
        hint = (f" {n} does not divide numel {numels}: if it works when it does, check the "
                f"padding ({PADDING_HINT}).")
    return f"{where}: {raised(named, hint)}"


def _explain_timeout(plan: Plan, n: int, err: LaunchTimeout, timeout: float, where: str) -> str:
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} "
            f"A rank waits forever in a collective that a peer never makes: every rank must "
            f"make {plan.exercise.collective} of every tensor, in the same order, even a rank "
            "whose shard is only padding.")


# --- the checks ------------------------------------------------------------------------------


_JUDGES = {ZeroExercise.SHARDED_STEP: _judge_step, ZeroExercise.FSDP_FORWARD: _judge_forward,
           ZeroExercise.REDUCE_SCATTER_GRAD: _judge_grad}


def _judge(plan: Plan, n: int, results: Sequence[list[list[Call]]]) -> str:
    """What is wrong in the most telling failing case (values first, then memory and traffic),
    with a hint when only the numels that N does not divide fail."""
    verdicts = []
    for index, case in enumerate(plan.cases):
        calls = [per_rank[index] for per_rank in results]
        verdicts.append(_JUDGES[plan.exercise](n, index, case, plan.seed, calls)
                        or _judge_cost(plan.exercise, n, case, calls))
    failed = [i for i, v in enumerate(verdicts) if v]
    if not failed:
        return ""
    # The most telling case: one that N divides if any fails (the shards hold no padding), the
    # largest of those (a shifted shard or a swapped weight and bias cannot match by chance).
    even = [i for i in failed if not plan.cases[i].uneven(plan.exercise, n)]
    shown = max(even or failed, key=lambda i: (plan.cases[i].numel, -i))
    message = f"with {n} rank(s), {plan.cases[shown].describe(plan.exercise)}, {verdicts[shown]}"
    divides = [i for i, c in enumerate(plan.cases) if not c.uneven(plan.exercise, n)]
    if divides and not set(divides) & set(failed):
        message += (f" It is right where {n} divides every numel, wrong where it does not: "
                    f"check the padding ({PADDING_HINT}).")
    return message


def _check(exercise: ZeroExercise, fn: Callable[..., Any], world_sizes: Sequence[int], seed: int,
           timeout: float) -> CheckResult:
    validate_check_call(fn, world_sizes, seed, timeout)
    plan = Plan.make(exercise, world_sizes, seed)

    return run_check(
        exercise.title, plan, timeout,
        worker=rank_run,
        args=lambda n: (fn, exercise, plan.cases),
        rank_args=lambda n: [(rank_inputs(exercise, seed, n, r, plan.cases),) for r in range(n)],
        judge=lambda n, results: _judge(plan, n, results),
        explain_error=lambda n, err: _explain_error(plan, n, err),
        explain_timeout=lambda n, err, where: _explain_timeout(plan, n, err, timeout, where),
        passed=_passed(exercise, listed(plan.world_sizes)),
        problem=signature_problem(exercise.function, exercise.parameters, fn),
    )


def _passed(exercise: ZeroExercise, sizes: str) -> str:
    shapes = f"shapes {shapes_text(SHAPES)}"
    cost = (f"sent more than {exercise.collective}'s (N-1)/N·S bytes, S being the "
            "zero-padded tensor(s) of N·k float32")
    what = {
        ZeroExercise.SHARDED_STEP: (
            f"after each of {STEPS} steps every rank holds exactly the parameters of SGD with "
            f"momentum in one process, and the momentum of its own shard, on {sizes} rank(s), "
            f"for {shapes}, one at a time, then {shapes_text(TOGETHER)} in one call; no "
            f"rank {cost}, or kept anything between calls but its momentum shards"),
        ZeroExercise.FSDP_FORWARD: (
            f"every rank returns exactly F.linear with the full weight and bias on {sizes} "
            f"rank(s), for Linear{', Linear'.join(map(str, LINEARS))}; no rank {cost}, and the "
            "gathered vector was freed before returning"),
        ZeroExercise.REDUCE_SCATTER_GRAD: (
            "rank r gets the k = ceil(numel / N) elements [r*k, (r+1)*k) of the mean of the "
            f"zero-padded gradients, grad unchanged, on {sizes} rank(s), for {shapes}; no "
            f"rank made an all-reduce, {cost}, or kept anything but its shard"),
    }[exercise]
    return f"{what}."


def check_sharded_sgd_step(
    sharded_sgd_step: Callable[..., object],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 6.1: ``sharded_sgd_step(params, momentum_shards, lr, beta)``, called under
    ``torch.no_grad()`` with every rank holding the same parameters and mean gradients, must
    update in place each ``momentum_shards[i]`` (1-D, k = ceil(numel / N) elements: this
    rank's shard of the momentum, kept by the rank between calls) as ``m = beta * m +
    g_shard``, then ``p_shard -= lr * m``, and all-gather the updated shards into every ``p``
    in place. After each of 3 steps every rank must hold exactly the parameters of SGD with
    momentum in one process; no rank may send more than an all-gather's (N-1)/N·S bytes or
    keep anything alive after the call.

    A non-zero ``seed`` also runs one more world size (5 or 6) and two other parameter
    shapes, drawn from ``random.Random(seed)``; the verdict names them."""
    return _check(ZeroExercise.SHARDED_STEP, sharded_sgd_step, world_sizes, seed, timeout)


def check_fsdp_linear_forward(
    fsdp_linear_forward: Callable[..., torch.Tensor],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 6.2: ``fsdp_linear_forward(shard, in_features, out_features, x)``, with
    ``shard`` this rank's k elements of the zero-padded flat vector ``cat(weight.flatten(),
    bias)`` of a ``Linear(in_features, out_features)``, must all-gather the vector, return
    exactly ``x @ weight.T + bias`` (called under ``torch.no_grad()``), and free the gathered
    vector before returning: nothing made during the call but the output may be alive after
    it. No rank may send more than an all-gather's (N-1)/N·S bytes.

    A non-zero ``seed`` also runs one more world size (5 or 6) and another Linear, drawn from
    ``random.Random(seed)``; the verdict names them."""
    return _check(ZeroExercise.FSDP_FORWARD, fsdp_linear_forward, world_sizes, seed, timeout)


def check_reduce_scatter_grad(
    reduce_scatter_grad: Callable[[torch.Tensor], torch.Tensor],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 6.3: ``reduce_scatter_grad(grad)`` must return on rank r a 1-D tensor of
    k = ceil(numel / N) elements, elements [r*k, (r+1)*k) of the mean over ranks of the
    flattened, zero-padded gradients (rtol=1e-6, atol=1e-6), leave ``grad`` unchanged, make
    no all-reduce (refused inside the check), and send at most a reduce-scatter's (N-1)/N·S
    bytes.

    A non-zero ``seed`` also runs one more world size (5 or 6) and two other gradient shapes,
    drawn from ``random.Random(seed)``; the verdict names them."""
    return _check(ZeroExercise.REDUCE_SCATTER_GRAD, reduce_scatter_grad, world_sizes, seed,
                  timeout)
