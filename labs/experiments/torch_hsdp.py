"""Chapter 8: torch's HSDP, ``fully_shard`` on a 2-D ``("replicate", "shard")`` mesh, beside
labs' ``FSDP(shard_size=g)`` on the same model and batch (:func:`compare_fully_shard_hsdp`): both
average the gradient over all N ranks, so their parameters should agree to rounding.

The worker runs inside a rank; ranks import this module, so it imports no plotting.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from labs.experiments.hsdp import LAB_SETTINGS, HsdpSettings, batch_of
from labs.experiments.mesh import device_mesh_available
from labs.fsdp import FSDP
from labs.fsdp_torch import apply_fully_shard, fully_shard_available
from labs.launcher import launch, rank_device
from labs.models import mlp


@dataclass(frozen=True)
class TorchHsdpResult:
    """One rank's run of labs' HSDP and torch's, from the same start on the same batch."""

    rank: int
    labs_losses: list[float]
    labs_params: dict[str, torch.Tensor]  #: the full parameters after the last step
    torch_losses: list[float] = field(default_factory=list)
    torch_params: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: str = ""  #: why torch's run did not happen ("" when it did)


def fully_shard_hsdp_available(device_type: str = "cpu") -> tuple[bool, str]:
    """Can this torch run ``fully_shard`` on a named 2-D mesh on ``device_type``? (True,
    what it uses) or (False, "skipped: ...")."""
    ok, why = fully_shard_available(device_type)
    if not ok:
        return ok, why
    mesh_ok, mesh_why = device_mesh_available()
    return (True, why) if mesh_ok else (False, mesh_why)


def _hsdp_train(model: nn.Module, x: torch.Tensor, steps: int) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        finish = getattr(model, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()
        optimizer.step()
        losses.append(loss.item())
    return losses


def torch_hsdp_worker(rank: int, world_size: int, settings: HsdpSettings) -> TorchHsdpResult:
    """Worker: ``settings.steps`` Adam steps of the MLP on this rank's batch with
    ``FSDP(shard_size=g)`` (torch collectives), then with ``fully_shard(model,
    mesh=init_device_mesh(..., (n, g), mesh_dim_names=("replicate", "shard")))``: shard
    along "shard" (the g ranks of a node), replicate along "replicate". Both average the
    gradient over all N ranks, so the parameters should agree to rounding."""
    if world_size != settings.world_size:
        raise ValueError(f"launched on {world_size} ranks, settings say {settings.world_size}.")
    x = batch_of(rank, settings)
    device = rank_device()
    labs_model = FSDP(mlp(settings.step_settings).to(device), shard_size=settings.shard_size)
    labs_losses = _hsdp_train(labs_model, x, settings.steps)
    labs_params = labs_model.gather_full_params()
    ok, why = fully_shard_hsdp_available(device.type)
    if not ok:
        return TorchHsdpResult(rank, labs_losses, labs_params, skipped=why)
    net = mlp(settings.step_settings).to(device)  # the same seed on every rank: same start
    mesh = init_device_mesh(device.type, (settings.groups, settings.shard_size),
                            mesh_dim_names=("replicate", "shard"))
    apply_fully_shard(net, mesh)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        torch_losses = _hsdp_train(net, x, settings.steps)
    torch_params = {}
    for name, p in net.named_parameters():
        full = p.detach()
        if hasattr(full, "full_tensor"):  # a DTensor: all-gathered over the whole mesh
            full = full.full_tensor()
        torch_params[name] = full.clone().cpu()
    return TorchHsdpResult(rank, labs_losses, labs_params, torch_losses, torch_params)


def compare_fully_shard_hsdp(settings: HsdpSettings = LAB_SETTINGS, timeout: float = 180.0
                             ) -> list[TorchHsdpResult]:
    """:func:`torch_hsdp_worker` on ``settings.world_size`` ranks (gloo)."""
    return list(launch(torch_hsdp_worker, settings.world_size, args=(settings,), echo=False,
                       timeout=timeout))


def torch_hsdp_difference(results: Sequence[TorchHsdpResult]) -> float | None:
    """The largest |difference| between labs' and torch's parameters after the last step,
    over ranks and parameters; None where torch's run was skipped."""
    if any(r.skipped for r in results):
        return None
    return max((r.labs_params[name] - r.torch_params[name]).abs().max().item()
               for r in results for name in r.labs_params)
