"""Writes notebooks/05_ddp.ipynb (source cells only; `make notebooks` executes it).

Kept as a script so the chapter can be regenerated and reviewed as plain text; edit here,
then run `make notebooks`.
"""

from nbgen import CHECK, HIDE, IGNORE, check, code, md, setup, solution, write_notebook

cells = [
    md(r"""
# Data parallelism: from all-reduce to DDP

Chapters 1 to 4 built the collectives. This chapter puts the all-reduce to work the way
`torch.nn.parallel.DistributedDataParallel` (DDP) does. Every rank holds the whole model and
its own slice of the batch; after `loss.backward()` the ranks average their gradients, so
every replica takes the same optimizer step and stays identical to the others.

The chapter builds that twice, both in `labs.ddp`, and measures both on real ranks:

1. why the average of the ranks' gradients is the full batch's gradient, and when it is not;
2. `NaiveDDP`: after backward, one all-reduce per parameter;
3. `DDP`: gradients packed into buckets whose all-reduces start *during* backward, shown on a
   timeline measured in the ranks;
4. step times of the two against torch's DDP, and a sweep over the bucket size;
5. gradient accumulation, with and without `no_sync()`;
6. the `DistributedSampler`: who reads what, `set_epoch`, and the padding that double-counts;
7. pitfalls, each run on real ranks with a timeout: unused parameters, changing the model
   after wrapping it, logging, checkpointing, seeding;
8. a small transformer language model trained with DDP, from the notebook and from
   `torchrun`, with a checkpoint and a resume;
9. a panel, two exercises and a summary.
"""),
    setup("""
import dataclasses
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from IPython.display import Code, display
from torch import nn

from labs import LaunchTimeout, RankError, launch, rank_device
from labs.checks import check_bucketed_ddp, check_simple_ddp
from labs.collectives import Recorder, ring_all_reduce
from labs.ddp import DDP, NaiveDDP, assign_buckets, trainable_parameters
from labs.ddp_experiments import (
    Implementation, SamplerSettings, StepSettings, bucket_plan, bucket_sweep_cases, cap_text,
    coverage, default_cases, evaluation_worker, measure_accumulation, measure_step_times,
    measure_timelines, mlp, sampler_views, synchronise,
)
from labs.ddp_pitfalls import (
    ChangeAfterWrapping, Logging, change_after_wrapping_worker, checkpoint_worker,
    logging_worker, seeding_worker, unused_parameter_first_step_worker, unused_parameter_worker,
)
from labs.train import CHARS, TEXT, TrainConfig, Wrapper, train_worker
from labs.viz import format_table
from labs.viz_ddp import (
    accumulation_table, plot_bucket_sweep, plot_loss, plot_step_times, plot_timeline,
    sampler_table, step_time_table,
)
from labs.widgets import ddp_panel
"""),
    md(r"""
## Why the average is the full batch's gradient

Take a batch of $B$ samples and a loss that is the mean of per-sample losses,
$L = \frac{1}{B}\sum_{i=1}^{B} \ell_i$. Split the batch over $N$ ranks, $b = B/N$ samples
each; rank $r$ computes the gradient of *its* mean loss, $g_r = \frac1b\sum_{i \in r}
\nabla\ell_i$. Then

$$
\frac1N \sum_{r} g_r \;=\; \frac1N \sum_r \frac1b \sum_{i\in r} \nabla \ell_i
\;=\; \frac{1}{B}\sum_{i=1}^{B} \nabla\ell_i \;=\; \nabla L .
$$

The step uses $b = B/N$ for every rank. Below, the chapter's model (an MLP of six
`Linear(256, 256)` layers; the cell prints its parameter count) is wrapped in `labs.ddp.DDP`
on 1, 2 and 4 ranks, each taking an equal share of one batch of 24 samples; then on 3 ranks
with shares of 10, 8 and 6. Each rank's averaged gradient is compared with the gradient one
process computes on the whole batch, relative to that gradient's largest entry.
"""),
    code("""
SETTINGS = StepSettings(width=256, layers=6, batch=32, steps=8, warmup=2, bucket_cap_mb=0.25)
BATCH = torch.randn(24, SETTINGS.width, generator=torch.Generator().manual_seed(1))

def loss_fn(model, x):
    return model(x).square().mean()   # a mean over samples, like cross-entropy

def ddp_gradient(rank, world_size, shares):
    start = sum(shares[:rank])
    mine = BATCH[start:start + shares[rank]].to(rank_device())
    model = DDP(mlp(SETTINGS).to(rank_device()), bucket_cap_mb=SETTINGS.bucket_cap_mb)
    loss_fn(model, mine).backward()
    model.finish_gradient_synchronization()
    return torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])

reference = mlp(SETTINGS)
loss_fn(reference, BATCH).backward()
full_batch = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
scale = full_batch.abs().max().item()
print(f"{SETTINGS.parameters:,} parameters; largest |full-batch gradient| entry {scale:.1e}")

rows = []
for shares in ([24], [12, 12], [6, 6, 6, 6], [10, 8, 6]):
    grads = launch(ddp_gradient, len(shares), args=(shares,), echo=False)
    worst = max((g - full_batch).abs().max().item() for g in grads)
    rows.append([len(shares), " + ".join(map(str, shares)), f"{worst:.1e}",
                 f"{worst / scale:.1e}", "yes" if worst / scale < 1e-4 else "NO"])
print(format_table(["ranks", "samples per rank", "max |avg - full batch|", "relative",
                    "equal?"], rows))
"""),
    code("""
# The differences depend on the hardware (rounding on a GPU is not the CPU's); the verdicts don't.
print({" + ".join(map(str, shares)): row[-1] for shares, row in
       zip(([24], [12, 12], [6, 6, 6, 6], [10, 8, 6]), rows, strict=True)})
""", CHECK),
    md(r"""
With equal shares the difference is float32 rounding: the sums are added in another order,
and the relative error is of the order of float32's precision. With 10, 8 and 6 samples the
error is orders of magnitude larger, and not rounding: the plain average gives the 6 samples
of rank 2 as much weight as the 10 of rank 0. The exact gradient weights rank $r$ by
$b_r/B$ (chapter 1 showed that fix). DDP does not do it for you: it divides by $N$. This is
one reason the `DistributedSampler` below pads or drops samples so that every rank gets the
same number.

## NaiveDDP: all-reduce every gradient after backward

The plainest wrapper broadcasts rank 0's parameters and buffers when it is built, so every
replica starts equal, and after backward all-reduces each gradient and divides by $N$:
"""),
    code("""
display(Code(inspect.getsource(NaiveDDP.finish_gradient_synchronization), language="python"))
""", HIDE),
    md(r"""
It is correct, and it is slow for two reasons the next sections measure: it sends one
message per parameter (a weight and a bias per layer here), each paying the latency
$\alpha$ of chapter 2's cost model, and it sends nothing until backward has finished, so the
network idles while the processor computes and the processor idles while the network sends.

The bytes are not the problem. Whatever the wrapper, a ring all-reduce of $S$ bytes of
gradients makes each rank send $2\frac{N-1}{N}S$ (chapter 2). It is tempting to call that
"twice the model, independent of $N$"; the factor does depend on $N$, a little. Measured with `labs.collectives.ring_all_reduce` on this model's gradients ($S$ is
printed above the table):
"""),
    code("""
def ring_bytes(rank, world_size, numel):
    recorder = Recorder()
    ring_all_reduce(torch.ones(numel, device=rank_device()), recorder=recorder)
    return recorder.stats.bytes_sent

S = SETTINGS.gradient_bytes
print(f"S = {S / 2**20:.2f} MiB ({SETTINGS.parameters:,} float32 gradients)")
rows = []
for n in (2, 3, 4, 8):
    sent = max(launch(ring_bytes, n, args=(SETTINGS.parameters,), echo=False))
    rows.append([n, f"{sent / S:.4f}", f"{2 * (n - 1) / n:.4f}", f"{sent / 2**20:.2f}"])
print(format_table(["N", "bytes sent per rank / S", "2(N-1)/N", "MiB sent per rank"], rows))
""", CHECK),
    md(r"""
## DDP: buckets, hooks and overlap

`labs.ddp.DDP` does what torch's DDP does, in Python (how torch's buckets differ comes
after the step times):

* **Buckets.** At construction the trainable parameters are split into flat buffers of about
  `bucket_cap_mb` MiB, walking them in *reverse* registration order: backward produces the
  last layer's gradients first.
* **Hooks.** Each parameter gets a `register_post_accumulate_grad_hook`. Autograd calls it
  once the parameter's `.grad` is complete (the hook receives the parameter, not the
  gradient); it copies the gradient into its bucket.
* **Async all-reduce.** When a bucket's last gradient arrives,
  `dist.all_reduce(bucket, async_op=True)` is launched, in bucket order on every rank. The
  call returns at once and backward goes on computing earlier layers while the bucket travels.
* **Finish.** `finish_gradient_synchronization()`, called after backward and before
  `optimizer.step()`, waits for every bucket and writes each sum divided by $N$ back into
  `p.grad`.

With a cap of 256 KiB this model gets one bucket per layer: each weight alone is as large as
the cap, so a bucket closes as soon as its weight is added (the bias comes first in reverse
order):
"""),
    code("""
plan = bucket_plan(mlp(SETTINGS), SETTINGS.bucket_cap_mb)
print(format_table(["bucket", "parameters (in the order their gradients arrive)", "KiB"],
                   [[i, ", ".join(names), nbytes / 1024]
                    for i, (names, nbytes) in enumerate(plan.buckets)]))
""", CHECK),
    md(r"""
### One backward pass, measured

Each rank records `time.perf_counter()` when backward starts, when each gradient's hook runs,
when each all-reduce is launched and when it completes (a callback on the all-reduce's
future), and when every gradient holds its average. Rank 0's record of one step, under each
wrapper (the exact times change from run to run):
"""),
    code("""
timelines = measure_timelines(2, SETTINGS)
fig = plot_timeline({impl: per_rank[0] for impl, per_rank in timelines.items()},
                    title="One backward pass on 2 ranks, rank 0")
""", IGNORE + HIDE),
    md(r"""
In the top panel the all-reduces start only after backward has ended, one per parameter.
In the bottom panel bucket 0 (the last layer) is launched while backward is still computing
the earlier layers. Three details that the picture shows and a diagram would not:

* Backward itself can take longer under DDP: collectives launched during backward run on
  gloo's worker threads, which compete with autograd for the CPU cores, and the hooks also
  copy every gradient into its bucket. On a GPU the computation runs on the device and the
  overlap is cheaper.
* A bar runs from launch to completion, waiting included. gloo runs a process group's
  collectives on a small pool of worker threads, so an all-reduce launched while others are
  in flight may wait for a free thread, or share the cores and the link with them.
* Each panel is one sample. A single pass can be much slower than the median step time
  measured below; compare the wrappers by the medians.

Both backward passes end with the same averages; what the structure of these timelines
implies, whatever the exact milliseconds, is checked below:
"""),
    code("""
for impl, per_rank in timelines.items():
    t = per_rank[0]
    first = min(s.start for s in t.allreduces)
    print(f"{impl.value}: {len(t.allreduces)} all-reduces; first launched "
          f"{'before' if first < t.backward_end else 'after'} backward ended")
""", CHECK),
    md(r"""
## Step times: NaiveDDP, DDP and torch DDP

`measure_step_times` trains the same model on the same batch under four implementations in
one launch, alternating their order every step; each row is the median over steps of the
slowest rank's time (a step ends when the last rank ends it). "no sync" is the compute-only
floor: the ranks do not communicate at all.
"""),
    code("""
rows = measure_step_times(2, SETTINGS, default_cases(SETTINGS.bucket_cap_mb))
print(step_time_table(rows))
fig = plot_step_times(rows, title="Milliseconds per step, 2 ranks, bucket cap 256 KiB")
""", IGNORE),
    md(r"""
NaiveDDP pays for its blocking all-reduces one after another once backward has ended. DDP
sends the same bytes in fewer messages and starts them during backward. torch's DDP does the
same in C++, but builds its buckets differently. With `find_unused_parameters=False` its
first iteration puts every parameter into one bucket, because the order in which gradients
arrive is not known yet; after that iteration it rebuilds its buckets in the order the
gradients arrived, up to the cap. (Only when `bucket_cap_mb` is left unset does the rebuilt
first bucket get a smaller cap of its own; here the cap is given.) The untimed warm-up steps
include that first iteration.

torch's DDP makes its all-reduces in C++, out of sight of Python, so the all-reduce count in
torch's row comes from an untimed copy of the same model with a communication hook
(`register_comm_hook`, public API) that counts its calls before all-reducing as the default
hook does: `labs.ddp_experiments.torch_bucket_counts` runs two iterations and reports the
second, after the rebuild. It is the same number as `labs.ddp.assign_buckets` gives labs' DDP
at this cap, and the accumulation section below counts the same way.

### The bucket size

A bucket is a trade: small buckets start communicating early but pay the per-message latency
many times; one big bucket pays it once but cannot start until backward has finished. Each
point below is one launch's median step time at one cap; the numbers above the points are
the buckets per step (labs' from `assign_buckets`, torch's counted by the hook above). This
model cannot show many small buckets: each weight is as large as the 256 KiB cap, and a bucket closes once its weight
is in it, so every cap up to 256 KiB gives one bucket per layer.
"""),
    code("""
caps = [1 / 64, 1 / 16, 1 / 4, 1, 4]
sweep = measure_step_times(2, SETTINGS, bucket_sweep_cases(caps))
fig = plot_bucket_sweep(sweep, title="Step time against bucket size, 2 ranks")
""", IGNORE + HIDE),
    md(r"""
The three smallest caps give the same bucket plan, so the differences between them are noise,
and the figure shows how large that noise is in this run. The line below names each wrapper's
fastest cap in this run. If it is the single bucket, which overlaps nothing with backward,
then on this machine DDP's gain over NaiveDDP comes from fewer, larger messages, not from
overlap: backward is short and shares the cores with gloo, so there is little computation to
hide the messages behind.
"""),
    code("""
for impl in (Implementation.OURS, Implementation.TORCH):
    best = min((r for r in sweep if r.case.implementation is impl), key=lambda r: r.seconds)
    print(f"{impl.value}: fastest at {cap_text(best.case.bucket_cap_mb)} ({best.buckets} "
          f"bucket(s)), {best.seconds * 1e3:.1f} ms per step")
""", IGNORE),
    md(r"""
Overlap can only pay where backward has computation to hide the messages behind: on a GPU,
or for a larger model. The bench command below measures a larger one (it prints the size), comparing
labs' DDP and torch's at a cap of 25 MiB. That is torch's default value, but the bench passes
it explicitly, so torch's rebuilt first bucket gets the same cap as the others:

```bash
python -m labs.bench ddp --world-size 2 --launches 3
```

## Gradient accumulation and `no_sync()`

To train with a batch larger than fits in memory, run $k$ micro-batches through forward and
backward, summing their gradients, then take one optimizer step. The loop usually written
for one GPU is this:

```python
for i, batch in enumerate(dataloader):
    loss = model(batch) / accumulation_steps
    loss.backward()
    if (i + 1) % accumulation_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
```

Under DDP every `backward()` all-reduces every bucket and leaves the average in `.grad`. The
next micro-batch's backward adds its local gradient onto that average, and its all-reduce
sends the whole `.grad` again, the part already averaged included. The result is right, but
each optimizer step makes $k$ rounds of all-reduces where one would do. The fix is
`model.no_sync()` around the forward *and* backward of every micro-batch but the last, so
that only the last one communicates (the sum of everything accumulated). Counted and timed
on real ranks, 4 micro-batches per optimizer step:
"""),
    code("""
accumulation = measure_accumulation(2, StepSettings(width=256, layers=6, batch=32, steps=6,
                                                    warmup=1, accumulation=4,
                                                    bucket_cap_mb=0.25))
print(accumulation_table(accumulation))
""", IGNORE),
    md(r"""
The all-reduce counts do not depend on the machine:
"""),
    code("""
for row in accumulation:
    print(f"{row.implementation.value}, no_sync {'on ' if row.no_sync else 'off'}: "
          f"{row.allreduces:g} all-reduces per optimizer step")
""", CHECK),
    md(r"""
In exact arithmetic the gradients are the same either way: the sum of averages equals the
average of sums. In float32 the additions happen in another order, so the last bits can
differ. The traffic differs by a factor of $k$.

## The DistributedSampler

Each rank must read a different part of the data. `torch.utils.data.DistributedSampler`
does the split: every epoch it permutes the indices (with a seed, so every rank computes the
*same* permutation), pads the list to a multiple of $N$ by repeating its first indices, and
gives rank $r$ every $N$-th index starting at $r$. Each rank below builds its own sampler over
a dataset of 10 samples (sample $i$ is the number $i$), as a training script does, and
returns what it read in two epochs:
"""),
    code("""
views = sampler_views(4, SamplerSettings(size=10, shuffle=True, epochs=2))
print(sampler_table(views))
for epoch in (0, 1):
    c = coverage(views, 10, epoch)
    print(f"epoch {epoch}: {c.read} reads of {c.distinct} distinct samples; read twice: "
          f"{list(c.duplicated)}")
""", CHECK),
    md(r"""
Three things to see:

* **Interleaved, not contiguous.** Without shuffling, rank 0 of 2 reads samples 0, 2, 4, not
  0, 1, 2 as one might guess (next cell).
* **`set_epoch` changes the permutation.** The sampler's permutation is seeded with
  `seed + epoch`. Without `sampler.set_epoch(epoch)` every epoch repeats epoch 0's order
  exactly: forgetting it does not give unshuffled contiguous blocks but a shuffled order
  that never changes.
* **Padding.** 10 samples on 4 ranks become 12 reads: two samples are read twice per epoch.
  For training that is a small bias; for evaluation it is a wrong number (below).
"""),
    code("""
plain = sampler_views(2, SamplerSettings(size=6, shuffle=False, epochs=1))
print("no shuffle, 2 ranks:", {v.rank: list(v.epochs[0]) for v in plain})
frozen = sampler_views(4, SamplerSettings(size=10, set_epoch=False, epochs=3))
print("without set_epoch, rank 0 per epoch:", [list(e) for e in frozen[0].epochs])
dropped = coverage(sampler_views(4, SamplerSettings(size=10, drop_last=True)), 10)
print(f"drop_last=True: {dropped.read} reads, never read this epoch: {list(dropped.missing)}")
""", CHECK),
    md(r"""
### Padding double-counts in evaluation

A model that is right on the samples whose number is a multiple of 3 (0, 3, 6 and 9) and
wrong on the others is evaluated on 10 samples by 4 ranks; each rank counts its correct
answers, and the counts are summed:
"""),
    code("""
per_rank = launch(evaluation_worker, 4, args=(10, False), echo=False)
correct, seen = map(sum, zip(*per_rank))
truth = sum(i % 3 == 0 for i in range(10))
print(f"ranks report {correct}/{seen} correct = {correct / seen:.3f}; "
      f"the truth is {truth}/10 = {truth / 10:.3f}")
twice = coverage(sampler_views(4, SamplerSettings(size=10, shuffle=False, epochs=1)), 10)
print(f"read twice: {list(twice.duplicated)}, of which right: "
      f"{[i for i in twice.duplicated if i % 3 == 0]}")
""", CHECK),
    md(r"""
The padding repeats the first samples of the (unshuffled) list, and a repeated sample that
the model gets right counts twice. `drop_last=True` is no fix for evaluation: it skips
samples instead (above). Evaluate the whole set on one rank, or gather each rank's
per-sample results with their indices and count every index once.

One more way to break the split: give each rank's sampler its own seed, `seed + rank`, as a
script that seeds everything by rank does. Each rank then shuffles differently, so the ranks'
shares overlap and some samples are never read. One epoch of 40 samples on 4 ranks, with a
shared seed and with per-rank seeds:
"""),
    code("""
for per_rank_seed in (False, True):
    c = coverage(sampler_views(4, SamplerSettings(size=40, per_rank_seed=per_rank_seed)), 40)
    print(f"seed {'+ rank' if per_rank_seed else 'shared'}: {c.distinct} distinct of 40, "
          f"{len(c.duplicated)} read more than once, {len(c.missing)} never read")
""", CHECK),
    md(r"""
## Pitfalls, on real ranks

Each of these is run in real ranks with a timeout, so a mistake that would hang becomes an
error naming the stuck ranks instead of a frozen notebook.

### A parameter unused in forward

Is it true that a parameter which gets no gradient makes DDP hang? Here a model
with an auxiliary head that `forward` never uses is trained for three steps, by torch's DDP and
by `labs.ddp.DDP`, without and then with `find_unused_parameters=True`:
"""),
    code("""
def first_line(err):
    # which rank fails first is a race, so the line leaves the rank out
    line = re.sub(r"^rank \\d+ raised ", "", str(err).splitlines()[0])
    return line[:150] + "..."

for impl in (Implementation.TORCH, Implementation.OURS):
    for find_unused in (False, True):
        try:
            outcome = launch(unused_parameter_worker, 2, args=(impl, find_unused),
                             echo=False, timeout=30)[0]
        except (RankError, LaunchTimeout) as err:
            outcome = f"{type(err).__name__}: {first_line(err)}"
        print(f"{impl.value}, find_unused_parameters={find_unused}:\\n    {outcome}")
""", CHECK),
    md(r"""
Here neither hangs: the head is unused on *every* rank, so every rank fails the same way.
torch's DDP raises at the start of the *second* step, when its reducer finds that the
previous reduction never finished. `labs.ddp.DDP` raises at the end of the first backward,
before any step, naming the parameters, because its `finish_gradient_synchronization()` can
see which slots never arrived.

torch's first step was not harmless. In its first iteration torch keeps the parameters of
this small model in one bucket; that bucket never became ready, so nothing was all-reduced
and the optimizer applied each rank's own gradients. The cell below runs that one step on
ranks with different data and compares every rank's parameters with rank 0's:
"""),
    code("""
for find_unused in (False, True):
    drifts = launch(unused_parameter_first_step_worker, 2, args=(find_unused,), echo=False)
    print(f"torch DDP, find_unused_parameters={find_unused}: after one step the ranks' "
          f"parameters are equal: {all(d.max_difference == 0 for d in drifts)}")
""", CHECK),
    md(r"""
With `find_unused_parameters=True` the step averaged the gradients and every rank took the
same step; without it the ranks have already diverged when the error comes.

Why not just send what arrived? Because the ranks must make the same collective calls in the
same order. If the head were used on rank 0 and not on rank 1, rank 0 would all-reduce that
bucket and rank 1 never would. Only rank 1 would raise; rank 0 would block in its all-reduce
until the process group's timeout, under `labs.ddp.DDP` as under torch's DDP.

With `find_unused_parameters=True`, after every forward DDP walks the autograd graph from
the output (`labs.ddp.params_in_graph`), marks the parameters it cannot reach as ready with
zero gradients, and so still launches every bucket, in order, on every rank. At the end one
extra small all-reduce of a "used" flag per parameter tells which parameters no rank used:
those keep `grad = None`, as in a single process. The price is the graph walk every step and
that extra all-reduce; torch's documentation recommends it only when a model needs it.

### Changing the model after wrapping it

DDP averages gradients; it never compares parameters. Anything that changes them on one rank
after the broadcast in the constructor is never undone. Below, rank 0 doubles a weight in place
after wrapping, then both ranks train five steps; then every rank replaces a layer after
wrapping (the new parameters belong to no bucket and get no hook):
"""),
    code("""
for change in ChangeAfterWrapping:
    for impl in (Implementation.OURS, Implementation.TORCH):
        try:
            drift = launch(change_after_wrapping_worker, 2, args=(change, impl), echo=False,
                           timeout=30)
            outcome = f"rank 1 differs from rank 0 by up to {drift[1].max_difference:.3f}"
        except (RankError, LaunchTimeout) as err:
            outcome = f"{type(err).__name__}: {first_line(err)}"
        print(f"{change.value}, {impl.value}:\\n    {outcome}")
""", CHECK),
    md(r"""
`labs.ddp.DDP`'s error for the replaced layer names `head.bias` and `head.weight`, and means
the *old* layer's parameters: the buckets were built from the model as it was when wrapped.
The old `head` is no longer used in forward, so its gradients never arrive; the new layer's
parameters belong to no bucket, so their gradients would never be averaged.

Build the model completely, load any checkpoint and move it to its device, *then* wrap it.

### Logging and checkpointing from rank 0

Every rank runs the same script, so a `print` prints $N$ times. Printing on rank 0 only is
the usual fix, but rank 0's loss is the loss of rank 0's shard; to log the batch's loss,
all-reduce it first, on every rank (a collective inside `if rank == 0:` would hang the
others):
"""),
    code("""
for mode in Logging:
    print(f"{mode.value}:")
    launch(logging_worker, 4, args=(mode,))
""", CHECK),
    md(r"""
A checkpoint is written once, by rank 0, from `model.module.state_dict()`: the wrapper's own
`state_dict()` prefixes every key with `module.`, and a bare model refuses those keys. Write
to a temporary file and rename it, so that a crash never leaves half a checkpoint, and make
the other ranks wait at a barrier before they read it. Load it with
`torch.load(path, map_location=device)`: tensors remember the device they were saved from, so
without `map_location` every rank of a GPU job would load rank 0's checkpoint onto `cuda:0`.
"""),
    code("""
with tempfile.TemporaryDirectory() as tmp:
    reports = launch(checkpoint_worker, 2, args=(str(Path(tmp) / "model.pt"),), echo=False)
print("wrapper's keys:      ", list(reports[0].wrapper_keys[:2]), "...")
print("model.module's keys: ", list(reports[0].module_keys[:2]), "...")
for r in reports:
    print(f"rank {r.rank}: loaded onto {r.storage_device}; a model from another seed differed "
          f"before loading: {r.differed_before}, equals the wrapped model after: {r.loaded_equal}")
""", CHECK),
    md(r"""
A bare model accepts `model.module`'s keys, and each rank's tensors land on the device
`map_location` names. Each rank loads into a model built from a seed of its own (`1000 + rank`),
which differs from the wrapped model until the load makes it equal.

### Seeding

Seeding every rank with `torch.manual_seed(seed)` so that the models agree is common advice.
They agree anyway: the wrapper broadcasts rank 0's parameters. Each rank below builds its
model after seeding with `100 + rank`, then wraps it (or not):
"""),
    code("""
for impl in (Implementation.LOCAL, Implementation.OURS, Implementation.TORCH):
    gaps = launch(seeding_worker, 2, args=(impl,), echo=False)
    name = "not wrapped" if impl is Implementation.LOCAL else f"wrapped in {impl.value}"
    print(f"{name}: rank 1's weights differ from rank 0's by up to {gaps[1]:.3f}")
""", CHECK),
    md(r"""
What seeds are for under DDP: the *sampler's* seed must be equal on every rank (above), and
a fixed seed makes a run reproducible. Dropout masks that differ between ranks are not a bug:
each rank drops units for different samples, as a single process would within one batch.
"""),
    md(r"""
## The training lab: a small transformer language model

`labs.train` trains a character-level transformer (token and position embeddings, two
pre-LayerNorm blocks of causal self-attention and an MLP, an output layer tied to the token
embedding) on the eight sentences of chapter 1. Everything about a run is one frozen
`TrainConfig`; `train_worker(rank, world_size, config)` is the whole training loop of one rank:

* the device comes from `labs.rank_device()`: `cuda:LOCAL_RANK` under nccl, the CPU under
  gloo;
* the data comes through a `DistributedSampler` with `set_epoch`, `drop_last=True` and the
  same seed on every rank;
* the model is wrapped in `labs.ddp.DDP`, `NaiveDDP` or torch's DDP (`Wrapper`);
  accumulated micro-batches before the last run inside `no_sync()`;
* rank 0 writes checkpoints from `model.module` (atomically, then a barrier); a resumed run
  loads with `map_location` before wrapping and continues exactly where it stopped.
"""),
    code("""
config = TrainConfig(steps=60, wrapper=Wrapper.OURS)
model = config.model()
print(f"{sum(p.numel() for p in model.parameters()):,} parameters, vocabulary of "
      f"{len(CHARS)} characters, {len(TEXT)} training windows of {config.seq_len} characters")
runs = {wrapper: launch(train_worker, 2, args=(dataclasses.replace(config, wrapper=wrapper),),
                        echo=False, timeout=300)
        for wrapper in Wrapper}
fig = plot_loss({f"{w.value} ({runs[w][0].seconds:.1f} s)": runs[w][0].losses for w in Wrapper},
                title="Training loss, 2 ranks (times in the legend vary)")
""", IGNORE),
    md(r"""
The three wrappers compute the same averages, and at two ranks to the same bits. An
all-reduce over two ranks is one addition, $a + b$, whatever the algorithm. `NaiveDDP` and
`labs.ddp.DDP` divide the sum by 2; torch divides each bucket by 2 before the all-reduce and
sums $a/2 + b/2$. Dividing by 2 only lowers the exponent, so it is exact, and both orders give
the same float. The three curves are therefore not just close, they are the same numbers:
"""),
    code("""
curves = {w: torch.tensor(runs[w][0].losses) for w in Wrapper}
for w in (Wrapper.NAIVE, Wrapper.TORCH):
    gap = (curves[w] - curves[Wrapper.OURS]).abs().max().item()
    print(f"{w.value} vs ours: max |loss difference| over 60 steps = {gap:.1e}")
print(f"loss at step 1: {curves[Wrapper.OURS][0]:.3f}, at step 60: {curves[Wrapper.OURS][-1]:.3f}")
print("every rank reports the same parameters:",
      all(r.checksum == runs[Wrapper.OURS][0].checksum for r in runs[Wrapper.OURS]))
""", CHECK),
    md(r"""
### Checkpoint, stop, resume

Thirty steps with a checkpoint, a new launch that resumes from it to step 60, compared with
the uninterrupted run above:
"""),
    code("""
with tempfile.TemporaryDirectory() as tmp:
    path = str(Path(tmp) / "lab.pt")
    first = launch(train_worker, 2, args=(dataclasses.replace(config, steps=30, checkpoint=path),),
                   echo=False, timeout=300)
    second = launch(train_worker, 2, args=(dataclasses.replace(config, checkpoint=path,
                                                                resume=True),),
                    echo=False, timeout=300)
print(f"first launch: steps 1-{first[0].steps}, checkpoint written by rank(s) "
      f"{[r.rank for r in first if r.saved_steps]}")
print(f"second launch: resumed at step {second[0].start_step}, ran to "
      f"{second[0].start_step + second[0].steps}")
resumed = torch.tensor(first[0].losses + second[0].losses)
print("same losses as the uninterrupted run:", torch.equal(resumed, curves[Wrapper.OURS]))
print("same final parameters:", second[0].checksum == runs[Wrapper.OURS][0].checksum)
""", CHECK),
    md(r"""
### The same lab under torchrun

`python -m labs ddp` runs the same `train_worker` with the same `TrainConfig`: locally through
`launch`, or inside processes started by `torchrun`, which then join torchrun's rendezvous and
pick `cuda:LOCAL_RANK` under nccl. Started from this notebook as a shell command would start
it:
"""),
    code("""
command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "labs", "ddp", "--steps", "60"]
print("$ torchrun --standalone --nproc_per_node=2 -m labs ddp --steps 60")
done = subprocess.run(command, capture_output=True, text=True, timeout=300)
print(done.stdout.strip() if done.returncode == 0 else done.stderr[-2000:])
""", IGNORE),
    code("""
final = float(done.stdout.split("final loss ")[1].split()[0])
print(f"torchrun's final loss {final:.4f}, the notebook's {curves[Wrapper.OURS][-1]:.4f}: "
      f"{'the same' if abs(final - curves[Wrapper.OURS][-1].item()) < 5e-5 else 'DIFFERENT'}")
""", CHECK),
    md(r"""
### What a first multi-GPU script often gets wrong

A training script written and tried on one machine can break on two. These are the usual
mistakes:

* Calling `torch.cuda.set_device(rank)` and `model.to(rank)` with the **global** rank.
  With two nodes of four GPUs, torchrun numbers the processes of the second node 4 to 7, and
  that node has `cuda:0` to `cuda:3` only. The device index is `LOCAL_RANK`:
"""),
    code("""
rows = []
for node in range(2):
    for local_rank in range(4):
        rank = node * 4 + local_rank  # what torchrun sets as RANK with --nproc_per_node=4
        rows.append([node, local_rank, rank, f"cuda:{rank}" + (" (no such GPU)" if rank > 3
                                                             else ""), f"cuda:{local_rank}"])
print(format_table(["node", "LOCAL_RANK", "RANK", "device(rank)", "right device"], rows))
""", CHECK),
    md(r"""
* Rank 0 saving a checkpoint while the other ranks race ahead; nothing makes them wait
  for a complete file before anyone reads it, the file is written in place (a crash leaves
  half of it), and it is later loaded without `map_location`.
* Logging rank 0's local loss as if it were the batch's.
* Accumulating gradients with the one-GPU loop, which all-reduces every micro-batch (measured
  above).

`labs.train` does each of these the other way; the lab's loop is short enough to read:
"""),
    code("""
display(Code(inspect.getsource(train_worker), language="python"))
""", HIDE),
    md(r"""
## Try it: the DDP panel

World size, bucket cap and micro-batches per optimizer step; the button times NaiveDDP, DDP
and torch DDP on real ranks and draws one backward pass of NaiveDDP and one of labs' DDP. The
run below the panel is the default one.
"""),
    code("""
ddp_panel(world_size=2, bucket_cap_mb=0.25, accumulation=1, settings=SETTINGS)
""", IGNORE),
    md(r"""
## Exercise 5.1: `SimpleDDP`

Write the naive wrapper yourself. `SimpleDDP(module)` must

* keep the model as `self.module` and make `forward` call it;
* in `__init__`, broadcast every parameter and every buffer from rank 0 (`dist.broadcast`),
  so that ranks that built their models differently start equal;
* in `finish_gradient_synchronization()`, replace each trainable parameter's `.grad` by its
  mean over the ranks. Frozen parameters (`requires_grad=False`) have no gradient: skip them.

The check builds a model with awkward parts (a weight used by two layers, a frozen parameter,
a buffer used in forward) with a different initialisation on every rank, trains it for three
SGD steps through your wrapper on 1 to 4 ranks, each rank on its share of one batch, and after
every step compares every rank's parameters with one process trained on the whole batch.
"""),
    solution("""
class SimpleDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)        # rank 0's values everywhere

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for p in self.module.parameters():
            if p.requires_grad:
                dist.all_reduce(p.grad)              # the sum over ranks ...
                p.grad /= world_size                 # ... divided: the mean
""", "5.1"),
    check("""
result = check_simple_ddp(SimpleDDP)
""", "5.1"),
    md(r"""
## Exercise 5.2: `BucketedDDP`

Now the real thing. `BucketedDDP(module, bucket_cap_mb)` broadcasts like `SimpleDDP`, and

* splits the trainable parameters into buckets by this rule: walk `module.parameters()`
  (trainable ones only) in **reverse** order, append each to the current bucket, and close
  the bucket as soon as it holds `bucket_cap_mb * 2**20` bytes **or more** (so a tiny cap
  gives one parameter per bucket, a huge one a single bucket);
* gives each bucket one flat buffer and registers `p.register_post_accumulate_grad_hook(hook)`
  on every trainable parameter: the hook receives the parameter and copies its `.grad` into
  its place in the buffer;
* when a bucket holds all its gradients, launches `dist.all_reduce(buffer, async_op=True)`,
  **in bucket order** (every rank must make the same calls in the same order, and a bucket can
  fill up before the one before it);
* in `finish_gradient_synchronization()`, waits for every bucket's work, divides by the world
  size, and copies each parameter's part of the buffer back into its `.grad`.

The check runs a parity test like 5.1's (on the world sizes its verdict lists) with three
bucket caps, and counts your all-reduces inside the ranks: their number and sizes must follow
the rule, in bucket order, and each must be launched asynchronously while `loss.backward()`
is still running. One all-reduce at the end, or a blocking one in the hook, fails: that is
`SimpleDDP` again.
"""),
    solution("""
class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, current, size = [], [], 0
        for p in reversed(params):                    # backward's order, roughly
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap_mb * 2**20:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.slot = {}                                # id(p) -> (bucket, offset)
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.slot[id(p)] = (i, offset)
                offset += p.numel()
        self.reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self.hook)

    def reset(self):
        self.arrived = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)
        self.next_bucket = 0

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def hook(self, p):
        i, offset = self.slot[id(p)]
        self.flat[i][offset:offset + p.numel()].copy_(p.grad.view(-1))
        self.arrived[i] += 1
        while (self.next_bucket < len(self.buckets)
               and self.arrived[self.next_bucket] == len(self.buckets[self.next_bucket])):
            self.works[self.next_bucket] = dist.all_reduce(self.flat[self.next_bucket],
                                                           async_op=True)
            self.next_bucket += 1

    def finish_gradient_synchronization(self):
        for i, bucket in enumerate(self.buckets):
            self.works[i].wait()
            self.flat[i] /= dist.get_world_size()
            offset = 0
            for p in bucket:
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.reset()
""", "5.2"),
    check("""
result = check_bucketed_ddp(BucketedDDP)
""", "5.2"),
    md(r"""
## Summary

* With equal local batches, averaging the ranks' gradients gives exactly the full batch's
  gradient (up to float rounding). With unequal ones it does not; DDP divides by $N$.
* `NaiveDDP`: broadcast at construction, one blocking all-reduce per parameter after
  backward. Correct, and it wastes both the latency of many small messages and the time
  backward spends computing.
* `DDP`: buckets in reverse registration order, filled by post-accumulate-grad hooks, each
  all-reduced asynchronously as soon as it is full, in bucket order on every rank; the
  measured timeline shows communication running during backward. Same bytes per rank,
  $2\frac{N-1}{N}S$; fewer messages, started earlier.
* Without `no_sync()`, every micro-batch's backward all-reduces every bucket: $k$ rounds per
  optimizer step. With `no_sync()` around all but the last micro-batch, one round.
* The `DistributedSampler` interleaves, pads to a multiple of $N$ (double-counting in
  evaluation), and needs `set_epoch` and the same seed on every rank.
* A parameter unused on every rank makes both wrappers raise; torch's DDP only at the second
  step, after a first step on un-averaged gradients. One unused on some ranks only leaves the
  other ranks blocked until the timeout. `find_unused_parameters=True` walks the graph after
  forward.
* Change the model before wrapping, log the all-reduced loss from rank 0, checkpoint
  `model.module` from rank 0 and load with `map_location`, and pick the device from
  `LOCAL_RANK`.

Every rank still holds the whole model, its gradients and its optimizer state. Chapter 6
shards them.
"""),
]

write_notebook(cells, "05_ddp.ipynb")
