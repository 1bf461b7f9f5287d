"""The book's exercises, one row each: where it is, what the learner writes, which check runs
it, what that check refuses, and where its hidden cases are drawn.

Everything that lists the exercises reads this table: the checks' public names
(``from labs.checks import check_ring_all_reduce``), the answer keys and the learners'
function names (:data:`labs.checks.answer_keys.ANSWER_KEYS`, ``LEARNER_FUNCTIONS``, the
appendix's table), each check's title and the signature it holds the learner's code to, and
the tests' parametrizations (the check contract, the grading tests, the answer keys). A test
holds it against the notebooks: every cell tagged ``exercise-N.M`` has a row, and every row
has its tagged cells in its chapter.

The table is data only, and sits below every module of :mod:`labs.checks` (the check modules
read their titles and signatures from it), so it names checks and answer keys by dotted path,
as :mod:`labs.checks.answer_keys` names its keys: :meth:`ExerciseSpec.check_function` imports a
check when asked for it.
"""

from __future__ import annotations

import enum
import importlib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class Form(enum.Enum):
    """What the learner writes for an exercise, as the check takes it."""

    #: A function; the check calls it with :attr:`ExerciseSpec.parameters`.
    FUNCTION = "function"
    #: A class; the check builds it with :attr:`ExerciseSpec.parameters` and calls its methods.
    CLASS = "class"


@dataclass(frozen=True)
class ExerciseSpec:
    """One exercise of the book."""

    id: str
    """``"2.1"``: its notebook's cells carry the tag ``exercise-2.1``."""
    notebook: str
    """The stem of its chapter: ``notebooks/<notebook>.md``, paired with ``.ipynb``."""
    learner_name: str
    """The name the chapter's check cell passes to the check: what the learner writes."""
    function: str
    """The name the check's verdicts and messages give it (its title: ``Exercise 2.1
    ring_all_reduce``); the learner's own name may differ (``my_ring_all_reduce``)."""
    parameters: tuple[str, ...]
    """How the check calls it (a class: builds it), positionally."""
    check: str
    """The name of its check, importable from :mod:`labs.checks`."""
    module: str
    """The module that defines the check."""
    answer_keys: tuple[str, ...]
    """The dotted paths of the ``labs`` objects that solve it, refused while its check runs
    the learner's code (:mod:`labs.checks.answer_keys`): functions, classes (refused at
    construction) and methods."""
    hidden_cases: str
    """The dotted path of the plan whose ``make`` draws what a non-zero seed adds (a
    :class:`labs.checks.core.CheckPlan`)."""
    form: Form = Form.FUNCTION

    @property
    def title(self) -> str:
        """What its verdicts start with, after PASS or FAIL: ``Exercise 2.1 ring_all_reduce``."""
        return f"Exercise {self.id} {self.function}"

    @property
    def signature(self) -> str:
        """``ring_all_reduce(tensor)``."""
        return f"{self.function}({', '.join(self.parameters)})"

    @property
    def tag(self) -> str:
        """The cell tag of its solution and check cells."""
        return f"exercise-{self.id}"

    def check_function(self) -> Callable[..., Any]:
        """The check itself, imported from :attr:`module`."""
        return getattr(importlib.import_module(self.module), self.check)


class ExerciseRow:
    """What an Enum of one chapter's exercises (its values are the ids, ``"9.1"``) reads from
    its row of the table: mix it in before ``enum.Enum``."""

    value: str

    @property
    def function(self) -> str:
        return spec(self.value).function

    @property
    def parameters(self) -> tuple[str, ...]:
        return spec(self.value).parameters

    @property
    def title(self) -> str:
        return spec(self.value).title


# --- the answer keys several exercises share ------------------------------------------------

#: labs' all-reduces, each one exercise 2.1's answer (and 4.2's).
_ALL_REDUCES = (
    "labs.collectives.ring_all_reduce",
    "labs.collectives.all_reduce",
    "labs.collectives.naive_all_reduce",
    "labs.collectives.whole_tensor_ring_all_reduce",
    "labs.collectives.recursive_doubling_all_reduce",
    "labs.collectives.hierarchical_all_reduce",
)
#: labs' ring engine, which runs the steps of any of its rings, and the builders of those
#: steps: refused with the rings in chapters 2-4, so that the parts of labs' rings do not
#: assemble one either.
_RING_ENGINE = ("labs.ring_schedule.run_ring", "labs.ring_schedule.execute",
                "labs.ring_schedule.run_lockstep", "labs.ring_schedule.compile_pipelined",
                "labs.collectives._reduce_scatter_steps", "labs.collectives._all_gather_steps")
