"""Exercise checks for chapter 8: the hierarchical all-reduce (8.1) and one rank's forward of a
Megatron MLP (8.2), both on real ranks.

* 8.1 ``hierarchical_all_reduce_(tensor, node_group, cross_group)``: N ranks in n nodes of g
  consecutive ranks; ``node_group`` holds this rank's node, ``cross_group`` the ranks of its
  local rank on every node (the check builds both with ``dist.new_group``). The tensor (1-D,
  float32, S bytes) must end holding the sum over every rank, in place, built from labs' ring
  collectives: reduce-scatter in the node, all-reduce of the chunk across nodes, all-gather in
  the node. Inputs are integers in [1, 9], so the sum is compared exactly. Inside every rank
  each point-to-point send is counted by its destination's node, and torch's collectives are
  refused (their messages are hidden inside gloo). A rank may send at most the hierarchical
  closed form across nodes, 2(n-1)/n of its chunk of S/g (rounded up:
  :func:`~labs.checks.topology_cases.cross_node_bound`), where a flat ring over all N ranks
  sends 2(N-1)/N·S from a node's edge ranks. Every layout of each world size runs (2 ranks as
  2 nodes of 1 and 1 node of 2, 4 ranks as 2 x 2, 4 x 1 and 1 x 4).
* 8.2 ``tp_mlp_forward(x, w1, b1, w2, b2)``: rank r holds rows h_r of W1 (H, D) and of b1,
  the same columns of W2 (D, H), and the whole b2; it returns ``gelu(x W1^T + b1) W2^T + b2``
  on every rank with one ``dist.all_reduce`` of the (..., D) output (2(N-1)/N of it per
  rank), the bias added once, after it. Compared with the unsplit MLP in one process (rtol =
  atol = 1e-5); the all-reduces are counted.

The cases and references are in :mod:`labs.checks.topology_cases`. ``seed=0`` runs the
documented cases; any other seed also draws hidden ones from ``random.Random(seed)`` (8.1: 6
ranks in 3 nodes of 2 or 2 of 3, and another tensor size; 8.2: 3 ranks and another MLP), and
the verdict names them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, distributed_c10d

from labs.checks.answer_keys import answer_keys_refused
from labs.checks.collectives import CollectiveUsedError
from labs.checks.core import (
    CHECK_TIMEOUT_S,
    CheckResult,
    case_noted,
    failed_case,
    failing_rank,
    first_difference,
    listed,
    raised,
    run_check,
    signature_problem,
    validate_check_call,
)
from labs.checks.topology_cases import (
    HIER_NUMELS,
    MLP_ATOL,
    MLP_RTOL,
    HierPlan,
    Layout,
    MlpCase,
    MlpPlan,
    TopologyExercise,
    cross_node_bound,
    hier_input,
    hier_sum,
    mlp_partial,
    mlp_reference,
    mlp_weights,
    node_chunk,
    rank_weights,
)
from labs.checks.watch import (
    COLLECTIVE_METHODS,
    GROUP_METHODS,
    Kind,
    nbytes,
    patched,
    side_doors_closed,
)
from labs.grid import ProcessGrid
from labs.launcher import LaunchTimeout, RankError

# --- 8.1, inside every rank ------------------------------------------------------------------


def _refusal(kind: Kind) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise CollectiveUsedError(
            f"Exercise 8.1: torch's {kind.value} is refused here: the exercise builds the "
            "all-reduce from labs' ring collectives (ring_reduce_scatter, ring_all_reduce, "
            "ring_all_gather, each with group=), whose every message the check sees; a "
            "torch collective runs inside gloo, where nobody sees which bytes cross nodes, "
            "and dist.all_reduce on the world is the flat sum the hierarchy replaces")

    return refuse


@dataclass
class _Sends:
    """What this rank sent since the check last reset it, split by the destination's node."""

    node_size: int = 1
    sent: int = 0  #: bytes, every send
    across: int = 0  #: bytes, sends to a rank on another node


