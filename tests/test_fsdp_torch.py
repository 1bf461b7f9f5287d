"""torch's fully_shard (FSDP2) beside labs.fsdp.FSDP, on real ranks.

The oracle is one process trained on the whole batch (:func:`reference_run`): after every
step, every rank's full parameters and buffer, under both wrappers, must equal it
(``torch.testing.assert_close`` at its fp32 defaults, rtol 1.3e-6 and atol 1e-5: the ranks
add the same gradients in another order). The model has an embedding tied to its output
layer, a frozen layer, a buffer, and sizes that N = 4 does not divide; ranks build it from
different seeds, so the broadcast before sharding is tested too. Where this torch cannot run
fully_shard on the CPU, its tests skip with :func:`fully_shard_available`'s message.
"""

from __future__ import annotations

import math

import pytest
import torch

from labs import launch
from labs.fsdp_torch import (
    CompareSettings,
    RankReport,
    apply_fully_shard,
    compare_on_ranks,
    full_value,
    fully_shard_available,
    held_table,
    label,
    load_fully_shard,
    max_abs_difference,
    reference_run,
)
from labs.memory import local_tensor
from labs.models import TiedNet
from labs.wrappers import Wrapper

AVAILABLE, WHY = fully_shard_available()
needs_fully_shard = pytest.mark.skipif(not AVAILABLE, reason=WHY)
SETTINGS = CompareSettings()
WORLD_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def reference():
    return reference_run(SETTINGS)


@pytest.fixture(scope="module")
def reports() -> dict[int, list[RankReport]]:
    """One launch per world size, both wrappers in each."""
    return {n: compare_on_ranks(n, SETTINGS) for n in WORLD_SIZES}


def runs_of(reports, n, sharding):
    per_rank = reports[n]
    if sharding is Wrapper.FULLY_SHARD and not AVAILABLE:
        assert all(r.skipped[sharding] == WHY for r in per_rank)
        pytest.skip(WHY)
    return [r.runs[sharding] for r in per_rank]


# --- which torch ------------------------------------------------------------------------------


def test_the_helper_answers_for_this_torch_and_older_ones():
    """The thresholds as run with torch 2.4.0, 2.6.0, 2.7.0 and 2.13.0 on the CPU: 2.4 and 2.5
    create CUDA streams in fully_shard's first forward ("RuntimeError: FSDP requires CUDA for
    streams"); 2.6, whose streams are device-generic (pytorch PR 136843), calls record_event on
    a CPU stream, which has none ("AttributeError: 'Stream' object has no attribute
    'record_event'"); 2.7 runs."""
    major_minor = tuple(int(v) for v in torch.__version__.split(".")[:2])
    assert AVAILABLE == (major_minor >= (2, 7)), WHY
    if AVAILABLE:
        assert WHY.startswith("fully_shard from torch.distributed.fsdp"), WHY
    ok, why = fully_shard_available(version="2.5.1")
    assert not ok and why.startswith("skipped: fully_shard on the CPU (gloo) needs torch >= 2.7")
    assert fully_shard_available("cuda", version="2.5.1") == (
        True, "fully_shard from torch.distributed._composable.fsdp (torch 2.5.1)")
    assert fully_shard_available("cuda", version="2.3.1") == (
        False, "skipped: fully_shard needs torch >= 2.4 (this is torch 2.3.1)")
    assert not fully_shard_available(version="2.6.0+cpu")[0]  # run: record_event fails
    assert fully_shard_available(version="2.7.0+cpu")[0]


def test_settings_are_checked():
    with pytest.raises(ValueError, match="batch must be a positive int"):
        CompareSettings(batch=0)
    with pytest.raises(ValueError, match="reference runs in reference_run"):
        CompareSettings(wrappers=(Wrapper.LOCAL,))


# --- parity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sharding", [Wrapper.FSDP, Wrapper.FULLY_SHARD])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_rank_matches_one_process_on_the_full_batch(reports, reference, n, sharding):
    runs = runs_of(reports, n, sharding)
    assert [r.rank for r in runs] == list(range(n))
    for run in runs:
        assert run.units == ("hidden", "root")  # embed and head share their weight: root
        assert len(run.states) == SETTINGS.steps
        for step, (got, want) in enumerate(zip(run.states, reference.states, strict=True)):
            assert got.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name],
                    msg=lambda m, r=run.rank, s=step, k=name: f"{label(sharding)} N={n} rank {r} "
                    f"step {s} {k}: {m}")
    # equal shares: the mean of the ranks' losses is the loss on the whole batch
    mean_loss = [sum(vals) / n for vals in zip(*(r.losses for r in runs), strict=True)]
    torch.testing.assert_close(mean_loss, list(reference.losses))


