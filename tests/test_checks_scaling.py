"""The check of chapter 5's exercise 5.3 (the per-rank batch above which N ranks of data
parallelism train faster than one, a pure function called in one rank of its own) passes right
answers and fails each usual wrong formula with its reason.

First the cases and the reference (against the chapter's own answer,
:func:`labs.cost_model.crossover_batch`), then right answers (the book's, and others), then the
wrong formulas, each with its hint, then what is not a number, a call that raises or never
returns, the hidden cases of a seed and the refusal of labs' answer. What every check does alike
(the reference passes with a seed, wrong arguments are refused before any rank starts, the
hang verdict, the answer keys under any name) is tested once, over the exercise registry, in
test_check_contract.py.
"""

import importlib
import math
import os
import threading
from fractions import Fraction
from functools import partial

import numpy as np
import pytest
import torch

import labs.cost_model
from labs.checks import check_crossover_batch
from labs.checks.answer_keys import refusal_message
from labs.checks.scaling import _as_number
from labs.checks.scaling_cases import (
    ATOL,
    CROSSOVER_CASES,
    MISTAKES,
    RTOL,
    CrossoverCase,
    CrossoverPlan,
    Formula,
    expected_crossover,
)

from solutions import send_by_value, solution

pytestmark = pytest.mark.usefixtures("no_leftover_processes")
send_by_value(__name__)

TITLE = "Exercise 5.3 crossover_batch"
#: The documented cases, as the verdict names them.
N2 = ("alpha = 1e-05 s, bandwidth = 1e+10 B/s, model_bytes = 4e+08 B, world_size = 2, "
      "per_sample_s = 0.001 s, fixed_s = 0.005 s (S/bw dominates)")
N4 = ("alpha = 1e-05 s, bandwidth = 1e+10 B/s, model_bytes = 4e+08 B, world_size = 4, "
      "per_sample_s = 0.001 s, fixed_s = 0.005 s")
FIXED_WINS = ("alpha = 1e-05 s, bandwidth = 1e+10 B/s, model_bytes = 4e+08 B, world_size = 8, "
              "per_sample_s = 0.001 s, fixed_s = 0.02 s (the fixed cost outlasts the "
              "all-reduce's share)")
ALPHA_ZERO = ("alpha = 0 s, bandwidth = 5e+10 B/s, model_bytes = 2e+09 B, world_size = 4, "
              "per_sample_s = 0.0005 s, fixed_s = 0.001 s (alpha = 0)")
PASSED = (
    f"PASS: {TITLE}: on N = 2, 4, 8 and 16 ranks, where S/bw dominates and where alpha does, with "
    "alpha = 0, and with a fixed cost that outlasts the all-reduce (b* = 0), every answer is the "
    "per-rank batch b* above which N ranks' N b / (T1 + R) samples per second beat one rank's "
    "b / T1 (T1 = c b + f, R = 2(N-1)(alpha + S/(N bw)), the ring all-reduce after backward), "
    "within rtol = 1e-06 (atol = 1e-09).")


# --- the cases and the reference -----------------------------------------------------------------


def test_the_reference_is_the_chapters_answer():
    drawn = (c for seed in range(1, 201) for c in CrossoverPlan.make(seed).drawn)
    cases = [*CROSSOVER_CASES, *drawn]
    for case in cases:
        assert expected_crossover(case) == pytest.approx(
            labs.cost_model.crossover_batch(*case.arguments), rel=1e-12, abs=1e-12), case


def test_the_reference_is_where_the_throughputs_meet():
    for case in CROSSOVER_CASES:
        b = expected_crossover(case)
        one = lambda b, case=case: b / (case.per_sample_s * b + case.fixed_s)  # noqa: E731
        many = lambda b, case=case: case.world_size * b / (  # noqa: E731
            case.per_sample_s * b + case.fixed_s + case.allreduce_s)
        if b > 0:
            assert many(b) == pytest.approx(one(b), rel=1e-12)
            assert many(0.9 * b) < one(0.9 * b) and many(1.1 * b) > one(1.1 * b)
        else:  # N ranks are faster at every batch
            assert all(many(x) > one(x) for x in (1e-3, 1.0, 1e3))


