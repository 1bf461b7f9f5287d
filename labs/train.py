"""Chapter 5's lab: train a small transformer language model with data parallelism.

Every rank builds the same model, takes its own share of the data through a
``DistributedSampler`` and averages gradients with one of three wrappers
(:data:`labs.wrappers.DDP_WRAPPERS`).
One optimizer step on N ranks with a local batch of B windows of T characters, accumulated
over k micro-batches, sees N * k * B * T tokens and costs one gradient all-reduce per bucket
(2(N-1)/N * S bytes per rank for S bytes of gradients, chapter 2), whatever k is: the first
k - 1 micro-batches run inside ``no_sync()``.

Checkpoints are written by rank 0 alone, atomically, and a run resumed from one continues
exactly as if it had never stopped: the data order is a function of (seed, epoch), and the
epoch and the position inside it are derived from the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from labs.clock import now
from labs.ddp import DDP, DEFAULT_BUCKET_CAP_MB, NaiveDDP
from labs.launcher import rank_device
from labs.toy_allreduce import EXAMPLE_SENTENCES
from labs.wrappers import DDP_WRAPPERS, Wrapper, wrap

#: The training text: the seed sentences, one per line (the newline marks where one ends).
TEXT: str = "".join(sentence + "\n" for sentence in EXAMPLE_SENTENCES)
#: Its characters, sorted: the model's vocabulary (built like ``toy_allreduce.VOCAB``).
CHARS: tuple[str, ...] = tuple(sorted(set(TEXT)))


def encode(text: str) -> torch.Tensor:
    """Character ids of ``text``, shape (len(text),)."""
    return torch.tensor([CHARS.index(c) for c in text], dtype=torch.long)


def char_windows(seq_len: int) -> TensorDataset:
    """Every window of ``seq_len`` characters of :data:`TEXT` read cyclically, with its
    next-character targets: ``len(TEXT)`` samples of (input, target), each (seq_len,) long."""
    ids = encode(TEXT + TEXT[: seq_len])  # cyclic, so every position starts a window
    starts = torch.arange(len(TEXT))[:, None] + torch.arange(seq_len)  # (N, seq_len)
    return TensorDataset(ids[starts], ids[starts + 1])


# --- the model ----------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only.

    ``softmax(Q K^T / sqrt(d_head) + M) V`` with ``M[t, s] = -inf`` for ``s > t``; cost
    O(T^2 d) per sequence."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # (B, T, D) -> (B, heads, T, D / heads)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, heads, T, T)
        # Built per call, not a registered buffer: DDP would broadcast a buffer every forward.
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A character-level decoder-only transformer whose output head is the token embedding
    (weight tying: one parameter used twice, so its gradient has two contributions that a
    data-parallel wrapper must sum before averaging)."""

    def __init__(self, vocab_size: int, d_model: int = 32, n_heads: int = 2, n_layers: int = 2,
                 seq_len: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (B, T) character ids -> (B, T, vocab) logits for the next character."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln_f(self.blocks(self.tok_emb(ids) + self.pos_emb(positions))))

    def reset_parameters(self, generator: torch.Generator) -> None:
        """GPT-2's initialisation, drawn from ``generator`` (the global RNG is not touched):
        weights N(0, 0.02^2), biases 0, LayerNorm scales 1."""
        norm_scales = {id(m.weight) for m in self.modules() if isinstance(m, nn.LayerNorm)}
        with torch.no_grad():
            for name, param in self.named_parameters():  # the tied weight once
                if name.endswith("bias"):
                    param.zero_()
                elif id(param) in norm_scales:
                    param.fill_(1.0)
                else:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator))


