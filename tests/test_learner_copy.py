"""tools/learner_copy.py (`make learner`): a learner's own copy of the chapters, one .ipynb
each with its outputs, unpaired from its .md, that never overwrites what the learner changed."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from tools.learner_copy import MANIFEST, REFERENCE_DIR, Outcome, copy_chapters, main


def _chapter(path: Path, text: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A chapter"),
        nbformat.v4.new_code_cell("print(1)", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text=text)])])
    nb.metadata["jupytext"] = {"formats": "ipynb,md:myst"}
    nbformat.write(nb, path)
    path.with_suffix(".md").write_text("# A chapter\n")


def _outcomes(copied: list) -> dict[str, Outcome]:
    return {c.path.name: c.outcome for c in copied}


def test_the_copy_is_one_notebook_per_chapter_with_its_outputs_and_no_pairing(
        tmp_path: Path) -> None:
    ref, out = tmp_path / "notebooks", tmp_path / "mine"
    ref.mkdir()
    _chapter(ref / "01_a.ipynb", "one\n")
    _chapter(ref / "02_b.ipynb", "two\n")
    assert _outcomes(copy_chapters(ref, out)) == {"01_a.ipynb": Outcome.WRITTEN,
                                                  "02_b.ipynb": Outcome.WRITTEN}
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "01_a.ipynb", "02_b.ipynb"]
    nb = nbformat.read(out / "01_a.ipynb", as_version=4)
    assert nb.cells[1].outputs[0]["text"] == "one\n"
    assert "jupytext" not in nb.metadata
    assert _outcomes(copy_chapters(ref, out)) == dict.fromkeys(
        ("01_a.ipynb", "02_b.ipynb"), Outcome.UNCHANGED)


def test_a_changed_reference_replaces_an_untouched_copy_and_never_a_learner_s_edit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref, out = tmp_path / "notebooks", tmp_path / "mine"
    ref.mkdir()
    _chapter(ref / "01_a.ipynb", "one\n")
    _chapter(ref / "02_b.ipynb", "two\n")
    copy_chapters(ref, out)
    mine = out / "02_b.ipynb"
    edited = nbformat.read(mine, as_version=4)
    edited.cells[1].source = "print('my answer')"
    nbformat.write(edited, mine)
    learners_bytes = mine.read_bytes()
    _chapter(ref / "01_a.ipynb", "one, re-executed\n")
    _chapter(ref / "02_b.ipynb", "two, re-executed\n")
    (out / "03_c.ipynb").write_text("{}")  # there before, not written by the tool
    _chapter(ref / "03_c.ipynb", "three\n")

    assert main([str(out), "--reference", str(ref)]) == 0
    printed = capsys.readouterr().out
    assert nbformat.read(out / "01_a.ipynb", as_version=4).cells[1].outputs[0]["text"] == (
        "one, re-executed\n")
    assert mine.read_bytes() == learners_bytes
    assert (out / "03_c.ipynb").read_text() == "{}"
    assert f"updated  {out / '01_a.ipynb'}" in printed
    assert f"kept  {mine}" in printed and f"kept  {out / '03_c.ipynb'}" in printed
    assert "Kept 2 notebook(s) you changed" in printed and "rename or delete it" in printed
    # and it stays kept: the learner's file is never taken for the tool's
    assert _outcomes(copy_chapters(ref, out))["02_b.ipynb"] is Outcome.KEPT


def test_the_reference_folder_itself_is_refused(tmp_path: Path) -> None:
    _chapter(tmp_path / "01_a.ipynb", "one\n")
    with pytest.raises(ValueError, match="reference folder"):
        copy_chapters(tmp_path, tmp_path)
    assert main([str(tmp_path), "--reference", str(tmp_path)]) == 2


def test_the_course_s_chapters_copy(tmp_path: Path) -> None:
    copied = copy_chapters(REFERENCE_DIR, tmp_path)
    names = {c.path.name for c in copied}
    assert names == {p.name for p in REFERENCE_DIR.glob("*.ipynb")}
    assert "03_reduce_scatter.ipynb" in names and not list(tmp_path.glob("*.md"))
    for path in tmp_path.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        assert "jupytext" not in nb.metadata
        nbformat.validate(nb)
