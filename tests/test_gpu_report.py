"""tools/gpu_report.py: the report of a GPU check, from real JUnit files that pytest wrote
here (one test passing, one failing, one skipped) and an env.txt as gpu_check.sh writes it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parents[1] / "tools" / "gpu_report.py"

CASES = '''
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="no GPU here")
def test_skipped():
    pass
'''


def test_the_report_counts_each_stage_and_names_each_failure(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "env.txt").write_text("NVIDIA H200, 580.159.04, 143771 MiB\ntorch 2.11.0+cu130\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-p", "no:xdist", f"--junitxml={out / 'gpu.xml'}",
                    str(tmp_path / "test_cases.py")], cwd=tmp_path, capture_output=True)
    done = subprocess.run([sys.executable, str(TOOL), str(out)], capture_output=True,
                          text=True, check=True)
    text = done.stdout
    assert "NVIDIA H200, 580.159.04" in text
    assert "tests/test_gpu.py: the labs on NCCL and CUDA tensors: 1 passed, 1 failed, " \
           "0 errors, 1 skipped" in text
    assert "| `test_cases::test_fails` | AssertionError: one is not two" in text
    assert "test_passes" not in text  # only failures are listed
    # the stages that left no file are said not to have run, not counted as passing
    assert "the library's tests with the GPU visible: not run" in text
    assert "nbval of every chapter with CUDA visible: not run" in text


def test_a_folder_that_is_not_there_is_refused_with_the_usage(tmp_path):
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "missing")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "usage: python tools/gpu_report.py OUT_DIR" in done.stderr
