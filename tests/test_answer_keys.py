"""Every exercise refuses the library's own solution of it, under any name, while its check runs
the learner's code; the list of answer keys is complete, and a correct solution still passes.

The table is a column of the exercise registry (held against the reference notebooks in
test_check_contract.py, which also refuses each exercise's keys through an alias taken before
the check and through importlib, gives them back afterwards, fails a check whose answer calls a
key and passes the notebooks' solutions). Here: every key is real and refusable, the refusal's
mechanics (threads, copies, nesting, subclasses), and the real checks, on real ranks, failing
the cheats a learner would write (the alias import, ``importlib.import_module("labs." +
"collectives")``, a subclass, a caught refusal) with a one-line verdict naming the key.
"""

import ast
import importlib
import inspect
import math  # noqa: F401  (chapter 7's setup: its solution, run into this module, uses it)
import sys
import textwrap
import threading
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import labs.checkpoint
import labs.ring_schedule
from labs.checks import (
    AnswerKeyUsed,
    check_average_gradients,
    check_hierarchical_all_reduce_,
    check_ring_all_reduce,
    check_shard_pieces,
    check_sharded_sgd_step,
    check_simple_ddp,
    check_tp_mlp_forward,
)
from labs.checks.answer_keys import (
    ANSWER_KEYS,
    LEARNER_FUNCTIONS,
    NOT_BY_SHAPE,
    SHAPE_MATCH,
    _long_codes,
    answer_key,
    answer_key_table,
    answer_keys_refused,
    fingerprint,
    likeness,
    refusal_message,
    refused_function,
    shape,
)
from labs.checks.core import answer_key_refusal
from labs.checks.exercises import EXERCISES
from labs.collectives import (  # noqa: F401  (chapter 8's setup: its solution is built on them)
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from labs.ddp import NaiveDDP
from labs.grading.handout import load_chapters
from labs.launcher import RankError, RankFailure
from labs.toy_allreduce import all_reduce_gradients_flat
from labs.zero import ShardedOptimizer

from solutions import NOTEBOOKS, send_by_value, solution

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

my_ring_all_reduce = solution("02_allreduce_algorithms.ipynb", "2.1", "my_ring_all_reduce",
                              globals())
shard_pieces = solution("07_fsdp_in_practice.ipynb", "7.2", "shard_pieces", globals())
hierarchical_all_reduce_ = solution("08_beyond_one_node.ipynb", "8.1", "hierarchical_all_reduce_",
                                    globals())
send_by_value(__name__)


# --- the table: every exercise, every key real --------------------------------------------------


def test_every_exercise_of_the_registry_has_answer_keys():
    assert list(ANSWER_KEYS) == list(LEARNER_FUNCTIONS) == [e.id for e in EXERCISES]
    assert all(ANSWER_KEYS.values())


def test_the_table_is_frozen():
    with pytest.raises(TypeError):
        ANSWER_KEYS["9.9"] = ("labs.collectives.ring_all_reduce",)  # type: ignore[index]


ALL_KEYS = sorted({key for keys in ANSWER_KEYS.values() for key in keys})


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_key_is_a_labs_object_whose_code_can_be_refused(key):
    obj = answer_key(key)
    assert callable(obj) or isinstance(obj, (classmethod, staticmethod)), key
    assert key.startswith("labs.")
    function = refused_function(key)
    assert isinstance(function, types.FunctionType)
    assert function.__module__.startswith("labs."), key


@pytest.mark.parametrize("exercise", [e.id for e in EXERCISES])
def test_no_two_keys_of_an_exercise_are_one_function(exercise):
    functions = [refused_function(key) for key in ANSWER_KEYS[exercise]]
    assert len({id(f) for f in functions}) == len(functions)


def test_the_appendix_table_lists_every_exercise_function_and_key():
    table = answer_key_table()
    lines = table.splitlines()
    assert lines[0].split() == ["exercise", "learner's", "function", "answer", "keys"]
    assert len(lines) == 2 + sum(len(keys) for keys in ANSWER_KEYS.values())
    for exercise, keys in ANSWER_KEYS.items():
        assert any(line.split()[:2] == [exercise, LEARNER_FUNCTIONS[exercise]] for line in lines)
        for key in keys:
            assert any(line.split()[-1] == key for line in lines), key


def test_an_unknown_exercise_is_refused():
    with pytest.raises(ValueError, match="no exercise '0.1' has answer keys"):
        with answer_keys_refused("0.1"):
            pass


# --- refusing them (each exercise's keys, under any name: test_check_contract.py) ---------------


def test_other_exercises_keys_stay_allowed():
    with answer_keys_refused("8.1"):
        for key in ("labs.collectives.ring_reduce_scatter", "labs.collectives.ring_all_reduce",
                    "labs.collectives.ring_all_gather"):  # 8.1 is built from labs' rings
            assert refused_function(key).__code__.co_filename.endswith("collectives.py")
        assert labs.checkpoint.shard_pieces(10, 4, 2, 0) == [(0, 0, 3), (1, 0, 2)]


def test_the_key_works_again_after_the_scope():
    with pytest.raises(AnswerKeyUsed):
        with answer_keys_refused("7.2"):
            labs.checkpoint.shard_pieces(10, 4, 2, 0)
    assert labs.checkpoint.shard_pieces(10, 4, 2, 0) == shard_pieces(10, 4, 2, 0)


def test_a_caught_refusal_still_fails_when_the_scope_ends():
    with pytest.raises(AnswerKeyUsed, match="`labs.checkpoint.shard_pieces` is its answer key"):
        with answer_keys_refused("7.2"):
            try:
                labs.checkpoint.shard_pieces(10, 4, 2, 0)
            except AnswerKeyUsed:
                pass  # the learner hides it ...


def test_a_caught_refusal_wins_over_the_error_that_followed_it():
    with pytest.raises(AnswerKeyUsed) as refused:
        with answer_keys_refused("7.2"):
            try:
                labs.checkpoint.shard_pieces(10, 4, 2, 0)
            except RuntimeError:
                raise ValueError("something else") from None
    assert isinstance(refused.value.__cause__, ValueError)


def _the_key(source: str) -> object:
    return labs.checkpoint.shard_pieces


def _a_copy(source: str) -> object:
    return _copy_of(labs.checkpoint.shard_pieces, source)


@pytest.mark.parametrize("made", [_the_key, _a_copy], ids=["the key", "a copy made in it"])
def test_a_refusal_in_another_thread_is_recorded(made):
    # Inside a scope, getsource reads the refusal's own lines: the key's are read before it.
    source = inspect.getsource(labs.checkpoint.shard_pieces)

    def call() -> None:
        try:
            made(source)(10, 4, 2, 0)
        except AnswerKeyUsed:
            pass

    with pytest.raises(AnswerKeyUsed, match="exercise 7.2"):
        with answer_keys_refused("7.2"):
            thread = threading.Thread(target=call)
            thread.start()
            thread.join()


def test_an_error_without_a_refusal_passes_through_and_the_code_comes_back():
    code = refused_function("labs.checkpoint.shard_pieces").__code__
    with pytest.raises(KeyError, match="mine"):
        with answer_keys_refused("7.2"):
            raise KeyError("mine")
    assert refused_function("labs.checkpoint.shard_pieces").__code__ is code


def _copy_of(function: types.FunctionType, source: str = "") -> types.FunctionType:
    """What ``exec(inspect.getsource(key))`` gives a learner: a new function of the key's code
    (inside a scope, getsource reads the refusal's own lines: pass the key's ``source``)."""
    namespace = dict(vars(importlib.import_module(function.__module__)))
    exec(textwrap.dedent(source or inspect.getsource(function)), namespace)
    return namespace[function.__name__]


def test_a_copy_of_a_key_is_refused_however_it_was_made():
    by_source = _copy_of(labs.checkpoint.shard_pieces)
    original = labs.checkpoint.shard_pieces
    by_code = types.FunctionType(original.__code__, original.__globals__, "mine")
    assert by_source(10, 4, 2, 0) == [(0, 0, 3), (1, 0, 2)]
    for copy in (by_source, by_code):
        with pytest.raises(AnswerKeyUsed, match="`labs.checkpoint.shard_pieces`"):
            with answer_keys_refused("7.2"):
                copy(10, 4, 2, 0)
    assert by_source(10, 4, 2, 0) == [(0, 0, 3), (1, 0, 2)]  # the watch is gone after it
    assert sys.getprofile() is None


class _Reshape(ast.NodeTransformer):
    """What a learner does to a key's source so that no fingerprint knows it: every local
    name renamed, the docstring dropped, a dead statement after every third one."""

    def __init__(self, local: set[str]) -> None:
        self.local = local

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id in self.local:
            node.id = f"my_{node.id}"
        return node

    def visit_arg(self, node: ast.arg) -> ast.arg:
        node.arg = f"my_{node.arg}"
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and all(isinstance(b, ast.stmt) for b in body):
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:] or [ast.Pass()]
            padded: list[ast.stmt] = []
            for i, statement in enumerate(body):
                padded.append(statement)
                if i % 3 == 2:
                    padded.append(ast.parse("my_unused = len('padding')").body[0])
            node.body = padded
        return node