@contextlib.contextmanager
def _watched_sends() -> Iterator[_Sends]:
    """Inside: every ``ProcessGroup.send`` (what ``dist.isend``/``dist.send`` and the labs
    rings reach) adds its bytes to the yielded :class:`_Sends`, to ``across`` too when the
    destination's global rank is on another node; torch's collectives raise
    :class:`CollectiveUsedError`."""
    sends = _Sends()
    group_class = distributed_c10d.ProcessGroup
    me = dist.get_rank()
    ranks: dict[int, list[int]] = {}  # id(group) -> its global ranks, in group-rank order

    def global_rank(group: ProcessGroup, group_rank: int) -> int:
        if id(group) not in ranks:
            ranks[id(group)] = dist.get_process_group_ranks(group)
        return ranks[id(group)][group_rank]

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def send(self: Any, tensors: Any, dst: int, *args: Any, **kwargs: Any) -> Any:
            size = nbytes(tensors)
            sends.sent += size
            if global_rank(self, dst) // sends.node_size != me // sends.node_size:
                sends.across += size
            return original(self, tensors, dst, *args, **kwargs)

        return send

    with side_doors_closed(set(Kind)), patched([
        (group_class, "send", counted(group_class.send)),
        *((group_class, name, _refusal(kind)) for name, kind in COLLECTIVE_METHODS.items()
          if hasattr(group_class, name)),
    ]):
        yield sends


def _groups(layout: Layout) -> tuple[ProcessGroup, ProcessGroup]:
    """This rank's node group and cross-node group of ``layout``, from its grid
    (:class:`labs.grid.ProcessGrid`: every rank creates every group, in the same order, as
    ``dist.new_group`` requires)."""
    grid = ProcessGrid.build(layout.grid)
    return grid["node"], grid["cross"]


@dataclass(frozen=True)
class _HierCall:
    """One call of 8.1's function on one rank."""

    after: torch.Tensor  #: a copy of the tensor it was given, after the call
    returned: torch.Tensor | None  #: a copy of what it returned, when a tensor
    sent: int  #: bytes it sent
    across: int  #: of these, bytes to ranks on other nodes


def _hier_rank(rank: int, world_size: int, fn: Callable[..., Any], layouts: tuple[Layout, ...],
               tensors: list[list[torch.Tensor]]) -> list[list[_HierCall]]:
    """Calls the learner's function for every layout and tensor size, sends watched.
    ``tensors[layout][case]``: this rank's inputs, drawn by the parent (never the seed)."""
    groups = [_groups(layout) for layout in layouts]  # before watching: no send counted
    results = []
    with _watched_sends() as sends, \
            answer_keys_refused(TopologyExercise.HIERARCHICAL_ALL_REDUCE.value):
        for li, (layout, (node, cross)) in enumerate(zip(layouts, groups, strict=True)):
            sends.node_size = layout.node_size
            calls = []
            for index, tensor in enumerate(tensors[li]):  # 1-D, float32, one per tensor size
                sends.sent = sends.across = 0
                with case_noted(li * len(tensors[li]) + index):
                    returned = fn(tensor, node, cross)
                calls.append(_HierCall(
                    tensor.detach().clone(),
                    returned.detach().clone() if isinstance(returned, torch.Tensor) else None,
                    sends.sent, sends.across))
            results.append(calls)
    return results


# --- 8.1, judging ----------------------------------------------------------------------------


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.equal(got, want.to(got.dtype)))


