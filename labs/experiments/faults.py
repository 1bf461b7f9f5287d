"""Chapter 9: jobs that go wrong, on real ranks.

**A rank dies** (:func:`measure_death`). Every rank but one all-reduces in a loop, on a
process group whose timeout is ``group_timeout_s``; the victim, after ``after_s`` seconds,
either is killed (SIGKILL: its process and its sockets are gone) or stops (SIGSTOP: alive,
its sockets open, answering nothing, as a machine that hangs). Each survivor reports what its
collective raised and how long after the victim's moment, as a :class:`PeerLost`; the
launcher reports the whole as one :class:`labs.rank_errors.RankError`, which the run keeps.

**A desynchronized collective** (:func:`run_desync`). A step all-reduces a gradient, then a loss;
rank 1 gets it wrong in one of :data:`DESYNC_KINDS` ways: it skips the gradient's all-reduce,
issues the two in the other order, or all-reduces a gradient of another shape. Each rank keeps
a log of what it issued (a :class:`Recorder`, a flight recorder of one step) and reports how
its step ended: sums right, sums wrong, or the error it got. One of :data:`WATCHERS` looks
on: nobody, torch's own checks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which wraps the group in a
``ProcessGroupWrapper``: before every collective a ``monitored_barrier`` and a comparison of
each rank's op, shapes and dtypes), or labs' ``launch(..., check_collectives=True)``.
:func:`first_desync` reads the logs after the job.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from labs.collective_check import CollectiveCall
from labs.collectives import ring_all_reduce
from labs.ddp import DDP
from labs.launcher import launch
from labs.models import StepSettings, mlp
from labs.rank_errors import LaunchTimeout, RankError
from labs.tables import format_table

#: How a victim goes: its process killed, or stopped and left alive.
HOW = ("killed", "stopped")
#: The all-reduce the survivors run: torch's (gloo's own) or labs' ring (send/recv).
COLLECTIVES = ("torch", "ring")


class PeerLost(RuntimeError):
    """What a surviving rank raises once its collective fails: the error it got and when."""


@dataclass(frozen=True)
class DeathSettings:
    """One failure: ``victim`` is ``how`` (killed or stopped) ``after_s`` seconds into a loop of
    all-reduces of ``numel`` floats with ``collective``, on a group whose timeout is
    ``group_timeout_s``."""

    world_size: int = 3
    victim: int = 1
    after_s: float = 0.5
    how: str = "killed"
    collective: str = "torch"
    group_timeout_s: float = 3.0
    numel: int = 1 << 16

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) \
                or self.world_size < 2:
            raise ValueError(f"world_size must be an int >= 2 (a survivor and a victim), got "
                             f"{self.world_size!r}.")
        if not (isinstance(self.victim, int) and 0 <= self.victim < self.world_size):
            raise ValueError(f"victim must be a rank, 0 to {self.world_size - 1}, got "
                             f"{self.victim!r}.")
        if self.how not in HOW:
            raise ValueError(f"how must be one of {HOW}, got {self.how!r}.")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got "
                             f"{self.collective!r}.")
        if not (self.after_s >= 0 and self.group_timeout_s > 0 and self.numel >= 1):
            raise ValueError("after_s must be >= 0, group_timeout_s > 0 and numel >= 1.")


def death_worker(rank: int, world_size: int, config: DeathSettings) -> None:
    """All-reduce until something fails; the victim all-reduces too until ``after_s``
    seconds have passed, then goes between two of them (its peers are then in the next)."""
    group = dist.new_group(timeout=timedelta(seconds=config.group_timeout_s))
    x = torch.ones(config.numel)
    dist.barrier(group=group)
    moment = time.time() + config.after_s
    calls = 0
    try:
        while True:
            if rank == config.victim and time.time() >= moment:
                moment = time.time()
                os.kill(os.getpid(), signal.SIGKILL if config.how == "killed"
                        else signal.SIGSTOP)
                time.sleep(3600)  # not reached: a killed rank is gone, a stopped one stopped
            if config.collective == "torch":
                dist.all_reduce(x, group=group)
            else:
                ring_all_reduce(x, group=group)
            x.fill_(1.0)
            calls += 1
    except Exception as err:  # noqa: BLE001 - whatever the transport raises is the lesson
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise PeerLost(f"rank {rank} got {type(err).__name__} {time.time() - moment:.3f} s "
                       f"after rank {config.victim} was {config.how} (after {calls} "
                       f"all-reduces): {first[:200]}") from err


@dataclass(frozen=True)
class DeathRow:
    """What one failure looked like from outside."""

    config: DeathSettings
    named_rank: int
    """The rank launch's RankError names."""
    named_type: str
    detected_s: tuple[float, ...]
    """Each survivor's seconds from the victim's moment to its collective's error."""
    errors: tuple[str, ...]
    """What each survivor's collective raised (its type)."""
    report: str
    """The first lines of the RankError, as a notebook shows them."""
    launch_s: float
    """From the victim's moment to launch() raising."""


