"""The labs on NCCL with CUDA tensors: what a learner runs on a GPU box, one GPU per rank.

Every test here is marked ``gpu`` and skips on a machine without CUDA (conftest). Each uses
as many ranks as there are GPUs, up to four, and compares the NCCL run with the same
worker on gloo and the CPU, which the rest of the suite checks in depth. With one GPU the
NCCL runs have a single rank: what they check then is that every tensor a worker makes
lands on the rank's GPU and that nothing mixes devices.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labs import Backend, launch, rank_device
from labs.collectives import Algorithm, all_gather, all_reduce, reduce_scatter
from labs.experiments.zero import lab_worker
from labs.fsdp import FSDP
from labs.memory import ShardMemorySettings, all_gather_memory, reduce_scatter_memory
from labs.models import StepSettings, mlp
from labs.toy_allreduce import (
    EXAMPLE_GRADIENTS,
    EXAMPLE_SENTENCES,
    ToyAllReduceConfig,
    data_parallel_gradients,
    full_batch_gradients,
    max_abs_difference,
    toy_all_reduce_step,
)
from labs.train import TrainConfig, train_worker
from labs.wrappers import DDP_WRAPPERS, ZERO_STAGES

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftover_processes")]


def gpus() -> int:
    """Ranks for the NCCL runs: one per GPU, at most four (the seed examples' world size)."""
    return min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0


def on_both(worker, *args, world_size: int | None = None):
    """(NCCL results, gloo results) of the same worker and arguments."""
    n = world_size or gpus()
    nccl = launch(worker, n, args=args, backend="nccl", echo=False, timeout=180)
    assert nccl.backend is Backend.NCCL
    return nccl, launch(worker, n, args=args, backend="gloo", echo=False, timeout=180)


def collectives_on_cuda(rank: int, world_size: int) -> list[str]:
    """Every from-scratch collective on CUDA tensors against NCCL's own all-reduce."""
    problems = []
    device = rank_device()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for numel in (1, 7, 1000, 1 << 18):
            x = torch.arange(numel, dtype=torch.float64).remainder(13).to(dtype).to(device)
            x += rank
            want = x.clone()
            dist.all_reduce(want)
            for algorithm in (Algorithm.NAIVE, Algorithm.WHOLE_TENSOR_RING, Algorithm.RING,
                              Algorithm.RECURSIVE_DOUBLING):
                got = all_reduce(x.clone(), algorithm=algorithm)
                if got.device != device or not torch.equal(got, want):
                    problems.append(f"{algorithm.name} {dtype} numel {numel} on {got.device}")
            shard = reduce_scatter(x, algorithm=Algorithm.RING)
            full = all_gather(shard, numel=numel, algorithm=Algorithm.RING)
            if full.device != device or not torch.equal(full, want):
                problems.append(f"ring reduce-scatter + all-gather {dtype} numel {numel}")
    return problems


def test_every_collective_works_on_cuda_tensors_and_matches_nccl():
    for rank, problems in enumerate(launch(collectives_on_cuda, gpus(), backend="nccl",
                                           echo=False, timeout=180)):
        assert problems == [], f"rank {rank}: {problems}"


def ring_on_cuda_under_gloo(rank: int, world_size: int) -> tuple[str, float]:
    """The ring on a CUDA tensor with gloo (ranks share cuda:0), then gloo's own all-reduce
    of a CUDA tensor, which gloo stages through host memory."""
    x = torch.ones(1000, device="cuda:0")
    try:
        all_reduce(x, algorithm=Algorithm.RING)
        error = "no error"
    except ValueError as refused:
        error = str(refused)
    dist.all_reduce(x)
    return error, float(x[0])


def test_gloo_refuses_cuda_tensors_for_send_recv_and_its_own_all_reduce_still_works():
    """Without the check, gloo's send of a CUDA tensor fails in the socket ("writev: Bad
    address"), seen on an H100 with torch 2.11."""
    for rank, (error, value) in enumerate(launch(ring_on_cuda_under_gloo, 2, backend="gloo",
                                                 echo=False, timeout=180)):
        assert error.startswith(f"rank {rank}: ") and "cannot carry cuda tensors" in error, error
        assert value == 2.0


def test_chapter_1_labs_give_the_cpu_answer_on_the_gpus():
    config = ToyAllReduceConfig(grads=EXAMPLE_GRADIENTS[:gpus()], param=0.5, lr=0.001)
    nccl, gloo = on_both(toy_all_reduce_step, config)
    for a, b in zip(nccl, gloo, strict=True):
        assert a.averaged == pytest.approx(b.averaged, abs=1e-7)
        assert a.param_after == pytest.approx(b.param_after, abs=1e-7)
    reference = full_batch_gradients(EXAMPLE_SENTENCES)
    for rank in launch(data_parallel_gradients, gpus(), args=(EXAMPLE_SENTENCES,),
                       backend="nccl", echo=False, timeout=180):
        assert max_abs_difference(rank.averaged, reference) < 1e-5


@pytest.mark.parametrize("worker", [reduce_scatter_memory, all_gather_memory])
def test_memory_timelines_count_the_same_bytes_on_the_gpus(worker):
    nccl, gloo = on_both(worker, ShardMemorySettings())
    for a, b in zip(nccl, gloo, strict=True):
        assert [s.held_bytes for s in a] == [s.held_bytes for s in b]


def test_the_training_lab_gives_the_cpu_curve_on_the_gpus():
    for wrapper in DDP_WRAPPERS:
        nccl, gloo = on_both(train_worker, TrainConfig(steps=5, wrapper=wrapper))
        torch.testing.assert_close(nccl[0].losses, gloo[0].losses, atol=1e-4, rtol=1e-4,
                                   msg=f"{wrapper}")


def test_the_zero_lab_measures_the_same_bytes_on_the_gpus():
    settings = StepSettings(width=64, layers=4, batch=8, steps=2, warmup=0)
    (nccl_reports, nccl_traffic), (gloo_reports, gloo_traffic) = (
        runs[0] for runs in on_both(lab_worker, settings, list(ZERO_STAGES)))
    for strategy in ZERO_STAGES:
        a, b = nccl_reports[strategy], gloo_reports[strategy]
        assert [(s.moment, a.bytes(s)) for s in a.snapshots] == [
            (s.moment, b.bytes(s)) for s in b.snapshots], strategy
    assert [(r.measured, r.expected) for r in nccl_traffic] == [
        (r.measured, r.expected) for r in gloo_traffic]


def fsdp_on_cuda(rank: int, world_size: int) -> tuple[torch.Tensor, str]:
    settings = StepSettings(width=32, layers=3, batch=4, steps=2, warmup=0)
    device = rank_device()
    model = FSDP(mlp(settings, seed=0).to(device))
    # SGD, not Adam: Adam moves a parameter by about lr whatever the size of its gradient,
    # so a near-zero gradient that rounds differently on the GPU would move it the other way.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, settings.width, device=device) * (rank + 1)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        opt.step()
    try:  # a sharded parameter used outside its unit's forward
        model.module[0].weight.sum()
        error = "no error"
    except RuntimeError as err:
        error = str(err)
    full = model.gather_full_params()
    return torch.cat([t.reshape(-1) for t in full.values()]), error


def test_fsdp_trains_on_the_gpus_like_on_the_cpu_and_still_names_a_sharded_parameter():
    nccl, gloo = on_both(fsdp_on_cuda)
    for (a, error), (b, _) in zip(nccl, gloo, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert "0.weight" in error, error
