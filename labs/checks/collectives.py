"""Exercise checks for chapters 2-4: the learner's ring all-reduce, reduce-scatter, all-gather,
and the all-reduce composed from the last two, each run on real ranks.

Every check launches the learner's function once per world size and runs a list of cases in
each launch: numel 1, N-1, N, a prime that N does not divide, 300 and 301, and (for the
all-reduce and the reduce-scatter) a 2-D tensor. Inputs are small integers stored as
float32, so every sum is exact and the comparison is ``torch.equal``. Inside every rank:

* the collectives of ``torch.distributed`` (and the matching methods of ``ProcessGroup``)
  raise :class:`CollectiveUsedError`: the exercise is to build them from point-to-point
  messages;
* labs' own collectives (:mod:`labs.checks.answer_keys`) raise
  :class:`~labs.checks.answer_keys.AnswerKeyUsed`: they are the exercise's answer key;
* so do the ways around them (a backend's methods, functional collectives, the c10d
  operators: :func:`labs.checks.watch.side_doors_closed`);
* ``ProcessGroup.send`` counts the bytes the rank sends, so the check can hold the answer to
  the ring's volume: 2(N-1)/N·S per rank for an all-reduce, (N-1)/N·S for a reduce-scatter
  or an all-gather, S being the size of the whole tensor, rounded up to whole chunks: at
  most phases·(N-1) chunks of ceil(numel/N) elements, less than one element per message
  more than the formula when chunks are uneven.

That count lives in the rank, where the learner's code could set it, so the launcher also
reads what each rank wrote as the kernel counts it (``launch(count_writes=True)``) and the
check holds that to the ring's volume over all the cases, plus an allowance for headers
(:func:`_judge_written`); the last case, numel 65536, is large enough for the difference to
show. Each rank draws its inputs from its own key (:class:`~labs.checks.core.CaseKeys`), so
its sum cannot be right unless the other ranks' data reached it.

``seed=0`` runs the documented cases; any other seed also draws three numels and one extra
world size (up to 6) from ``random.Random(seed)``, and the verdict names them. The cases are
in :mod:`labs.checks.collectives_cases`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.collectives_cases import (
    Case,
    Exercise,
    Plan,
    gather_full,
    gather_shard,
    rank_input,
)
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CaseKeys,
    CheckResult,
    case_noted,
    failed_case,
    failing_rank,
    first_change,
    first_difference,
    listed,
    raised,
    run_check,
    signature_problem,
    validate_check_call,
)
from labs.checks.watch import COLLECTIVE_METHODS, Traffic, counted_collectives, patched
from labs.collectives import Collective, shard_bounds
from labs.launcher import LaunchTimeout, RankError

#: The collectives of torch.distributed a learner might reach for; inside a check each raises
#: (and so do the methods of ProcessGroup they call, watch.COLLECTIVE_METHODS).
_COLLECTIVES = (
    "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
    "all_gather_into_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather",
    "scatter", "_reduce_scatter_base", "_all_gather_base", "all_reduce_coalesced",
    "all_gather_coalesced", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list",
)
_P2P = "dist.isend/irecv, send/recv, batch_isend_irecv"


class CollectiveUsedError(RuntimeError):
    """Raised inside a check's ranks when the learner's code calls a built-in collective."""


# --- inside every rank ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    """What one rank saw in one case: its input after the call, what the call returned (a
    copy, when a tensor), and the bytes it sent."""

    after: torch.Tensor
    returned: torch.Tensor | None
    returned_type: str
    bytes_sent: int


def _refuse(exercise: Exercise, name: str, qualified: str) -> Callable[..., NoReturn]:
    what = ("is the collective you are building" if exercise.builds(name)
            else "is a collective too; build on your point-to-point code instead")

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise CollectiveUsedError(
            f"Exercise {exercise.value}: use only point-to-point calls ({_P2P}); "
            f"{qualified} {what}"
        )

    return refuse


@contextlib.contextmanager
def _point_to_point_only(exercise: Exercise) -> Iterator[Traffic]:
    """Inside: built-in collectives raise and every send is counted. The learner's code looks
    ``dist.all_reduce`` up when it runs, so patching the module attributes reaches it; the
    ProcessGroup methods catch functions imported by name earlier. All restored on exit."""
    functions = [(module, name, _refuse(exercise, name, f"dist.{name}"))
                 for module in (dist, distributed_c10d) for name in _COLLECTIVES
                 if hasattr(module, name)]
    methods = {name: _refuse(exercise, name, f"ProcessGroup.{name}")
               for name in COLLECTIVE_METHODS}
    with patched(functions), counted_collectives(methods) as traffic:
        yield traffic


def _call(fn: Callable[..., Any], exercise: Exercise, keys: CaseKeys, n: int, rank: int,
          index: int, case: Case) -> tuple[torch.Tensor, object]:
    if exercise is Exercise.RING_ALL_GATHER:
        shard = gather_shard(keys, n, index, rank, case)
        return shard, fn(shard, case.numel)
    tensor = rank_input(keys, index, rank, case)
    return tensor, fn(tensor)


def _rank_run(rank: int, world_size: int, fn: Callable[..., Any], exercise: Exercise,
              cases: tuple[Case, ...], keys: CaseKeys) -> list[_Outcome]:
    """Runs every case on this rank, with collectives and labs' own answers refused and sends
    counted. ``keys`` are this rank's only: it can draw its own inputs, no other rank's."""
    outcomes = []
    with _point_to_point_only(exercise) as traffic, answer_keys_refused(exercise.value):
        for index, case in enumerate(cases):
            traffic.sent = 0.0
            with case_noted(index):
                after, returned = _call(fn, exercise, keys, world_size, rank, index, case)
            copy = returned.detach().clone() if isinstance(returned, torch.Tensor) else None
            outcomes.append(_Outcome(after.detach().clone(), copy, type(returned).__name__,
                                     int(traffic.sent)))  # sends only: whole bytes
    return outcomes


# --- judging values ---------------------------------------------------------------------------


#: The diagnosis below tries every subset of ranks: 2^N sums, so it stops at this N.
_SUBSET_SEARCH_MAX_N = 10


def _subset_sum(got: torch.Tensor, parts: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The smallest set of ranks whose parts sum to ``got`` exactly, or None (also when there
    are more than :data:`_SUBSET_SEARCH_MAX_N` ranks to try)."""
    n = len(parts)
    if n > _SUBSET_SEARCH_MAX_N:
        return None
    for size in range(1, n + 1):
        for ranks in itertools.combinations(range(n), size):
            if torch.equal(got, sum(parts[r] for r in ranks)):
                return ranks
    return None


