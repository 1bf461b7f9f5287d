"""ZeRO-1, ZeRO-2 and FSDP on real ranks: parity with one process on the full batch, shards,
frees, traffic, and the errors that say what to do.

The oracle is the one of chapter 5: a single-process model trained on the whole batch from
the same initialisation; after every step every rank's full parameters must equal it. Ranks
build their models from *different* seeds, so the broadcast at construction is tested too.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from collective_counter import calls_before_refusal
from torch import nn

from labs import RankError
from labs.collectives import Algorithm, Recorder
from labs.fsdp import FSDP, Event, ShardedState
from labs.zero import GradientEvent, ShardedOptimizer, ZeroStage, shard_numel

from parity import (
    OPTIMIZERS,
    STEPS,
    Deep,
    TiedNet,
    assert_states_match,
    batch,
    launch,
    loss_of,
    rank_batch,
    reference_run,
)

#: (strategy, FSDP compute dtype)
STRATEGIES = ["zero1", "zero2", "fsdp", "fsdp-ring"]


def parity_worker(rank: int, world_size: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    x, y = rank_batch(rank, world_size)
    out = {}
    for optimizer, (cls, kwargs) in OPTIMIZERS.items():
        for strategy in STRATEGIES:
            net = TiedNet(seed=rank)
            if strategy.startswith("fsdp"):
                ring = strategy == "fsdp-ring"
                model = FSDP(net, collectives=Algorithm.RING if ring else Algorithm.TORCH)
                opt = cls(model.parameters(), **kwargs)
            else:
                with torch.no_grad():  # buffers: the optimizer only broadcasts parameters
                    for b in net.buffers():
                        dist.broadcast(b, src=0)
                model = net
                stage = ZeroStage.OPTIMIZER if strategy == "zero1" else ZeroStage.GRADIENTS
                opt = ShardedOptimizer(net.named_parameters(), cls, stage=stage, **kwargs)
            states = []
            for _ in range(STEPS):
                opt.zero_grad()
                loss_of(model, x, y).backward()
                if strategy.startswith("fsdp"):
                    model.finish_gradient_synchronization()
                opt.step()
                states.append(model.gather_full_params() if strategy.startswith("fsdp") else
                              {k: v.clone() for k, v in net.state_dict().items()})
            out[f"{optimizer}-{strategy}"] = states
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_stage_matches_one_process_on_the_full_batch(world_size):
    results = launch(parity_worker, world_size, echo=False)
    expected = {name: reference_run(name) for name in OPTIMIZERS}
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(OPTIMIZERS) * len(STRATEGIES)
        for key, states in per_rank.items():
            assert_states_match(states, expected[key.split("-")[0]], f"{key} rank {rank}")


# --- what each rank holds --------------------------------------------------------------------


def holdings_worker(rank: int, world_size: int) -> dict[str, object]:
    x, y = batch()
    net = TiedNet(0)
    params = dict(net.named_parameters())
    told: list[tuple[GradientEvent, str, bool]] = []  # (event, name, full gradient still held)
    opt = ShardedOptimizer(net.named_parameters(), torch.optim.Adam, stage=ZeroStage.GRADIENTS,
                           lr=0.01, observer=lambda event, name: told.append(
                               (event, name, params[name].grad is not None)))
    loss_of(net, x, y).backward()
    grads_after_backward = {n: p.grad is not None for n, p in net.named_parameters()}
    shard_grads = [s.shard.grad.numel() for s in opt.sharded]
    opt.step()
    model = FSDP(TiedNet(0))
    sharded_storage = [u.full.untyped_storage().nbytes() for u in model.units]
    loss_of(model, x, y).backward()
    model.finish_gradient_synchronization()
    return {"grads": grads_after_backward, "shard_grads": shard_grads, "told": told,
            "shards": [s.shard.numel() for s in opt.sharded],
            "state_bytes": opt.state_bytes(),
            "fsdp_units": [u.name for u in model.units],
            "fsdp_shards": [u.shard.numel() for u in model.units],
            "fsdp_storage": sharded_storage,
            "fsdp_after": [u.full.untyped_storage().nbytes() for u in model.units],
            "fsdp_states": [u.state for u in model.units],
            "fsdp_params": [n for n, _ in model.named_parameters()]}


def test_ranks_hold_shards_of_a_quarter_and_free_what_they_gathered():
    results = launch(holdings_worker, 4, echo=False)
    numels = [66, 36, 6]  # embed (= head), hidden.weight, hidden.bias
    for r in results:
        # ZeRO-2: no full gradient survives backward; every shard is ceil(numel / 4)
        assert not any(r["grads"][n] for n in ("embed.weight", "hidden.weight", "hidden.bias"))
        assert r["shards"] == r["shard_grads"] == [shard_numel(n, 4) for n in numels]
        # the observer is told an Event, as FSDP's is, once per trainable parameter, backward's
        # order, while the full gradient is still there
        assert r["told"] == [(GradientEvent.REDUCE_SCATTER, n, True)
                             for n in ("hidden.bias", "hidden.weight", "embed.weight")]
        # Adam: m and v for each shard element, and a float32 step count per shard
        assert r["state_bytes"] == 2 * 4 * sum(shard_numel(n, 4) for n in numels) + 3 * 4
        # FSDP: hidden is a unit; the tied embedding/head and the rest form the root
        assert r["fsdp_units"] == ["hidden", "root"]
        assert r["fsdp_shards"] == [shard_numel(42, 4), shard_numel(66, 4)]
        assert r["fsdp_storage"] == r["fsdp_after"] == [0, 0]
        assert r["fsdp_states"] == [ShardedState.SHARDED] * 2
        assert r["fsdp_params"] == ["module.frozen.weight", "module.frozen.bias", "shards.0",
                                    "shards.1"]  # the optimizer's: frozen ones, then shards


# --- events, traffic, mixed precision --------------------------------------------------------


def events_worker(rank: int, world_size: int) -> dict[str, object]:
    events: list[tuple[str, str]] = []
    recorder = Recorder()
    net = Deep()
    model = FSDP(net, units=list(net.layers), collectives=Algorithm.RING, recorder=recorder,
                 observer=lambda e, name: events.append((e.name, name)))
    model(torch.ones(2, 10)).sum().backward()
    model.finish_gradient_synchronization()
    return {"events": list(events), "sent": recorder.stats.bytes_sent,
            "padded": sum(u.padded_numel for u in model.units) * 4}


def test_fsdp_gathers_before_and_frees_after_each_unit_and_moves_three_halves_of_ddp():
    results = launch(events_worker, 2, echo=False)
    names = ["layers.0", "layers.1", "layers.2"]
    forward = [(e, n) for n in names for e in ("UNSHARD_FORWARD", "RESHARD_FORWARD")]
    backward = [(e, n) for n in reversed(names)
                for e in ("UNSHARD_BACKWARD", "REDUCE_SCATTER", "RESHARD_BACKWARD")]
    for r in results:
        assert r["events"] == forward + backward
        # all-gather in forward and in backward, reduce-scatter: 3 (N-1)/N S = 1.5 S at N = 2
        assert r["sent"] == 3 * r["padded"] // 2


def prefetch_worker(rank: int, world_size: int) -> list[list[list[str]]]:
    """The other units' states each time a unit's forward starts, in two steps."""
    net = Deep()
    seen: list[list[str]] = []
    model = FSDP(net, units=list(net.layers))
    for unit in model.units:
        unit.module.register_forward_pre_hook(
            lambda *_: seen.append([u.state.value for u in model.units]))
    steps = []
    for _ in range(2):
        seen.clear()
        model(torch.ones(2, 10)).sum().backward()
        model.finish_gradient_synchronization()
        steps.append(list(seen))
    return steps


def test_from_the_second_step_the_next_unit_is_gathered_while_this_one_computes():
    first, second = launch(prefetch_worker, 2, echo=False)[0]
    # the probe runs after FSDP's own pre-forward hook: the unit itself is unsharded
    assert first == [["unsharded", "sharded", "sharded"], ["sharded", "unsharded", "sharded"],
                     ["sharded", "sharded", "unsharded"]]
    assert second == [["unsharded", "gathering", "sharded"],
                      ["sharded", "unsharded", "gathering"],
                      ["sharded", "sharded", "unsharded"]]


def mixed_worker(rank: int, world_size: int) -> tuple[torch.Tensor, torch.dtype]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = FSDP(net, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        opt.zero_grad()
        out = model(x)
        out.float().square().mean().backward()
        model.finish_gradient_synchronization()
        opt.step()
    return model.gather_full_params()["0.weight"], out.dtype


def test_bfloat16_compute_keeps_fp32_shards_and_stays_close_to_fp32():
    results = launch(mixed_worker, 2, echo=False)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.cat([torch.randn(8, 16, generator=torch.Generator().manual_seed(r))
                   for r in range(2)])
    for _ in range(3):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    for weight, dtype in results:
        assert dtype == torch.bfloat16 and weight.dtype == torch.float32
        torch.testing.assert_close(weight, net[0].weight.detach(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(results[0][0], net[0].weight.detach())  # bf16 did round


def reduce_dtype_worker(rank: int, world_size: int) -> dict[str, object]:
    """Bytes one bf16 step sends with the gradients reduce-scattered in bf16 and in fp32."""
    out: dict[str, object] = {}
    for reduce_dtype in (None, torch.float32):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        recorder = Recorder()
        model = FSDP(net, torch.bfloat16, reduce_dtype=reduce_dtype,
                     collectives=Algorithm.RING, recorder=recorder)
        model(torch.randn(8, 16)).float().square().mean().backward()
        model.finish_gradient_synchronization()
        out[str(reduce_dtype)] = recorder.stats.bytes_sent
        out["padded"] = sum(u.padded_numel for u in model.units)
        out[f"grad {reduce_dtype}"] = [u.shard.grad.dtype for u in model.units]
    return out


def test_reduce_dtype_float32_reduce_scatters_bf16_gradients_in_fp32_at_twice_the_bytes():
    for got in launch(reduce_dtype_worker, 4, echo=False):
        # each reduce-scatter sends (N-1)/N of the padded gradient: 3/4 x 2 B more per element
        extra = got["padded"] * 3 // 4 * 2
        assert got["torch.float32"] - got["None"] == extra, got
        assert got["grad None"] == got["grad torch.float32"] == [torch.float32] * 2  # fp32


def test_dtypes_that_are_not_floating_point_are_refused():
    with pytest.raises(ValueError, match="reduce_dtype must be None or a floating-point"):
        FSDP(nn.Linear(2, 2), reduce_dtype="float32")


def nested_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    return nn.Sequential(nn.Linear(4, 8), block, nn.Tanh(), nn.Linear(8, 2))


def squares_input() -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(5))


def train_squares(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> None:
    """STEPS SGD steps on sum(model(x)^2) * scale; an FSDP model synchronises each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        (model(x).square().sum() * scale).backward()
        if isinstance(model, FSDP):
            model.finish_gradient_synchronization()
        opt.step()