def _hier_value_problem(seed: int, layout: Layout, index: int, numel: int, r: int,
                        call: _HierCall, want: torch.Tensor) -> str:
    """Why rank r's tensor is not the sum ('' when it is)."""
    if _same(call.after, want):
        return ""
    given = hier_input(seed, layout, index, r, numel)
    if _same(call.after, given):
        if call.returned is not None and _same(call.returned.reshape(-1), want):
            return (f"rank {r}: the sum is right in the tensor it returned, but `tensor` itself "
                    "is unchanged: the all-reduce works in place, as dist.all_reduce does (copy "
                    "the result into it, or all-gather with out=tensor).")
        return (f"rank {r}: `tensor` is unchanged: it must end holding the sum over every rank, "
                "in place.")
    node = hier_sum(seed, layout, index, numel, layout.node_ranks(layout.node_of(r)))
    if layout.nodes > 1 and _same(call.after, node):
        return (f"rank {r}: every element holds the sum over this rank's node only (ranks "
                f"{listed(layout.node_ranks(layout.node_of(r)))}): between the reduce-scatter "
                "and the all-gather, all-reduce this rank's chunk across nodes, over "
                "cross_group.")
    cross = hier_sum(seed, layout, index, numel, layout.cross_ranks(r % layout.node_size))
    if layout.node_size > 1 and _same(call.after, cross):
        return (f"rank {r}: every element holds the sum over the ranks of its cross_group only "
                f"(ranks {listed(layout.cross_ranks(r % layout.node_size))}): the ranks of its "
                "node (node_group) must add theirs too, by the reduce-scatter inside the node.")
    start, stop = node_chunk(layout, r, numel)
    if 0 < stop - start < numel:
        if _same(call.after[start:stop], want[start:stop]):
            return (f"rank {r}: only its own chunk, elements [{start}, {stop}), holds the sum: "
                    "all-gather the node's chunks inside the node, over node_group, into "
                    "tensor (ring_all_gather(shard, node_group, numel=tensor.numel(), "
                    "out=tensor)).")
    if torch.allclose(call.after * layout.world_size, want):
        return (f"rank {r}: it holds the average over the ranks; the exercise asks for the sum "
                "(ReduceOp.SUM, the rings' default).")
    return f"rank {r}: " + first_difference(call.after, want, "the sum over every rank")


def _hier_traffic_problem(layout: Layout, numel: int, calls: Sequence[_HierCall]) -> str:
    bound = cross_node_bound(layout, numel)
    for r, call in enumerate(calls):
        if call.across > bound:
            n, g = layout.nodes, layout.node_size
            return (f"the sums are right, but rank {r} sent {call.across} bytes to ranks on "
                    f"other nodes, more than the hierarchical all-reduce's {bound}: 2(n-1)/n "
                    f"of its chunk of S/g ({n} nodes of g = {g}, S = {numel * 4} bytes, sizes "
                    "rounded up). Only phase 2, the all-reduce of this rank's chunk over "
                    "cross_group, may leave the node; a flat ring over all N ranks sends "
                    "2(N-1)/N·S across from a node's edge ranks, and reducing or gathering "
                    "over cross_group sends the whole tensor across.")
    return ""


def _judge_hier(plan: HierPlan, n: int, results: Sequence[list[list[_HierCall]]]) -> str:
    """What is wrong in the first failing layout and case, in the plan's order."""
    for li, layout in enumerate(plan.layouts(n)):
        for index, numel in enumerate(plan.numels):
            calls = [per_rank[li][index] for per_rank in results]
            want = hier_sum(plan.seed, layout, index, numel)
            wrong = next((p for r, call in enumerate(calls) if (p := _hier_value_problem(
                plan.seed, layout, index, numel, r, call, want))), "")
            wrong = wrong or _hier_traffic_problem(layout, numel, calls)
            if wrong:
                return f"{_hier_where(layout, numel)}: {wrong}"
    return ""


def _hier_where(layout: Layout, numel: int) -> str:
    return (f"with {layout.world_size} rank(s) in {layout.describe()}, a tensor of {numel} "
            "element(s)")


def _hier_error(plan: HierPlan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    if err.exc_type == "RankDied":
        return (f"with {n} rank(s), rank {named.rank} died. gloo ends a process when a message "
                "does not fit the buffer posted to receive it: each ring must run over the "
                "group it belongs to (group=node_group for the reduce-scatter and the "
                "all-gather, group=cross_group for the all-reduce of the chunk), so that "
                "every rank of it cuts the same tensor into the same chunks.")
    labels = [(layout, numel) for layout in plan.layouts(n) for numel in plan.numels]
    case = failed_case(named.traceback, labels)
    where = _hier_where(*case) if case else f"with {n} rank(s)"
    if err.exc_type == CollectiveUsedError.__name__:
        refused = re.search(r"Exercise 8\.1: torch's .*", named.traceback)
        return f"{where}: {refused.group(0) if refused else str(err).splitlines()[0]}."
    hint = ""
    if err.exc_type == "ValueError" and ("shard has" in named.traceback
                                         or "out must be a contiguous" in named.traceback):
        hint = (" ring_all_gather cuts its result as ring_reduce_scatter cut the input "
                "(chunks of uneven sizes when g does not divide the numel): pass "
                "numel=tensor.numel().")
    return f"{where}: {raised(named, hint)}"


def _hier_timeout(n: int, err: LaunchTimeout, timeout: float, where: str) -> str:
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} A "
            "rank waits forever for a message a peer never sends: every rank of node_group "
            "must make the same reduce-scatter and all-gather, every rank of cross_group the "
            "same all-reduce, each ring over the group given to it (group=...), even a rank "
            "whose chunk is empty.")


