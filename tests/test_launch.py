"""Tests of labs.launch with real rank processes (no mocks).

Each test names the promise of ``launch`` it checks. Every test also checks, through the
``no_leftover_processes`` fixture, that no rank outlives its launch, whatever happened in it.
"""

from __future__ import annotations

import json
import math
import operator
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
import torch.distributed as dist
from nbclient import NotebookClient

import labs
from labs import Backend, LaunchTimeout, RankError, RankResults, launch
from labs.launcher import pick_backend

from launch_driver import meet  # the same rendezvous helper the two-process test runs

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# The rank functions below travel by value, as a notebook's would: otherwise every rank would
# import this module, and with it pytest and nbclient (a second per launch on 2 cores).
# They build tensors with torch.full rather than torch.tensor next to `dist`: cloudpickle ships
# every loaded submodule whose name the function mentions, so once this process has imported
# torch.distributed.tensor (torch.testing does) each rank would import it too (+1.5 s a launch).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DRIVER = Path(__file__).with_name("launch_driver.py")
CORES = len(os.sched_getaffinity(0))


def run_driver(*argv: str, log: Path) -> tuple[subprocess.Popen, Path, Path]:
    """Start tests/launch_driver.py, its output going to log.out and log.err: files, not pipes,
    since its forkserver inherits them and would hold a pipe open after the driver is gone."""
    out, err = log.with_suffix(".out"), log.with_suffix(".err")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, str(DRIVER), *argv], stdout=stdout, stderr=stderr)
    return proc, out, err


def wait_for_files(where: Path, pattern: str, count: int, proc: subprocess.Popen) -> list[Path]:
    """Wait (up to 60 s: the driver imports torch twice) for ``count`` files to appear."""
    deadline = time.monotonic() + 60.0
    while len(found := sorted(where.glob(pattern))) < count:
        assert proc.poll() is None, f"the driver exited early with code {proc.returncode}"
        assert time.monotonic() < deadline, f"only {len(found)} of {count} ranks started"
        time.sleep(0.05)
    return found


def return_rank(rank: int, world_size: int) -> int:
    return rank


def return_rank_plus(rank: int, world_size: int, extra: object) -> int:
    return rank


# --- 1. ranks run fn inside an initialised process group; results in rank order -------------
# Tests whose ranks run collectives on CPU tensors ask for gloo: under backend="auto" a machine
# with a GPU per rank would pick nccl, which needs CUDA tensors.


def group_facts(rank: int, world_size: int) -> tuple:
    total = torch.full((1,), rank + 1.0)
    dist.all_reduce(total)
    return dist.is_initialized(), dist.get_rank(), dist.get_world_size(), rank, total.item()


def test_ranks_run_inside_an_initialised_process_group():
    """Promise 1: fn(rank, world_size) runs in N processes that each joined the default group,
    and a real all_reduce adds across all of them."""
    results = launch(group_facts, 4, backend="gloo", echo=False)
    assert isinstance(results, RankResults) and isinstance(results, list)
    assert results == [(True, rank, 4, rank, 1.0 + 2 + 3 + 4) for rank in range(4)]
    assert results.backend is Backend.GLOO
    assert len(results.stdout) == len(results.stderr) == 4
    assert results.seconds > 0