def squares_worker(rank: int, world_size: int, build: str, inner_first: bool = False
                   ) -> dict[str, object]:
    """FSDP on this rank's rows of squares_input(): units that nest (the block and the first
    layer inside it, listed in either order), or a model whose blocks sit in a ModuleList."""
    if build == "nested":
        net = nested_net(seed=rank)
        inner, outer = net[1][0], net[1]
        model = FSDP(net, units=[inner, outer] if inner_first else [outer, inner])
    else:
        model = FSDP(Looped(seed=rank))
    per = 8 // world_size
    train_squares(model, squares_input()[rank * per:(rank + 1) * per])
    return {"units": {u.name: u.numel for u in model.units}, "params": model.gather_full_params()}


@pytest.mark.parametrize("inner_first", [True, False])
def test_nested_units_each_hold_their_innermost_parameters_and_train_like_one_process(
        inner_first):
    net = nested_net(seed=0)
    train_squares(net, squares_input(), scale=1 / 4)  # the mean over 4 ranks of their sums
    for got in launch(squares_worker, 4, args=("nested", inner_first), echo=False):
        # the inner layer's 72, the block's other layer's 72, the rest (40 + 18) in the root
        assert got["units"] == {"1.0": 72, "1": 72, "root": 58}
        for name, want in net.state_dict().items():
            torch.testing.assert_close(got["params"][name], want, msg=name)


