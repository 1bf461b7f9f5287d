"""The report of a GPU check, from what ``tools/gpu_check.sh`` left in its folder.

    python tools/gpu_report.py _build/gpu > _build/gpu/report.md

Reads ``env.txt`` (the machine: GPU, driver, Python, torch, CUDA, NCCL, cores) and the JUnit
files of the three stages (``gpu.xml``: tests/test_gpu.py; ``suite.xml``: the library's tests
with the GPU visible; ``nbval.xml``: every chapter's stored outputs), and writes Markdown: the
machine, then per stage what passed, failed, errored and was skipped, in how many seconds,
and a table of every failure with the first line of its message. A stage without its file is
reported as not run (its log says why: a time limit, a missing package). The report is the
starting point of ``reports/gpu/DATE.md``: the causes of the failures are a person's to add.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

#: The stages gpu_check.sh runs, in order: (JUnit file, what it holds).
STAGES = (("gpu.xml", "tests/test_gpu.py: the labs on NCCL and CUDA tensors"),
          ("suite.xml", "the library's tests with the GPU visible"),
          ("nbval.xml", "nbval of every chapter with CUDA visible"))


@dataclass
class Stage:
    """What one JUnit file says."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)  #: (test, first line)


def read_junit(path: Path) -> Stage:
    """Counts and failures of every test case in a pytest JUnit file."""
    stage = Stage()
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        stage.seconds += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
            outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            if outcome is None:
                stage.passed += 1
            elif outcome.tag == "skipped":
                stage.skipped += 1
            else:
                if outcome.tag == "failure":
                    stage.failed += 1
                else:
                    stage.errors += 1
                message = (outcome.get("message") or outcome.text or "").strip()
                stage.failures.append((name, message.splitlines()[0] if message else ""))
    return stage


def report(folder: Path) -> str:
    """The Markdown report of the check whose files are in ``folder``."""
    env = folder / "env.txt"
    lines = ["# GPU check", "", "## The machine", "", "```"]
    lines += (env.read_text().rstrip().splitlines() if env.exists()
              else ["(no env.txt: gpu_check.sh did not run here)"])
    lines += ["```", ""]
    for file, what in STAGES:
        path = folder / file
        if not path.exists():
            lines += [f"## {what}: not run", "", f"No `{file}`: see the stage's log.", ""]
            continue
        s = read_junit(path)
        lines += [f"## {what}: {s.passed} passed, {s.failed} failed, {s.errors} errors, "
                  f"{s.skipped} skipped ({s.seconds:.0f} s)", ""]
        if s.failures:
            lines += ["| test | first line of the message |", "| --- | --- |"]
            lines += [f"| `{name}` | {message.replace('|', '/')} |"
                      for name, message in s.failures]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python tools/gpu_report.py OUT_DIR (the folder gpu_check.sh wrote)",
              file=sys.stderr)
        return 2
    print(report(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
