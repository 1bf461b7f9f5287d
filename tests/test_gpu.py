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
from torch import nn

from labs import Backend, launch, rank_device
from labs.activations import Workload, activation_bytes, measure_saved
from labs.collectives import Algorithm, all_gather, all_reduce, reduce_scatter
from labs.ddp import DDP, StepTimeline
from labs.experiments.activations import ActivationSettings
from labs.experiments.recipe import RecipeConfig, budget_table, recipe_worker
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
    return nccl, launch(worker, n, args=args, backend="gloo", device="cpu", echo=False,
                        timeout=180)


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


def ring_on_cuda_under_gloo(rank: int, world_size: int) -> tuple[str, float, str]:
    """Ranks sharing one GPU (the one-GPU mode): labs' ring on a CUDA tensor, its messages
    staged through host memory, then gloo's own all-reduce of the result."""
    x = torch.ones(1000, device=rank_device())
    all_reduce(x, algorithm=Algorithm.RING)
    dist.all_reduce(x)
    return str(x.device), float(x[0]), str(rank_device())


def test_ranks_sharing_one_gpu_run_labs_ring_through_host_memory():
    """Without staging, gloo's send of a CUDA tensor fails in the socket ("writev: Bad
    address"), seen on an H100 with torch 2.11."""
    results = launch(ring_on_cuda_under_gloo, 2, device="cuda", backend="gloo", echo=False,
                     timeout=180)
    assert results.placement.backend is Backend.GLOO and results.placement.gpus == 1
    for device, value, placed in results:
        assert (device, value, placed) == ("cuda:0", 4.0, "cuda:0")


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


def test_the_activation_closed_form_counts_cudas_float32_layer_norm_statistics():
    """In bf16 on CUDA the saved activations are the closed form with device_type="cuda":
    LayerNorm's mean and rstd in float32, not the bf16 the CPU keeps them in."""
    s = ActivationSettings(2, 6, 8, 2, 2, dtype=torch.bfloat16)
    cpu = s.workload()
    on_gpu = Workload(cpu.model.to("cuda"), tuple(t.to("cuda") for t in cpu.batch), cpu.loss)
    want = activation_bytes(2, 6, 8, 2, 2, s.vocab, element_size=2, device_type="cuda")
    assert measure_saved(on_gpu).total_bytes == want != s.activation_bytes()


@pytest.mark.parametrize("worker", [fsdp_on_cuda, train_worker])
def test_four_ranks_sharing_one_gpu_give_the_cpu_answer(worker):
    """The one-GPU mode: four gloo ranks on cuda:0 (labs' messages and FSDP's collectives
    staged through pinned host buffers) against the same four ranks on the CPU."""
    args = () if worker is fsdp_on_cuda else (TrainConfig(steps=3, wrapper=DDP_WRAPPERS[0]),)
    shared = launch(worker, 4, args=args, device="cuda", backend="gloo", echo=False,
                    timeout=180)
    assert shared.placement.gpus >= 1 and shared.backend is Backend.GLOO
    cpu = launch(worker, 4, args=args, device="cpu", echo=False, timeout=180)
    for a, b in zip(shared, cpu, strict=True):
        if worker is fsdp_on_cuda:
            torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(a.losses, b.losses, atol=1e-4, rtol=1e-4)


def test_the_recipe_budget_sits_beside_the_allocators_peak():
    config = RecipeConfig(steps=2, measure_memory=True)
    result = launch(recipe_worker, 1, args=(config,), echo=False, timeout=180)[0]
    print(budget_table(result))
    assert result.cuda_peak_bytes is not None and result.peak_bytes is not None
    assert result.cuda_peak_bytes >= result.peak_bytes


def timelines_on_cuda(rank: int, world_size: int) -> dict[str, bool]:
    """One step of DDP (four buckets) and of FSDP (a unit per layer) on the rank's GPU, with
    enough work per layer that the queue runs behind Python: their timelines, read from CUDA
    events, in order."""
    device = rank_device()
    torch.manual_seed(0)
    x = torch.randn(1024, 2048, device=device)
    ddp = DDP(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).to(device),
              bucket_cap_mb=16)
    for _ in range(2):  # the second step is the one kept
        ddp.timeline = StepTimeline()
        ddp(x).square().mean().backward()
        ddp.finish_gradient_synchronization()
    t = ddp.timeline.resolved()
    net = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]).to(device)
    fsdp = FSDP(net, units=list(net))
    fsdp(x).square().mean().backward()
    fsdp.finish_gradient_synchronization()
    intervals = fsdp.timeline.resolved()
    return {
        "floats": all(isinstance(m, float) for m in [*t.done.values(), t.finished]),
        "launched before done": all(t.launched[i] <= t.done[i] for i in t.done),
        "done before finished": max(t.done.values()) <= t.finished,
        "fsdp intervals": len(intervals) >= 8 and all(i.start <= i.end for i in intervals),
    }


@pytest.mark.parametrize("shared", [False, True], ids=["a GPU each", "one GPU shared"])
def test_the_timelines_on_cuda_are_read_from_events_in_order(shared):
    results = (launch(timelines_on_cuda, 2, device="cuda", backend="gloo", echo=False,
                      timeout=180) if shared
               else launch(timelines_on_cuda, gpus(), backend="nccl", echo=False, timeout=180))
    for rank, checks in enumerate(results):
        assert all(checks.values()), (rank, checks)