def _reshaped(function: types.FunctionType) -> types.FunctionType:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
             and isinstance(n.ctx, ast.Store)} | {a.arg for a in ast.walk(tree)
                                                 if isinstance(a, ast.arg)}
    tree = ast.fix_missing_locations(_Reshape(local).visit(tree))
    namespace = dict(vars(importlib.import_module(function.__module__)))
    exec(compile(tree, "<a learner's cell>", "exec"), namespace)
    return namespace[function.__name__]


def test_a_key_renamed_and_reshaped_is_refused_by_its_shape():
    """labs' ring renamed and reshaped passed exercise 2.1: no fingerprint knew it."""
    key = labs.ring_schedule.compile_pipelined
    copy = _reshaped(key)
    assert fingerprint(copy.__code__) != fingerprint(key.__code__)
    alike = likeness(shape(copy.__code__), shape(key.__code__))
    assert SHAPE_MATCH < alike < 1, alike
    with pytest.raises(AnswerKeyUsed, match="has the shape of `labs.ring_schedule."
                                            "compile_pipelined`"):
        with answer_keys_refused("2.1"):
            copy(None, None, [], 1, 1, None)  # refused as it starts


def _closest(exercise: str, key: str) -> float:
    """The share of ``key``'s shape the book's answer to ``exercise`` has (its closest code)."""
    chapter = next(c for c in load_chapters(NOTEBOOKS) if any(
        e.exercise == exercise for e in c.exercises))
    answers = [shape(code) for source in chapter.sources(chapter.exercise(exercise).solutions)
               for code in _long_codes(compile(source, "<answer>", "exec"))]
    return max((likeness(a, shape(k)) for a in answers
                for k in _long_codes(refused_function(key).__code__)), default=0.0)


