"""Keep a check's ranks away from the judge that runs them.

In stage 2 the judge's pytest, its nbval kernel and the ranks the checks start all run as the
sandbox's one user. A process may trace, read the memory of, and open the files of any
process of its own user that is *dumpable*, and a rank runs the learner's code: a rank that
attached to the judge's pytest with ``ptrace`` could forge the verdicts and make it exit 0.
So the judge's two processes make themselves not dumpable (``prctl(PR_SET_DUMPABLE, 0)``:
no ``ptrace``, no ``/proc/PID/mem``, ``environ`` or ``fd`` for another process of the same
user; it lasts until the process execs, so each process sets it itself), and the kernel
removes what a rank could read from the files it shares with it: its connection file (its
key would let a rank run code in the kernel) and the judge's notebook (it holds the hidden
seed), before any check starts a rank.

``python -m labs.grading.guard ARGS`` is ``python -m pytest ARGS`` run that way;
:func:`guard_judge_kernel` is the first thing the judge's kernel runs.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

_PR_SET_DUMPABLE = 4


def undumpable() -> None:
    """This process: no ptrace, /proc/PID/mem, environ or fd for other processes of its user,
    until it execs (nothing to do off Linux, where grading has no sandbox either). OSError
    where the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(errno)}")


def guard_judge_kernel(notebook: str) -> None:
    """Run by the judge's kernel before any check: not dumpable, and its connection file and
    the judge's ``notebook`` (read by pytest already) removed."""
    undumpable()
    from ipykernel.connect import get_connection_file  # noqa: PLC0415 - only in a kernel

    for path in (get_connection_file(), notebook):
        Path(path).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m labs.grading.guard ARGS``: pytest with ARGS, not dumpable."""
    import pytest  # noqa: PLC0415

    undumpable()
    return int(pytest.main(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
