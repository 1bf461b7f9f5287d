"""Grading a hostile learner: notebooks that attack the grader itself, graded as instructors
grade (``grade``, sandbox on), each of which once passed, harmed the grading machine or
stopped the batch, and must now fail its exercise with a clear reason and leave the machine
as it was.

* The judge ran in the folder the learner's kernel wrote: a planted ``conftest.py`` ran as
  the judge, links made the grader (root) overwrite host files, and the judge loaded every
  name of the learner-written index, so a fake ``check_*`` replaced the real one.
* The judge unpickled the learner's functions (a ``__reduce__`` ran in the judge and replaced
  the check) and the ranks' results (a tensor subclass of the learner's answered
  ``torch.allclose`` with True).
* One stage had no deadline (each cell had its own) and no cap on what the grader kept.
* A malformed export index, a folder where a file was expected, a link loop or a pipe
  under ``--keep`` stopped the whole batch with a traceback.
* The sandbox kept root's capabilities when the grader was root: the host's disk could be
  mounted from a cell.

Every attack is exercise 1.1 (one exercise, about 10 s to grade). The sandbox's privileges
and limits are tested directly in tests/test_grading_isolation.py.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labs.grading import grader, submission
from labs.grading.grader import MAX_OUTPUT_BYTES, GradeSettings, grade
from labs.grading.isolation import isolation_problem

from grading_learners import RIGHT, WRONG, learner, only


@pytest.fixture(scope="module")
def sandbox() -> None:
    problem = isolation_problem()
    if problem:
        pytest.skip(f"no sandbox on this machine: {problem}")


# --- the judge trusts nothing stage 1 left ------------------------------------------------------

_PLANT = '''
import json, os, pathlib
import labs.grading.submission as _submission
from labs.rank_pickle import pack_call

_here = pathlib.Path.cwd()
(_here / "conftest.py").write_text(
    "import pytest\\n"
    "@pytest.hookimpl(hookwrapper=True)\\n"
    "def pytest_runtest_makereport(item, call):\\n"
    "    outcome = yield\\n"
    "    outcome.get_result().outcome = 'passed'\\n")
(_here / "pytest.py").write_text("raise SystemExit(0)\\n")
for _name in ("judge.ipynb", "sanitize.cfg", "pytest.ini", "pytest.log", "collect.ipynb",
              "verdicts.json", "junit.xml"):
    os.symlink(f"{VICTIMS}/{_name}", _here / _name)


def _fake_check(fn, **kwargs):
    from labs.checks.core import CheckResult, report
    return report(CheckResult("Exercise 1.1 average_gradients", True,
                              "every rank holds the mean gradient on 1, 2, 3, 4 rank(s)."))


def _export(namespace, names, stage):
    out = pathlib.Path(stage)
    out = out if out.name == "submission" else out / "submission"
    out.mkdir(parents=True, exist_ok=True)
    shipped = {"average_gradients": namespace["average_gradients"],
               "check_average_gradients": _fake_check}
    for name, value in shipped.items():
        (out / f"{name}.pkl").write_bytes(pack_call(value, ()))
    (out / "index.json").write_text(json.dumps({n: {"ok": True} for n in shipped}))


_submission.export = _export
'''


@pytest.mark.slow  # make test's budget (12 s)
def test_nothing_stage_one_leaves_reaches_the_judge(sandbox, tmp_path,
                                                     no_leftover_processes) -> None:
    """A planted conftest.py and pytest.py, links where the grader writes its files, and a fake
    check shipped through a replaced export: the judge runs in a folder of its own, loads
    only the exercise's names, and the host files stay as they were."""
    victims = tmp_path / "victims"
    victims.mkdir()
    for name in ("judge.ipynb", "pytest.log", "collect.ipynb", "verdicts.json"):
        (victims / name).write_text("the host's own file")
    path = learner(tmp_path, WRONG + _PLANT.replace("{VICTIMS}", str(victims)))
    graded = only(grade([path], GradeSettings(hidden=False)))
    assert not graded.passed
    assert "SUM" in graded.reason, graded.details  # the real check's diagnosis
    assert {p.name: p.read_text() for p in victims.iterdir()} == dict.fromkeys(
        ("judge.ipynb", "pytest.log", "collect.ipynb", "verdicts.json"), "the host's own file")


# --- the judge runs none of the learner's code -------------------------------------------------