@needs_fully_shard
@pytest.mark.parametrize("n", [2, 4])
def test_fully_shard_matches_labs_fsdp_step_by_step(reports, n):
    ours = runs_of(reports, n, Wrapper.FSDP)
    theirs = runs_of(reports, n, Wrapper.FULLY_SHARD)
    for a, b in zip(ours, theirs, strict=True):
        for step, (got, want) in enumerate(zip(b.states, a.states, strict=True)):
            for name in want:
                torch.testing.assert_close(got[name], want[name],
                                           msg=lambda m, s=step, k=name: f"step {s} {k}: {m}")
        assert max(max_abs_difference(a, b)) < 1e-5


# --- memory -----------------------------------------------------------------------------------

F32 = 4
#: (rows, columns) of each parameter of TiedNet, the tied weight once; and which train.
SHAPES = {"embed.weight": (11, 6), "hidden.weight": (6, 6), "hidden.bias": (6, 1),
          "frozen.weight": (6, 6), "frozen.bias": (6, 1)}
TRAINABLE = ("embed.weight", "hidden.weight", "hidden.bias")
UNITS = (42, 66)  #: elements of labs.fsdp's units: hidden (weight + bias), root (embed)


def rows_of(rows: int, n: int, rank: int) -> int:
    """Rows of dim 0 that rank holds under Shard(0): torch.chunk's pieces, then empty ones."""
    pieces = torch.arange(rows).chunk(n)
    return len(pieces[rank]) if rank < len(pieces) else 0


