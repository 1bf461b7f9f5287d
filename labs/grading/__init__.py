"""Grading for instructors: learners' copies with the solutions stubbed, graded with nbval.

* :mod:`labs.grading.notebook` - the cell tags that mark setup, solution and check cells, and
  how a reference notebook and a learner's notebook are read.
* :mod:`labs.grading.handout` - ``python -m labs.grading release OUT_DIR``: the learners'
  copies.
* :mod:`labs.grading.grader` - ``python -m labs.grading grade STUDENT.ipynb [...]``: the
  learner's code in one kernel, the reference checks under nbval in another.
* :mod:`labs.grading.handins` - what ``grade`` takes: notebooks and folders, read safely.
* :mod:`labs.grading.report` - the report: the learner's reasons, the instructor's details.
* :mod:`labs.grading.submission` - the hand-off between those two kernels.
* :mod:`labs.grading.sandbox` - every process a grading stage started is killed when it ends.
"""

from labs.grading.grader import GradeSettings, grade
from labs.grading.handout import release
from labs.grading.notebook import CellTag, Chapter, GradingError
from labs.grading.report import Report, Result

__all__ = ["CellTag", "Chapter", "GradeSettings", "GradingError", "Report", "Result", "grade",
           "release"]