_REDUCE = '''
_FAKE = (
    "from labs.checks.core import CheckResult, report\\n"
    "def _fake(fn, **kwargs):\\n"
    "    return report(CheckResult('Exercise 1.1 average_gradients', True, 'every rank holds "
    "the mean gradient on 1, 2, 3, 4 rank(s).'))\\n"
    "import sys\\n"
    "_frame = sys._getframe()\\n"
    "while _frame is not None:\\n"
    "    if 'check_average_gradients' in _frame.f_globals:\\n"
    "        _frame.f_globals['check_average_gradients'] = _fake\\n"
    "    _frame = _frame.f_back\\n")


class _Payload:
    def __reduce__(self):
        return (exec, (_FAKE, {}))


def average_gradients(model, _unused=_Payload()):
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)  # sums; never divides
'''

_LIAR = '''
class _Liar(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("allclose", "equal"):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})
''' + WRONG.replace("dist.all_reduce(param.grad)  # sums; never divides",
                     "param.grad = param.grad.as_subclass(_Liar)  # agrees with anything")


# both in make test-slow (budget); tests/test_plain_results.py refuses a pickle in the results, fast
@pytest.mark.parametrize("attack", [pytest.param(_REDUCE, marks=pytest.mark.slow),
                                    pytest.param(_LIAR, marks=pytest.mark.slow)],
                         ids=["__reduce__ in the judge", "a tensor that agrees"])
def test_the_judge_unpickles_nothing_of_the_learners(sandbox, tmp_path, no_leftover_processes,
                                                      attack) -> None:
    """The learner's function travels to the ranks sealed, and their results come back as
    plain data, so neither a pickle's ``__reduce__`` nor a tensor subclass runs in the judge."""
    graded = only(grade([learner(tmp_path, attack)], GradeSettings(hidden=False)))
    assert not graded.passed, graded.details
    assert "every rank holds the mean gradient" not in graded.reason


# --- one learner's notebook never stops the batch ----------------------------------------------

_BREAK_THE_FOLDER = '''
import os, pathlib
import labs.grading.submission as _submission


def _export(namespace, names, stage):
    out = pathlib.Path(stage)
    out = out if out.name == "submission" else out / "submission"
    (out / "index.json").mkdir(parents=True)  # a folder where the index should be
    os.symlink("loop", out / "loop")
    os.symlink("a", out / "b")
    os.symlink("b", out / "a")
    os.mkfifo(out / "pipe")


_submission.export = _export
'''


@pytest.mark.slow  # make test's budget: a grading run of two notebooks (19 s)
def test_a_broken_stage_folder_fails_one_exercise_and_the_batch_goes_on(
        sandbox, tmp_path, monkeypatch, no_leftover_processes) -> None:
    roots = []
    make = grader.tempfile.mkdtemp
    monkeypatch.setattr(grader.tempfile, "mkdtemp",
                        lambda **kw: roots.append(make(**kw)) or roots[-1])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    broken = learner(tmp_path / "a", RIGHT + _BREAK_THE_FOLDER)
    honest = learner(tmp_path / "b", RIGHT)
    keep = tmp_path / "keep"
    report = grade([broken, honest], GradeSettings(hidden=False, keep=keep))
    first, second = (n.exercises[0] for n in report.notebooks)
    assert not first.passed and "export index could not be read" in first.reason, first
    assert second.passed, second.details
    assert roots and not Path(roots[0]).exists()  # the scratch folder is gone
    kept = list(keep.rglob("*"))
    assert kept and not [p for p in kept if p.is_symlink() or not (p.is_file() or p.is_dir())]


# --- one deadline per stage, and a cap on what the grader keeps --------------------------------

_SLEEP = "import time\ntime.sleep(5)\n"


def test_a_stage_has_one_deadline_not_one_per_cell(sandbox, tmp_path,
                                                   no_leftover_processes) -> None:
    """Three cells of 5 s each under an 8 s limit: each cell keeps within it, the stage does
    not."""
    path = learner(tmp_path, RIGHT + _SLEEP, _SLEEP, _SLEEP)
    start = time.monotonic()
    graded = only(grade([path], GradeSettings(hidden=False, timeout=8)))
    assert not graded.passed
    assert "did not finish within 8 s, the limit of the whole stage" in graded.reason, graded.reason
    assert time.monotonic() - start < 30


