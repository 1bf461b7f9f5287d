"""What the grader reads and writes without running anything: the hand-ins it takes (a
regular file the learner gave, never a link, a FIFO, the reference or something huge), the
report it writes (any string a learner made is escaped, a notebook that cannot be graded is
its own row), the files it keeps and the limits of a stage's folder. Each test is an attack
that once got through, named in its docstring, and a wrong answer of the check that stops it
failing."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import nbformat
import pytest

from labs.grading import submission
from labs.grading.__main__ import EXIT_FAILED, main
from labs.grading.grader import GradeSettings, grade, match_chapter
from labs.grading.handins import MAX_NOTEBOOK_BYTES, hand_ins, parse_notebook, read_hand_in
from labs.grading.handout import load_chapters, release_notebook
from labs.grading.isolation import Isolation
from labs.grading.report import (
    ExerciseGrade,
    NotebookGrade,
    Report,
    Result,
    shown,
    shown_name,
)
from labs.grading.sandbox import DiskWatch, ProcessSweep, folder_usage

REFERENCE = Path(__file__).resolve().parents[1] / "notebooks"
TOY = "01_toy_allreduce.ipynb"
CHAPTERS = load_chapters(REFERENCE)


def released(directory: Path, name: str = TOY) -> Path:
    path = directory / name
    nbformat.write(release_notebook(next(c for c in CHAPTERS if c.name == TOY)), path)
    return path


# --- a hand-in is a regular file the learner gave -----------------------------------------------


def test_a_link_to_a_host_file_is_refused_and_never_read(tmp_path) -> None:
    """A hand-in that was a link to a host file (read as root, its start printed in the
    report) or to the reference notebook (graded as the learner's): refused before a read."""
    secret = tmp_path / "secret"
    secret.write_text("root's secret: 0xC0FFEE")
    (tmp_path / "in").mkdir()
    os.symlink(secret, tmp_path / "in" / TOY)
    os.symlink(REFERENCE / TOY, tmp_path / "in" / "02_allreduce_algorithms.ipynb")
    found = hand_ins([tmp_path / "in"], REFERENCE)
    assert [h.problem for h in found] == [
        "a link, not a notebook: hand in the notebook itself"] * 2
    assert all(h.notebook is None for h in found)
    assert "0xC0FFEE" not in json.dumps([h.problem for h in found])


def test_fifos_devices_hard_links_the_reference_and_huge_files_are_refused(tmp_path) -> None:
    os.mkfifo(tmp_path / "fifo.ipynb")  # would block a grader that opened it
    hard = released(tmp_path, "hard.ipynb")
    os.link(hard, tmp_path / "other.ipynb")
    big = tmp_path / "big.ipynb"
    with open(big, "wb") as handle:
        handle.truncate(MAX_NOTEBOOK_BYTES + 1)
    problems = {p.name: read_hand_in(p, REFERENCE).problem
                for p in (tmp_path / "fifo.ipynb", hard, big, REFERENCE / TOY)}
    assert problems["fifo.ipynb"].startswith("not a regular file")
    assert "hard links" in problems["hard.ipynb"]
    assert problems["big.ipynb"].startswith("larger than 32 MiB")
    assert problems[TOY] == "the reference notebook, not a learner's"
    (tmp_path / "fresh").mkdir()
    assert not read_hand_in(released(tmp_path / "fresh"), REFERENCE).problem  # the control


def test_a_folder_is_searched_without_following_links(tmp_path) -> None:
    (tmp_path / "alice").mkdir()
    (tmp_path / "bob" / "deep").mkdir(parents=True)
    released(tmp_path / "alice")
    released(tmp_path / "bob" / "deep")
    (tmp_path / "bob" / "notes.txt").write_text("not a notebook")
    os.symlink(tmp_path / "alice", tmp_path / "mallory")  # alice's work under another name
    found = hand_ins([tmp_path], REFERENCE)
    assert [(str(h.path.relative_to(tmp_path)), h.problem) for h in found] == [
        (f"alice/{TOY}", ""), (f"bob/deep/{TOY}", "")]


@pytest.mark.parametrize("data, problem", [
    (b"\xff\xfe", "not UTF-8 text (at byte 0)"),
    (b'{"cells": [', "not JSON (line 1, column 12)"),
    (b"[1, 2]", "no list of cells"),
    (b'{"cells": [], "nbformat": 3}', "not a notebook of format 4"),
    (b'{"cells": [{"cell_type": "code", "source": 7}], "nbformat": 4}', "source is not text"),
    (b"[" * 100_000, "nested too deep"),
])
def test_why_a_notebook_cannot_be_read_never_quotes_it(data, problem) -> None:
    with pytest.raises(Exception, match="not a notebook") as caught:
        parse_notebook(data)
    assert problem in str(caught.value)


def test_bad_metadata_fails_that_notebook_and_the_batch_goes_on(tmp_path, capsys,
                                                                 refuse_processes) -> None:
    """A chapter's metadata holding a list (unhashable) and a notebook of no chapter each
    stopped the batch before anyone was graded; each now fails alone."""
    odd = nbformat.v4.new_notebook()
    odd.metadata["labs"] = {"chapter": ["01_toy_allreduce.ipynb"]}
    nbformat.write(odd, tmp_path / "odd.ipynb")
    (tmp_path / "notes.ipynb").write_text("{}")
    (tmp_path / os.fsdecode(b"\xff\xe2\x88\x95.ipynb")).write_bytes(b"\x1b[2K\r")  # an
    # undecodable name with a look-alike slash; bytes that are no notebook
    found = hand_ins([tmp_path / "odd.ipynb", tmp_path / "notes.ipynb"], REFERENCE)
    assert "cannot tell which chapter" in match_chapter(found[0], CHAPTERS)
    assert match_chapter(found[1], CHAPTERS) == "not a notebook: no list of cells"
    with refuse_processes():
        report = grade([tmp_path], GradeSettings(hidden=False, isolation=Isolation.NONE))
        code = main(["grade", str(tmp_path), "--no-isolation", "--no-hidden"])
    assert [n.problem.split(":")[0] for n in report.notebooks] == [
        "not a notebook", "cannot tell which chapter it is", "not a notebook"]
    assert code == EXIT_FAILED and not report.passed
    out = capsys.readouterr().out
    assert re.search(r"notes.ipynb +- +FAIL +not a notebook: no list of cells", out)
    assert re.search(r"/\\udcff\\u2215.ipynb +- +FAIL +not a notebook: not JSON", out), out


# --- the report shows every learner-made string escaped -----------------------------------------


def test_control_characters_and_look_alikes_are_escaped() -> None:
    forged = "x\rPASS: \x1b[32mok\x1b[0m \u202egnp.\u200b \ud800 \u00a0é·"
    assert shown(forged) == ("x\\rPASS: \\x1b[32mok\\x1b[0m \\u202egnp.\\u200b \\ud800 "
                             "\\xa0é·")
    assert shown("a\nb") == "a\\nb" and shown("a\nb", lines=True) == "a\nb"
    assert shown_name("alice\u2215ex.ipynb") == "alice\\u2215ex.ipynb"
    assert shown_name(os.fsdecode(b"caf\xe9.ipynb")) == "caf\\udce9.ipynb"


def test_the_report_escapes_every_field_and_survives_any_string(tmp_path) -> None:
    """An exception message with ANSI escapes redrew a FAIL row as PASS in a terminal; a name
    with a look-alike slash passed for another learner's row; a lone surrogate or an
    undecodable name crashed the writing of everyone's report."""
    evil = "\x1b[1A\x1b[2K\rPASS  all good \ud800"
    report = Report(5, (
        NotebookGrade(Path("bob\u2215" + os.fsdecode(b"\xff.ipynb")), TOY, (
            ExerciseGrade("1.1", "t", Result.FAIL, shown(evil), shown(evil, lines=True)),)),
        NotebookGrade(Path("odd.ipynb"), "", (), problem=shown(evil))))
    table = report.table()
    assert "\x1b" not in table and "\r" not in table and "\ud800" not in table
    assert "bob\\u2215\\udcff.ipynb  1.1       FAIL    \\x1b[1A" in table
    table.encode("ascii", errors="strict")  # nothing a terminal could misread
    data = json.dumps(report.to_json())
    data.encode("ascii")
    assert json.loads(data)["notebooks"][1]["problem"].startswith("\\x1b[1A")
    assert not report.passed


def test_the_learners_reason_holds_no_hidden_case_and_the_instructor_sees_it() -> None:
    graded = ExerciseGrade("2.1", "t", Result.FAIL, "the documented cases pass, but a hidden "
                           "case failed", "FAIL [a hidden case, for the instructor]: seed 7",
                           checks=({"passed": False, "hidden": True, "message": "seed 7"},))
    entry = Report(7, (NotebookGrade(Path("a.ipynb"), TOY, (graded,)),)).to_json()[
        "notebooks"][0]["exercises"][0]
    assert "seed" not in entry["reason"]
    assert entry["instructor"]["checks"][0]["hidden"] is True


# --- what the grader keeps, and the limits of a stage -------------------------------------------


def test_keep_copies_what_it_can_and_never_stops_the_batch(tmp_path) -> None:
    """A file name too long for the --keep folder (ENAMETOOLONG) stopped the whole batch."""
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "file").write_text("kept")
    (root / "a" / ("n" * 250)).write_text("its kept path is longer than the system allows")
    os.mkfifo(root / "a" / "pipe")
    keep = tmp_path / "keep"
    while len(str(keep)) < 3880:  # PATH_MAX 4096: "a/file" fits below it, the long name not
        keep = keep / ("k" * min(250, 3880 - len(str(keep))))
    assert submission.keep_files(root, keep) == 2  # the pipe and the long name
    assert (keep / "a" / "file").read_text() == "kept"


