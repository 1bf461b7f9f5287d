"""Chapter 1's lab on real ranks: the toy step, gradient parity, and the CLI/torchrun path."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from labs import launch
from labs.toy_allreduce import (
    EXAMPLE_GRADIENTS,
    EXAMPLE_SENTENCES,
    ToyAllReduceConfig,
    data_parallel_gradients,
    float32_steps,
    full_batch_gradients,
    max_abs_difference,
    shard_sentences,
    swapped_order_sums,
    toy_all_reduce_step,
)


@pytest.mark.parametrize("world_size", [1, 2, 4, 7])
def test_toy_step_leaves_every_rank_with_the_same_parameter(world_size):
    config = ToyAllReduceConfig(seed=3)
    records = launch(toy_all_reduce_step, world_size, args=(config,), echo=False)
    grads = torch.tensor(config.gradients(world_size), dtype=torch.float32)
    assert [r.rank for r in records] == list(range(world_size))
    assert [r.local_grad for r in records] == grads.tolist()
    assert len({r.param_after_bits for r in records}) == 1
    assert records[0].summed == pytest.approx(float(grads.sum()), rel=1e-6, abs=1e-7)
    mean = records[0].summed / world_size
    assert records[0].averaged == pytest.approx(mean, rel=1e-6)
    assert records[0].param_after == pytest.approx(0.5 - 1e-3 * mean, rel=1e-6)


def test_seed_story_numbers():
    records = launch(toy_all_reduce_step, 4, args=(ToyAllReduceConfig(grads=EXAMPLE_GRADIENTS),),
                     echo=False)
    assert records[0].summed == pytest.approx(0.2, abs=1e-7)
    assert records[0].param_after == pytest.approx(0.49995, abs=1e-7)


def test_config_refuses_wrong_number_of_gradients():
    with pytest.raises(ValueError, match="give exactly 4"):
        ToyAllReduceConfig(grads=(0.1, 0.2)).gradients(4)


def test_drawn_gradients_depend_only_on_the_seed():
    assert ToyAllReduceConfig(seed=5).gradients(6) == ToyAllReduceConfig(seed=5).gradients(6)
    assert ToyAllReduceConfig(seed=5).gradients(6) != ToyAllReduceConfig(seed=6).gradients(6)


@pytest.mark.parametrize("world_size", range(1, 9))
def test_shards_cover_every_sentence_once(world_size):
    shards = [shard_sentences(EXAMPLE_SENTENCES, r, world_size) for r in range(world_size)]
    assert [s for shard in shards for s in shard] == list(EXAMPLE_SENTENCES)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_averaged_gradients_equal_full_batch_when_batches_are_even(world_size):
    ranks = launch(data_parallel_gradients, world_size, args=(EXAMPLE_SENTENCES,), echo=False)
    reference = full_batch_gradients(EXAMPLE_SENTENCES)
    for r in ranks:
        for name, grad in r.averaged.items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-6)
        assert max_abs_difference(r.local, reference) > 1e-3  # the all-reduce did the work


def test_averaged_gradients_differ_when_batches_are_uneven():
    ranks = launch(data_parallel_gradients, 3, args=(EXAMPLE_SENTENCES,), echo=False)
    reference = full_batch_gradients(EXAMPLE_SENTENCES)
    assert max_abs_difference(ranks[0].averaged, reference) > 1e-3


def test_rounding_is_a_few_float32_steps_and_a_wrong_average_is_not():
    reference = full_batch_gradients(EXAMPLE_SENTENCES)
    even = launch(data_parallel_gradients, 4, args=(EXAMPLE_SENTENCES,), echo=False)
    uneven = launch(data_parallel_gradients, 3, args=(EXAMPLE_SENTENCES,), echo=False)
    assert float32_steps(even[0].averaged, reference).max() < 1000
    assert float32_steps(uneven[0].averaged, reference).max() > 1e5
    assert float32_steps(reference, reference).max() == 0
    one_step = {n: torch.nextafter(g, torch.tensor(float("inf"))) for n, g in reference.items()}
    assert float32_steps(one_step, reference).max() == 1


@pytest.mark.parametrize("world_size, swapped", [(2, 1), (4, 3)])
def test_two_same_sized_all_reduces_in_another_order_give_wrong_sums_silently(world_size,
                                                                             swapped):
    sums = launch(swapped_order_sums, world_size, args=(swapped,), echo=False)
    total = world_size * (world_size + 1) / 2
    for s in sums:
        assert (s.want_weight, s.want_bias) == (total, 100 * total)
        assert s.weight != s.want_weight and s.bias != s.want_bias
    # the first call paired the others' weight with the swapped rank's bias
    first = total - swapped - 1 + 100 * (swapped + 1)
    assert sums[0].weight == first and sums[swapped].bias == first
    in_order = launch(swapped_order_sums, world_size, args=(-1,), echo=False)
    assert all((s.weight, s.bias) == (s.want_weight, s.want_bias) for s in in_order)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labs", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # the CLI's local launch: also test_recipe's; the toy lab: also torchrun's
def test_cli_runs_the_toy_lab():
    out = _cli("toy", "--world-size", "2", "--grads", "1", "3")
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [row[2] for row in rows] == ["4", "4"]  # the sum, on both ranks
    assert [row[3] for row in rows] == ["2", "2"]  # the average


def test_cli_refuses_bad_settings_with_a_message():
    out = _cli("toy", "--world-size", "4", "--grads", "0.1", "0.2")
    assert out.returncode == 2
    assert "give exactly 4" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # make test runs the lab under torchrun in the two-node test below
def test_same_lab_runs_under_torchrun():
    """torchrun's env:// rendezvous on a free port (--standalone), two processes."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "labs", "toy", "--grads", "1", "3"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"]  # printed once, by rank 0, for both ranks
    assert {row[2] for row in rows} == {"4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_agent(node: int, port: int) -> subprocess.Popen:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return subprocess.Popen(
        [torchrun, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
         "--master_addr=127.0.0.1", f"--master_port={port}",
         # gloo: both "nodes" are this machine, and on a box with one GPU each would take
         # nccl on cuda:0, which refuses two processes on one GPU
         "-m", "labs", "toy", "--grads", "1", "3", "--backend", "gloo"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def _listens(agent: subprocess.Popen, port: int, timeout: float) -> bool:
    """Whether node 0's agent holds ``port`` (its rendezvous store) within ``timeout`` s; False
    once it has exited, which it does when another process took the port first."""
    process = psutil.Process(agent.pid)
    connections = getattr(process, "net_connections", None) or process.connections  # psutil < 6
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in connections(kind="tcp")):
                return True
        time.sleep(0.05)
    return False


def _stop_agent(agent: subprocess.Popen) -> None:
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)  # the agent and its ranks: its own session
    agent.wait()


