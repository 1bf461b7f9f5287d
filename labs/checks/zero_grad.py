"""Exercise checks for chapter 6's gradients: ZeRO-2's gradient hook (6.4) and FSDP's backward
of one unit (6.5), each run on real ranks against one process's backward.

* 6.4 ``zero2_grad_hook(param, grad_shards)``: the function a ZeRO-2 wrapper registers as every
  parameter's post-accumulate-grad hook. When backward has finished ``param.grad``, it
  reduce-scatters it (the mean over ranks, flattened and zero-padded to N*k elements), stores
  this rank's k elements in ``grad_shards[param]`` and sets ``param.grad = None``: no full
  gradient outlives its hook. The check registers it on every parameter of a chain of Linear
  layers and runs backward on each rank's own rows.
* 6.5 ``fsdp_linear_backward(shard, in_features, out_features, x, grad_out)``: one FSDP unit's
  backward. ``shard`` is this rank's k elements of the zero-padded flat vector
  ``cat(weight.flatten(), bias)`` of a ``Linear(in_features, out_features)`` (as in 6.2), ``x``
  this rank's input and ``grad_out`` the gradient of its output. It all-gathers the
  parameters, computes ``grad_x`` and the gradients of weight and bias, reduce-scatters the
  flat gradient (the mean over ranks) and frees the gathered parameters; it returns
  ``(grad_x, grad_shard)``.

The cases and one process's answers are in :mod:`labs.checks.zero_grad_cases`. Every input
is a small integer stored as float32: the input gradient is compared exactly, the shards of
the mean with rtol = atol = 1e-6 (dividing by N rounds). Inside every rank each collective
(and each send of :mod:`labs.collectives`) is counted at its ring cost
(:func:`labs.checks.watch.counted_collectives`): per parameter, or per call, a rank may send
no more than one reduce-scatter's (N-1)/N·S (6.4) or one all-gather's and one
reduce-scatter's (6.5), S being the padded tensor's bytes. All-reduces are refused: they
leave the whole mean on every rank, for twice a reduce-scatter's bytes. Each call of the
learner's function runs inside an :class:`~labs.memory.AllocationTracker` (6.4's also tracks
the full gradient it is handed), read once every case has run: nothing but the stored or
returned shards may be alive then.

``seed=0`` runs the documented cases; any other seed also draws one more world size (5 or 6)
and another model from ``random.Random(seed)``, and the verdict names them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.collectives import CollectiveUsedError
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CheckResult,
    case_noted,
    failed_case,
    failing_rank,
    largest_difference,
    listed,
    raised,
    run_check,
    signature_problem,
    validate_check_call,
)
from labs.checks.watch import GROUP_METHODS, Kind, Traffic, counted_collectives
from labs.checks.zero import (
    PADDING_HINT,
    RTOL,
    all_reduce_refused,
    elements_text,
    shard_size_died,
)
from labs.checks.zero_cases import ZeroExercise, shard_of
from labs.checks.zero_grad_cases import (
    GradCase,
    Gradients,
    GradPlan,
    backward_reference,
    build_chain,
    chain_batch,
    chain_values,
    hook_reference,
    linear_batch,
    linear_flat,
)
from labs.checks.zero_ranks import settle
from labs.launcher import LaunchTimeout, RankError
from labs.memory import AllocationTracker
from labs.zero import shard_numel

_F32 = 4  #: bytes per element: every tensor of these checks is float32


# --- inside every rank ---------------------------------------------------------------------------


def _refusals(exercise: ZeroExercise) -> dict[str, Callable[..., NoReturn]]:
    """Every all-reduce method of ProcessGroup, replaced by a refusal naming the exercise."""

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise CollectiveUsedError(
            f"Exercise {exercise.value}: no all-reduce: it would leave the whole mean gradient "
            "on every rank, twice the traffic of a reduce-scatter (2(N-1)/N·S instead of "
            "(N-1)/N·S) and N times the memory of the shard. Reduce-scatter the zero-padded "
            "gradient (labs.collectives.ring_reduce_scatter, or torch's reduce-scatter) and "
            "divide by N")

    return {name: refuse for name, kind in GROUP_METHODS.items() if kind is Kind.ALL_REDUCE}


def _stored(value: object) -> tuple[torch.Tensor | None, str, int]:
    """(a copy, type name, storage bytes) of what the learner left, a tensor or not."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone(), "Tensor", value.untyped_storage().nbytes()
    return None, type(value).__name__, 0