def test_the_documented_cases_are_the_ones_that_separate_the_formulas():
    assert {2, 4, 8} <= {c.world_size for c in CROSSOVER_CASES}
    assert any(expected_crossover(c) == 0 for c in CROSSOVER_CASES)  # f outlasts R / (N-1)
    assert any(c.alpha == 0 for c in CROSSOVER_CASES)
    bandwidth_terms = [(2 * c.alpha, 2 * c.model_bytes / (c.world_size * c.bandwidth))
                       for c in CROSSOVER_CASES]
    assert any(latency > 10 * bw for latency, bw in bandwidth_terms)  # alpha dominates
    assert any(bw > 10 * latency for latency, bw in bandwidth_terms)  # S/bw dominates
    for mistake in MISTAKES:  # each wrong formula fails at least one documented case
        assert any(not math.isclose(mistake.value(c), expected_crossover(c), rel_tol=RTOL,
                                    abs_tol=ATOL) for c in CROSSOVER_CASES), mistake
    two_rank = (Formula.WHOLE_BANDWIDTH, Formula.RING_BYTES, Formula.WHOLE_ALLREDUCE)
    for case in CROSSOVER_CASES:  # ... and the two-rank forms are right at N = 2
        if case.world_size == 2:
            assert all(f.value(case) == pytest.approx(expected_crossover(case)) for f in two_rank)
    assert Formula.RIGHT.value(CROSSOVER_CASES[0]) == expected_crossover(CROSSOVER_CASES[0])


# --- right answers -------------------------------------------------------------------------------


def book_answer():
    """The chapter's solution cell, run into this module."""
    return solution("05_ddp.ipynb", "5.3", "crossover_batch", globals())


def test_the_books_answer_passes_with_the_documented_verdict(capsys):
    result = check_crossover_batch(book_answer())
    assert str(result) == PASSED  # what the chapter's check cell shows, which nbval compares
    assert capsys.readouterr().out == PASSED + "\n"


def learner_crossover(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s, *,
                      checker=None):
    """b* from the throughputs, as a learner might write it; refuses to run in the checking
    process ``checker``."""
    assert os.getpid() != checker, "called in the checking process"
    n = world_size
    allreduce = 2 * (n - 1) * alpha + 2 * (n - 1) / n * model_bytes / bandwidth
    # n b / (c b + f + R) = b / (c b + f)  <=>  (n - 1)(c b + f) = R
    b = (allreduce / (n - 1) - fixed_s) / per_sample_s
    return b if b > 0 else 0


def crossover_as_a_tensor(*args):
    """A one-element tensor and NumPy's float are numbers too."""
    b = learner_crossover(*args)
    return torch.tensor([b], dtype=torch.float64) if b else np.float64(b)


def test_a_right_answer_passes_outside_the_checking_process(capsys):
    result = check_crossover_batch(partial(learner_crossover, checker=os.getpid()))
    assert str(result) == PASSED
    assert capsys.readouterr().out == PASSED + "\n"


@pytest.mark.slow  # more of the same: one more right answer through a rank
def test_a_tensor_or_numpy_answer_passes():
    result = check_crossover_batch(crossover_as_a_tensor)
    assert result.passed, result.message


def test_what_counts_as_a_number():
    assert _as_number(3) == 3.0 and _as_number(2.5) == 2.5 and _as_number(Fraction(1, 4)) == 0.25
    assert _as_number(np.float32(0.5)) == 0.5 and _as_number(torch.tensor(1.5)) == 1.5
    for value, words in [
        (None, "returned None; return b* as a number"),
        (True, "returned True (bool); return b* as a number"),
        ("35.02", "returned '35.02' (str); return b* as a number"),
        ([35.02], "returned [35.02] (list), which float() cannot make one number of"),
        (torch.ones(2), "(Tensor), which float() cannot make one number of"),
        (1j, "returned 1j (complex), which float() cannot make one number of"),
        (10**400, "(int), which float() cannot make one number of"),
        (math.nan, "returned nan, not a finite number"),
        (-math.inf, "returned -inf, not a finite number"),
    ]:
        got = _as_number(value)
        assert isinstance(got, str) and words in got, (value, got)


# --- wrong formulas, each with its hint ----------------------------------------------------------


