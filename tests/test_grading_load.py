"""Right answers pass on a machine busy with other work.

Graded while other work kept the two cores busy, 12 of 19 right answers once failed, read as
hangs: every rank of a check unpickled the learner's function through the grader's module, so
it imported nbclient, jsonschema and lark (1.5 s of CPU a rank, 8-9 s for a 6-rank launch),
all inside the check's 10 s. Now the ranks import nothing of the grader, a check's clock
starts once its ranks have all joined their group, and a hang is blamed on the learner only
when a rank was in the learner's code. Here two CPU burners run while two graders grade the
reference answers of chapters 1 and 2 side by side (hidden cases on, world sizes up to 6):
about 4 minutes on the course's 2-core machine.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from labs.checks.core import explain_hang, is_learners_frame
from labs.grading.handout import load_chapters, release_notebook
from labs.grading.isolation import isolation_problem
from labs.launcher import LaunchTimeout, launch
from labs.rank_pickle import pack_call

REFERENCE = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = ("01_toy_allreduce.ipynb", "02_allreduce_algorithms.ipynb")


@pytest.fixture
def burners() -> Iterator[None]:
    """Two processes that keep the machine's two cores busy."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def answered(directory: Path, name: str) -> Path:
    """The learner's copy of chapter ``name`` with every reference answer typed in."""
    chapter = next(c for c in load_chapters(REFERENCE) if c.name == name)
    nb = release_notebook(chapter)
    for ex in chapter.exercises:
        for i in ex.solutions:
            nb.cells[i].source = chapter.nb.cells[i].source
    directory.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, directory / name)
    return directory / name


class _ThroughTheGrader:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return importlib.import_module, ("labs.grading.submission",)


def test_a_rank_that_opens_a_sealed_function_imports_nothing_of_the_grader() -> None:
    from labs.grading.submission import Sealed  # noqa: PLC0415

    def worker(rank: int, world_size: int, fn: object) -> list[str]:
        import sys  # noqa: PLC0415 - in the rank; a local function travels by value

        return sorted(m for m in sys.modules
                      if m.split(".")[0] in ("nbclient", "nbformat", "jsonschema", "lark")
                      or m.startswith("labs.grading"))

    sealed = Sealed("f", pack_call(len, ()), None)
    (imported,) = launch(worker, 1, args=(sealed,), timeout=60, echo=False)
    assert imported == []
    # what a Sealed opened through labs.grading.submission, as it once was, brought along
    (imported,) = launch(worker, 1, args=(_ThroughTheGrader(),), timeout=60, echo=False)
    assert "labs.grading.grader" in imported and "nbclient" in imported


@pytest.mark.slow  # about 4 minutes: two graders and two burners on two cores
def test_right_answers_pass_with_the_cores_busy_and_two_graders_at_once(
        tmp_path, no_leftover_processes, burners) -> None:
    # burners after no_leftover_processes: fixtures end in reverse, so they are gone before
    # the check for leftovers runs
    problem = isolation_problem()
    if problem:
        pytest.skip(f"no sandbox on this machine: {problem}")
    graders = []
    for who in ("a", "b"):
        paths = [str(answered(tmp_path / who, name)) for name in CHAPTERS]
        report = tmp_path / f"{who}.json"
        graders.append((report, subprocess.Popen(
            [sys.executable, "-m", "labs.grading", "grade", *paths, "--seed", "11",
             "--json", str(report)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)))
    start = time.monotonic()
    for report, proc in graders:
        out, _ = proc.communicate(timeout=1800)
        assert proc.returncode == 0, out
        data = json.loads(report.read_text())
        assert data["passed"] == data["total"] == 2, out
    print(f"two graders, two burners: {time.monotonic() - start:.0f} s")


def test_a_hang_is_blamed_on_the_learner_only_where_a_rank_was_in_the_learners_code() -> None:
    """A busy machine once stopped right answers with "hung for 10 s ... Every rank must call
    all_reduce", naming a line of ``lark`` (imported by the rank) as where the learner's code
    waited. Frames of installed packages, the interpreter and labs are never the learner's."""
    import torch  # noqa: PLC0415

    installed = f'  File "{Path(torch.__file__).parent}/distributed/c10d.py", line 3 in wait'
    cell = '  File "/tmp/ipykernel_4242/3141.py", line 7 in my_ring_all_reduce'
    busy = LaunchTimeout([0, 1], 10, {0: installed, 1: installed})
    verdict, where = explain_hang(2, busy, 10)
    assert verdict is not None and "none of them was running your code" in verdict
    assert "--check-timeout" in verdict and not where
    stuck = LaunchTimeout([1], 10, {1: installed + "\n" + cell})
    assert explain_hang(2, stuck, 10) == (None, ' Rank 1 was waiting at File "<notebook cell>", '
                                                "line 7 in my_ring_all_reduce.")
    assert is_learners_frame(cell) and is_learners_frame("    Cell In[5], line 3")
    assert not is_learners_frame(installed)
