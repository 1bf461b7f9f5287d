"""The two hand-offs between grading stages, called from inside the grading kernels.

Stage 1 (the learner's kernel) runs the setup cells and the learner's cells, then
:func:`export` writes the functions the checks need, each pickled by value with cloudpickle,
and an index saying which names were found. Stage 2 (a fresh kernel that never ran a
learner's cell) calls :func:`load` to get those functions, runs the reference check cells
through nbval, then :func:`write_verdicts` records what each check said.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

#: Per exported name: ``{"ok": true}`` or ``{"error": "why it could not be exported"}``.
INDEX = "index.json"


def _blob(directory: Path, name: str) -> Path:
    return directory / f"{name}.pkl"


def export(namespace: Mapping[str, Any], names: Sequence[str], directory: str) -> None:
    """Pickle ``namespace[name]`` for each name into ``directory`` and write the index."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, dict[str, object]] = {}
    for name in names:
        if name not in namespace:
            index[name] = {"error": f"`{name}` is not defined after your cells ran."}
            continue
        value = namespace[name]
        if not callable(value):
            index[name] = {"error": f"`{name}` is a {type(value).__name__}, not a function."}
            continue
        try:
            _blob(out, name).write_bytes(cloudpickle.dumps(value))
        except Exception as err:  # noqa: BLE001 - any pickling failure is the learner's to see
            index[name] = {"error": f"`{name}` cannot be sent to the ranks: {err!r}"}
            continue
        index[name] = {"ok": True}
    (out / INDEX).write_text(json.dumps(index))


def read_index(directory: Path) -> dict[str, dict[str, object]]:
    """The export index, read by the grader without unpickling anything."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def load(directory: str) -> dict[str, Any]:
    """The exported functions, by name (in the judging kernel)."""
    out = Path(directory)
    return {name: cloudpickle.loads(_blob(out, name).read_bytes())
            for name, entry in read_index(out).items() if entry.get("ok")}


def write_verdicts(results: Sequence[Any], path: str) -> None:
    """Record each check's :class:`labs.checks.CheckResult` as JSON."""
    Path(path).write_text(json.dumps([
        {"exercise": r.exercise, "passed": bool(r.passed), "message": str(r.message)}
        for r in results
    ]))
