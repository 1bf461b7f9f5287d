"""Chapter 7's whole recipe: the chapter-5 transformer trained with FSDP as it is done in
practice, and the memory budget of one of its steps.

One optimizer step on N ranks, k micro-batches of B windows of T characters each:

* ``FSDP(model, compute_dtype, reduce_dtype=float32, units=blocks,
  activation_checkpointing=...)``: fp32 master shards, parameters gathered and computed in
  ``compute_dtype``, gradients reduce-scattered in fp32;
* the first k - 1 micro-batches inside ``no_sync()`` (one reduce-scatter per unit a step);
* ``clip_grad_norm_(max_norm)`` across the shards (one 4-byte all-reduce);
* AdamW on the shards (fp32);
* every ``checkpoint_every`` steps and at the end, :func:`labs.checkpoint.save`: each rank
  writes its shards; a run resumes from it on *any* number of ranks.

The global batch is N * k * B windows: a run resumed on N/2 ranks with 2k micro-batches
keeps it. (The order of the samples depends on N, so such a run continues the loss curve,
not the exact sequence of batches an N-rank run would have read.)

:func:`recipe_worker` measures rank 0's peak over one step (tensor storages, as
:mod:`labs.memory` counts them) and :func:`peak_budget` sets beside it the closed form of each
thing a rank holds then: its shards of the parameters, gradients and Adam state (1/N), the
activations saved for backward (:func:`labs.activations.activation_bytes`), the block being
recomputed, the gathered units and the collectives in flight. :func:`memory_budget` keeps the
terms that grow with the model, for the chapter's calculator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labs import checkpoint
from labs.activations import activation_bytes
from labs.clock import now
from labs.fsdp import FSDP
from labs.launcher import rank_device
from labs.memory import AllocationTracker
from labs.tables import format_table
from labs.train import TEXT, TrainConfig, micro_batches
from labs.zero import shard_numel

#: Settings a resumed run must share with the run that wrote the checkpoint: the model.
MODEL_FIELDS = ("d_model", "n_heads", "n_layers", "seq_len")

_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class RecipeConfig:
    """One run of the recipe (``python -m labs fsdp`` parses into one).

    Attributes:
        steps: optimizer steps to reach (a resumed run continues up to it).
        batch_size: windows per rank per micro-batch.
        accumulation: micro-batches per optimizer step (k - 1 of them inside ``no_sync``).
        lr: AdamW learning rate.
        seed: initialisation and data order.
        d_model, n_heads, n_layers, seq_len: the transformer (chapter 5's ``TinyTransformer``).
        dtype: ``"fp32"`` or ``"bf16"``: FSDP's compute dtype (gradients reduced in fp32).
        activation_checkpointing: checkpoint every block (FSDP unit).
        max_norm: clip the gradient's total norm to this (None: no clipping).
        checkpoint: directory to save to (and resume from), or None.
        checkpoint_every: also save every this many steps (None: at the end only).
        resume: start from ``checkpoint``'s step.
        measure_memory: measure rank 0's memory over the last step (slower: every operator
            of that step is seen by an :class:`~labs.memory.AllocationTracker`).
        fail_at_step: rank 1 raises :class:`InjectedFailure` as this step starts, in a run
            that did not resume (a crash to recover from: under ``torchrun --max-restarts``
            the restarted ranks resume from the last checkpoint and do not fail again).
    """

    steps: int = 30
    batch_size: int = 4
    accumulation: int = 2
    lr: float = 3e-3
    seed: int = 0
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 8
    seq_len: int = 32
    dtype: str = "bf16"
    activation_checkpointing: bool = True
    max_norm: float | None = 1.0
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    measure_memory: bool = False
    fail_at_step: int | None = None

    def __post_init__(self) -> None:
        self.train_config()  # its checks: positive sizes, heads dividing d_model, lr
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}.")
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"max_norm must be positive (or None for no clipping), got "
                             f"{self.max_norm!r}; try 1.0.")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1 step, got "
                             f"{self.checkpoint_every}; leave it out to save at the end only.")
        if (self.resume or self.checkpoint_every is not None) and not self.checkpoint:
            raise ValueError("resume and checkpoint_every need a checkpoint directory: give "
                             "its path.")
        if self.fail_at_step is not None and (
                isinstance(self.fail_at_step, bool) or not isinstance(self.fail_at_step, int)
                or not 1 <= self.fail_at_step <= self.steps):
            raise ValueError(f"fail_at_step must be a step of the run, 1 to steps={self.steps}, "
                             f"got {self.fail_at_step!r}.")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return _DTYPES[self.dtype]

    def train_config(self) -> TrainConfig:
        """The same run as chapter 5's settings: its data order and its model."""
        return TrainConfig(steps=self.steps, batch_size=self.batch_size,
                           accumulation=self.accumulation, lr=self.lr, seed=self.seed,
                           d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers,
                           seq_len=self.seq_len)

    def check(self, world_size: int) -> int:
        """Refuse, before any process starts, what cannot run on ``world_size`` ranks; return
        the step a resume starts from (0 without resume)."""
        self.train_config().steps_per_epoch(world_size)
        if self.fail_at_step is not None and world_size < 2:
            raise ValueError(f"fail_at_step makes rank 1 fail: it needs at least 2 ranks, got "
                             f"{world_size}.")
        if not self.resume:
            return 0
        saved = read_recipe(str(self.checkpoint))
        differ = [f"{name}={saved[name]} (now {getattr(self, name)})" for name in MODEL_FIELDS
                  if saved[name] != getattr(self, name)]
        if differ:
            raise ValueError(f"the checkpoint {self.checkpoint} holds another model: "
                             f"{', '.join(differ)}. Resume with its settings.")
        if saved["step"] > self.steps:
            raise ValueError(f"the checkpoint is at step {saved['step']}, past steps="
                             f"{self.steps}: ask for more steps.")
        return int(saved["step"])


