"""Run ``fn(rank, world_size, *args)`` on N real torch.distributed ranks and collect the results.

``launch`` is what every notebook of the course calls. It owns everything about processes:
starting the ranks, their environment and process group, per-rank threads, a fresh
rendezvous port, timeouts, captured output, and cleaning up after any fault.

How the ranks are started (see ``python -m labs.bench launch`` for the numbers):

* ``fork`` is unsafe from a notebook kernel: a child forked after the kernel ran a
  multithreaded torch op can spin forever in OpenMP, and fork cannot be used at all once
  CUDA is initialised.
* ``spawn`` is safe but starts a fresh interpreter per rank that imports torch again
  (over a second per rank on 2 cores), and it cannot find a function defined in a
  notebook cell, because the child re-imports ``__main__`` by name.
* So ranks are forked from a **forkserver**: a single-threaded helper process, started once
  per kernel, that has imported torch and this module but never ran a torch op or touched
  CUDA. Forking from it is cheap and safe from CPU and GPU kernels alike. The function and
  its arguments travel **by value** (cloudpickle, :mod:`labs.rank_pickle`) to the importable
  entry point :func:`_rank_main`, so functions defined in notebook cells work. The helper
  stays alive (idle, with no children) between launches; :func:`shutdown` stops it.

The ranks meet through a ``FileStore`` in the launch's own temporary directory: no fixed
port, so two launches at once never collide and re-running a cell never meets "address
already in use" (gloo's own connections use ports the OS assigns). A ``TCPStore`` hosted by
the caller was measured first: its server looks up the host name of every rank that connects
(a reverse DNS query for 127.0.0.1), and where the resolver drops a query a launch stalled
for 5 s, about one launch in ten here.

What a learner sees when ranks fail or hang, :class:`RankError` and :class:`LaunchTimeout`
with the first failing rank named and the notebook's cells named as IPython names them, is
built in :mod:`labs.rank_errors`. The same workers run under torchrun with
:func:`labs.torchrun.run_torchrun`. What ``launch`` accepts (refused before any process
starts) and the backend it picks are in :mod:`labs.launch_inputs`; what it hands back
(:class:`RankResults`, how a launch ended, the ranks' output) in :mod:`labs.rank_results`.
"""

from __future__ import annotations

import dataclasses
import enum
import faulthandler
import math
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labs import collective_check, plain_results
from labs import link as emulated
from labs.collective_check import check_mode
from labs.launch_inputs import (
    DEVICE_VARIABLE,
    MAX_WORLD_SIZE,
    Backend,
    Device,
    Placement,
    check_inputs,
    check_rank_args,
    choose_placement,
    cpu_cores,
    enter,
    pick_backend,
    pick_placement,
    threads_per_rank,
)
from labs.link import Link, Topology
from labs.rank_errors import (
    MAIN_GUARD,
    LaunchTimeout,
    RankError,
    RankFailure,
    died,
    first_failure,
    name_cells,
    stuck_stack,
)
from labs.rank_pickle import pack_call, pack_result, unpack_call, unpack_result
from labs.rank_results import (
    GLOO_CONNECTED,
    Done,
    Failed,
    RankResults,
    TimedOut,
    echo_output,
    plain_failure,
    read_output,
    written_bytes,
)

__all__ = [
    "MAX_WORLD_SIZE",
    "Backend",
    "Device",
    "LaunchTimeout",
    "RankError",
    "RankFailure",
    "RankResults",
    "Placement",
    "StartMethod",
    "choose_placement",
    "cpu_cores",
    "launch",
    "pick_backend",
    "pick_placement",
    "rank_device",
    "shutdown",
]