@dataclass(frozen=True)
class _HookRun:
    """One rank's backward through one 6.4 model, with the learner's hook on every parameter."""

    fired: tuple[int, ...]  #: parameter indices, in the order the hook ran
    sent: tuple[float, ...]  #: bytes each hook call sent, in that order
    kept_grad: tuple[int, ...]  #: parameters whose ``.grad`` was not None after their hook
    stored: tuple[torch.Tensor | None, ...]  #: per parameter, a copy of grad_shards[param]
    stored_type: tuple[str, ...]  #: per parameter, what grad_shards[param] was ('' if missing)
    stored_storage: tuple[int, ...]  #: per parameter, bytes of the storage behind it
    foreign_keys: tuple[str, ...]  #: keys of grad_shards that are no parameter of the model
    held: int = 0
    """Bytes still alive once every case has run of the full gradients handed to the hook and
    of the storages made during its calls, the stored shards aside."""


_MISSING = object()  #: what :func:`_entry` returns when a parameter has no entry


def _entry(shards: dict[Any, Any], param: torch.Tensor) -> object:
    """``shards[param]`` looked up by identity (:data:`_MISSING` when absent): a key such as
    ``id(param)`` hashes like the parameter, and comparing a tensor with it would raise."""
    return next((value for key, value in shards.items() if key is param), _MISSING)


def _key_text(key: object) -> str:
    """A key of grad_shards that is no parameter, in words the same on every run (an id is
    not)."""
    if isinstance(key, str):
        return repr(key)
    if isinstance(key, torch.Tensor):
        return "a tensor that is not the parameter (a copy, a view or its gradient?)"
    return f"a{'n' if type(key).__name__[0] in 'aeiou' else ''} {type(key).__name__}"


def _rank_inputs(exercise: ZeroExercise, seed: int, n: int, rank: int,
                 cases: tuple[GradCase, ...]) -> list[tuple[torch.Tensor, ...]]:
    """What rank ``rank`` is given, case by case, drawn here in the parent: 6.4 the model's
    values (the same on every rank) and its own rows and targets, 6.5 its own shard of the
    padded weights, its own input and output gradient. A rank never gets the seed, so it
    cannot draw another rank's inputs."""
    given: list[tuple[torch.Tensor, ...]] = []
    for index, case in enumerate(cases):
        if exercise is ZeroExercise.GRAD_HOOK:
            given.append((*chain_values(seed, n, index, case),
                          *chain_batch(seed, n, index, rank, case)))
        else:
            given.append((shard_of(linear_flat(seed, n, index, case), n, rank).clone(),
                          *linear_batch(seed, n, index, rank, case)))
    return given


def _run_hook(fn: Callable[..., Any], rank: int, n: int, case: GradCase,
              given: tuple[torch.Tensor, ...], traffic: Traffic, keep: list[object]
              ) -> tuple[_HookRun, list[AllocationTracker]]:
    *values, x, t = given
    model = build_chain(case, values)
    params = list(model.parameters())
    grad_shards: dict[Any, Any] = {}
    keep.append((model, grad_shards))  # alive until the end, as a wrapper keeps them
    fired: list[int] = []
    sent: list[float] = []
    kept: list[int] = []
    made_all: list[AllocationTracker] = []

    def hook(param: torch.Tensor) -> None:
        i = next(j for j, p in enumerate(params) if p is param)
        traffic.sent = 0.0
        with AllocationTracker() as made:
            made.track([param.grad] if param.grad is not None else [])  # must not outlive it
            fn(param, grad_shards)
        entry = _entry(grad_shards, param)
        if isinstance(entry, torch.Tensor):
            made.untrack([entry])  # the shard is what the hook keeps
        fired.append(i)
        sent.append(traffic.sent)
        made_all.append(made)
        if param.grad is not None:
            kept.append(i)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    (model(x) * t).sum().backward()
    for handle in handles:
        handle.remove()
    entries = [_entry(grad_shards, p) for p in params]
    stored = [_stored(e) for e in entries]
    foreign = [_key_text(key) for key in grad_shards if not any(key is p for p in params)]
    for p in params:
        p.grad = None  # a full gradient kept on the parameter is judged by kept_grad
    return _HookRun(tuple(fired), tuple(sent), tuple(kept), tuple(s[0] for s in stored),
                    tuple("" if e is _MISSING else s[1]
                          for s, e in zip(stored, entries, strict=True)),
                    tuple(s[2] for s in stored), tuple(foreign[:3])), made_all