class InjectedFailure(RuntimeError):
    """The crash ``fail_at_step`` asks for."""


def read_recipe(path: str) -> dict[str, object]:
    """The step and settings a recipe run saved with its checkpoint in directory ``path``
    (every shard file is checked to be there, at its size)."""
    extra = dict(checkpoint.inspect(path).extra or {})
    if "step" not in extra:
        raise ValueError(f"the checkpoint in {path} was not written by this recipe (its index "
                         "has no step): resume from a directory that `python -m labs fsdp "
                         "--checkpoint` wrote.")
    return extra


@dataclass(frozen=True)
class BudgetRow:
    """One thing rank 0 holds at the peak of a step: its closed form, in bytes."""

    name: str
    model_bytes: int
    how: str  #: the formula, in words


@dataclass(frozen=True)
class RecipeResult:
    """What one rank reports (the losses are the mean over ranks, the same everywhere)."""

    rank: int
    world_size: int
    start_step: int
    losses: tuple[float, ...]  #: steps start_step + 1 .. steps
    grad_norms: tuple[float, ...]  #: total norm before clipping, per step
    seconds: float
    saved_steps: tuple[int, ...]
    peak_bytes: int | None  #: measured over the last step (``measure_memory``), rank 0
    budget: tuple[BudgetRow, ...]  #: the closed forms beside it (rank 0)
    #: On a GPU: ``torch.cuda.max_memory_allocated`` over the same step (rank 0), what the
    #: caching allocator handed out: the tracked storages, rounded up to its 512-byte blocks,
    #: and what kernels and libraries allocate through it that no tensor of the step holds
    #: (cuBLAS's workspace, a kernel's scratch).
    cuda_peak_bytes: int | None = None

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


