"""Chapter 7's activation experiments: the chapter's 8-block transformer and chapter 6's MLP
as :class:`labs.activations.Workload` s, and activation checkpointing measured on them (bytes
and step time)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labs.activations import (
    Workload,
    activation_bytes,
    check_positive,
    checkpoint_module,
    measure_alive,
    recomputed_modules,
)
from labs.fsdp import FSDP
from labs.launcher import rank_device
from labs.memory import AllocationTracker
from labs.models import StepSettings, mlp
from labs.train import CHARS, TinyTransformer

# --- the chapter's transformer -------------------------------------------------------------------


def lm_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-character cross-entropy of ``model(ids)``: (B, T) ids -> a scalar."""
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def mean_square_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Chapter 5's MLP loss: ``model(x).square().mean()``."""
    return model(x).square().mean()


@dataclass(frozen=True)
class ActivationSettings:
    """The transformer of :class:`labs.train.TinyTransformer` at one size, a random batch,
    and how to time a step.

    Attributes:
        batch, seq_len: B sequences of T characters.
        d_model, n_heads, n_layers: D, H (dividing D) and L blocks.
        dtype: the parameters' and activations' dtype (float32 or bfloat16 on CPU).
        seed: the weights' and the batch's.
        repeats: timed steps (forward + backward) per case; warmup: untimed ones first.
    """

    batch: int = 8
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 8
    dtype: torch.dtype = torch.float32
    seed: int = 0
    repeats: int = 7
    warmup: int = 2

    def __post_init__(self) -> None:
        check_positive(batch=self.batch, seq_len=self.seq_len, d_model=self.d_model,
                        n_heads=self.n_heads, n_layers=self.n_layers, repeats=self.repeats)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must divide into n_heads={self.n_heads} "
                             "heads of equal size: pick a multiple of n_heads.")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32 or "
                             f"torch.bfloat16, got {self.dtype!r}.")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a whole number >= 0, got {self.warmup!r}.")

    @property
    def vocab(self) -> int:
        """V: the characters of the training text (``labs.train.CHARS``)."""
        return len(CHARS)

    def activation_bytes(self, *, checkpointing: bool = False) -> int:
        """:func:`activation_bytes` at these settings."""
        return activation_bytes(self.batch, self.seq_len, self.d_model, self.n_heads,
                                self.n_layers, self.vocab, element_size=self.dtype.itemsize,
                                checkpointing=checkpointing)

    def workload(self, *, checkpointing: bool = False) -> Workload:
        """The model (every block a checkpoint if asked), a random (ids, targets) batch and
        :func:`lm_loss`; the same weights and batch on every call."""
        model = TinyTransformer(self.vocab, self.d_model, self.n_heads, self.n_layers,
                                self.seq_len)
        model.reset_parameters(torch.Generator().manual_seed(self.seed))
        model.to(self.dtype)
        if checkpointing:
            for block in model.blocks:
                checkpoint_module(block)
        generator = torch.Generator().manual_seed(self.seed + 1)
        ids, targets = (torch.randint(0, self.vocab, (self.batch, self.seq_len),
                                      generator=generator) for _ in range(2))  # (B, T) int64
        return Workload(model, (ids, targets), lm_loss)


#: The chapter's 8-block model: a step (forward + backward) takes tens of milliseconds on
#: one CPU core.
CHAPTER_MODEL = ActivationSettings(batch=8, seq_len=64, d_model=64, n_heads=4, n_layers=8)


def mlp_workload(settings: StepSettings, seed: int = 0) -> Workload:
    """Chapter 5/6's MLP (:func:`labs.models.mlp`), a random (batch, width) input and
    :func:`mean_square_loss`."""
    x = torch.randn(settings.batch, settings.width,
                    generator=torch.Generator().manual_seed(seed + 1))  # (B, W)
    return Workload(mlp(settings, seed), (x,), mean_square_loss)


@dataclass(frozen=True)
class CheckpointCase:
    """One model measured with or without activation checkpointing of every block."""

    checkpointing: bool
    activation_bytes: int  #: measured (:func:`measure_alive`)
    formula_bytes: int  #: :func:`activation_bytes`
    seconds: tuple[float, ...]  #: each timed step: forward, loss and backward
    recomputed: int  #: module forwards that ran again during backward (:func:`recomputed_modules`)
    forward_seconds: tuple[float, ...] = ()  #: the forward and loss of each timed step

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_forward(self) -> float:
        """The median forward (and loss) of the timed steps."""
        return statistics.median(self.forward_seconds)

    @property
    def median_backward(self) -> float:
        """The median of each step's time less its forward."""
        return statistics.median(t - f for t, f in zip(self.seconds, self.forward_seconds,
                                                        strict=True))

    @property
    def min_seconds(self) -> float:
        return min(self.seconds)

    @property
    def max_seconds(self) -> float:
        return max(self.seconds)