@dataclass(frozen=True)
class _BackwardCall:
    """One call of 6.5's function on one rank."""

    returned_type: str
    grad_x: torch.Tensor | None
    grad_shard: torch.Tensor | None
    storages: tuple[int, int]  #: bytes of the storages behind grad_x and grad_shard
    inputs_changed: str  #: which of shard, x, grad_out the call changed ('' when none)
    sent: float
    held: int = 0


def _pair(value: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(v, torch.Tensor) for v in value)):
        return value[0], value[1]
    return None


def _run_backward(fn: Callable[..., Any], rank: int, n: int, case: GradCase,
                  given: tuple[torch.Tensor, ...], traffic: Traffic, keep: list[object]
                  ) -> tuple[_BackwardCall, list[AllocationTracker]]:
    (in_features, out_features), = case.layers
    shard, x, grad_out = given  # shard: 1-D, k elements
    before = [t.clone() for t in (shard, x, grad_out)]
    keep.extend((shard, x, grad_out))
    traffic.sent = 0.0
    with AllocationTracker() as made:
        returned = fn(shard, in_features, out_features, x, grad_out)
    pair = _pair(returned)
    if pair is not None:
        made.untrack(pair)  # the results are the caller's to keep
    changed = [name for name, now, old in zip(("shard", "x", "grad_out"), (shard, x, grad_out),
                                              before, strict=True)
               if not torch.equal(now.detach(), old) or now.requires_grad or now.grad is not None]
    return _BackwardCall(
        type(returned).__name__,
        None if pair is None else pair[0].detach().clone(),
        None if pair is None else pair[1].detach().clone(),
        (0, 0) if pair is None else (pair[0].untyped_storage().nbytes(),
                                     pair[1].untyped_storage().nbytes()),
        ", ".join(changed), traffic.sent), [made]


def _rank_run(rank: int, world_size: int, fn: Callable[..., Any], exercise: ZeroExercise,
              cases: tuple[GradCase, ...], given: list[tuple[torch.Tensor, ...]]) -> list[Any]:
    """Runs every case on this rank with the collectives watched, then counts what each call
    left alive (at the end, when gloo has let go of the tensors of finished collectives).
    ``given``: this rank's inputs, case by case (:func:`_rank_inputs`)."""
    run = _run_hook if exercise is ZeroExercise.GRAD_HOOK else _run_backward
    results = []
    keep: list[object] = []  # alive until the end: what the learner hangs on them is held
    with counted_collectives(_refusals(exercise)) as traffic, \
            answer_keys_refused(exercise.value):
        for index, case in enumerate(cases):
            with case_noted(index):
                results.append(run(fn, rank, world_size, case, given[index], traffic, keep))
    settle([made for _, trackers in results for made in trackers])
    return [replace(record, held=sum(m.live_bytes for m in trackers))
            for record, trackers in results]


# --- judging a shard of a gradient ----------------------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=RTOL)