def _partial(ranks: tuple[int, ...], n: int) -> str:
    missing = [r for r in range(n) if r not in ranks]
    return (f"the sum over rank(s) {listed(ranks)} only, missing rank(s) "
            f"{listed(missing)}")


_STEPS_HINT = ("every chunk must collect all N contributions, which takes N-1 reduce-scatter "
               "steps (k = 0..N-2), each adding the chunk that arrives from the left neighbour")


def _judge_all_reduce(exercise: Exercise, n: int, inputs: list[torch.Tensor],
                      outcomes: list[_Outcome]) -> str:
    expected = sum(inputs).reshape(-1)
    bounds = shard_bounds(expected.numel(), n)
    for r, out in enumerate(outcomes):
        got = out.after.reshape(-1)
        if torch.equal(got, expected):
            continue
        mine = inputs[r].reshape(-1)
        if torch.equal(got, mine):
            returned = out.returned
            if returned is not None and torch.equal(returned.reshape(-1), expected):
                return (f"rank {r}: the tensor is unchanged, but {exercise.function} returned "
                        "the sum as a new tensor. An all-reduce works in place: write the result "
                        "into the tensor it was given (tensor.copy_(result)).")
            return (f"rank {r}: the tensor is unchanged. {exercise.function} must sum in place, "
                    "writing into the tensor it was given (assigning `tensor = ...` only rebinds "
                    "a local name; use tensor.copy_(...) or in-place ops on a view of it).")
        chunks = [(j, bounds[j], bounds[j + 1]) for j in range(n) if bounds[j + 1] > bounds[j]]
        right = [j for j, a, b in chunks if torch.equal(got[a:b], expected[a:b])]
        subsets = {j: _subset_sum(got[a:b], [x.reshape(-1)[a:b] for x in inputs])
                   for j, a, b in chunks if j not in right}
        if len(right) == 1 and len(chunks) > 1 and all(subsets.values()):
            j = right[0]
            second = ("all-gather half is missing: all-gather the reduced chunk and copy the "
                      "result into the tensor" if exercise is Exercise.COMPOSED_ALL_REDUCE else
                      "all-gather phase is missing: after the N-1 reduce-scatter steps, pass the "
                      "finished chunks round the ring for N-1 more steps, each rank storing the "
                      "chunk it receives")
            return (f"rank {r}: only chunk {j} (elements {bounds[j]}..{bounds[j + 1] - 1}) holds "
                    f"the full sum; the other chunks hold partial sums. The {second}.")
        for j, a, b in chunks:
            ranks = subsets.get(j)
            if ranks is not None:
                return (f"rank {r}: chunk {j} (elements {a}..{b - 1}) holds {_partial(ranks, n)}: "
                        f"{_STEPS_HINT}.")
        return f"rank {r}: " + first_difference(got, expected, "the sum over all ranks") + "."
    return ""


