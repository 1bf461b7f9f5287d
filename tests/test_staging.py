"""The one-GPU mode (issue 43): where ``launch`` puts ranks, and the path their CUDA tensors
take, run here on the CPU.

Ranks that share a GPU run on gloo, whose send/recv cannot carry CUDA tensors: labs stages
their messages through host buffers (:mod:`labs.staging`). ``launch(host_staging=True)`` sends
CPU tensors down the same path, so these tests run it without a GPU: every collective and
FSDP's step give the unstaged run's result bit for bit, and a staging path that forgets to
copy a landed message back is caught (``tests/test_gpu.py`` runs the real thing on a GPU).
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest
import torch

import labs
from labs import Backend, Device, Placement, launch, placement_note, rank_device, staging
from labs.collectives import Algorithm, all_gather, all_reduce, reduce_scatter
from labs.fsdp import FSDP
from labs.launch_inputs import pick_placement, sizes_note
from labs.memory import ShardMemorySettings, all_gather_memory, reduce_scatter_memory
from labs.multi_ring import multi_ring_all_reduce

from parity import TiedNet, assert_states_match, loss_of, rank_batch, reference_run

# --- the rule ----------------------------------------------------------------------------------

GLOO_CPU, GLOO_ONE_GPU = Placement(Backend.GLOO), Placement(Backend.GLOO, 1)


@pytest.mark.parametrize("backend, device, ranks, gpus, link, expected", [
    ("auto", "auto", 4, 0, False, GLOO_CPU),                 # a laptop
    ("auto", "auto", 1, 1, False, Placement(Backend.NCCL, 1)),  # one GPU, one rank
    ("auto", "auto", 4, 1, False, GLOO_ONE_GPU),             # one GPU, four ranks share it
    ("auto", "auto", 4, 4, False, Placement(Backend.NCCL, 4)),  # a GPU per rank
    ("auto", "auto", 2, 8, True, Placement(Backend.GLOO, 2)),  # the link is gloo's, GPUs kept
    ("auto", "cpu", 4, 4, False, GLOO_CPU),                  # asked for the CPU
    ("gloo", "auto", 4, 1, False, GLOO_ONE_GPU),             # gloo, still on the GPU there is
    ("gloo", "cpu", 4, 1, False, GLOO_CPU),
    ("auto", "cuda", 3, 2, False, Placement(Backend.GLOO, 2)),  # 3 ranks on 2 GPUs: 0, 1, 0
    ("nccl", "cuda", 2, 2, False, Placement(Backend.NCCL, 2)),
])
def test_one_rule_places_the_ranks(backend, device, ranks, gpus, link, expected):
    """nccl when each rank has a GPU and no link is asked for; else gloo, on the GPUs there
    are (shared), else on the CPU; every process of a machine reaches the same answer."""
    assert pick_placement(backend, ranks, gpus, True, device, link=link) == expected
    assert pick_placement(Backend(expected.backend), ranks, gpus, True, Device(device),
                          link=link) == expected


def test_ranks_sharing_gpus_take_them_in_turn_and_say_so():
    placement = Placement(Backend.GLOO, 2)
    assert [str(placement.device(r)) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert placement.describe(3) == ("3 rank(s): gloo, sharing 2 GPUs (messages staged through "
                                     "host memory)")
    assert GLOO_CPU.describe(2) == "2 rank(s): gloo, on the CPU"
    assert str(GLOO_CPU.device(5)) == "cpu"


@pytest.mark.parametrize("gpus, sizes, note", [
    (0, range(1, 9), "where the ranks ran (N = 1-8): gloo, on the CPU"),
    (0, (8, 2, 4, 2), "where the ranks ran (N = 2, 4, 8): gloo, on the CPU"),
    # the one-GPU box: one GPU all along, but two backends, so the note says which rows had which
    (1, range(1, 9), "where the ranks ran: N = 1: nccl, one GPU each; N = 2-8: gloo, sharing "
                     "one GPU (messages staged through host memory)"),
    (4, (1, 2), "where the ranks ran (N = 1, 2): nccl, one GPU each"),
])
def test_the_note_under_a_table_says_where_each_world_size_ran(gpus, sizes, note):
    assert sizes_note(sizes, lambda n: pick_placement("auto", n, gpus, True)) == note


def test_the_note_is_what_the_launch_chose():
    """placement_note follows the rule launch follows, with the same arguments (the
    machine's own: the CPU here, a GPU on a GPU box); a note of one GPU shared would differ
    from a run on the CPU."""
    for kwargs in ({}, {"device": "cpu"}, {"backend": "gloo"}):
        results = launch(where_am_i, 2, echo=False, **kwargs)
        assert placement_note(2, **kwargs) == (f"where the ranks ran (N = 2): "
                                               f"{results.placement.where()}")
        elsewhere = GLOO_CPU if results.placement.gpus else GLOO_ONE_GPU
        assert placement_note(2, **kwargs) != sizes_note([2], lambda n, e=elsewhere: e)


@pytest.mark.parametrize("backend, device, gpus, link, message", [
    ("auto", "cuda", 0, False, "device='cuda' but no GPU is visible here; use device='cpu'"),
    ("nccl", "cpu", 4, False, "nccl carries CUDA tensors only; use backend='gloo'"),
    ("nccl", "auto", 4, True, "the emulated link runs on gloo"),
    ("nccl", "auto", 1, False, r"NCCL needs one GPU per rank; use backend='gloo' \(world_size=2"),
    ("auto", "gpu", 1, False, r"device must be one of \['auto', 'cpu', 'cuda'\], got 'gpu'"),
])
def test_a_placement_that_cannot_be_is_refused_with_what_to_pass(backend, device, gpus, link,
                                                                 message):
    with pytest.raises(ValueError, match=message):
        pick_placement(backend, 2, gpus, True, device, link=link)


def where_am_i(rank: int, world_size: int) -> tuple[str, bool]:
    return str(rank_device()), staging.forced()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_launch_places_ranks_on_the_cpu_here_and_refuses_cuda_before_any_process(
        refuse_processes):
    results = launch(where_am_i, 2, host_staging=True, echo=False)
    assert results == [("cpu", True)] * 2 and results.placement == GLOO_CPU
    with refuse_processes(), pytest.raises(ValueError, match="no GPU is visible"):
        launch(where_am_i, 2, device="cuda")
    with refuse_processes(), pytest.raises(TypeError, match="host_staging must be True or"):
        launch(where_am_i, 2, host_staging="yes")


# --- the staging path, forced on the CPU ---------------------------------------------------------


def collectives(rank: int) -> dict[str, torch.Tensor]:
    """Every collective built on labs' point-to-point layer, FSDP's torch collectives (staged
    by labs.staging.staged) and the ring with segments, on uneven sizes."""
    x = torch.arange(37, dtype=torch.float32) * (rank + 1) + 0.25 * rank  # 37: uneven shards
    out = {f"all_reduce {a.name}": all_reduce(x.clone(), algorithm=a)
           for a in Algorithm if a is not Algorithm.TORCH}
    big = torch.linspace(-1, 1, 70_000) * (rank + 1)  # 280 kB: the ring's segments on CPU
    out["all_reduce RING 280 kB"] = all_reduce(big, algorithm=Algorithm.RING)
    out["multi_ring"] = multi_ring_all_reduce(x.clone(), node_size=1, channels=2)
    for algorithm in (Algorithm.RING, Algorithm.TORCH):
        shard = reduce_scatter(x, algorithm=algorithm)
        out[f"reduce_scatter {algorithm.name}"] = shard
        out[f"all_gather {algorithm.name}"] = all_gather(shard, numel=37, algorithm=algorithm)
    return out


def fsdp_states(rank: int, world_size: int) -> dict[str, list[dict[str, torch.Tensor]]]:
    """TiedNet trained by FSDP with torch's collectives and with the ring (prefetching on its
    communication stream): the full parameters after each step."""
    x, y = rank_batch(rank, world_size)
    out = {}
    for algorithm, prefetch in ((Algorithm.TORCH, 1), (Algorithm.RING, 1)):
        model = FSDP(TiedNet(seed=rank), collectives=algorithm, prefetch=prefetch)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        states = []
        for _ in range(3):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            model.finish_gradient_synchronization()
            opt.step()
            states.append(model.gather_full_params())
        out[algorithm.name] = states
    return out


def staged_worker(rank: int, world_size: int) -> dict[str, object]:
    """The collectives and FSDP, then the collectives again with a staging path that forgets
    to copy a landed message into its tensor (the mistake the parity must catch)."""
    result: dict[str, object] = {"collectives": collectives(rank),
                                 "fsdp": fsdp_states(rank, world_size)}
    if staging.forced():
        right = staging.Landing.wait
        staging.Landing.wait = lambda self, timeout=None: self.work.wait() or True
        try:
            result["forgetful"] = collectives(rank)
            result["forgetful fsdp"] = fsdp_states(rank, world_size)
        finally:
            staging.Landing.wait = right
    return result


def test_every_collective_and_fsdp_give_the_same_bits_through_host_buffers():
    plain = launch(staged_worker, 2, echo=False, timeout=120)
    staged = launch(staged_worker, 2, host_staging=True, echo=False, timeout=120)
    expected = reference_run("sgd")[:3]
    for rank in range(2):
        got, want = staged[rank]["collectives"], plain[rank]["collectives"]
        assert list(got) == list(want) and len(got) == 12
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)
        for name, states in staged[rank]["fsdp"].items():
            assert_states_match(states, expected, f"staged FSDP {name} rank {rank}")
            assert_states_match(states, plain[rank]["fsdp"][name], f"FSDP {name} rank {rank}")
        # Every collective of messages lost one; torch's, called without async_op, copy
        # their output back before they return, never through a Landing.
        forgetful = staged[rank]["forgetful"]
        right = [name for name in want if torch.equal(forgetful[name], want[name])]
        assert right == ["reduce_scatter TORCH", "all_gather TORCH"], rank
        for name, states in staged[rank]["forgetful fsdp"].items():  # FSDP's are async
            with pytest.raises(AssertionError):
                assert_states_match(states, expected, f"forgetful FSDP {name}")


def test_the_package_names_the_placement():
    assert labs.Placement is Placement and labs.Device is Device


def test_nbval_reads_a_cpu_note_and_a_gpu_note_as_one_line():
    """The chapters' outputs are stored from a CPU run; on a GPU box their notes differ, and
    notebooks/sanitize.cfg (make test's and make test-gpu's nbval) maps every note to one
    line. The rest of a checked output is still compared."""
    config = configparser.ConfigParser()
    config.read(Path(__file__).parents[1] / "notebooks" / "sanitize.cfg")
    rules = [(re.compile(config[s]["regex"]), config[s]["replace"]) for s in config.sections()]

    def sanitized(text: str) -> str:
        for pattern, replacement in rules:
            text = pattern.sub(replacement, text)
        return text

    cpu = f"N  MiB\n2  4.0\n{sizes_note([2], lambda n: GLOO_CPU)}\n"
    gpu = f"N  MiB\n2  4.0\n{sizes_note([2], lambda n: GLOO_ONE_GPU)}\n"
    assert cpu != gpu and sanitized(cpu) == sanitized(gpu)
    assert sanitized(cpu.replace("4.0", "4.5")) != sanitized(gpu)


@pytest.mark.parametrize("worker", [reduce_scatter_memory, all_gather_memory])
def test_a_memory_timeline_through_host_buffers_is_the_plain_one(worker):
    """The staging buffers are the transport's, as gloo's own: the tracker does not count
    them, so chapters 3 and 4's memory tables of ranks sharing a GPU are the CPU run's (a
    host buffer the tracker saw would add a chunk to every moment's transient bytes). With
    torch's collective only the transient bytes are compared: gloo's thread lets go of the
    output it wrote a little after the call returns, so what the plain run still holds at the
    moment after the free varies from run to run."""
    for settings in (ShardMemorySettings(), ShardMemorySettings(algorithm=Algorithm.TORCH)):
        plain = launch(worker, 4, args=(settings,), echo=False)
        staged = launch(worker, 4, args=(settings,), host_staging=True, echo=False)
        ring = settings.algorithm is Algorithm.RING
        for a, b in zip(plain, staged, strict=True):
            assert [(s.held_bytes if ring else 0, s.transient_bytes) for s in a] == \
                [(s.held_bytes if ring else 0, s.transient_bytes) for s in b]
