"""Leave no process behind: whatever a learner's code starts is killed when its stage ends,
or when its deadline passes, and the grader keeps a bounded part of what it printed.

A learner's notebook may start ranks that hang, or a kernel that never returns. Each grading
stage runs inside :class:`ProcessSweep`: on exit it kills every process that descends from
the grader and did not exist when the stage began (kernels, pytest, ranks, and anything those
started). On Linux the grader first makes itself a *child subreaper* (``prctl``), so a process
whose parent died is re-parented to the grader instead of to init and is still found.

A stage that writes without end into its folder (the one folder of the machine's it may
write) is stopped the same way (:class:`DiskWatch`): the folder is measured often, more often
while it grows fast, and past :data:`MAX_STAGE_BYTES` or :data:`MAX_STAGE_FILES` the stage's
processes are killed.

This is clean-up, not a security sandbox: the learner's code runs with the grader's rights.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import psutil

#: The most bytes of output the grader keeps from one stage (the learner's kernel may print
#: without end): past it, outputs are dropped and the verdict says so.
MAX_OUTPUT_BYTES = 4 << 20
#: The most bytes (of disk: a sparse file counts what it holds) a stage may keep in its
#: folder: an exercise's exported functions and the judge's reports take well under 1 MiB.
MAX_STAGE_BYTES = 256 << 20
#: The most files and folders a stage may make in its folder.
MAX_STAGE_FILES = 10_000
#: The longest and the shortest time between two of :class:`DiskWatch`'s looks at a folder.
DISK_WATCH_PERIOD_S = (0.2, 0.005)
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, value: int | ctypes.c_int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arg = ctypes.byref(value) if isinstance(value, ctypes.c_int) else value
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether orphaned descendants are re-parented to this process (Linux only)."""
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, flag) and bool(flag.value)


def set_subreaper(on: bool) -> bool:
    """Ask Linux to re-parent (or stop re-parenting) orphaned descendants to this process;
    False where that is not possible."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, int(on))


def descendants() -> dict[int, psutil.Process]:
    """Every live descendant of this process, by pid."""
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def kill_new(before: set[int], rounds: int = 5) -> list[int]:
    """SIGKILL every descendant not in ``before`` (repeating while kills orphan others) and
    reap those that are our own children. Returns the pids killed."""
    killed: list[int] = []
    for _ in range(rounds):
        targets = [p for pid, p in descendants().items() if pid not in before]
        if not targets:
            break
        for proc in targets:
            try:
                proc.kill()
                killed.append(proc.pid)
            except psutil.Error:
                pass
        psutil.wait_procs(targets, timeout=5)
    _reap(before)
    return killed


def _reap(before: set[int]) -> None:
    """Collect exit statuses of dead children that were re-parented to us (no zombies)."""
    for proc in psutil.Process().children():
        if proc.pid in before:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


class ProcessSweep:
    """``with ProcessSweep(): ...`` kills, on exit, every process started inside the block.

    The process is a subreaper only inside the block: outside it, an orphan re-parented to a
    long-lived caller (a test session, a notebook kernel) that never waits for it would stay
    a zombie."""

    def __init__(self) -> None:
        self.before: set[int] = set()
        self.killed: list[int] = []
        self._was_subreaper = False

    def __enter__(self) -> ProcessSweep:
        self._was_subreaper = is_subreaper()
        set_subreaper(True)
        self.before = set(descendants())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.killed = kill_new(self.before)
        finally:
            if not self._was_subreaper:
                set_subreaper(False)


class Deadline:
    """``with Deadline(seconds, sweep): ...``: one deadline for a whole stage. When it passes,
    every process the stage started (``sweep``'s) is killed, so that whatever waits on them
    returns; :attr:`passed` then says so."""

    def __init__(self, seconds: float, sweep: ProcessSweep) -> None:
        self.passed = False
        self._sweep = sweep
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def _expire(self) -> None:
        self.passed = True
        kill_new(self._sweep.before)

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


class DiskWatch:
    """``with DiskWatch(folder, limit, sweep): ...``: while the block runs, ``folder`` is
    measured (never following a link); once it holds more than ``limit`` bytes or
    :data:`MAX_STAGE_FILES` entries, every process ``sweep`` saw start is killed and
    :attr:`exceeded` says so.

    The first look comes after the shortest period of :data:`DISK_WATCH_PERIOD_S`; each next
    one comes before the folder could fill half the room left at the rate it grew since the
    last, within the two periods. A writer at the page cache's speed (1 GB/s on a 2-core
    machine) overshoots by a few tens of MiB, against the whole disk it could fill before."""

    def __init__(self, folder: Path, limit: int, sweep: ProcessSweep) -> None:
        self.folder, self.limit, self._sweep = Path(folder), limit, sweep
        self.exceeded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def words(self) -> str:
        return (f"your code wrote more than {self.limit >> 20} MiB (or {MAX_STAGE_FILES} files) "
                "into its folder, the most one grading stage may keep")

    def _watch(self) -> None:
        longest, shortest = DISK_WATCH_PERIOD_S
        period, last = shortest, 0
        while not self._stop.wait(period):
            used, entries = folder_size(self.folder, self.limit, MAX_STAGE_FILES)
            if used > self.limit or entries > MAX_STAGE_FILES:
                self.exceeded = True
                kill_new(self._sweep.before)
                return
            grown, last = used - last, used
            if grown <= 0:
                period = min(longest, 2 * period)
            else:  # at this rate, half the room left lasts period * room / (2 * grown)
                period = min(longest, max(shortest, period * (self.limit - used) / (2 * grown)))

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if not self.exceeded and folder_usage(self.folder, self.limit, MAX_STAGE_FILES):
            self.exceeded = True  # written between the last look and the stage's end


def folder_size(folder: Path, limit: int, max_entries: int) -> tuple[int, int]:
    """The bytes of disk ``folder`` holds and its number of entries (each file counted once
    however many names it has; links not followed). Stops reading as soon as either passes
    ``limit`` or ``max_entries``."""
    used, entries, seen = 0, 0, set()
    pending = [str(folder)]
    while pending:
        try:
            with os.scandir(pending.pop()) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries:
                        return used, entries
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif (info.st_dev, info.st_ino) not in seen:
                        seen.add((info.st_dev, info.st_ino))
                        used += max(getattr(info, "st_blocks", 0) * 512, info.st_size)
                        if used > limit:
                            return used, entries
        except OSError:
            continue
    return used, entries


def folder_usage(folder: Path, limit: int, max_entries: int) -> bool:
    """Whether ``folder`` holds more than ``limit`` bytes of disk or ``max_entries`` entries."""
    used, entries = folder_size(folder, limit, max_entries)
    return used > limit or entries > max_entries


def run_capped(command: Sequence[str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """Run ``command``; (its exit code, or None when it ran past ``timeout`` and was killed,
    and the first :data:`MAX_OUTPUT_BYTES` of what it printed)."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    kept = bytearray()
    dropped = 0

    def drain() -> None:
        nonlocal dropped
        assert proc.stdout is not None
        while chunk := proc.stdout.read(65536):
            room = MAX_OUTPUT_BYTES - len(kept)
            kept.extend(chunk[:max(room, 0)])
            dropped += max(len(chunk) - max(room, 0), 0)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        returncode: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        returncode = None
    reader.join(timeout=5)
    text = kept.decode(errors="replace")
    if dropped:
        text += f"\n[{dropped} more bytes of output dropped]"
    return returncode, text
