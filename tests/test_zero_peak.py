"""FSDP's peak, term by term: the schedule's count of what a rank holds at each reduce-scatter
equals the bytes measured there, and the prefetches it counts are seen as events."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from labs.experiments.zero import (
    Group,
    fsdp_reduce_scatter_terms,
    fsdp_term_mismatches,
    fsdp_units,
    measure_memory,
    reduce_scatter_unit,
)
from labs.fsdp import FSDP, Event
from labs.launcher import launch
from labs.models import StepSettings
from labs.wrappers import Wrapper

# 4 layers of Linear(10, 10): 110 parameters each, which 4 does not divide (padding counts).
SETTINGS = StepSettings(width=10, layers=4, batch=4, steps=2, warmup=0)


@pytest.fixture(scope="module")
def reports():
    return measure_memory([1, 2, 4], SETTINGS, [Wrapper.FSDP])


def test_the_units_are_the_linear_layers_padded_to_n_shards():
    assert fsdp_units(SETTINGS, 4) == [(name, 4 * 28) for name in ("0", "2", "4", "6")]
    assert fsdp_units(SETTINGS, 3) == [(name, 3 * 37) for name in ("0", "2", "4", "6")]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_terms_add_up_to_every_reduce_scatter_measured(reports, n):
    report = reports[(Wrapper.FSDP, n)]
    moments = [s.moment for s in report.snapshots if reduce_scatter_unit(s.moment)]
    assert len(moments) == SETTINGS.layers
    assert fsdp_term_mismatches(report, SETTINGS) == []
    # and the peak is one of them, the second-to-last unit of backward ("2" of 0, 2, 4, 6)
    assert report.peak.moment == f"{Event.REDUCE_SCATTER.value} 2"
    terms = fsdp_reduce_scatter_terms(SETTINGS, n, "2")
    assert sum(t.nbytes for t in terms) == report.peak_bytes


def test_a_count_for_another_model_is_caught(reports):
    """The checker can fail: the terms of a wider model do not add up to this one's bytes."""
    wider = dataclasses.replace(SETTINGS, width=16)
    wrong = fsdp_term_mismatches(reports[(Wrapper.FSDP, 2)], wider)
    assert len(wrong) == 3 * SETTINGS.layers  # every kind at every reduce-scatter
    assert wrong[0].startswith(f"N = 2, {Event.REDUCE_SCATTER.value} 6: parameters ")


def test_the_terms_of_the_first_and_last_units_of_backward():
    first = fsdp_reduce_scatter_terms(SETTINGS, 2, "6")  # nothing in flight, no shard yet
    assert [t.what.split(",")[0] for t in first if t.group is Group.GRADIENTS] == [
        "full gradient of unit 6"]
    last = fsdp_reduce_scatter_terms(SETTINGS, 2, "0")  # nothing left to prefetch
    assert not any("prefetched" in t.what for t in last)
    with pytest.raises(ValueError, match="no unit '1'"):
        fsdp_reduce_scatter_terms(SETTINGS, 2, "1")  # a ReLU: no parameters, no unit


def prefetch_events(rank: int, world_size: int) -> list[list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    model = FSDP(net, observer=lambda event, unit: events.append((event.name, unit)))
    steps = []
    for _ in range(2):
        events.clear()
        model(torch.ones(2, 4)).sum().backward()
        model.finish_gradient_synchronization()
        steps.append([e for e in events if e[0] == Event.PREFETCH.name])
    return steps


def test_prefetches_follow_the_previous_steps_order():
    first, second = launch(prefetch_events, 2, echo=False)[0]
    assert first == []  # no order to prefetch by yet
    assert second == [("PREFETCH", "1"), ("PREFETCH", "2"),  # forward: the next layer
                      ("PREFETCH", "1"), ("PREFETCH", "0")]  # backward, in reverse
