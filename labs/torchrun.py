"""The same workers under torchrun: ``python -m labs ...`` started by ``torchrun`` on any
number of nodes runs the ``fn(rank, world_size, *args)`` that :func:`labs.launcher.launch`
runs from a notebook.

torchrun starts the processes and sets RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous
address; :func:`run_torchrun` joins the process group, runs the worker and gathers every
rank's return value on rank 0, so a script prints the same results a notebook gets.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from labs.launch_inputs import Backend, choose_placement, enter
from labs.rank_pickle import pack_result, unpack_result


def under_torchrun() -> bool:
    """True in a process started by torchrun (it sets RANK, LOCAL_RANK and WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def run_torchrun(
    fn: Callable[..., Any], args: Sequence[Any] = (), backend: str = "auto"
) -> list[Any] | None:
    """Run ``fn(rank, world_size, *args)`` in a process that torchrun started.

    The process group uses torchrun's env:// rendezvous (MASTER_ADDR, MASTER_PORT), so it
    spans every node. Each process is placed as :func:`labs.launch` places its ranks
    (:func:`labs.launch_inputs.pick_placement`), by LOCAL_RANK among LOCAL_WORLD_SIZE: under
    nccl it uses ``cuda:LOCAL_RANK``, not RANK, because rank 4 on the second node of a 2x4 job
    owns that node's GPU 0; under gloo on a node with fewer GPUs than processes they share
    them. Rank 0 gets every rank's return value (gathered, in rank order); other ranks get
    None.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # Decided from LOCAL_WORLD_SIZE, which every process of this node shares: deciding from
    # LOCAL_RANK would give nccl to the first processes and gloo to the rest, and hang.
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    placement = choose_placement(backend, local_world_size, ranks="LOCAL_WORLD_SIZE")
    enter(placement, local_rank)
    _init_group(placement.backend.value, rank, world_size)
    # The results travel on the rank's GPU under nccl, which carries nothing else; on the CPU
    # under gloo, even where the ranks compute on a GPU.
    nccl = placement.backend is Backend.NCCL
    device = placement.device(local_rank) if nccl else torch.device("cpu")
    in_flight: list[torch.Tensor] = []
    try:
        payload = pack_result(fn(rank, world_size, *args))
        payloads, in_flight = _gather_bytes(payload, rank, world_size, device)
    finally:
        dist.destroy_process_group()
    del in_flight  # only now that the group's threads have stopped (see _gather_bytes)
    return None if payloads is None else [unpack_result(p) for p in payloads]


def _init_group(backend: str, rank: int, world_size: int) -> None:
    """torchrun's env:// rendezvous, with keys of this attempt's own after a restart.

    Under ``torchrun --max-restarts`` the agent's store outlives the workers it restarts, and
    on torch 2.13 gloo's new group read the addresses the first attempt's ranks had left
    there: "Gloo connectFullMesh failed ... Connection refused". Each attempt
    (TORCHELASTIC_RESTART_COUNT) therefore meets under a prefix of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"labs/attempt-{attempt}", store),
                            rank=rank, world_size=world_size)


def _gather_bytes(payload: bytes, rank: int, world_size: int, device: torch.device,
                  ) -> tuple[list[bytes] | None, list[torch.Tensor]]:
    """Every rank's ``payload`` on rank 0 (None on the others), and the tensors that carried
    them, which the caller must keep until the process group is destroyed.

    It is ``dist.gather_object`` but for those tensors. On torch 2.4 gloo's worker thread lets
    go of a collective's tensors a moment after the caller's wait returns. If its reference is
    the last, freeing a tensor needs the GIL, which the main thread holds while
    ``destroy_process_group`` waits for that thread to stop: the rank hangs for ever (seen
    under torchrun in 2 runs of 10: the main thread in ``~ProcessGroupGloo``, the worker in
    ``~AsyncGatherWork``). Kept here, the tensors outlive the worker's reference."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    received = [torch.empty_like(padded) for _ in range(world_size)] if rank == 0 else None
    dist.gather(padded, received, dst=0)
    in_flight = [size, *sizes, padded, *(received or [])]
    if received is None:
        return None, in_flight
    payloads = [t[:n].cpu().numpy().tobytes() for t, n in zip(received, lengths, strict=True)]
    return payloads, in_flight
