"""Every exercise check passes the reference solution and fails each typical wrong answer."""

import pytest
import torch.distributed as dist

from labs.checks import CheckResult, check_average_gradients


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


def gives_frozen_a_gradient(model):
    correct(model)
    model.frozen.grad = model.frozen.detach().clone()


def rank_zero_skips_the_collective(model):
    if dist.get_rank() == 0:
        return
    correct(model)


def test_reference_solution_passes(capsys):
    result = check_average_gradients(correct)
    assert result.passed
    assert capsys.readouterr().out.startswith("PASS: Exercise 1.1")


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (sum_without_dividing, "SUM over ranks"),
        (does_nothing, "unchanged"),
        (crashes_on_frozen_parameter, "requires_grad=False"),
        (only_rank_zero_divides, "rank 1"),
        (gives_frozen_a_gradient, "frozen parameter got a gradient"),
    ],
)
def test_wrong_answers_fail_with_a_reason(answer, reason, capsys):
    result = check_average_gradients(answer)
    assert isinstance(result, CheckResult)
    assert not result.passed
    assert reason in result.message
    assert capsys.readouterr().out.startswith("FAIL: Exercise 1.1")


def test_a_hanging_answer_fails_after_the_timeout():
    result = check_average_gradients(rank_zero_skips_the_collective, timeout=3)
    assert not result.passed
    assert "hung" in result.message