def _judge_shard(got: torch.Tensor, grads: Gradients, i: int, numel: int, n: int, r: int,
                 what: str, extra: Sequence[tuple[torch.Tensor, str]] = ()) -> str:
    """Why ``got``, rank r's shard of gradient i (``numel`` elements before padding), is wrong
    ('' when right), naming the usual mistakes: the sum, the whole mean, another rank's shard,
    a gradient never reduced, ... ``extra``: (a padded mean, the hint) of further mistakes."""
    mean, summed, local = grads.mean[i], grads.summed[i], grads.local[r][i]
    k = mean.numel() // n
    mine = elements_text(r, k)
    if got.dim() != 1:
        return (f"{what} is a tensor of shape {tuple(got.shape)}; it must be 1-D, k = "
                f"ceil(numel / N) = {k} element(s): {mine} of the mean.")
    if _close(got, shard_of(mean, n, r)):
        return ""
    if n > 1 and _close(got, mean):
        return (f"{what} is the whole mean ({got.numel()} elements); keep only this rank's "
                f"{mine}: 1/N of the memory, for (N-1)/N·S bytes.")
    chunk = torch.tensor_split(mean[:numel], n)[r]
    if _close(got, chunk):
        return (f"{what} is chunk {r} of torch.tensor_split, not the ZeRO shard: zero-pad the "
                f"flattened gradient to N*k = {n * k} elements first (k = ceil(numel / N)), "
                "then reduce-scatter it.")
    if got.numel() != k:
        return f"{what} has {got.numel()} element(s); a shard has k = ceil(numel / N) = {k}."
    for value, hint in extra:
        if _close(got, shard_of(value, n, r)):
            return f"{what}: {hint}"
    if n > 1 and _close(got, shard_of(summed, n, r)):
        return (f"{what} is the SUM over ranks ({n} x the mean): a reduce-scatter sums; divide "
                "by the world size.")
    if n > 1 and any(_close(got, shard_of(local, n, r) / d) for d in (1, n)):
        return (f"{what} is this rank's shard of its OWN gradient, never reduced over the "
                "ranks: reduce-scatter the gradient (every rank contributes its gradient, "
                "rank r receives the sum of shard r), then divide by N.")
    other = [q for q in range(n) if q != r and _close(got, shard_of(mean, n, q))]
    if other:
        return (f"{what} is {elements_text(other[0], k)} of the mean, not this rank's {mine}: "
                "rank r owns elements [r*k, (r+1)*k).")
    divisor = next((d for d in range(1, 2 * n + 1) if d != n
                    and _close(got, shard_of(summed, n, r) / d)), 0)
    if n > 1 and divisor:
        return (f"{what} is the sum divided by {divisor}, not by the world size {n}: divide by "
                "dist.get_world_size().")
    return f"{what}: " + largest_difference(got, shard_of(mean, n, r), f"{mine} of the mean") + "."


@dataclass(frozen=True)
class _Verdict:
    """What is wrong in one case, and how telling it is."""

    message: str
    even: bool  #: N divides the numel of what failed: no padding can be to blame
    numel: int


def _held_text(exercise: ZeroExercise, held: int, padded: int) -> str:
    if exercise is ZeroExercise.GRAD_HOOK:
        return (f"{held} bytes of the full gradients handed to the hook, or of what its calls "
                f"made, were still alive after backward, once every case had run (the padded "
                f"gradients hold {padded} bytes): keep nothing but the shard in grad_shards. A "
                "reference to param.grad, or to a copy of it, in a global, a cache or an "
                "attribute is the full gradient that ZeRO-2 frees.")
    return (f"{held} bytes allocated during the call were still alive after it returned, once "
            f"every case had run (the padded flat vector holds {padded} bytes): free the "
            "gathered parameters before returning (FSDP's reshard after backward): keep no "
            "reference to the gathered vector, or to a view of it, in a global, a cache or an "
            "attribute, or empty its storage (full.untyped_storage().resize_(0)).")