#: How long to wait for near-simultaneous failures before naming the first one.
_FAILURE_GRACE_S = 0.3
#: How long a rank gets to exit after SIGTERM before SIGKILL.
_KILL_GRACE_S = 1.0
#: How long the ranks have to start and meet, from when they exist (on a busy machine seconds
#: that are no fault of the worker's); their ``timeout`` starts once all have joined the group.
STARTUP_TIMEOUT_S = 120.0
#: How much longer the default group's timeout is than ``timeout``: a hang is ended by the
#: launcher (stacks dumped), not by gloo, even when a busy launcher hears late of the joins.
GROUP_TIMEOUT_MARGIN_S = 60.0
#: What a rank sends first, once it has joined its process group (a report is never empty).
_JOINED = b""
#: Modules the forkserver imports once, so that forked ranks start with torch loaded.
#: torch._dynamo: building the first torch.optim optimizer imports it (torch.optim wraps its
#: methods with dynamo's "disable"), about 1.3 s per rank per launch on 2 cores; preloaded, a
#: later launch that builds an optimizer takes 0.07 s instead of 1.4 s. It starts no thread,
#: so forking after it stays safe. labs.launcher brings labs.rank_pickle along, which every
#: rank needs to unpickle its function.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "labs.launcher"]


class StartMethod(enum.Enum):
    """How rank processes are created (see the module docstring for why)."""

    FORKSERVER = "forkserver"  #: Fork from a helper that preloaded torch (the default).
    SPAWN = "spawn"  #: A fresh interpreter per rank; slower, kept for comparison.


@dataclass(frozen=True)
class _RankSpec:
    """Everything a rank needs to join the group; pickled to the child with the start call."""

    rank: int
    world_size: int
    placement: Placement
    threads: int
    timeout_s: float
    store_path: str  #: the FileStore every rank of this launch meets in
    stdout_path: str
    stderr_path: str
    stack_path: str  #: where faulthandler writes the stack when the launcher asks (timeout)
    link: Link | Topology | None = None  #: the emulated wire of labs' point-to-point messages
    plain: bool = False  #: report as plain data (labs.plain_results), not as a pickle
    check: bool | str = False  #: check its collectives (labs.collective_check)
    host_staging: bool = False  #: stage every message through host memory (labs.staging)