_DETECTED = re.compile(r"rank (\d+) got (\w+) (-?[0-9.]+) s after")


def measure_death(config: DeathSettings, timeout: float = 60.0) -> DeathRow:
    """Run one failure and read what launch reported."""
    started = time.time()
    try:
        launch(death_worker, config.world_size, args=(config,), backend="gloo", device="cpu",
               timeout=timeout, echo=False, failure_grace=1.0)
    except RankError as err:
        failures = [err.failure, *err.secondary]
        seen = sorted((int(m.group(1)), m.group(2), float(m.group(3)))
                      for f in failures if (m := _DETECTED.search(f.message)))
        return DeathRow(config, err.rank, err.exc_type, tuple(s for _, _, s in seen),
                        tuple(e for _, e, _ in seen), "\n".join(str(err).splitlines()[:3]),
                        time.time() - started - config.after_s)
    except LaunchTimeout as err:
        raise RuntimeError(f"no rank noticed the failure within {timeout} s: {err}") from err
    raise RuntimeError("the job ended without an error: the victim did not go.")


def death_table(rows: Sequence[DeathRow]) -> str:
    """Each failure: when the survivors saw it, against the group's timeout, and what launch
    named."""
    return format_table(
        ["victim", "all-reduce", "survivors saw it after (s)", "group timeout (s)",
         "launch named", "launch raised after (s)"],
        [[r.config.how, r.config.collective, ", ".join(f"{s:.3f}" for s in r.detected_s),
          f"{r.config.group_timeout_s:g}", f"rank {r.named_rank} {r.named_type}",
          f"{r.launch_s:.2f}"] for r in rows])


# --- desynchronized collectives -------------------------------------------------------------

#: What :func:`first_desync` returns where the logs differ: the sequence number, then each
#: distinct entry at it (None: the log had ended) with the ranks whose log holds it.
Desync = tuple[int, dict[CollectiveCall | None, tuple[int, ...]]]


def first_desync(logs: Sequence[Sequence[CollectiveCall]]) -> Desync | None:
    """The first collective at which the ranks' logs differ, read after the job: ``logs[r]``
    holds what rank ``r`` issued on one group, in order (the k-th entry has ``seq`` k).

    Two ranks agree on collective k when their k-th entries are equal (operation, shape,
    dtype, root and call site); a log that has ended has None there. Returns None when every
    log is the same, else ``(k, sides)``: ``sides`` maps each distinct k-th entry to the ranks
    that hold it, ascending. Cost: one pass over the entries, O(N x length)."""
    longest = max((len(log) for log in logs), default=0)
    for index in range(longest):
        sides: dict[CollectiveCall | None, list[int]] = {}
        for rank, log in enumerate(logs):
            sides.setdefault(log[index] if index < len(log) else None, []).append(rank)
        if len(sides) > 1:
            return index + 1, {call: tuple(ranks) for call, ranks in sides.items()}
    return None


#: How rank 1 breaks the step's promise: it skips the gradient's all-reduce, issues the
#: loss's first, or all-reduces a gradient of 5 elements instead of 4.
DESYNC_KINDS = ("skip", "swap", "shape")
#: Who looks on: nobody, torch's TORCH_DISTRIBUTED_DEBUG=DETAIL (set for the step's group), or
#: labs' check_collectives=True.
WATCHERS = ("none", "detail", "labs")