# --- settings and results -----------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (the CLI ``python -m labs ddp`` parses into one).

    Attributes:
        steps: optimizer steps to reach; a resumed run continues up to this step.
        batch_size: windows per rank per micro-batch.
        accumulation: micro-batches per optimizer step (the first ones under ``no_sync()``).
        lr: AdamW learning rate.
        seed: model initialisation and the sampler's shuffling.
        d_model, n_heads, n_layers, seq_len: model size; ``seq_len`` is the window length.
        wrapper: the data-parallel wrapper.
        bucket_cap_mb: bucket size of Wrapper.DDP and Wrapper.TORCH_DDP, in MiB.
        checkpoint: file to save to (and resume from), or None for no checkpoints.
        checkpoint_every: also save every this many steps; None saves at the end only.
        resume: start from ``checkpoint`` (it must exist) instead of from scratch.
    """

    steps: int = 60
    batch_size: int = 8
    accumulation: int = 1
    lr: float = 1e-2
    seed: int = 0
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    seq_len: int = 16
    wrapper: Wrapper = Wrapper.DDP
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accumulation", "d_model", "n_heads", "n_layers",
                     "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}.")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must divide into n_heads={self.n_heads} "
                             "heads of equal size: pick a multiple of n_heads.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}; try 1e-2.")
        if not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be positive (MiB), got {self.bucket_cap_mb!r}; "
                             f"torch's default is {DEFAULT_BUCKET_CAP_MB}.")
        if self.wrapper not in DDP_WRAPPERS:
            raise ValueError(f"wrapper must be one of {[f'Wrapper.{w.name}' for w in DDP_WRAPPERS]}"
                             f", got {self.wrapper!r}.")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1 step, got "
                             f"{self.checkpoint_every}; leave it out to save at the end only.")
        if (self.resume or self.checkpoint_every is not None) and not self.checkpoint:
            raise ValueError("resume and checkpoint_every need a checkpoint file: give its path.")

    def steps_per_epoch(self, world_size: int) -> int:
        """Optimizer steps in one pass over the data: each rank's ``len(TEXT) // world_size``
        windows (the sampler drops the remainder so every rank gets as many) in groups of
        ``accumulation * batch_size``; the windows left over at the end of an epoch are skipped.
        """
        per_rank = len(TEXT) // world_size
        per_step = self.accumulation * self.batch_size
        if per_rank < per_step:
            raise ValueError(
                f"each of {world_size} ranks holds {per_rank} windows, fewer than one step's "
                f"batch_size * accumulation = {per_step}: use a smaller batch size, less "
                "accumulation or fewer ranks.")
        return per_rank // per_step

    def model(self) -> TinyTransformer:
        """The model at initialisation, on the CPU: the same weights wherever it is built."""
        model = TinyTransformer(len(CHARS), self.d_model, self.n_heads, self.n_layers,
                                self.seq_len)
        model.reset_parameters(torch.Generator().manual_seed(self.seed))
        return model


@dataclass(frozen=True)
class TrainResult:
    """What one rank reports after training (the losses are the same on every rank)."""

    rank: int
    world_size: int
    start_step: int  #: 0, or the checkpoint's step when resumed
    steps: int  #: optimizer steps done in this run
    losses: tuple[float, ...]  #: mean loss over all ranks, for steps start_step+1 .. start+steps
    tokens: int  #: tokens this rank trained on in this run
    seconds: float  #: wall time of the training loop (checkpoints included)
    checksum: float  #: sum of every parameter's elements, in float64, after the last step
    saved_steps: tuple[int, ...]  #: steps at which this rank wrote a checkpoint

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


# --- the training loop --------------------------------------------------------------------------


def micro_batches(config: TrainConfig, rank: int, world_size: int, start_step: int
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches from optimizer step ``start_step`` on, forever.

    Step s reads epoch ``s // steps_per_epoch``, whose order the sampler draws from
    (seed, epoch) alone, so a resumed run reads exactly what an uninterrupted one would."""
    sampler = DistributedSampler(char_windows(config.seq_len), num_replicas=world_size,
                                 rank=rank, shuffle=True, seed=config.seed, drop_last=True)
    loader = DataLoader(sampler.dataset, batch_size=config.batch_size, sampler=sampler,
                        num_workers=0, drop_last=True)
    per_epoch = config.steps_per_epoch(world_size)
    epoch, done = divmod(start_step, per_epoch)
    while True:
        sampler.set_epoch(epoch)  # without it every epoch repeats the same order
        # Skipping reads the skipped batches: cheap here; large jobs use a stateful loader.
        yield from itertools.islice(loader, done * config.accumulation,
                                    per_epoch * config.accumulation)
        epoch, done = epoch + 1, 0


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    config: TrainConfig, world_size: int) -> None:
    """Rank 0 only: write the unwrapped model, the optimizer and the step, atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Same directory, so os.replace is an atomic rename: a crash leaves the old file or the
    # new one, never half of one.
    partial = target.with_name(target.name + ".partial")
    settings = {**dataclasses.asdict(config), "wrapper": config.wrapper.value,
                "world_size": world_size}
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "config": settings}, partial)
    os.replace(partial, target)


def train_worker(rank: int, world_size: int, config: TrainConfig) -> TrainResult:
    """Train up to optimizer step ``config.steps`` (from the checkpoint's step when resuming).

    Per step and rank: ``accumulation`` forward/backward passes on ``batch_size`` windows,
    one gradient synchronisation (after the last micro-batch), one AdamW step. A resumed run
    repeats an uninterrupted one exactly when world size, batch size, accumulation and seed
    are the ones the checkpoint was written with (they fix the data order); a resume with
    others is refused (:func:`check_resume`)."""
    config.steps_per_epoch(world_size)  # refuse an impossible batch before any collective
    device = rank_device()
    model = config.model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    start_step = 0
    if config.resume:
        start_step = _load_checkpoint(config, model, optimizer, device, world_size)
    ddp = wrap(config.wrapper, model, config.bucket_cap_mb)
    # labs' wrappers synchronise in finish_gradient_synchronization(); torch's inside backward.
    ours = isinstance(ddp, (NaiveDDP, DDP))
    batches = micro_batches(config, rank, world_size, start_step)
    losses: list[torch.Tensor] = []
    saved: list[int] = []
    started = now(device)  # synchronized: on a GPU the steps end when their kernels do
    for step in range(start_step + 1, config.steps + 1):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for micro in range(config.accumulation):
            x, y = (t.to(device) for t in next(batches))
            last = micro == config.accumulation - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(x)  # forward inside the block too: torch DDP prepares there
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / config.accumulation
                loss.backward()
            total += loss.detach()
        if ours:
            ddp.finish_gradient_synchronization()
        optimizer.step()
        losses.append(total)
        at_end = step == config.steps
        if config.checkpoint and (at_end or (config.checkpoint_every
                                             and step % config.checkpoint_every == 0)):
            if rank == 0:
                save_checkpoint(config.checkpoint, ddp.module, optimizer, step, config,
                                world_size)
                saved.append(step)
            dist.barrier()  # no rank goes on (or reads the file) before it is complete
    seconds = now(device) - started
    # One all-reduce of the whole loss curve at the end, instead of a sync point per step.
    curve = torch.stack(losses) if losses else torch.zeros(0, device=device)
    dist.all_reduce(curve)
    curve /= world_size
    with torch.no_grad():
        checksum = sum(p.double().sum() for p in model.parameters()).item()
    done = config.steps - start_step
    return TrainResult(
        rank=rank, world_size=world_size, start_step=start_step, steps=done,
        losses=tuple(curve.tolist()), seconds=seconds, checksum=checksum, saved_steps=tuple(saved),
        tokens=done * config.accumulation * config.batch_size * config.seq_len,
    )


#: What a resumed run must share with the run that wrote its checkpoint: the model's shape,
#: and every setting that decides which samples each rank reads at each step.
RESUME_MUST_MATCH = ("world_size", "seed", "batch_size", "accumulation", "seq_len", "d_model",
                     "n_heads", "n_layers")


def check_resume(config: TrainConfig, world_size: int,
                 saved: dict[str, Any] | None = None) -> None:
    """Refuse to resume from a checkpoint written with other settings: another world size,
    seed or batch would silently read other samples than the uninterrupted run, and another
    model shape would not load. ``saved`` is the checkpoint's ``config`` (read from the file
    when not given); the parent calls this before any process starts, each rank again."""
    if not config.resume:
        return
    if saved is None:
        if not Path(str(config.checkpoint)).exists():
            raise FileNotFoundError(f"no checkpoint at {config.checkpoint} to resume from: run "
                                    "once without resume first.")
        saved = torch.load(str(config.checkpoint), map_location="cpu", weights_only=True)["config"]
    now = {**dataclasses.asdict(config), "world_size": world_size}
    differ = [name for name in RESUME_MUST_MATCH if name in saved and saved[name] != now[name]]
    if differ:
        pairs = ", ".join(f"{name}={saved[name]} (now {now[name]})" for name in differ)
        raise ValueError(f"the checkpoint {config.checkpoint} was written with {pairs}: resume "
                         "with the same values, or start a new run without resume.")


def _load_checkpoint(config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                     device: torch.device, world_size: int) -> int:
    """Restore model and optimizer in place, before wrapping; return the checkpoint's step."""
    assert config.checkpoint is not None  # __post_init__ refuses resume without a path
    if not Path(config.checkpoint).exists():
        raise FileNotFoundError(f"no checkpoint at {config.checkpoint} to resume from: run "
                                "once without resume first.")
    # map_location: tensors saved from cuda:0 would otherwise come back on cuda:0 in every rank.
    state: dict[str, Any] = torch.load(config.checkpoint, map_location=device, weights_only=True)
    check_resume(config, world_size, state["config"])
    if state["step"] > config.steps:
        raise ValueError(f"the checkpoint is at step {state['step']}, past steps={config.steps}: "
                         "ask for more steps.")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