def launch(
    fn: Callable[..., Any],
    world_size: int = 4,
    *,
    args: Sequence[Any] = (),
    backend: str = "auto",
    device: str = "auto",
    host_staging: bool = False,
    timeout: float = 60.0,
    echo: bool = True,
    threads: int | None = None,
    start_method: StartMethod = StartMethod.FORKSERVER,
    failure_grace: float = _FAILURE_GRACE_S,
    link: Link | Topology | None = None,
    result_types: Sequence[type] | None = None,
    rank_args: Sequence[Sequence[Any]] | None = None,
    count_writes: bool = False,
    check_collectives: bool | str = False,
) -> RankResults:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes and return the results.

    Each process runs inside an initialised default process group (``dist.all_reduce`` and
    friends just work). ``fn`` may be defined in a notebook cell. Return values come back in
    rank order; tensors come back on the CPU.

    Args:
        fn: the worker, called as ``fn(rank, world_size, *args)`` in every rank.
        world_size: number of ranks, 1..MAX_WORLD_SIZE.
        args: extra positional arguments, sent by value to every rank.
        count_writes: count the bytes each rank writes, by the kernel's count
            (``results.written``; needs ``result_types``).
        rank_args: one tuple per rank, appended to ``args`` for that rank only:
            ``fn(rank, world_size, *args, *rank_args[rank])``. What one rank must not see of
            another's (an exercise check's hidden inputs) goes here.
        backend: ``"auto"`` (nccl when there is one GPU per rank and no ``link``, gloo
            otherwise), ``"gloo"`` or ``"nccl"``. Under nccl, rank k uses ``cuda:k``.
        device: ``"auto"`` (the GPUs when there is one, else the CPU), ``"cpu"`` or
            ``"cuda"``: where :func:`rank_device` puts a rank's tensors. Ranks on gloo with
            fewer GPUs than ranks share them (rank k on ``cuda:(k % GPUs)``): gloo's
            collectives carry CUDA tensors, and labs' point-to-point messages and FSDP's
            collectives go through pinned host buffers (:mod:`labs.staging`).
            ``results.placement.describe()`` says what was chosen.
        host_staging: stage every message through host memory even for CPU tensors: the
            one-GPU mode's path, run where there is no GPU (the parity tests use it).
        timeout: seconds the ranks may run, counted once all of them have joined the process
            group (they have :data:`STARTUP_TIMEOUT_S` to start and join); then those still
            running are killed and LaunchTimeout is raised (the group's own timeout is longer).
        echo: print what each rank printed, prefixed ``[rank k]``, after the ranks finish.
        threads: each rank's intra-op threads (``torch.set_num_threads``, OMP_NUM_THREADS).
            Default: the machine's cores divided by ``world_size``, at least 1, so that N ranks
            computing at once do not oversubscribe the cores.
        start_method: how rank processes are created; keep the default.
        link: an emulated network (:class:`labs.link.Link`, or a
            :class:`labs.link.Topology` of nodes, whose ``node_size`` must divide
            ``world_size``) for the messages of labs' point-to-point layer; None (default)
            sends them over the real transport.
        check_collectives: True checks, before each collective, that every rank of its
            group issues the same one (operation, shape, dtype, root, call site) as the same
            numbered collective of that group, and raises :class:`RankError` naming the
            collective, what each rank issued and where, before any rank enters it
            (:mod:`labs.collective_check`); ``"shapes"`` leaves out the call sites.
        failure_grace: seconds to wait, once a rank has failed, for the others to report
            (or fail) before the rest are stopped. The exercise checks wait longer, so that
            ranks failing the same way on a busy machine are all seen and their verdict
            names the same rank every run.
        result_types: None (default) brings results back by unpickling them. A sequence of
            dataclasses and enums brings them back as plain data instead
            (:mod:`labs.plain_results`): tensors, numbers, strings, lists, tuples, dicts and
            instances of those classes, nothing unpickled, so that ranks running code the
            caller does not trust (an exercise check's) cannot run any in the caller.

    Raises:
        TypeError, ValueError: bad input, before any process starts.
        RankError: a rank raised; names the rank that failed first and carries its traceback.
        LaunchTimeout: ranks still running after ``timeout`` seconds (they are killed).
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(MAIN_GUARD)
    placement = check_inputs(fn, world_size, args, backend, timeout, device,
                             link=link is not None)
    if isinstance(failure_grace, bool) or not isinstance(failure_grace, (int, float)) \
            or not 0 <= failure_grace < math.inf:
        raise ValueError(f"failure_grace must be a number of seconds >= 0, got "
                         f"{failure_grace!r}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be a positive int (or None for cores / world_size), "
                         f"got {threads!r}.")
    if not isinstance(host_staging, bool):
        raise TypeError(f"host_staging must be True or False, got {host_staging!r}.")
    if link is not None and not isinstance(link, (Link, Topology)):
        raise TypeError(f"link must be a labs.Link or labs.Topology (or None), got "
                        f"{type(link).__name__}.")
    if isinstance(link, Topology):
        link.check(world_size)
    if rank_args is not None:
        check_rank_args(rank_args, world_size)
    check = check_mode(check_collectives)
    if count_writes and result_types is None:
        raise ValueError("count_writes needs result_types: the bytes of a plain report are "
                         "known, and taken off what the rank wrote.")
    payloads = [pack_call(fn, tuple(args) + tuple(rank_args[r] if rank_args else ()))
                for r in range(world_size)]
    started = time.monotonic()
    ctx = mp.get_context(start_method.value)
    if start_method is StartMethod.FORKSERVER:
        ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="labs-launch-") as tmp:
        specs = [
            _RankSpec(
                rank=rank, world_size=world_size, placement=placement,
                threads=threads or threads_per_rank(world_size), timeout_s=timeout,
                store_path=str(Path(tmp) / "store"),
                stdout_path=str(Path(tmp) / f"rank{rank}.out"),
                stderr_path=str(Path(tmp) / f"rank{rank}.err"),
                stack_path=str(Path(tmp) / f"rank{rank}.stack"), link=link,
                plain=result_types is not None, check=check, host_staging=host_staging,
            )
            for rank in range(world_size)
        ]
        ranks: list[_Rank] = []
        outcome: Done | Failed | TimedOut | None = None
        try:
            for spec, payload in zip(specs, payloads, strict=True):
                ranks.append(_Rank.start(ctx, payload, spec))
            # The clock starts once every rank has joined its group (_supervise).
            outcome = _supervise(ranks, deadline=time.monotonic() + STARTUP_TIMEOUT_S,
                                 grace=failure_grace, result_types=result_types,
                                 count_writes=count_writes)
        finally:  # also on KeyboardInterrupt (the notebook's stop button)
            _stop(ranks, outcome)
        stdout = [GLOO_CONNECTED.sub("", read_output(spec.stdout_path)) for spec in specs]
        stderr = [read_output(spec.stderr_path) for spec in specs]
        stacks = {r: stuck_stack(read_output(specs[r].stack_path)) for r in range(world_size)}
    if echo:
        echo_output(stdout, stderr)
    if isinstance(outcome, TimedOut):
        found = {r: name_cells(stacks[r]) for r in outcome.ranks if stacks[r]}
        raise LaunchTimeout(outcome.ranks, timeout, found)
    if isinstance(outcome, Failed):
        raise first_failure([dataclasses.replace(f, traceback=name_cells(f.traceback),
                                                 message=name_cells(f.message))
                              for f in outcome.failures])
    results = RankResults(outcome.values[r] if result_types is not None
                          else unpack_result(outcome.values[r]) for r in range(world_size))
    results.stdout, results.stderr = stdout, stderr
    results.backend, results.seconds = placement.backend, time.monotonic() - started
    results.placement = placement
    if outcome.written is not None:
        results.written = [outcome.written[r] for r in range(world_size)]
    return results


def rank_device() -> torch.device:
    """Where this rank's tensors belong: its own GPU under nccl; under gloo the GPU it shares
    with other ranks where the machine has one (the one-GPU mode), else the CPU.

    Call it inside a worker: :func:`launch` and :func:`labs.torchrun.run_torchrun` placed the
    rank (:class:`Placement`) and made its GPU the current device. In a process group labs
    did not start: the current GPU under nccl, else the CPU."""
    if DEVICE_VARIABLE in os.environ:
        return torch.device(os.environ[DEVICE_VARIABLE])
    if dist.is_initialized() and dist.get_backend() == Backend.NCCL.value:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    """Stop the forkserver helper (it is restarted by the next launch).

    Nothing needs this in normal use: the helper is idle between launches and exits with the
    kernel. Tests use it to show that nothing at all is left running.
    """
    multiprocessing.forkserver._forkserver._stop()
    # The forkserver's companion, started with it; also idle, also restarted on demand.
    multiprocessing.resource_tracker._resource_tracker._stop()


# --- the rank side --------------------------------------------------------------------------


def _rank_main(payload: bytes, spec: _RankSpec, conn: Connection) -> None:
    """Entry point of every rank process (importable, so forkserver and spawn can find it).
    :mod:`labs.rank_errors` cuts a rank's stacks at this function's name, and at
    :func:`_watch_launcher`'s and :func:`_join_group`'s."""
    os.setpgrp()  # its own process group, so the launcher can kill it and anything it started
    _redirect_output(spec)
    stack_file = open(spec.stack_path, "w")  # noqa: SIM115 - open for the rank's whole life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # on timeout
    # A crash in C or C++ (SIGABRT from an uncaught exception, SIGSEGV) has no Python
    # traceback; faulthandler writes the Python stack it happened in to stderr, which the
    # launcher shows in the RankError.
    faulthandler.enable(file=sys.stderr, all_threads=False)
    released = threading.Event()
    threading.Thread(target=_watch_launcher, args=(conn, released), daemon=True).start()
    try:
        torch.set_num_threads(spec.threads)
        fn, args = unpack_call(payload)
        emulated.use(spec.link, spec.rank)
        _join_group(spec)
        conn.send_bytes(_JOINED)  # the launcher's clock for this rank starts now
        if spec.check:
            collective_check.install(spec.rank, spec.check)
        value = fn(spec.rank, spec.world_size, *args)
        collective_check.finish()
        message: tuple[str, Any] = ("ok", plain_results.encode(("ok", value)) if spec.plain
                                    else pack_result(value))
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit too, goes back
        message = ("error", _failure(spec.rank, exc))
    sys.stdout.flush()
    sys.stderr.flush()
    if spec.plain:
        conn.send_bytes(message[1] if message[0] == "ok" else plain_results.encode(
            ("error", dataclasses.asdict(message[1]))))
    else:
        conn.send_bytes(ForkingPickler.dumps(message))
    if message[0] == "ok":
        # Stay in the group until every rank has returned: a rank that left early would make
        # a peer still inside a collective fail, hiding the real problem (a hang).
        released.wait()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()


def _join_group(spec: _RankSpec) -> None:
    env = {
        "RANK": spec.rank, "LOCAL_RANK": spec.rank, "WORLD_SIZE": spec.world_size,
        "LOCAL_WORLD_SIZE": spec.world_size, "OMP_NUM_THREADS": spec.threads,
    }
    # For code written for torchrun: the same variables it would set.
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    enter(spec.placement, spec.rank, host_staging=spec.host_staging)
    store = dist.FileStore(spec.store_path, spec.world_size)
    # Meet the other ranks first, with the start-up's own limit: gloo's rendezvous waits only
    # the group's timeout, which a rank that starts late on a busy machine could outlast.
    store.set_timeout(timedelta(seconds=STARTUP_TIMEOUT_S))
    if store.add("labs/started", 1) == spec.world_size:
        store.set("labs/all started", "1")
    store.wait(["labs/all started"])
    group_timeout = timedelta(seconds=spec.timeout_s + GROUP_TIMEOUT_MARGIN_S)
    store.set_timeout(group_timeout)
    dist.init_process_group(
        spec.placement.backend.value, store=store, rank=spec.rank, world_size=spec.world_size,
        timeout=group_timeout,
    )


def _loopback_interface() -> str:
    # Single-machine ranks talk over loopback; without this gloo resolves the hostname,
    # which fails in some containers and laptops on odd networks.
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), names[0] if names else "lo")


