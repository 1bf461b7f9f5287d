"""Launch ranks from a separate Python process, for tests that signal or kill the launcher.

    python tests/launch_driver.py sleep DIR              # ranks write DIR/rank{k}.pid, then sleep
    python tests/launch_driver.py meet DIR NAME EXPECTED # ranks wait for EXPECTED ranks in DIR

``meet`` prints the results as JSON on its last line of stdout.

The launching code stays under ``if __name__ == "__main__"``: every rank re-imports this script
as ``__mp_main__`` (standard multiprocessing behaviour for forkserver and spawn).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labs import launch


def write_pid_and_sleep(rank: int, world_size: int, where: str) -> None:
    """Announce this rank's pid (written whole, then renamed), then never return."""
    tmp = Path(where) / f"rank{rank}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(where) / f"rank{rank}.pid")
    time.sleep(1000)


def meet(rank: int, world_size: int, where: str, name: str, expected: int) -> dict:
    """Wait until ``expected`` ranks (of any launch) have checked in under ``where``, which
    proves the launches ran at the same time; then all-reduce within this launch."""
    Path(where, f"{name}-rank{rank}").touch()
    deadline = time.monotonic() + 20.0
    while len(os.listdir(where)) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(where))} of {expected} ranks met")
        time.sleep(0.02)
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"sum": total.item()}


def main(argv: list[str]) -> None:
    # A shell's background job starts with SIGINT ignored and Python keeps it ignored; a
    # notebook kernel always turns SIGINT into KeyboardInterrupt, so do the same here.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode, where, *rest = argv
    if mode == "sleep":
        launch(write_pid_and_sleep, 4, args=(where,), timeout=60.0, echo=False)
    elif mode == "meet":
        name, expected = rest
        results = launch(
            meet, 2, args=(where, name, int(expected)), backend="gloo", timeout=30.0, echo=False
        )
        print(json.dumps(list(results)))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