def _judge_hook(n: int, index: int, case: GradCase, seed: int,
                runs: Sequence[_HookRun]) -> _Verdict | None:
    grads = hook_reference(seed, n, index, case)
    ks = [shard_numel(numel, n) for numel in case.numels]
    # Values first, the parameters N divides first, the largest of them first.
    order = sorted(range(len(ks)), key=lambda i: (case.numels[i] % n != 0, -case.numels[i], i))
    for i in order:
        name, even = case.param_text(i), case.numels[i] % n == 0
        for r, run in enumerate(runs):
            at = f"{name}, rank {r}: "
            if not run.stored_type[i]:
                keys = " and ".join(dict.fromkeys(run.foreign_keys))
                why = (f"grad_shards is keyed by {keys}, not by the parameters: store the shard "
                       "as grad_shards[param]." if keys else
                       "grad_shards has no entry for it after backward: the hook must store "
                       "this rank's shard in grad_shards[param] before it returns (it runs "
                       "once per parameter, as soon as param.grad is complete).")
                return _Verdict(at + why, even, case.numels[i])
            got = run.stored[i]
            if got is None:
                return _Verdict(f"{at}grad_shards[param] is a {run.stored_type[i]}; store the "
                                "1-D tensor of this rank's shard of the mean.", even,
                                case.numels[i])
            wrong = _judge_shard(got, grads, i, case.numels[i], n, r, "grad_shards[param]")
            if wrong:
                return _Verdict(at + wrong, even, case.numels[i])
    padded = n * sum(ks) * _F32
    for r, run in enumerate(runs):
        for i in (i for i in order if i in run.kept_grad):
            return _Verdict(
                f"{case.param_text(i)}, rank {r}: after the hook returned, param.grad still held "
                "a gradient: set param.grad = None, so that no full gradient outlives its hook "
                "(ZeRO-2 keeps only the shard).", True, case.numels[i])
        for i, (value, storage) in enumerate(zip(run.stored, run.stored_storage, strict=True)):
            if value is not None and storage > value.numel() * _F32:
                return _Verdict(
                    f"{case.param_text(i)}, rank {r}: grad_shards[param] is a view of a larger "
                    f"tensor ({storage} bytes), which it keeps alive: store a tensor of its own "
                    "(.clone() the shard).", True, case.numels[i])
        if run.held:
            return _Verdict(f"rank {r}: " + _held_text(ZeroExercise.GRAD_HOOK, run.held, padded),
                            True, case.numel)
    if n == 1:
        return None
    for i in order:
        sent = [run.sent[run.fired.index(i)] for run in runs]
        bound = (n - 1) * ks[i] * _F32
        worst = max(range(n), key=lambda r: (sent[r], -r))
        name = case.param_text(i)
        if sent[worst] > bound:
            return _Verdict(
                f"{name}, rank {worst}: the values are right, but its hook sent "
                f"{sent[worst]:g} bytes, more than a reduce-scatter of that gradient, (N-1)/N·S "
                f"= {bound} bytes (S = N·k·4 = {n * ks[i] * _F32}): reduce-scatter each "
                "gradient once, in its own hook (an all-reduce sends twice as much).", True,
                case.numels[i])
        lower = (n - 1) * case.numels[i] * _F32
        if sum(sent) < lower:
            return _Verdict(
                f"{name}: the values are right, but the hooks of this parameter sent only "
                f"{sum(sent):g} bytes in all, less than the (N-1)·numel·4 = {lower} bytes that "
                f"{n} ranks must exchange: reduce-scatter the gradient inside the hook, the "
                "moment backward has finished it, not later.", True, case.numels[i])
    return None


def _judge_backward(n: int, index: int, case: GradCase, seed: int,
                    calls: Sequence[_BackwardCall]) -> _Verdict | None:
    (in_features, out_features), = case.layers
    ref = backward_reference(seed, n, index, case)
    k = shard_numel(case.numel, n)
    even = case.numel % n == 0
    w = in_features * out_features

    def wrong(message: str) -> _Verdict:
        return _Verdict(message, even, case.numel)

    for r, call in enumerate(calls):
        if call.inputs_changed:
            return wrong(f"rank {r}: the call changed {call.inputs_changed} (its values, "
                         "requires_grad or .grad): leave the inputs as they are, and gather "
                         "into a tensor of your own.")
        if call.grad_x is None or call.grad_shard is None:
            return wrong(f"rank {r}: returned {call.returned_type}; it must return a tuple "
                         "(grad_x, grad_shard) of two tensors.")
        want = ref.grad_x[r]
        if call.grad_x.shape != want.shape:
            return wrong(f"rank {r}: grad_x has shape {tuple(call.grad_x.shape)}; it must have "
                         f"x's shape {tuple(want.shape)}: the gradient of the loss with respect "
                         "to this rank's input.")
        if not torch.equal(call.grad_x, want):
            return wrong(f"rank {r}: grad_x, " + largest_difference(
                call.grad_x, want, "grad_out @ weight, with the gathered weight") + ".")
        transposed = (ref.transposed, (
            f"the weight's gradient is transposed: it has the weight's shape ({out_features}, "
            f"{in_features}), so it is grad_out.T @ x, flattened row by row like the weight "
            f"(elements [0, {w}) of the flat vector)."))
        problem = _judge_shard(call.grad_shard, ref.grads, 0, case.numel, n, r, "grad_shard",
                               extra=[transposed])
        if problem:
            return wrong(f"rank {r}: {problem}")
    padded = n * k * _F32
    for r, call in enumerate(calls):
        for what, value, storage in (("grad_x", call.grad_x, call.storages[0]),
                                     ("grad_shard", call.grad_shard, call.storages[1])):
            assert value is not None
            if storage > value.numel() * _F32:
                return wrong(f"rank {r}: {what} is a view of a larger tensor ({storage} bytes), "
                             "which it keeps alive: return a tensor of its own (.clone()).")
        if call.held:
            return wrong(f"rank {r}: " + _held_text(ZeroExercise.FSDP_BACKWARD, call.held,
                                                    padded))
    if n == 1:
        return None
    sent = [call.sent for call in calls]
    bound = 2 * (n - 1) * k * _F32
    worst = max(range(n), key=lambda r: (sent[r], -r))
    if sent[worst] > bound:
        return wrong(f"rank {worst}: the values are right, but it sent {sent[worst]:g} bytes, "
                     "more than an all-gather and a reduce-scatter of the padded flat vector: "
                     f"2(N-1)/N·S = {bound} bytes (S = N·k·4 = {padded}). Gather once, "
                     "reduce-scatter once, and nothing else.")
    lower = 2 * (n - 1) * case.numel * _F32
    if sum(sent) < lower:
        return wrong(f"the values are right, but the ranks sent only {sum(sent):g} bytes in all, "
                     f"less than the 2(N-1)·numel·4 = {lower} bytes of an all-gather and a "
                     "reduce-scatter: every rank must send its shard and its gradient, not "
                     "compute the others' itself.")
    return None