def _wrong_shape(r: int, out: _Outcome, want: int, what: str) -> str:
    """Why rank r's returned value is not a 1-D float32 tensor of ``want`` elements, or ''."""
    got = out.returned
    if got is None:
        return (f"rank {r}: returned {out.returned_type}; it must return a 1-D tensor "
                f"holding {what}.")
    if got.dim() != 1:
        return (f"rank {r}: returned a tensor of shape {tuple(got.shape)}; it must return a 1-D "
                f"tensor of {want} element(s) holding {what}.")
    if got.dtype != torch.float32:
        return f"rank {r}: returned dtype {got.dtype}; keep the input's dtype, torch.float32."
    return ""


_CHUNKS_HINT = ("torch.tensor_split / shard_bounds make the first numel % N chunks one element "
                "longer than the rest")


def _judge_reduce_scatter(n: int, inputs: list[torch.Tensor], outcomes: list[_Outcome]) -> str:
    expected = sum(inputs).reshape(-1)
    numel = expected.numel()
    bounds = shard_bounds(numel, n)
    chunk = [expected[bounds[j]:bounds[j + 1]] for j in range(n)]
    for r, out in enumerate(outcomes):
        size = bounds[r + 1] - bounds[r]
        wrong = _wrong_shape(r, out, size, f"chunk {r} of the sum")
        if wrong:
            return wrong
        got = out.returned
        assert got is not None
        if got.numel() != size:
            if got.numel() == numel and torch.equal(got, expected):
                return (f"rank {r}: returned the whole sum ({numel} elements); a reduce-scatter "
                        f"returns only chunk {r} ({size} element(s)). That is its point: each "
                        "rank gets 1/N of the result for (N-1)/N·S bytes.")
            return (f"rank {r}: returned {got.numel()} element(s), but chunk {r} of {numel} "
                    f"elements over {n} ranks has {size}.")
        if torch.equal(got, chunk[r]):
            continue
        others = [j for j in range(n) if j != r and torch.equal(got, chunk[j])]
        if others:
            j = others[0]
            return (f"rank {r}: returned chunk {j} of the sum, expected chunk {r}: ownership is "
                    f"off by {(j - r) % n}. At step k rank r sends chunk (r-k-1) mod N and adds "
                    "into chunk (r-k-2) mod N, so after the last step (k = N-2) the chunk it has "
                    "just finished is chunk r.")
        ranks = _subset_sum(got, [x.reshape(-1)[bounds[r]:bounds[r + 1]] for x in inputs])
        if ranks is not None:
            return f"rank {r}: returned {_partial(ranks, n)}: {_STEPS_HINT}."
        return f"rank {r}: " + first_difference(got, chunk[r], f"chunk {r} of the sum") + "."
    for r, out in enumerate(outcomes):
        if not torch.equal(out.after, inputs[r]):
            return (f"rank {r}: the right chunk, but the input tensor was changed: "
                    f"{first_change(out.after, inputs[r])}. A reduce-scatter must leave its "
                    "input as it was: add into a separate buffer (e.g. a clone of the chunk), "
                    "not into a view of the input.")
    return ""


