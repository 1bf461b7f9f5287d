"""Shared test helpers: which processes a test left running, a guard against any process
starting (for input that must be refused first), GPU-only tests, ``assert_fails`` (what
every test of an exercise check's wrong answers asserts) and ``stated_values`` (the numbers a
wrong answer's verdict states).

Ranks are forked from multiprocessing's forkserver helper, a child of the test process; the
forkserver in turn needs multiprocessing's resource tracker, also a child of the test process.
So after a launch the process tree under pytest is::

    pytest ─┬─ resource tracker      (idle helper, started once with the forkserver)
            └─ forkserver ── rank 0, rank 1, ...   (must be gone once launch returns)

Everything here reads ``/proc/<pid>/stat`` directly (Linux), so no psutil is needed.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from labs.checks import CheckResult


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip cleanly on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass(frozen=True)
class Proc:
    """One line of the process table."""

    pid: int
    ppid: int
    state: str  #: the state letter of /proc/PID/stat: R, S, D, Z (zombie, not reaped yet), ...
    name: str


class Processes:
    """What runs under this test process, read from ``/proc``."""

    @staticmethod
    def table() -> dict[int, Proc]:
        """Every process of the machine, by pid."""
        procs = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # it exited while we were looking
                continue
            # The name is in parentheses and may itself hold spaces or ')': split after the last.
            close = stat.rindex(")")
            state, ppid = stat[close + 2 :].split()[:2]
            name = stat[stat.index("(") + 1 : close]
            procs[int(entry)] = Proc(int(entry), int(ppid), state, name)
        return procs

    def descendants(self, root: int | None = None) -> dict[int, Proc]:
        """Children, grandchildren, ... of ``root`` (default: this process), zombies included."""
        root = os.getpid() if root is None else root
        children: dict[int, list[Proc]] = {}
        for proc in self.table().values():
            children.setdefault(proc.ppid, []).append(proc)
        found: dict[int, Proc] = {}
        todo = [root]
        while todo:
            for child in children.get(todo.pop(), []):
                if child.pid not in found:
                    found[child.pid] = child
                    todo.append(child.pid)
        return found

    @staticmethod
    def running(pid: int) -> bool:
        """True while ``pid`` exists and has not exited. A zombie counts as exited: an orphan's
        zombie belongs to init, which may be slow to reap it."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZX"

    @staticmethod
    def forkserver_pid() -> int | None:
        """The pid of the forkserver that launch forks ranks from (None when not started)."""
        return multiprocessing.forkserver._forkserver._forkserver_pid

    def helpers(self) -> set[int]:
        """The idle multiprocessing helpers a launch may leave behind (never a rank)."""
        tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
        return {pid for pid in (self.forkserver_pid(), tracker) if pid is not None}

    def leftovers(self, within: float = 2.0) -> dict[int, Proc]:
        """Descendants other than the idle helpers, after waiting up to ``within`` seconds for
        exiting ranks to be reaped. A rank is a child of the forkserver, so "the forkserver has
        no children" is part of this."""
        deadline = time.monotonic() + within
        while True:
            helpers = self.helpers()
            left = {pid: p for pid, p in self.descendants().items() if pid not in helpers}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def wait_gone(self, pids: list[int], within: float) -> list[int]:
        """Wait up to ``within`` seconds for ``pids`` to exit; return those still running."""
        deadline = time.monotonic() + within
        while True:
            alive = [pid for pid in pids if self.running(pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.05)


@pytest.fixture
def procs() -> Processes:
    """The process-table helpers (Linux only)."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc (Linux)")
    return Processes()


@pytest.fixture
def no_leftover_processes(procs: Processes) -> Iterator[None]:
    """After the test, nothing but the idle forkserver (and its resource tracker) is left under
    this process: every rank of every launch has exited."""
    yield
    left = procs.leftovers(within=3.0)
    assert not left, f"processes left running after the test: {list(left.values())}"


class ProcessStarted(AssertionError):
    """Raised by :func:`refuse_processes` where a process would have started."""


def _refuse(*args: object, **kwargs: object) -> None:
    raise ProcessStarted("a process was started: the input should have been refused before")


@pytest.fixture
def refuse_processes(monkeypatch: pytest.MonkeyPatch
                     ) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """``with refuse_processes(): ...`` fails the test if the block starts a process of any
    kind: a rank (``multiprocessing`` ``Process.start``), the forkserver or the resource
    tracker (``multiprocessing.util.spawnv_passfds``), or a subprocess (a kernel, nbval).
    Comparing the process table before and after cannot tell: the forkserver reaps ranks that
    have exited, so a launch that ran and then raised leaves no trace there."""

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        with monkeypatch.context() as patch:
            patch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
            patch.setattr(multiprocessing.util, "spawnv_passfds", _refuse)
            patch.setattr(subprocess.Popen, "__init__", _refuse)
            yield

    return guard


@pytest.fixture
def assert_fails(capsys: pytest.CaptureFixture[str]) -> Callable[..., None]:
    """``assert_fails(result, exercise, *reasons)``: ``result`` is a FAIL of ``exercise``
    (``"6.4"``), printed, whose message holds every one of ``reasons``: what each test of an
    exercise check's wrong answers asserts."""
    def check(result: CheckResult, exercise: str, *reasons: str) -> None:
        assert isinstance(result, CheckResult)
        assert not result.passed
        for reason in reasons:
            assert reason in result.message, result.message
        assert capsys.readouterr().out.startswith(f"FAIL: Exercise {exercise}")

    return check


#: A value as a verdict writes it (``:g``), NaN and infinities included.
_NUMBER = r"(-?(?:inf|nan|[\d.]+(?:e[-+]?\d+)?))"
#: What ``labs.checks.core`` writes for a tensor: ``element [2, 1] is 0.5, expected 0.25``
#: (first_difference, largest_difference) or ``element 4 is now 0, was 7`` (first_change).
_STATED = re.compile(rf"(?:element (?:\d+|\[[\d, ]+\])|the value) is (?:now )?{_NUMBER}, "
                     rf"(?:expected|was) {_NUMBER}")


@pytest.fixture
def stated_values() -> Callable[[str], tuple[float, float]]:
    """``stated_values(message)``: the first pair ``(got, expected)`` that a verdict states for
    a tensor's element (``(now, was)`` for a tensor that was to stay as it was); the test fails
    when the message states none."""
    def find(message: str) -> tuple[float, float]:
        found = _STATED.search(message)
        assert found, f"no element's values in: {message}"
        return float(found.group(1)), float(found.group(2))

    return find
