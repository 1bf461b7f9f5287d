"""The two hand-offs between grading stages, and how the grader carries one to the other.

Stage 1 (the learner's kernel) runs the setup cells and the learner's cells, then
:func:`export` writes the functions the checks need, each pickled by value as the launcher
sends a function to its ranks, and an index saying which names were found, with each one's
parameters. Everything stage 1 leaves is the learner's: their
code can replace :func:`export` and write any file, link or folder there. So the grader
(outside any sandbox) carries across only what it asked for (:func:`carry`): the index and the
pickles of the exercise's own names, each a regular file read without following a link and
within a size, into a folder of its own. Stage 2 (a fresh kernel that never ran a learner's
cell) calls :func:`load` for those names only, runs the reference check cells through nbval,
then :func:`write_verdicts` records what each check said.

The judge never unpickles the learner's functions: unpickling runs code (an object's
``__reduce__``), which could rewrite the checks before they run. :func:`load` gives the judge
a :class:`Sealed` function for each name, holding the pickle and the parameters stage 1
read; the checks pass it to their ranks, where it is unpickled and run, and the ranks' results
come back as plain data (:mod:`labs.plain_results`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from labs.rank_pickle import pack_call, unpack_function

#: The folder, inside a stage's own folder, that holds the exported functions.
EXPORT = "submission"
#: Per exported name: ``{"ok": true}`` or ``{"error": "why it could not be exported"}``.
INDEX = "index.json"
#: The most bytes the grader reads of one file a stage left (a pickled function is a few KiB;
#: the index and the verdicts less).
MAX_FILE_BYTES = 16 << 20
#: The longest export error carried to the report.
_MAX_ERROR_CHARS = 500


class UnsafeFile(OSError):
    """A file a stage left that the grader will not read: a link, a folder, a device, a pipe,
    missing, or over :data:`MAX_FILE_BYTES`. The message says which."""


def read_left(folder: Path, *names: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of ``folder/names[0]/.../names[-1]``, a file a sandboxed stage wrote under
    ``folder`` (a folder the grader made): every component opened without following a link,
    the last one a regular file of at most ``limit`` bytes. Raises :class:`UnsafeFile`."""
    where = "/".join(names)
    if not names or any(part in ("", ".", "..") or "/" in part for part in names):
        raise UnsafeFile(f"{where}: not a path of plain names")
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    except OSError as err:
        raise UnsafeFile(f"{where}: {err.strerror}") from err
    try:
        for part in names[:-1]:
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=fd)
            except OSError as err:
                raise UnsafeFile(f"{where}: {part} is not a folder ({err.strerror})") from err
            os.close(fd)
            fd = inner
        try:
            file = os.open(names[-1], os.O_RDONLY | os.O_NONBLOCK | nofollow, dir_fd=fd)
        except OSError as err:
            raise UnsafeFile(f"{where}: {err.strerror}") from err
        if not stat.S_ISREG(os.fstat(file).st_mode):
            os.close(file)
            raise UnsafeFile(f"{where}: not a regular file")
        with os.fdopen(file, "rb") as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise UnsafeFile(f"{where}: larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def _blob(directory: Path, name: str) -> Path:
    return directory / f"{name}.pkl"


def export(namespace: Mapping[str, Any], names: Sequence[str], stage: str) -> None:
    """Pickle ``namespace[name]`` for each name into the stage folder's :data:`EXPORT` folder
    and write the index."""
    out = Path(stage) / EXPORT
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
            _blob(out, name).write_bytes(pack_call(value, ()))
        except Exception as err:  # noqa: BLE001 - any pickling failure is the learner's to see
            index[name] = {"error": f"`{name}` cannot be sent to the ranks: {err!r}"}
            continue
        index[name] = {"ok": True, "parameters": _parameters(value),
                       "methods": _methods(value) if inspect.isclass(value) else None}
    (out / INDEX).write_text(json.dumps(index))


#: inspect's parameter kinds, by the number each one is.
_KINDS = sorted((inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                 inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY,
                 inspect.Parameter.VAR_KEYWORD), key=int)


def _parameters(value: Callable[..., Any]) -> list[list[object]] | None:
    """``value``'s parameters as ``[name, kind, has_default]`` lists, None when they cannot be
    read."""
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None
    return [[p.name, int(p.kind), p.default is not p.empty]
            for p in signature.parameters.values()]


def _methods(cls: type) -> list[str]:
    """The names of a class's public methods (what a check may look for before it runs it)."""
    return sorted(n for n in dir(cls) if not n.startswith("_") and callable(
        inspect.getattr_static(cls, n, None)))


def _signature(parameters: object) -> inspect.Signature | None:
    """The signature :func:`_parameters` described, or None when the description is not one
    (it comes from the learner's kernel)."""
    if not isinstance(parameters, list) or len(parameters) > 64:
        return None
    params = []
    try:
        for name, kind, has_default in parameters:
            if not (isinstance(name, str) and name.isidentifier() and kind in range(len(_KINDS))
                    and isinstance(has_default, bool)):
                return None
            params.append(inspect.Parameter(
                name, _KINDS[kind], default=None if has_default else inspect.Parameter.empty))
        return inspect.Signature(params)
    except (TypeError, ValueError):
        return None


class Sealed:
    """A learner's function as the judge holds it: its pickle, never loaded here. Called in
    the judge it raises; pickled (to a rank) it becomes the learner's function again there.
    ``inspect.signature`` reads the parameters stage 1 recorded, so that a check can say
    before any rank starts that the function takes the wrong arguments."""

    def __init__(self, name: str, blob: bytes, signature: inspect.Signature | None,
                 methods: Sequence[str] | None = None) -> None:
        self.__name__ = self.__qualname__ = name
        self._blob = blob
        if signature is not None:
            self.__signature__ = signature
        self.sealed_class = methods is not None
        """True for a learner's class: :func:`labs.checks.core.is_class` reads it."""
        for method in methods or ():
            if not hasattr(self, method):
                setattr(self, method, self)  # present, and as uncallable here as the rest

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"`{self.__name__}` is the learner's function: it runs in a check's "
                           "ranks, never in the judge.")

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        # Opened by a function of labs.rank_pickle, which every rank has imported already:
        # a rank that unpickles this imports nothing of the grader (nbclient, jsonschema and
        # what they import cost a rank seconds of CPU, inside its check's deadline).
        return unpack_function, (self._blob,)

    def __repr__(self) -> str:
        return f"<the learner's {self.__name__}, sealed>"


