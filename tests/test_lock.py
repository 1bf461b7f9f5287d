"""requirements.lock, the exact versions `make book` and `make test` install, agrees with
requirements.txt (the ranges) and pyproject.toml, and is what the environment under test has.

A dependency added to requirements.txt without `make lock`, a pin outside its range, or a
.venv left behind by an older lock fails here, with what to run.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from lock_diff import canonical, differences, installed, read_lock  # noqa: E402


def direct_requirements(text: str) -> list[Requirement]:
    """The requirements of a requirements.txt, comments and blank lines skipped."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [Requirement(line) for line in lines if line]


def lock_problems(requirements: list[Requirement], locked: dict[str, str]) -> list[str]:
    """What is wrong with a lock for these requirements: a package missing from it, or pinned
    to a version its range does not admit."""
    problems = []
    for req in requirements:
        pin = locked.get(canonical(req.name))
        if pin is None:
            problems.append(f"{req.name} is not in the lock")
        elif not req.specifier.contains(Version(pin), prereleases=True):
            problems.append(f"{req.name}=={pin} is outside {req.name}{req.specifier}")
    return problems


LOCK = read_lock(ROOT / "requirements.lock")
FIX = "run `make lock`, then `make test test-slow`, and commit requirements.lock"


def test_the_lock_pins_every_direct_requirement_inside_its_range():
    requirements = direct_requirements((ROOT / "requirements.txt").read_text())
    problems = lock_problems(requirements, LOCK)
    assert not problems, f"{'; '.join(problems)}: {FIX}"


def test_the_lock_pins_the_packages_labs_itself_needs():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needs = project["dependencies"] + project["optional-dependencies"]["grading"]
    problems = lock_problems([Requirement(r) for r in needs], LOCK)
    assert not problems, f"{'; '.join(problems)}: {FIX}"


def test_every_line_of_the_lock_is_an_exact_version():
    text = (ROOT / "requirements.lock").read_text()
    entries = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    loose = [line for line in entries if not re.fullmatch(r"[A-Za-z0-9._-]+==[\w.]+", line)]
    assert not loose, f"lock lines that are not name==version: {loose}"
    assert len(entries) == len(LOCK) > 50


def test_the_lock_keeps_the_cpu_torch_this_machine_installs():
    # pip finds torch==2.13.0 here as the CPU wheel on disk; a pin with its local label
    # (2.13.0+cpu) would not be found on PyPI, where a laptop looks.
    assert LOCK["torch"] == "2.13.0"


@pytest.mark.parametrize("requirements, lock, problem", [
    ("numpy>=1.26\n", {}, "numpy is not in the lock"),
    ("numpy>=1.26  # why\n", {"numpy": "1.25.2"}, "numpy==1.25.2 is outside numpy>=1.26"),
    ("Jupyter_Book>=1.0.4,<2\n", {"jupyter-book": "2.0.0"}, "Jupyter_Book==2.0.0 is outside"),
])
def test_a_stale_lock_is_caught(requirements, lock, problem):
    """The check above fails for a lock that misses a package or pins outside its range."""
    problems = lock_problems(direct_requirements(requirements), lock)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_the_environment_under_test_is_the_lock():
    """`make test` runs in what the lock says; `make test-latest` deliberately does not."""
    if os.environ.get("LABS_UNLOCKED"):
        pytest.skip("make test-latest: the newest releases, not the lock")
    rows = differences(LOCK, installed())
    assert not rows, (f"this environment differs from requirements.lock: {rows}; rebuild it "
                      "(rm -rf .venv && make env)")


def test_a_difference_from_the_lock_is_listed():
    rows = differences({"torch": "2.13.0", "numpy": "2.3.0"},
                       {"torch": "2.13.0+cpu", "numpy": "2.4.1", "extra": "1.0"})
    assert rows == [("extra", "-", "1.0"), ("numpy", "2.3.0", "2.4.1")]