def _redirect_output(spec: _RankSpec) -> None:
    """Send fd 1 and 2 (Python prints and C++ logs alike) to per-rank files the launcher reads."""
    for fd, path in ((1, spec.stdout_path), (2, spec.stderr_path)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the rank
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _watch_launcher(conn: Connection, released: threading.Event) -> None:
    """Wait for the launcher's go-ahead; if the launcher dies, end this rank at once."""
    try:
        conn.recv()
        released.set()
    except (EOFError, OSError):
        os._exit(3)  # the notebook kernel is gone: never leave an orphan rank behind


def _failure(rank: int, exc: BaseException) -> RankFailure:
    # Drop the launcher's own frame: the traceback starts in the learner's code.
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return RankFailure(
        rank=rank, exc_type=type(exc).__name__, message=str(exc), traceback=text,
        when=time.time(),
    )


# --- the launcher side ----------------------------------------------------------------------


@dataclass
class _Rank:
    spec: _RankSpec
    process: Any  # multiprocessing.Process of the chosen context
    conn: Connection
    report_bytes: int = 0  #: what its plain report took on the pipe (with its 4-byte length)

    @classmethod
    def start(cls, ctx: Any, payload: bytes, spec: _RankSpec) -> _Rank:
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=_rank_main, args=(payload, spec, theirs), name=f"rank{spec.rank}", daemon=False
        )
        process.start()
        theirs.close()
        return cls(spec, process, ours)