def _judge_all_gather(n: int, full: torch.Tensor, outcomes: list[_Outcome]) -> str:
    numel = full.numel()
    bounds = shard_bounds(numel, n)
    chunk = [full[bounds[j]:bounds[j + 1]] for j in range(n)]
    for r, out in enumerate(outcomes):
        wrong = _wrong_shape(r, out, numel, "every rank's shard in rank order")
        if wrong:
            return wrong
        got = out.returned
        assert got is not None
        if got.numel() != numel:
            guess = ("; that is shard.numel() x N, but shards differ in length when numel does "
                     "not divide by N, so use the numel argument" if
                     got.numel() == out.after.numel() * n else "")
            return (f"rank {r}: returned {got.numel()} element(s), expected numel = {numel}"
                    f"{guess}.")
        if torch.equal(got, full):
            continue
        for j in range(n):
            a, b = bounds[j], bounds[j + 1]
            if b == a or torch.equal(got[a:b], chunk[j]):
                continue
            holder = [k for k in range(n) if k != j and torch.equal(got[a:b], chunk[k])]
            if holder:
                return (f"rank {r}: elements {a}..{b - 1} hold rank {holder[0]}'s shard, "
                        f"expected rank {j}'s: put the shard that started on rank i at "
                        "shard_bounds(numel, N)[i] .. [i+1]; at step k rank r receives the "
                        "shard that started on rank (r-k-1) mod N.")
        placed = [j for j in range(n) if bounds[j + 1] > bounds[j]
                  and torch.equal(got[bounds[j]:bounds[j + 1]], chunk[j])]
        missing = [j for j in range(n) if bounds[j + 1] > bounds[j] and j not in placed]
        if placed == [r]:
            return (f"rank {r}: only its own shard (chunk {r}) is in place; no other shard "
                    "arrived. The ring takes N-1 steps: each rank sends a shard to its right "
                    "neighbour and stores the one from its left, then forwards that one on.")
        if placed:
            return (f"rank {r}: the shard(s) of rank(s) {listed(missing)} never arrived; "
                    "the ring takes N-1 steps, each forwarding the shard received in the step "
                    "before.")
        return f"rank {r}: " + first_difference(got, full, "the gathered tensor") + "."
    for r, out in enumerate(outcomes):
        if not torch.equal(out.after, chunk[r]):
            return (f"rank {r}: the right result, but its shard was changed "
                    f"({first_change(out.after, chunk[r])}); an all-gather must leave its input "
                    "as it was (copy it into the output instead).")
    return ""


def _judge_case(exercise: Exercise, keys: CaseKeys, n: int, index: int, case: Case,
                outcomes: list[_Outcome]) -> str:
    if exercise is Exercise.RING_ALL_GATHER:
        return _judge_all_gather(n, gather_full(keys, n, index, case), outcomes)
    inputs = [rank_input(keys, index, r, case) for r in range(n)]
    if exercise is Exercise.RING_REDUCE_SCATTER:
        return _judge_reduce_scatter(n, inputs, outcomes)
    return _judge_all_reduce(exercise, n, inputs, outcomes)


def _pattern(exercise: Exercise, n: int, cases: tuple[Case, ...], failed: list[int]) -> str:
    """A hint when the failing cases share what the passing ones lack."""
    passed = [i for i in range(len(cases)) if i not in failed]
    if not passed:
        return ""
    if all(cases[i].uneven(n) for i in failed):
        good = ", ".join(str(cases[i].numel) for i in passed)
        bad = ", ".join(str(cases[i].numel) for i in failed)
        return (f" It is right for numel {good} but wrong for numel {bad}, which {n} does not "
                f"divide: check the chunk sizes ({_CHUNKS_HINT}; some chunks are empty when "
                "numel < N).")
    if all(len(cases[i].shape) > 1 for i in failed):
        target = "slice a flat view" if exercise.collective is Collective.ALL_REDUCE else \
            "return chunk r of the flattened sum"
        return (" Only the 2-D input fails: work on tensor.view(-1) (a view, so in-place writes "
                f"reach the caller's tensor) and {target}.")
    return ""