@pytest.mark.parametrize("exercise", list(ANSWER_KEYS))
def test_the_books_answers_are_far_from_every_key_compared_by_shape(exercise):
    """The margin the shape rule leaves right answers: a fifth of a key's shape at most,
    against the half that makes a copy; the keys a right answer is written like are not
    compared by shape, and each of them is one (the list stays as short as it can)."""
    for key in ANSWER_KEYS[exercise]:
        closest = _closest(exercise, key)
        if key in NOT_BY_SHAPE:
            assert closest > 0.3 or any(_closest(e, key) > 0.3 for e, keys in
                                        ANSWER_KEYS.items() if key in keys), key
        else:
            assert closest < 0.2, (key, closest)


def test_scopes_nest():
    code = refused_function("labs.collectives.ring_all_reduce").__code__
    with answer_keys_refused("2.1"), answer_keys_refused("4.2"):
        assert refused_function("labs.collectives.ring_all_reduce").__code__ is not code
    assert refused_function("labs.collectives.ring_all_reduce").__code__ is code


def test_a_refused_class_refuses_its_subclasses_and_keeps_its_free_variables():
    class Mine(NaiveDDP):  # a learner's "own" wrapper
        pass

    init = NaiveDDP.__init__
    assert init.__code__.co_freevars == ("__class__",)  # super(): a closure cell to keep
    with pytest.raises(AnswerKeyUsed, match="`labs.ddp.NaiveDDP` is its answer key"):
        with answer_keys_refused("5.1"):
            Mine(nn.Linear(2, 2))
    assert NaiveDDP.__init__ is init and init.__code__.co_freevars == ("__class__",)


