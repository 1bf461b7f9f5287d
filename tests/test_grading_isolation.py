"""Grading a learner who wants the points without the work.

Each attack below once passed exercise 2.1 (``my_ring_all_reduce``) through
``python -m labs.grading grade``; each must now fail it, with a reason that names what was
refused:

* calls ``labs.collectives.ring_all_reduce``, imported by name: refused as the answer key
  (labs.checks.answer_keys);
* the same through ``importlib.import_module("labs." + "collectives")``: the same;
* reads the reference notebook beside ``labs`` and runs its solution cell: the sandbox holds
  no such file;
* writes into the grading machine's /tmp and connects to its 127.0.0.1: the sandbox has its
  own /tmp, which vanishes, and its own loopback, where nothing listens.

The last one is also checked from outside: the test listens on the grading machine's
127.0.0.1 and looks for the file, and neither the connection nor the file may happen. The
sandbox itself (:mod:`labs.grading.isolation`) is tested directly too: what it can read,
write and reach, that it holds no privilege (as root it once mounted the host's disk), and
its limits. Everything here needs Linux namespaces; where this machine cannot make a
sandbox, the tests skip and say why. tests/test_grading_attacks.py grades the attacks on the
grader itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from labs.grading import grader, isolation
from labs.grading.__main__ import EXIT_USAGE, main
from labs.grading.grader import GradeSettings, grade
from labs.grading.handout import load_chapters, release_notebook
from labs.grading.isolation import (
    DEVICES,
    SANDBOX_UID,
    Isolation,
    Limits,
    isolated,
    isolation_problem,
)
from labs.grading.notebook import GradingError
from labs.grading.report import NO_ISOLATION_NOTE, Report

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "notebooks"
RING = "02_allreduce_algorithms.ipynb"


@pytest.fixture(scope="module")
def sandbox() -> None:
    problem = isolation_problem()
    if problem:
        pytest.skip(f"no sandbox on this machine: {problem}")


class Listener:
    """A TCP server on the grading machine's 127.0.0.1 that counts who connects."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def test_a_machine_where_no_sandbox_starts_is_told_why(monkeypatch) -> None:
    def broken(command, **kwargs):
        return ["sh", "-c", "echo 'sandbox: unshare: Operation not permitted' >&2; exit 1"]

    monkeypatch.setattr(isolation, "isolated", broken)
    assert "a sandbox could not be started: sandbox: unshare: Operation not permitted" in (
        isolation_problem())


def test_grade_refuses_without_a_sandbox_before_anything_runs(monkeypatch, tmp_path,
                                                               capsys) -> None:
    monkeypatch.setattr(grader, "isolation_problem", lambda: "user namespaces are off")
    chapter = next(c for c in load_chapters(REFERENCE) if c.name == RING)
    path = tmp_path / RING
    path.write_text(json.dumps(release_notebook(chapter)))
    with pytest.raises(GradingError, match="user namespaces are off.*--no-isolation"):
        grade([path], GradeSettings(hidden=False))
    assert main(["grade", str(path)]) == EXIT_USAGE
    assert "--no-isolation" in capsys.readouterr().err


def test_the_report_says_when_grading_ran_without_isolation() -> None:
    report = Report(seed=None, isolation=Isolation.NONE)
    assert report.table().endswith(NO_ISOLATION_NOTE)
    assert report.to_json()["isolation"] == "none"
    assert NO_ISOLATION_NOTE not in Report(seed=None).table()


_INSIDE = r"""
import json, socket, sys, pathlib
seen = {}
reference = pathlib.Path(sys.argv[1])
try:
    reference.read_text()
    seen["reference"] = "read"
except OSError as err:
    seen["reference"] = type(err).__name__
import labs.collectives, torch  # the environment is there
seen["labs"] = labs.collectives.__name__
pathlib.Path("/tmp", sys.argv[2]).write_text("escaped?")
pathlib.Path(sys.argv[3], "scratch.txt").write_text("kept")
seen["tmp_inside"] = pathlib.Path("/tmp", sys.argv[2]).exists()
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[4])), 2).close()
    seen["host"] = "connected"
except OSError as err:
    seen["host"] = type(err).__name__
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
socket.create_connection(server.getsockname(), 2).close()
seen["own_loopback"] = "ok"
seen["processes"] = sorted(int(p.name) for p in pathlib.Path("/proc").iterdir() if p.name.isdigit())
print(json.dumps(seen))
"""


def test_the_sandbox_reads_the_environment_writes_its_scratch_and_reaches_only_itself(
        sandbox, tmp_path, listener) -> None:
    token = f"labs-escape-{uuid.uuid4().hex}"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    command = isolated([sys.executable, "-c", _INSIDE, str(REFERENCE / RING), token,
                        str(scratch), str(listener.port)], scratch=scratch)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["reference"] == "FileNotFoundError"  # the reference notebooks are not there
    assert seen["labs"] == "labs.collectives" and seen["own_loopback"] == "ok"
    assert seen["tmp_inside"] and not (Path("/tmp") / token).exists()  # its /tmp vanished
    assert (scratch / "scratch.txt").read_text() == "kept"  # the one folder it may write
    assert seen["host"] == "ConnectionRefusedError" and listener.accepted == 0
    assert seen["processes"] == [1]  # a process table of its own: it is pid 1, alone


