"""Writes notebooks/06_zero_fsdp.ipynb (source cells only; `make notebooks` executes it).

Kept as a script so the chapter can be regenerated and reviewed as plain text; edit here,
then run `make notebooks`.
"""

from nbgen import CHECK, HIDE, IGNORE, check, code, md, setup, solution, write_notebook

cells = [
    md(r"""
# ZeRO and FSDP: sharding the training state

Under DDP every rank holds everything: the parameters, their gradients and the optimizer
state. Chapter 5's ranks only ever needed their average. ZeRO (Rajbhandari et al.,
[arXiv:1910.02054](https://arxiv.org/abs/1910.02054)) removes the copies in three stages,
using the two halves of the all-reduce that chapters 3 and 4 built:

1. **ZeRO-1** shards the optimizer state: reduce-scatter the gradients, update your shard,
   all-gather the parameters (`labs.zero.ShardedOptimizer`);
2. **ZeRO-2** shards the gradients too, reduce-scattering each one as backward produces it;
3. **ZeRO-3**, fully sharded data parallelism (FSDP), shards the parameters themselves and
   gathers each unit's just before it is used (`labs.fsdp.FSDP`).

This chapter builds the three, checks them against one process, and measures on real ranks:

* the bytes each rank holds, by kind, at every moment of a step, for world sizes 1 to 8,
  beside the closed forms;
* the bytes each rank sends: why ZeRO-1 and 2 cost what DDP costs and ZeRO-3 half as much
  again;
* torch's own FSDP2 (`fully_shard`) beside `labs.fsdp.FSDP`, on a small model with a tied
  embedding, a frozen layer and a buffer;
* a calculator that reconciles the 16, 18 and 20 bytes per parameter found in the
  literature, and a recount of a "maximum model size" claim;
* a panel and three exercises.
"""),
    setup("""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labs import launch, rank_device
from labs.checks import check_fsdp_linear_forward, check_reduce_scatter_grad, check_sharded_sgd_step
from labs.collectives import Algorithm, Recorder, ring_all_gather, ring_reduce_scatter
from labs.ddp_experiments import mlp
from labs.fsdp import FSDP, Event
from labs.fsdp_torch import (
    CompareSettings, Sharding, compare_on_ranks, fully_shard_available, held_table,
    max_abs_difference, reference_run,
)
from labs.viz import format_table
from labs.viz_zero import (
    calculator_table, memory_table, plot_memory_by_stage, plot_step_memory, traffic_plot,
    traffic_table,
)
from labs.widgets import memory_calculator, zero_panel
from labs.zero import ShardedOptimizer, ZeroStage, shard_numel
from labs.zero_experiments import (
    LAB_SETTINGS, Group, Recipe, Strategy, bytes_per_parameter, max_parameters, measure_memory,
    measure_traffic,
)
"""),
    md(r"""
## The layout: a shard of every parameter

All three stages cut the training state the same way. A parameter of $P$ elements is
flattened, padded with zeros to $N k$ elements, $k = \lceil P/N \rceil$, and rank $r$ owns
elements $[rk, (r+1)k)$. The padding is what lets every rank send and receive equal chunks;
it is at most $N-1$ elements per parameter (FSDP flattens a whole unit of parameters
together, so it pays the padding once per unit). For a `Linear(6, 6)` on 4 ranks:
"""),
    code("""
rows = []
for name, numel in (("weight", 36), ("bias", 6), ("weight + bias, flattened together", 42)):
    k = shard_numel(numel, 4)
    rows.append([name, numel, k, 4 * k - numel,
                 " | ".join(f"{r * k}..{min((r + 1) * k, numel) - 1}" if r * k < numel
                            else "padding only" for r in range(4))])
print(format_table(["tensor", "elements", "k per rank", "padding",
                    "elements of ranks 0 | 1 | 2 | 3"], rows))
""", CHECK),
    md(r"""
## ZeRO-1 and ZeRO-2: sharding the optimizer state, then the gradients

`ShardedOptimizer(params, optimizer_cls, stage=...)` wraps any torch optimizer. It re-points
each parameter at a padded flat buffer, so rank $r$'s shard is a *view* of the parameter:
the optimizer updates the shard in place, with state for $k$ elements instead of $P$.

* At **stage 1** `step()` reduce-scatters each full gradient (rank $r$ receives the sum of
  its shard), divides by $N$, steps the shard, and all-gathers the shards back into every
  parameter.
* At **stage 2** a post-accumulate-grad hook reduce-scatters each gradient the moment
  backward has finished it, keeps the shard of the sum and sets `p.grad = None`: a full
  gradient only lives while it is in flight.

Both must train exactly as one process on the whole batch does. Each rank below builds the
chapter's MLP from a different seed (the optimizer broadcasts rank 0's values), trains three
Adam steps on its share, $1/N$, of one batch, and is compared with a single process:
"""),
    code("""
SETTINGS = LAB_SETTINGS  # 8 x Linear(64, 64), as in python -m labs zero; 16/N rows per rank
BATCH = torch.randn(16, SETTINGS.width, generator=torch.Generator().manual_seed(1))

def train_zero(rank, world_size, stage, steps=3):
    torch.manual_seed(rank)                       # different on every rank ...
    net = mlp(SETTINGS, seed=rank).to(rank_device())
    opt = ShardedOptimizer(net.parameters(), torch.optim.Adam, stage=stage, lr=1e-2)
    share = len(BATCH) // world_size              # ... until the broadcast in here
    x = BATCH[rank * share:(rank + 1) * share].to(rank_device())
    for _ in range(steps):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

reference = mlp(SETTINGS, seed=0)
opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
for _ in range(3):
    opt.zero_grad()
    reference(BATCH).square().mean().backward()
    opt.step()
expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])

worst = {}  # (stage, N) -> largest |rank - one process| over every rank and element
for stage in ZeroStage:
    for n in (2, 4):
        got = launch(train_zero, n, args=(stage,), echo=False)
        worst[(stage, n)] = max((g - expected).abs().max().item() for g in got)
print(format_table(["stage", "N", "max |rank - one process|"],
                   [[f"ZeRO-{stage.value}", n, f"{w:.1e}"] for (stage, n), w in worst.items()]))
""", IGNORE),
    md(r"""
The differences are float32 rounding: the ranks add the same numbers in another order (a
shard's gradient is a sum over ranks, the single process's a sum over the whole batch). Their
last digits depend on the CPU's kernels, so the verdict is checked against a bound:
"""),
    code("""
print("ZeRO-1 and ZeRO-2 on 2 and 4 ranks equal one process to 1e-5:",
      all(w < 1e-5 for w in worst.values()))
""", CHECK),
    md(r"""
## ZeRO-3: FSDP from scratch

`labs.fsdp.FSDP(module)` cuts the model into **units**, by default every direct child with
trainable parameters (here each `Linear`), plus a root unit for whatever is left (a
parameter shared by two units, like an embedding tied to the output layer, belongs to the
root). Each unit's parameters become one flat vector, sharded as above; rank $r$ keeps its
fp32 shard as an `nn.Parameter`, and the optimizer sees only shards. Around every unit:

| moment | what FSDP does | state |
|---|---|---|
| before its forward | all-gather the shards into the full vector, point the unit's parameters at views of it | `UNSHARDED` |
| after its forward | free the full vector (`untyped_storage().resize_(0)`); autograd keeps its views, empty | `SHARDED` |
| before its backward (a hook on its output) | all-gather again into the same storage | `UNSHARDED` |
| after its backward (a hook on the full vector) | reduce-scatter the gradient, add shard $r$ / $N$ to the shard's `.grad`, free | `SHARDED` |

Two details make it work. The gathered data is written through `full.data`, which does not
bump the version counter that autograd checks, so the views saved in forward are valid again
in backward. And with torch's collectives the next unit's all-gather is started while this
one computes (a *prefetch*, in the order of the previous step), and a unit's reduce-scatter
travels while the next unit computes its gradient.

The events of one step on 2 ranks, for a 3-layer model (rank 0):
"""),
    code("""
def fsdp_events(rank, world_size):
    events = []
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)]).to(rank_device())
    model = FSDP(net, observer=lambda event, unit: events.append(f"{event.value}: layer {unit}"))
    model(torch.ones(2, 8, device=rank_device())).sum().backward()
    model.finish_gradient_synchronization()
    return events

for line in launch(fsdp_events, 2, echo=False)[0]:
    print(line)
""", CHECK),
    md(r"""
Backward visits the layers in reverse. The parity test of ZeRO-1 and 2, now with `FSDP`,
both with torch's collectives (asynchronous, with prefetching) and with chapters 3 and 4's
ring. (`tests/test_zero_fsdp.py` runs the same test on a model with an embedding tied to the
output layer, a frozen layer, a buffer and sizes that $N$ does not divide.)
"""),
    code("""
def train_fsdp(rank, world_size, collectives, steps=3):
    net = mlp(SETTINGS, seed=rank).to(rank_device())
    model = FSDP(net, collectives=collectives)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    share = len(BATCH) // world_size
    x = BATCH[rank * share:(rank + 1) * share].to(rank_device())
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        opt.step()
    full = model.gather_full_params()             # every rank gets the whole state dict
    return torch.cat([full[name].reshape(-1) for name, _ in reference.named_parameters()])

worst = {}  # (collectives, N) -> largest |rank - one process|
for collectives in (Algorithm.TORCH, Algorithm.RING):
    for n in (2, 4):
        got = launch(train_fsdp, n, args=(collectives,), echo=False)
        worst[(collectives, n)] = max((g - expected).abs().max().item() for g in got)
print(format_table(["collectives", "N", "max |rank - one process|"],
                   [[c.value, n, f"{w:.1e}"] for (c, n), w in worst.items()]))
""", IGNORE),
    code("""
print("FSDP with torch's and with the ring's collectives, on 2 and 4 ranks, equals one process "
      "to 1e-5:", all(w < 1e-5 for w in worst.values()))
""", CHECK),
    md(r"""
`compute_dtype=torch.bfloat16` gathers, computes and reduce-scatters in bfloat16 while the
shards, and so the optimizer, stay fp32 (tested within a stated tolerance: bfloat16 stores 7
mantissa bits, 8 bits of precision with the implicit leading bit).
`reduce_dtype=torch.float32` (the `reduce_dtype` of torch's `MixedPrecisionPolicy`) sums the
ranks' bfloat16 gradients in fp32 instead, for twice the reduce-scatter's bytes.

## What each rank holds, measured

`labs.zero_experiments.measure_memory` trains the MLP of `SETTINGS` ($P$ parameters, printed
below) with Adam under each strategy and records, at every moment the strategy exposes
(after forward, at each gather, free and reduce-scatter, after backward, after the step),
the bytes of every tensor storage rank 0 holds: parameters, gradients, optimizer state and
communication buffers (labs.memory counts each storage once, at its size at that moment, so a
freed full vector counts 0). Activations are not counted. The *peak* is the moment at which
parameters + gradients + optimizer state are largest: communication buffers are left out of
it, both DDP's gradient buckets (so DDP's peak line in the figure sits below its after-step
bars, which include them) and the receive buffer of FSDP's all-to-all (see the traffic
section). Divided by the number of parameters (`python -m labs zero` prints this table and
the traffic table below from a shell, or from ranks that `torchrun` started on a GPU node,
with `--width` and `--layers` for a larger model):
"""),
    code("""
WORLD_SIZES = (1, 2, 4, 8)
reports = measure_memory(WORLD_SIZES, SETTINGS)
print(f"P = {reports[(Strategy.DDP, 1)].parameters:,} parameters; bytes per parameter, rank 0:")
print(memory_table(reports))
""", CHECK),
    code("""
fig = plot_memory_by_stage(reports, title="Bytes per parameter on rank 0: after the step "
                                          "(bars) and at the peak (black)")
""", HIDE),
    md(r"""
Reading the table:

* **DDP** holds $4 + 4 + 8 = 16$ bytes per parameter at any world size, plus the 4 of its
  gradient buckets (the gray bars; torch's `gradient_as_bucket_view=True` saves them).
* **ZeRO-1** divides the optimizer state by $N$. Its peak is after backward: full gradients
  exist until the step reduce-scatters them, $4 + 4 + 8/N$, which is its closed form. The
  step then keeps only the gradient's shard and sets `param.grad = None`, so after the step
  ZeRO-1 holds what ZeRO-2 holds.
* **ZeRO-2** also keeps only a shard of each gradient: $4 + 4/N + 8/N$ after the step, its
  closed form. Its hook runs per parameter, so its peak adds one parameter's full gradient
  while that gradient is reduce-scattered, in place of its shard: about $(1 - 1/N)$ times one
  weight's gradient (in the table, at `0.weight`).
* **FSDP** divides everything by $N$; its peak adds what is gathered at once: the unit being
  computed, the next one being prefetched, and two full gradients, this unit's, about to be
  reduce-scattered, and the previous unit's, whose reduce-scatter is still in flight.
  That is why a model is cut into many small units, and why that costs more messages. Its
  closed form, $16/N$, is again what it holds after the step.

The labels name modules by their index in the `nn.Sequential`: its Linear layers sit at the
even indices, each followed by a ReLU, so `gradient 2` is the second Linear layer's unit and
`0.weight` the first layer's weight.

The moments of one FSDP step on 4 ranks, for rank 0:
"""),
    code("""
fig = plot_step_memory(reports[(Strategy.ZERO3, 4)])
""", HIDE),
    md(r"""
## What each rank sends, measured

Each strategy trains one step with chapters 3 and 4's ring collectives and a `Recorder`
counting every byte rank 0 sends. DDP is its all-reduce of the gradients. $S$ is the bytes of
the (padded) fp32 parameters:
"""),
    code("""
traffic = measure_traffic([2, 4, 8], SETTINGS)
print(traffic_table(traffic))
""", CHECK),
    code("""
fig = traffic_plot(traffic)
""", HIDE),
    md(r"""
ZeRO-1 and 2 send exactly what DDP sends: a ring all-reduce *is* a reduce-scatter followed by
an all-gather (chapter 4), and they only move the all-gather to after the optimizer step,
where it carries updated parameters instead of gradients. ZeRO-3 sends half as much again,
$3\frac{N-1}{N}S$: the parameters are all-gathered twice, once for forward and once for
backward, because `labs.fsdp` frees them in between (torch's `reshard_after_forward=True`,
FSDP1's `FULL_SHARD`). That is the price of holding $1/N$ of them. Keeping a unit gathered
from its forward to its backward (`reshard_after_forward=False` in FSDP2, `SHARD_GRAD_OP` in
FSDP1) skips the second all-gather and sends $2\frac{N-1}{N}S$, like DDP, for the memory of
full parameters between forward and backward.

(gloo has no reduce-scatter of its own: torch's `reduce_scatter_tensor` on gloo is an
all-reduce followed by a copy, twice the bytes. So when `labs.fsdp.FSDP` runs on gloo with
torch's collectives, it reduce-scatters with one all-to-all instead: piece $j$ of the gradient
goes straight to rank $j$, which sums the $N$ pieces that arrive. That direct algorithm sends
$\frac{N-1}{N}S$ per rank, like the ring, in a single asynchronous call; the price is a
receive buffer as large as the unit's gradient while it is in flight.)

## torch's FSDP2: `fully_shard`
"""),
    code("""
available, why = fully_shard_available()
print(why)
""", IGNORE),
    md(r"""
`torch.distributed.fsdp.fully_shard` does ZeRO-3 with the same lifecycle, but shards each
parameter separately along its first dimension (a `DTensor`). (`labs.fsdp`'s one flat vector
per unit is the design of torch's first FSDP, its `FlatParameter`; FSDP2 replaced it with
per-parameter sharding.) The comparison below trains a small model with awkward parts (an
embedding tied to the output layer, a frozen layer, a buffer, rows that 4 does not divide),
not the MLP above, with `labs.fsdp.FSDP` and with `fully_shard`, on 2 and 4 ranks, against
one process. Before wrapping with `fully_shard` the ranks broadcast rank 0's values:
`fully_shard` does not, and ranks built from different seeds would otherwise train a model
stitched from their different initial values.
"""),
    code("""
compare = CompareSettings()
one_process = reference_run(compare)
runs = {n: compare_on_ranks(n, compare) for n in (2, 4)}
rows, worst = [], {}
for n, per_rank in runs.items():
    for sharding in per_rank[0].runs:
        worst[(n, sharding)] = max(max(max_abs_difference(r.runs[sharding], one_process))
                                   for r in per_rank)
        rows.append([n, sharding.value, f"{worst[(n, sharding)]:.1e}"])
    for sharding, message in per_rank[0].skipped.items():
        rows.append([n, sharding.value, message])
print(format_table(["N", "wrapper", "max |rank - one process| over the steps"], rows))
""", IGNORE),
    code("""
ran = " and ".join(dict.fromkeys(sharding.value for _, sharding in worst))
print(f"{ran}, on 2 and 4 ranks, equal one process to 1e-5 at every step:",
      all(w < 1e-5 for w in worst.values()))
""", CHECK),
    md(r"""
Bytes held after the last step (rank 0, and rank 3, whose `fully_shard` shards have fewer
rows, or none):
"""),
    code("""
print(held_table(one_process, runs, ranks=(0, 3)))
""", IGNORE),
    md(r"""
Where they differ, and why:

* `labs.fsdp` keeps the frozen layer whole on every rank; `fully_shard` shards it too.
* Both pad. `fully_shard` splits each parameter's rows with `torch.chunk`: when $N$ does not
  divide the rows, the last ranks own fewer rows (or none), but their local shards, and the
  gradients, are stored padded to a full chunk, so rank 3 holds as many parameter and
  gradient bytes as rank 0. Adam's state is made from the unpadded shard, so rank 3 holds
  less of it. `labs.fsdp` pads a whole unit's flat vector: every rank holds the same.
* "Peak during step" is another peak than the one of the tables above: every storage alive
  at once during the step (`StoragePeak`), activations and temporaries included.
  In the table above `fully_shard`'s is the higher (it moves a little from run to run with
  the timing of gloo's asynchronous collectives). A likely part of the difference:
  `apply_fully_shard` leaves `reshard_after_forward` at its default, under which this torch
  does not reshard the root module after forward, so the root group (here the tied embedding
  and the frozen layer) stays gathered from forward to backward.

## The arithmetic: 16, 18 or 20 bytes per parameter?

Texts on large-model training quote 16, 18 or 20 bytes per parameter for Adam. All three are
right, for different precision recipes (`labs.zero_experiments.Recipe`):

* fp32 everywhere: parameters, gradients, Adam's m and v;
* bf16 (or fp16) parameters and gradients, with an fp32 master copy of the parameters for
  the optimizer: the ZeRO paper's count, $2 + 2 + K$ with $K = 12$;
* the same with the gradients accumulated in fp32;
* bf16 gradients *and* an fp32 accumulation buffer.

`labs.zero_experiments.bytes_per_parameter(recipe, stage, N)` counts the bytes of each kind,
and each stage divides one more kind by $N$ (stage 1 the optimizer state with the master
copy, stage 2 the gradients, stage 3 the parameters). Below, each recipe's bytes by kind
under DDP, then the totals of every stage at $N = 8$. Activations, buffers and what FSDP
gathers at once are not in these numbers; the measurements above show what the last of
those adds.
"""),
    code("""
rows = []
for recipe in Recipe:
    ddp = bytes_per_parameter(recipe, 0, 1)
    rows.append([recipe.value, *(f"{b:g}" for b in (ddp.parameters, ddp.gradients, ddp.optimizer)),
                 *(f"{bytes_per_parameter(recipe, stage, 8).total:g}" for stage in range(4))])
print(format_table(["recipe", "params", "grads", "master, m, v", "DDP", "ZeRO-1 (N = 8)",
                    "ZeRO-2", "ZeRO-3"], rows))
""", CHECK),
    md(r"""
### "DDP: ~2 B parameters; FSDP: ~8 B" on four 8 GB GPUs?

A common estimate puts the largest model at `GPU_memory / 4` parameters under DDP and
`GPU_memory * num_GPUs / 4` with FSDP: "2 B" and "8 B" parameters on four 8 GB GPUs.
Dividing by 4 counts only the fp32 parameters. With Adam's training state, and nothing yet
for activations:
"""),
    code("""
gpu, n = 8e9, 4
rows = []
for recipe in (Recipe.FP32, Recipe.MIXED_BOTH_GRADS):
    for strategy in (Strategy.DDP, Strategy.ZERO3):
        most = max_parameters(gpu, recipe, strategy.stage, n)
        rule = gpu * (n if strategy is Strategy.ZERO3 else 1) / 4   # "GPU memory / 4"
        rows.append([recipe.value, strategy.value, f"{most / 1e9:.2f} B", f"{rule / 1e9:.2f} B",
                     f"{rule / most:.1f}"])
print(format_table(["recipe", "strategy", "fits on 4 x 8 GB (model state only)", "rule",
                    "rule / fits"], rows))
""", CHECK),
    md(r"""
The rule overestimates by the factor in the last column, before a single activation is
stored. The factor of $N$ between DDP and FSDP is right.

### The calculator

Model size, recipe, world size and memory per GPU; every change redraws. The default: a
7 B-parameter model in bf16 with fp32 master weights on 8 GPUs of 80 GB.
"""),
    code("""
memory_calculator(parameters=7e9, recipe=Recipe.MIXED, world_size=8, memory_gb=80)
""", IGNORE),
    md(r"""
## Try it: one measured step

World size, stage and layer width; the button trains one step of the 8-layer MLP on real
ranks and draws rank 0's memory at every moment, with the bytes it sent.
"""),
    code("""
zero_panel(world_size=4, strategy=Strategy.ZERO3, settings=SETTINGS)
""", IGNORE),
    md(r"""
## Exercise 6.1: a ZeRO-1 step

Write `sharded_sgd_step(params, momentum_shards, lr, beta)`: SGD with momentum where each rank
keeps the momentum of its shard only. Every rank holds the same full parameters, and their
`.grad` already holds the mean gradient (the same on every rank). For each parameter `p`,
with `m = momentum_shards[i]` (1-D, $k = \lceil P/N \rceil$ elements, kept by the rank between
calls, updated in place):

* take this rank's shard of the flattened, zero-padded gradient and of the parameter
  (elements $[rk, (r+1)k)$);
* `m = beta * m + g_shard`, then `p_shard = p_shard - lr * m`;
* all-gather the updated shards, so that every rank holds the whole updated `p` (in place).

The check calls it under `torch.no_grad()` and allocates `momentum_shards` itself (zeros,
$k$ elements each). It runs three steps on 1 to 4 ranks, for parameters of awkward sizes (1
element, fewer than $N$, not divisible by $N$, 2-D), compares every rank with SGD with
momentum in one process (exactly), and counts the bytes each rank sends: an all-gather's
$\frac{N-1}{N}S$, not an all-reduce's twice that.
"""),
    solution("""
def sharded_sgd_step(params, momentum_shards, lr, beta):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for p, m in zip(params, momentum_shards):
        k = m.numel()                                   # ceil(p.numel() / world_size)
        pad = (0, world_size * k - p.numel())
        mine = slice(rank * k, (rank + 1) * k)
        m.mul_(beta).add_(F.pad(p.grad.reshape(-1), pad)[mine])
        shard = F.pad(p.reshape(-1), pad)[mine] - lr * m  # this rank's updated shard
        full = ring_all_gather(shard)                   # every rank's shard, in rank order
        p.copy_(full[:p.numel()].view_as(p))
""", "6.1"),
    check("""
result = check_sharded_sgd_step(sharded_sgd_step)
""", "6.1"),
    md(r"""
## Exercise 6.2: gather, use, free

Write `fsdp_linear_forward(shard, in_features, out_features, x)`, one FSDP unit's forward.
`shard` is this rank's fp32 shard ($k$ elements) of the flat vector
`cat(weight.flatten(), bias)` of a `Linear(in_features, out_features)`, padded as above. The
function all-gathers the full vector, takes `weight` (out, in) and `bias` (out,) as views of
it, returns `x @ weight.T + bias`, and frees the gathered vector before it returns: after the
call nothing of the full vector's size may be alive besides the output.

The check runs it under `torch.no_grad()` on 1 to 4 ranks for several layer sizes, compares
the output with `F.linear` and the full weights (exactly), counts the bytes sent (an
all-gather) and looks for storages the call left alive.
"""),
    solution("""
def fsdp_linear_forward(shard, in_features, out_features, x):
    full = ring_all_gather(shard)                    # weight, bias, padding
    n_weight = out_features * in_features
    weight = full[:n_weight].view(out_features, in_features)
    bias = full[n_weight:n_weight + out_features]
    out = x @ weight.T + bias                        # a new tensor, not a view of full
    full.untyped_storage().resize_(0)                # free the gathered vector, even if views
    return out                                       # of it live on (a `del` would not)
""", "6.2"),
    check("""
result = check_fsdp_linear_forward(fsdp_linear_forward)
""", "6.2"),
    md(r"""
## Exercise 6.3: the gradient's reduce-scatter

Write `reduce_scatter_grad(grad)`: every rank holds a full gradient `grad` (any shape, any
number of elements); return this rank's shard ($k$ elements, 1-D) of the **mean** over ranks
of the flattened, zero-padded gradients, computed with a reduce-scatter (chapter 3's
`ring_reduce_scatter`, or torch's). Leave `grad` unchanged. An all-reduce is refused inside
the check: it would leave the whole mean on every rank, twice the traffic and $N$ times the
memory. The mean is compared with `allclose` (rtol = atol = 1e-6): dividing by $N$ rounds.
"""),
    solution("""
def reduce_scatter_grad(grad):
    world_size = dist.get_world_size()
    k = math.ceil(grad.numel() / world_size)
    padded = F.pad(grad.reshape(-1), (0, world_size * k - grad.numel()))  # a copy
    return ring_reduce_scatter(padded) / world_size
""", "6.3"),
    check("""
result = check_reduce_scatter_grad(reduce_scatter_grad)
""", "6.3"),
    md(r"""
## Summary

* The three ZeRO stages shard, in turn, the optimizer state, the gradients and the
  parameters, over a layout where rank $r$ owns elements $[rk, (r+1)k)$ of each flattened,
  padded tensor.
* Measured per rank with Adam in fp32: DDP 16 bytes per parameter (plus 4 of buckets);
  ZeRO-1 $8 + 8/N$ at its peak; ZeRO-2 $4 + 12/N$ plus a gradient in flight; FSDP $16/N$
  plus the units it has gathered.
* ZeRO-1 and 2 send what DDP sends, $2\frac{N-1}{N}S$ per rank: an all-reduce is a
  reduce-scatter and an all-gather. FSDP sends $3\frac{N-1}{N}S$ when it frees the
  parameters after forward, as `labs.fsdp` does, and gathers them again for backward;
  keeping them until backward costs $2\frac{N-1}{N}S$.
* FSDP gathers a unit before its forward and backward and frees it after, through storage
  that autograd's saved views share; a prefetch overlaps the next unit's gather with this
  one's compute.
* `fully_shard` does the same per parameter with DTensors; it does not broadcast, shards
  frozen parameters too, and on gloo its reduce-scatter is an all-reduce.
* 16, 18 and 20 bytes per parameter are three precision recipes; "GPU memory / 4" counts the
  parameters only.

`python -m labs.bench fsdp` measures a larger MLP (`--width`, `--layers`): FSDP's peak against
DDP's, and their step times.
"""),
]

write_notebook(cells, "06_zero_fsdp.ipynb")
