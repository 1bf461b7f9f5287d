"""What a launch hands back (:func:`labs.launcher.launch`): the ranks' results, how the launch
ended, and what each rank printed.

:class:`RankResults` is the list of per-rank return values with what each rank printed and, with
``count_writes``, the bytes it wrote. The launcher's supervision ends in one of :class:`Done`,
:class:`Failed` or :class:`TimedOut`. A rank that reports as plain data
(:mod:`labs.plain_results`) sends its failure as plain fields, read back by
:func:`plain_failure`. A rank's output goes to files (fd 1 and 2): :func:`read_output` reads
them back, the launcher drops gloo's connection lines (:data:`GLOO_CONNECTED`), and
:func:`echo_output` shows them in rank order. Kept apart from the launcher's process handling
(:mod:`labs.launcher`); ``from labs import RankResults`` keeps working.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labs import plain_results
from labs.launch_inputs import Backend, Placement
from labs.rank_errors import RankFailure

#: The line gloo writes to stdout each time a process group connects, in some torch releases
#: (2.8 and 2.9; not 2.11 or 2.13). It is dropped from what a rank printed when every peer
#: connected; a line whose two counts differ is kept, since it reports a connection that failed.
GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                            r"Expected number of connected peer ranks is : \1\n?", re.MULTILINE)


class RankResults(list):
    """The per-rank return values in rank order (a plain list), plus what each rank printed.

    Attributes:
        stdout, stderr: captured text per rank (index = rank).
        backend: the backend the ranks used.
        placement: that backend and the GPUs the ranks used (``placement.describe(N)``, a
            line to print under a table).
        seconds: wall time of the launch.
        written: with ``count_writes``, the bytes each rank wrote by its own system calls
            (``wchar`` of ``/proc/PID/io``, counted by the kernel) up to the moment every
            rank had reported, less what it wrote to its output and its report: its messages
            (gloo writes each one), and any file it wrote. None otherwise.
    """

    stdout: list[str]
    stderr: list[str]
    backend: Backend
    placement: Placement
    seconds: float
    written: list[int] | None = None


@dataclass(frozen=True)
class Done:
    """Every rank reported a result (and, with ``count_writes``, what each wrote)."""

    values: dict[int, bytes]
    written: dict[int, int] | None = None


@dataclass(frozen=True)
class Failed:
    """At least one rank raised or died: the failures seen before the grace ran out."""

    failures: list[RankFailure]


@dataclass(frozen=True)
class TimedOut:
    """The deadline passed with these ranks still running."""

    ranks: list[int]


def plain_failure(rank: int, fields: dict[Any, Any]) -> RankFailure:
    """The RankFailure a plain report describes, its fields checked (strings, a time)."""
    texts = {k: fields.get(k) for k in ("exc_type", "message", "traceback")}
    if not all(isinstance(v, str) for v in texts.values()) or not isinstance(
            fields.get("when"), (int, float)):
        raise plain_results.NotPlain("a failure whose fields are not strings and a time")
    return RankFailure(rank=rank, exc_type=texts["exc_type"], message=texts["message"],
                       traceback=texts["traceback"], when=float(fields["when"]))


#: The most bytes of one rank's output file the launcher reads (the start of it).
MAX_OUTPUT_BYTES = 4 << 20


def read_output(path: str) -> str:
    """A file a rank wrote (its output, or its stack dump), at most :data:`MAX_OUTPUT_BYTES`
    of it; "" when it wrote none, or left something else there (a link, a FIFO: the rank may
    run code the caller does not trust, and the caller must not follow it or wait on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return handle.read(MAX_OUTPUT_BYTES).decode(errors="replace")


def written_bytes(pid: int, outputs: tuple[str, ...], report_bytes: int) -> int:
    """The bytes process ``pid`` passed to write system calls (the kernel's count, ``wchar``),
    less its ``outputs`` files and its ``report_bytes``; -1 where the kernel does not say (not
    Linux, or the process is gone)."""
    try:
        fields = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/io").read_text().splitlines())
        total = int(fields["wchar"])
        printed = sum(os.path.getsize(p) for p in outputs)
    except (OSError, KeyError, ValueError):
        return -1
    return total - printed - report_bytes


def echo_output(stdout: list[str], stderr: list[str]) -> None:
    """Show what each rank printed, in rank order (deterministic, unlike live interleaving)."""
    for rank, text in enumerate(stdout):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}", file=sys.stdout)
    for rank, text in enumerate(stderr):
        for line in text.splitlines():
            print(f"[rank {rank}] {line}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
