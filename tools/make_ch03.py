"""Writes notebooks/03_reduce_scatter.ipynb (source cells only; `make notebooks` executes it).

Kept as a script so the chapter can be regenerated and reviewed as plain text; edit here,
then run `make notebooks`.
"""

from nbgen import CHECK, HIDE, check, code, md, setup, solution, write_notebook

cells = [
    md(r"""
# Reduce-scatter

An all-reduce leaves every rank holding the sum of every rank's tensor. A **reduce-scatter**
computes the same sums but hands them out: the tensor is cut into $N$ chunks, and rank $r$
ends with chunk $r$ of the sum and nothing else. With $x_k$ the tensor of rank $k$,

$$
y_r \;=\; \sum_{k=0}^{N-1} x_k[\text{chunk } r] \qquad \text{on rank } r .
$$

Chunk $r$ is the slice that `shard_bounds(numel, N)` gives it, the way `torch.tensor_split`
cuts: when $N$ does not divide the number of elements, the first chunks are one element longer.

This chapter runs it on real ranks and measures what it costs:

1. what it computes, on the four-gradient example, beside torch.distributed's own;
2. why it is exactly the first phase of the ring all-reduce of chapter 2: the trace, and the
   bytes each rank sends;
3. how much memory a rank holds before, during and after, measured from its tensors;
4. why ZeRO and FSDP are built on it;
5. a panel to time it, and an exercise: write it yourself from point-to-point messages.
"""),
    setup("""
import fractions
import inspect

import torch
import torch.distributed as dist
from IPython.display import Code, display

from labs import collectives, launch, rank_device
from labs.checks import check_ring_reduce_scatter
from labs.collectives import Algorithm, Collective, Recorder, shard_bounds
from labs.experiments import TraceSettings, run_ring_trace
from labs.memory import (
    ReduceScatterMoment, ShardMemorySettings, check_held_bytes, describe_allocations, find,
    memory_table, plot_memory_timeline, reduce_scatter_memory,
)
from labs.viz import format_table, ring_animation, ring_trace_table
from labs.widgets import collective_panel

# torch.distributed's own reduce-scatter into one output tensor: newer PyTorch calls it
# reduce_scatter_single, older versions reduce_scatter_tensor (same arguments).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""),
    md(r"""
## What it computes

A common way to introduce reduce-scatter: four ranks have each computed a gradient for the
same four parameters, A to D, on different text. The gradients:
"""),
    code("""
GRADS = (
    (0.1, 0.2, 0.3, 0.4),  # rank 0
    (0.2, 0.1, 0.4, 0.2),  # rank 1
    (0.3, 0.4, 0.1, 0.3),  # rank 2
    (0.4, 0.3, 0.2, 0.1),  # rank 3
)
PARAMS = "ABCD"
print(format_table(["rank", *(f"grad {p}" for p in PARAMS)],
                   [[r, *g] for r, g in enumerate(GRADS)]))
"""),
    md(r"""
Each rank runs three collectives on its gradient: the ring reduce-scatter of
`labs.collectives` (built from `isend`/`irecv` only), torch.distributed's own reduce-scatter,
and, for contrast, an all-reduce:
"""),
    code("""
def three_collectives(rank, world_size, grads):
    grad = torch.tensor(grads[rank], device=rank_device())  # this rank's gradients of A..D
    ring = collectives.ring_reduce_scatter(grad)      # 1-D: chunk `rank` of the sum
    builtin = torch.empty_like(ring)
    reduce_scatter_single(builtin, grad)              # torch.distributed's own
    everything = grad.clone()
    dist.all_reduce(everything)                       # every sum, on every rank
    return ring, builtin, everything

results = launch(three_collectives, world_size=4, args=(GRADS,))
rows = [[r, PARAMS[r], ring.tolist(), builtin.tolist(), everything.tolist()]
        for r, (ring, builtin, everything) in enumerate(results)]
print(format_table(["rank", "owns", "ring reduce-scatter", "torch reduce-scatter",
                    "all-reduce"], rows))
"""),
    md(r"""
After the reduce-scatter each rank holds one number, the sum for the parameter it owns; after
the all-reduce each rank holds all four sums. Same additions, a quarter of the result per rank.

### Are the sums all 1.0?

The example usually comes with the claim that every parameter's summed gradient is exactly
1.0. Each column below is added once with exact decimal arithmetic (Python's `fractions`)
and three ways in float32: by the ring reduce-scatter, by torch's reduce-scatter (both from
the table above), and by one process adding the four rows (`torch.tensor(GRADS).sum(0)`).
The last columns count how many float32 numbers each float32 result lies from 1.0: 0 means
exactly 1.0, +1 the next float32 above it.
"""),
    code("""
exact = [sum(fractions.Fraction(str(g[c])) for g in GRADS) for c in range(4)]
one_process = torch.tensor(GRADS).sum(dim=0)

def off(value):
    # float32 bit patterns of positive numbers are ordered like the numbers: subtracting
    # them counts the float32 values in between
    bits = torch.tensor([value, 1.0], dtype=torch.float32).view(torch.int32)
    return int(bits[0] - bits[1])

rows = []
for c in range(4):
    ring, builtin = results[c][0].item(), results[c][1].item()
    rows.append([PARAMS[c], str(exact[c]), ring, builtin, one_process[c].item(),
                 off(ring), off(builtin), off(one_process[c].item())])
print(format_table(["param", "exact sum", "ring (float32)", "torch (float32)", "one process",
                    "ring: floats from 1", "torch: floats from 1", "one process: floats from 1"],
                   rows))
"""),
    code("""
print("exact sums equal to 1:", [PARAMS[c] for c in range(4) if exact[c] == 1])
for name, values in [("ring", [r[0].item() for r in results]),
                     ("torch", [r[1].item() for r in results]),
                     ("one process", one_process.tolist())]:
    print(f"{name:>12}: float32 sums that are not exactly 1.0:",
          [PARAMS[c] for c in range(4) if values[c] != 1.0])
print("params where the two reduce-scatters disagree:",
      [PARAMS[c] for c in range(4) if results[c][0].item() != results[c][1].item()])
print("params where torch's reduce-scatter differs from torch's all-reduce:",
      [PARAMS[c] for c in range(4) if results[c][1].item() != results[c][2][c].item()])
""", CHECK),
    md(r"""
With exact arithmetic the claim can be checked column by column, and the first line says
which sums are 1. The ranks, though, do not add decimals: 0.1, 0.2, 0.3 and 0.4 have no exact
float32 form, and each addition rounds. Whether a float32 sum lands exactly on 1.0 then depends
on the **order** of the additions, and the three float32 ways add in different orders. The
ring starts chunk $c$ on rank $c+1$ and goes round the ring to rank $c$. torch's
reduce-scatter on gloo is an all-reduce inside: it all-reduces a copy of the whole tensor
and keeps this rank's chunk (more on that under "While it runs" below), so its sums
are gloo's all-reduce's, as the last line confirms. `sum(0)` adds the rows top to bottom.
The lines above list where the order showed. A difference of a float32 step or two is
harmless for training, but it is why the results of different collective implementations are
compared with a tolerance, not bit for bit. Within one implementation nothing can disagree:
each chunk of the result exists on one rank only, the rank that owns it, and when an
all-gather later copies it to the others (chapter 4) they all receive the same bits.

## The first phase of the ring

Chapter 2's ring all-reduce runs in two phases. In the first, at step $k = 0, \dots, N-2$,
rank $r$ sends chunk $(r-k-1) \bmod N$ to rank $r+1$ and receives chunk $(r-k-2) \bmod N$ from
rank $r-1$, adding its own part of that chunk to it. After $N-1$ steps the chunk it has just
completed is chunk $r$, summed over all ranks. Stop there, and that is a reduce-scatter: it is
what `ring_reduce_scatter` does, leaving its input untouched and accumulating in buffers of
its own.

The trace below records every step on every rank (`Recorder(trace=True)`). As in chapter 2,
element $i$ of rank $r$'s tensor is $(i+1)\cdot 10^r$, so the digit in position $r$ of a
partial sum says whether rank $r$'s contribution is already in it: 1111 is a finished sum of
four ranks, 11 holds ranks 0 and 1 only.
"""),
    code("""
trace = run_ring_trace(4, TraceSettings(collective=Collective.REDUCE_SCATTER, numel=8))
print(format_table(["rank", "input (8 elements, 4 chunks)", "returned: its chunk of the sum"],
                   [[r, list(trace.inputs[r]), list(trace.outputs[r])] for r in range(4)]))
"""),
    code("""
print(ring_trace_table(trace.steps))
""", CHECK),
    md(r"""
Read the "chunk after" column for rank 0: one more digit appears at each step, and at the
last step the chunk it completes is chunk 0. The animation replays the same trace (colour:
how many ranks' contributions a chunk holds):
"""),
    code("""
ring_animation(trace.steps, trace.world_size, trace.numel)
""", HIDE),
    md(r"""
### Bytes sent: (N-1)/N · S

Each rank sends one chunk per step for $N-1$ steps. With $S$ the bytes of the whole tensor and
equal chunks of $S/N$, that is $\frac{N-1}{N}S$ per rank, half of the ring all-reduce's
$2\frac{N-1}{N}S$. A `Recorder` counts the bytes each rank really passes to `isend`; the
tensor has 840 float32 elements, which every $N$ from 2 to 8 divides:
"""),
    code("""
def reduce_scatter_traffic(rank, world_size, numel):
    recorder = Recorder()
    gradient = torch.ones(numel, device=rank_device())
    collectives.ring_reduce_scatter(gradient, recorder=recorder, segment_bytes=None)
    return recorder.stats

NUMEL = 840
S = NUMEL * 4
rows = []
for n in range(2, 9):
    stats = launch(reduce_scatter_traffic, n, args=(NUMEL,), echo=False)
    sent = {fractions.Fraction(s.bytes_sent, S) for s in stats}
    received = {fractions.Fraction(s.bytes_received, S) for s in stats}
    formula = fractions.Fraction(n - 1, n)
    rows.append([n, " ".join(map(str, sorted(sent))), " ".join(map(str, sorted(received))),
                 str(formula), max(s.messages_sent for s in stats),
                 "yes" if sent == received == {formula} else "NO"])
print(format_table(["N", "sent / S (every rank)", "received / S", "(N-1)/N",
                    "messages per rank", "match"], rows))
""", CHECK),
    md(r"""
Every rank sends exactly as much as every other, whatever $N$ is, and the total approaches
$S$ from below. No algorithm can send less. Take one element of the result: its $N$
contributions start on $N$ different ranks and must end up added together on one. Call the
contributions already combined in one place a group: there are $N$ groups at the start and
one at the end, and a message carrying that element (a contribution or a partial sum) merges
at most two groups into one. So every element travels at least $N-1$ times: each chunk of
$\frac{S}{N}$ bytes costs at least $(N-1)\frac{S}{N}$ bytes of messages, and the whole
reduce-scatter at least $(N-1)S$, summed over all ranks. That is $\frac{N-1}{N}S$ per rank on
average, so the busiest rank sends at least that much. The ring sends exactly that on every
rank: it is bandwidth-optimal, as the ring all-reduce is.

## Memory, measured

The usual selling point of reduce-scatter is memory: each rank keeps $1/N$ of the result.
Instead of assuming that, `labs.memory` measures it. A `MemoryTimeline` counts, at named
moments, the bytes of the tensor storages a rank holds (each storage once, however many views
point into it; a tensor the code has let go of drops out by itself), and an
`AllocationTracker` records every storage created by the PyTorch operators that a block
calls, so the buffers of a collective written in Python, like the ring, are all seen; what a
built-in collective allocates inside its own C++ operator is not (see "While it runs"
below). Both count tensor bytes, not the process's
resident memory or the allocator's cache: that is what a formula in $S$ and $N$ talks about,
and on a CPU it is exactly reproducible. Here is what each rank runs:
"""),
    code("""
display(Code(inspect.getsource(reduce_scatter_memory), language="python"))
""", ["hide-output"]),
    md(r"""
For $N = 1, \dots, 8$, a gradient of 840 float32 elements, so that every chunk has the
same size:
"""),
    code("""
settings = ShardMemorySettings(numel=840)
S = settings.nbytes
runs = {n: launch(reduce_scatter_memory, n, args=(settings,), echo=False) for n in range(1, 9)}

def held(per_rank, moment):
    return sorted({find(snaps, moment).held_bytes for snaps in per_rank})

rows = []
for n, per_rank in runs.items():
    shard = held(per_rank, ReduceScatterMoment.FREED)
    rows.append([n, S, " ".join(map(str, shard)), str(fractions.Fraction(shard[0], S)),
                 " ".join(map(str, held(per_rank, ReduceScatterMoment.AFTER)))])
print(format_table(["N", "gradient S (bytes)", "result on each rank (bytes)", "result / S",
                    "gradient + result (bytes)"], rows))
"""),
    code("""
print(check_held_bytes(runs, ReduceScatterMoment.FREED, lambda n, rank: S // n,
                       "the reduce-scatter result is S/N bytes on every rank"))
print(check_held_bytes(runs, ReduceScatterMoment.AFTER, lambda n, rank: S + S // n,
                       "until the gradient is freed a rank holds S + S/N"))
""", CHECK),
    md(r"""
The result is $1/N$ of the input on every rank. But look at the last column: as long as the
full gradient is still referenced, the rank holds $S + S/N$, *more* than before the
collective.

### While it runs

The ring accumulates partial sums in chunk-sized buffers of its own, so that its input is
left as it was. The tracker lists every storage created during the call; here they are for
each $N$, for the ring of `labs.collectives` and for torch.distributed's reduce-scatter (on
gloo). Its peak is the most bytes of those new storages alive at one time, on top of the
gradient the rank already holds:
"""),
    code("""
torch_runs = {n: launch(reduce_scatter_memory, n,
                        args=(ShardMemorySettings(numel=840, algorithm=Algorithm.TORCH),),
                        echo=False)
              for n in (2, 4, 8)}
rows = []
for algorithm, table in [(Algorithm.RING, runs), (Algorithm.TORCH, torch_runs)]:
    for n, per_rank in table.items():
        during = find(per_rank[0], ReduceScatterMoment.DURING)
        rows.append([algorithm.value, n, S // n, during.transient_bytes,
                     str(fractions.Fraction(during.transient_bytes * n, S)),
                     describe_allocations(during.allocations)])
print(format_table(["algorithm", "N", "S/N (bytes)", "peak allocated during",
                    "peak / (S/N)", "storages created on rank 0 (operator, bytes)"], rows))
""", CHECK),
    md(r"""
The allocations column accounts for the peak. The ring creates three chunk-sized storages:
the two accumulators that partial sums alternate between (`empty`, twice) and the returned
chunk (`clone`, a copy so that the result does not keep an accumulator alive). Each incoming
chunk lands straight in an accumulator, so the ring needs no other receive buffers. With
$N \ge 3$ both accumulators are still alive when the copy is made, and the peak is three
chunks. With $N = 2$ the ring has a single step, which uses only the first accumulator; the
second is dropped before the copy is made, so the peak is two chunks. At $N = 1$ there is no
ring at all, only the copy that is returned. So the peak is $S$ for $N = 1$, 2 and 3 (one, two
and three chunks of $S/N$), and $3S/N$ from $N = 3$ on: past three ranks the transient cost
shrinks as $N$ grows.

For torch's reduce-scatter the tracker lists one storage: the output that
`labs.collectives.reduce_scatter` allocates for it (840 elements divide into $N$ equal chunks,
so no padded copy of the input is needed). That is not all the call uses. PyTorch's gloo
backend has no reduce-scatter of its own: inside its C++ operator it clones the whole input
($S$ bytes), all-reduces the clone, and copies this rank's chunk into the output. The tracker
sees only the operators called from Python, not the tensors made inside one, so for torch's
collective the peak in the table leaves out that $S$-byte clone.

### "75% less memory"

The same example is often summed up as: all-reduce stores $4 \times 4 = 16$ values, reduce-scatter
$4 \times 1 = 4$, so reduce-scatter saves 75%. Here is that example measured on four ranks,
4 float32 gradients per rank:
"""),
    code("""
seed_case = launch(reduce_scatter_memory, 4, args=(ShardMemorySettings(numel=4),), echo=False)
print(memory_table(seed_case, ranks=(0, 1)))
""", CHECK),
    code("""
fig = plot_memory_timeline(seed_case, title="Reduce-scatter of 4 gradients on 4 ranks")
""", HIDE),
    code("""
gradient = find(seed_case[0], ReduceScatterMoment.GRADIENT).held_bytes
for moment in (ReduceScatterMoment.AFTER, ReduceScatterMoment.FREED):
    snap = find(seed_case[0], moment)
    print(f"rank 0, {snap.moment}: {snap.held_bytes} bytes = "
          f"{snap.held_bytes / gradient:.0%} of the full gradient")
""", CHECK),
    md(r"""
The 75% is real only in the last moment, after the full gradient is gone. A reduce-scatter
does not free anything by itself: it *adds* the shard, and while it runs it adds its buffers
too. The saving appears when the code that produced the full gradient lets it go. That is
what ZeRO stage 2 and FSDP do: as backward produces each layer's gradient, they
reduce-scatter it and free the full one at once, so at no time does a rank hold the full
gradients of the whole model. Plain data parallelism (DDP) cannot free them: every rank needs
every gradient for its full optimizer step.

The same story goes on to say that this lets a model grow from "GPU memory / 4" to "GPU
memory × number of GPUs / 4". That is not a memory count: parameters, gradients and
optimizer states take different numbers of bytes each, and activations depend on the batch.
Chapter 6 builds the count from measured tensors instead.

## Why ZeRO and FSDP need it

ZeRO (Rajbhandari et al., [arXiv:1910.02054](https://arxiv.org/abs/1910.02054)) splits the
training state over the ranks in three stages. Stage 1 shards the optimizer state and
stage 2 the gradients too; both keep the full parameters on every rank. Stage 3, which
PyTorch's FSDP implements, shards the parameters as well. In every stage each rank updates
only its own shard of the parameters, so it needs only the gradient of *its* shard, summed
over all ranks: exactly what a reduce-scatter delivers.

What follows the update differs. In stages 1 and 2 the ranks swap the updated shards with an
**all-gather** (chapter 4), so that every rank again holds all the parameters for the next
forward pass. In stage 3 and FSDP the parameters stay sharded: the parameters of each unit
(a layer or a group of layers) are all-gathered just before the unit runs, in forward and
again in backward, and freed after. Chapter 6 builds both.

The update from the example, on real ranks, as stages 1 and 2 do it: rank $r$ owns parameter
$r$, updates it, and all-gathers. The example's update subtracts the learning rate times the
*summed* gradient; data-parallel training uses the mean (chapter 1), so both are shown. The
example gives no starting values, so every parameter starts at 0.5, as in chapter 1. Each
rank also runs the ordinary data-parallel step for comparison: all-reduce the whole gradient,
then update every parameter; the check after the table compares the two.
"""),
    code("""
LR = 0.001

def sharded_step(rank, world_size, grads, start, lr):
    grad = torch.tensor(grads[rank], device=rank_device())   # full gradient, needed until here
    params = torch.tensor(start, device=rank_device())       # the same on every rank
    bounds = shard_bounds(params.numel(), world_size)
    mine = params[bounds[rank]:bounds[rank + 1]].clone()    # the shard this rank owns
    summed = collectives.ring_reduce_scatter(grad)          # its chunk of the summed gradient
    mean = summed / world_size
    seed_rule = mine - lr * summed                    # the example's update (summed gradient)
    mine -= lr * mean                                 # update the owned shard only
    updated = collectives.ring_all_gather(mine, numel=params.numel())   # chapter 4
    reference = grad.clone()                          # data parallel: all-reduce everything,
    collectives.ring_all_reduce(reference)            # then every rank updates everything
    reference = params - lr * (reference / world_size)
    return summed, mean, seed_rule, mine, updated, reference

START = (0.5, 0.5, 0.5, 0.5)
steps = launch(sharded_step, 4, args=(GRADS, START, LR), echo=False)
rows = [[r, PARAMS[r], START[r], s[0].item(), s[2].item(), s[1].item(), s[3].item()]
        for r, s in enumerate(steps)]
print(format_table(["rank", "owns", "start", "summed grad", "p - lr*sum (example)",
                    "mean grad", "p - lr*mean (owned shard)"], rows))
"""),
    code("""
def bit_for_bit(steps):
    same = all(torch.equal(s[4], s[5]) for s in steps)
    everywhere = all(torch.equal(s[4], steps[0][4]) for s in steps)
    return same and everywhere

print("after the all-gather every rank holds", steps[0][4].tolist())
print("sharded update + all-gather == all-reduce + full update, bit for bit, on every rank:",
      bit_for_bit(steps))
generator = torch.Generator().manual_seed(0)
RANDOM_NUMEL = 1001   # 4 does not divide it: uneven chunks
random_grads = torch.randn(4, RANDOM_NUMEL, generator=generator).tolist()
random_start = torch.randn(RANDOM_NUMEL, generator=generator).tolist()
random_steps = launch(sharded_step, 4, args=(random_grads, random_start, LR), echo=False)
print(f"the same with random gradients and parameters, {RANDOM_NUMEL} elements:",
      bit_for_bit(random_steps))
""", CHECK),
    md(r"""
Same parameters, bit for bit, on every rank. With the example's values that shows little,
since every start and every summed gradient is the same; the last line repeats the step with
random gradients and starting values, and uneven chunks. The equality is no accident: the
ring all-reduce *is* a reduce-scatter followed by an all-gather, so the sharded step adds the
same numbers in the same order (chapter 4 checks this for the two collectives alone). What
changed is who does the work and who holds what: each rank updated one parameter instead of
four, and an optimizer with state (momentum, Adam's moments) would keep that state for its
shard only. Chapter 6 measures what that saves.

## Try it

The panel times the ring reduce-scatter against torch.distributed's on real ranks, for the
world size and message size you choose. Below it is the default run (4 ranks, 1 MiB). The
bus bandwidth column uses the factor $\frac{N-1}{N}$ of a reduce-scatter, so it can be
compared with the link speed whatever $N$ is. For torch on gloo that factor understates the
traffic: as "While it runs" explained, and as the bit-for-bit match with gloo's all-reduce
in the float32 check above bears out, its reduce-scatter is an all-reduce of the whole tensor,
which on a ring sends twice the bytes of the ring reduce-scatter: a likely reason why the
ring can beat it here.
The shell command's `--iters` is the number of timed calls for large sizes; smaller sizes get
more, enough to carry a fixed number of bytes (`--min-bytes`), so the table's median can be
over more calls than `--iters` says.
"""),
    code("""
collective_panel(Collective.REDUCE_SCATTER, world_size=4)
"""),
    md(r"""
## Exercise 3.1: a ring reduce-scatter

Write `ring_reduce_scatter(tensor)`: called on every rank, it returns on rank $r$ a new 1-D
tensor holding chunk $r$ of the element-wise sum over ranks of the flattened `tensor`, and
leaves `tensor` unchanged.

* Use only point-to-point calls: `dist.isend`/`dist.irecv`, `dist.send`/`dist.recv` or
  `dist.batch_isend_irecv` with `dist.P2POp`. The check makes torch.distributed's
  collectives raise.
* Chunks are `shard_bounds(numel, N)` (imported above): chunk $i$ is
  `flat[bounds[i]:bounds[i+1]]`. Some are one element longer, some may be empty (skip the
  messages of an empty chunk; both neighbours will).
* At step $k$ rank $r$ sends its partial sum of chunk $(r-k-1) \bmod N$ to the right and adds
  the partial sum of chunk $(r-k-2) \bmod N$ that arrives from the left to its own part.
* Each rank may send at most $N-1$ chunks of $\lceil \text{numel}/N \rceil$ elements: the
  ring's $\frac{N-1}{N}S$, rounded up to whole chunks when $N$ does not divide numel. The
  check counts the bytes.

The check runs your function on 1 to 5 real ranks, with tensors that $N$ divides and tensors
it does not, and names the first thing that is wrong.
"""),
    solution("""
def ring_reduce_scatter(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1)
    bounds = shard_bounds(flat.numel(), n)

    def chunk(i):
        i %= n
        return flat[bounds[i]:bounds[i + 1]]

    partial = chunk(rank - 1).clone()      # a copy: the input must stay as it was
    for k in range(n - 1):
        own = chunk(rank - k - 2)
        arriving = torch.empty_like(own)
        ops = []
        if partial.numel():
            ops.append(dist.P2POp(dist.isend, partial, (rank + 1) % n))
        if arriving.numel():
            ops.append(dist.P2POp(dist.irecv, arriving, (rank - 1) % n))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        partial = arriving + own           # now holds this rank's contribution too
    return partial                         # chunk `rank`, summed over all ranks
""", "3.1"),
    check("""
result = check_ring_reduce_scatter(ring_reduce_scatter)
""", "3.1"),
    md(r"""
## Summary

* A **reduce-scatter** sums the ranks' tensors like an all-reduce, but rank $r$ receives
  only chunk $r$ of the sum. `torch.distributed` has one built in; `labs.collectives` builds
  it from point-to-point messages, and both give each rank the same chunk (up to the order of
  float32 additions, which can move the last bit).
* It is the first phase of the ring all-reduce: $N-1$ steps, each rank sending and receiving
  $\frac{N-1}{N}S$ bytes, the least any algorithm can.
* Measured: the result is $S/N$ bytes on every rank. The saving over an all-reduce is real
  only once the full gradient is freed; until then a rank holds $S + S/N$, and while the ring
  runs it also holds chunk-sized buffers.
* ZeRO and FSDP reduce-scatter gradients so that each rank gets exactly the gradient of the
  shard it owns and updates. ZeRO stages 1 and 2 then all-gather the updated parameters on
  every rank; stage 3 and FSDP keep them sharded and all-gather each unit's parameters when
  it runs, in forward and again in backward.

Next, chapter 4 looks at that all-gather: the ring's second phase.
"""),
]

write_notebook(cells, "03_reduce_scatter.ipynb")