def _judge(plan: GradPlan, n: int, results: Sequence[list[Any]]) -> str:
    """What is wrong in the most telling failing case: one where N divides what failed, the
    largest, with a hint when only what N does not divide fails."""
    judge = _judge_hook if plan.exercise is ZeroExercise.GRAD_HOOK else _judge_backward
    verdicts = [(i, judge(n, i, case, plan.seed, [per_rank[i] for per_rank in results]))
                for i, case in enumerate(plan.cases)]
    failed = [(i, v) for i, v in verdicts if v is not None]
    if not failed:
        return ""
    index, shown = max(failed, key=lambda iv: (iv[1].even, iv[1].numel, -iv[0]))
    message = (f"with {n} rank(s), {plan.cases[index].describe(plan.exercise)}, "
               f"{shown.message}")
    if not shown.even:
        message += (f" It is right where {n} divides the numel, wrong where it does not: "
                    f"check the padding ({PADDING_HINT}).")
    return message


# --- judging failures ---------------------------------------------------------------------------


def _explain_error(plan: GradPlan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    if err.exc_type == "RankDied":
        return shard_size_died(n, named.rank)
    case = failed_case(named.traceback, plan.cases)
    where = f"with {n} rank(s), {case.describe(plan.exercise)}" if case else f"with {n} rank(s)"
    if err.exc_type == CollectiveUsedError.__name__:
        return all_reduce_refused(where, named.traceback, err)
    hint = ""
    if case is not None and any(numel % n for numel in case.numels):
        hint = (f" {n} does not divide every numel ({listed(case.numels)}): if it works when "
                f"it does, check the padding ({PADDING_HINT}).")
    return f"{where}: {raised(named, hint)}"


def _explain_timeout(plan: GradPlan, n: int, err: LaunchTimeout, timeout: float,
                     where: str) -> str:
    what = ("reduce-scatter every parameter's gradient, in the hook, even a rank whose shard "
            "is only padding" if plan.exercise is ZeroExercise.GRAD_HOOK else
            "make the all-gather and the reduce-scatter, in the same order, even a rank whose "
            "shard is only padding")
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} A "
            f"rank waits forever in a collective that a peer never makes: every rank must "
            f"{what}.")


# --- the checks ------------------------------------------------------------------------------


