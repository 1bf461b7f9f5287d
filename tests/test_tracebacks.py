"""A rank's traceback shows the learner's source lines and where they were written: the
notebook cell (``Cell In[n]``, as IPython names it) or the file. With real ranks, for a
function defined in a Jupyter kernel, in a module file that travels by value, and in code
whose only copy is in :mod:`linecache`.

cloudpickle 3.1.3 renames the file of every code object it sends by value to
``<dynamic-code>``, so the traceback lost both. The suite runs with the cloudpickle of
``requirements.lock`` (the newest release when it was locked); the last test runs this module
again with the oldest release ``requirements.txt`` admits, installed beside it.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import nbformat
import pytest
from nbclient import NotebookClient
from packaging.version import Version

from labs import RankError, launch
from labs.checks.core import clean_traceback

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

ROOT = Path(__file__).resolve().parents[1]
#: Set by test_the_oldest_cloudpickle_shows_them_too for the run it starts.
EXPECTED = os.environ.get("LABS_TEST_CLOUDPICKLE")


def test_the_cloudpickle_under_test_is_the_one_asked_for():
    """The run with the oldest release really imports it (not the environment's own)."""
    if EXPECTED is None:
        pytest.skip("runs inside test_the_oldest_cloudpickle_shows_them_too")
    assert Version(cloudpickle.__version__) == Version(EXPECTED)


CELLS = [
    "import torch.distributed as dist\nfrom labs import RankError, launch",
    "def helper(x):\n    return x.no_such_attribute  # the learner's bug\n",
    "def worker(rank, world_size):\n    dist.barrier()\n    return helper(rank)\n",
    "import cloudpickle\n"
    "try:\n"
    "    launch(worker, 2, backend='gloo', echo=False)\n"
    "except RankError as err:\n"
    "    print(err.remote_traceback)\n"
    "print('cloudpickle', cloudpickle.__version__)\n",
]


def test_a_function_defined_in_a_notebook_cell(tmp_path):
    """In a real kernel: each frame names its cell as IPython does and shows its line."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    client = NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = notebook.cells[-1].outputs
    assert not [o for o in outputs if o.output_type == "error"], outputs
    text = "".join(o.text for o in outputs if o.get("name") == "stdout")
    assert "Cell In[3], line 3, in worker\n    return helper(rank)\n" in text, text
    assert ("Cell In[2], line 2, in helper\n"
            "    return x.no_such_attribute  # the learner's bug\n") in text, text
    assert "AttributeError: 'int' object has no attribute 'no_such_attribute'" in text
    assert "ipykernel_" not in text and "<dynamic-code>" not in text
    used = re.search(r"^cloudpickle (\S+)$", text, re.MULTILINE).group(1)
    assert Version(used) == Version(EXPECTED or cloudpickle.__version__)


MODULE = """\
import torch.distributed as dist


def worker(rank, world_size):
    dist.barrier()
    if rank == 1:
        raise KeyError(f"rank {rank} looked up a missing key")
    return rank
"""


def test_a_function_from_a_module_file_sent_by_value(tmp_path):
    """A module the ranks do not import travels by value; the frame names its file."""
    path = tmp_path / "learner_module.py"
    path.write_text(MODULE)
    spec = importlib.util.spec_from_file_location("learner_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[module.__name__] = module  # cloudpickle sends only imported modules by value
    cloudpickle.register_pickle_by_value(module)
    try:
        with pytest.raises(RankError) as info:
            launch(module.worker, 2, backend="gloo", timeout=60.0, echo=False)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[module.__name__]
    text = info.value.remote_traceback
    assert info.value.rank == 1
    assert (f'File "{path}", line 7, in worker\n'
            '    raise KeyError(f"rank {rank} looked up a missing key")\n') in text, text


def test_code_whose_only_copy_is_in_linecache(tmp_path):
    """Code compiled from a string that no file holds (as a kernel compiles a cell): its lines
    travel with it, so the rank shows them."""
    filename = str(tmp_path / "no-such-file.py")  # never written
    source = "def worker(rank, world_size):\n    return 1 / (rank - rank)\n"
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    scope: dict = {}
    exec(compile(source, filename, "exec"), scope)
    try:
        with pytest.raises(RankError) as info:
            launch(scope["worker"], 2, backend="gloo", timeout=60.0, echo=False)
    finally:
        del linecache.cache[filename]
    assert (f'File "{filename}", line 2, in worker\n'
            "    return 1 / (rank - rank)\n") in info.value.remote_traceback


def oldest_cloudpickle() -> str:
    """The lower bound of cloudpickle in requirements.txt."""
    text = (ROOT / "requirements.txt").read_text()
    found = re.search(r"^cloudpickle>=([\d.]+)", text, re.MULTILINE)
    assert found, "requirements.txt should give cloudpickle a lower bound (cloudpickle>=X)"
    return found.group(1)


@pytest.mark.slow
def test_the_oldest_cloudpickle_shows_them_too(tmp_path):
    """Runs the tests above again with the oldest cloudpickle the course admits, installed
    with pip into a folder put first on the path of the kernel and the ranks."""
    if EXPECTED is not None:
        pytest.skip("this is already the run with the oldest release")
    version = oldest_cloudpickle()
    target = tmp_path / f"cloudpickle-{version}"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
         str(target), f"cloudpickle=={version}"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"pip could not install cloudpickle=={version} (no package index?): "
                    f"{pip.stderr.strip()[-300:]}")
    env = {**os.environ, "LABS_TEST_CLOUDPICKLE": version,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(target),
                                                        os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(Path(__file__)), "-k", "not oldest"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "5 passed" in run.stdout, run.stdout[-1000:]


def test_a_check_verdict_keeps_the_cell_frames_and_drops_its_own():
    """A check shows the learner's frames, as the launcher named them, without its own."""
    check = "/venv/labs/checks/ddp.py"
    text = ("Traceback (most recent call last):\n"
            f'  File "{check}", line 10, in _run\n    average_gradients(model)\n'
            "  Cell In[4], line 2, in average_gradients\n    p.grad /= n\n"
            f'  File "{check}", line 20, in hook\n    raise TypeError(note)\n'
            "TypeError: boom\n")
    assert clean_traceback(text, check) == (
        "Traceback (most recent call last):\n"
        "  Cell In[4], line 2, in average_gradients\n    p.grad /= n\n"
        "TypeError: boom")
