"""Execute chapters in place and store them without per-cell timing metadata.

    python tools/execute_notebooks.py notebooks/02_allreduce_algorithms.md [...]
    python tools/execute_notebooks.py --strip-only notebooks/*.ipynb

A chapter is a MyST Markdown notebook (``notebooks/NN_name.md``, what an author edits) paired
by jupytext with ``notebooks/NN_name.ipynb`` (the executed outputs that nbval, the grader and
the book use). Given either file, this first brings the pair into agreement with ``jupytext
--sync`` (from whichever of the two was edited last, keeping the outputs of unchanged cells),
then executes the ``.ipynb``. ``make chapter NB=02`` runs it on one chapter, ``make
notebooks`` on all.

`jupyter execute` would record when every cell started and finished (``metadata.execution``),
so each re-execution rewrote every cell of the committed notebook; and it ignores
``--NotebookClient.record_timing=False``, because it does not hand its configuration to the
client it builds. This runs nbclient directly, with timing off, in the notebook's folder as
`jupyter execute` does.

Widgets get ids of their own too: the kernel names each widget model with a random uuid, in
the outputs that display it and in the widget state saved with the notebook (which the
rendered book uses to draw it), so every re-execution rewrote each panel's few hundred lines
of state. Ids are renamed to ones derived from the notebook's name and the order in which its
outputs reach the models, so a re-execution changes only what did change.

``--strip-only`` does both to the stored notebooks without executing anything.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
from pathlib import Path

import nbformat
from jupytext.cli import jupytext
from nbclient import NotebookClient

#: Seconds one cell may run: generous, since the stored outputs are what nbval compares.
CELL_TIMEOUT_S = 600

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
#: How one widget's state refers to another (its children, layout, style).
_REFERENCE = re.compile(r"IPY_MODEL_([0-9a-f]{32})")


def strip_timing(nb: nbformat.NotebookNode) -> None:
    for cell in nb.cells:
        cell.metadata.pop("execution", None)


def _model_order(nb: nbformat.NotebookNode, state: dict[str, dict]) -> list[str]:
    """Every widget model id, in an order that does not depend on the ids: breadth first
    from the models the outputs display, in cell order, through the references in each
    model's state; then models nothing displays, by their content."""
    queue = collections.deque(
        output["data"][WIDGET_VIEW]["model_id"]
        for cell in nb.cells for output in cell.get("outputs", [])
        if WIDGET_VIEW in output.get("data", {}))
    order: list[str] = []
    while queue:
        model = queue.popleft()
        if model in order:
            continue
        order.append(model)
        if model in state:
            queue.extend(_REFERENCE.findall(json.dumps(state[model], sort_keys=True)))

    # A model nothing displays (a jslink's Link) is known by its content, the models it
    # refers to named by their place in the order: links that differ only in which control
    # and stack they tie keep one order, whatever ids the kernel drew.
    place = {model: i for i, model in enumerate(order)}

    def content(model: str) -> str:
        return _REFERENCE.sub(lambda ref: f"IPY_MODEL_{place.get(ref.group(1), '?')}",
                              json.dumps(state[model], sort_keys=True))

    return order + sorted((m for m in state if m not in order), key=content)


def stable_widget_ids(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """``nb`` with every widget model id replaced by one derived from ``name`` and the
    model's place in :func:`_model_order`, everywhere it occurs."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    order = _model_order(nb, state)
    if not order:
        return nb
    text = nbformat.writes(nb)
    # Through a placeholder first, so that a new id can never be taken for an old one.
    for i, model in enumerate(order):
        text = text.replace(model, f"@widget-{i}@")
    for i in range(len(order)):
        new = hashlib.sha1(f"{name}:{i}".encode()).hexdigest()[:32]
        text = text.replace(f"@widget-{i}@", new)
    return nbformat.reads(text, as_version=4)


def synced(path: Path) -> Path:
    """The ``.ipynb`` of the chapter ``path`` (its ``.md`` or its ``.ipynb``), once jupytext
    has brought the two into agreement."""
    if path.suffix not in (".md", ".ipynb") or not path.exists():
        raise SystemExit(f"{path}: not a chapter; give notebooks/NN_name.md (or its .ipynb)")
    if path.with_suffix(".md").exists():
        jupytext(["--sync", "--quiet", str(path.with_suffix(".md"))])
    return path.with_suffix(".ipynb")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--strip-only", action="store_true",
                        help="only remove the timing metadata and rename widget ids; "
                             "execute nothing")
    opts = parser.parse_args(argv)
    for chapter in opts.notebooks:
        path = synced(chapter)
        nb = nbformat.read(path, as_version=4)
        strip_timing(nb)
        if not opts.strip_only:
            print(f"executing {path}", flush=True)
            NotebookClient(nb, timeout=CELL_TIMEOUT_S, record_timing=False,
                           resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(stable_widget_ids(nb, path.stem), path)


if __name__ == "__main__":
    main()