# --- 8.2, inside every rank ------------------------------------------------------------------


@dataclass
class _Collectives:
    """The collectives and sends this rank made since the check last cleared it."""

    all_reduces: list[int] = field(default_factory=list)  #: the numel of each all-reduce
    others: list[str] = field(default_factory=list)  #: every other collective or send


@contextlib.contextmanager
def _counted_collectives() -> Iterator[_Collectives]:
    """Inside: every collective and send of ``ProcessGroup`` is logged, then runs."""
    log = _Collectives()
    group_class = distributed_c10d.ProcessGroup

    def logged(name: str, kind: Kind, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if kind is Kind.ALL_REDUCE:
                given = tensors if isinstance(tensors, (list, tuple)) else [tensors]
                log.all_reduces.append(sum(t.numel() for t in given
                                           if isinstance(t, torch.Tensor)))
            else:
                log.others.append(kind.value if kind is not Kind.OTHER else name)
            return original(self, tensors, *args, **kwargs)

        return call

    with side_doors_closed(), patched(
            (group_class, name, logged(name, kind, getattr(group_class, name)))
            for name, kind in GROUP_METHODS.items() if hasattr(group_class, name)):
        yield log


@dataclass(frozen=True)
class _MlpCall:
    """One call of 8.2's function on one rank."""

    output: torch.Tensor | None  #: a copy of what it returned, when a tensor
    returned_type: str
    all_reduces: tuple[int, ...]
    others: tuple[str, ...]


def _mlp_rank(rank: int, world_size: int, fn: Callable[..., Any],
              given: list[tuple[torch.Tensor, ...]]) -> list[_MlpCall]:
    """Calls the learner's function once per case with this rank's slices (drawn by the
    parent, ``given[index]``: a rank never gets the seed, nor another rank's slices),
    collectives counted."""
    results = []
    with _counted_collectives() as log, answer_keys_refused(TopologyExercise.TP_MLP_FORWARD.value):
        for index, args in enumerate(given):  # one per case
            log.all_reduces.clear()
            log.others.clear()
            with case_noted(index):
                out = fn(*args)
            results.append(_MlpCall(
                out.detach().clone() if isinstance(out, torch.Tensor) else None,
                type(out).__name__, tuple(log.all_reduces), tuple(log.others)))
    return results


# --- 8.2, judging ----------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.allclose(got.double(), want, rtol=MLP_RTOL, atol=MLP_ATOL))


def _mlp_value_problem(plan: MlpPlan, n: int, index: int, case: MlpCase, r: int,
                       call: _MlpCall) -> str:
    """Why rank r's output is wrong ('' when right)."""
    weights = mlp_weights(plan.seed, n, index, case)
    want = mlp_reference(weights)
    shape = tuple(want.shape)
    if call.output is None:
        return (f"rank {r}: returned {call.returned_type}; return the MLP's output, a tensor "
                f"of shape {shape}, the same on every rank.")
    got = call.output
    if tuple(got.shape) != shape:
        return (f"rank {r}: returned shape {tuple(got.shape)}, expected {shape} (the input's "
                "shape: the second Linear maps the hidden features back to D).")
    if not got.is_floating_point():
        return f"rank {r}: returned {got.dtype}; return the float32 output."
    if _close(got, want):
        return ""
    b2 = weights.b2.double()
    partial = mlp_partial(weights, case, n, r)
    guesses = [
        (want + (n - 1) * b2, n > 1,
         f"b2 is added {n} times: every rank added it before the all-reduce, which then "
         "summed the N copies. Add b2 once, after the all-reduce (or on one rank only)"),
        (want - b2, True, "b2 is missing: add the second bias, once, after the all-reduce"),
        (partial + b2, n > 1,
         "it is this rank's own term only, gelu(x W1_r^T + b1_r) W2_r^T + b2: the output is "
         "the SUM of every rank's term: all-reduce it (then add b2)"),
        (partial, n > 1,
         "it is this rank's own term only, gelu(x W1_r^T + b1_r) W2_r^T: all-reduce it, then "
         "add b2"),
        (mlp_reference(weights, approximate="tanh"), True,
         "it matches the tanh approximation of GELU: use the exact one, F.gelu(h) (what "
         "nn.GELU() does by default)"),
    ]
    hint = next((why for value, when, why in guesses if when and _close(got, value)), "")
    if hint:
        return f"rank {r}: {hint}."
    far = (~torch.isclose(got.double(), want, rtol=MLP_RTOL, atol=MLP_ATOL)).reshape(-1)
    i = int(far.nonzero()[0, 0])
    return (f"rank {r}: element {i} (flat) is {float(got.reshape(-1)[i]):.6g}, expected "
            f"{float(want.reshape(-1)[i]):.6g}: gelu(x W1^T + b1) W2^T + b2 of the unsplit "
            f"MLP (rtol = atol = {MLP_RTOL:g}).")


def _mlp_count_problem(n: int, case: MlpCase, calls: Sequence[_MlpCall]) -> str:
    """Exactly one all-reduce per rank (on more than one rank)."""
    if n == 1:
        return ""
    shape = (*case.batch, case.dim)
    for r, call in enumerate(calls):
        count = len(call.all_reduces)
        if count == 0:
            used = f" (it used {listed(sorted(set(call.others)))})" if call.others else ""
            return (f"rank {r}: the output is right, but it made no all-reduce{used}: the "
                    f"exercise is one dist.all_reduce of the output {shape}, this rank's term "
                    "of the sum, 2(N-1)/N of it sent per rank.")
        if count > 1:
            return (f"rank {r}: the output is right, but it made {count} all-reduces (of "
                    f"{listed(call.all_reduces)} element(s)): sum the terms with one all-reduce "
                    f"of the output {shape}: one collective, one latency, on the critical path "
                    "of every forward.")
    return ""


def _judge_mlp(plan: MlpPlan, n: int, results: Sequence[list[_MlpCall]]) -> str:
    for index, case in enumerate(plan.cases):
        calls = [per_rank[index] for per_rank in results]
        wrong = next((p for r, call in enumerate(calls)
                      if (p := _mlp_value_problem(plan, n, index, case, r, call))), "")
        wrong = wrong or _mlp_count_problem(n, case, calls)
        if wrong:
            return f"with {n} rank(s), {case.describe()}: {wrong}"
    return ""


def _mlp_error(plan: MlpPlan, n: int, err: RankError) -> str:
    named = failing_rank(err)
    if err.exc_type == "RankDied":
        return (f"with {n} rank(s), rank {named.rank} died. gloo ends a process when a message "
                "does not fit the buffer posted to receive it: every rank must all-reduce a "
                "tensor of the same shape, the (..., D) output, not the hidden activations, "
                "whose slices differ in size between ranks.")
    case = failed_case(named.traceback, plan.cases)
    where = f"with {n} rank(s), {case.describe()}" if case else f"with {n} rank(s)"
    return f"{where}: {raised(named)}"


def _mlp_timeout(n: int, err: LaunchTimeout, timeout: float, where: str) -> str:
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} hung for {timeout:g} s.{where} A "
            "rank waits forever in a collective that a peer never makes: every rank must make "
            "the same one all-reduce in every call, even a rank that holds no hidden feature.")