def _judge_values(exercise: Exercise, keys: CaseKeys, n: int, cases: tuple[Case, ...],
                  results: Sequence[list[_Outcome]]) -> str:
    verdicts = {i: _judge_case(exercise, keys, n, i, case, [res[i] for res in results])
                for i, case in enumerate(cases)}
    failed = [i for i, v in verdicts.items() if v]
    if not failed:
        return ""
    # The traffic case is shown only when it alone fails: the others are smaller to read.
    failed = [i for i in failed if not cases[i].traffic] or failed
    # The most telling case: a divisible one if any fails (chunks are unambiguous there), the
    # largest of those (a shifted chunk cannot match by chance).
    even = [i for i in failed if not cases[i].uneven(n)]
    shown = max(even or failed, key=lambda i: (cases[i].numel, -i))
    return (f"with {n} rank(s), {cases[shown].describe()}: {verdicts[shown]}"
            + _pattern(exercise, n, cases, failed))


# --- judging traffic ----------------------------------------------------------------------------


def _chunk_count(exercise: Exercise) -> str:
    """How many chunks a rank of the ring sends, as a formula in N: N-1 per phase."""
    return {2: "2(N-1)", 1: "N-1"}[exercise.phases]


def _judge_traffic(exercise: Exercise, n: int, cases: tuple[Case, ...],
                   results: Sequence[list[_Outcome]]) -> str:
    if n == 1:
        return ""
    formula = {2: "2(N-1)/N·S", 1: "(N-1)/N·S"}[exercise.phases]
    why = {
        Collective.ALL_REDUCE: "Passing whole tensors round the ring, or gathering everything "
        "at one rank, costs a rank (N-1)·S, which grows with N, while the ring's 2(N-1)/N·S "
        "stays under 2·S for any N: send one chunk (about S/N) per step, never the whole "
        "tensor.",
        Collective.REDUCE_SCATTER: "Each step sends one chunk (about S/N), the running partial "
        "sum; whole tensors, or an all-reduce followed by slicing, send far more than a "
        "reduce-scatter needs.",
        Collective.ALL_GATHER: "Each step forwards one shard (about S/N); gathering at one rank "
        "and sending the whole result from there costs that rank (N-1)·S.",
    }[exercise.collective]
    # The traffic case is judged by what the kernel counted (:func:`_judge_written`).
    order = sorted((i for i in range(len(cases)) if not cases[i].traffic),
                   key=lambda i: (-cases[i].numel, i))
    for i in order:
        numel = cases[i].numel
        esize = results[0][i].after.element_size()
        total_bytes = numel * esize
        sent = [res[i].bytes_sent for res in results]
        longest = math.ceil(numel / n)  # elements of the longest chunk (shard_bounds)
        upper = exercise.phases * (n - 1) * longest * esize
        worst = max(range(n), key=lambda r: (sent[r], -r))
        optimal = exercise.phases * (n - 1) / n * total_bytes
        where = f"with {n} rank(s), {cases[i].describe()} (S = {total_bytes} bytes)"
        if sent[worst] > upper:
            return (f"{where}: the values are right, but rank {worst} sent {sent[worst]} bytes. "
                    f"A ring {exercise.collective.value} sends {formula} = {optimal:.1f} bytes "
                    f"per rank; the check allows {upper}: {_chunk_count(exercise)} chunks of "
                    f"at most ceil(numel/N) = {longest} elements. {why}")
        lower = (n - 1) * total_bytes
        if sum(sent) < lower:
            return (f"{where}: the values are right, but the ranks sent only {sum(sent)} bytes "
                    f"in all through point-to-point calls, less than the (N-1)·S = {lower} bytes "
                    "any algorithm must move: the data travelled some other way. Use only "
                    f"point-to-point calls ({_P2P}).")
    return ""


#: What a rank may write beyond the payloads of a ring's messages, over all the cases of one
#: world size: the check's own report and output are not counted, gloo's headers are (about
#: 120 bytes a message: 8 KiB at 6 ranks), and so is the process group's set-up (~250 bytes).
WRITE_ALLOWANCE = 64 << 10