def _supervise(ranks: list[_Rank], deadline: float, grace: float,
               result_types: Sequence[type] | None = None, count_writes: bool = False
               ) -> Done | Failed | TimedOut:
    """Wait for every rank's report; stop ``grace`` seconds after the first failure (or
    once every rank has reported), or at the deadline: ``deadline`` until every rank has
    joined its group, then that moment plus ``spec.timeout_s``. With ``count_writes``, read
    what each rank wrote once all have reported and before any is released."""
    values: dict[int, Any] = {}
    failures: list[RankFailure] = []
    pending = {r.spec.rank: r for r in ranks}
    joined: set[int] = set()
    give_up_at = deadline
    while pending and time.monotonic() < give_up_at:
        waitables: list[Any] = [r.conn for r in pending.values()]
        waitables += [r.process.sentinel for r in pending.values()]
        ready = set(wait(waitables, timeout=max(0.0, give_up_at - time.monotonic())))
        for rank, r in list(pending.items()):
            if r.conn in ready or (r.process.sentinel in ready and r.conn.poll()):
                kind, body = _receive(r, result_types)
                if kind == "joined":
                    joined.add(rank)
                    if len(joined) == len(ranks) and not failures:
                        give_up_at = deadline = time.monotonic() + ranks[0].spec.timeout_s
                    continue
                if kind == "ok":
                    values[rank] = body
                else:
                    failures.append(body)
                del pending[rank]
            elif r.process.sentinel in ready:
                failures.append(_died(r))
                del pending[rank]
        if failures and give_up_at == deadline:
            # Give peers a moment to report, so the failure that came first can be named.
            give_up_at = min(deadline, time.monotonic() + grace)
    if failures:
        return Failed(failures)
    if pending:
        return TimedOut(sorted(pending))
    written = {r.spec.rank: _written(r) for r in ranks} if count_writes else None
    for r in ranks:
        r.conn.send("release")
    return Done(values, written)