class Recorder:
    """A rank's log of the collectives it issues on ``group`` (a flight recorder): each
    entry a :class:`~labs.collective_check.CollectiveCall` naming the line that issued it."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.log: list[CollectiveCall] = []

    def all_reduce(self, tensor: torch.Tensor) -> None:
        __tracebackhide__ = True  # noqa: F841 - labs' check names our caller's line, not ours
        frame = traceback.extract_stack(limit=2)[0]
        where = f'File "{os.path.basename(frame.filename)}", line {frame.lineno}, in ' \
                f"{frame.name}\n    {frame.line}"
        self.log.append(CollectiveCall(len(self.log) + 1, "all_reduce", tuple(tensor.shape),
                                       str(tensor.dtype).removeprefix("torch."), None, where))
        dist.all_reduce(tensor, group=self.group)


def desync_step(recorder: Recorder, rank: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's two all-reduces, the gradient's then the loss's, with rank 1 breaking the
    promise as ``kind`` says. Rank r holds a gradient of r + 1 and a loss of 10 (r + 1)."""
    grad = torch.full((4,), float(rank + 1))
    loss = torch.full((4,), 10.0 * (rank + 1))
    if rank == 1 and kind == "swap":
        recorder.all_reduce(loss)
        recorder.all_reduce(grad)
        return grad, loss
    if rank == 1 and kind == "shape":
        grad = torch.full((5,), float(rank + 1))
    if not (rank == 1 and kind == "skip"):
        recorder.all_reduce(grad)
    recorder.all_reduce(loss)
    return grad, loss


@dataclass(frozen=True)
class StepOutcome:
    """How one rank's step ended."""

    rank: int
    log: tuple[CollectiveCall, ...]
    sums_right: bool | None
    """Whether both sums were right (None: the step raised)."""
    error: str
    """The error's type and message ('' when the step returned)."""
    seconds: float


def desync_worker(rank: int, world_size: int, kind: str, watcher: str,
                  group_timeout_s: float) -> StepOutcome:
    """One step of :func:`desync_step` on a group of its own, its outcome kept, not raised."""
    if watcher == "detail":  # what TORCH_DISTRIBUTED_DEBUG=DETAIL sets, for the group below
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group(timeout=timedelta(seconds=group_timeout_s))
    recorder = Recorder(group)
    started = time.perf_counter()
    try:
        grad, loss = desync_step(recorder, rank, kind)
    except Exception as err:  # noqa: BLE001 - what the step raised is the lesson
        return StepOutcome(rank, tuple(recorder.log), None,
                           f"{type(err).__name__}: {str(err).strip()[:2000]}",
                           time.perf_counter() - started)
    total = world_size * (world_size + 1) / 2
    right = grad.numel() == 4 and bool((grad == total).all() and (loss == 10 * total).all())
    return StepOutcome(rank, tuple(recorder.log), right, "", time.perf_counter() - started)


@dataclass(frozen=True)
class DesyncRow:
    """One kind of desync under one watcher."""

    kind: str
    watcher: str
    outcomes: tuple[StepOutcome, ...]
    """Every rank's, when the job ended without a crash."""
    crash: str
    """When a rank's process died (gloo aborts on some mismatches): launch's first line and
    what the transport wrote last ('' otherwise)."""

    def seen(self, rank: int) -> str:
        """How rank ``rank``'s step ended, in a few words."""
        if self.crash:
            return "aborted" if f"rank {rank} " in self.crash.splitlines()[0] else "-"
        outcome = self.outcomes[rank]
        if not outcome.error:
            return "right sums" if outcome.sums_right else "wrong sums, no error"
        error = outcome.error.splitlines()[0]
        for needle, words in _SAID:
            if needle in error:
                return words
        if error.startswith("CollectiveMismatch"):
            return f"CollectiveMismatch at {error.split()[2]}"
        return error.split(":")[0]

    @property
    def seconds(self) -> float | None:
        """When the slowest rank's step ended (None after a crash)."""
        return max(o.seconds for o in self.outcomes) if self.outcomes else None