def test_auto_backend_is_gloo_unless_there_is_a_gpu_per_rank():
    """Promise 1: backend="auto" picks nccl only when every rank can have its own GPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    expected = Backend.NCCL if gpus >= 2 and dist.is_nccl_available() else Backend.GLOO
    assert launch(return_rank, 2, echo=False).backend is expected


@pytest.mark.parametrize("backend, ranks_here, gpus, nccl, expected", [
    ("auto", 2, 0, True, Backend.GLOO),
    ("auto", 2, 1, True, Backend.GLOO),   # torchrun --nproc_per_node=2 on a 1-GPU box: all gloo
    ("auto", 2, 2, True, Backend.NCCL),
    ("auto", 1, 8, True, Backend.NCCL),
    ("auto", 4, 8, False, Backend.GLOO),  # a torch build without NCCL
    ("gloo", 4, 8, True, Backend.GLOO),
    ("nccl", 4, 4, True, Backend.NCCL),
])
def test_every_process_of_a_machine_picks_the_same_backend(backend, ranks_here, gpus, nccl,
                                                           expected):
    """Promise 1: the choice depends on how many processes share the machine, never on which
    one asks (under torchrun a choice by LOCAL_RANK gave rank 0 nccl and rank 1 gloo on a
    1-GPU box, and the group hung)."""
    assert pick_backend(backend, ranks_here, gpus, nccl) is expected


@pytest.mark.parametrize("ranks_here, gpus, nccl, message", [
    (2, 1, True, r"NCCL needs one GPU per rank; use backend='gloo' \(LOCAL_WORLD_SIZE=2, GPUs"),
    (1, 1, False, "this torch build has no NCCL; use backend='gloo'"),
])
def test_nccl_without_a_gpu_per_process_is_refused(ranks_here, gpus, nccl, message):
    with pytest.raises(ValueError, match=message):
        pick_backend("nccl", ranks_here, gpus, nccl, ranks="LOCAL_WORLD_SIZE")


def thread_settings(rank: int, world_size: int) -> tuple[int, str]:
    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def test_each_rank_gets_its_share_of_the_cores_or_the_threads_asked_for():
    """Promise 1: by default N ranks share the cores (cores // N threads each, at least one);
    ``threads`` sets the number instead (the collectives benchmark asks for one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // 2)
    assert launch(thread_settings, 2, echo=False) == [(share, str(share))] * 2
    assert launch(thread_settings, 2, threads=3, echo=False) == [(3, "3")] * 2


def distinct_pids(rank: int, world_size: int) -> int:
    return os.getpid()


def test_each_rank_is_its_own_process():
    """Promise 1: N real processes, none of them the caller."""
    pids = launch(distinct_pids, 4, echo=False)
    assert len(set(pids)) == 4 and os.getpid() not in pids


def tensors_and_args(rank: int, world_size: int, scale: float, name: str) -> dict:
    return {"name": name, "values": [torch.full((2,), rank * scale)], "rank": torch.tensor(rank)}


def test_args_are_passed_and_tensors_come_back_in_rank_order():
    """Promise 1: extra args reach every rank; tensors (nested too) come back in rank order."""
    results = launch(tensors_and_args, 3, args=(0.5, "w"), echo=False)
    for rank, value in enumerate(results):
        assert value["name"] == "w"
        torch.testing.assert_close(value["values"][0], torch.full((2,), rank * 0.5))
        assert value["rank"].item() == rank and value["rank"].device.type == "cpu"


def what_this_rank_holds(rank: int, world_size: int, shared: str, own: str) -> tuple:
    return shared, own


def test_rank_args_reach_their_own_rank_only():
    """What one rank must not see of another's (a check's hidden inputs) goes by rank_args."""
    results = launch(what_this_rank_holds, 3, args=("all",),
                     rank_args=[("zero",), ("one",), ("two",)], echo=False)
    assert list(results) == [("all", "zero"), ("all", "one"), ("all", "two")]


def cuda_tensors(rank: int, world_size: int) -> dict:
    on_gpu = torch.full((2,), float(rank), device=f"cuda:{rank}")
    return {"flat": on_gpu, "nested": [on_gpu]}


@pytest.mark.gpu
def test_cuda_tensors_come_back_on_the_cpu():
    """Promise 1: tensors returned from a GPU rank (nested too) arrive on the CPU."""
    results = launch(cuda_tensors, 1, echo=False)
    assert results.backend is Backend.NCCL
    assert results[0]["flat"].device.type == results[0]["nested"][0].device.type == "cpu"


# --- 2. functions that cannot be imported by name travel by value ---------------------------


def test_lambda_and_closure_run():
    """Promise 2: a lambda and a closure over a local variable run in the ranks."""
    offset = 10
    assert launch(lambda rank, world_size: rank + offset, 2, echo=False) == [10, 11]

    def make_adder(step: int):
        return lambda rank, world_size: rank * step + world_size

    assert launch(make_adder(3), 3, echo=False) == [3, 6, 9]


def test_function_defined_inside_a_test_runs():
    """Promise 2: a function defined in a local scope (as in a notebook cell), calling another
    local function, with its own all_reduce."""

    def square(x: float) -> float:
        return x * x

    def work(rank: int, world_size: int, base: float) -> float:
        total = torch.full((1,), square(rank + base))
        dist.all_reduce(total)
        return total.item()

    assert launch(work, 3, args=(1.0,), backend="gloo", echo=False) == [1.0 + 4 + 9] * 3


def test_function_importable_by_name_runs():
    """Promise 2, the usual case: a function the ranks can import by name."""
    assert launch(operator.add, 3, echo=False) == [3, 4, 5]  # rank + world_size


NOTEBOOK_CELL = """\
import torch
import torch.distributed as dist
from labs import launch

def total(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"rank {rank} sees {t.item():g}")
    return t.item()

results = launch(total, world_size=2, backend="gloo")
print("results:", list(results))
"""


@pytest.mark.slow  # nbval runs every chapter's cells, which define workers and launch them
def test_function_defined_in_a_jupyter_kernel_runs(tmp_path):
    """Promise 2: a real Jupyter kernel runs a cell that defines fn and calls launch."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_CELL)])
    client = NotebookClient(
        notebook, timeout=120, kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = notebook.cells[0].outputs
    assert not [o for o in outputs if o.output_type == "error"], outputs
    stdout = "".join(o.text for o in outputs if o.get("name") == "stdout")
    assert "[rank 0] rank 0 sees 3\n[rank 1] rank 1 sees 3\n" in stdout
    assert "results: [3.0, 3.0]" in stdout


# --- 3. a fresh rendezvous per launch (no fixed port) ------------------------------------


def check_two_overlapping_launches(first: list[dict], second: list[dict]) -> None:
    for results in (first, second):
        assert [r["sum"] for r in results] == [2.0, 2.0]  # each all_reduce saw only its own group


def test_two_launches_at_once_in_threads(tmp_path):
    """Promise 3: two launches running at the same time in one process both succeed, each in
    its own group."""
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                launch, meet, 2, args=(str(tmp_path), name, 4), backend="gloo", timeout=30.0,
                echo=False,
            )
            for name in ("a", "b")
        ]
        first, second = (future.result() for future in futures)
    check_two_overlapping_launches(first, second)


@pytest.mark.slow  # the same promise as the threads' test above, from two processes
def test_two_launches_at_once_in_two_processes(tmp_path):
    """Promise 3: two launches running at the same time from two processes both succeed."""
    where = tmp_path / "met"
    where.mkdir()
    drivers = [run_driver("meet", str(where), name, "4", log=tmp_path / name) for name in "ab"]
    results = []
    for proc, out, err in drivers:
        assert proc.wait(timeout=90) == 0, err.read_text()
        results.append(json.loads(out.read_text().splitlines()[-1]))
    check_two_overlapping_launches(*results)


def test_five_launches_in_a_row():
    """Promise 3: re-running a launch never meets a port still in use."""
    for _ in range(5):
        assert launch(group_facts, 4, backend="gloo", echo=False)[0][-1] == 10.0


# --- 4. threads per rank share the cores ----------------------------------------------------


def thread_count(rank: int, world_size: int) -> int:
    return torch.get_num_threads()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_threads_per_rank_share_the_cores(world_size):
    """Promise 4: each rank gets cores // world_size threads (at least 1), so N ranks do not
    oversubscribe the machine; a single rank gets every core."""
    expected = max(1, CORES // world_size)
    assert launch(thread_count, world_size, echo=False) == [expected] * world_size
    if world_size == 1:
        assert expected == CORES


# --- 5. a failing rank is named, with its own traceback -------------------------------------


def raise_in_one_rank(rank: int, world_size: int, bad_rank: int) -> float:
    dist.barrier()
    total = torch.ones(1)
    if rank == bad_rank:
        time.sleep(0.2)  # the others are inside all_reduce by now, waiting for this rank
        raise ValueError(f"boom from rank {rank}")
    dist.all_reduce(total)
    return total.item()


@pytest.mark.parametrize("bad_rank", [2, 0])
def test_rank_that_raises_is_named_with_its_traceback(bad_rank):
    """Promise 5: the rank that raised is named, with its traceback; the peers that failed only
    because it left ("Connection closed by peer") are secondary, not the cause."""
    with pytest.raises(RankError) as info:
        launch(raise_in_one_rank, 4, args=(bad_rank,), backend="gloo", timeout=30.0, echo=False)
    error = info.value
    assert error.rank == bad_rank and error.exc_type == "ValueError"
    assert f"boom from rank {bad_rank}" in error.remote_traceback
    assert 'raise ValueError(f"boom from rank {rank}")' in error.remote_traceback
    assert str(error).startswith(f"rank {bad_rank} raised ValueError: boom from rank {bad_rank}")
    peers = sorted(set(range(4)) - {bad_rank})
    assert [f.rank for f in error.secondary] == peers
    assert all(f.peer_lost for f in error.secondary), error.secondary


def fail_late_on_rank_zero(rank: int, world_size: int) -> None:
    """Every rank raises the same error, rank 0 a second after the others."""
    if rank == 0:
        time.sleep(1.0)
    raise ValueError(f"the same bug on rank {rank}")


@pytest.mark.parametrize("grace, seen", [(0.0, [1]), (5.0, [0, 1])])
def test_failure_grace_decides_which_late_failures_are_seen(grace, seen):
    """After the first failure the launcher waits ``failure_grace`` seconds for the others
    (the checks wait long enough for ranks that fail the same way a little later)."""
    with pytest.raises(RankError) as error:
        launch(fail_late_on_rank_zero, 2, echo=False, failure_grace=grace)
    assert sorted([error.value.rank] + [f.rank for f in error.value.secondary]) == seen
    assert error.value.rank == 1  # the first to fail is named; the checks pick the lowest


def die_in_one_rank(rank: int, world_size: int, how: str) -> float:
    dist.barrier()
    if rank == 1:
        if how == "exit":
            os._exit(7)
        if how == "abort":  # as a C++ library does on an uncaught exception
            os.write(2, b"terminate called after throwing an instance of 'c10::Error'\n")
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)
    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


@pytest.mark.parametrize(("how", "said"), [
    ("exit", "exited (7)"), ("kill", "killed by signal 9"), ("abort", "killed by signal 6"),
])
def test_rank_that_dies_without_a_traceback_is_named(how, said):
    """Promise 5: a rank that ends without raising (os._exit, a signal, a crash in C++) is
    named as RankDied, and its peers stuck in all_reduce are secondary. A crash shows what the
    rank wrote last and the Python line it crashed on."""
    with pytest.raises(RankError) as info:
        launch(die_in_one_rank, 4, args=(how,), backend="gloo", timeout=30.0, echo=False)
    error = info.value
    assert error.rank == 1 and error.exc_type == "RankDied"
    assert said in str(error)
    crashed = "in die_in_one_rank" in error.remote_traceback
    assert crashed == (how == "abort"), error.remote_traceback
    assert ("terminate called" in error.remote_traceback) == (how == "abort")
    assert "_rank_main" not in error.remote_traceback  # the launcher's frames are cut
    assert [f.rank for f in error.secondary] == [0, 2, 3]
    assert all(f.peer_lost for f in error.secondary), error.secondary


def unpicklable_result(rank: int, world_size: int) -> object:
    return threading.Lock() if rank == 3 else rank


def test_unpicklable_return_value_is_that_ranks_error():
    """Promise 5: a return value that cannot be pickled is reported as an error of its rank."""
    with pytest.raises(RankError) as info:
        launch(unpicklable_result, 4, echo=False)
    error = info.value
    assert error.rank == 3 and error.exc_type == "TypeError"
    assert "pickle" in str(error) and "lock" in str(error)
    assert error.secondary == []


# --- 6. a hung rank ends the launch at the timeout ------------------------------------------


def skip_a_collective(rank: int, world_size: int) -> int:
    if rank != 3:  # the bug: rank 3 never joins, so 0, 1 and 2 wait in all_reduce forever
        dist.all_reduce(torch.ones(1))
    return rank


def sleep_in_one_rank(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(1000)
    return rank


@pytest.mark.parametrize(
    ("fn", "world_size", "stuck", "where"),
    [
        (skip_a_collective, 4, [0, 1, 2], "in all_reduce"),
        (sleep_in_one_rank, 2, [1], "in sleep_in_one_rank"),
    ],
)
def test_hung_ranks_time_out(fn, world_size, stuck, where):
    """Promise 6: LaunchTimeout soon after the timeout, naming exactly the ranks still running,
    with the stack each was stuck in; the fixture checks they were all killed."""
    timeout = 3.0
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(fn, world_size, backend="gloo", timeout=timeout, echo=False)
    assert time.monotonic() - started < timeout + 5
    error = info.value
    assert error.ranks == stuck
    assert sorted(error.stacks) == stuck
    assert all(where in stack for stack in error.stacks.values()), error.stacks
    assert f"still running after {timeout:g} s" in str(error)


# --- 7. interrupting or killing the launcher ends every rank --------------------------------


def test_keyboard_interrupt_kills_all_ranks(tmp_path, procs):
    """Promise 7: Ctrl-C (the notebook's stop button) in the launcher ends every rank."""
    proc, _, err = run_driver("sleep", str(tmp_path), log=tmp_path / "driver")
    try:
        pid_files = wait_for_files(tmp_path, "rank*.pid", 4, proc)
        pids = [int(path.read_text()) for path in pid_files]
        assert all(procs.running(pid) for pid in pids)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) != 0
    finally:
        proc.kill()
        proc.wait()
    assert "KeyboardInterrupt" in err.read_text()
    assert procs.wait_gone(pids, within=5.0) == []


def test_ranks_exit_when_the_launcher_is_killed(tmp_path, procs):
    """Promise 7: when the launcher dies outright (a kernel crash, SIGKILL), its ranks notice
    the closed pipe and exit by themselves."""
    proc, _, _ = run_driver("sleep", str(tmp_path), log=tmp_path / "driver")
    try:
        pids = [int(path.read_text()) for path in wait_for_files(tmp_path, "rank*.pid", 4, proc)]
        proc.send_signal(signal.SIGKILL)  # no finally, no cleanup: only the ranks can act
        assert proc.wait(timeout=20) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert procs.wait_gone(pids, within=5.0) == []


# --- 9. bad input is refused before any process starts --------------------------------------



def case_id(value: object) -> str | None:
    """Readable, stable ids for the bad-input cases: "world_size=0", "args=(lock,)"."""
    if not isinstance(value, dict):
        return None  # pytest's own id
    (key, v), = value.items()
    return f"{key}=({type(v[0]).__name__},)" if isinstance(v, tuple) else f"{key}={v!r}"


@pytest.mark.parametrize(
    ("kwargs", "error", "advice"),
    [
        ({"world_size": 0}, ValueError, "world_size must be at least 1"),
        ({"world_size": -1}, ValueError, "world_size must be at least 1"),
        ({"world_size": 2.0}, TypeError, "positive int.*e.g. world_size=4"),
        ({"world_size": "4"}, TypeError, "positive int.*e.g. world_size=4"),
        ({"world_size": True}, TypeError, "positive int.*e.g. world_size=4"),
        ({"world_size": labs.MAX_WORLD_SIZE + 1}, ValueError, "Use a smaller world_size"),
        ({"fn": 42}, TypeError, r"Pass the function itself, e.g. launch\(my_fn"),
        ({"backend": "nccl"}, ValueError, "use backend='gloo'"),
        pytest.param(
            {"backend": "nccl"}, ValueError, "NCCL needs one GPU per rank; use backend='gloo'",
            id="nccl-without-gpus-message",
        ),
        ({"backend": "mpi"}, ValueError, r"backend must be one of \['auto', 'gloo', 'nccl'\]"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds"),
        ({"timeout": -1.0}, ValueError, "timeout must be a positive number of seconds"),
        ({"timeout": math.nan}, ValueError, "timeout must be a positive number of seconds"),
        ({"timeout": math.inf}, ValueError, "timeout must be finite"),
        ({"threads": 0}, ValueError, r"threads must be a positive int \(or None"),
        ({"threads": 1.5}, ValueError, r"threads must be a positive int \(or None"),
        ({"threads": True}, ValueError, r"threads must be a positive int \(or None"),
        ({"failure_grace": -1}, ValueError, "failure_grace must be a number of seconds >= 0"),
        ({"failure_grace": "2"}, ValueError, "failure_grace must be a number of seconds >= 0"),
        ({"args": 3}, TypeError, r"args must be a tuple.*write args=\(value,\)"),
        ({"args": "abc"}, TypeError, r"args must be a tuple.*write args=\(value,\)"),
        ({"rank_args": [(1,)]}, ValueError, "rank_args holds 1 tuple.*give one per rank"),
        ({"rank_args": [1, 2]}, TypeError, r"one tuple per rank, e.g. rank_args=\[\(x0,\)"),
        (
            {"args": (threading.Lock(),)}, TypeError,
            "Arguments must be picklable.*create open files, locks or sockets inside fn",
        ),
    ],
    ids=case_id,
)
def test_bad_input_is_refused_before_any_process_starts(kwargs, error, advice,
                                                        refuse_processes):
    """Promise 9: bad input raises at once, with a message saying what to do, and no process is
    started (anything that would start one fails the test)."""
    call = {"fn": return_rank, "world_size": 2, "echo": False, **kwargs}
    with refuse_processes(), pytest.raises(error, match=advice):
        launch(call.pop("fn"), call.pop("world_size"), **call)


class Spec:
    """An argument with an attribute named like a torch submodule (``torch.ops``)."""

    ops = ("add", "mul")


def read_ops(rank: int, world_size: int, spec: Spec) -> tuple[str, ...]:
    # Reads an attribute named ``ops`` and uses torch: cloudpickle ships ``torch.ops`` along
    # with this function, an object it cannot pickle on its own (a ModuleType subclass).
    return spec.ops if torch.is_tensor(torch.zeros(1)) else ()


def test_a_worker_reading_an_attribute_named_like_a_torch_submodule_launches():
    assert launch(read_ops, 2, args=(Spec(),), echo=False) == [("add", "mul"), ("add", "mul")]


LOCK = threading.Lock()


def use_a_global_lock(rank: int, world_size: int) -> int:
    with LOCK:
        return rank


@pytest.mark.parametrize(
    ("fn", "args", "advice"),
    [
        (use_a_global_lock, (), r"could not send fn use_a_global_lock.*define open files, "
                                r"locks.*inside fn"),
        (return_rank_plus, (threading.Lock(),), r"could not send args.*Arguments must be "
                                                r"picklable"),
    ],
    ids=["the function", "an argument"],
)
def test_what_cannot_travel_to_the_ranks_is_named(fn, args, advice, refuse_processes):
    with refuse_processes(), pytest.raises(TypeError, match=advice):
        launch(fn, 2, args=args, echo=False)


def test_the_process_guard_sees_a_launch(refuse_processes):
    """The guard the bad-input tests rely on fails a launch that starts ranks."""
    from conftest import ProcessStarted

    with refuse_processes(), pytest.raises(ProcessStarted):
        launch(return_rank, 2, echo=False)


# --- 10. what ranks print is captured and echoed --------------------------------------------


def chatty(rank: int, world_size: int) -> int:
    print(f"hello from {rank}")
    os.write(1, f"c-level {rank}\n".encode())
    print(f"warning {rank}", file=sys.stderr)
    os.write(2, f"c-level err {rank}\n".encode())
    return rank


def test_prints_are_captured_and_echoed_in_rank_order(capsys):
    """Promise 10: Python prints and C-level writes of every rank land in results.stdout and
    .stderr, and are echoed in the parent prefixed "[rank k] ", in rank order."""
    results = launch(chatty, 3, echo=True)
    assert results == [0, 1, 2]
    for rank in range(3):
        assert results.stdout[rank] == f"hello from {rank}\nc-level {rank}\n"
        assert f"warning {rank}\nc-level err {rank}\n" in results.stderr[rank]
    out, err = capsys.readouterr()
    assert out == "".join(f"[rank {r}] hello from {r}\n[rank {r}] c-level {r}\n" for r in range(3))
    echoed = [line for line in err.splitlines() if "warning" in line or "c-level" in line]
    assert echoed == [
        f"[rank {r}] {text} {r}" for r in range(3) for text in ("warning", "c-level err")
    ]


def test_echo_false_prints_nothing(capsys):
    """Promise 10: with echo=False the output is only in the results."""
    results = launch(chatty, 2, echo=False)
    assert results.stdout == [f"hello from {r}\nc-level {r}\n" for r in range(2)]
    assert capsys.readouterr() == ("", "")


def gloo_chatter(rank: int, world_size: int) -> None:
    # What gloo in torch 2.9 writes to fd 1 whenever a group connects, then the same line
    # reporting a peer missing, then the learner's own line.
    os.write(1, f"[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected "
                "peer ranks is : 1\n".encode())
    os.write(1, f"[Gloo] Rank {rank} is connected to 0 peer ranks. Expected number of connected "
                "peer ranks is : 1\n".encode())
    print(f"mine {rank}")


def test_gloo_connection_chatter_is_dropped_but_a_shortfall_is_kept(capsys):
    """Promise 10: gloo's "connected to all peers" line (torch 2.9 prints it at every group's
    start) does not reach the results or the echo; the same line with a peer missing does."""
    results = launch(gloo_chatter, 2)
    for rank in range(2):
        assert results.stdout[rank] == (
            f"[Gloo] Rank {rank} is connected to 0 peer ranks. Expected number of connected peer "
            f"ranks is : 1\nmine {rank}\n")
    out = capsys.readouterr().out
    assert "connected to 1 peer ranks" not in out
    assert out.count("connected to 0 peer ranks") == 2 and "[rank 1] mine 1" in out


def print_then_fail(rank: int, world_size: int) -> int:
    print(f"rank {rank} got this far")
    if rank == 1:
        raise RuntimeError("failed after printing")
    return rank


def test_prints_before_a_failure_are_echoed(capsys):
    """Promise 10: what a failing rank printed before it raised is still shown."""
    with pytest.raises(RankError) as info:
        launch(print_then_fail, 2, echo=True)
    assert info.value.rank == 1
    out = capsys.readouterr().out
    assert "[rank 0] rank 0 got this far\n[rank 1] rank 1 got this far\n" in out


# --- 11. the simple cases -------------------------------------------------------------------


def test_world_size_one():
    """Promise 11: a single rank works, collectives included."""
    assert launch(group_facts, 1, backend="gloo", echo=False) == [(True, 0, 1, 0, 1.0)]


def test_explicit_gloo_backend():
    """Promise 11: backend="gloo" is accepted and used."""
    results = launch(group_facts, 2, backend="gloo", echo=False)
    assert results.backend is Backend.GLOO
    assert [r[-1] for r in results] == [3.0, 3.0]


def test_results_compare_equal_to_a_plain_list():
    """Promise 11: RankResults is a plain list of the values, in rank order."""
    results = launch(lambda rank, world_size: rank * rank, 3, echo=False)
    assert results == [0, 1, 4] and [0, 1, 4] == results
    assert list(results) == [0, 1, 4]


# --- 8. shutdown (last: every later launch would restart the forkserver) --------------------


def test_shutdown_stops_the_forkserver(procs):
    """Promise 8: after shutdown no forkserver and no rank is left; the next launch restarts
    the forkserver."""
    launch(return_rank, 2, echo=False)
    forkserver = procs.forkserver_pid()
    assert forkserver is not None and procs.running(forkserver)
    labs.shutdown()
    assert procs.wait_gone([forkserver], within=2.0) == []
    left = procs.leftovers(within=2.0)
    assert not left, left
    assert launch(return_rank, 2, echo=False) == [0, 1]


def test_shutdown_leaves_no_process_at_all(procs):
    """Promise 8: after shutdown nothing at all runs under this process."""
    launch(return_rank, 2, echo=False)
    labs.shutdown()
    deadline = time.monotonic() + 2.0
    while (left := procs.descendants()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left


def test_the_forkserver_start_does_not_count_against_the_timeout():
    """Promise 6: the timeout is the ranks' own. The first launch after shutdown starts the
    forkserver, which imports torch (two seconds here, more with a CUDA build); that time is
    not the ranks' and must not turn into a LaunchTimeout (it did, failing exercise checks
    with a 10-second timeout on a GPU box)."""
    labs.shutdown()
    timeout = 0.5
    # device="cpu": a rank's own CUDA start (seconds on a GPU box) does count, and is not
    # what this test is about
    results = launch(return_rank, 1, timeout=timeout, echo=False, device="cpu")
    assert results == [0]
    assert results.seconds > timeout  # the cold start itself took longer than the timeout


@pytest.mark.slow  # make test's budget (7 s)
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """Each rank imports the main script first: a module-level launch() would launch again
    from inside every rank. The ranks say why they stopped, and the parent says what to do."""
    script = tmp_path / "no_guard.py"
    script.write_text("from labs import launch\n\n\ndef worker(rank, world_size):\n"
                      "    return rank\n\n\nlaunch(worker, 2, echo=False)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(labs.__file__).parents[1])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode != 0
    assert "RuntimeError: launch() was called while a rank process was importing the main " \
           "script" in done.stderr, done.stderr
    assert 'put the call under `if __name__ == "__main__":`' in done.stderr, done.stderr