# --- the checks ------------------------------------------------------------------------------


def check_hierarchical_all_reduce_(
    hierarchical_all_reduce_: Callable[..., object],
    world_sizes: Sequence[int] = (1, 2, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 8.1: ``hierarchical_all_reduce_(tensor, node_group, cross_group)`` must leave
    in ``tensor`` (1-D, float32) the sum over every rank, in place, using labs' ring
    collectives over ``node_group`` (this rank's node: g consecutive ranks) and
    ``cross_group`` (this rank's local rank on every node), each rank sending at most
    2(n-1)/n of its chunk of S/g to other nodes. Every layout of each world size runs (all
    node sizes that divide it), for tensors of 7, 1 and 61 elements, compared exactly (integer
    inputs); torch's collectives are refused inside the check.

    A non-zero ``seed`` also runs 6 ranks in one layout (3 nodes of 2 or 2 of 3) and another
    tensor size, drawn from ``random.Random(seed)``; the verdict names them."""
    exercise = TopologyExercise.HIERARCHICAL_ALL_REDUCE
    validate_check_call(hierarchical_all_reduce_, world_sizes, seed, timeout,
                        example="check_hierarchical_all_reduce_(hierarchical_all_reduce_)")
    plan = HierPlan.make(world_sizes, seed)
    layouts = "; ".join(f"{n}: " + ", ".join(layout.describe() for layout in plan.layouts(n))
                        for n in plan.world_sizes if n != plan.drawn_world_size)
    return run_check(
        exercise.title, plan, timeout,
        worker=_hier_rank,
        args=lambda n: (hierarchical_all_reduce_, plan.layouts(n)),
        rank_args=lambda n: [([[hier_input(seed, layout, index, r, numel)
                                for index, numel in enumerate(plan.numels)]
                               for layout in plan.layouts(n)],) for r in range(n)],
        judge=lambda n, results: _judge_hier(plan, n, results),
        explain_error=lambda n, err: _hier_error(plan, n, err),
        explain_timeout=lambda n, err, where: _hier_timeout(n, err, timeout, where),
        passed=(f"on {listed(plan.world_sizes)} rank(s), in every layout ({layouts}), for "
                f"tensors of {listed(HIER_NUMELS)} element(s), every rank's tensor holds the "
                "sum over every rank, exactly (integer inputs: no rounding), and no rank sent "
                "more to other nodes than 2(n-1)/n of its chunk of S/g."),
        problem=signature_problem(exercise.function, exercise.parameters,
                                  hierarchical_all_reduce_),
    )


def check_tp_mlp_forward(
    tp_mlp_forward: Callable[..., object],
    world_sizes: Sequence[int] = (1, 2, 4),
    seed: int = 0,
    timeout: float = CHECK_TIMEOUT_S,
) -> CheckResult:
    """Exercise 8.2: ``tp_mlp_forward(x, w1, b1, w2, b2)``, with ``w1`` (h_r, D) and ``b1``
    (h_r,) this rank's rows of the first Linear, ``w2`` (D, h_r) its columns of the second and
    ``b2`` (D,) the whole second bias, must return ``gelu(x W1^T + b1) W2^T + b2`` of the
    unsplit MLP on every rank (rtol = atol = 1e-5), with exactly one all-reduce. The hidden
    features are cut as ``torch.tensor_split`` cuts them (uneven; a rank may hold none).

    A non-zero ``seed`` also runs 3 ranks and another MLP, drawn from ``random.Random(seed)``;
    the verdict names them."""
    exercise = TopologyExercise.TP_MLP_FORWARD
    validate_check_call(tp_mlp_forward, world_sizes, seed, timeout,
                        example="check_tp_mlp_forward(tp_mlp_forward)")
    plan = MlpPlan.make(world_sizes, seed)
    cases = "; ".join(case.describe() for case in plan.cases[:len(plan.cases) - len(plan.drawn)])
    return run_check(
        exercise.title, plan, timeout,
        worker=_mlp_rank,
        args=lambda n: (tp_mlp_forward,),
        rank_args=lambda n: [([rank_weights(mlp_weights(seed, n, index, case), case, n, r)
                               for index, case in enumerate(plan.cases)],) for r in range(n)],
        judge=lambda n, results: _judge_mlp(plan, n, results),
        explain_error=lambda n, err: _mlp_error(plan, n, err),
        explain_timeout=lambda n, err, where: _mlp_timeout(n, err, timeout, where),
        passed=(f"on {listed(plan.world_sizes)} rank(s), for {cases} (cut unevenly between "
                "the ranks), every rank returned gelu(x W1^T + b1) W2^T + b2 of the unsplit MLP "
                f"(rtol = atol = {MLP_RTOL:g}), with b2 added once and one all-reduce per "
                "rank."),
        problem=signature_problem(exercise.function, exercise.parameters, tp_mlp_forward),
    )
