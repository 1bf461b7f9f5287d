"""Writes notebooks/04_all_gather.ipynb (source cells only; `make notebooks` executes it).

Kept as a script so the chapter can be regenerated and reviewed as plain text; edit here,
then run `make notebooks`.
"""

from nbgen import CHECK, HIDE, check, code, md, setup, solution, write_notebook

cells = [
    md(r"""
# All-gather

In an **all-gather** every rank contributes one shard and every rank receives all of them,
concatenated in rank order. With $x_k$ the shard of rank $k$,

$$
y \;=\; \big[\,x_0,\; x_1,\; \dots,\; x_{N-1}\,\big] \qquad \text{on every rank.}
$$

Nothing is added: the result is as large as all the shards together. Chapter 3's ZeRO
section used one: after each rank had updated the shard of parameters it owns, the ranks swapped the updated
shards so that every rank held all the parameters again. FSDP uses it differently: its
parameters stay in shards, and a layer's full weights are all-gathered just before the layer
runs, in forward and again in backward, then let go.

This chapter:

1. runs an all-gather of a sharded weight matrix on real ranks and uses the result;
2. shows that it is the ring all-reduce's second phase, with the trace and the bytes sent;
3. measures what a rank holds before, during and after the gather;
4. puts the two halves together: a reduce-scatter followed by an all-gather *is* the ring
   all-reduce, bit for bit;
5. ends with a panel and two exercises.
"""),
    setup("""
from fractions import Fraction

import torch
import torch.distributed as dist

from labs import collectives, launch, rank_device
from labs.checks import check_composed_all_reduce, check_ring_all_gather
from labs.collectives import Collective, Recorder, shard_bounds
from labs.experiments import TraceSettings, run_ring_trace
from labs.memory import (
    AllGatherMoment, AllocationTracker, MemoryTimeline, ShardMemorySettings, all_gather_memory,
    describe_allocations, find, memory_table, plot_memory_timeline,
)
from labs.viz import format_table, ring_animation, ring_trace_table
from labs.widgets import collective_panel

# torch.distributed's own all-gather into one output tensor: newer PyTorch calls it
# all_gather_single, older versions all_gather_into_tensor (same arguments).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""),
    md(r"""
## What it computes: a sharded weight matrix

A common illustration: the $4 \times 4$ query weight `W_query` of an attention layer, sharded
over four ranks, one row each.
"""),
    code("""
W_QUERY = (
    (0.1, 0.2, 0.3, 0.4),  # row 0, owned by rank 0
    (0.5, 0.6, 0.7, 0.8),  # row 1, rank 1
    (0.9, 1.0, 1.1, 1.2),  # row 2, rank 2
    (1.3, 1.4, 1.5, 1.6),  # row 3, rank 3
)
W = torch.tensor(W_QUERY)  # the whole matrix, in this (single) notebook process
print(format_table(["rank", "its shard: one row of W_query"],
                   [[r, list(row)] for r, row in enumerate(W_QUERY)]))
"""),
    md(r"""
Each rank gathers the rows with the ring all-gather of `labs.collectives` (built from
`isend`/`irecv` only) and with torch.distributed's own, and both results are compared with the
matrix as one process holds it:
"""),
    code("""
def gather_rows(rank, world_size, w):
    row = torch.tensor(w[rank], device=rank_device())  # this rank's shard: 4 elements
    ring = collectives.ring_all_gather(row)            # 1-D, 16 elements, rows in rank order
    builtin = torch.empty(world_size * row.numel(), device=row.device)
    all_gather_single(builtin, row)                    # torch.distributed's own
    return row, ring, builtin

gathered = launch(gather_rows, world_size=4, args=(W_QUERY,))
rows = [[r, row.numel(), ring.numel(), torch.equal(ring.view(4, 4), W),
         torch.equal(builtin.view(4, 4), W)]
        for r, (row, ring, builtin) in enumerate(gathered)]
print(format_table(["rank", "shard elements", "gathered elements", "ring == W (bits)",
                    "torch == W (bits)"], rows))
print("rank 2's gathered tensor, viewed as 4 x 4:")
print(gathered[2][1].view(4, 4))
""", CHECK),
    md(r"""
No arithmetic happens, so unlike a reduce-scatter there is no rounding to disagree about:
every rank holds exactly the bits of `W`.

## The second phase of the ring

In chapter 2's ring all-reduce, once the first phase has left rank $r$ with chunk $r$ of
the sum, the second phase passes finished chunks round the ring: at step $k = 0, \dots, N-2$
rank $r$ sends chunk $(r-k) \bmod N$ (its own at step 0, then whatever it received last) to
rank $r+1$, and stores chunk $(r-k-1) \bmod N$ arriving from rank $r-1$. After $N-1$ steps
every rank has every chunk. That phase alone, started from shards, is `ring_all_gather`.

The trace uses chapter 2's encoding again: element $i$ of rank $r$'s tensor is
$(i+1)\cdot 10^r$, and rank $r$ starts with chunk $r$ of its tensor only.
"""),
    code("""
trace = run_ring_trace(4, TraceSettings(collective=Collective.ALL_GATHER, numel=8))
print(format_table(["rank", "its shard", "returned"],
                   [[r, list(trace.inputs[r]), list(trace.outputs[r])] for r in range(4)]))
"""),
    code("""
print(ring_trace_table(trace.steps))
""", CHECK),
    code("""
ring_animation(trace.steps, trace.world_size, trace.numel)
""", HIDE),
    md(r"""
### Bytes sent: (N-1)/N · S

Here $S$ is the size of the *result*. Each rank sends one chunk of $S/N$ per step for $N-1$
steps, $\frac{N-1}{N}S$ in all, and receives as much: exactly the $N-1$ shards it did not
have, which is the least any algorithm can deliver. Measured with a `Recorder`, for a result
of 840 float32 elements:
"""),
    code("""
def all_gather_traffic(rank, world_size, numel):
    bounds = shard_bounds(numel, world_size)
    recorder = Recorder()
    shard = torch.ones(bounds[rank + 1] - bounds[rank], device=rank_device())
    collectives.ring_all_gather(shard, numel=numel, recorder=recorder, segment_bytes=None)
    return recorder.stats

NUMEL = 840
S = NUMEL * 4
rows = []
for n in range(2, 9):
    stats = launch(all_gather_traffic, n, args=(NUMEL,), echo=False)
    sent = {Fraction(s.bytes_sent, S) for s in stats}
    received = {Fraction(s.bytes_received, S) for s in stats}
    formula = Fraction(n - 1, n)
    rows.append([n, " ".join(map(str, sorted(sent))), " ".join(map(str, sorted(received))),
                 str(formula), max(s.messages_sent for s in stats),
                 "yes" if sent == received == {formula} else "NO"])
print(format_table(["N", "sent / S (every rank)", "received / S", "(N-1)/N",
                    "messages per rank", "match"], rows))
""", CHECK),
    md(r"""
## Using the gathered weights: queries for "I love cats"

The illustration continues: rank 0 wants the queries of the three tokens "I", "love", "cats",
whose embeddings are the rows of $X$ ($3 \times 4$). With its one row it can compute only one
row of $W X^\top$; with the gathered matrix it computes all of it, $4 \times 3$. Every rank
does the same here, and each records what it holds with a `MemoryTimeline` (chapter 3): the
bytes of the tensor storages it registered, each storage counted once, and a tensor dropping
out of the count as soon as nothing refers to it any more. The embeddings are not
registered: they are the same at every moment.
"""),
    code("""
X_TOKENS = (
    (1.0, 0.5, 0.2, 0.8),  # "I"
    (0.3, 1.2, 0.9, 0.4),  # "love"
    (0.7, 0.1, 1.5, 0.6),  # "cats"
)

def queries_with_gathered_weights(rank, world_size, w, x):
    timeline = MemoryTimeline(rank)
    shard = torch.tensor(w[rank], device=rank_device())   # row `rank` of W_query, 4 elements
    embeddings = torch.tensor(x, device=rank_device())    # 3 tokens x 4
    timeline.record("before all-gather", shard=shard)
    with AllocationTracker() as during:
        gathered = collectives.ring_all_gather(shard)  # 1-D, 16 elements
    timeline.record("during all-gather", during=during)
    weight = gathered.view(world_size, -1)             # 4 x 4: a view, no new storage
    timeline.record("after all-gather", gathered=gathered, weight=weight)
    queries = weight @ embeddings.T                    # 4 x 3
    timeline.record("queries computed", queries=queries)
    del gathered, weight                               # give the borrowed rows back
    timeline.record("borrowed rows freed")
    return queries, timeline.snapshots

runs = launch(queries_with_gathered_weights, 4, args=(W_QUERY, X_TOKENS), echo=False)
queries = [q for q, _ in runs]
timelines = [snaps for _, snaps in runs]
X = torch.tensor(X_TOKENS)
reference = W @ X.T                                    # one process, the whole matrix
print("queries on rank 0 (rows: rows of W_query; columns: I, love, cats):")
print(queries[0])
""", CHECK),
    code("""
worst = max(float((q - reference).abs().max()) for q in queries)
print("every rank's queries equal W @ X.T computed in one process (to 1e-6):", worst < 1e-6)
print("and bit for bit:", all(torch.equal(q, reference) for q in queries))
""", CHECK),
    md(r"""
The text this example comes from prints its own query matrix. Beside the one computed here:
"""),
    code("""
PRINTED = torch.tensor([[0.49, 0.43, 0.61],
                        [1.18, 1.20, 1.41],
                        [1.87, 1.97, 2.21],
                        [2.56, 2.74, 3.01]])
TOKENS = ("I", "love", "cats")
# Four decimals: the last bits of a float32 matrix product depend on the CPU's kernels.
rows = [[i, TOKENS[j], f"{float(PRINTED[i, j]):.2f}", f"{float(reference[i, j]):.4f}",
         f"{float(reference[i, j] - PRINTED[i, j]):.4f}"]
        for i in range(4) for j in range(3)]
print(format_table(["row of W", "token", "printed", "W @ X.T", "difference"], rows))
agree = int(((reference - PRINTED).abs() < 0.005).sum())
print(f"entries that agree to 2 decimals: {agree} of {PRINTED.numel()}")
""", CHECK),
    md(r"""
The printed matrix is not $W X^\top$; the count above says how many of its twelve entries
survive rounding to two decimals. Entry (0, 0), for instance, is
$0.1 \cdot 1.0 + 0.2 \cdot 0.5 + 0.3 \cdot 0.2 + 0.4 \cdot 0.8$, which the table shows next
to the printed value. The shapes in the illustration are right, $(4 \times 4)(4 \times 3) =
4 \times 3$; its numbers are not those of $W X^\top$.

## What a rank holds

The timelines recorded above, for ranks 0 and 1, in elements per group and in bytes:
"""),
    code("""
print(memory_table(timelines, ranks=(0, 1)))
""", CHECK),
    code("""
fig = plot_memory_timeline(timelines, title="All-gather of W_query and the queries, 4 ranks")
""", HIDE),
    md(r"""
The same illustration sums this up as "4 parameters before, 16 during, 4 after". Counted in
W_query's elements on rank 0, as measured:
"""),
    code("""
def weight_elements(snap):
    by_group = snap.elements_by_group()
    return sum(by_group.get(g, 0) for g in ("shard", "gathered", "weight"))

for snap in timelines[0]:
    extra = (f" + {snap.transient_bytes} bytes allocated inside the call"
             if snap.transient_bytes else "")
    print(f"{snap.moment:>20}: {weight_elements(snap):2d} elements of W_query, "
          f"{snap.held_bytes:3d} bytes held in all{extra}")
during = timelines[0][1]
print("storages created inside the all-gather:", describe_allocations(during.allocations))
""", CHECK),
    md(r"""
Compared with "4, 16, 4", the lines above differ in one way, which shows at two moments:
the rank's own row stays a separate tensor, so while the gathered matrix exists the rank
holds $N+1$ rows, not $N$.

* During the call: the only storage the call creates is its output, the size of the whole
  matrix (the last line). The ring receives every row straight into its place in that
  output, with no receive buffers of its own, so the rank holds its row plus the output:
  that is the "allocated inside the call" part.
* After the call: its own row **and** the gathered matrix, which contains that row again.
  The shard must survive the free, so it is kept apart. (An implementation can avoid the
  copy by gathering into a buffer whose slice $r$ *is* the shard; the timeline would then
  count that storage once.)

Two other things in the lines are not differences. `weight` is a view of `gathered` and adds
nothing: the table shows no elements for it. And the bytes held in all include the queries,
an activation, which stay after the borrowed rows are freed; in a real model they are what
the next layer consumes.

### Freeing means dropping every reference

"Throw away the borrowed rows" is a `del`, but only if nothing else still points into the
gathered storage. A single row kept as a view keeps all 16 elements alive:
"""),
    code("""
timeline = MemoryTimeline()
gathered_copy = W.reshape(-1).clone()                  # stands in for a gathered tensor
first_row = gathered_copy.view(4, 4)[0]                # a view that outlives the matrix
timeline.record("gathered", gathered=gathered_copy)
del gathered_copy
timeline.record("del gathered, one row view kept", row=first_row)
del first_row
timeline.record("row view dropped too")
for snap in timeline.snapshots:
    print(f"{snap.moment:>32}: {snap.held_bytes} bytes")
""", CHECK),
    md(r"""
### At the scale of a real layer

The illustration's real-scale example: a $768 \times 768$ `W_query` over 4 ranks, "192 × 768 =
147,456 parameters per rank (25%) most of the time, 589,824 during the all-gather". The
arithmetic first, then the same gather measured on four real ranks with
`all_gather_memory` (float32):
"""),
    code("""
full = 768 * 768
per_rank = 192 * 768
print(f"768 x 768 = {full:,}; / 4 = {full // 4:,}; 192 x 768 = {per_rank:,}; "
      f"equal: {full // 4 == per_rank}")
big = launch(all_gather_memory, 4, args=(ShardMemorySettings(numel=full),), echo=False)
rows = []
for snap in big[0]:
    rows.append([snap.moment, snap.held_elements, snap.held_bytes, snap.transient_bytes,
                 f"{snap.total_bytes / (full * 4):.0%}"])
print(format_table(["moment (rank 0)", "elements held", "bytes held",
                    "allocated during (peak bytes)", "total / full matrix"], rows))
""", CHECK),
    code("""
claims = [
    (AllGatherMoment.BEFORE, per_rank, "between gathers a rank holds 147,456 parameters"),
    (AllGatherMoment.AFTER, full, "with the matrix gathered a rank holds 589,824 parameters"),
]
for moment, claimed, claim in claims:
    held = sorted({find(snaps, moment).held_elements for snaps in big})  # over all 4 ranks
    verdict = "holds" if held == [claimed] else "does not hold"
    print(f"{verdict}: {claim}; measured at {moment.value!r}, every rank: "
          f"{' or '.join(f'{h:,}' for h in held)} parameters")
""", CHECK),
    md(r"""
The first line checks the per-rank share between gathers. The second checks "589,824
during the all-gather" against what a rank holds once the matrix is gathered: the full
matrix *plus* its own shard. The call itself needs no more than that. The only storage it
creates is its output, which the ring fills in place, so in the table above the rank's total
during the call (its shard plus what the call allocated) is the same as after it. The peak,
not the average, decides whether a layer fits; chapter 6 measures it for a whole model.

## All-reduce = reduce-scatter + all-gather

Chapter 3's reduce-scatter leaves rank $r$ with chunk $r$ of the sum; this chapter's
all-gather then gives every rank every chunk. Together they are an all-reduce, and for the
ring they are literally the same steps as `ring_all_reduce`. On real ranks, with random
float32 tensors, the composition is compared bit for bit with `ring_all_reduce`, and the
bytes of the two phases are added up. 840 elements divide by every $N$ here; 1001 do not, so
the chunks are uneven:
"""),
    code("""
def composed_vs_ring(rank, world_size, numel, seed):
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=generator).to(rank_device())
    scatter, gather, whole = Recorder(), Recorder(), Recorder()
    shard = collectives.ring_reduce_scatter(x, recorder=scatter)
    composed = collectives.ring_all_gather(shard, numel=numel, recorder=gather)
    reference = x.clone()
    collectives.ring_all_reduce(reference, recorder=whole)
    return (torch.equal(composed, reference), scatter.stats.bytes_sent,
            gather.stats.bytes_sent, whole.stats.bytes_sent)

rows = []
for numel in (840, 1001):
    size = numel * 4
    for n in (2, 3, 4, 8):
        out = launch(composed_vs_ring, n, args=(numel, 0), echo=False)
        busiest = max(out, key=lambda o: o[1] + o[2])
        rows.append([numel, n, all(o[0] for o in out),
                     f"{busiest[1] / size:.4f}", f"{busiest[2] / size:.4f}",
                     f"{(busiest[1] + busiest[2]) / size:.4f}", f"{busiest[3] / size:.4f}",
                     f"{2 * (n - 1) / n:.4f}"])
print(format_table(["numel", "N", "bit-identical to ring_all_reduce (all ranks)",
                    "reduce-scatter / S", "all-gather / S", "sum / S", "ring all-reduce / S",
                    "2(N-1)/N"], rows))
""", CHECK),
    md(r"""
Bit for bit the same, on every rank: the composition adds the same numbers in the same order
as the all-reduce, because it *is* the all-reduce cut in two. Whenever $N$ divides the
tensor, the bytes add up to exactly $2\frac{N-1}{N}S$. With uneven chunks a rank can send a
few elements more, when the longer chunks pass through it, as most of the 1001-element rows
show. Not always: with $N = 2$ each rank sends both chunks once, the longer and the shorter,
so the total is exact.

ZeRO stages 1 and 2 cut the all-reduce at this seam: between the halves each rank holds
only $1/N$ of the summed gradient, and that is when it updates its shard of the parameters
(chapter 3); the all-gather then carries updated parameters instead of gradients. FSDP
(ZeRO stage 3) goes further: it keeps the parameters sharded and all-gathers each layer's
parameters just before they are needed, in forward and again in backward. That is one
all-gather more per step than the two halves of an all-reduce; chapter 6 measures what each
sends.

## Try it

The panel times the ring all-gather against torch.distributed's on real ranks. The size is
that of the gathered result, $S$, and the bus bandwidth uses the factor $\frac{N-1}{N}$. As
in chapter 3, the shell command's `--iters` counts the timed calls at large sizes; smaller
sizes get enough calls to carry a fixed number of bytes (`--min-bytes`), so the table's
median can be over more calls than `--iters` says.
"""),
    code("""
collective_panel(Collective.ALL_GATHER, world_size=4)
"""),
    md(r"""
## Exercise 4.1: a ring all-gather

Write `ring_all_gather(shard, numel)`: rank $i$ holds chunk $i$ of `shard_bounds(numel, N)`
(its length may differ from other ranks' by one, and it may be empty); every rank must return
a new 1-D tensor of `numel` elements holding the shards in rank order.

* Only point-to-point calls (`dist.isend`/`irecv`, `send`/`recv`, `batch_isend_irecv`).
* Allocate the output, copy your shard into its slot, then for $N-1$ steps send chunk
  $(r-k) \bmod N$ to the right and receive chunk $(r-k-1) \bmod N$ from the left, straight
  into its slot.
* At most $N-1$ chunks of $\lceil \text{numel}/N \rceil$ elements sent per rank: the ring's
  $\frac{N-1}{N}S$, $S$ being the size of the result, rounded up to whole chunks when $N$
  does not divide numel.
"""),
    solution("""
def ring_all_gather(shard, numel):
    rank, n = dist.get_rank(), dist.get_world_size()
    bounds = shard_bounds(numel, n)
    out = torch.empty(numel, dtype=shard.dtype, device=shard.device)   # 1-D, S bytes

    def chunk(i):
        i %= n
        return out[bounds[i]:bounds[i + 1]]

    chunk(rank).copy_(shard.reshape(-1))
    for k in range(n - 1):
        outgoing, incoming = chunk(rank - k), chunk(rank - k - 1)
        ops = []
        if outgoing.numel():
            ops.append(dist.P2POp(dist.isend, outgoing, (rank + 1) % n))
        if incoming.numel():
            ops.append(dist.P2POp(dist.irecv, incoming, (rank - 1) % n))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    return out
""", "4.1"),
    check("""
result = check_ring_all_gather(ring_all_gather)
""", "4.1"),
    md(r"""
## Exercise 4.2: an all-reduce from the two halves

Write `all_reduce(tensor)`: in place, on every rank, `tensor` must end up holding the
element-wise sum over ranks, computed by **your** reduce-scatter followed by **your**
all-gather, so each rank sends at most $2(N-1)$ chunks of $\lceil \text{numel}/N \rceil$
elements: the ring all-reduce's $2\frac{N-1}{N}S$, rounded up to whole chunks when $N$ does
not divide numel.

The all-gather is your `ring_all_gather` from Exercise 4.1 above. The reduce-scatter is your
`ring_reduce_scatter` from Exercise 3.1, in chapter 3's notebook: paste it into the next cell,
so that this chapter runs on its own. That cell is part of this exercise, and the check below
runs it through your `all_reduce`. (In the book, its dropdown shows a reference version.)
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
        partial = arriving + own
    return partial
""", "4.2"),
    solution("""
def all_reduce(tensor):
    shard = ring_reduce_scatter(tensor)                 # chunk `rank` of the sum
    total = ring_all_gather(shard, tensor.numel())      # every chunk, on every rank
    tensor.copy_(total.view_as(tensor))                 # in place, like dist.all_reduce
""", "4.2"),
    check("""
result = check_composed_all_reduce(all_reduce)
""", "4.2"),
    md(r"""
## Summary

* An **all-gather** gives every rank every rank's shard, in rank order. No arithmetic: every
  rank ends with the same bits.
* It is the second phase of the ring all-reduce: $N-1$ steps, $\frac{N-1}{N}S$ bytes sent and
  received per rank, $S$ being the gathered size; that is the least possible.
* Measured memory: between gathers a rank holds its shard, $S/N$; once gathered it holds the
  full tensor and its shard, $S + S/N$. The call needs no more: the ring receives straight
  into its output, the only storage it creates. Freeing works only when no view of the
  gathered tensor survives.
* A reduce-scatter followed by an all-gather is the ring all-reduce, bit for bit, for
  $2\frac{N-1}{N}S$ bytes per rank when $N$ divides the tensor. ZeRO stages 1 and 2 split
  the all-reduce at that seam and update the owned shard in between. FSDP keeps the
  parameters sharded and gathers a layer's when it needs them, in forward and again in
  backward: one all-gather more per step, which chapter 6 measures.
"""),
]

write_notebook(cells, "04_all_gather.ipynb")
