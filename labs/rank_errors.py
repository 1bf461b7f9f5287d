"""What the notebook sees when ranks fail or hang: :class:`RankError` and :class:`LaunchTimeout`.

:func:`labs.launcher.launch` collects a :class:`RankFailure` from every rank that raised or
died, and the stacks of the ranks that hung. This module turns them into the error a learner
reads in the notebook:

* **Which rank to blame.** When one rank fails, its peers usually fail too, only because it
  went away (a closed connection, a timed-out collective). :func:`first_failure` names the
  earliest failure that is not such a lost peer; the others stay in ``RankError.secondary``.
* **The learner's frames only.** A traceback starts in the worker, not in the launcher; a dead
  rank's last words (:func:`last_words`) and a hung rank's stack (:func:`stuck_stack`) stop
  at the launcher's entry point, ``_rank_main``.
* **Cells named as IPython names them.** :func:`name_cells` writes ``Cell In[5], line 3``
  where the traceback says ``File "/tmp/ipykernel_4242/3141.py", line 3``.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

#: Error texts that mean "a peer went away", not "this rank's code is wrong".
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"Socket Timeout|Timed out waiting|Connection refused|NCCL communicator was aborted|"
    r"ProcessGroupNCCL.*(aborted|watchdog)",
    re.IGNORECASE,
)
#: Lines of a dead rank's stderr that its RankError shows.
_LAST_LINES = 25
#: The launcher's functions that a rank's stack runs through below (or beside) the learner's
#: code: ``_rank_main`` calls the worker, ``_watch_launcher`` is a thread of every rank and
#: ``_join_group`` joins the process group before the worker starts (all in labs.launcher).
_RANK_ENTRY = "in _rank_main"
_WATCHER = "_watch_launcher"
_JOINING = "_join_group"


@dataclass(frozen=True)
class RankFailure:
    """What a rank reports when its code raises (or what the launcher notices if it dies)."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    when: float  #: time.time() at the failure, to order failures across ranks

    @property
    def peer_lost(self) -> bool:
        """True when the error says a peer went away rather than this rank's code failing."""
        return bool(_PEER_LOST.search(self.message) or _PEER_LOST.search(self.traceback))


class RankError(RuntimeError):
    """A rank raised (or died). Names the rank whose failure came first, with its traceback.

    Attributes:
        rank: the rank that failed first.
        exc_type: the name of its exception class.
        remote_traceback: the traceback text printed in that rank.
        secondary: failures of other ranks that only followed from it (a lost peer).
        failure: the first failure whole (its rank, type, message and traceback).
    """

    def __init__(self, first: RankFailure, others: Sequence[RankFailure]) -> None:
        self.failure = first
        self.rank = first.rank
        self.exc_type = first.exc_type
        self.remote_traceback = first.traceback
        self.secondary = list(others)
        lines = [
            f"rank {first.rank} raised {first.exc_type}: {first.message}",
            "",
            f"Traceback from rank {first.rank}:",
            first.traceback.rstrip(),
        ]
        if others:
            names = ", ".join(str(f.rank) for f in others)
            lines += [
                "",
                f"Rank(s) {names} failed afterwards, only because rank {first.rank} stopped "
                "(their errors are in .secondary).",
            ]
        super().__init__("\n".join(lines))


class LaunchTimeout(TimeoutError):
    """Some ranks were still running when the launch's timeout ran out.

    Attributes:
        ranks: the ranks that never returned (they have been killed).
        stacks: for each of them, the Python stack it was stuck in, when one could be read.
    """

    def __init__(self, ranks: list[int], timeout: float, stacks: dict[int, str]) -> None:
        self.ranks = ranks
        self.stacks = stacks
        starting = not stacks or all(_JOINING in s for s in stacks.values())
        hint = (
            "They were still starting up (joining the process group): the first launch in a "
            "kernel also starts the helper that imports torch. Pass a larger timeout=."
            if starting else
            "A common cause: one rank skips a collective (all_reduce, barrier, ...) that its "
            "peers entered, so the peers wait forever. Every rank must make the same "
            "collective calls in the same order. If the work is just slow, pass a larger "
            "timeout=."
        )
        lines = [
            f"rank(s) {', '.join(map(str, ranks))} still running after {timeout:g} s; "
            "they were killed.",
            hint,
        ]
        for rank, stack in stacks.items():
            lines += ["", f"Where rank {rank} was stuck (most recent call first):", stack]
        super().__init__("\n".join(lines))


