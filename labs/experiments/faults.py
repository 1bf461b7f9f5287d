"""Chapter 9: jobs that go wrong, on real ranks.

**A rank dies** (:func:`measure_death`). Every rank but one all-reduces in a loop, on a
process group whose timeout is ``group_timeout_s``; the victim, after ``after_s`` seconds,
either is killed (SIGKILL: its process and its sockets are gone) or stops (SIGSTOP: alive,
its sockets open, answering nothing, as a machine that hangs). Each survivor reports what its
collective raised and how long after the victim's moment, as a :class:`PeerLost`; the
launcher reports the whole as one :class:`labs.rank_errors.RankError`, which the run keeps.

**A straggler** (:func:`measure_stragglers`). N ranks train a small model with labs' DDP; before
each step every rank sleeps a delay drawn from an exponential distribution of mean ``mean_s``
(the draws are known in advance: a generator seeded by step and rank). A step cannot end
before the slowest rank's all-reduce, so each step should last a step without delays plus
the largest of that step's N delays, whose expectation is ``mean_s`` times the harmonic
number H_N = 1 + 1/2 + ... + 1/N: 1.5, 2.08 and 2.72 means at N = 2, 4, 8.
"""

from __future__ import annotations

import math
import os
import re
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from labs.collectives import ring_all_reduce
from labs.ddp import DDP
from labs.launcher import launch
from labs.link import Link
from labs.rank_errors import LaunchTimeout, RankError

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
        launch(death_worker, config.world_size, args=(config,), backend="gloo",
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


# --- stragglers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StragglerSettings:
    """N ranks, ``steps`` timed steps, delays of mean ``mean_s`` before each."""

    mean_s: float = 0.03
    steps: int = 12
    width: int = 64
    batch: int = 16
    link: Link = Link(alpha=2e-4, bandwidth=1e9)
    seed: int = 0

    def delays(self, world_size: int) -> list[list[float]]:
        """``delays[step][rank]``: the seconds each rank sleeps before each step (the first
        row is the untimed step's: zeros)."""
        rows = [[0.0] * world_size]
        for step in range(1, self.steps + 1):
            generator = torch.Generator().manual_seed(self.seed * 100_003 + step)
            draws = torch.empty(world_size).exponential_(1.0, generator=generator)
            rows.append([self.mean_s * float(d) for d in draws])
        return rows


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n: the expected largest of n exponential draws of mean 1."""
    return sum(1.0 / k for k in range(1, n + 1))


def straggler_worker(rank: int, world_size: int, config: StragglerSettings,
                     delayed: bool) -> list[float]:
    """Each timed step on this rank (a barrier first; with ``delayed`` a sleep of this rank's
    delay, then forward, backward, the all-reduces and the optimizer step)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(config.width, config.width), nn.Tanh(),
                              nn.Linear(config.width, config.width)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(config.batch, config.width, generator=torch.Generator().manual_seed(rank))
    delays = config.delays(world_size)
    seconds = []
    for step in range(config.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        if delayed:
            time.sleep(delays[step][rank])
        model(x).square().mean().backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            seconds.append(time.perf_counter() - start)
    return seconds


@dataclass(frozen=True)
class StragglerRow:
    """One world size: steps without and with delays, and what the delays predict."""

    world_size: int
    base: tuple[float, ...]
    """Each step without delays, the slowest rank's."""
    delayed: tuple[float, ...]
    """Each step with delays, the slowest rank's."""
    largest: tuple[float, ...]
    """Each step's largest delay (drawn before the run)."""
    mean_s: float

    @property
    def predicted(self) -> float:
        """The median step without delays plus the mean of each step's largest delay."""
        return statistics.median(self.base) + statistics.mean(self.largest)

    @property
    def expected(self) -> float:
        """The median step without delays plus mean x H_N (the expectation)."""
        return statistics.median(self.base) + self.mean_s * harmonic(self.world_size)

    @property
    def measured(self) -> float:
        return statistics.mean(self.delayed)


def measure_stragglers(world_sizes: Sequence[int] = (2, 4, 8),
                       config: StragglerSettings = StragglerSettings(),
                       timeout: float = 120.0) -> list[StragglerRow]:
    """Each world size twice on ``config.link``: without delays, then with them."""
    bad = [n for n in world_sizes if isinstance(n, bool) or not isinstance(n, int) or n < 2]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be ints >= 2, got {list(world_sizes)}.")
    rows = []
    for n in world_sizes:
        steps = {}
        for delayed in (False, True):
            per_rank = launch(straggler_worker, n, args=(config, delayed), link=config.link,
                              backend="gloo", timeout=timeout, echo=False)
            steps[delayed] = tuple(max(r[k] for r in per_rank) for k in range(config.steps))
        largest = tuple(max(row) for row in config.delays(n)[1:])
        rows.append(StragglerRow(n, steps[False], steps[True], largest, config.mean_s))
    return rows


def expected_largest(mean_s: float, world_size: int) -> float:
    """``mean_s`` x H_N."""
    if world_size < 1 or not mean_s >= 0 or math.isinf(mean_s):
        raise ValueError("world_size must be >= 1 and mean_s a finite number >= 0.")
    return mean_s * harmonic(world_size)
