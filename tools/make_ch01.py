"""Writes notebooks/01_toy_allreduce.ipynb (source cells only; `make notebooks` executes it).

Kept as a script so the chapter can be regenerated and reviewed as plain text; edit here,
then run `make notebooks`.
"""

from nbgen import CHECK, check, code, md, setup, solution, write_notebook

cells = [
    md(r"""
# The toy all-reduce

Data-parallel training runs one copy of the model per **rank** (a process, usually one per
GPU). Every rank reads a different slice of the data, so every rank computes a different
gradient. If each rank stepped with its own gradient, the copies would drift apart after the
first update. They stay identical because, before each step, the ranks **all-reduce** their
gradients: every rank contributes its tensor and every rank receives the element-wise sum.
Divide by the number of ranks and every rank holds the same average, takes the same step,
and ends with the same parameters.

This chapter runs that idea on real processes:

1. four ranks average one gradient value and take one SGD step;
2. the same on a tiny language model, compared with ordinary single-process training;
3. a panel to change the number of ranks and the values;
4. an exercise: write `average_gradients(model)` yourself.
"""),
    setup("""
import fractions
import inspect

import torch
import torch.distributed as dist
from IPython.display import Code, display

from labs import RankError, launch, rank_device
from labs.checks import check_average_gradients
from labs.toy_allreduce import (
    EXAMPLE_GRADIENTS, EXAMPLE_SENTENCES, ToyAllReduceConfig, batch_loss, data_parallel_gradients,
    full_batch_gradients, gradients, make_model, max_abs_difference, shard_sentences,
    toy_all_reduce_step,
)
from labs.viz import format_table, plot_gradient_parity, toy_table
from labs.widgets import toy_allreduce_panel
"""),
    md(r"""
## Ranks and a process group

`launch(fn, world_size=4)` starts four processes. Each one joins a **process group** (the set
of ranks that take part in collectives) and calls `fn(rank, world_size)`. The return values
come back to the notebook as a list in rank order, and anything a rank prints is shown
afterwards, prefixed with its rank.
"""),
    code("""
def hello(rank, world_size):
    print(f"hello from rank {rank} of {world_size}")
    return dist.get_rank(), dist.get_world_size()

launch(hello, world_size=4)
""", CHECK),
    md(r"""
Inside `fn`, `torch.distributed` is ready to use: `dist.get_rank()` agrees with the `rank`
argument, and collectives such as `dist.all_reduce` reach the other three processes.
`hello` was defined in this notebook; `launch` sends it to the ranks by value, which is why
the exercises below can be written in notebook cells.

Which backend the group uses depends on the machine: `launch` picks NCCL when every rank can
have a GPU of its own and gloo otherwise. NCCL only moves tensors that live on the GPU, so the
workers of this book create theirs on `rank_device()`, which is the CPU under gloo and the
rank's own GPU under NCCL; the same cells then run on a laptop and on a GPU box.

## Four ranks, one gradient

Suppose four ranks hold the gradient of the same weight, each computed on different text, so
the values differ. To start, they are four example values (`EXAMPLE_GRADIENTS`); later in the
chapter the gradients come from a real model:
"""),
    code("""
print(format_table(["rank", "gradient"], list(enumerate(EXAMPLE_GRADIENTS))))
""", CHECK),
    md(r"""
The ranks want the mean gradient $\bar g = \frac{1}{N}\sum_{r=0}^{N-1} g_r$ and then one SGD
step $w \leftarrow w - \eta\,\bar g$ from $w = 0.5$ with learning rate $\eta = 0.001$. Here
is everything one rank does:
"""),
    code("""
display(Code(inspect.getsource(toy_all_reduce_step), language="python"))
""", ["hide-output"]),
    code("""
config = ToyAllReduceConfig(grads=EXAMPLE_GRADIENTS, param=0.5, lr=0.001)
records = launch(toy_all_reduce_step, world_size=4, args=(config,))
print(toy_table(records))
""", CHECK),
    md(r"""
Every row after the all-reduce is the same: each rank received the sum of all four gradients,
divided it by four itself, and took the same step. The last column is the bit pattern of the
new float32 parameter, so "the same" means the same bits, not just the same printed digits:
"""),
    code("""
print("distinct parameter bit patterns across ranks:", len({r.param_after_bits for r in records}))
""", CHECK),
    md(r"""
### Exact arithmetic against float32

Written out by hand the sum is 0.2, the mean 0.05 and the new parameter 0.49995. The ranks
hold float32 tensors, and none of 0.1, 0.2, 0.4 or 0.49995 is exactly representable in
binary. Exact decimal arithmetic beside what the ranks computed:
"""),
    code("""
exact = [fractions.Fraction(str(g)) for g in EXAMPLE_GRADIENTS]
exact_sum = sum(exact)
exact_mean = exact_sum / 4
exact_param = fractions.Fraction("0.5") - fractions.Fraction("0.001") * exact_mean
rank0 = records[0]
rows = [
    [name, float(value), got, abs(got - float(value))]
    for name, value, got in [
        ("sum", exact_sum, rank0.summed),
        ("mean", exact_mean, rank0.averaged),
        ("parameter after", exact_param, rank0.param_after),
    ]
]
print(format_table(["quantity", "exact", "float32 on the ranks", "difference"], rows))
""", CHECK),
    md(r"""
The differences are float32 rounding (a float32 carries about 7 significant decimal digits).
They are harmless here, but they are why distributed results are compared with a tolerance,
and why the *order* in which an all-reduce adds numbers matters: change the order and the
last bits can change. What matters for training is that every rank ends with the same bits.
The API does not promise that, but gloo's and NCCL's algorithms reduce each element once and
then copy the result to every rank, so the ranks agree bit for bit; the table above shows it.

### What "all-reduce" does and does not do

The steps are easy to list as "sum, average, broadcast". The collective is not used that way:

* `dist.all_reduce(t)` is **one** call. When it returns, every rank already holds the result;
  the caller writes no broadcast. Inside, algorithms differ: the simplest reduces to one rank
  and broadcasts from it, the ring reduce-scatters and then all-gathers (chapter 2 builds and
  measures both).
* With `op=SUM` it sums; the average is our division by the world size. Some backends also
  offer `ReduceOp.AVG`. Whether this one does, and whether it gives the same bits:
"""),
    code("""
def all_reduce_avg(rank, world_size, grads):
    grad = torch.tensor([grads[rank]], dtype=torch.float32, device=rank_device())
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    return grad.item()

try:
    averaged = launch(all_reduce_avg, world_size=4, args=(EXAMPLE_GRADIENTS,), echo=False)
    same = all(a == r.averaged for a, r in zip(averaged, records))
    print(f"ReduceOp.AVG works on {averaged.backend.value}; same value as SUM then divide: {same}")
except RankError as err:
    print(f"ReduceOp.AVG is not available here ({err.exc_type}); use SUM and divide.")
"""),
    md(r"""
Do four ranks make training four times faster? Four ranks do process
four batches per step, but each step now also pays for the all-reduce, which grows with the
model. Chapters 2 and 5 measure that cost instead of assuming it away.

## A real model: the average of the ranks' gradients is the full-batch gradient

Now the gradients come from a model. Each rank trains a tiny character **bigram** language
model (an embedding and a linear layer that predict the next character from the current one)
on its own two sentences. The loss of one sentence is the mean next-character cross-entropy;
a rank's loss is the mean over its sentences.
"""),
    code("""
rows = [[rank, " | ".join(shard_sentences(EXAMPLE_SENTENCES, rank, 4))] for rank in range(4)]
print(format_table(["rank", "its sentences"], rows))
""", CHECK),
    md(r"""
If every rank holds $n$ sentences, the mean of the ranks' gradients is

$$
\frac{1}{N}\sum_{r=0}^{N-1} \frac{1}{n}\sum_{i \in B_r} \nabla \ell_i
\;=\; \frac{1}{Nn}\sum_{i=1}^{Nn} \nabla \ell_i ,
$$

the gradient of the mean loss over **all** sentences: what one process would compute on the
concatenated batch. Each rank below builds the same model (same seed), runs backward on its
own sentences, and averages gradients with one all-reduce; the notebook computes the
single-process gradient on all eight sentences and compares.
"""),
    code("""
ranks = launch(data_parallel_gradients, world_size=4, args=(EXAMPLE_SENTENCES,))
reference = full_batch_gradients(EXAMPLE_SENTENCES)
rows = [
    [r.rank, r.loss, max_abs_difference(r.local, reference),
     max_abs_difference(r.averaged, reference)]
    for r in ranks
]
print(format_table(["rank", "local loss", "max |local - full|", "max |averaged - full|"], rows))
"""),
    md(r"""
Before the all-reduce each rank's gradient is far from the full-batch one (it saw a quarter of
the data). After it, the difference is at the level of float32 rounding. As a verdict:
"""),
    code("""
worst = max(max_abs_difference(r.averaged, reference) for r in ranks)
print(f"max abs difference: {worst:.1e}")
""", ["nbval-ignore-output"]),
    code("""
print("averaged gradients equal the full-batch gradient (to 1e-6):", worst < 1e-6)
""", CHECK),
    code("""
fig = plot_gradient_parity(reference, ranks[0].averaged, "4 ranks, 2 sentences each")
""", ["hide-input"]),
    md(r"""
### When the average is wrong: uneven local batches

The equality needed every rank to hold the same number of sentences. With three ranks the
eight sentences split 3, 3 and 2, and the average of the three means weighs the two
sentences on rank 2 more than the others:
"""),
    code("""
uneven = launch(data_parallel_gradients, world_size=3, args=(EXAMPLE_SENTENCES,))
worst_uneven = max(max_abs_difference(r.averaged, reference) for r in uneven)
print("sentences per rank:", [len(r.sentences) for r in uneven])
print(f"max abs difference from the full-batch gradient: {worst_uneven:.3g}")
""", ["nbval-ignore-output"]),
    md(r"""
A difference of that size is a real error, not rounding. One fix: make each rank's loss a
*sum* over its sentences divided by the **global** number of sentences, and all-reduce with
SUM and no division. Then the ranks' contributions add up to exactly the full-batch mean:
"""),
    code("""
def weighted_gradients(rank, world_size, sentences):
    model = make_model().to(rank_device())
    mine = shard_sentences(sentences, rank, world_size)
    loss = batch_loss(model, mine) * len(mine) / len(sentences)  # sum over mine / global count
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # no division: the weights add up to 1
    return gradients(model)

fixed = launch(weighted_gradients, world_size=3, args=(EXAMPLE_SENTENCES,))
worst_fixed = max(max_abs_difference(g, reference) for g in fixed)
print(f"uneven batches, weighted: max abs difference {worst_fixed:.1e}")
""", ["nbval-ignore-output"]),
    code("""
print("plain average is wrong with uneven batches:", worst_uneven > 1e-3)
print("weighted gradients equal the full-batch gradient (to 1e-6):", worst_fixed < 1e-6)
""", CHECK),
    md(r"""
PyTorch's `DistributedSampler` takes the other route and makes the shares equal: it pads the
data by repeating samples (or, with `drop_last=True`, drops the remainder), so the average is
then over a batch that is not quite the original one; chapter 5 looks at what that costs.

## Try it

Choose a world size and a random seed and press the button: the panel launches that many real
ranks, each with a gradient drawn at random from that seed, and shows the table and a figure. Below the panel is
the default run (four ranks, seed 0). With one rank the all-reduce returns the rank's own
gradient; with any number of ranks every row ends with the same bits.
"""),
    code("""
toy_allreduce_panel(world_size=4, seed=0)
"""),
    md(r"""
## Exercise 1.1: `average_gradients`

Write `average_gradients(model)`: after `loss.backward()` on every rank, it must leave each
parameter's `.grad` holding the mean of that gradient over all ranks.

* Use `dist.all_reduce(tensor)`: it works **in place** and sums across ranks.
* Divide by `dist.get_world_size()`.
* Skip parameters whose `.grad` is `None` (frozen parameters have none).
* Every rank must call `all_reduce` on the same parameters in the same order. Otherwise the
  ranks wait for each other forever (the check stops that after a timeout), or, when the
  tensors have the same size, silently add one parameter's gradient to another's.

The check below runs your function on 1, 2, 3 and 4 real ranks, each starting from different
gradients, and compares every rank's result with the mean.
"""),
    solution("""
def average_gradients(model):
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size
""", "1.1"),
    check("""
result = check_average_gradients(average_gradients)
""", "1.1"),
    md(r"""
## Summary

* Data-parallel ranks hold the same model and different data; an **all-reduce** of the
  gradients followed by a division by the world size gives every rank the same average, so
  every rank takes the same step and the copies stay identical, bit for bit.
* `all_reduce` is a single collective: it sums (or applies another reduction) and leaves the
  result on every rank. The averaging is a separate division, or `ReduceOp.AVG` where the
  backend offers it.
* With equal local batches, the average of the ranks' gradients equals the gradient of the
  full batch, up to float32 rounding. With unequal batches it does not: weight each rank's
  loss by its share of the samples, or make the shares equal.
* `labs.launch` runs any function, notebook-defined ones included, on real ranks; the same
  workers run under `torchrun`
  (`torchrun --nproc_per_node=4 -m labs toy --grads 0.1 -0.2 0.4 -0.1`).

Next, chapter 2 asks how an all-reduce is computed: which messages travel between the ranks,
and what that costs.
"""),
]

write_notebook(cells, "01_toy_allreduce.ipynb")