_KERNEL_PACKAGES = r"""
import json, pathlib, sys
seen = {}
import wheelhouse_probe  # installed with --target into a folder on PYTHONPATH
seen["probe"] = wheelhouse_probe.VALUE
try:
    pathlib.Path(sys.argv[1]).read_text()
    seen["checkout"] = "read"
except OSError as err:
    seen["checkout"] = type(err).__name__
print(json.dumps(seen))
"""


def test_the_sandbox_reads_packages_installed_beside_the_interpreter(
        sandbox, tmp_path, monkeypatch) -> None:
    # make test-gpu installs the kernel's packages (ipykernel, nbval, ...) with pip --target
    # into a folder on PYTHONPATH; a learner's kernel started there once died in the sandbox,
    # which bound only Python's prefixes. A checkout on the path holds no distribution and
    # stays out (its reference notebooks hold the solutions).
    site, checkout, scratch = tmp_path / "site", tmp_path / "checkout", tmp_path / "scratch"
    for folder in (site / "wheelhouse_probe-1.0.dist-info", checkout, scratch):
        folder.mkdir(parents=True)
    (site / "wheelhouse_probe.py").write_text("VALUE = 41\n")
    (site / "wheelhouse_probe-1.0.dist-info" / "METADATA").write_text("Name: wheelhouse-probe\n")
    (checkout / "reference.ipynb").write_text("{}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(checkout))
    assert site in isolation.site_folders() and checkout not in isolation.site_folders()
    command = isolated([sys.executable, "-c", _KERNEL_PACKAGES, str(checkout / "reference.ipynb")],
                       scratch=scratch)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(site)])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"probe": 41, "checkout": "FileNotFoundError"}


def test_a_package_folder_closed_to_the_sandbox_user_is_named_before_anything_runs(
        sandbox, tmp_path, monkeypatch) -> None:
    # mktemp -d makes a 0700 folder; make test-gpu once installed the kernel's packages into
    # one, and every sandboxed kernel, run as nobody, died before it replied
    if os.geteuid() != 0:
        pytest.skip("the sandbox keeps the grader's user when the grader is not root")
    site = tmp_path / "closed-site"
    (site / "probe-1.0.dist-info").mkdir(parents=True)
    site.chmod(0o700)
    monkeypatch.syspath_prepend(str(site))
    problem = isolation_problem()
    assert str(site) in problem and "chmod a+rX" in problem and "nobody" in problem
    site.chmod(0o755)
    assert isolation_problem() == ""


_NO_PRIVILEGE = r"""
import ctypes, json, os, pathlib
libc = ctypes.CDLL(None, use_errno=True)
seen = {}
seen["mount"] = libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None) == 0
seen["devices"] = sorted(os.listdir("/dev"))
try:
    open("/proc/sys/kernel/core_pattern", "w")
    seen["core_pattern"] = "opened for writing"
except OSError as err:
    seen["core_pattern"] = err.strerror
status = dict(line.split(":", 1) for line in pathlib.Path("/proc/self/status").read_text()
              .splitlines())
seen["caps"] = [int(status[k], 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")]
seen["no_new_privs"] = status["NoNewPrivs"].strip()
seen["uid"] = os.getuid()
try:
    pathlib.Path("/etc/shadow").read_bytes()
    seen["shadow"] = "read"
except OSError as err:
    seen["shadow"] = err.strerror
pathlib.Path("mine.txt").write_text("x")
# A user namespace of its own gives capabilities there, but the sandbox's read-only mounts
# stay locked read-only.
r, w = os.pipe()
if os.fork() == 0:
    ok = libc.unshare(0x10000000 | 0x00020000) == 0  # CLONE_NEWUSER | CLONE_NEWNS
    rw = ok and libc.mount(None, b"/usr", None, 32 | 4096, None) == 0  # MS_REMOUNT | MS_BIND
    os.write(w, b"remounted" if rw else b"refused")
    os._exit(0)
os.wait()
seen["nested_remount"] = os.read(r, 16).decode()
print(json.dumps(seen))
"""


