"""Small models that the chapters and tests share, and the settings of the timed MLP.

:class:`StepSettings` and :func:`mlp` are the model and loop that chapters 5-8 time under
each wrapper (DDP's buckets, the ZeRO stages, activation checkpointing, mixed precision,
HSDP): one frozen dataclass that the widget panels and ``python -m labs.bench`` build alike.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from labs.ddp import DEFAULT_BUCKET_CAP_MB


class TiedNet(nn.Module):
    """A tiny language model with every awkward part: an embedding tied to the output layer,
    a hidden layer, a frozen layer and a buffer used in forward."""

    def __init__(self, vocab: int, dim: int, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            self.hidden = nn.Linear(dim, dim)
            self.frozen = nn.Linear(dim, dim)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two uses
        self.register_buffer("scale", torch.full((dim,), 1.0 + seed))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        return self.head(self.frozen(torch.tanh(self.hidden(x))))


class Optimizer(enum.Enum):
    """The optimizer of a step-time experiment."""

    SGD = "SGD"
    """Plain SGD (no state): the step is cheap, communication stands out."""
    ADAM = "Adam"
    """Adam: 8 bytes of state per parameter, and a heavier step (ZeRO shards it)."""

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if self is Optimizer.ADAM:
            return torch.optim.Adam(params, lr=1e-4)
        return torch.optim.SGD(params, lr=1e-3)


@dataclass(frozen=True)
class StepSettings:
    """One experiment's model and loop: an MLP of ``layers`` square Linear layers (ReLU
    between), a random batch, ``steps`` timed optimizer steps (``optimizer``: SGD or Adam)
    after ``warmup`` untimed ones.
    The widget panel and ``python -m labs.bench ddp`` build one of these."""

    width: int = 256
    layers: int = 6
    batch: int = 32
    steps: int = 8
    warmup: int = 2
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    accumulation: int = 1
    """Micro-batches per optimizer step (the accumulation experiment)."""
    optimizer: Optimizer = Optimizer.SGD

    def __post_init__(self) -> None:
        for name in ("width", "layers", "batch", "steps", "accumulation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}.")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive (MiB), got {self.bucket_cap_mb!r}.")

    @property
    def parameters(self) -> int:
        """Trainable parameters of the model: layers * (width^2 + width)."""
        return self.layers * (self.width * self.width + self.width)

    @property
    def gradient_bytes(self) -> int:
        """S, the bytes of all gradients (float32): what one all-reduce of them moves."""
        return 4 * self.parameters


def mlp(settings: StepSettings, seed: int = 0) -> nn.Sequential:
    """The experiment's model, the same on every rank for the same seed."""
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left alone
        torch.manual_seed(seed)
        for _ in range(settings.layers):
            layers += [nn.Linear(settings.width, settings.width), nn.ReLU()]
    return nn.Sequential(*layers)
