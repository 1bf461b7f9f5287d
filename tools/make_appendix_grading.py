"""Writes notebooks/A1_grading.ipynb: the instructor's appendix (release, collect, grade, read).

Run by `make notebooks` with the chapter scripts; edit here, then run `make notebooks`.
"""

from nbgen import CHECK, HIDE, code, md, write_notebook

cells = [
    md(r"""
# Appendix: grading the exercises

This page is for instructors. The notebooks of the book are the **reference**: they hold the
solutions (the dropdowns after each exercise) and, under each check cell, the verdict a right
answer prints. Grading takes four steps:

1. **release** a copy of the notebooks in which every solution is a stub;
2. **collect** the notebooks learners hand back;
3. **grade** them: one command runs each learner's code against the reference checks;
4. **read the report**: a table per exercise, a total, and JSON for a gradebook.

Every step below runs for real, in a scratch directory, on chapter 1's exercise.
"""),
    code("""
import json
import os
import shutil
import tempfile
from pathlib import Path

import nbformat
from IPython.display import Code, display

from labs.grading.grade import DEFAULT_REFERENCE_DIR, GradeSettings, grade
from labs.grading.release import load_chapters, release
from labs.viz import format_table

home = Path.cwd()
workspace = Path(tempfile.mkdtemp(prefix="grading-demo-"))
os.chdir(workspace)  # every path printed below is relative to this scratch directory
""", HIDE),
    md(r"""
## What the grader reads

The grader knows nothing about particular chapters. It reads four cell tags in the reference
notebooks:

| tag | on | meaning |
|---|---|---|
| `setup` | the chapter's import cell | run before the learner's code |
| `solution` + `exercise-N.M` | the reference answer | replaced by a stub on release |
| `check` + `exercise-N.M` | one `check_*(fn)` call | its stored output is the expected verdict |

So an exercise added to a later chapter is graded as soon as its cells carry these tags; no
grading code changes. These are the exercises it finds in the book today:
"""),
    code("""
chapters = load_chapters(DEFAULT_REFERENCE_DIR)
print(format_table(
    ["notebook", "exercise", "learner writes", "solution cells", "check cells"],
    [[c.name, e.exercise, ", ".join(e.submitted), len(e.solutions), len(e.checks)]
     for c in chapters for e in c.exercises]))
""", CHECK),
    md(r"""
## 1. Release

```bash
python -m labs.grading release handout/
```

writes one notebook per chapter with exercises. Outputs are cleared, and each solution cell
keeps the signatures of what it defines and raises `NotImplementedError`. The book-only parts
go too: a solution cell's `hide-input` tag and display metadata, and the saved widget state.
Everything else, the other tags included, stays as it is, and the copy records which chapter
it came from, so a learner may rename the file. The command refuses to overwrite an earlier handout unless given
`--force`.
"""),
    code("""
for item in release(DEFAULT_REFERENCE_DIR, Path("handout")):
    print(f"wrote {item.path} (stubbed: {', '.join(item.exercises)})")
""", CHECK),
    md(r"""
Exercise 1.1 as the learner receives it:
"""),
    code("""
handout = nbformat.read("handout/01_toy_allreduce.ipynb", as_version=4)
stub = next(c for c in handout.cells if "solution" in c.metadata.get("tags", []))
display(Code(stub.source, language="python"))
""", CHECK),
    md(r"""
## 2. Collect

Learners work in their copy and hand the notebook back; how they hand it in is up to you. The
grader reads only the code of the exercise cells (and any cell a learner added between an
exercise cell and its check), never their outputs. Here three learners hand in chapter 1: Ada
types the reference answer, Ben forgets to divide by the world size, and Cy never started.
"""),
    code("""
solution_index = handout.cells.index(stub)
reference = nbformat.read(DEFAULT_REFERENCE_DIR / "01_toy_allreduce.ipynb", as_version=4)
answer = reference.cells[solution_index].source


def hand_in(learner, source):
    nb = nbformat.read("handout/01_toy_allreduce.ipynb", as_version=4)
    nb.cells[solution_index].source = source
    path = Path("submissions", learner, "01_toy_allreduce.ipynb")
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


submissions = [
    hand_in("ada", answer),
    hand_in("ben", answer.replace("param.grad /= world_size", "pass  # (forgot)")),
    hand_in("cy", stub.source),
]
print(*submissions, sep="\\n")
""", CHECK),
    md(r"""
## 3. Grade

```bash
python -m labs.grading grade submissions/*/*.ipynb --json report.json
```

For each exercise of each notebook the grader works in two fresh kernels:

* the first runs the chapter's `setup` cells, the reference answers of the exercises before
  this one, then the learner's cells, and saves the functions the check takes;
* the second never runs a learner's cell. It loads those functions and runs the reference
  check cells under `pytest --nbval-lax`, compared with the outputs stored in the reference.
  Each check runs twice: as the learner saw it, and with `seed=` drawing **hidden cases**
  (other values, world sizes, odd sizes). The seed is printed, so a failure can be rerun
  with `--seed`.

Each exercise is graded on its own: the other exercises' code comes from the reference, so a
bug in 4.1 costs 4.1 only. Each stage has a time limit (`--timeout`, 300 s by default), and
every process a stage started is killed when it ends. The command prints a progress bar, then
the table; it exits with 0 when every exercise passed, 1 when any failed, and 2 on bad
input, such as a file that is not a notebook of the course (then nothing runs). The cell below
does what the command does (with the hidden cases' seed fixed so that this page is
reproducible):
"""),
    code("""
report = grade(submissions, GradeSettings(seed=1))
print(report.table())
""", CHECK),
    md(r"""
## 4. Read the report

The table gives each exercise's first line of explanation. `--json report.json` writes the
whole report: per exercise the result, the reason, every check's verdict (visible and hidden
cases) and the seconds it took. Ben's entry:
"""),
    code("""
ben = report.to_json()["notebooks"][1]["exercises"][0]
print(json.dumps({key: ben[key] for key in ("exercise", "result", "reason")}, indent=2))
print()
print(ben["details"])
""", CHECK),
    md(r"""
When a result is surprising, `--keep DIR` keeps what the grader generated for every
exercise: the first-stage notebook as it ran (with the learner's errors), the judging
notebook, and nbval's log.

## What the grader trusts, and what it does not

* A learner's stored outputs are never read, so editing them to show `PASS` changes nothing.
* The verdict comes from a kernel in which no learner's cell ran. Printing a fake `PASS` line,
  editing the check cell, redefining `check_average_gradients`, or monkeypatching
  `labs.checks` or `launch` in a cell only changes the learner's own kernel. The
  test suite (`tests/test_grading.py`) shows each of these cheats passing plain nbval and
  failing here.
* A syntax error, a crash, an infinite loop or a rank that hangs fails that exercise only,
  with the reason in the table.
* It is not a security sandbox. The learner's functions run in the ranks with your rights,
  and code written to attack the grader (a crafted pickle, reading files) could. Grade
  untrusted work inside a container.
"""),
    code("""
os.chdir(home)
shutil.rmtree(workspace)
""", HIDE),
]

write_notebook(cells, "A1_grading.ipynb")