def read_index(stage: Path, names: Sequence[str]) -> dict[str, dict[str, object]]:
    """The export index of the stage folder ``stage`` for ``names`` only, read without
    unpickling anything or following a link: per name ``{"ok": True}`` or ``{"error": why}``.
    An index that is missing, a link, too large or not the JSON :func:`export` writes leaves
    every name with an error."""
    problem = ""
    try:
        raw = json.loads(read_left(Path(stage), EXPORT, INDEX, limit=1 << 20))
    except (UnsafeFile, ValueError, UnicodeDecodeError) as err:
        raw, problem = {}, f" (its export index could not be read: {err})"
    if not isinstance(raw, dict):
        raw, problem = {}, " (its export index is not what the grader writes)"
    index: dict[str, dict[str, object]] = {}
    for name in names:
        entry = raw.get(name)
        if isinstance(entry, dict) and entry.get("ok") is True:
            methods = entry.get("methods")
            plain = isinstance(methods, list) and len(methods) <= 256 and all(
                isinstance(m, str) and m.isidentifier() and not m.startswith("_")
                for m in methods)
            index[name] = {"ok": True, "parameters": entry.get("parameters"),
                           "methods": methods if plain else None}
        elif isinstance(entry, dict) and "error" in entry:
            index[name] = {"error": str(entry["error"])[:_MAX_ERROR_CHARS]}
        else:
            index[name] = {"error": f"`{name}` was not exported{problem}."}
    return index


