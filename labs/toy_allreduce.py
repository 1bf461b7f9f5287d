"""Chapter 1: the toy all-reduce, then the same idea on a tiny language model.

Four ranks each hold one gradient of the same parameter. ``all_reduce`` (SUM) leaves the sum
on every rank; dividing by the world size gives the average; one SGD step from the same
starting value then leaves every rank with the same parameter:

    g_bar = (1/N) * sum_r g_r          p_new = p - lr * g_bar        (on every rank)

Cost: one all-reduce of the gradient; with the ring of chapter 2 every rank sends
2(N-1)/N * S bytes and receives as many (chapter 2 measures this).

The second half replaces the single number by a real model: a character bigram model
trained on each rank's own sentences. Averaging the per-rank gradients gives exactly the
gradient of the mean loss over all sentences, provided every rank holds the same number of
sentences; :func:`shard_sentences` shows what happens when they do not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labs.launcher import rank_device

#: The per-rank gradients of ``W_query[0, 0]`` in chapter 1's example (ranks 0..3).
EXAMPLE_GRADIENTS: tuple[float, ...] = (0.1, -0.2, 0.4, -0.1)
#: The text each of the four ranks trains on in chapter 1's example.
EXAMPLE_BATCHES: tuple[tuple[str, str], ...] = (
    ("The cat sat", "Dogs are fun"),
    ("I love pizza", "Weather is nice"),
    ("Python rocks", "AI is amazing"),
    ("Hello world", "Coding is cool"),
)
#: All eight sentences, in rank order.
EXAMPLE_SENTENCES: tuple[str, ...] = tuple(s for batch in EXAMPLE_BATCHES for s in batch)


# --- the toy all-reduce ------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyAllReduceConfig:
    """Settings of the toy all-reduce (the widget panel and ``python -m labs toy`` build one).

    Attributes:
        grads: one gradient per rank; ``None`` draws them from ``seed``.
        seed: seed for drawn gradients (uniform in [-0.5, 0.5], rounded to 2 decimals).
        param: the parameter's value before the step, the same on every rank.
        lr: the SGD learning rate.
    """

    grads: tuple[float, ...] | None = None
    seed: int = 0
    param: float = 0.5
    lr: float = 1e-3

    def gradients(self, world_size: int) -> tuple[float, ...]:
        """The gradient each rank holds before the all-reduce (index = rank)."""
        if self.grads is not None:
            if len(self.grads) != world_size:
                raise ValueError(
                    f"{len(self.grads)} gradients given for {world_size} ranks: give exactly "
                    f"{world_size} (one per rank), or none to draw them from the seed."
                )
            return tuple(float(g) for g in self.grads)
        draws = np.random.default_rng(self.seed).uniform(-0.5, 0.5, size=world_size)
        return tuple(round(float(g), 2) for g in draws)


@dataclass(frozen=True)
class ToyRankRecord:
    """What one rank saw during the toy step (all values as float32, like the tensors)."""

    rank: int
    local_grad: float
    summed: float
    averaged: float
    param_before: float
    param_after: float
    param_after_bits: str  #: the float32 bit pattern, to show ranks agree bit for bit


def toy_all_reduce_step(rank: int, world_size: int, config: ToyAllReduceConfig) -> ToyRankRecord:
    """One rank of the toy: all-reduce its gradient, average, take one SGD step."""
    device = rank_device()  # the CPU under gloo, this rank's GPU under nccl
    grad = torch.tensor([config.gradients(world_size)[rank]], dtype=torch.float32, device=device)
    local_grad = grad.item()
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum
    summed = grad.item()
    grad /= world_size  # the average: all_reduce sums, the division is ours
    param = torch.tensor([config.param], dtype=torch.float32, device=device)
    param_before = param.item()
    param -= config.lr * grad  # the same update on every rank
    return ToyRankRecord(
        rank=rank, local_grad=local_grad, summed=summed, averaged=grad.item(),
        param_before=param_before, param_after=param.item(),
        param_after_bits=f"0x{param.view(torch.int32).item() & 0xFFFFFFFF:08x}",
    )


# --- a tiny language model ---------------------------------------------------------------------

#: The characters of the example sentences; the model's vocabulary.
VOCAB: tuple[str, ...] = tuple(sorted(set("".join(EXAMPLE_SENTENCES))))


class BigramLM(nn.Module):
    """Predicts the next character from the current one: an embedding, then a linear layer."""

    def __init__(self, vocab_size: int = len(VOCAB), dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (T,) character ids -> (T, vocab) logits for the next character."""
        return self.head(self.embed(ids))