def test_the_sandbox_holds_no_privilege(sandbox, tmp_path) -> None:
    """As root the sandbox once kept every capability: a learner mounted the host's disk and
    could write /proc/sys/kernel/core_pattern. Now its code runs without any."""
    done = subprocess.run(isolated([sys.executable, "-c", _NO_PRIVILEGE], scratch=tmp_path),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["mount"] is False
    assert seen["devices"] == sorted([*DEVICES, "fd", "shm", "stdin", "stdout", "stderr"])
    assert seen["core_pattern"] != "opened for writing"
    assert seen["caps"] == [0, 0, 0, 0] and seen["no_new_privs"] == "1"
    assert seen["nested_remount"] == "refused"
    if os.geteuid() == 0:  # root's sandbox runs as nobody, inside and outside
        assert seen["uid"] == SANDBOX_UID
        assert (tmp_path / "mine.txt").stat().st_uid == SANDBOX_UID
        if Path("/etc/shadow").exists():
            assert seen["shadow"] == "Permission denied"


_LIMITS = r"""
import json, threading, pathlib
seen = {}
try:
    block = bytearray(3 << 30)
    seen["memory"] = "allocated"
except MemoryError:
    seen["memory"] = "MemoryError"
try:
    pathlib.Path("big").write_bytes(b"x" * (2 << 20))
    seen["file"] = "written"
except OSError as err:
    seen["file"] = err.strerror
written = 0
try:
    for i in range(64):
        pathlib.Path(f"/tmp/{i}").write_bytes(b"x" * (1 << 20))
        written += 1
    seen["tmp"] = "filled"
except OSError as err:
    seen["tmp"] = err.strerror
seen["tmp_mib"] = written
stop, threads = threading.Event(), 0
try:
    for _ in range(500):
        threading.Thread(target=stop.wait, daemon=True).start()
        threads += 1
except RuntimeError:
    pass
seen["threads"] = threads
stop.set()
print(json.dumps(seen))
"""


def test_the_sandbox_has_limits(sandbox, tmp_path) -> None:
    """Nothing stopped a learner's kernel from allocating 8 GiB, writing 2 GiB to the host's
    scratch folder or starting processes without end."""
    limits = Limits(address_space=2 << 30, processes=64, file_size=1 << 20,
                    tmpfs_size=8 << 20)
    done = subprocess.run(isolated([sys.executable, "-c", _LIMITS], scratch=tmp_path,
                                   limits=limits),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["memory"] == "MemoryError"
    assert seen["file"] == "File too large"
    assert seen["tmp"] == "No space left on device" and seen["tmp_mib"] <= 8
    assert seen["threads"] < 64


# --- the attacks, graded end to end ----------------------------------------------------------


def _attack(kind: str, port: int, token: str) -> str:
    if kind == "import":
        return ("def my_ring_all_reduce(t):\n"
                "    from labs.collectives import ring_all_reduce\n"
                "    return ring_all_reduce(t)\n")
    if kind == "importlib":
        return ("import importlib\n\n"
                "def my_ring_all_reduce(t):\n"
                "    module = importlib.import_module('labs.' + 'collectives')\n"
                "    return getattr(module, 'ring_' + 'all_reduce')(t)\n")
    if kind == "reference":
        return ("import json, pathlib, labs\n"
                "_ref = pathlib.Path(labs.__file__).resolve().parents[1] / 'notebooks' / "
                f"{RING!r}\n"
                "_cells = json.loads(_ref.read_text())['cells']\n"
                "exec(next(''.join(c['source']) for c in _cells\n"
                "          if 'def my_ring_all_reduce' in ''.join(c['source'])))\n")
    assert kind == "escape"
    return ("import pathlib, socket\n"
            "from labs.collectives import ring_all_reduce as _honest_looking\n\n"
            "def my_ring_all_reduce(t):\n"
            f"    pathlib.Path('/tmp/{token}').write_text('I was here')\n"
            f"    socket.create_connection(('127.0.0.1', {port}), 2).close()\n"
            "    return _honest_looking(t)\n")


#: What each attack's verdict must name.
REFUSED = {
    "import": "labs.collectives.ring_all_reduce",
    "importlib": "labs.collectives.ring_all_reduce",
    "reference": "No such file or directory",
    "escape": "Connection refused",
}


# All in make test-slow (budget): make test shows the sandbox reaching only itself directly
# (test_the_sandbox_reads_the_environment_writes_its_scratch_and_reaches_only_itself), and an
# imported answer key refused inside every check (tests/test_answer_keys.py)
@pytest.mark.parametrize("kind", [
    pytest.param("escape", marks=pytest.mark.slow),
    pytest.param("import", marks=pytest.mark.slow),
    pytest.param("importlib", marks=pytest.mark.slow),
    pytest.param("reference", marks=pytest.mark.slow),
])
def test_every_attack_fails_its_exercise_naming_what_was_refused(
        sandbox, tmp_path, listener, no_leftover_processes, kind) -> None:
    token = f"labs-escape-{uuid.uuid4().hex}"
    chapter = next(c for c in load_chapters(REFERENCE) if c.name == RING)
    nb = release_notebook(chapter)
    (index,) = chapter.exercise("2.1").solutions
    nb.cells[index].source = _attack(kind, listener.port, token)
    path = tmp_path / RING
    path.write_text(json.dumps(nb))
    report = grade([path], GradeSettings(hidden=False))
    (graded,) = report.notebooks[0].exercises
    assert not graded.passed, report.table()
    assert REFUSED[kind] in graded.reason + graded.details, graded.details
    assert listener.accepted == 0 and not (Path("/tmp") / token).exists()


def test_the_bench_times_a_process_in_and_out_of_the_sandbox(sandbox) -> None:
    from labs.bench.grading import start_seconds

    assert 0 < start_seconds(False, 1) and 0 < start_seconds(True, 1)