def first_failure(failures: list[RankFailure]) -> RankError:
    """The error that names the cause: the earliest failure that is not just "my peer went
    away" (the earliest of all when every one is), with the others as its secondaries."""
    causes = [f for f in failures if not f.peer_lost] or failures
    first = min(causes, key=lambda f: f.when)
    return RankError(first, sorted((f for f in failures if f is not first), key=lambda f: f.rank))


#: A rank process imports the main script before it runs anything (forkserver and spawn do),
#: so a script that calls launch() at module level would launch again from every rank.
MAIN_GUARD = (
    "launch() was called while a rank process was importing the main script. Every rank "
    "imports it first, so a call at module level runs again in each rank: put it under "
    "`if __name__ == \"__main__\":`.")


def died(rank: int, code: int | None, stderr: str, from_script: bool) -> RankFailure:
    """What a rank whose process ended without reporting failed with: how it ended (exit
    ``code``, or the signal of a negative one), what it wrote last on ``stderr``, and, for a
    rank of a script (``from_script``) that exited with 1, the missing main guard."""
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited ({code})"
    hint = ""
    if code == 1 and from_script:
        hint = (" If the script calls launch() at module level, put the call under "
                "`if __name__ == \"__main__\":` (every rank imports the main script first).")
    last = last_words(stderr)
    said = f"\nWhat it wrote last (stderr):\n{last}" if last else ""
    return RankFailure(
        rank=rank, exc_type="RankDied",
        message=f"the process of rank {rank} {how} before returning a result",
        traceback="(no Python traceback: the process ended without raising; look for os._exit, "
        f"sys.exit in C code or a crash.{hint}){said}",
        when=time.time(),
    )


def last_words(stderr: str) -> str:
    """The end of a dead rank's stderr: a C++ library's last message (``terminate called
    after throwing ...``) and faulthandler's Python stack of the crash, without the frames of
    the launcher below the worker."""
    lines = [line for line in stderr.rstrip().splitlines() if line.strip()]
    # faulthandler lists the innermost frame first: in its dump, what follows the launcher's
    # own frame (process start-up, the list of extension modules) is not the learner's.
    dump = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")),
               default=len(lines))
    cut = next((i for i in range(dump, len(lines)) if _RANK_ENTRY in lines[i]), len(lines))
    lines = lines[:cut]
    return "\n".join(f"    {line}" for line in lines[-_LAST_LINES:])


def stuck_stack(dump: str) -> str:
    """The learner's frames from a faulthandler dump of a hung rank: the launcher's watcher
    thread and the process start-up frames below ``_rank_main`` are dropped."""
    blocks = re.split(r"\n\s*\n", dump.strip())
    stacks = []
    for block in blocks:
        if _WATCHER in block:
            continue
        frames = [line for line in block.splitlines() if line.startswith("  File")]
        cut = next((i for i, line in enumerate(frames) if _RANK_ENTRY in line), len(frames))
        stacks.append("\n".join(frames[:cut]))
    return "\n".join(s for s in stacks if s)


def name_cells(text: str) -> str:
    """Name the notebook cells in a rank's traceback or stack as IPython names them in its
    own tracebacks (``Cell In[5], line 3``) instead of by the file the kernel made up for the
    cell (``File "/tmp/ipykernel_4242/3141.py", line 3``). Outside a kernel, unchanged."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name_of is None:
        return text

    def cell(match: re.Match[str]) -> str:
        named = name_of(match.group(1))
        return f"{named[0]} {named[1]}, line" if named else match.group(0)

    return re.sub(r'File "([^"]+)", line', cell, text)