class Looped(nn.Module):
    """Blocks in a ModuleList, called one by one by the parent's forward (as GPT code does)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_a_module_list_child_gives_its_elements_as_units_and_trains_like_one_process():
    net = Looped(seed=0)
    train_squares(net, squares_input(), scale=1 / 2)
    for got in launch(squares_worker, 2, args=("looped",), echo=False):
        assert list(got["units"]) == ["inp", "blocks.0", "blocks.1", "blocks.2"]
        for name, want in net.state_dict().items():
            torch.testing.assert_close(got["params"][name], want, msg=name)


class ReadsAnotherUnitsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) @ self.a.weight  # a's weight, outside a's forward


def test_using_a_units_parameter_outside_its_forward_is_an_error_naming_it():
    with pytest.raises(RankError, match=r"read a.weight, which belongs to unit 'a' and is "
                                        r"sharded now.*not as layer.weight from another"):
        launch(outside_use_worker, 2, echo=False, timeout=30)


def units_error(rank: int, world_size: int, which: str) -> tuple[int, str]:
    """(calls to any collective before FSDP refused the units, its message)."""
    net = Deep()
    units = {"itself": [net], "foreign": [nn.Linear(2, 2)], "twice": [net.layers[0]] * 2,
             "not a module": ["layers.0"]}.get(which)

    def build() -> None:
        if which == "list":
            looped = Looped(seed=0)
            FSDP(looped, units=[looped.blocks])
        FSDP(net, units=units)

    return calls_before_refusal(build, refusals=(TypeError, ValueError))


@pytest.mark.parametrize("which, message", [
    ("itself", "wrapped module itself"), ("foreign", "not a submodule"),
    ("twice", "'layers.0'.* listed twice"), ("not a module", "must be an nn.Module"),
    ("list", r"'blocks'.* is a ModuleList, which is never called.*list\(model.blocks\)")])
def test_wrong_units_are_named_before_any_collective(which, message):
    for calls, text in launch(units_error, 2, args=(which,), echo=False, timeout=30):
        assert re.search(message, text, re.DOTALL), text
        assert calls == 0


def test_the_communication_counter_sees_fsdp_construction():
    """The counter above is live: a right FSDP broadcasts its parameters when built."""
    assert all(calls > 0 for calls, _ in launch(units_error, 2, args=("right",), echo=False,
                                                  timeout=30))


# --- errors ------------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.unused(x)  # runs, but its output is thrown away
        return self.used(x)


def unused_unit(rank: int, world_size: int) -> None:
    model = FSDP(Branchy())
    model(torch.ones(1, 4)).sum().backward()
    model.finish_gradient_synchronization()


def test_a_unit_without_gradient_is_an_error_naming_it():
    with pytest.raises(RankError, match=r"FSDP: unit\(s\) \['unused'\] ran forward"):
        launch(unused_unit, 2, echo=False, timeout=30)


def cast_after_wrapping(rank: int, world_size: int) -> None:
    net = TiedNet(seed=0)
    opt = ShardedOptimizer(net.named_parameters(), torch.optim.SGD, lr=0.1)
    net.double()  # new memory for every parameter: the shards no longer reach them
    loss_of(net, *rank_batch(rank, world_size)).backward()
    opt.step()


def test_casting_the_model_after_building_the_sharded_optimizer_is_an_error_saying_so():
    with pytest.raises(RankError, match=r"embed.weight no longer lives.*torch.float64.*before "
                                        r"building the ShardedOptimizer"):
        launch(cast_after_wrapping, 2, echo=False, timeout=30)


def poke_worker(rank: int, world_size: int) -> list[str]:
    net = Deep()
    model = FSDP(net, units=list(net.layers))
    model(torch.ones(1, 10)).sum().backward()
    model.finish_gradient_synchronization()
    weight = net.layers[0].weight  # between steps: shape and dtype, no data to read
    seen = [weight.device.type, str(tuple(weight.shape)), str(weight.dtype), repr(weight)]
    for read in (lambda: weight * 2, lambda: torch.ones(1, 10) @ weight, weight.sum):
        try:
            read()
            seen.append("no error")
        except RuntimeError as err:
            seen.append(str(err).split(":")[1].strip())
    return seen


def test_reading_a_sharded_parameter_between_steps_is_an_error_naming_it_not_garbage():
    """A plain meta tensor would let `cpu_tensor @ weight` return uninitialised memory."""
    seen = launch(poke_worker, 2, echo=False)[0]
    assert seen[:3] == ["meta", "(10, 10)", "torch.float32"]
    assert seen[3] == ("ShardedPlaceholder(layers.0.weight, shape=(10, 10), dtype=torch.float32, "
                       "unit='layers.0')")
    for message, op in zip(seen[4:], ["mul", "mm", "sum"], strict=True):
        assert message.startswith(f"{op} read"), seen
        assert "layers.0.weight, which belongs to unit 'layers.0'" in message, seen


def outside_use_worker(rank: int, world_size: int) -> None:
    FSDP(ReadsAnotherUnitsWeight())(torch.ones(1, 4))


def eval_worker(rank: int, world_size: int) -> list[ShardedState]:
    model = FSDP(Deep())
    with torch.no_grad():
        model(torch.ones(1, 10))
    model.finish_gradient_synchronization()  # nothing pending after a no-grad forward
    return [u.state for u in model.units]


def test_a_no_grad_forward_leaves_nothing_pending_and_everything_sharded():
    assert launch(eval_worker, 2, echo=False) == [[ShardedState.SHARDED]] * 2


def freed_worker(rank: int, world_size: int) -> list[int]:
    """The bytes still allocated to each unit's full gradient once the step's gradient
    synchronisation is finished (the observer keeps a reference to every one)."""
    seen: list[torch.Tensor] = []
    units: list[FSDP] = []

    def keep(event: Event, name: str) -> None:
        if event is Event.REDUCE_SCATTER:
            seen.append(next(u for u in units[0].units if u.name == name).full.grad)

    units.append(FSDP(Deep(), observer=keep))
    units[0](torch.ones(2, 10)).sum().backward()
    units[0].finish_gradient_synchronization()
    return [g.untyped_storage().nbytes() for g in seen]


def test_each_full_gradient_is_freed_when_its_reduce_scatter_lands():
    """gloo's worker thread drops a finished all-to-all's tensors a moment after wait(): FSDP
    frees the S-sized gradient itself, so no step holds it longer than its reduce-scatter."""
    for per_unit in launch(freed_worker, 2, echo=False):
        assert per_unit and per_unit == [0] * len(per_unit)