@pytest.mark.slow  # make test's budget: 64 MiB through a kernel (20 s)
def test_the_grader_keeps_a_bounded_part_of_what_a_kernel_prints(
        sandbox, tmp_path, no_leftover_processes) -> None:
    """The grader held every byte a kernel printed (512 MiB printed, 1.8 GB of grader)."""
    printing = "import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))\n"
    path = learner(tmp_path, RIGHT + printing)
    keep = tmp_path / "keep"
    graded = only(grade([path], GradeSettings(hidden=False, keep=keep)))
    assert graded.passed, graded.details  # printing is no fault; the answer is right
    (collected,) = keep.rglob("collect.ipynb")
    assert collected.stat().st_size < MAX_OUTPUT_BYTES + (1 << 20)


_PEAK = """
import resource, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from grading_learners import RIGHT, learner, only
from labs.grading.grader import GradeSettings, grade
printing = "import sys\\nfor _ in range(512):\\n    sys.stdout.write('x' * (1 << 20))\\n"
graded = only(grade([learner(Path({folder!r}), RIGHT + printing)], GradeSettings(hidden=False)))
print(graded.result.value, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
"""


@pytest.mark.slow  # 512 MiB through a kernel (25 s)
def test_the_graders_memory_is_bounded_by_what_it_keeps(sandbox, tmp_path,
                                                        no_leftover_processes) -> None:
    """A kernel that printed 512 MiB made the grader peak at 1.6 GB though it kept 4 MiB: its
    socket queued every message. It now queues 64, of at most 8 MiB each."""
    script = _PEAK.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, check=True)
    result, peak_mib = done.stdout.split()[-2:]
    assert result == "PASS", done.stdout
    assert int(peak_mib) < 600, f"the grader peaked at {peak_mib} MiB"


# --- the sandbox as root -----------------------------------------------------------------------

_MOUNT_THE_DISK = '''
import ctypes, os, pathlib
_libc = ctypes.CDLL(None, use_errno=True)
_tried = []
for _line in pathlib.Path("/proc/partitions").read_text().splitlines()[2:]:
    _dev = "/dev/" + _line.split()[-1]
    for _fs in (b"ext4", b"xfs", b"btrfs", b"overlay"):
        _ok = _libc.mount(_dev.encode(), b"/tmp", _fs, 1, None) == 0
        _tried.append((_dev, _fs, _ok, os.path.exists(_dev)))
        if _ok:
            break
assert not any(ok for _, _, ok, _ in _tried), f"mounted the host's disk: {_tried}"
with open("/proc/sys/kernel/core_pattern", "w") as _f:  # raises
    _f.write("|/bin/true")
'''


@pytest.mark.slow  # test_grading_isolation checks the same privileges directly, in 1 s
def test_a_learner_cannot_mount_the_hosts_disk(sandbox, tmp_path,
                                               no_leftover_processes) -> None:
    path = learner(tmp_path, _MOUNT_THE_DISK + RIGHT)
    graded = only(grade([path], GradeSettings(hidden=False)))
    assert not graded.passed
    assert "Read-only file system" in graded.reason or "Permission denied" in graded.reason, (
        graded.reason)
    assert "OSError" in graded.reason and "AssertionError" not in graded.reason


@pytest.mark.slow  # test_grading_isolation checks the memory limit directly, in 1 s
def test_a_cell_that_takes_too_much_memory_fails_naming_the_limit(
        sandbox, tmp_path, no_leftover_processes) -> None:
    path = learner(tmp_path, "_hog = bytearray(8 << 30)\n" + RIGHT)
    graded = only(grade([path], GradeSettings(hidden=False)))
    assert not graded.passed
    assert "MemoryError" in graded.reason and "GiB of memory per process" in graded.reason


def test_the_keep_copy_takes_regular_files_only(tmp_path) -> None:
    root, keep = tmp_path / "root", tmp_path / "keep"
    (root / "a").mkdir(parents=True)
    (root / "a" / "file").write_text("kept")
    os.symlink("/etc/hostname", root / "a" / "link")
    os.symlink("loop", root / "loop")
    os.symlink(root, root / "a" / "up")
    os.mkfifo(root / "a" / "pipe")
    submission.keep_files(root, keep)
    assert sorted(str(p.relative_to(keep)) for p in keep.rglob("*")) == ["a", "a/file"]


# --- the hand-off itself -----------------------------------------------------------------------


class Wrapper:
    def __init__(self, module, bucket_cap_mb=25):
        self.module = module

    def finish_gradient_synchronization(self):
        return "synchronized"