def test_the_verdict_names_a_refused_rank_even_when_another_failed_first():
    def failure(rank: int, exc_type: str, message: str, when: float) -> RankFailure:
        return RankFailure(rank, exc_type, message, "Traceback ...", when)

    refusal = refusal_message("2.1", "labs.collectives.ring_all_reduce")
    err = RankError(failure(0, "KeyError", "'my_bug'", 1.0),
                    [failure(2, "AnswerKeyUsed", refusal, 2.0),
                     failure(1, "AnswerKeyUsed", refusal + "\nmore", 3.0)])
    assert answer_key_refusal(err) == refusal
    assert answer_key_refusal(RankError(failure(0, "KeyError", "'my_bug'", 1.0), [])) == ""


# --- end to end: the real checks on real ranks -------------------------------------------------


def alias_import(tensor):
    from labs.collectives import ring_all_reduce as mine

    mine(tensor)


def importlib_import(tensor):
    importlib.import_module("labs." + "collectives").ring_all_reduce(tensor)


def hides_the_refusal(tensor):
    try:
        ring_all_reduce(tensor)
    except Exception:
        my_ring_all_reduce(tensor)  # ... and does the work after all: still refused


def refused_on_rank_zero_only(tensor):
    if dist.get_rank() == 1:
        raise KeyError("my_bug")
    ring_all_reduce(tensor)


def composed_from_labs_halves(tensor):
    shard = importlib.import_module("labs.collectives").ring_reduce_scatter(tensor)
    tensor.copy_(ring_all_gather(shard, numel=tensor.numel()).view_as(tensor))


# Copied before the check starts (at import, in every rank too): the refusal of
# ring_all_reduce's own code cannot reach this copy, the refusal of the ring engine it runs does.
copied = types.FunctionType(ring_all_reduce.__code__, ring_all_reduce.__globals__, "copied",
                            ring_all_reduce.__defaults__, ring_all_reduce.__closure__)
copied.__kwdefaults__ = ring_all_reduce.__kwdefaults__


def copies_the_code(tensor):
    copied(tensor)


ALL_REDUCE_REFUSED = ("FAIL: Exercise 2.1 ring_all_reduce: "
                      + refusal_message("2.1", "labs.collectives.ring_all_reduce"))


@pytest.mark.parametrize("cheat", [alias_import, importlib_import, hides_the_refusal,
                                   ring_all_reduce])
def test_check_2_1_fails_labs_ring_all_reduce_however_it_is_reached(cheat, capsys):
    result = check_ring_all_reduce(cheat, world_sizes=(1, 2))
    assert not result.passed
    assert str(result) == ALL_REDUCE_REFUSED
    assert capsys.readouterr().out == ALL_REDUCE_REFUSED + "\n"


def test_check_2_1_fails_the_composed_halves_of_labs():
    result = check_ring_all_reduce(composed_from_labs_halves, world_sizes=(2,))
    assert str(result) == ("FAIL: Exercise 2.1 ring_all_reduce: "
                           + refusal_message("2.1", "labs.collectives.ring_reduce_scatter"))


def test_check_2_1_fails_a_copy_of_labs_code_made_before_it():
    result = check_ring_all_reduce(copies_the_code, world_sizes=(2,))
    assert str(result) == ("FAIL: Exercise 2.1 ring_all_reduce: "
                           + refusal_message("2.1", "labs.collectives.ring_all_reduce"))


def test_check_2_1_names_the_refusal_the_same_way_every_run():
    verdicts = {str(check_ring_all_reduce(refused_on_rank_zero_only, world_sizes=(2,)))
                for _ in range(2)}
    assert verdicts == {ALL_REDUCE_REFUSED}


@pytest.mark.slow  # the contract: the reference of 2.1, with a seed
def test_check_2_1_passes_the_notebooks_solution():
    result = check_ring_all_reduce(my_ring_all_reduce, world_sizes=(1, 3))
    assert result.passed, result.message