#: labs' reduce-scatters (exercise 3.1).
_REDUCE_SCATTERS = ("labs.collectives.ring_reduce_scatter", "labs.collectives.reduce_scatter")
#: labs' all-gathers (exercise 4.1).
_ALL_GATHERS = ("labs.collectives.ring_all_gather", "labs.collectives.all_gather")
#: Chapter 5's wrappers with what they are made of: the broadcast at construction and the
#: averaging after backward (one flat all-reduce in chapter 1 does it as well).
_NAIVE_DDP = (
    "labs.ddp.NaiveDDP",
    "labs.ddp.NaiveDDP.finish_gradient_synchronization",
    "labs.ddp.broadcast_state",
    "labs.toy_allreduce.all_reduce_gradients_flat",
)
_BUCKETED_DDP = (
    "labs.ddp.DDP",
    "labs.ddp.DDP.finish_gradient_synchronization",
    "labs.ddp.assign_buckets",
    "labs.ddp.broadcast_state",
)


# --- the table ---------------------------------------------------------------------------------

#: Every exercise of the book, in the book's order. Chapters 2-4 ask for a collective from
#: point-to-point messages, so an all-reduce (2.1, 4.2) refuses the two halves too, which make
#: one (chapter 4), and each refuses labs' ring engine. Three keys are private methods,
#: because that is where labs keeps the step the exercise asks for: ZeRO's gradient
#: reduce-scatter (6.3), its stage-2 hook (6.4) and FSDP's post-backward reduce-scatter (6.5).
#: 8.1 is built from labs' rings, so the rings stay allowed there, and point-to-point sends
#: are allowed everywhere.
EXERCISES: tuple[ExerciseSpec, ...] = (
    ExerciseSpec(
        "1.1", "01_toy_allreduce", "average_gradients", "average_gradients", ("model",),
        "check_average_gradients", "labs.checks.toy",
        ("labs.toy_allreduce.all_reduce_gradients_flat", "labs.ddp.NaiveDDP",
         "labs.ddp.NaiveDDP.finish_gradient_synchronization"),
        "labs.checks.toy.AveragePlan"),
    ExerciseSpec(
        "2.1", "02_allreduce_algorithms", "my_ring_all_reduce", "ring_all_reduce", ("tensor",),
        "check_ring_all_reduce", "labs.checks.collectives",
        _ALL_REDUCES + _REDUCE_SCATTERS + _ALL_GATHERS + _RING_ENGINE,
        "labs.checks.collectives_cases.Plan"),
    ExerciseSpec(
        "3.1", "03_reduce_scatter", "ring_reduce_scatter", "ring_reduce_scatter", ("tensor",),
        "check_ring_reduce_scatter", "labs.checks.collectives",
        _REDUCE_SCATTERS + _RING_ENGINE,
        "labs.checks.collectives_cases.Plan"),
    ExerciseSpec(
        "4.1", "04_all_gather", "ring_all_gather", "ring_all_gather", ("shard", "numel"),
        "check_ring_all_gather", "labs.checks.collectives",
        _ALL_GATHERS + _RING_ENGINE,
        "labs.checks.collectives_cases.Plan"),
    ExerciseSpec(
        "4.2", "04_all_gather", "all_reduce", "all_reduce", ("tensor",),
        "check_composed_all_reduce", "labs.checks.collectives",
        _ALL_REDUCES + _REDUCE_SCATTERS + _ALL_GATHERS + _RING_ENGINE,
        "labs.checks.collectives_cases.Plan"),
    ExerciseSpec(
        "5.1", "05_ddp", "SimpleDDP", "SimpleDDP", ("module",),
        "check_simple_ddp", "labs.checks.ddp",
        _NAIVE_DDP + ("labs.ddp.DDP", "labs.ddp.DDP.finish_gradient_synchronization"),
        "labs.checks.ddp_cases.Plan", Form.CLASS),
    ExerciseSpec(
        "5.2", "05_ddp", "BucketedDDP", "BucketedDDP", ("module", "bucket_cap_mb"),
        "check_bucketed_ddp", "labs.checks.ddp",
        _BUCKETED_DDP,
        "labs.checks.ddp_cases.Plan", Form.CLASS),
    ExerciseSpec(
        "5.3", "05_ddp", "crossover_batch", "crossover_batch",
        ("alpha", "bandwidth", "model_bytes", "world_size", "per_sample_s", "fixed_s"),
        "check_crossover_batch", "labs.checks.scaling",
        ("labs.cost_model.crossover_batch",),
        "labs.checks.scaling_cases.CrossoverPlan"),
    ExerciseSpec(
        "6.1", "06_zero_fsdp", "sharded_sgd_step", "sharded_sgd_step",
        ("params", "momentum_shards", "lr", "beta"),
        "check_sharded_sgd_step", "labs.checks.zero",
        ("labs.zero.ShardedOptimizer", "labs.zero.ShardedOptimizer.step"),
        "labs.checks.zero_cases.Plan"),
    ExerciseSpec(
        "6.2", "06_zero_fsdp", "fsdp_linear_forward", "fsdp_linear_forward",
        ("shard", "in_features", "out_features", "x"),
        "check_fsdp_linear_forward", "labs.checks.zero",
        ("labs.fsdp.FSDP", "labs.fsdp.FSDP.unshard", "labs.fsdp.FSDP.reshard"),
        "labs.checks.zero_cases.Plan"),
    ExerciseSpec(
        "6.3", "06_zero_fsdp", "reduce_scatter_grad", "reduce_scatter_grad", ("grad",),
        "check_reduce_scatter_grad", "labs.checks.zero",
        ("labs.zero.ShardedOptimizer._reduce_scatter",),
        "labs.checks.zero_cases.Plan"),
    ExerciseSpec(
        "6.4", "06_zero_fsdp", "zero2_grad_hook", "zero2_grad_hook", ("param", "grad_shards"),
        "check_zero2_grad_hook", "labs.checks.zero_grad",
        ("labs.zero.ShardedOptimizer", "labs.zero.ShardedOptimizer._reduce_now",
         "labs.zero.ShardedOptimizer._reduce_scatter"),
        "labs.checks.zero_grad_cases.GradPlan"),
    ExerciseSpec(
        "6.5", "06_zero_fsdp", "fsdp_linear_backward", "fsdp_linear_backward",
        ("shard", "in_features", "out_features", "x", "grad_out"),
        "check_fsdp_linear_backward", "labs.checks.zero_grad",
        ("labs.fsdp.FSDP", "labs.fsdp.FSDP.unshard", "labs.fsdp.FSDP.reshard",
         "labs.fsdp.FSDP._post_backward"),
        "labs.checks.zero_grad_cases.GradPlan"),
    ExerciseSpec(
        "7.1", "07_fsdp_in_practice", "clip_shards_", "clip_shards_", ("grads", "max_norm"),
        "check_clip_shards_", "labs.checks.fsdp_practice",
        ("labs.fsdp.FSDP", "labs.fsdp.FSDP.clip_grad_norm_"),
        "labs.checks.fsdp_practice_cases.ClipPlan"),
    ExerciseSpec(
        "7.2", "07_fsdp_in_practice", "shard_pieces", "shard_pieces",
        ("numel", "saved_world_size", "world_size", "rank"),
        "check_shard_pieces", "labs.checks.checkpoint",
        ("labs.checkpoint.shard_pieces",),
        "labs.checks.fsdp_practice_cases.PiecesPlan"),
    ExerciseSpec(
        "7.3", "07_fsdp_in_practice", "units_to_prefetch", "units_to_prefetch",
        ("order", "current", "prefetch"),
        "check_units_to_prefetch", "labs.checks.prefetch",
        ("labs.fsdp.units_to_prefetch",),
        "labs.checks.fsdp_practice_cases.PrefetchPlan"),
    ExerciseSpec(
        "8.1", "08_beyond_one_node", "hierarchical_all_reduce_", "hierarchical_all_reduce_",
        ("tensor", "node_group", "cross_group"),
        "check_hierarchical_all_reduce_", "labs.checks.topology",
        ("labs.collectives.hierarchical_all_reduce",),
        "labs.checks.topology_cases.HierPlan"),
    ExerciseSpec(
        "8.2", "08_beyond_one_node", "tp_mlp_forward", "tp_mlp_forward",
        ("x", "w1", "b1", "w2", "b2"),
        "check_tp_mlp_forward", "labs.checks.topology",
        ("labs.tensor_parallel.ParallelMLP", "labs.tensor_parallel.ParallelMLP.forward",
         "labs.tensor_parallel.ColumnParallelLinear",
         "labs.tensor_parallel.ColumnParallelLinear.forward",
         "labs.tensor_parallel.RowParallelLinear",
         "labs.tensor_parallel.RowParallelLinear.forward"),
        "labs.checks.topology_cases.MlpPlan"),
    ExerciseSpec(
        "9.1", "09_when_it_goes_wrong", "find_desync", "find_desync", ("logs",),
        "check_find_desync", "labs.checks.faults",
        ("labs.experiments.faults.first_desync",),
        "labs.checks.faults_cases.DesyncPlan"),
    ExerciseSpec(
        "9.2", "09_when_it_goes_wrong", "join_step", "join_step", ("model", "batch", "lr"),
        "check_join_step", "labs.checks.faults",
        ("labs.ddp.DDP", "labs.ddp.DDP.join"),
        "labs.checks.faults_cases.JoinPlan"),
)

#: Exercise id -> its row.
BY_ID: Mapping[str, ExerciseSpec] = types.MappingProxyType({e.id: e for e in EXERCISES})


def spec(exercise_id: str) -> ExerciseSpec:
    """The row of exercise ``exercise_id`` (``"2.1"``); KeyError naming the known ones."""
    try:
        return BY_ID[exercise_id]
    except KeyError:
        known = ", ".join(BY_ID)
        raise KeyError(f"no exercise {exercise_id!r}; the exercises are {known}.") from None