def _written(r: _Rank) -> int:
    """What rank ``r`` wrote (:func:`written_bytes`), read while every rank awaits release."""
    return written_bytes(r.process.pid, (r.spec.stdout_path, r.spec.stderr_path),
                         r.report_bytes)


def _receive(r: _Rank, result_types: Sequence[type] | None = None) -> tuple[str, Any]:
    """A rank's next message: ("joined", None), then ("ok", its result: unpickled, or as plain
    data when ``result_types`` is given) or ("error", a RankFailure)."""
    try:
        data = r.conn.recv_bytes(plain_results.MAX_BYTES if result_types is not None
                                 else None)
    except (EOFError, OSError):
        return "error", _died(r)
    if data == _JOINED:
        return "joined", None
    if result_types is None:
        return ForkingPickler.loads(data)
    r.report_bytes = len(data) + 4
    try:
        kind, body = plain_results.decode(data, result_types)
        if kind == "ok":
            return "ok", body
        if kind == "error" and isinstance(body, dict):
            return "error", plain_failure(r.spec.rank, body)
        raise plain_results.NotPlain(f"a report of kind {kind!r}")
    except (plain_results.NotPlain, TypeError, ValueError) as err:
        return "error", RankFailure(
            rank=r.spec.rank, exc_type="UnreadableResult",
            message=f"rank {r.spec.rank} sent a result that is not plain data: {err}",
            traceback="", when=time.time())


def _died(r: _Rank) -> RankFailure:
    r.process.join(timeout=1.0)
    return died(r.spec.rank, r.process.exitcode, read_output(r.spec.stderr_path),
                from_script=bool(getattr(sys.modules.get("__main__"), "__file__", None)))


def _stop(ranks: list[_Rank], outcome: Done | Failed | TimedOut | None) -> None:
    """Make sure no rank outlives the launch: released ranks exit by themselves, the rest are
    killed (SIGTERM, then SIGKILL). On a timeout, hung ranks first dump their stacks."""
    if isinstance(outcome, TimedOut):
        # faulthandler in each hung rank writes its Python stack to its .stack file.
        _signal_all([r for r in ranks if r.spec.rank in outcome.ranks], signal.SIGUSR1)
        time.sleep(0.2)
    if isinstance(outcome, Done):
        _join_all(ranks, time.monotonic() + 5 * _KILL_GRACE_S)  # destroy_process_group, exit
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [r for r in ranks if r.process.is_alive()]
        if not alive:
            break
        _signal_all(alive, sig)
        _join_all(alive, time.monotonic() + _KILL_GRACE_S)
    for r in ranks:
        r.conn.close()


def _join_all(ranks: list[_Rank], deadline: float) -> None:
    for r in ranks:
        r.process.join(timeout=max(0.0, deadline - time.monotonic()))


def _signal_all(ranks: list[_Rank], sig: signal.Signals) -> None:
    for r in ranks:
        pid = r.process.pid
        if pid is None:
            continue
        try:
            os.killpg(pid, sig)  # the rank and anything it started (its own process group)
        except (ProcessLookupError, PermissionError):
            # Not yet its own group leader (killed right after start), or already gone.
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
