"""Small models that the chapters and tests share."""

from __future__ import annotations

import torch
from torch import nn


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