#: What a rank's error says, in a few words.
_SAID = (("Timed out waiting", "gloo timed out"),
         ("failed to pass monitoredBarrier", "monitored_barrier: rank 1 missing"),
         ("Detected mismatch between collectives", "fingerprints differ"))


def run_desync(kind: str, watcher: str, world_size: int = 2, group_timeout_s: float = 2.0,
               timeout: float = 60.0) -> DesyncRow:
    """One step of ``kind`` under ``watcher`` on ``world_size`` ranks."""
    if kind not in DESYNC_KINDS or watcher not in WATCHERS:
        raise ValueError(f"kind must be one of {DESYNC_KINDS} and watcher one of {WATCHERS}, "
                         f"got {kind!r} and {watcher!r}.")
    try:
        outcomes = launch(desync_worker, world_size, args=(kind, watcher, group_timeout_s),
                          backend="gloo", device="cpu", timeout=timeout, echo=False,
                          check_collectives=watcher == "labs")
    except RankError as err:
        said = [line.strip() for line in str(err).splitlines() if "mismatch" in line]
        crash = str(err).splitlines()[0] + (f"\n  {said[0]}" if said else "")
        return DesyncRow(kind, watcher, (), crash)
    return DesyncRow(kind, watcher, tuple(outcomes), "")


def desync_table(rows: Sequence[DesyncRow]) -> str:
    """Each kind under each watcher: how every rank's step ended, and when."""
    names = {"none": "nobody", "detail": "DETAIL", "labs": "check_collectives"}
    width = max(len(r.outcomes) for r in rows) if rows else 2
    return format_table(
        ["rank 1", "watcher", *(f"rank {k}" for k in range(width)), "ended after (s)"],
        [[r.kind, names[r.watcher], *(r.seen(k) for k in range(width)),
          "" if r.seconds is None else f"{r.seconds:.2f}"] for r in rows])


# --- what watching costs ----------------------------------------------------------------------

#: The all-reduces :func:`checking_cost` times (bytes).
COST_SIZES = (4 << 10, 1 << 20)


#: Blocks of back-to-back calls :func:`cost_worker` times of each thing under each watcher.
COST_BLOCKS = 7


