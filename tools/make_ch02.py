"""Writes notebooks/02_allreduce_algorithms.ipynb (source cells only; `make notebooks` executes it).

Kept as a script so the chapter can be regenerated and reviewed as plain text; edit here,
then run `make notebooks`.
"""

from nbgen import CHECK, HIDE, IGNORE, check, code, md, setup, solution, write_notebook

cells = [
    md(r"""
# All-reduce algorithms

Chapter 1 called `dist.all_reduce` and trusted it. This chapter builds it. Every algorithm
below uses nothing but point-to-point messages (`isend`, `irecv`) between real ranks, and
each one is measured rather than described:

1. the naive algorithm: everything to one root and back;
2. the whole-tensor ring, a tempting mistake;
3. the ring: reduce-scatter, then all-gather, traced step by step and animated;
4. recursive doubling, for any number of ranks;
5. the messages and bytes each algorithm really sends, beside the formulas;
6. a latency-bandwidth cost model fitted on this machine, and where it is wrong;
7. the ring against torch's built-in all-reduce, and why NCCL switches algorithms by size;
8. a panel to time them yourself, and an exercise: write the ring.
"""),
    setup("""
import inspect
import math
import statistics
import struct
from fractions import Fraction

import torch
import torch.distributed as dist
from IPython.display import Code, display

from labs import launch
from labs.bench_collectives import SweepSettings, plot_busbw, run_sweep, sweep_tables
from labs.checks import check_ring_all_reduce
from labs.collectives import (
    Algorithm, Collective, Recorder, all_reduce, naive_all_reduce,
    recursive_doubling_all_reduce, whole_tensor_ring_all_reduce,
)
from labs.cost_model import (
    coefficients, crossover_bytes, fit_alpha_beta, measured_over_predicted,
    plot_cost_model, predict,
)
from labs.experiments import (
    AgreementSettings, PlanningSettings, TraceSettings, compare_algorithms, expected_traffic,
    measure_planning, measure_traffic, run_ring_trace,
)
from labs.timing import (
    CollectiveCase, P2PPattern, Statistic, format_size, measure_collectives,
)
from labs.viz import (
    agreement_table, format_table, plot_traffic, ring_animation, ring_steps_figure,
    ring_trace_table, traffic_table,
)
from labs.widgets import collective_panel, sweep_command
"""),
    md(r"""
## The problem

$N$ ranks each hold a tensor of the same shape. When the all-reduce returns, every rank must
hold the element-wise sum of all $N$ tensors. A small example often used to introduce it:
three ranks holding `[1, 2, 3]`, `[4, 5, 6]` and `[7, 8, 9]`. Here it is on three real ranks,
summed by the first algorithm of this chapter. (The tensors of this chapter live on the CPU,
so the launches ask for the gloo backend: on a machine with a GPU per rank `launch` would pick
NCCL, which needs CUDA tensors.)
"""),
    code("""
def three_ranks(rank, world_size):
    tensor = torch.tensor([1.0, 2.0, 3.0]) + 3 * rank  # rank 0: 1 2 3, rank 1: 4 5 6, ...
    before = tensor.tolist()
    naive_all_reduce(tensor)  # in place, like dist.all_reduce
    return before, tensor.tolist()

results = launch(three_ranks, world_size=3, backend="gloo")
print(format_table(["rank", "before", "after the all-reduce"],
                   [[rank, before, after] for rank, (before, after) in enumerate(results)]))
""", CHECK),
    md(r"""
Every rank ends with `[12, 15, 18]`. *How* the sums travel is the whole subject of this
chapter, because it decides how long the all-reduce takes, and data-parallel training runs
one for every step.

Throughout, $S$ is the size of the tensor in bytes and $N$ the number of ranks.

## Naive: reduce to a root, broadcast back

The first idea: every rank sends its tensor to rank 0, rank 0 adds them up and sends the sum
back to every rank. The library's version:
"""),
    code("""
display(Code(inspect.getsource(naive_all_reduce), language="python"))
""", ["hide-output"]),
    md(r"""
It is correct, and it sends few messages. Where the time goes shows when we count the traffic
of each rank. A `Recorder` passed to the collective counts every `isend` and `irecv` it makes;
the tensor here holds 840 float32 elements ($S$ = 3360 bytes), and the table gives bytes as
multiples of $S$:
"""),
    code("""
SIZE_NUMEL = 840  # divisible by every N from 1 to 8, so ring chunks are equal
S = 4 * SIZE_NUMEL

def traffic_per_rank(rank, world_size, algorithm):
    recorder = Recorder()
    all_reduce(torch.ones(SIZE_NUMEL), algorithm=algorithm, recorder=recorder)
    return recorder.stats

def per_rank_traffic(algorithm, world_size):
    stats = launch(traffic_per_rank, world_size, args=(algorithm,), backend="gloo")
    rows = [[rank, s.messages_sent, Fraction(s.bytes_sent, S), s.messages_received,
             Fraction(s.bytes_received, S)] for rank, s in enumerate(stats)]
    return format_table(["rank", "msgs sent", "sent / S", "msgs received", "received / S"],
                        rows)

print(per_rank_traffic(Algorithm.NAIVE, world_size=4))
""", CHECK),
    md(r"""
Rank 0 receives $(N-1)\cdot S$ and sends $(N-1)\cdot S$, one tensor after another, through
its one link; every other rank sends and receives a single $S$ and then waits. On a network,
where each rank has a link of its own, the root's link is the bottleneck: its traffic, and so
the all-reduce's time, grows linearly with $N$, however fast the other links are. (On one
machine the "links" are copies made by the CPUs; the timings further down show what that
changes.)

## The whole-tensor ring: correct, and a common mistake

To spread the load, put the ranks in a ring, rank $r$ sending to rank $r+1$ (and $N-1$ to
0). A tempting version passes **whole tensors** round it: at each of $N-1$ steps every rank
sends the tensor it last received to its right and adds the one arriving from its left. No
root, every link busy at once:
"""),
    code("""
display(Code(inspect.getsource(whole_tensor_ring_all_reduce), language="python"))
""", ["hide-output"]),
    code("""
print(per_rank_traffic(Algorithm.WHOLE_TENSOR_RING, world_size=4))
""", CHECK),
    md(r"""
There is no bottleneck any more, but *every* rank now sends $(N-1)\cdot S$, as much as the
naive root did. The ring below does the same job with less than $2S$ per rank.

There is a second, subtler problem. Rank $r$ adds the tensors in its own order: its own
first, then rank $r-1$'s, then rank $r-2$'s... Floating-point addition is not associative, so
$(x_0 + x_2) + x_1$ on rank 0 need not equal $(x_1 + x_0) + x_2$ on rank 1 in the last bit.
Ranks that should hold identical gradients can then drift apart. Every algorithm of this
chapter, and torch's own, run on the same random float32 tensors (4096 standard-normal
elements per rank, a fixed seed), counting the elements at which some rank's bits differ from
rank 0's:
"""),
    code("""
agreement = compare_algorithms(range(2, 9), AgreementSettings(numel=4096, seed=0))
print(agreement_table(agreement))
""", IGNORE),
    md(r"""
The first element at which the three ranks of a 3-rank run disagree, with the order in which
each rank added the three tensors, its float32 result, and that result's bits:
"""),
    code("""
def whole_ring(rank, world_size, settings):
    tensor = settings.tensor(rank)
    whole_tensor_ring_all_reduce(tensor)
    return tensor

settings = AgreementSettings(numel=4096, seed=0)
sums = torch.stack(launch(whole_ring, 3, args=(settings,), backend="gloo"))  # (3 ranks, 4096)
i = int((sums != sums[0]).any(dim=0).nonzero()[0])
inputs = [settings.tensor(r)[i].item() for r in range(3)]
exact = sum(Fraction(x) for x in inputs)  # float32 inputs are exact binary fractions
rows = []
for rank in range(3):
    order = [(rank - k) % 3 for k in range(3)]
    bits = struct.unpack("<I", struct.pack("<f", sums[rank, i].item()))[0]
    rows.append([rank, f"((x{order[0]} + x{order[1]}) + x{order[2]})",
                 f"{sums[rank, i].item():.9g}", f"0x{bits:08x}"])
print(f"element {i}: x0, x1, x2 = " + ", ".join(f"{x:.9g}" for x in inputs)
      + f"; exact sum {float(exact):.12g}")
print(format_table(["rank", "order of additions", "float32 result", "bits"], rows))
""", CHECK),
    code("""
differing = {(row.world_size, row.algorithm): row.differing for row in agreement}
WHOLE = Algorithm.WHOLE_TENSOR_RING
print("whole-tensor ring, 2 ranks: the ranks agree bit for bit:", differing[(2, WHOLE)] == 0)
print("whole-tensor ring, 3 to 8 ranks: the ranks disagree somewhere:",
      all(differing[(n, WHOLE)] > 0 for n in range(3, 9)))
print("naive, ring, recursive doubling: identical bits on every rank for 2 to 8 ranks:",
      all(differing[(n, a)] == 0 for n in range(2, 9)
          for a in (Algorithm.NAIVE, Algorithm.RING, Algorithm.RECURSIVE_DOUBLING)))
""", CHECK),
    md(r"""
With two ranks the whole-tensor ring is safe, because $a + b = b + a$ holds exactly in IEEE
arithmetic; from three ranks on the order matters. The other algorithms compute each element
of the sum once, on one rank (or, in recursive doubling, as $a+b$ on one rank and $b+a$ on its
partner), and copy it, so every rank holds the same bits. The differences from the exact sum
in the `max |error|` column are ordinary float32 rounding, of the same order for every
algorithm: no order is "the" right one, but every rank must use the same.

## The ring: reduce-scatter, then all-gather

The real ring cuts the tensor into $N$ chunks and runs two phases of $N-1$ steps each; at
every step every rank sends one chunk to its right and receives one from its left, all at
once:

* **reduce-scatter**: at step $k$ rank $r$ sends chunk $(r-k-1) \bmod N$ and receives chunk
  $(r-k-2) \bmod N$, adding its own part to it. A partial sum gains one rank per step; after
  $N-1$ steps rank $r$ holds chunk $r$ summed over all ranks.
* **all-gather**: at step $k$ rank $r$ forwards the finished chunk $(r-k) \bmod N$ and stores
  chunk $(r-k-1) \bmod N$. After $N-1$ steps every rank holds every finished chunk.

(Some texts call the first phase "scatter-reduce"; it is the collective that
`torch.distributed` names `reduce_scatter`, the subject of chapter 3; chapter 4 is the
all-gather.) Each rank sends $2(N-1)$ chunks of $S/N$ bytes, $2\frac{N-1}{N}S$ in all: less
than $2S$ however large $N$ is, and no rank does more than any other.

To watch it, a trace: `Recorder(trace=True)` makes every rank record each step with the
values it sent and received. Rank $r$ starts with element $i$ equal to $(i+1)\cdot 10^r$, so
in any partial sum the digit in position $r$ tells whether rank $r$'s contribution is in it:
`1111` is a finished sum over four ranks, `11` holds ranks 0 and 1 only. Four ranks, eight
elements, four chunks of two:
"""),
    code("""
trace = run_ring_trace(4, TraceSettings(numel=8))
print(format_table(["rank", "input"], [[r, list(trace.inputs[r])] for r in range(4)]))
print()
print(ring_trace_table(trace.steps))
""", CHECK),
    md(r"""
Follow chunk 1 (elements 2 and 3, counting from 0) down the "chunk after" column: rank 2 sends its own part
at reduce-scatter step 0, rank 3 adds its digit, rank 0 adds its digit at step 1, and at
step 2 rank 1 completes the chunk, just as rank $r$ completes chunk $r$ in general. The
all-gather then carries each finished chunk round the ring. The same trace
as an animation (press play; colour: how many ranks' contributions a chunk holds, outlines:
the chunk each rank sent and the one that arrived):
"""),
    code("""
ring_animation(trace.steps, trace.world_size, trace.numel)
""", IGNORE),
    md(r"""
And as a single figure, every step at once:
"""),
    code("""
fig = ring_steps_figure(trace.steps, trace.world_size, trace.numel)
""", HIDE),
    md(r"""
Every rank ends with the same values, and with the same bits: each chunk was summed once, by
one chain of additions, and then only copied.
"""),
    code("""
outputs = torch.tensor(trace.outputs)  # (4 ranks, 8 elements)
total = sum(TraceSettings(numel=8).tensor(r) for r in range(4))
print("every rank holds the same bits:", bool((outputs == outputs[0]).all()))
print("and they are the sum:", torch.equal(outputs[0], total), outputs[0].tolist())
print("random float32, 2 to 8 ranks: elements where ring ranks disagree:",
      sum(differing[(n, Algorithm.RING)] for n in range(2, 9)))
""", CHECK),
    md(r"""
## Recursive doubling

The ring needs $2(N-1)$ steps, one after the other. Recursive doubling needs $\log_2 N$: in
round $j$ rank $r$ swaps its whole partial sum with rank $r \oplus 2^j$ (XOR) and adds. After
round $j$ every rank holds the sum over a block of $2^{j+1}$ ranks, so $\log_2 N$ rounds cover
everyone. The price is bytes: each round moves the whole $S$, $\log_2 N \cdot S$ per rank
against the ring's $2\frac{N-1}{N}S$.

When $N$ is not a power of two, let $P$ be the largest power of two below $N$ and $R = N -
P$. The first $2R$ ranks pair up: each even one hands its tensor to the odd one after it and
waits; $P$ ranks run the rounds; each odd one then sends the result back. The per-rank
traffic at $N = 6$ ($P = 4$, $R = 2$) shows who does the extra work:
"""),
    code("""
display(Code(inspect.getsource(recursive_doubling_all_reduce), language="python"))
""", ["hide-output"]),
    code("""
print(per_rank_traffic(Algorithm.RECURSIVE_DOUBLING, world_size=6))
""", CHECK),
    md(r"""
Ranks 0 and 2 send their tensor once and receive the answer once; ranks 1 and 3 fold them in,
run two rounds and send the answer back; ranks 4 and 5 only run the rounds. Checked against
torch's own all-reduce on the random tensors above, for world sizes that are not powers of
two:
"""),
    code("""
odd_sizes = (3, 5, 6)
rows = [row for row in agreement
        if row.algorithm is Algorithm.RECURSIVE_DOUBLING and row.world_size in odd_sizes]
print(agreement_table(rows))
""", IGNORE),
    code("""
print("recursive doubling equals torch.distributed.all_reduce to 1e-5 on 3, 5 and 6 ranks:",
      all(row.from_torch < 1e-5 for row in rows))
""", CHECK),
    md(r"""
Where the results differ from torch's, it is in the last bits: gloo adds in its own order.

## What each algorithm sends, measured

The closed forms, for the busiest rank (for the naive algorithm, the root):

| algorithm | messages sent | bytes sent | messages, whole group |
|---|---|---|---|
| naive | $N-1$ | $(N-1)\,S$ | $2(N-1)$ |
| whole-tensor ring | $N-1$ | $(N-1)\,S$ | $N(N-1)$ |
| ring | $2(N-1)$ | $2\frac{N-1}{N}\,S$ | $2N(N-1)$ |
| recursive doubling | $\lceil\log_2 N\rceil$ | $\lceil\log_2 N\rceil S$ | $N\log_2 N$ ($N=2^k$) |

For $N$ not a power of two recursive doubling sends $P\log_2 P + 2R$ messages in all. Below,
one launch per world size from 2 to 8 runs all four algorithms with a `Recorder` (the ring in
its plain lock-step form, so that one step is one message) beside the formulas:
"""),
    code("""
traffic = measure_traffic(range(2, 9))
print(traffic_table(traffic))
""", CHECK),
    code("""
print("measured messages and bytes equal the closed forms for every algorithm, N = 2..8:",
      all(row.matches for row in traffic))
""", CHECK),
    code("""
fig = plot_traffic(traffic)
""", HIDE),
    md(r"""
### "Naive is O(n²) messages, the ring O(n)"

A comparison that circulates in introductions to all-reduce tabulates messages for the two
algorithms and derives "speedups" from them: naive 2, 12, 56, 240, 992 against ring 2, 6, 14,
30, 62 for $N$ = 2, 4, 8, 16, 32. Set beside what the ranks above actually sent (measured for
$N \le 8$; for 16 and 32 the closed forms, which the table above confirms up to 8):
"""),
    code("""
claimed = {2: (2, 2), 4: (12, 6), 8: (56, 14), 16: (240, 30), 32: (992, 62)}  # N: (naive, ring)
measured = {(row.world_size, row.algorithm): row.measured for row in traffic}

def counts(n, algorithm):
    return measured.get((n, algorithm)) or expected_traffic(algorithm, n)

rows = [[n, naive, ring,
         counts(n, Algorithm.NAIVE).group_messages, counts(n, Algorithm.RING).group_messages,
         counts(n, Algorithm.RING).messages_sent,
         counts(n, Algorithm.WHOLE_TENSOR_RING).group_messages,
         "measured" if n <= 8 else "closed form"]
        for n, (naive, ring) in claimed.items()]
print(format_table(["N", "claimed naive", "claimed ring", "naive, all ranks", "ring, all ranks",
                    "ring, per rank", "whole-tensor ring, all ranks", "source"], rows))
""", CHECK),
    code("""
print("claimed 'naive' column = N(N-1):",
      all(naive == n * (n - 1) for n, (naive, _) in claimed.items()))
print("claimed 'ring' column = the ring's messages per rank, 2(N-1):",
      all(ring == counts(n, Algorithm.RING).messages_sent for n, (_, ring) in claimed.items()))
print("the naive algorithm sends fewer messages in total than the ring, every N:",
      all(counts(n, Algorithm.NAIVE).group_messages < counts(n, Algorithm.RING).group_messages
          for n in claimed))
""", CHECK),
    md(r"""
The comparison goes wrong in three places:

* Its "naive" column is $N(N-1)$: every rank sending its tensor to every other rank. That is
  not the reduce-to-root algorithm, which sends $2(N-1)$ messages in all; it is what the
  whole-tensor ring sends.
* Its "ring" column counts the messages of **one** rank, $2(N-1)$, while the "naive" column
  counts the whole group. Counted the same way, the ring sends $2N(N-1)$ messages, more than
  the naive algorithm at every $N$.
* A ratio of message counts is not a speedup. Messages differ in size (the ring's carry
  $S/N$), many travel at the same time on different links, and each one costs a fixed
  latency on top of its bytes.

What the ring really wins is **bytes on the busiest link**: the naive root moves $(N-1)\cdot S$
each way, the ring's every link less than $2S$ (left panel of the figure). What it pays is
**latency**: $2(N-1)$ steps one after the other, each with a message's fixed cost. The naive
root pays as many, since it receives $N-1$ messages in turn and then sends $N-1$ (the right
panel counts the ones it sends), but recursive doubling needs only $\log_2 N$ rounds. So for
small tensors, where the fixed cost of a message dominates, fewer and larger messages win. A
cost model makes this quantitative.

## A cost model: latency and bandwidth

The classic model prices a message of $m$ bytes at $\alpha + \beta m$: $\alpha$ the fixed
cost of any message (software, handshakes, waking the receiver), $\beta$ the seconds per byte
of the link. Adding received bytes costs $\gamma$ per byte. Along the critical path:

| algorithm | predicted time |
|---|---|
| ring | $2(N-1)\,(\alpha + \tfrac{S}{N}\beta) + (N-1)\tfrac{S}{N}\gamma$ |
| recursive doubling ($N=2^k$) | $\log_2 N\,(\alpha + S\beta + S\gamma)$ |
| naive | $2(N-1)\,(\alpha + S\beta) + (N-1)S\gamma$ |
| whole-tensor ring | $(N-1)\,(\alpha + S\beta + S\gamma)$ |

`fit_alpha_beta` measures $\alpha$ and $\beta$ on this machine by timing exchanges between two
real ranks, each sending $m$ bytes to the other while receiving $m$ (one step of a ring, made
by `labs.collectives.exchange`, the same exchange as a step of the lock-step ring), over
message sizes from 4 B to 4 MiB; and $\gamma$ by timing `torch.add`. So $\beta$ here is the
cost of a byte that goes out while another comes in, what a step of the ring pays. The
textbook fit times one-way messages instead (`pattern=P2PPattern.PING_PONG`); on one machine
the two need not agree, since both directions of an exchange are copies made by the same CPUs.
"""),
    code("""
params = fit_alpha_beta(world_size=2, backend="gloo")
print(params.summary())
print(f"fitted on {params.cores} CPU core(s) with {params.world_size} ranks ({params.backend})")
""", IGNORE),
    md(r"""
Now every algorithm is timed on 2 and 4 ranks for sizes from 1 KiB to 4 MiB (5 calls each;
a call's time is its slowest rank's, and the figures use the fastest of the 5 calls, as the
fit does), and the model's predictions are laid over the measurements. The right-hand
panels divide measured by predicted: 1 means the model is exact.
"""),
    code("""
model_sizes = [1 << k for k in range(10, 23, 2)]  # 1 KiB .. 4 MiB
model_cases = [CollectiveCase(Collective.ALL_REDUCE, algorithm, size)
               for size in model_sizes for algorithm in Algorithm]
model_timings = {n: measure_collectives(model_cases, n, iters=5, backend="gloo")
                 for n in (4, 2)}
print("every timed call gave the exact sum:",
      all(t.correct for n in model_timings for t in model_timings[n]))
""", CHECK),
    code("""
fig = plot_cost_model(model_timings[4], params, world_size=4)
""", HIDE),
    code("""
fig = plot_cost_model(model_timings[2], params, world_size=2)
""", HIDE),
    md(r"""
Where recursive doubling stops beating the ring, by the model and by the measurements
(fastest of the 5 calls at each size):
"""),
    code("""
for n in (2, 4):
    cross = crossover_bytes(Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, n, params)
    best = {(t.case.algorithm, t.case.size_bytes): t.summary(Statistic.MIN)
            for t in model_timings[n]}
    ring_wins = [s for s in model_sizes
                 if best[(Algorithm.RING, s)] < best[(Algorithm.RECURSIVE_DOUBLING, s)]]
    model_text = "never" if cross is None else f"at {cross / 1024:.0f} KiB"
    measured_text = ", ".join(format_size(s) for s in ring_wins) or "none of the sizes"
    print(f"N = {n}: the model has the ring overtake recursive doubling {model_text}; "
          f"measured, the ring was faster at {measured_text}")
    ratios = [measured_over_predicted(t, params) for t in model_timings[n]
              if t.case.algorithm is not Algorithm.TORCH]
    above = sum(r > 1 for r in ratios)
    print(f"       measured / predicted ranges from {min(ratios):.2g} to {max(ratios):.2g}, "
          f"above 1 at {above} of {len(ratios)} points")
print(f"4 ranks on {params.cores} cores: more ranks than cores: {params.oversubscribed(4)}")
""", IGNORE),
    md(r"""
Two ranks are a special case. There the ring's two chunks are halves, and the coefficients
of the model say what each algorithm costs per byte of $S$:
"""),
    code("""
ring2, doubling2 = (coefficients(a, 2) for a in (Algorithm.RING, Algorithm.RECURSIVE_DOUBLING))
for name, c in (("ring", ring2), ("recursive doubling", doubling2)):
    print(f"N = 2, {name:>18}: sends {c.bytes_per_byte:g} S, adds {c.reduced_per_byte:g} S, "
          f"pays {c.messages:g} x alpha")
largest = model_sizes[-1]
ring_s, doubling_s = (predict(a, largest, 2, params)
                      for a in (Algorithm.RING, Algorithm.RECURSIVE_DOUBLING))
calls = [t.all_seconds for t in model_timings[2] if t.case.size_bytes == largest
         and t.case.algorithm in (Algorithm.RING, Algorithm.RECURSIVE_DOUBLING)]
spread = max(max(c) / min(c) - 1 for c in calls)
gap = abs(doubling_s / ring_s - 1)
print(f"at {format_size(largest)} the model predicts ring {ring_s * 1e6:.0f} us, recursive "
      f"doubling {doubling_s * 1e6:.0f} us: {gap:.1%} apart")
print(f"the 5 calls of one algorithm at that size differ by up to {spread:.0%}: the predicted "
      f"gap is {'smaller' if gap < spread else 'larger'} than that")
""", IGNORE),
    md(r"""
At two ranks both algorithms send the same bytes, $S$ per rank. They differ only in a
message latency, which the ring pays twice and recursive doubling once, against additions:
recursive doubling adds the whole tensor, the ring half of it. So the model's crossover at
$N=2$ is where $\tfrac{S}{2}\gamma = \alpha$, at $S = 2\alpha/\gamma$: it rests on $\alpha$
and on $\gamma$, the cost of adding a byte. The two predictions differ by
$|\tfrac{S}{2}\gamma - \alpha|$, small next to the $S\beta$ that both of them carry once $S$
is large. When that gap is smaller than the spread of the calls (the cell above compares
them), which of the two "wins" at $N=2$ is decided by the machine's noise, not by the
algorithm, and the fastest of 5 calls can neither confirm nor refute the model there.

At four ranks the ring sends $\tfrac{3}{2}S$ per rank against recursive doubling's $2S$, so
the bytes should set them apart once $S$ is well past the crossover. The figures stop at
4 MiB, not far past the crossover the model predicts; here are the two, and the naive
algorithm, at 16 and 64 MiB (fastest of 5 calls). The last lines list the sizes of the
figures at which the naive algorithm was the fastest of the three on 4 ranks.
"""),
    code("""
large_sizes = [1 << 24, 1 << 26]  # 16 MiB, 64 MiB
three = (Algorithm.NAIVE, Algorithm.RING, Algorithm.RECURSIVE_DOUBLING)
large_cases = [CollectiveCase(Collective.ALL_REDUCE, a, s) for s in large_sizes for a in three]
large = {n: measure_collectives(large_cases, n, iters=5, backend="gloo") for n in (4, 2)}
rows, ring_fastest = [], True
for n in (2, 4):
    for size in large_sizes:
        best = {t.case.algorithm: t.summary(Statistic.MIN) for t in large[n]
                if t.case.size_bytes == size}
        fastest = min(best, key=best.get)
        ring_fastest &= fastest is Algorithm.RING
        rows.append([n, format_size(size), *(f"{best[a] * 1e3:.1f}" for a in three),
                     fastest.value])
print(format_table(["N", "size", "naive (ms)", "ring (ms)", "recursive doubling (ms)",
                    "fastest"], rows))
print("every call gave the exact sum:", all(t.correct for n in large for t in large[n]))
print("the ring was the fastest at 16 and 64 MiB on 2 and 4 ranks:", ring_fastest)
best4 = {(t.case.algorithm, t.case.size_bytes): t.summary(Statistic.MIN)
         for t in model_timings[4]}
naive_first = [format_size(s) for s in model_sizes
               if min(three, key=lambda a: best4[(a, s)]) is Algorithm.NAIVE]
print("N = 4, 1K to 4M: the naive algorithm was the fastest of the three at:",
      ", ".join(naive_first) or "none of the sizes")
""", IGNORE),
    md(r"""
Where the naive algorithm is the fastest of the three at 4 ranks, the machine is the
reason, not the algorithm. Here four ranks share the cores of one machine, and the ring and
recursive doubling keep all four of them busy at every step, so at every step some rank
waits for a core. The naive algorithm keeps fewer ranks busy: while the root receives the
tensors one after another, the other ranks only wait, and its messages go one way, not
both ways at once like the exchanges $\alpha$ and $\beta$ were fitted on. Give every rank
its own cores and its own link, as on a cluster, and the root's link is the bottleneck the model
describes; `python -m labs collectives` under `torchrun` measures that across nodes.

Read the figures with the model's blind spots in mind:

* **More ranks than cores.** When there are more ranks than cores (the crossover cell
  says whether that is the case here), ranks take turns on the cores; a rank that waits for
  a core delays its neighbours, and nothing in $\alpha + \beta m$ says so. The next section
  measures how much.
* **Links are shared.** All ranks of a ring send at once, and here every "link" is the same
  memory bus; the naive root receives its $N-1$ messages one after another, and its $N-1$
  sends, posted at once, leave through the same link. The model prices
  each message as if it had the link to itself.
* **Small messages.** At a few KiB the time is almost all $\alpha$, and $\alpha$ measured on
  one idle pair of ranks is not what a busy collective sees; timings there are also the
  noisiest.
* **Python per step.** Each step of a from-scratch algorithm runs some Python (slicing,
  posting the messages, waiting, adding), more than the fit's bare exchange does. The model
  has no term for it, so it pushes measured / predicted up, even at $N=2$ where the fit ran
  on the same pair of ranks (the crossover cell prints how many points lie above 1).
* **The library's ring is pipelined** on CPU once a chunk is larger than a segment
  (`DEFAULT_SEGMENT_BYTES`, 2 MiB): segments overlap sending and adding, which the lock-step
  formula does not describe. In the figures no chunk is larger than 2 MiB, so there it is not
  pipelined; at 16 and 64 MiB it is. Torch's built-in is not modelled at all (it is gloo's
  own ring, cut into segments its own way; more on that below).

What the model describes is a network where each rank has its own cores and links: there,
with few ranks and small tensors the algorithm with fewer messages wins, and as tensors grow
the bytes on the busiest link decide. On one machine with few cores the measurements above
follow that only in part, and the cells say where: which algorithm was fastest at each size,
and where the naive algorithm won.

### The parameters depend on the load

$\alpha$ and $\beta$ above were fitted on two ranks: one pair exchanging, nothing else
running. In a 4-rank collective every rank sends, receives and adds at the same time. Fitting
again with all four ranks stepping a ring at once (each sends $m$ bytes to its right
neighbour while it receives $m$ from its left: `P2PPattern.RING_STEP`) prices a message under
the load that a collective puts on the machine. The table compares the 4-rank measurements
with both fits: the geometric mean of measured / predicted over the sizes of the figures,
and its range.
"""),
    code("""
busy = fit_alpha_beta(world_size=4, pattern=P2PPattern.RING_STEP, backend="gloo")
print("2 ranks, one pair exchanging:", params.summary())
print("4 ranks, all stepping a ring:", busy.summary())
print(f"busy / alone: alpha x {busy.alpha_s / params.alpha_s:.1f}, "
      f"beta x {busy.beta_s_per_byte / params.beta_s_per_byte:.1f}, "
      f"gamma x {busy.gamma_s_per_byte / params.gamma_s_per_byte:.1f}")

def against(fit, timings):
    ratios = [measured_over_predicted(t, fit) for t in timings]
    return statistics.geometric_mean(ratios), f"{min(ratios):.2g} to {max(ratios):.2g}"

rows = []
for algorithm in Algorithm:
    if algorithm is Algorithm.TORCH:
        continue
    timings = [t for t in model_timings[4] if t.case.algorithm is algorithm]
    (alone, alone_range), (loaded, loaded_range) = (against(f, timings) for f in (params, busy))
    closer = "busy" if abs(math.log(loaded)) < abs(math.log(alone)) else "2 ranks"
    rows.append([algorithm.value, f"{alone:.2f}", alone_range, f"{loaded:.2f}", loaded_range,
                 closer])
print()
print(format_table(["N = 4", "2-rank fit", "range", "busy fit", "range", "closer to 1"], rows))
""", IGNORE),
    md(r"""
The third line of the cell says how much a message's fixed cost and its cost per byte grow
when the other ranks compete for the same cores and memory. An algorithm in which every rank
works at every step (the ring, recursive doubling, the whole-tensor ring) runs under the
busy fit's load. The naive algorithm does not: while the root receives one tensor after
another, the other ranks wait, so its load lies somewhere between the two fits. What is
left of measured / predicted after the busy fit is what the model still leaves out: the
Python of each step, and at small sizes a latency that the fit's straight line does not
follow.

So $\alpha$ and $\beta$ are constants of a machine *under a given load*, not of the machine.
A cluster's network behaves the same way, where the load includes the other jobs on its
switches: fit the model on the machine, under the load it will run with.

## The ring against torch's built-in

How close does a ring written in Python, on top of `isend`/`irecv`, come to gloo's own
all-reduce? An nccl-tests style table for 2 and 4 ranks at 1, 16 and 64 MiB. `algbw` is
$S$ divided by the time; `busbw` multiplies it by $2\frac{N-1}{N}$, the bytes each rank must
move per byte of $S$, so that it can be compared with a link's speed whatever $N$ is. The
last table is the ratio of the ring's bus bandwidth to torch's (above 1: the ring is faster).
These are the course's performance figures for the ring; the full sweep over every
collective and size is `python -m labs.bench collectives`, and `python -m labs collectives`
prints the same table from ranks that `torchrun` started, across nodes too, where the ring's
messages cross a real network. On a machine shared with other
work the timings move from run to run, and on a small machine they also
move from launch to launch, with the way the ranks happen to share the cores; so the cell
runs three launches per world size, each with at least 6 calls of each algorithm per size and
more at the smaller sizes (as many as it takes to move 128 MiB, at most 100). Within a launch the two algorithms take turns call by call
(each iteration in the opposite order to the last), so call $i$ of the ring and call $i$ of
torch's met the same load, and each ratio in the `busbw / torch` column is the median of those
per-call ratios, all launches pooled (so it need not equal the quotient of the two `busbw`
entries, each the median of its own calls). In the last table the brackets hold the lowest and
the highest of the same median taken one launch at a time (the pooled one always lies between
them): a cell whose range straddles 1 says the two are level within what this machine can
resolve, whatever its first number says.

What to expect before looking: for CPU tensors gloo's own all-reduce is a ring too
(`gloo/allreduce.cc` in the gloo sources: the tensor cut into at least $2N$ segments of at
most 1 MiB, two in flight, the addition of one overlapped with the transfer of the next),
over the same TCP connections that `isend` and `irecv` use here. Same algorithm, same bytes,
same transport: the two differ in how they cut the tensor into segments (the library's ring
into segments of 2 MiB), in what Python adds per message, and in how well each overlaps
sending with adding, so the two should come out close; where they do not, look first at
those three.
One setting matters for that: the ranks of a collectives benchmark run with one intra-op
thread each, as torchrun gives each process by default. gloo adds in a thread of its own and
never uses them; the ring adds with torch, and with many threads per rank its additions
compete with the transfers for the cores (`--threads` sets the number; try it on a machine
with many cores).
"""),
    code("""
bench_settings = SweepSettings(
    collectives=(Collective.ALL_REDUCE,), algorithms=(Algorithm.RING, Algorithm.TORCH),
    sizes=(1 << 20, 1 << 24, 1 << 26), world_sizes=(2, 4), iters=6, min_bytes=128 << 20,
    launches=3,
)
print("the same from a shell:", sweep_command(bench_settings))
bench = run_sweep(bench_settings)
print(sweep_tables(bench))
""", IGNORE),
    code("""
fig = plot_busbw(bench)
""", HIDE),
    md(r"""
Where a range stays below 1, the ring is behind gloo at that size. Part of what Python adds
is the same for every call, whatever the size: checking the arguments, posting each message
and waiting for it. A call with nothing to move shows how
large that part is, and dividing it by the ring's calls in the table shows how much of them
it explains:
"""),
    code("""
tiny = {t.case.algorithm: t.seconds for t in measure_collectives(
    [CollectiveCase(Collective.ALL_REDUCE, a, 4) for a in (Algorithm.RING, Algorithm.TORCH)],
    2, iters=50, backend="gloo")}
fixed = tiny[Algorithm.RING] - tiny[Algorithm.TORCH]
print(f"2 ranks, 4 B, median of 50 calls: ring {tiny[Algorithm.RING] * 1e6:.0f} us, torch "
      f"{tiny[Algorithm.TORCH] * 1e6:.0f} us")
if fixed <= 0:
    print(f"the ring paid nothing more per call ({-fixed * 1e6:.0f} us less than torch): here "
          "its fixed cost is lost in the noise")
else:
    print(f"the ring pays {fixed * 1e6:.0f} us more per call, this share of each ring call above:")
    for t in bench:
        if t.case.algorithm is Algorithm.RING:
            print(f"  {t.world_size} ranks, {format_size(t.case.size_bytes)}: "
                  f"{fixed / t.seconds:.0%} of the ring's median call ({t.seconds * 1e3:.2f} ms)")
""", IGNORE),
    md(r"""
Where the cell finds a fixed cost, it weighs most where calls are shortest: few ranks and
small sizes. Where it is a small share, or lost in the noise, and the ring still trails, the
rest is in how the two cut the tensor and overlap sending with adding; `python -m labs.bench collectives --segment-bytes 256K 2M`
compares segment sizes for the ring.

The ring timed above did not work out its schedule on every call. Before its first message
a call of the ring must know which segment of which chunk each step sends and receives,
where each one lands, when to add and when to wait. gloo works its own out on every call, in
C++, where that costs little; in Python it is worth doing once. A caller passes the same
`RingBuffers` to every call, as the benchmark above does and as a training loop would, and
the schedule is kept there with the scratch buffers and run again while the calls are the
same (the same tensor memory, size, dtype, group and segments): plan once, run many times.
Such a call also skips the checks its first call made (the group's ranks, whether the
backend can carry the tensor), since none of them can have changed, and posts its messages
through the process group's own `send` and `recv`, which `dist.isend` and `dist.irecv` call
after checking their arguments on every message. What planning on every call would cost,
timed in pairs of calls that take turns, one running the kept schedule, the other dropping it
and planning again:
"""),
    code("""
planning = measure_planning(2, PlanningSettings(size_bytes=1 << 20, iters=100))
print(f"2 ranks, {format_size(planning.size_bytes)}, median of 100 calls each: schedule kept "
      f"{planning.kept * 1e3:.2f} ms, planned again {planning.planned * 1e3:.2f} ms; "
      f"per pair, planning again took {planning.ratio:.2f}x as long")
""", IGNORE),
    code("""
kept_calls, planned_calls = planning.compiled
print(f"schedules worked out during the timed calls: {kept_calls} by the calls that kept one, "
      f"{planned_calls} by the 100 that dropped it")
""", CHECK),
    code("""
print("every benchmarked call gave the exact sum:", all(t.correct for t in bench))
""", CHECK),
    md(r"""
## Why NCCL chooses among algorithms by size

The crossover above is the reason production libraries do not use one algorithm for every
call. NCCL, the library behind `torch.distributed` on NVIDIA GPUs, implements several
all-reduce algorithms, among them the ring and trees (NCCL's trees span the nodes as two binary
trees, with a chain of GPUs inside each node, so their depth grows with the logarithm of the
number of nodes, plus that chain, rather than with $N$), and several protocols that trade
bandwidth for latency. For each call its internal tuning model estimates the time of every
algorithm and protocol from the message size, the number of ranks and GPUs per node, and the
bandwidths of the links between them, and picks the fastest; the `NCCL_ALGO` and `NCCL_PROTO`
environment variables override the choice. It is the same reasoning as the $\alpha$-$\beta$
model here: few steps for small messages, where latency dominates; the bandwidth-optimal ring
for large ones, where bytes dominate. So "DDP uses ring all-reduce" is only sometimes true:
which algorithm runs depends on the size of each bucket of gradients and on the machine.

## Try it

Choose the number of ranks, the size of the tensor and the algorithms, then press the button:
the panel times them on real ranks and shows the same table as above and a bar chart. Below
it is the default run (4 ranks, 1 MiB, every algorithm). Try 4 KiB against 16 MiB, and 2
ranks against 8. The panel runs one launch of at least 5 calls, more at small sizes (as
many as it takes to move 64 MiB, at most 100; its table's header says how many), so on a
small machine its
ring-to-torch ratio can land outside the range the three launches above gave: that spread is
the noise the brackets measure, not a change in either algorithm.
"""),
    code("""
collective_panel(Collective.ALL_REDUCE)
""", IGNORE),
    md(r"""
## Exercise 2.1: a ring all-reduce

Write `my_ring_all_reduce(tensor)`: when it returns, `tensor` must hold, on every rank, the
element-wise sum over all ranks, computed in place by the ring of this chapter.

* Use only point-to-point calls: `dist.isend`, `dist.irecv`, `dist.send`, `dist.recv` or
  `dist.batch_isend_irecv`. The check makes `dist.all_reduce` and the other collectives
  raise.
* Cut the flattened tensor into $N$ chunks with `torch.tensor_split(flat, N)`: the chunks are
  views, so adding into them changes `tensor`. Some chunks are empty when the tensor has fewer
  than $N$ elements; send nothing for those.
* Reduce-scatter step $k$: send chunk $(r-k-1) \bmod N$ to rank $r+1$, receive chunk
  $(r-k-2) \bmod N$ from rank $r-1$ into a buffer and add it. All-gather step $k$: send chunk
  $(r-k) \bmod N$, receive chunk $(r-k-1) \bmod N$ in place.
* Post the send and the receive of a step together (`batch_isend_irecv`, or `isend` then
  `recv`): if every rank first waits for its send to finish, they can all wait forever.

The check runs your function on 1 to 5 ranks with tensors of several shapes (including fewer
elements than ranks and sizes $N$ does not divide), compares every rank's result with the
exact sum, and counts the bytes each rank sends: no more than the ring's $2(N-1)$ chunks of
$\lceil \mathrm{numel}/N \rceil$ elements, which is $2\frac{N-1}{N}S$ rounded up to whole chunks.
"""),
    solution("""
def my_ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return tensor
    chunks = torch.tensor_split(tensor.view(-1), n)  # views into tensor
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv):
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, right))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, left))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    for k in range(n - 1):  # reduce-scatter: a partial sum gains one rank per step
        mine = chunks[(rank - k - 2) % n]
        incoming = torch.empty_like(mine)
        exchange(chunks[(rank - k - 1) % n], incoming)
        mine += incoming
    for k in range(n - 1):  # all-gather: pass the finished chunks round
        exchange(chunks[(rank - k) % n], chunks[(rank - k - 1) % n])
    return tensor
""", "2.1"),
    check("""
result = check_ring_all_reduce(my_ring_all_reduce)
""", "2.1"),
    md(r"""
## Summary

* All-reduce can be computed from point-to-point messages in several ways, and they differ
  in **where the bytes go** and **how many steps** run one after the other.
* **Naive** (reduce to a root, broadcast back) sends few messages, $2(N-1)$ in all, but the
  root's link carries $(N-1)\cdot S$ each way: it grows with $N$.
* The **whole-tensor ring** removes the root but sends $(N-1)\cdot S$ per rank, and each rank
  adds in its own order, so from three ranks on the ranks can end with different bits.
* The **ring** (reduce-scatter, then all-gather over $N$ chunks) sends $2\frac{N-1}{N}S$ per
  rank, less than $2S$ at any $N$, and leaves every rank with identical bits; it pays
  $2(N-1)$ message latencies.
* **Recursive doubling** needs only $\lfloor\log_2 N\rfloor$ rounds (two more messages when
  $N$ is not a power of two), but its busiest rank sends $\lceil\log_2 N\rceil\cdot S$: by
  the model it wins on small tensors, the ring on large ones. A fitted $\alpha$-$\beta$
  model predicts the crossover, and the measurements show where the model is too simple.
  Its parameters hold for the load they were measured under: fitted with every rank busy,
  they grow. With more ranks than cores the cores, not the links, are the bottleneck, which
  can even let the naive algorithm win.
* Counting messages is not timing them: the "O(n²) against O(n)" table compares a
  group's count with one rank's, and the real difference is bytes per link against latency.
* NCCL makes this choice per call, by size and topology, among rings, trees and protocols.

Next, chapter 3 takes the first half of the ring on its own: reduce-scatter, the collective
that ZeRO and FSDP are built on.
"""),
]

write_notebook(cells, "02_allreduce_algorithms.ipynb")