def no_clamp(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    return (2 * alpha + 2 * model_bytes / (world_size * bandwidth) - fixed_s) / per_sample_s


def two_rank_form(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    """The chapter's N = 2 condition, T1 > 2 alpha + S/bw, used for every N."""
    return max(0.0, (2 * alpha + model_bytes / bandwidth - fixed_s) / per_sample_s)


def ring_bytes(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    """The bytes each rank of a ring sends, 2(N-1)/N S, for the bandwidth term."""
    n = world_size
    sent = 2 * (n - 1) / n * model_bytes
    return max(0.0, (2 * alpha + sent / bandwidth - fixed_s) / per_sample_s)


def whole_allreduce(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    """T1 > R: the whole all-reduce, not divided by the N-1 ranks beyond the first."""
    n = world_size
    allreduce = 2 * (n - 1) * (alpha + model_bytes / (n * bandwidth))
    return max(0.0, (allreduce - fixed_s) / per_sample_s)


def alpha_once(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    return max(0.0, (alpha + 2 * model_bytes / (world_size * bandwidth) - fixed_s)
               / per_sample_s)


def no_fixed_cost(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    return max(0.0, (2 * alpha + 2 * model_bytes / (world_size * bandwidth)) / per_sample_s)


def rounded_up(*args):
    """The smallest whole batch at which N ranks are at least as fast."""
    return math.ceil(learner_crossover(*args))


def forgets_to_return(*args):
    learner_crossover(*args)


@pytest.mark.parametrize(
    ("answer", "reasons"),
    [
        (no_clamp,
         [f"{FIXED_WINS}: returned -9.98, expected 0: a batch is never negative: when the fixed "
          "cost f alone outlasts one extra rank's share of the all-reduce, N ranks train faster "
          "than one at every batch, and b* is 0."]),
        (two_rank_form,
         [f"{N4}: returned 35.02, expected 15.02: that is (2 alpha + S/bw - f) / c, the two-rank "
          "form of this chapter; it is right at N = 2 only (this case has N = 4): the ring's "
          "2(N-1) steps each send S/N bytes, so R = 2(N-1)(alpha + S/(N bw)) = 0.06006 s here, "
          "and the N-1 ranks beyond the first share it. How much of R must one rank's T1 "
          "outlast?"]),
        (ring_bytes,
         [f"{N4}: returned 55.02, expected 15.02: that is (2 alpha + 2(N-1)/N S/bw - f) / c, the "
          "whole ring's bandwidth term with 2 alpha; it is right at N = 2 only (this case has "
          "N = 4)"]),
        (whole_allreduce,
         [f"{N4}: returned 55.06, expected 15.02: that is (R - f) / c, one rank's T1 set against "
          "the whole all-reduce R; it is right at N = 2 only (this case has N = 4)"]),
        (alpha_once,
         [f"{N2}: returned 35.01, expected 35.02: that counts the latency alpha = 1e-05 s once; "
          "the ring's 2(N-1) messages, shared by the N-1 ranks beyond the first, make how many "
          "alphas each?"]),
        (no_fixed_cost,
         [f"{N2}: returned 40.02, expected 35.02: that leaves out the fixed cost f = 0.005 s of "
          "one rank's step, T1(b) = c b + f"]),
        (rounded_up,
         [f"{N2}: returned 36, expected 35.02: b* is where the two throughputs meet, a real "
          "number: return it as it is, not rounded to a whole batch."]),
        (forgets_to_return,
         [f"{N2}: returned None; return b* as a number, a float (0.0 when N ranks are faster at "
          "every batch)."]),
    ],
    ids=["no_clamp", "two_rank_form", "ring_bytes", "whole_allreduce", "alpha_once",
         "no_fixed_cost", "rounded_up", "forgets_to_return"],
)
def test_a_wrong_formula_fails_with_its_hint(answer, reasons, assert_fails):
    assert_fails(check_crossover_batch(answer), "5.3", *reasons)


def seconds_in_milliseconds(*args):
    """Right, but in other units than the case's: nothing the check names."""
    return 1e3 * learner_crossover(*args)


def test_a_wrong_answer_no_formula_explains_gets_the_throughputs(assert_fails):
    assert_fails(check_crossover_batch(seconds_in_milliseconds), "5.3",
                 f"{N2}: returned 35020, expected 35.02: one rank's step takes T1 = c b + f; N "
                 "ranks of b samples each take T1 + R, R = 2(N-1)(alpha + S/(N bw)) = 0.04002 s "
                 "here. At b*, N ranks' N b / (T1 + R) samples per second equal one rank's b / "
                 "T1: solve that for b (0 when N ranks are faster at every batch).")


# --- a call that raises or never returns ---------------------------------------------------------


def latency_in_messages(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    """Divides by alpha: the case alpha = 0 raises."""
    messages = (model_bytes / bandwidth) / alpha  # how many alphas the bytes cost
    return learner_crossover(alpha, bandwidth, model_bytes, world_size, per_sample_s,
                             fixed_s) + 0 * messages


def test_a_call_that_raises_names_the_case(assert_fails):
    result = check_crossover_batch(latency_in_messages)
    assert_fails(result, "5.3",
                 f"{ALPHA_ZERO}: crossover_batch raised ZeroDivisionError.\n"
                 "Traceback (most recent call last):",
                 "in latency_in_messages", "ZeroDivisionError: float division by zero")
    assert "labs/checks" not in result.message


def search_that_never_ends(alpha, bandwidth, model_bytes, world_size, per_sample_s, fixed_s):
    """Searches b upwards from 0 for N > 2, by a step meant to grow that never does."""
    if world_size == 2:
        return learner_crossover(alpha, bandwidth, model_bytes, world_size, per_sample_s,
                                 fixed_s)
    b, step, n = 0.0, 0.0, world_size
    allreduce = 2 * (n - 1) * (alpha + model_bytes / (n * bandwidth))
    while n * b / (per_sample_s * b + fixed_s + allreduce) <= b / (per_sample_s * b + fixed_s):
        b += step
    return b


def test_a_call_that_never_returns_is_stopped_and_named(assert_fails):
    result = check_crossover_batch(search_that_never_ends, timeout=1)
    assert_fails(result, "5.3",
                 f"{N4}: crossover_batch did not return within 1 s, and was stopped at File",
                 "in search_that_never_ends", "A loop that never ends? b* solves an equation "
                 "linear in b: it needs no search.")
    threads = [t for t in threading.enumerate() if t.name == "labs check 5.3"]
    for t in threads:
        t.join(2.0)
    assert not any(t.is_alive() for t in threads)  # stopped, not left spinning


# --- hidden cases, determinism, the refusal ------------------------------------------------------


def test_a_seed_draws_three_cases_the_same_every_time():
    plan = CrossoverPlan.make(1)
    assert plan == CrossoverPlan.make(1) and plan != CrossoverPlan.make(2)
    assert plan.cases[:len(CROSSOVER_CASES)] == CROSSOVER_CASES and len(plan.drawn) == 3
    assert plan.note() == (
        " [seed 1 drew crossover_batch(3.141e-06, 1.604e+11, 1.135e+09, 10, 1.003e-07, 0.000607), "
        "crossover_batch(0.0008269, 1.755e+09, 1.298e+06, 368, 0.0004437, 0.001201) and "
        "crossover_batch(4.441e-05, 7.542e+10, 8.223e+06, 728, 6.088e-05, 2.59e-06); pass "
        "seed=1 to rerun]")
    assert CrossoverPlan.make(0).drawn == () and CrossoverPlan.make(0).note() == ""


def test_the_drawn_cases_span_the_ranges():
    drawn = [c for seed in range(1, 301) for c in CrossoverPlan.make(seed).drawn]
    for c in drawn:
        assert 1e-6 <= c.alpha <= 5e-3 and 1e9 <= c.bandwidth <= 400e9
        assert 1e6 <= c.model_bytes <= 10e9 and 2 <= c.world_size <= 1024
        assert c.per_sample_s > 0 and c.fixed_s >= 0
        assert CrossoverCase(*c.arguments).draw_text() == c.draw_text()
        assert f"{c.alpha:g}" == f"{c.alpha:.4g}"  # what the verdict shows is what ran
    answers = [expected_crossover(c) for c in drawn]
    assert 0.1 < sum(b == 0 for b in answers) / len(answers) < 0.4
    assert min(b for b in answers if b > 0) < 3 and 3e5 < max(answers) < 1.1e6
    assert min(c.world_size for c in drawn) == 2 and max(c.world_size for c in drawn) > 700


def test_hidden_cases_catch_answers_fitted_to_the_documented_ones(capsys, assert_fails):
    known = {case.arguments: expected_crossover(case) for case in CROSSOVER_CASES}

    def memorised(*args):
        return known.get(args, 1.0)

    assert check_crossover_batch(memorised).passed
    capsys.readouterr()
    result = check_crossover_batch(memorised, seed=1)
    assert_fails(result, "5.3", "alpha = 3.141e-06 s, bandwidth = 1.604e+11 B/s, model_bytes = "
                 "1.135e+09 B, world_size = 10, per_sample_s = 1.003e-07 s, fixed_s = 0.000607 "
                 "s: returned 1, expected 8120.577967")
    assert result.message.endswith(CrossoverPlan.make(1).note())
    assert str(check_crossover_batch(memorised, seed=1)) == str(result)  # the same every run


def alias_of_the_key(*args):
    from labs.cost_model import crossover_batch as mine  # noqa: PLC0415

    return mine(*args)


def key_through_importlib(*args):
    return importlib.import_module("labs." + "cost_model").crossover_batch(*args)


def hides_the_refusal(*args):
    try:
        return labs.cost_model.crossover_batch(*args)
    except Exception:
        return learner_crossover(*args)  # ... and does the work after all: still refused


@pytest.mark.parametrize("cheat", [alias_of_the_key, key_through_importlib, hides_the_refusal])
def test_labs_own_answer_is_refused_however_it_is_reached(cheat, capsys):
    result = check_crossover_batch(cheat)
    assert str(result) == (f"FAIL: {TITLE}: "
                           + refusal_message("5.3", "labs.cost_model.crossover_batch"))
    assert capsys.readouterr().out == f"{result}\n"
    # the refusal lives in the check's rank: the learner's own process keeps labs' function
    assert labs.cost_model.crossover_batch(1e-5, 1e10, 4e8, 2, 1e-3, 5e-3) == pytest.approx(35.02)