def make_model(seed: int = 0) -> BigramLM:
    """The same initial weights wherever it is called (own generator: no global RNG touched)."""
    model = BigramLM()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def encode(sentence: str) -> torch.Tensor:
    """Character ids of a sentence, shape (len(sentence),)."""
    return torch.tensor([VOCAB.index(c) for c in sentence], dtype=torch.long)


def sentence_loss(model: nn.Module, sentence: str) -> torch.Tensor:
    """Mean next-character cross-entropy over one sentence: the loss of one sample."""
    ids = encode(sentence).to(next(model.parameters()).device)
    return F.cross_entropy(model(ids[:-1]), ids[1:])


def batch_loss(model: nn.Module, sentences: Sequence[str]) -> torch.Tensor:
    """Mean of the per-sentence losses: what a rank minimises on its local batch."""
    return torch.stack([sentence_loss(model, s) for s in sentences]).mean()


def shard_sentences(sentences: Sequence[str], rank: int, world_size: int) -> list[str]:
    """Rank ``rank``'s contiguous slice of the sentences; the first ``len % N`` ranks get
    one extra when the count does not divide (so local batches can differ in size)."""
    base, extra = divmod(len(sentences), world_size)
    start = rank * base + min(rank, extra)
    return list(sentences[start : start + base + (rank < extra)])


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by name."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def all_reduce_gradients_flat(model: nn.Module) -> None:
    """Average every gradient across ranks with ONE all-reduce of a flat buffer.

    Packing all gradients into one 1-D buffer sends one message instead of one per
    parameter (chapter 5 splits the buffer into buckets so that communication can start
    before backward ends). Bytes per rank are the same as per-parameter all-reduces.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # 1-D, numel = total gradient numel
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@dataclass(frozen=True)
class RankGradients:
    """One rank's view of a data-parallel backward pass on the bigram model."""

    rank: int
    sentences: list[str]
    loss: float
    local: dict[str, torch.Tensor]  #: gradients of this rank's own batch
    averaged: dict[str, torch.Tensor]  #: after the all-reduce average


def data_parallel_gradients(
    rank: int, world_size: int, sentences: Sequence[str], seed: int = 0
) -> RankGradients:
    """Each rank: same model, own shard of the sentences, backward, then average gradients."""
    model = make_model(seed).to(rank_device())
    local_batch = shard_sentences(sentences, rank, world_size)
    loss = batch_loss(model, local_batch)
    loss.backward()
    local = gradients(model)
    all_reduce_gradients_flat(model)
    return RankGradients(rank, local_batch, loss.item(), local, gradients(model))


def full_batch_gradients(sentences: Sequence[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """The single-process reference: one model, the mean loss over every sentence."""
    model = make_model(seed)
    batch_loss(model, sentences).backward()
    return gradients(model)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute element-wise difference between two sets of named gradients."""
    return max((a[name] - b[name]).abs().max().item() for name in a)


def float32_steps(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every entry's difference ``|got - want|`` in float32 steps: multiples of the gap
    between ``|want|`` and the next float32 above it (one step is a change of the last bit).
    Rounding differs by a few steps; a wrong answer by millions. 1-D, one per entry."""
    g = torch.cat([got[name].reshape(-1) for name in want]).double()
    w = torch.cat([want[name].reshape(-1) for name in want]).float()
    step = (torch.nextafter(w.abs(), torch.tensor(float("inf"))) - w.abs()).double()
    return (g - w.double()).abs() / step


# --- the same calls in another order -----------------------------------------------------------


@dataclass(frozen=True)
class TwoSums:
    """What one rank holds after all-reducing two same-sized gradients, ``weight`` and
    ``bias``, and what a correct all-reduce leaves there."""

    rank: int
    weight: float
    bias: float
    want_weight: float
    want_bias: float


def swapped_order_sums(rank: int, world_size: int, swapped_rank: int) -> TwoSums:
    """Every rank all-reduces its ``weight`` gradient (rank + 1) and then its ``bias``
    gradient (100 (rank + 1)), both of 4 numbers, except ``swapped_rank``, which issues them
    the other way round.

    A collective is matched by the order of the calls, not by the tensor's name: the first
    all-reduce adds the other ranks' ``weight`` to ``swapped_rank``'s ``bias``. The sizes
    agree, so nothing fails; every rank ends with wrong sums."""
    weight = torch.full((4,), float(rank + 1), device=rank_device())
    bias = torch.full((4,), 100.0 * (rank + 1), device=rank_device())
    first, second = (bias, weight) if rank == swapped_rank else (weight, bias)
    dist.all_reduce(first)
    dist.all_reduce(second)
    total = world_size * (world_size + 1) / 2
    return TwoSums(rank, weight[0].item(), bias[0].item(), total, 100 * total)