def _judge_written(exercise: Exercise, n: int, cases: tuple[Case, ...],
                   written: Sequence[int] | None) -> str:
    """The bytes each rank wrote, as the kernel counted them (``launch(count_writes=True)``),
    against the most a ring sends over all the cases, plus :data:`WRITE_ALLOWANCE`. The
    counters of :func:`_judge_traffic` live in the rank, where the learner's code could set
    them; this count does not, and it takes in any other way out of the rank that writes
    (a file, a pipe, a socket written with write()). '' when right, or where the kernel does
    not count (not Linux)."""
    if n == 1 or not written or min(written) < 0:
        return ""
    esize = 4  # float32
    most = sum(exercise.phases * (n - 1) * math.ceil(c.numel / n) * esize for c in cases)
    worst = max(range(n), key=lambda r: (written[r], -r))
    if written[worst] <= most + WRITE_ALLOWANCE:
        return ""
    big = next(c for c in cases if c.traffic)
    formula = {2: "2(N-1)/N·S", 1: "(N-1)/N·S"}[exercise.phases]
    return (f"with {n} rank(s), over every case ({big.describe()} the largest): the values are "
            f"right, but rank {worst} wrote {written[worst]} bytes, as the kernel counts them "
            f"(its messages, and anything else it wrote), where a ring "
            f"{exercise.collective.value} sends {formula} per case, at most {most} bytes in "
            f"all, and the check allows {WRITE_ALLOWANCE} bytes more for message headers. "
            "Send one chunk (about S/N) per step, never the whole tensor, and send nothing "
            "but the ring's messages.")


# --- judging failures ---------------------------------------------------------------------------


def _explain_error(n: int, cases: tuple[Case, ...], err: RankError) -> str:
    named = failing_rank(err)
    if err.exc_type == "RankDied":
        return (f"with {n} rank(s), rank {named.rank} died ({named.message}). gloo ends a "
                "process when a message does not fit the buffer posted to receive it: every "
                "send needs a receive of the same number of elements on the other side; check "
                f"the chunk sizes ({_CHUNKS_HINT}).")
    case = failed_case(named.traceback, cases)
    where = f"with {n} rank(s), {case.describe()}" if case else f"with {n} rank(s)"
    if err.exc_type == CollectiveUsedError.__name__:
        called = re.search(r"Exercise [\d.]+: use only.*", named.traceback)
        return f"{where}: {called.group(0) if called else str(err).splitlines()[0]}."
    hint = ""
    if case is not None and case.uneven(n):
        hint = (f" {n} does not divide {case.numel}: if it works when it does, check the chunk "
                f"sizes ({_CHUNKS_HINT}; some chunks are empty when numel < N).")
    elif case is not None and len(case.shape) > 1:
        hint = " The input is 2-D: work on tensor.view(-1)."
    return f"{where}: {raised(named, hint)}"


def _explain_timeout(n: int, cases: tuple[Case, ...], err: LaunchTimeout, timeout: float,
                     where: str) -> str:
    numels = listed(c.numel for c in cases)
    return (f"with {n} rank(s) (numel {numels}), rank(s) {listed(err.ranks)} hung for "
            f"{timeout:g} s.{where} Every send needs a matching receive: on a ring, post the "
            "receive (dist.irecv) before waiting on the send, or use dist.batch_isend_irecv for "
            "each step; a blocking dist.send or dist.recv on every rank at once waits forever.")


# --- the checks ------------------------------------------------------------------------------


def _check(exercise: Exercise, fn: Callable[..., Any], world_sizes: Sequence[int], seed: int,
           timeout: float) -> CheckResult:
    validate_check_call(fn, world_sizes, seed, timeout)
    plan = Plan.make(world_sizes, seed)

    def judge(n: int, results: Sequence[list[_Outcome]]) -> str:
        cases = plan.cases(exercise, n)
        return (_judge_values(exercise, CaseKeys.draw(seed, n), n, cases, results)
                or _judge_traffic(exercise, n, cases, results)
                or _judge_written(exercise, n, cases, getattr(results, "written", None)))

    return run_check(
        exercise.title, plan, timeout,
        worker=_rank_run,
        args=lambda n: (fn, exercise, plan.cases(exercise, n)),
        rank_args=lambda n: CaseKeys.draw(seed, n).per_rank(),
        judge=judge,
        explain_error=lambda n, err: _explain_error(n, plan.cases(exercise, n), err),
        explain_timeout=lambda n, err, where: _explain_timeout(
            n, plan.cases(exercise, n), err, timeout, where),
        passed=_passed(exercise, plan),
        problem=signature_problem(exercise.function, exercise.parameters, fn),
        count_writes=True,
    )


