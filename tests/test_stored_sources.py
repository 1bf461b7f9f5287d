"""The library code a chapter shows is the library's code now.

A chapter shows a `labs` function with ``display(Code(inspect.getsource(f)))``. nbval does
not compare that output (the cell is not a check), so after an edit of ``f`` the committed
notebook would go on showing the old code until someone re-executed it. This test compares
each stored listing with ``inspect.getsource`` of the same object today.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def listings(path: Path) -> list[tuple[str, str]]:
    """(expression, stored text) of every ``display(Code(inspect.getsource(EXPR), ...))``."""
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "getsource" and node.args):
                stored = [o for o in cell["outputs"] if "text/plain" in o.get("data", {})]
                assert len(stored) == 1, f"{path.name}: no single listing for {source!r}"
                found.append((ast.unparse(node.args[0]), "".join(stored[0]["data"]["text/plain"])))
    return found


def labs_namespace(path: Path) -> dict[str, object]:
    """Every name the notebook imports from ``labs``."""
    namespace: dict[str, object] = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            for node in ast.parse("".join(cell["source"])).body:
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labs"):
                    exec(compile(ast.Module([node], []), path.name, "exec"), namespace)
    return namespace


CASES = [(path, expr, stored) for path in NOTEBOOKS for expr, stored in listings(path)]


def test_the_book_shows_library_code():
    assert len(CASES) >= 6, [(p.name, e) for p, e, _ in CASES]


@pytest.mark.parametrize("path, expr, stored", CASES,
                         ids=[f"{p.stem}:{e}" for p, e, _ in CASES])
def test_a_listing_is_the_current_source(path, expr, stored):
    current = inspect.getsource(eval(expr, labs_namespace(path)))  # noqa: S307
    assert stored.rstrip() == current.rstrip(), (f"{path.name} shows an old {expr}: re-execute it "
                               f"(make chapter NB={path.stem[:2]})")


def test_notebooks_are_stored_without_timing_metadata():
    timed = [(path.name, i) for path in NOTEBOOKS
             for i, cell in enumerate(json.loads(path.read_text())["cells"])
             if "execution" in cell.get("metadata", {})]
    assert not timed, (f"cells with execution timestamps (re-execute with "
                       f"tools/execute_notebooks.py, or --strip-only them): {timed[:5]}")


def test_execute_notebooks_runs_in_place_and_stores_no_timing(tmp_path):
    import nbformat

    from tools.execute_notebooks import main

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os\nprint(6 * 7)"),
                                         nbformat.v4.new_code_cell("print(os.getcwd())")])
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    main([str(path)])
    done = nbformat.read(path, as_version=4)
    assert [c.outputs[0].text for c in done.cells] == ["42\n", f"{tmp_path}\n"]
    assert not any("execution" in c.metadata for c in done.cells)


def test_notebooks_are_stored_with_stable_widget_ids():
    import nbformat

    from tools.execute_notebooks import stable_widget_ids

    stored = {path: nbformat.read(path, as_version=4) for path in NOTEBOOKS}
    random_ids = [path.name for path, nb in stored.items()
                  if stable_widget_ids(nb, path.stem) != nb]
    assert not random_ids, (f"widget ids as the kernel drew them (re-execute with "
                            f"tools/execute_notebooks.py, or --strip-only them): {random_ids}")


def test_a_re_execution_gives_widgets_the_same_ids(tmp_path):
    import nbformat

    from tools.execute_notebooks import WIDGET_STATE, WIDGET_VIEW, main

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import ipywidgets as w\nw.VBox([w.IntSlider(3), w.Button(description='run')])")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = tmp_path / "panel.ipynb"
    nbformat.write(nb, path)
    main([str(path)])
    first = path.read_text()
    main([str(path)])
    assert path.read_text() == first  # the kernel drew new uuids; the stored ids did not move
    done = nbformat.read(path, as_version=4)
    state = done.metadata.widgets[WIDGET_STATE]["state"]
    shown = done.cells[0].outputs[0].data[WIDGET_VIEW]["model_id"]
    assert state[shown]["model_name"] == "VBoxModel"
    children = state[shown]["state"]["children"]  # references renamed with their models
    assert [state[c.removeprefix("IPY_MODEL_")]["model_name"] for c in children] == [
        "IntSliderModel", "ButtonModel"]
