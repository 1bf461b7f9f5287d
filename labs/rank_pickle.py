"""How a worker and its arguments travel to the ranks, and its return values come back.

:func:`labs.launcher.launch` forks its ranks from a helper process that never saw the
notebook, so a function defined in a cell cannot be found there by name: it travels **by
value**, with cloudpickle. :func:`pack_call` writes ``(fn, args)`` in the notebook and
:func:`unpack_call` reads them back in the rank; :func:`pack_result` writes a rank's return
value (tensors moved to the CPU) and :func:`unpack_result` reads it in the notebook. A value
that cannot travel is refused with a message that says which one (the function or an
argument) and what to do instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import linecache
import marshal
import os
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with two changes to how things travel to the ranks.

    * **Code objects keep where they were written.** A function defined in a notebook cell
      travels by value; the rank's traceback should still show the learner's lines and where
      they are. cloudpickle 3.1.3 and later rename the file of every code object it sends to
      ``<dynamic-code>`` (so that its pickles do not depend on where a function was defined),
      which drops both. Here a code object travels as :mod:`marshal` writes it for ``.pyc``
      files: exact, file name and line table included, and the ranks run the same interpreter.
      A cell's lines are not in any file, only in the kernel's :mod:`linecache`; they travel
      with the code (:func:`_load_code` puts them in the rank's linecache).
    * **Modules of a ``types.ModuleType`` subclass are sent as imports.** A function that
      travels by value takes along, as imports, the submodules of its global modules that
      share a name with an attribute it reads: a worker that uses ``torch`` and reads
      ``spec.ops`` ships ``torch.ops``. cloudpickle sends a plain module as an import but
      tries to pickle a subclass instance (``torch.ops`` is a ``torch._ops._Ops``) field by
      field, and fails. Such a module is imported again by the rank, as any other module is.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            try:
                code = marshal.dumps(obj)
            except ValueError:  # a constant marshal cannot write: cloudpickle's own way
                return super().reducer_override(obj)
            return _load_code, (code, obj.co_filename, _unfiled_lines(obj.co_filename))
        if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                and sys.modules.get(obj.__name__) is obj):
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _unfiled_lines(filename: str) -> list[str] | None:
    """The source lines of code that is in no file a rank could read (a notebook cell, which
    IPython keeps in :mod:`linecache` only); None for code written in a file."""
    if not filename or os.path.exists(filename):
        return None
    entry = linecache.cache.get(filename)
    return entry[2] if entry is not None else None  # one list: pickled once per launch


def _load_code(code: bytes, filename: str, lines: list[str] | None) -> types.CodeType:
    """A code object sent by :class:`_Pickler`, its lines registered where tracebacks look.

    The rank finds this function by its module's name: labs.launcher imports this module, so
    the forkserver has it loaded before any rank starts."""
    if lines is not None and filename not in linecache.cache:
        # mtime None: linecache.checkcache never drops an entry that has no file.
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return marshal.loads(code)


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


def pack_call(fn: Callable[..., Any], args: Sequence[Any]) -> bytes:
    """``fn`` and ``args`` as bytes for the ranks (:func:`unpack_call` reads them).

    Raises:
        TypeError: ``fn`` (with what it refers to) or one of ``args`` cannot be pickled; the
            message says which, before any process starts.
    """
    try:
        return _dumps((fn, tuple(args)))
    except Exception as exc:  # noqa: BLE001 - any failure to pickle is reported the same way
        cause = exc
    problem = f"{type(cause).__name__}: {cause}"
    try:  # which one could not travel: the function (and what it refers to) or an argument
        _dumps(fn)
    except Exception:  # noqa: BLE001 - any failure to pickle is reported the same way
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"could not send fn {name} to the ranks ({problem}). A function defined in a "
            "notebook or script travels by value, with the globals and closure variables it "
            "uses: define open files, locks, sockets and other such objects inside fn, or "
            "import it from a module."
        ) from cause
    raise TypeError(
        f"could not send args to the ranks ({problem}). Arguments must be picklable: pass "
        "plain values, tensors or dataclasses, and create open files, locks or sockets "
        "inside fn instead."
    ) from cause


def unpack_call(payload: bytes) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(fn, args)`` from :func:`pack_call`'s bytes, in a rank."""
    return cloudpickle.loads(payload)


def unpack_function(payload: bytes) -> Callable[..., Any]:
    """The function of a :func:`pack_call` payload that carries no arguments (a function
    packed to travel on its own: how the grader holds a learner's, unopened until a rank
    unpickles it). TypeError for anything else."""
    unpacked = unpack_call(payload)
    if not (isinstance(unpacked, tuple) and len(unpacked) == 2 and callable(unpacked[0])
            and unpacked[1] == ()):
        raise TypeError("not a function packed on its own by labs.rank_pickle.pack_call")
    return unpacked[0]


def pack_result(value: Any) -> bytes:
    """A rank's return value as bytes for the notebook, its tensors moved to the CPU.

    Raises:
        TypeError: the value cannot be pickled; the message says what can be returned.
    """
    try:
        return cloudpickle.dumps(_to_cpu(value))
    except Exception as exc:
        raise TypeError(
            f"fn returned a {type(value).__name__} that cannot be sent back to the notebook "
            f"({type(exc).__name__}: {exc}). Return tensors, numbers, strings, lists, dicts or "
            "dataclasses of those."
        ) from exc


def unpack_result(payload: bytes) -> Any:
    """A rank's return value from :func:`pack_result`'s bytes. torch 2.4 and 2.5 unpickle a
    tensor's storage with ``torch.load(weights_only=False)`` and warn about untrusted pickles
    on the first one; these bytes come from this launch's own ranks, and the warning would
    land in every notebook that shows a tensor a rank returned."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"You are using `torch.load` with "
                                "`weights_only=False`", category=FutureWarning)
        return cloudpickle.loads(payload)


def _to_cpu(value: Any) -> Any:
    """Tensors come back to the notebook on the CPU (never initialise CUDA in the kernel)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_cpu(v) for v in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _to_cpu(getattr(value, f.name)) for f in dataclasses.fields(value)
                  if f.init}
        return dataclasses.replace(value, **fields)
    return value