def expected(sharding: Wrapper, n: int, rank: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes, by the rules of the module docstring."""
    if sharding is Wrapper.FSDP:
        shard = sum(math.ceil(u / n) for u in UNITS)  # flat, padded to a multiple of N
        frozen = sum(r * c for k, (r, c) in SHAPES.items() if k not in TRAINABLE)
        return F32 * (shard + frozen), F32 * shard, 2 * F32 * shard + 4 * len(UNITS)
    padded = {k: math.ceil(r / n) * c for k, (r, c) in SHAPES.items()}  # rows padded
    local = {k: rows_of(r, n, rank) * c for k, (r, c) in SHAPES.items()}  # Adam: not padded
    return (F32 * sum(padded.values()), F32 * sum(padded[k] for k in TRAINABLE),
            2 * F32 * sum(local[k] for k in TRAINABLE) + 4 * len(TRAINABLE))


def test_one_process_holds_every_byte_once(reference):
    net = TiedNet(SETTINGS.vocab, SETTINGS.dim, seed=0)
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)  # tied: once
    assert trainable == 108
    assert sum(p.numel() for _, p in net.named_parameters(remove_duplicate=False)) == 216
    held = reference.held[-1]
    assert held.parameters == F32 * sum(p.numel() for p in net.parameters()) == 600
    assert held.gradients == F32 * trainable
    assert held.optimizer_state == 2 * F32 * trainable + 4 * len(TRAINABLE) == 876
    assert held.buffers == F32 * SETTINGS.dim
    assert held.peak > held.parameters + held.gradients + held.optimizer_state


@pytest.mark.parametrize("sharding", [Wrapper.FSDP, Wrapper.FULLY_SHARD])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_each_rank_holds_about_one_nth(reports, reference, n, sharding):
    """Exact bytes by the sharding rules, and within 25% of 1/N of one process: padding to
    whole rows (fully_shard) or to a multiple of N (labs) costs up to one row or N-1
    elements per parameter or unit, a lot for layers of six rows."""
    one = reference.held[-1]
    runs = runs_of(reports, n, sharding)
    for run in runs:
        held = run.held[-1]
        params, grads, state = expected(sharding, n, run.rank)
        assert (held.parameters, held.gradients, held.optimizer_state) == (params, grads, state)
        assert held.buffers == one.buffers  # whole on every rank
        at_rest = [(h.parameters, h.gradients, h.optimizer_state) for h in run.held]
        assert len(set(at_rest)) == 1, "the same after every step"  # peak: timing
    frozen_whole = sharding is Wrapper.FSDP
    for field, single in [("parameters", one.parameters), ("gradients", one.gradients),
                          ("optimizer_state", one.optimizer_state)]:
        frozen = F32 * 42 if field == "parameters" and frozen_whole else 0
        most = max(getattr(r.held[-1], field) for r in runs) - frozen
        assert abs(most / ((single - frozen) / n) - 1) < 0.25, (field, most, single)
    # the gradients of all ranks together cover the model: nothing dropped
    assert sum(r.held[-1].gradients for r in runs) >= one.gradients
    if n > 1:
        assert max(r.held[-1].peak for r in runs) < one.peak


# --- the awkward parts, as the module docstring says ------------------------------------------


def awkward_worker(rank: int, world_size: int) -> dict[str, object]:
    """fully_shard on ranks that built different models and did *not* broadcast; then one
    step; then the tied modules wrapped in separate calls."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    net = TiedNet(SETTINGS.vocab, SETTINGS.dim, seed=rank)
    own = net.embed.weight.detach().clone()
    apply_fully_shard(net, mesh)
    facts: dict[str, object] = {
        "own_embed": own,
        "embed_full": full_value(net.embed.weight),
        "scale": net.scale.clone(),
        "tied": net.head.weight is net.embed.weight,
        "dtensor": {n: type(p).__name__ for n, p in net.named_parameters()},
        "frozen_requires_grad": net.frozen.weight.requires_grad,
        "local_shape": {n: tuple(local_tensor(p).shape) for n, p in net.named_parameters()},
        "storage_bytes": {n: local_tensor(p).untyped_storage().nbytes()
                          for n, p in net.named_parameters()},
    }
    x, y = SETTINGS.tokens()
    torch.nn.functional.cross_entropy(net(x).reshape(-1, SETTINGS.vocab), y.reshape(-1)
                                      ).backward()
    facts["has_grad"] = {n: p.grad is not None for n, p in net.named_parameters()}
    fully_shard = load_fully_shard()
    apart = TiedNet(SETTINGS.vocab, SETTINGS.dim, seed=0)
    fully_shard(apart.embed, mesh=mesh)
    fully_shard(apart.head, mesh=mesh)
    fully_shard(apart, mesh=mesh)
    try:
        apart(x)
        facts["apart"] = None
    except ValueError as exc:  # raised by every rank alike, before any collective
        facts["apart"] = str(exc)
    return facts


@needs_fully_shard
def test_what_fully_shard_does_with_the_awkward_parts():
    n = 4
    facts = launch(awkward_worker, n, backend="gloo", echo=False, timeout=120)  # a CPU mesh
    embed_rows = [piece for piece in torch.arange(SETTINGS.vocab).chunk(n)]
    for rank, f in enumerate(facts):
        # no broadcast: the full embedding is stitched from every rank's own rows
        for owner, rows in enumerate(embed_rows):
            torch.testing.assert_close(f["embed_full"][rows], facts[owner]["own_embed"][rows])
        # the buffer stays whatever each rank built (1 + seed), not sharded, not synced
        torch.testing.assert_close(f["scale"], torch.full((SETTINGS.dim,), 1.0 + rank))
        assert f["tied"] is True
        assert set(f["dtensor"].values()) == {"DTensor"}
        assert "head.weight" not in f["dtensor"]  # one parameter, under its first name
        assert f["frozen_requires_grad"] is False
        assert f["has_grad"] == {"embed.weight": True, "hidden.weight": True,
                                 "hidden.bias": True, "frozen.weight": False,
                                 "frozen.bias": False}
        # 6 rows over 4 ranks: 2, 2, 2, 0; every storage padded to 2 rows
        assert f["local_shape"]["hidden.weight"] == ((2, 6) if rank < 3 else (0, 6))
        assert f["local_shape"]["embed.weight"] == ((3, 6) if rank < 3 else (2, 6))
        assert f["storage_bytes"]["hidden.weight"] == 2 * 6 * F32
        assert f["storage_bytes"]["embed.weight"] == 3 * 6 * F32
    message = facts[0]["apart"]
    if message is None and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("this torch accepts tied modules in separate fully_shard calls")
    assert message is not None and "already managed by another FSDP group" in message


def test_the_table_shows_every_run_or_why_not(reports, reference):
    text = held_table(reference, reports, ranks=(0, 3))
    assert label(Wrapper.LOCAL) in text and label(Wrapper.FSDP) in text
    assert (label(Wrapper.FULLY_SHARD) if AVAILABLE else WHY) in text
    # Ranks 0 and 3: labs' FSDP for each, and fully_shard too where this torch has it.
    rows = 4 if AVAILABLE else 2
    assert len([line for line in text.splitlines() if line.lstrip().startswith("4 ")]) == rows


@pytest.mark.parametrize("world_size, match", [(3, "cannot be split into 3 equal shares"),
                                               (0, "world_size must be an int")])
def test_a_batch_that_does_not_split_is_refused_before_any_rank_starts(refuse_processes,
                                                                       world_size, match):
    with refuse_processes(), pytest.raises(ValueError, match=match):
        compare_on_ranks(world_size, SETTINGS)