def build(config: RecipeConfig, world_size: int) -> tuple[FSDP, torch.optim.Optimizer]:
    """The wrapped model and its optimizer, the same way on every rank."""
    net = config.train_config().model().to(rank_device())
    model = FSDP(net, config.compute_dtype, reduce_dtype=torch.float32,
                 units=list(net.blocks),
                 activation_checkpointing=config.activation_checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    return model, optimizer


def recipe_worker(rank: int, world_size: int, config: RecipeConfig) -> RecipeResult:
    """Train up to ``config.steps`` (from the checkpoint's step when resuming)."""
    start_step = config.check(world_size)
    model, optimizer = build(config, world_size)
    if config.resume:
        checkpoint.load(str(config.checkpoint), model, optimizer)
    batches = micro_batches(config.train_config(), rank, world_size, start_step)
    device = rank_device()
    losses: list[torch.Tensor] = []
    norms: list[torch.Tensor] = []
    saved: list[int] = []
    tracker: AllocationTracker | None = None
    started = now(device)  # synchronized: on a GPU the steps end when their kernels do
    for step in range(start_step + 1, config.steps + 1):
        if step == config.fail_at_step and rank == 1 and not config.resume:
            raise InjectedFailure(f"rank 1 fails as step {step} starts (fail_at_step={step}); "
                                  f"the last checkpoint holds step {saved[-1] if saved else 0}")
        measured = config.measure_memory and rank == 0 and step == config.steps
        with (AllocationTracker() if measured else contextlib.nullcontext()) as tracker_now:
            if measured:
                tracker = tracker_now
                tracker.track(held_tensors(model, optimizer))
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
            total = torch.zeros((), device=device)
            for micro in range(config.accumulation):
                x, y = (t.to(device) for t in next(batches))
                last = micro == config.accumulation - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    logits = model(x).float()
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                    (loss / config.accumulation).backward()
                total += loss.detach() / config.accumulation
            model.finish_gradient_synchronization()
            norm = model.clip_grad_norm_(config.max_norm or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(norm.detach())
        if config.checkpoint and (step == config.steps or (
                config.checkpoint_every and step % config.checkpoint_every == 0)):
            save(config, model, optimizer, step)
            saved.append(step)
    seconds = now(device) - started
    curve = torch.stack(losses) if losses else torch.zeros(0, device=device)
    dist.all_reduce(curve)  # one all-reduce of the whole curve, not a sync point per step
    curve /= world_size
    return RecipeResult(
        rank=rank, world_size=world_size, start_step=start_step,
        losses=tuple(curve.tolist()), grad_norms=tuple(float(n) for n in norms),
        seconds=seconds, saved_steps=tuple(saved),
        peak_bytes=tracker.peak_bytes if tracker is not None else None,
        budget=tuple(peak_budget(config, world_size, device_type=device.type))
        if tracker is not None else (),
        cuda_peak_bytes=torch.cuda.max_memory_allocated(device)
        if tracker is not None and device.type == "cuda" else None)


def save(config: RecipeConfig, model: FSDP, optimizer: torch.optim.Optimizer, step: int
         ) -> None:
    """Every rank writes its shards; the step and the settings go into the index, which is
    written last (a directory with an index is a complete checkpoint)."""
    checkpoint.save(str(config.checkpoint), model, optimizer,
                    extra={**dataclasses.asdict(config), "step": step})


def held_tensors(model: FSDP, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a rank holds between steps: its shards, frozen parameters, buffers, Adam state;
    and every unit's full vector, empty between steps: the all-gather fills a storage that
    exists already (``resize_``, no operator makes it), so the tracker must be told of it to
    see the gathered parameters."""
    tensors = [*model.parameters(), *model.buffers(), *(u.full for u in model.units)]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def unit_sizes(config: RecipeConfig, vocab: int | None = None) -> list[int]:
    """Elements of each FSDP unit of the recipe's model: one per block, then the root
    (embeddings, final LayerNorm; the output head is the token embedding, tied).

    A block: two LayerNorms (2D each), qkv (3D^2 + 3D), the attention's projection
    (D^2 + D), the MLP (4D^2 + 4D and 4D^2 + D): 12D^2 + 13D."""
    d = config.d_model
    block = 12 * d * d + 13 * d
    root = ((vocab or len(set(TEXT))) + config.seq_len) * d + 2 * d
    return [block] * config.n_layers + [root]


def memory_budget(config: RecipeConfig, world_size: int, vocab: int | None = None
                  ) -> list[BudgetRow]:
    """The closed form of each thing a rank holds at the peak of a step, in bytes.

    The peak comes in the last micro-batch. Held throughout: the fp32 shards of the
    parameters and Adam's two moments. With k > 1, every unit's full fp32 gradient, kept by
    ``no_sync`` since the first micro-batch (the shard gradients appear only as the units
    reduce-scatter, after the peak). Without checkpointing the peak is the end of forward and
    the start of backward: every activation of the micro-batch, and the last block gathered
    for its backward. With checkpointing, the activations are the blocks' inputs, and the
    peak moves into backward: two blocks gathered (one computing, one prefetched) and one
    block's full gradient in the compute dtype, about to be reduce-scattered, and the block
    being recomputed for its backward, whose activations are alive again."""
    vocab = vocab or len(set(TEXT))  # the recipe's characters; the calculator takes any
    padded_units = [shard_numel(n, world_size) * world_size
                    for n in unit_sizes(config, vocab)]
    padded = sum(padded_units)
    shard = padded // world_size  # fp32 elements, padding included
    element = torch.finfo(config.compute_dtype or torch.float32).bits // 8
    block = padded_units[0]
    saved = activation_bytes(config.batch_size, config.seq_len, config.d_model,
                             config.n_heads, config.n_layers, vocab,
                             element_size=element,
                             checkpointing=config.activation_checkpointing)
    rows = [
        BudgetRow("parameters", 4 * shard, "fp32 shards: 4 B x P/N"),
        BudgetRow("optimizer state", 8 * shard, "Adam, fp32 shards: 2 x 4 B x P/N"),
        BudgetRow("gradients", 4 * padded if config.accumulation > 1 else 0,
                  "kept whole by no_sync, fp32: 4 B x P" if config.accumulation > 1
                  else "none yet: the shards appear after the peak"),
        BudgetRow("activations", saved, "blocks' inputs, one micro-batch"
                  if config.activation_checkpointing else "saved for backward, one micro-batch"),
    ]
    if config.activation_checkpointing:
        rows.append(BudgetRow("communication buffers", 3 * element * block,
                              "two blocks gathered, one block's full gradient"))
        rows.append(BudgetRow("recomputed block", recomputed_block_bytes(config, vocab),
                              "one block's activations: BT(16D + HT + 4)e + T^2"))
    else:
        rows.append(BudgetRow("communication buffers", element * block,
                              "the last block gathered for its backward"))
    return rows


def recomputed_block_bytes(config: RecipeConfig, vocab: int | None = None, *,
                           device_type: str = "cpu") -> int:
    """One block's activations, alive again while checkpointing recomputes it for its
    backward: B T (16 D + H T + 4) e + T^2 (:func:`labs.activations.activation_bytes` of one
    block, on ``device_type``, less what checkpointing keeps of it, its input)."""
    vocab = vocab or len(set(TEXT))
    e = torch.finfo(config.compute_dtype or torch.float32).bits // 8
    shape = (config.batch_size, config.seq_len, config.d_model, config.n_heads)
    whole = activation_bytes(*shape, 1, vocab, element_size=e, device_type=device_type)
    inputs_only = activation_bytes(*shape, 1, vocab, element_size=e, checkpointing=True,
                                   device_type=device_type)
    return whole - inputs_only + config.batch_size * config.seq_len * config.d_model * e


def peak_budget(config: RecipeConfig, world_size: int, vocab: int | None = None, *,
                device_type: str = "cpu") -> list[BudgetRow]:
    """Every closed form rank 0 holds at the peak of a step: the largest of
    :func:`backward_moments` (see there)."""
    return max(backward_moments(config, world_size, vocab, device_type=device_type),
               key=lambda rows: sum(r.model_bytes for r in rows))


def peak_moment(config: RecipeConfig, world_size: int, vocab: int | None = None) -> int:
    """How many blocks' backward are done at the peak, by the closed forms."""
    totals = [sum(r.model_bytes for r in rows)
              for rows in backward_moments(config, world_size, vocab)]
    return totals.index(max(totals))


def backward_moments(config: RecipeConfig, world_size: int, vocab: int | None = None, *,
                     device_type: str = "cpu") -> list[list[BudgetRow]]:
    """The closed forms of what rank 0 holds at each block's backward in the last
    micro-batch (entry i: i blocks' backward done), on gloo, as :func:`recipe_worker`
    measures a step, transients included.

    :func:`memory_budget` keeps the terms that grow with a large model; this one adds what
    is in flight, so that the rows account for the measured peak. The peak falls in the last
    micro-batch's backward, at some block's backward; which one depends on the settings, so
    each block's moment is written down (:func:`peak_budget` takes the largest). With i
    blocks' backward done (i = 0 .. L-1), e bytes per element of the compute dtype, S_b a
    block's elements, S_r the root unit's (padded to a multiple of N):

    * the fp32 shards of the parameters (4P/N) and of Adam's two moments (8P/N);
    * gradients: with k > 1, every unit's whole fp32 gradient kept by ``no_sync`` (4P), less
      the i - 1 blocks whose reduce-scatter has landed, which hold their fp32 shard instead
      (4 S_b/N each); with k = 1, those shards only;
    * the reduce-scatter in flight (i >= 1): the previous block's fp32 gradient (with k = 1;
      with k > 1 it is the ``no_sync`` gradient, in the row above) and the buffer that gloo's
      all-to-all receives it into, all N pieces of S_b/N: 4 S_b (on NCCL an S_b/N shard);
    * the gathered parameters, in the compute dtype: the root unit, this block and the next
      one, prefetched (not at the last block): e (S_r + 2 S_b);
    * the prefetch's shard cast to the compute dtype, alive until its all-gather is waited
      for (e S_b/N; none in fp32, where the shard itself is sent, or on one rank);
    * the activations of the micro-batch (:func:`labs.activations.activation_bytes`) less
      the i blocks whose backward is done: each kept its whole activations, or with
      checkpointing only its input (B T D e);
    * with checkpointing, the block being recomputed: one block's activations,
      B T (16 D + H T + 4) e + T^2.

    On ``device_type="cuda"`` the activations count LayerNorm's statistics in float32, as
    CUDA's kernel keeps them (:func:`labs.activations.activation_bytes`).

    Not in it: the tensors backward makes and frees as it goes (the gradient of the residual
    stream, a layer's weight gradient before it is added to the block's), a few per cent."""
    vocab = vocab or len(set(TEXT))
    n = world_size
    sizes = [shard_numel(s, n) * n for s in unit_sizes(config, vocab)]
    padded, block, root = sum(sizes), sizes[0], sizes[-1]
    e = torch.finfo(config.compute_dtype or torch.float32).bits // 8
    shape = (config.batch_size, config.seq_len, config.d_model, config.n_heads)
    ckpt = config.activation_checkpointing
    block_input = config.batch_size * config.seq_len * config.d_model * e
    # B T (16 D + H T + 4) e + T^2
    one_block = recomputed_block_bytes(config, vocab, device_type=device_type)
    saved = activation_bytes(*shape, config.n_layers, vocab, element_size=e,
                             checkpointing=ckpt, device_type=device_type)
    kept = block_input if ckpt else one_block  # what each block holds until its backward
    shard_bytes = 4 * block // n
    moments = []
    for i in range(config.n_layers):
        landed = max(i - 1, 0)
        last = i == config.n_layers - 1
        if config.accumulation > 1:
            grads = BudgetRow("gradients", 4 * (padded - landed * block) + landed * shard_bytes,
                              "kept whole by no_sync, fp32: 4 B x P"
                              + (f" ({landed} block(s) already shards)" if landed else ""))
        else:
            grads = BudgetRow("gradients", landed * shard_bytes,
                              f"fp32 shards of {landed} block(s) reduce-scattered")
        in_flight = (4 * block if config.accumulation == 1 else 0) + 4 * block if i else 0
        what = "blocks' inputs" if ckpt else "saved for backward"
        rows = [
            BudgetRow("parameters", 4 * padded // n, "fp32 shards: 4 B x P/N"),
            BudgetRow("optimizer state", 8 * padded // n, "Adam, fp32 shards: 2 x 4 B x P/N"),
            grads,
            BudgetRow("reduce-scatter in flight", in_flight,
                      "none yet" if not i else "gloo's receive buffer: 4 B x S_block"
                      + (" + the block's fp32 gradient" if config.accumulation == 1 else "")),
            BudgetRow("gathered parameters", e * (root + block * (1 if last else 2)),
                      "root, this block" + ("" if last else ", the next (prefetched)")),
            BudgetRow("all-gather in flight", 0 if last or n == 1 or e == 4 else e * block // n,
                      "the prefetch's shard in the compute dtype: e x S_block/N"),
            BudgetRow("activations", saved - i * kept,
                      f"{what}, one micro-batch" + (f", less {i} block(s) done" if i else "")),
        ]
        if ckpt:
            rows.append(BudgetRow("recomputed block", one_block,
                                  "one block's activations: BT(16D + HT + 4)e + T^2"))
        moments.append(rows)
    return moments


def budget_table(result: RecipeResult) -> str:
    """Rank 0's budget: each closed form, their sum, and the measured peak beside it."""
    if result.peak_bytes is None:
        raise ValueError("this run did not measure memory: set measure_memory=True.")
    mib = 2**20
    total = sum(r.model_bytes for r in result.budget)
    rows = [[r.name, f"{r.model_bytes / mib:.3f}", r.how] for r in result.budget]
    rows += [["sum of the rows", f"{total / mib:.3f}", ""],
             ["measured peak", f"{result.peak_bytes / mib:.3f}",
              "tensor storages, the last step"],
             ["the rest (measured - sum)", f"{(result.peak_bytes - total) / mib:.3f}",
              f"{(result.peak_bytes - total) / result.peak_bytes:+.1%} of the peak"]]
    if result.cuda_peak_bytes is not None:
        extra = result.cuda_peak_bytes - result.peak_bytes
        rows += [["torch.cuda.max_memory_allocated", f"{result.cuda_peak_bytes / mib:.3f}",
                  "the caching allocator's peak, the same step"],
                 ["allocator - measured peak", f"{extra / mib:.3f}",
                  "512-byte rounding, cuBLAS workspace, kernels' scratch"]]
    return format_table(["held by rank 0", "MiB", "closed form"], rows)


def budget_error(result: RecipeResult) -> float:
    """(measured peak - sum of the closed forms) / measured peak."""
    assert result.peak_bytes is not None
    return (result.peak_bytes - sum(r.model_bytes for r in result.budget)) / result.peak_bytes


def budget_sweep_worker(rank: int, world_size: int, configs: tuple[RecipeConfig, ...]
                        ) -> list[RecipeResult]:
    """:func:`recipe_worker` for each of ``configs`` in turn, in one launch (one process
    group): the budget checked at several settings for the price of one start."""
    return [recipe_worker(rank, world_size, config) for config in configs]


def budget_sweep_table(results: list[RecipeResult], configs: tuple[RecipeConfig, ...]) -> str:
    """One line per setting: the rows' sum, the measured peak and the rest."""
    mib = 2**20
    rows = []
    for config, result in zip(configs, results, strict=True):
        total = sum(r.model_bytes for r in result.budget)
        rows.append([config.accumulation, "yes" if config.activation_checkpointing else "no",
                     peak_moment(config, result.world_size), f"{total / mib:.3f}",
                     f"{(result.peak_bytes or 0) / mib:.3f}", f"{budget_error(result):+.1%}"])
    return format_table(["k", "checkpointing", "blocks' backward done at the peak (model)",
                         "sum of the rows (MiB)", "measured peak (MiB)",
                         "the rest"], rows)


def loss_report(result: RecipeResult, rows: int = 8) -> str:
    """The loss every few steps, then the time."""
    every = max(1, len(result.losses) // rows)
    steps = range(result.start_step + 1, result.start_step + len(result.losses) + 1)
    table = [[step, loss, norm] for step, loss, norm in
             zip(steps, result.losses, result.grad_norms, strict=True)
             if step % every == 0 or step == steps[-1]]
    return "\n".join([
        format_table(["step", "loss", "gradient norm (before clipping)"], table),
        f"final loss {result.final_loss:.4f} after step {steps[-1] if table else 0}, on "
        f"{result.world_size} rank{'s' if result.world_size > 1 else ''} ({result.seconds:.2f} s)"])