def test_a_folder_past_its_size_or_count_is_seen(tmp_path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 4096)
    assert not folder_usage(tmp_path, 1 << 20, 10)
    assert folder_usage(tmp_path, 1024, 10)
    with open(tmp_path / "sparse", "wb") as handle:  # a sparse file counts what it claims
        handle.truncate(1 << 30)
    assert folder_usage(tmp_path, 1 << 20, 10)
    (tmp_path / "sparse").unlink()
    for i in range(12):
        (tmp_path / f"f{i}").touch()
    assert folder_usage(tmp_path, 1 << 20, 10)


def test_a_stage_that_fills_its_folder_is_stopped(tmp_path) -> None:
    """A stage writes 1 MiB files at the page cache's speed (about 1 GB/s here: 47 GiB or more
    in one 300 s stage, each file under the per-file cap): the folder is watched, more often
    while it grows, and the stage's processes killed past the limit. Quiet or beside two
    burners it kept 49-79 MiB for a 32 MiB limit; CI once kept 256 MiB when the watch looked
    only every 0.2 s."""
    import subprocess  # noqa: PLC0415

    script = ("import itertools\nfor i in itertools.count():\n"
              "    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n")
    with ProcessSweep() as sweep, DiskWatch(tmp_path, 32 << 20, sweep) as disk:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
        done = threading.Event()
        threading.Timer(30, done.set).start()
        while proc.poll() is None and not done.is_set():
            time.sleep(0.05)
    assert disk.exceeded and proc.returncode is not None
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) < 256 << 20
    assert "wrote more than 32 MiB" in disk.words()


def test_the_check_timeout_reaches_every_check_call_and_the_report() -> None:
    chapter = next(c for c in CHAPTERS if c.name == TOY)
    (call,) = chapter.exercise("1.1").calls
    assert call.with_keywords(seed=7, timeout=30.0) == (
        "check_average_gradients(average_gradients, seed=7, timeout=30.0)")
    assert "each check's ranks had 30 s (--check-timeout)" in Report(
        7, (), check_timeout=30.0).table()
    assert "--check-timeout" not in Report(7, ()).table()
    with pytest.raises(Exception, match="check_timeout must be a positive"):
        GradeSettings(check_timeout=0)