def cost_worker(rank: int, world_size: int, repeats: int, settings: StepSettings
                ) -> dict[str, list[list[float]]]:
    """Seconds per call, under each of :data:`WATCHERS`, of an all-reduce of each of
    :data:`COST_SIZES` and of one step of chapter 5's MLP under labs' DDP, in a launch with
    ``check_collectives=True``, all three watchers in these same processes: "none" calls
    torch's unchecked function (the one labs' check wraps) on a plain group, "detail" the
    same on a group made under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch wraps the groups made
    after it is set), "labs" the checked function on the plain group. The watchers take turns
    block by block (``repeats`` all-reduces, or ``settings.steps`` steps, back to back), so a
    slow moment of the machine or of the transport falls on each alike. Returns, per watcher
    and thing timed, the :data:`COST_BLOCKS` blocks' seconds per call."""
    plain = dist.new_group()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    detailed = dist.new_group()  # wrapped: a barrier and a fingerprint before each collective
    checked = dist.all_reduce
    unchecked = getattr(checked, "__wrapped__", checked)
    groups = {"none": plain, "detail": detailed, "labs": plain}
    sources = {"none": unchecked, "detail": unchecked, "labs": checked}
    models = {w: DDP(mlp(settings), settings.bucket_cap_mb, process_group=groups[w])
              for w in WATCHERS}
    optimizers = {w: torch.optim.SGD(m.parameters(), lr=1e-3) for w, m in models.items()}
    x = torch.randn(settings.batch, settings.width, generator=torch.Generator().manual_seed(rank))

    def step(watcher: str) -> None:
        models[watcher](x).square().mean().backward()
        models[watcher].finish_gradient_synchronization()
        optimizers[watcher].step()
        optimizers[watcher].zero_grad(set_to_none=True)

    tensors = [torch.ones(nbytes // 4) for nbytes in COST_SIZES]
    calls = [(lambda w, t=t: sources[w](t, group=groups[w]), repeats) for t in tensors]
    calls.append((step, settings.steps))
    blocks: dict[str, list[list[float]]] = {w: [[] for _ in calls] for w in WATCHERS}
    try:
        for block in range(1 + COST_BLOCKS):  # block 0 warms every path up, untimed
            for i, (call, count) in enumerate(calls):
                for watcher in WATCHERS:
                    dist.all_reduce = sources[watcher]  # what labs' DDP calls, this block
                    unchecked(torch.zeros(1), group=plain)  # the ranks start the block together
                    start = time.perf_counter()
                    for _ in range(count):
                        call(watcher)
                    if block:
                        blocks[watcher][i].append((time.perf_counter() - start) / count)
    finally:
        dist.all_reduce = checked
    return blocks


@dataclass(frozen=True)
class CostRow:
    """One thing timed, under each watcher: the slower rank's seconds per call in each block
    (:func:`checking_cost`)."""

    what: str
    blocks: dict[str, tuple[float, ...]]

    @property
    def seconds(self) -> dict[str, float]:
        """Per watcher, the fastest block's seconds per call: the least disturbed (a slow
        moment of the machine can only add time)."""
        return {w: min(b) for w, b in self.blocks.items()}

    def spread(self, watcher: str) -> float:
        """How much slower than the fastest the median block was (seconds per call): what
        the machine's moments add, against which a watcher's cost is read."""
        return statistics.median(self.blocks[watcher]) - min(self.blocks[watcher])

    def adds(self, watcher: str) -> float:
        """What ``watcher`` adds to the unchecked call, fastest block against fastest."""
        return self.seconds[watcher] - self.seconds["none"]


def checking_cost(world_size: int = 2, repeats: int = 20,
                  settings: StepSettings = StepSettings(steps=10)) -> list[CostRow]:
    """What each watcher adds to an all-reduce and to chapter 5's DDP step (gloo): one launch
    in which the three take turns (:func:`cost_worker`); each figure is the slower rank's."""
    if world_size < 2 or repeats < 1:
        raise ValueError("world_size must be >= 2 and repeats >= 1.")
    per_rank = launch(cost_worker, world_size, args=(repeats, settings), backend="gloo",
                      device="cpu", echo=False, timeout=300, check_collectives=True)
    names = [f"all_reduce of {n >> 10} KiB" for n in COST_SIZES] + [
        f"chapter 5's DDP step (MLP {settings.layers} x {settings.width})"]
    return [CostRow(name, {w: tuple(max(r[w][i][b] for r in per_rank)
                                    for b in range(COST_BLOCKS)) for w in WATCHERS})
            for i, name in enumerate(names)]


def cost_table(rows: Sequence[CostRow]) -> str:
    """Each thing timed: unchecked, under DETAIL, under check_collectives, the fastest block
    and the median block (µs per call), and what each watcher adds (fastest against
    fastest)."""
    def us(row: CostRow, watcher: str) -> str:
        return (f"{row.seconds[watcher] * 1e6:.0f} / "
                f"{statistics.median(row.blocks[watcher]) * 1e6:.0f}")

    return format_table(
        ["µs per call (fastest / median block)", "unchecked", "DETAIL", "check_collectives",
         "DETAIL adds", "check_collectives adds"],
        [[r.what, us(r, "none"), us(r, "detail"), us(r, "labs"),
          f"{r.adds('detail') * 1e6:+.0f}", f"{r.adds('labs') * 1e6:+.0f}"] for r in rows])


def cost_verdicts(rows: Sequence[CostRow]) -> list[str]:
    """For each thing timed and each watcher, in words: what it adds, and whether that is
    more than the unchecked blocks' own spread (below it, the run cannot tell the cost from
    the machine's moments)."""
    names = {"detail": "DETAIL", "labs": "check_collectives"}
    return [f"{r.what}: {names[w]} adds {r.adds(w) * 1e6:+.0f} µs, "
            f"{'more' if r.adds(w) > r.spread('none') else 'not more'} than the unchecked "
            f"blocks' spread ({r.spread('none') * 1e6:.0f} µs)"
            for r in rows for w in ("detail", "labs")]