def test_the_judge_holds_sealed_functions_that_open_only_in_a_rank(tmp_path) -> None:
    from labs.rank_pickle import pack_call, unpack_call

    def average(model, *, scale=1.0):
        return "averaged"

    collect, judge = tmp_path / "collect", tmp_path / "judge"
    submission.export({"average": average, "Wrapper": Wrapper, "answer": 42},
                      ["average", "Wrapper", "answer", "missing"], str(collect))
    index = submission.carry(collect, judge, ["average", "Wrapper", "answer", "missing"])
    assert "not a function" in index["answer"]["error"]
    assert "not defined" in index["missing"]["error"]
    loaded = submission.load(str(judge), ["average", "Wrapper", "check_average"])
    assert sorted(loaded) == ["Wrapper", "average"]
    sealed = loaded["average"]
    with pytest.raises(RuntimeError, match="runs in a check's ranks, never in the judge"):
        sealed(None)
    assert str(inspect.signature(sealed)) == "(model, *, scale=None)"
    assert not sealed.sealed_class and loaded["Wrapper"].sealed_class
    assert callable(loaded["Wrapper"].finish_gradient_synchronization)
    assert str(inspect.signature(loaded["Wrapper"])) == "(module, bucket_cap_mb=None)"
    fn, _ = unpack_call(pack_call(sealed, ()))  # what a rank gets
    assert fn(None) == "averaged"


@pytest.mark.parametrize("entry", [
    {"ok": True, "parameters": [["model", 9, False]], "methods": ["__init__"]},
    {"ok": True, "parameters": "(model)", "methods": "finish"},
    {"ok": True, "parameters": [["not a name", 1, False]], "methods": [1]},
])
def test_a_forged_index_entry_gives_no_signature_and_no_methods(tmp_path, entry) -> None:

    out = tmp_path / submission.EXPORT
    out.mkdir()
    (out / "f.pkl").write_bytes(b"not read here")
    (out / submission.INDEX).write_text(json.dumps({"f": entry}))
    sealed = submission.load(str(tmp_path), ["f"])["f"]
    assert not sealed.sealed_class and not hasattr(sealed, "__signature__")


# --- the ranks cannot reach the judge that runs them --------------------------------------------

_TAKE_OVER_THE_JUDGE = '''
import ctypes, json, os, pathlib


def _take_over_the_judge():
    """From a rank: forge the verdicts, then make the judge's pytest exit 0 (ptrace)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"judge.ipynb" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    if not found:
        return "no judge"
    pid = found[0]
    pathlib.Path("verdicts.json").write_text(json.dumps(
        [{"exercise": "1.1", "passed": True, "message": "taken over"}]))
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        return f"attach: errno {ctypes.get_errno()}"
    os.waitpid(pid, 0x40000000)  # __WALL
    regs = (ctypes.c_ulonglong * 27)()
    libc.ptrace(12, pid, None, ctypes.byref(regs))  # PTRACE_GETREGS
    code = bytes.fromhex("b8e700000031ff0f05") + bytes(7)  # exit_group(0)
    for i in (0, 8):
        word = int.from_bytes(code[i:i + 8], "little")
        libc.ptrace(5, pid, ctypes.c_void_p(regs[16] + i), ctypes.c_void_p(word))  # POKETEXT
    regs[15] = (1 << 64) - 1  # orig_rax: no syscall to restart
    libc.ptrace(13, pid, None, ctypes.byref(regs))  # PTRACE_SETREGS
    libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    return "taken over"


def average_gradients(model):
    print(_take_over_the_judge())
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)  # sums; never divides
'''


@pytest.mark.slow  # make test's budget (16 s); the judge's plain results: test_plain_results
def test_a_rank_cannot_take_over_the_judge(sandbox, tmp_path, no_leftover_processes) -> None:
    """A rank of the judge's check runs as the same user as the judge's pytest and kernel: it
    forged verdicts.json and made pytest exit 0 through ptrace, which earned a PASS. The judge
    is not dumpable now (no ptrace, no /proc/PID/mem or fd of it), and its kernel's
    connection file is gone before any rank starts."""
    graded = only(grade([learner(tmp_path, _TAKE_OVER_THE_JUDGE)], GradeSettings(hidden=False)))
    assert not graded.passed, graded.details
    assert "SUM" in graded.reason, graded.reason