def test_same_lab_runs_on_two_torchrun_nodes():
    """The README's two-node command, both "nodes" on this machine: two torchrun agents meet
    at node 0's address (static rendezvous), one rank each; rank 0, on node 0, prints the table
    for both ranks and node 1 prints none. Node 1 starts once node 0 holds the port: a free
    port can be taken by another process (the gloo sockets of tests running beside this one)
    before node 0 binds it, and node 1 would then wait on a stranger."""
    agents: list[subprocess.Popen] = []
    try:
        for _ in range(3):
            port = _free_port()
            agents = [_torchrun_agent(0, port)]
            if _listens(agents[0], port, timeout=60):
                break
            _stop_agent(agents[0])
        else:
            pytest.fail("node 0's torchrun did not get a free port in 3 tries: "
                        f"{agents[0].communicate()[1][-2000:]}")
        agents.append(_torchrun_agent(1, port))
        deadline = time.monotonic() + 180
        outs = []
        for agent in agents:
            try:
                outs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                _stop_agent(agent)
                outs.append(agent.communicate())
    finally:  # a hung rendezvous must not outlive the test: kill each agent with its ranks
        for agent in agents:
            _stop_agent(agent)
    said = "\n".join(f"node {node} (exit {agent.returncode}) stderr:\n{err[-2000:]}"
                     for node, (agent, (_, err)) in enumerate(zip(agents, outs, strict=True)))
    assert all(agent.returncode == 0 for agent in agents), said
    tables = [[line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
              for out, _ in outs]
    assert [row[0] for row in tables[0]] == ["0", "1"]
    assert tables[1] == []
    assert {row[2] for row in tables[0]} == {"4"}