def carry(collected: Path, judged: Path, names: Sequence[str]) -> dict[str, dict[str, object]]:
    """Copy the exported ``names`` from stage 1's folder ``collected`` (the learner's) into the
    stage folder ``judged`` (the grader's, new): the index the grader rebuilds and each name's
    pickle, read with :func:`read_left`. Returns that index; a name whose pickle is unsafe is
    marked with the reason."""
    out = judged / EXPORT
    out.mkdir(parents=True)
    index = read_index(collected, names)
    for name, entry in index.items():
        if not entry.get("ok"):
            continue
        try:
            _blob(out, name).write_bytes(read_left(collected, EXPORT, f"{name}.pkl"))
        except UnsafeFile as err:
            index[name] = {"error": f"`{name}` could not be collected: {err}."}
    (out / INDEX).write_text(json.dumps(index))
    return index


def load(stage: str, names: Sequence[str]) -> dict[str, Sealed]:
    """The exported functions among ``names`` (the exercise's, never the index's), by name, in
    the judging kernel, each :class:`Sealed`: nothing is unpickled here."""
    return {name: Sealed(name, read_left(Path(stage), EXPORT, f"{name}.pkl"),
                         _signature(entry.get("parameters")), entry.get("methods"))
            for name, entry in read_index(Path(stage), names).items() if entry.get("ok")}


class _Sink(io.TextIOBase):
    """A stream that takes every write and keeps nothing."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)


#: What the judge prints for a check: the verdict and the check's title, nothing else.
_TITLE = re.compile(r"Exercise \d+\.\d+ [A-Za-z_][A-Za-z0-9_]*")


def verdict_line(result: Any) -> str:
    """``PASS: Exercise 2.1 ring_all_reduce`` for a check's :class:`labs.checks.CheckResult`:
    its verdict and its title, made by the check, never a word of the learner's."""
    title = getattr(result, "exercise", None)
    if not (isinstance(title, str) and _TITLE.fullmatch(title)):
        return "FAIL: the check returned no verdict"
    return f"{'PASS' if getattr(result, 'passed', None) is True else 'FAIL'}: {title}"


def judged(check: Callable[[], Any]) -> Any:
    """Run one check cell's call in the judge and print only :func:`verdict_line` of what it
    returns. What the check prints, the learner's messages inside it, goes nowhere: nbval
    compares the judge's own line with the reference's, so no text the learner's code made
    (a carriage return, an escape sequence, a line that reads PASS) reaches the comparison."""
    with contextlib.redirect_stdout(_Sink()), contextlib.redirect_stderr(_Sink()):
        result = check()
    print(verdict_line(result))
    return result


def write_verdicts(results: Sequence[Any], path: str) -> None:
    """Record each check's :class:`labs.checks.CheckResult` as JSON, in a file made new
    (never through a link, a FIFO or a file already there)."""
    data = json.dumps([
        {"exercise": r.exercise, "passed": r.passed is True, "message": str(r.message)}
        for r in results
    ])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(data)


def keep_files(root: Path, keep: Path, limit: int = 64 << 20) -> int:
    """Copy the regular files under ``root`` (what the stages left, the learner's files among
    them) to ``keep``, never following a link, skipping sockets, pipes, devices, any file
    over ``limit`` bytes and any the machine will not write there (a name too long, say).
    Returns how many files were skipped; it never raises for one of them."""
    skipped = 0
    for folder, dirs, files in os.walk(root, followlinks=False):
        relative = Path(folder).relative_to(root)
        for name in files:
            try:
                data = read_left(Path(folder), name, limit=limit)
                target = keep / relative / name
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.is_symlink() or (target.exists() and not target.is_file()):
                    skipped += 1
                    continue
                target.write_bytes(data)
            except OSError:  # UnsafeFile too
                skipped += 1
        kept = []
        for d in dirs:
            try:
                if stat.S_ISDIR(os.lstat(os.path.join(folder, d)).st_mode):
                    kept.append(d)
            except OSError:
                skipped += 1
        dirs[:] = kept
    return skipped
