"""A learner's own copy of the chapters, to open and run in JupyterLab (`make learner`).

    python tools/learner_copy.py [OUT]        # OUT defaults to my-notebooks/ (git-ignored)

``notebooks/`` holds the reference notebooks: nbval compares their stored outputs and the
book and the grader read them, so they are not for running and saving (JupyterLab autosaves
a notebook whose cells ran), and a file browser lists each chapter twice there, the executed
``.ipynb`` beside its MyST source ``.md``. The copy is one ``.ipynb`` per chapter, with its
outputs (a chapter reads like the book before any cell runs) and its solutions (the book
shows them folded; ``python -m labs.grading release`` makes the copies with stubs that an
instructor hands out), unpaired from its ``.md`` (no jupytext metadata, so a Jupyter with
jupytext writes no ``.md`` beside it).

Run again, it brings in the chapters that changed since and never overwrites a learner's
work: a notebook in OUT that differs from what this wrote there (``OUT/.labs-copy.json``
keeps a digest of each) is kept as it is, and the run says so.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DIR = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "my-notebooks"
#: In OUT: what this wrote there last, ``{file name: sha256 of its bytes}``.
MANIFEST = ".labs-copy.json"


class Outcome(enum.Enum):
    """What happened to one chapter's copy."""

    WRITTEN = "written"  #: there was none: the copy was written
    UPDATED = "updated"  #: the reference changed and the learner had not: replaced
    UNCHANGED = "unchanged"  #: already the current reference's copy
    KEPT = "kept"  #: the learner changed it (or it was not written here): left as it is


@dataclass(frozen=True)
class Copied:
    """One chapter of a learner's copy."""

    path: Path
    outcome: Outcome


def learner_notebook(reference: Path) -> bytes:
    """The learner's copy of one reference notebook, as the bytes to write."""
    nb = nbformat.read(reference, as_version=4)
    nb.metadata.pop("jupytext", None)  # paired, a Jupyter with jupytext writes a .md beside it
    text = nbformat.writes(nb)
    return (text if text.endswith("\n") else text + "\n").encode("utf-8")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def copy_chapters(reference_dir: Path, out_dir: Path) -> list[Copied]:
    """Write the learner's copy of every ``*.ipynb`` of ``reference_dir`` into ``out_dir``
    (same file names), keeping every copy the learner changed."""
    reference_dir, out_dir = Path(reference_dir), Path(out_dir)
    if out_dir.resolve() == reference_dir.resolve():
        raise ValueError(f"{out_dir} is the reference folder: a copy there would overwrite "
                         "the notebooks nbval compares. Choose another folder.")
    references = sorted(reference_dir.glob("*.ipynb"))
    if not references:
        raise ValueError(f"{reference_dir} holds no notebooks (*.ipynb).")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST
    written = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    copied = []
    for reference in references:
        target = out_dir / reference.name
        new = learner_notebook(reference)
        if not target.exists():
            outcome = Outcome.WRITTEN
        else:
            here = _digest(target.read_bytes())
            if here == _digest(new):
                outcome = Outcome.UNCHANGED
            elif here == written.get(reference.name):
                outcome = Outcome.UPDATED
            else:
                copied.append(Copied(target, Outcome.KEPT))
                continue
        if outcome is not Outcome.UNCHANGED:
            target.write_bytes(new)
        written[reference.name] = _digest(new)
        copied.append(Copied(target, outcome))
    manifest_path.write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT,
                        help="where to write the copy (default: my-notebooks/)")
    parser.add_argument("--reference", type=Path, default=REFERENCE_DIR,
                        help="the reference notebooks (default: notebooks/)")
    args = parser.parse_args(argv)
    try:
        copied = copy_chapters(args.reference, args.out)
    except ValueError as err:
        print(f"learner_copy: {err}", file=sys.stderr)
        return 2
    for item in copied:
        if item.outcome is not Outcome.UNCHANGED:
            print(f"{item.outcome.value:>9}  {item.path}")
    kept = [c.path for c in copied if c.outcome is Outcome.KEPT]
    if kept:
        print(f"\nKept {len(kept)} notebook(s) you changed (or that were there before), "
              "not overwritten. For the current version of one, rename or delete it and run "
              "`make learner` again.")
    unchanged = sum(c.outcome is Outcome.UNCHANGED for c in copied)
    if unchanged:
        print(f"{unchanged} notebook(s) already up to date.")
    print(f"\nOpen them in JupyterLab: .venv/bin/jupyter lab {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