def _passed(exercise: Exercise, plan: Plan) -> str:
    what = {
        Collective.ALL_REDUCE: "exact sums on every rank",
        Collective.REDUCE_SCATTER: "rank r gets exactly chunk r of the sum, input unchanged",
        Collective.ALL_GATHER: "every rank gets every shard in rank order",
    }[exercise.collective]
    shapes = "1, N-1, N, a prime, 300, 301 and 65536"
    if exercise is not Exercise.RING_ALL_GATHER:
        shapes += ", and a 2-D (3, 2N) tensor"
    bound = {2: "2(N-1)/N·S", 1: "(N-1)/N·S"}[exercise.phases]
    return (f"{what}, with {listed(plan.world_sizes)} rank(s) and numel {shapes}; no rank sent "
            f"more than {_chunk_count(exercise)} chunks of ceil(numel/N) elements (the ring's "
            f"{bound}, rounded up to whole chunks) nor, by the kernel's count, wrote more in "
            "all, and no built-in collective was used.")


def check_ring_all_reduce(
    ring_all_reduce: Callable[[torch.Tensor], object],
    world_sizes: Sequence[int] = (1, 2, 3, 4, 5),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 2.1: ``ring_all_reduce(tensor)`` must leave every rank's ``tensor`` holding
    the element-wise sum over all ranks (in place; the return value is ignored), using only
    point-to-point calls, each rank sending at most the ring's 2(N-1) chunks of ceil(numel/N)
    elements (2(N-1)/N·S, rounded up to whole chunks)."""
    return _check(Exercise.RING_ALL_REDUCE, ring_all_reduce, world_sizes, seed, timeout)


def check_ring_reduce_scatter(
    ring_reduce_scatter: Callable[[torch.Tensor], torch.Tensor],
    world_sizes: Sequence[int] = (1, 2, 3, 4, 5),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 3.1: ``ring_reduce_scatter(tensor)`` must return, on rank r, a 1-D tensor
    holding chunk r (``shard_bounds`` / ``torch.tensor_split``) of the flattened sum over
    ranks, leave ``tensor`` unchanged, and send at most N-1 chunks of ceil(numel/N) elements
    per rank ((N-1)/N·S, rounded up to whole chunks)."""
    return _check(Exercise.RING_REDUCE_SCATTER, ring_reduce_scatter, world_sizes, seed, timeout)


def check_ring_all_gather(
    ring_all_gather: Callable[[torch.Tensor, int], torch.Tensor],
    world_sizes: Sequence[int] = (1, 2, 3, 4, 5),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 4.1: ``ring_all_gather(shard, numel)``, with rank i holding chunk i of
    ``shard_bounds(numel, N)``, must return on every rank the 1-D tensor of ``numel``
    elements that concatenates the shards in rank order, sending at most N-1 chunks of
    ceil(numel/N) elements per rank ((N-1)/N·S, S the size of the result, rounded up to whole
    chunks)."""
    return _check(Exercise.RING_ALL_GATHER, ring_all_gather, world_sizes, seed, timeout)


def check_composed_all_reduce(
    all_reduce: Callable[[torch.Tensor], object],
    world_sizes: Sequence[int] = (1, 2, 3, 4, 5),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 4.2: ``all_reduce(tensor)``, built from the learner's reduce-scatter and
    all-gather, must sum ``tensor`` over ranks in place, sending at most 2(N-1) chunks of
    ceil(numel/N) elements per rank: the reduce-scatter's N-1 plus the all-gather's."""
    return _check(Exercise.COMPOSED_ALL_REDUCE, all_reduce, world_sizes, seed, timeout)
