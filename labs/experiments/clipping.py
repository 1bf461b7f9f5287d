"""Chapter 7: clipping the gradient of a sharded model, against one process.

Every rank holds a shard of the gradient. The total norm is one number for the whole
model, so the ranks must agree on it before any of them scales: each rank's sum of squares,
one all-reduce, a square root (:meth:`labs.fsdp.FSDP.clip_grad_norm_`). The wrong way,
each rank clipping its shards by their own norm, is measured beside it: the factors
differ from rank to rank, and the step is no longer the one-process step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labs.fsdp import FSDP
from labs.launcher import rank_device
from labs.tables import format_table
from labs.train import TinyTransformer


@dataclass(frozen=True)
class ClipSettings:
    """A small tied transformer, one batch, one SGD step with clipping."""

    vocab: int = 11
    d_model: int = 16
    n_layers: int = 3
    seq_len: int = 8
    batch: int = 16
    max_norm: float = 0.1
    lr: float = 0.5

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise ValueError(f"max_norm must be a positive number, got {self.max_norm!r}.")
        if self.batch % 4:
            raise ValueError(f"batch must split over 1, 2 and 4 ranks: a multiple of 4, got "
                             f"{self.batch}.")

    def model(self) -> TinyTransformer:
        torch.manual_seed(0)
        return TinyTransformer(self.vocab, self.d_model, 2, self.n_layers, self.seq_len)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.batch, self.seq_len + 1),
                            generator=torch.Generator().manual_seed(1))
        return ids[:, :-1], ids[:, 1:]


@dataclass(frozen=True)
class ClipReport:
    """One rank's view of one clipped step."""

    rank: int
    shard_norm: float  #: the norm of this rank's shards alone
    total_norm: float  #: what clip_grad_norm_ returned: the norm of the whole gradient
    factor: float  #: the scale every rank applied
    own_factor: float  #: the scale this rank would apply by its own shards' norm
    max_difference: float  #: |parameters after the step - one process's| (max)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))


def reference_step(settings: ClipSettings) -> tuple[dict[str, torch.Tensor], float]:
    """One process, the whole batch: torch.nn.utils.clip_grad_norm_ and an SGD step."""
    model = settings.model()
    x, y = settings.data()
    _loss(model, x, y, settings.vocab).backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), settings.max_norm)
    torch.optim.SGD(model.parameters(), lr=settings.lr).step()
    return model.state_dict(), float(norm)


def clip_worker(rank: int, world_size: int, settings: ClipSettings) -> ClipReport:
    """FSDP on this rank's rows, clip_grad_norm_, SGD: the report, and the parameters'
    distance from one process's step."""
    device = rank_device()
    net = settings.model().to(device)
    model = FSDP(net, units=list(net.blocks))
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr)
    x, y = (t.to(device) for t in settings.data())
    rows = slice(rank * settings.batch // world_size, (rank + 1) * settings.batch // world_size)
    _loss(model, x[rows], y[rows], settings.vocab).backward()
    model.finish_gradient_synchronization()
    shard_norm = float(torch.cat([u.shard.grad for u in model.units]).norm())
    own = min(1.0, settings.max_norm / (shard_norm + 1e-6))
    total = float(model.clip_grad_norm_(settings.max_norm))
    optimizer.step()
    want, _ = reference_step(settings)
    got = model.gather_full_params()
    difference = max(float((got[k].cpu() - v).abs().max()) for k, v in want.items())
    return ClipReport(rank, shard_norm, total, min(1.0, settings.max_norm / (total + 1e-6)),
                      own, difference)


def clip_table(reports: list[ClipReport]) -> str:
    rows = [[r.rank, f"{r.shard_norm:.4f}", f"{r.own_factor:.4f}", f"{r.total_norm:.4f}",
             f"{r.factor:.4f}", f"{r.max_difference:.1e}"] for r in reports]
    return format_table(["rank", "norm of its shards", "factor by its own norm",
                         "total norm (all-reduced)", "factor applied",
                         "max |params - one process|"], rows)