def _passed(plan: GradPlan) -> str:
    sizes = listed(plan.world_sizes)
    documented = plan.cases[:len(plan.cases) - len(plan.drawn)]
    if plan.exercise is ZeroExercise.GRAD_HOOK:
        models = " and ".join(case.describe(plan.exercise).removeprefix("the model ")
                              for case in documented)
        return (f"on {sizes} rank(s), for the models {models}, the hook stored in "
                "grad_shards[param] the k = ceil(numel / N) elements [r*k, (r+1)*k) of the mean "
                "over ranks of every zero-padded gradient, set param.grad = None and kept "
                "nothing else; no hook call sent more than a reduce-scatter of its "
                "parameter's gradient, (N-1)/N·S bytes, or made an all-reduce.")
    linears = ", ".join(case.describe(plan.exercise).split(" (")[0] for case in documented)
    return (f"on {sizes} rank(s), for {linears}, grad_x equals one process's input gradient "
            "exactly, and grad_shard holds the k = ceil(numel / N) elements [r*k, (r+1)*k) of "
            "the mean over ranks of the zero-padded flat gradient of weight and bias; the "
            "gathered parameters were freed, and no rank sent more than an all-gather's and a "
            "reduce-scatter's (N-1)/N·S bytes or made an all-reduce.")


def _check(exercise: ZeroExercise, fn: Callable[..., Any], world_sizes: Sequence[int], seed: int,
           timeout: float) -> CheckResult:
    validate_check_call(fn, world_sizes, seed, timeout)
    plan = GradPlan.make(exercise, world_sizes, seed)
    return run_check(
        f"Exercise {exercise.value} {exercise.function}", plan, timeout,
        worker=_rank_run,
        args=lambda n: (fn, exercise, plan.cases),
        rank_args=lambda n: [(_rank_inputs(exercise, seed, n, r, plan.cases),) for r in range(n)],
        judge=lambda n, results: _judge(plan, n, results),
        explain_error=lambda n, err: _explain_error(plan, n, err),
        explain_timeout=lambda n, err, where: _explain_timeout(plan, n, err, timeout, where),
        passed=_passed(plan),
        problem=signature_problem(exercise.function, exercise.parameters, fn),
    )


def check_zero2_grad_hook(
    zero2_grad_hook: Callable[..., object],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 6.4: ``zero2_grad_hook(param, grad_shards)``, registered (through a lambda) as
    the post-accumulate-grad hook of every parameter of a chain of Linear layers, each rank
    running backward on its own rows. When it returns, ``grad_shards[param]`` must hold this
    rank's k = ceil(numel / N) elements ``[r*k, (r+1)*k)`` of the mean over ranks of the
    flattened, zero-padded gradient (rtol = atol = 1e-6, against one process's backward on the
    concatenated batch), and ``param.grad`` must be None. Each hook call must reduce-scatter
    its parameter's gradient, at most (N-1)/N·S bytes per rank, with no all-reduce (refused
    inside the check); after backward nothing but the stored shards may be alive.

    A non-zero ``seed`` also runs one more world size (5 or 6) and another two-layer model,
    drawn from ``random.Random(seed)``; the verdict names them."""
    return _check(ZeroExercise.GRAD_HOOK, zero2_grad_hook, world_sizes, seed, timeout)


def check_fsdp_linear_backward(
    fsdp_linear_backward: Callable[..., object],
    world_sizes: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 6.5: ``fsdp_linear_backward(shard, in_features, out_features, x, grad_out)``,
    with ``shard`` this rank's k elements of the zero-padded flat vector ``cat(weight.flatten(),
    bias)`` of a ``Linear(in_features, out_features)``, ``x`` this rank's input and
    ``grad_out`` the gradient of its output, must return ``(grad_x, grad_shard)``: exactly the
    gradient of the loss with respect to ``x``, and this rank's k elements ``[r*k, (r+1)*k)``
    of the mean over ranks of the zero-padded flat gradient of weight and bias (rtol = atol =
    1e-6), both against one process's autograd on the concatenated batch. It must free the
    gathered parameters, leave its inputs unchanged, send at most an all-gather's and a
    reduce-scatter's (N-1)/N·S bytes each, and make no all-reduce (refused inside the check).

    A non-zero ``seed`` also runs one more world size (5 or 6) and another Linear, drawn from
    ``random.Random(seed)``; the verdict names them."""
    return _check(ZeroExercise.FSDP_BACKWARD, fsdp_linear_backward, world_sizes, seed,
                  timeout)
