"""The oracle of the DDP, ZeRO and FSDP tests: a single process trained on the whole batch.

Ranks train :data:`TiedNet` (an embedding tied to the output layer, a frozen layer and a
buffer) on their slice of :func:`batch` from *different* seeds, so the broadcast at
construction is tested too; after every step their full parameters must equal
:func:`reference_run`'s.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

import labs
from labs import models
from labs.ddp import DDP, NaiveDDP

VOCAB, DIM, BATCH, STEPS = 11, 6, 8, 3

#: Embedding tied to the output layer, a frozen layer, a buffer used in forward.
TiedNet = partial(models.TiedNet, VOCAB, DIM)

#: name -> (optimizer class, keyword arguments)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, float]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
}


def launch(fn, world_size, **kwargs):
    """labs.launch on gloo: the workers of these tests build their tensors on the CPU, and on
    a box with a GPU per rank "auto" would pick NCCL, which needs CUDA tensors."""
    return labs.launch(fn, world_size, backend="gloo", **kwargs)


def make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **kwargs)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch: inputs and next-token targets."""
    ids = torch.randint(0, VOCAB, (BATCH, 5), generator=torch.Generator().manual_seed(123))
    return ids[:, :-1], ids[:, 1:]


def rank_batch(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of :func:`batch`."""
    x, y = batch()
    per = BATCH // world_size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the model computes in."""
    return nn.functional.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def reference_run(optimizer: str) -> list[dict[str, torch.Tensor]]:
    """One process, the whole batch: the state dict after each of :data:`STEPS` steps."""
    model = TiedNet(seed=0)
    opt = make_optimizer(optimizer, model.parameters())
    x, y = batch()
    states = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def train_sharded(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                  y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """:data:`STEPS` steps of a sharded model (FSDP, HSDP) on this rank's slice: its full
    parameters, gathered after each step, to hold against :func:`reference_run`'s."""
    states = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        model.finish_gradient_synchronization()
        opt.step()
        states.append(model.gather_full_params())
    return states


class Deep(nn.Module):
    """Three Linear(10, 10), the same on every rank: one FSDP unit each, when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Linear(10, 10) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean(dim=1)


def assert_states_match(got: list[dict[str, torch.Tensor]],
                        want: list[dict[str, torch.Tensor]], what: str) -> None:
    """Every step's state dict equal to the reference's, the tied names and buffer included."""
    assert len(got) == len(want), what
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), f"{what} step {step}"
        for name in w:
            torch.testing.assert_close(
                g[name], w[name], msg=lambda m, s=step, n=name: f"{what} step {s} {n}: {m}")


#: (wrapper, keyword arguments) of the DDP parity tests: tiny buckets (one parameter each), a
#: middle size, one bucket.
DDP_CASES = [
    ("naive", {}),
    ("ddp", {"bucket_cap_mb": 1e-9}),
    ("ddp", {"bucket_cap_mb": 42 * 4 / 2**20}),  # hidden (42 elements), then embed
    ("ddp", {"bucket_cap_mb": 25.0}),
]


def ddp_parity_worker(rank: int, world_size: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Every :data:`DDP_CASES` wrapper trained for :data:`STEPS` steps with every optimizer;
    ``"{optimizer}-{wrapper}-{cap}[-{n}buckets]"`` -> the module's state after each step. On
    the loopback or on an emulated link, whichever the launch gives."""
    x, y = rank_batch(rank, world_size)
    out = {}
    for optimizer in OPTIMIZERS:
        for wrapper, kwargs in DDP_CASES:
            net = TiedNet(seed=rank)  # different on every rank until the broadcast
            model = NaiveDDP(net) if wrapper == "naive" else DDP(net, **kwargs)
            opt = make_optimizer(optimizer, model.parameters())
            states = []
            for _ in range(STEPS):
                opt.zero_grad()
                loss_of(model, x, y).backward()
                model.finish_gradient_synchronization()
                opt.step()
                states.append({k: v.clone() for k, v in model.module.state_dict().items()})
            key = f"{optimizer}-{wrapper}-{kwargs.get('bucket_cap_mb', '')}"
            if wrapper == "ddp":
                key += f"-{len(model.buckets)}buckets"
            out[key] = states
    return out