def pieces_from_labs(numel, saved_world_size, world_size, rank):
    return labs.checkpoint.shard_pieces(numel, saved_world_size, world_size, rank)


@pytest.mark.slow  # the contract: 7.2's first key, in its rank, and given back
def test_check_7_2_fails_labs_shard_pieces_in_its_rank():
    result = check_shard_pieces(pieces_from_labs)
    assert str(result) == ("FAIL: Exercise 7.2 shard_pieces: "
                           + refusal_message("7.2", "labs.checkpoint.shard_pieces"))
    # the refusal lives in the check's rank: the learner's own process keeps labs' function
    assert labs.checkpoint.shard_pieces(10, 4, 2, 0) == [(0, 0, 3), (1, 0, 2)]


@pytest.mark.slow  # the contract: the reference of 7.2, with a seed
def test_check_7_2_passes_the_notebooks_solution():
    assert check_shard_pieces(shard_pieces).passed


def hierarchical_from_labs(tensor, node_group, cross_group):
    importlib.import_module("labs.collectives").hierarchical_all_reduce(
        tensor, dist.get_world_size(node_group))


@pytest.mark.slow  # the contract: 8.1's key (through importlib), refused
def test_check_8_1_fails_labs_hierarchical_all_reduce():
    result = check_hierarchical_all_reduce_(hierarchical_from_labs, world_sizes=(1, 2))
    assert str(result) == ("FAIL: Exercise 8.1 hierarchical_all_reduce_: "
                           + refusal_message("8.1", "labs.collectives.hierarchical_all_reduce"))


@pytest.mark.slow  # the contract: the reference of 8.1 (built on labs' rings), with a seed
def test_check_8_1_passes_the_notebooks_solution_built_on_labs_rings():
    result = check_hierarchical_all_reduce_(hierarchical_all_reduce_, world_sizes=(1, 2))
    assert result.passed, result.message


def average_with_labs(model):
    all_reduce_gradients_flat(model)


@pytest.mark.slow  # the contract: 1.1's first key, refused
def test_check_1_1_fails_labs_flat_all_reduce():
    result = check_average_gradients(average_with_labs, world_sizes=(2,))
    assert str(result) == ("FAIL: Exercise 1.1 average_gradients: " + refusal_message(
        "1.1", "labs.toy_allreduce.all_reduce_gradients_flat"))


class SubclassOfNaiveDDP(NaiveDDP):
    """A learner's SimpleDDP that is labs' NaiveDDP under another name."""


def test_check_5_1_fails_a_subclass_of_labs_naive_ddp():
    result = check_simple_ddp(SubclassOfNaiveDDP, world_sizes=(1,))
    assert str(result) == ("FAIL: Exercise 5.1 SimpleDDP: "
                           + refusal_message("5.1", "labs.ddp.NaiveDDP"))


def step_with_labs_optimizer(params, momentum_shards, lr, beta):
    ShardedOptimizer(params, torch.optim.SGD, lr=lr, momentum=beta).step()


@pytest.mark.slow  # the contract: 6.1's first key, a class, refused at construction
def test_check_6_1_fails_labs_sharded_optimizer():
    result = check_sharded_sgd_step(step_with_labs_optimizer, world_sizes=(1,))
    assert str(result) == ("FAIL: Exercise 6.1 sharded_sgd_step: "
                           + refusal_message("6.1", "labs.zero.ShardedOptimizer"))


def mlp_with_labs_row_parallel(x, w1, b1, w2, b2):
    row = importlib.import_module("labs.tensor_parallel").RowParallelLinear
    held = types.SimpleNamespace(weight=w2, bias=b2, group=None, log=None,
                                 algorithm=importlib.import_module("labs.collectives")
                                 .Algorithm.TORCH)
    return row.forward(held, torch.nn.functional.gelu(x @ w1.T + b1))


def test_check_8_2_fails_labs_row_parallel_forward_with_a_borrowed_self():
    result = check_tp_mlp_forward(mlp_with_labs_row_parallel, world_sizes=(1,))
    assert str(result) == ("FAIL: Exercise 8.2 tp_mlp_forward: " + refusal_message(
        "8.2", "labs.tensor_parallel.RowParallelLinear.forward"))