def checkpointing_model(plain: CheckpointCase) -> float:
    """The step time of every block checkpointed over the plain step's, from the plain
    step's own forward F and backward B: backward runs forward again, so (2F + B) / (F + B).
    (The layers outside the blocks run once; at the chapter's sizes they are a small part of
    F, which this charges in full, so it errs a little high.)"""
    forward, backward = plain.median_forward, plain.median_backward
    return (2 * forward + backward) / (forward + backward)


def _step_seconds(workload: Workload) -> tuple[float, float]:
    """(forward and loss, the whole step) in seconds."""
    workload.model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    loss = workload.forward()
    forward = time.perf_counter() - started
    loss.backward()
    return forward, time.perf_counter() - started


def measure_checkpointing(settings: ActivationSettings = CHAPTER_MODEL,
                          ) -> tuple[CheckpointCase, CheckpointCase]:
    """The model without and with every block checkpointed: activation bytes (measured and by
    the formula), step times and how much backward recomputes. The two cases are timed in
    turns, step by step, after ``warmup`` untimed steps each, so a slow moment of the machine
    falls on both; report the median and the spread, not one sample."""
    plain, checkpointed = (settings.workload(checkpointing=c) for c in (False, True))
    times: tuple[list[float], list[float]] = ([], [])
    forwards: tuple[list[float], list[float]] = ([], [])
    for step in range(settings.warmup + settings.repeats):
        order = (0, 1) if step % 2 == 0 else (1, 0)
        for i in order:
            forward, seconds = _step_seconds((plain, checkpointed)[i])
            if step >= settings.warmup:
                times[i].append(seconds)
                forwards[i].append(forward)
    without, with_ = (
        CheckpointCase(c, measure_alive(w).total_bytes, settings.activation_bytes(
            checkpointing=c), tuple(t), len(recomputed_modules(w)), tuple(f))
        for c, w, t, f in zip((False, True), (plain, checkpointed), times, forwards,
                              strict=True))
    return without, with_


@dataclass(frozen=True)
class BackwardPeak:
    """Bytes of the storages one step makes (forward, loss, backward), the parameters'
    gradients excepted: alive when forward returns, and the most alive at once in backward."""

    checkpointing: bool
    after_forward: int
    backward_peak: int


def backward_peak(workload: Workload, checkpointing: bool) -> BackwardPeak:
    """Run one step under an :class:`~labs.memory.AllocationTracker`. The parameters'
    gradients are made (zeros) before it, so backward adds into storages the tracker does not
    count: what it counts is the activations, the loss, what backward makes on its way (the
    gradient flowing back, a layer's weight gradient before it is added) and, with
    checkpointing, the block that backward runs forward again."""
    for p in workload.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    with AllocationTracker() as tracker:
        loss = workload.forward()
        after = tracker.live_bytes
        tracker.reset_peak()
        loss.backward()
    return BackwardPeak(checkpointing, after, tracker.peak_bytes)


@dataclass(frozen=True)
class FsdpCheckpointing:
    """One rank's comparison of FSDP with and without ``activation_checkpointing``."""

    rank: int
    same_gradients: bool  #: every shard's gradient bit-identical
    forwards: tuple[int, int]  #: MLP forwards run in one step: without, with checkpointing


def fsdp_checkpointing_worker(rank: int, world_size: int,
                              settings: ActivationSettings) -> FsdpCheckpointing:
    """The settings' transformer under ``FSDP(units=blocks)``, this rank's share of the
    batch, one backward with and one without ``activation_checkpointing``: the shards'
    gradients, and how many times the blocks' MLPs ran forward (once each, or twice with
    checkpointing: the rerun in backward)."""
    grads, forwards = [], []
    for on in (False, True):
        workload = settings.workload()
        model = workload.model.to(rank_device())
        calls = [0]
        for block in model.blocks:  # on the MLP inside: a hook on the block itself runs
            # around its call, once, while the rerun in backward calls its forward directly
            block.mlp.register_forward_pre_hook(lambda *_a, c=calls: c.__setitem__(0, c[0] + 1))
        wrapped = FSDP(model, units=list(model.blocks), activation_checkpointing=on)
        ids, targets = (t[rank::world_size].to(rank_device()) for t in workload.batch)
        lm_loss(wrapped, ids, targets).backward()
        wrapped.finish_gradient_synchronization()
        grads.append([u.shard.grad for u in wrapped.units])
        forwards.append(calls[0])
    same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return FsdpCheckpointing(rank, same, (forwards[0], forwards[1]))
