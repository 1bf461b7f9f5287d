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

Not dumpable is not enough: a rank could still write into the judge's folder (its verdicts,
pytest's JUnit file), listen to what the judge's kernel publishes on its loopback (the check
cells' sources, the hidden seed among them), or leave a process behind that does either later.
So the ranks run in a sandbox of their own, nested in the judge's (:func:`ranks_apart`): every
process ``multiprocessing`` starts from the judge's kernel (the forkserver that forks the
ranks, and its resource tracker) starts in a new user, mount, network and IPC namespace, whose
filesystem holds the Python environment read-only and one writable folder for the launches'
files, and whose network is a loopback of its own. The judge reaches the ranks only through
the pipes the launcher gave them, and reads what they send as plain data
(:mod:`labs.plain_results`). It shares the judge's PID namespace, so that the launcher can
signal its ranks by the pids it is told; the judge's processes are not dumpable, and the whole
sandbox ends with the judge's stage (the stage's own PID namespace).

``python -m labs.grading.guard ARGS`` is ``python -m pytest ARGS`` run that way;
:func:`guard_judge_kernel` is the first thing the judge's kernel runs.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shlex
import sys
import tempfile
from pathlib import Path

from labs.grading.isolation import isolated

_PR_SET_DUMPABLE = 4
#: The ranks' sandbox's folder in the judge's own /tmp (a tmpfs of the judge's sandbox):
#: ``launches/`` is the one folder the ranks may write (each launch's store and output files),
#: ``python`` the interpreter multiprocessing starts, a script that enters the sandbox first.
RANKS_FOLDER = Path("/tmp/labs-ranks")


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


def guard_judge_kernel(notebook: str, *, sandboxed: bool = True) -> None:
    """Run by the judge's kernel before any check: not dumpable, its connection file and the
    judge's ``notebook`` (read by pytest already) removed, and, when the judge is
    ``sandboxed``, its ranks in a sandbox of their own (:func:`ranks_apart`)."""
    undumpable()
    from ipykernel.connect import get_connection_file  # noqa: PLC0415 - only in a kernel

    for path in (get_connection_file(), notebook):
        Path(path).unlink(missing_ok=True)
    if sandboxed:
        ranks_apart(RANKS_FOLDER)


def ranks_apart(folder: Path) -> None:
    """From now on, every process ``multiprocessing`` starts from this one (a forkserver and
    the ranks it forks, a resource tracker) runs in a new sandbox nested in this process's
    (:func:`labs.grading.isolation.isolated` with ``share_pids``), whose one writable folder
    is ``folder/launches``, where the launcher's temporary folders now go (and this process's
working folder). Its output goes to
    ``folder/forkserver.log``, never to this kernel's own streams (a rank could otherwise write
    into a check cell's output). ``folder`` must not exist yet."""
    folder.mkdir(mode=0o700, parents=True)
    launches = folder / "launches"
    launches.mkdir(mode=0o700)
    command = isolated([sys.executable], scratch=launches, share_pids=True)
    python = folder / "python"
    python.write_text(f"#!/bin/sh\nexec </dev/null >>{shlex.quote(str(folder / 'forkserver.log'))}"
                      f" 2>&1\nexec {shlex.join(command)} \"$@\"\n")
    python.chmod(0o700)
    multiprocessing.set_executable(str(python))
    tempfile.tempdir = str(launches)  # the launcher's FileStore and rank output files
    os.chdir(launches)  # a forked rank starts in its parent's folder, which must exist there


def main(argv: list[str] | None = None) -> int:
    """``python -m labs.grading.guard ARGS``: pytest with ARGS, not dumpable."""
    import pytest  # noqa: PLC0415

    undumpable()
    return int(pytest.main(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
