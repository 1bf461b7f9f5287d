"""Execute notebooks in place and store them without per-cell timing metadata.

    python tools/execute_notebooks.py notebooks/02_allreduce_algorithms.ipynb [...]
    python tools/execute_notebooks.py --strip-only notebooks/*.ipynb

`jupyter execute` would record when every cell started and finished (``metadata.execution``),
so each re-execution rewrote every cell of the committed notebook; and it ignores
``--NotebookClient.record_timing=False``, because it does not hand its configuration to the
client it builds. This runs nbclient directly, with timing off, in the notebook's folder as
`jupyter execute` does. ``--strip-only`` removes the metadata without executing anything.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbclient import NotebookClient

#: Seconds one cell may run: generous, since the stored outputs are what nbval compares.
CELL_TIMEOUT_S = 600


def strip_timing(nb: nbformat.NotebookNode) -> None:
    for cell in nb.cells:
        cell.metadata.pop("execution", None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--strip-only", action="store_true",
                        help="only remove the timing metadata; execute nothing")
    opts = parser.parse_args(argv)
    for path in opts.notebooks:
        nb = nbformat.read(path, as_version=4)
        strip_timing(nb)
        if not opts.strip_only:
            print(f"executing {path}", flush=True)
            NotebookClient(nb, timeout=CELL_TIMEOUT_S, record_timing=False,
                           resources={"metadata": {"path": str(path.parent)}}).execute()
        nbformat.write(nb, path)


if __name__ == "__main__":
    main()
