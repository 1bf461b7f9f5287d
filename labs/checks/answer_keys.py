"""The answer keys: the objects of ``labs`` that solve an exercise, refused while its check runs
the learner's code.

``labs`` is the course's library, and most exercises ask the learner to write something it
already holds: exercise 2.1's ring all-reduce is :func:`labs.collectives.ring_all_reduce`,
7.2's resharding is :func:`labs.checkpoint.shard_pieces`. Learners must have ``labs``
installed to run the notebooks, so a check must tell "wrote it" from "called it".
:data:`ANSWER_KEYS` (a column of the exercise registry, :mod:`labs.checks.exercises`) lists,
per exercise, the objects a learner could call instead of writing the exercise (not the
primitives the exercise tells them to use: 8.1 is built from labs' rings, so the rings stay
allowed there, and point-to-point sends are allowed everywhere), and
:func:`answer_keys_refused` refuses them while a check runs the learner's code.

A refusal must catch every way of reaching the object: ``from labs.collectives import
ring_all_reduce as mine``, ``importlib.import_module("labs." + "collectives")``, a reference
kept from before the check started, a subclass. Replacing module attributes reaches none of
the last three, so the refusal replaces the function's *code* (``__code__``): every name and
alias leads to the same function object, and that object now raises. A class is refused at
construction (its ``__init__``), a method as its function, a decorated function as the
function it wraps. The code is given back on exit, raise or not.

A copy is refused too: ``exec(inspect.getsource(key))`` or ``types.FunctionType(key.__code__,
...)`` makes a new function of the same code. While the scope lasts, every Python function
called (in any thread started after it began) is compared with the keys by its code's
:func:`fingerprint`, the bytecode and the names and constants it uses, which a copy keeps
whatever it is called and wherever it was made. A copy renamed and reshaped (names, constants
and a few statements changed, dead ones added) keeps most of its :func:`shape`, the sequence of
its operations: a function that is not labs' own and shares :data:`SHAPE_MATCH` of a long key's
shape is refused as that key. The book's reference answers share at most 14 % with any key
of their exercise, but for three keys that a right answer is written like
(:data:`NOT_BY_SHAPE`); a key with a third of its lines changed keeps about 65 %.
"""

from __future__ import annotations

import contextlib
import dis
import hashlib
import importlib
import inspect
import sys
import textwrap
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from labs.checks.exercises import EXERCISES
from labs.tables import format_table

# --- which objects solve which exercise -------------------------------------------------------

#: Exercise id -> the dotted paths of the ``labs`` objects that solve it (the rows of
#: :data:`labs.checks.exercises.EXERCISES`, in the book's order): functions, classes (refused
#: at construction) and methods (``labs.fsdp.FSDP.clip_grad_norm_``).
ANSWER_KEYS: Mapping[str, tuple[str, ...]] = types.MappingProxyType(
    {e.id: e.answer_keys for e in EXERCISES})

#: Exercise id -> what the learner writes in it: the name its check cell passes to the check.
LEARNER_FUNCTIONS: Mapping[str, str] = types.MappingProxyType(
    {e.id: e.learner_name for e in EXERCISES})


class AnswerKeyUsed(RuntimeError):
    """Raised where a check runs the learner's code and that code calls one of the exercise's
    answer keys (under any name). Its message is the verdict's: which exercise, which key."""


def refusal_message(exercise: str, key: str, alike: float | None = None) -> str:
    """The one line a refusal says, the same on every run; ``alike``: the share of the key's
    shape a copy of it kept."""
    if alike is not None:
        return (f"exercise {exercise} asks you to write this; your code has the shape of "
                f"`{key}`, its answer key (labs' own solution), {alike:.0%} alike: a copy of "
                "it, refused while the check runs your code.")
    return (f"exercise {exercise} asks you to write this; `{key}` is its answer key (labs' own "
            "solution), refused while the check runs your code.")


def answer_key_table() -> str:
    """Every exercise, the function the learner writes, and its answer keys (one row per key),
    as a fixed-width table for the grading appendix."""
    rows = [[exercise if i == 0 else "", LEARNER_FUNCTIONS[exercise] if i == 0 else "", key]
            for exercise, keys in ANSWER_KEYS.items() for i, key in enumerate(keys)]
    return format_table(["exercise", "learner's function", "answer keys"], rows)


# --- finding the code to refuse ---------------------------------------------------------------


def answer_key(path: str) -> object:
    """The object a dotted path names (``labs.fsdp.FSDP.clip_grad_norm_``): the longest prefix
    that is a module, imported, then attributes (read from a class's ``__dict__``, so that a
    classmethod or staticmethod comes back as itself, not bound)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = (inspect.getattr_static(obj, name) if inspect.isclass(obj)
                   else getattr(obj, name))
        return obj
    raise ModuleNotFoundError(f"{path}: no module of it can be imported.")


def refused_function(path: str) -> types.FunctionType:
    """The function whose code :func:`answer_keys_refused` replaces for key ``path``: a
    class's own ``__init__``, a method's function, a decorated function's innermost
    (``__wrapped__``). TypeError for anything else: it could not be refused."""
    obj = answer_key(path)
    if inspect.isclass(obj):
        obj = obj.__dict__.get("__init__")
        if obj is None:
            # Its inherited __init__ serves other classes too: refusing it would refuse them.
            raise TypeError(f"{path} defines no __init__ of its own: list the function that "
                            "does the work instead.")
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    function = inspect.unwrap(obj) if callable(obj) else obj
    if not isinstance(function, types.FunctionType):
        raise TypeError(f"{path} is a {type(function).__name__}, not a Python function or "
                        "class: its code cannot be refused.")
    return function


#: Stands, in the template's source, for the refusal a stub calls: each stub's constants hold
#: its scope's refusal in its place.
_REFUSAL_SLOT = "labs.checks.answer_keys: the scope's refusal"


def _stub(*args: Any, **kwargs: Any) -> NoReturn:
    """The code a refused answer key runs instead of its own: the refusal of its scope."""
    refuse: Callable[[], NoReturn] = _REFUSAL_SLOT  # type: ignore[assignment]
    return refuse()


def _refusing_code(original: types.CodeType, refuse: Callable[[], NoReturn]) -> types.CodeType:
    """:func:`_stub`'s code for a function of code ``original``, calling ``refuse``.

    A function's new code must have as many free variables as its closure has cells, so the
    stub is compiled inside a function that gives it that many (never read). It is compiled
    from :func:`_stub`'s own source, on the same lines of this file, so that a traceback
    through it shows those lines; its name is the key's."""
    free = [f"_free{i}" for i in range(len(original.co_freevars))]
    source, first = inspect.getsourcelines(_stub)
    body = textwrap.indent("".join(source), "    ").replace(
        "_REFUSAL_SLOT  # type: ignore[assignment]", repr(_REFUSAL_SLOT))
    lines = "\n" * (first - 3) + "def _outer():\n    " + " = ".join([*free, "None"]) + "\n"
    lines += body + (f"        {', '.join(free)}\n" if free else "") + "    return _stub\n"
    module = compile(lines, __file__, "exec")
    outer = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    stub = next(c for c in outer.co_consts if isinstance(c, types.CodeType))
    if _REFUSAL_SLOT not in stub.co_consts:  # _stub's text changed: it would read a global
        raise RuntimeError("labs.checks.answer_keys._stub must assign _REFUSAL_SLOT to refuse.")
    names = {"co_name": original.co_name}
    if hasattr(original, "co_qualname"):  # Python 3.11+
        names["co_qualname"] = original.co_qualname
    return stub.replace(co_consts=tuple(refuse if c == _REFUSAL_SLOT else c
                                        for c in stub.co_consts), **names)


# --- knowing a copy when it runs --------------------------------------------------------------

#: The codes :func:`_refusing_code` made (by id): a key already refused by an enclosing scope
#: has one of these, not its own, and is not fingerprinted again.
_STUB_CODES: dict[int, types.CodeType] = {}


def fingerprint(code: types.CodeType) -> str:
    """What a copy of ``code`` keeps: its bytecode, its argument counts, the names it uses and
    its constants (nested code by its own fingerprint), but not its name, file or lines."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (code.co_code, repr((code.co_argcount, code.co_kwonlyargcount, code.co_names))):
        digest.update(part if isinstance(part, bytes) else part.encode())
    for const in code.co_consts:
        digest.update((fingerprint(const) if isinstance(const, types.CodeType)
                       else f"{type(const).__name__}:{const!r}").encode())
    return digest.hexdigest()


#: Operations :func:`shape` leaves out: they say nothing of what a function does.
_NOT_SHAPE = bytes(dis.opmap[name] for name in ("CACHE", "NOP", "EXTENDED_ARG")
                   if name in dis.opmap)
_SHAPE_K = 5
#: Code of fewer operations is not compared by shape: short functions look alike in any
#: answer (7.3's key is 10 operations long).
SHAPE_MIN_OPERATIONS = 40
#: The share of a key's :func:`shape` above which another function is a copy of it.
SHAPE_MATCH = 0.5
#: Keys a right answer is written like, so that their shape tells nothing (the share of the
#: key's shape the book's answer has, measured by tests/test_answer_keys.py): only a call of
#: them, or a copy of their exact code, is refused.
NOT_BY_SHAPE: Mapping[str, str] = types.MappingProxyType({
    "labs.ddp.broadcast_state": "5.1's answer broadcasts the module's state as labs does",
    "labs.checkpoint.shard_pieces": "7.2's answer walks the saved shards as labs does",
    "labs.experiments.faults.first_desync": "9.1's answer is labs' own",
})


def shape(code: types.CodeType) -> frozenset[bytes]:
    """What a renamed and reshaped copy of ``code`` keeps: the runs of five operations in its
    bytecode, their arguments (names, constants, jumps) left out."""
    ops = code.co_code[::2].translate(None, _NOT_SHAPE)
    return frozenset(ops[i:i + _SHAPE_K] for i in range(len(ops) - _SHAPE_K + 1))


def likeness(a: frozenset[bytes], b: frozenset[bytes]) -> float:
    """The share of their runs two shapes have in common (Jaccard), 0 to 1."""
    return len(a & b) / len(a | b) if a and b else 0.0


def _long_codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code nested in it, those of at least :data:`SHAPE_MIN_OPERATIONS`."""
    if len(code.co_code.translate(None, _NOT_SHAPE)) // 2 >= SHAPE_MIN_OPERATIONS:
        yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _long_codes(const)


def _labs_own_codes() -> set[int]:
    """The code of every function of the loaded ``labs`` modules (and their classes): the
    library's own, which the learner's code may call, never a copy."""
    found: set[int] = set()
    for name, module in list(sys.modules.items()):
        if not (name == "labs" or name.startswith("labs.")) or module is None:
            continue
        values = list(vars(module).values())
        for value in list(values):
            if inspect.isclass(value) and value.__module__ == name:
                values += list(vars(value).values())
        for value in values:
            function = getattr(inspect.unwrap(value) if callable(value) else value, "__func__",
                               value)
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                stack = [code]
                while stack:
                    current = stack.pop()
                    found.add(id(current))
                    stack += [c for c in current.co_consts if isinstance(c, types.CodeType)]
    return found


@contextlib.contextmanager
def _copies_refused(prints: dict[str, Callable[[], NoReturn]],
                    shapes: list[tuple[frozenset[bytes], Callable[[float], NoReturn]]] = ()
                    ) -> Iterator[None]:
    """Inside: a Python function whose code has one of the fingerprints ``prints`` calls that
    fingerprint's refusal when it starts, and one that is not labs' own and shares
    :data:`SHAPE_MATCH` of one of ``shapes`` calls that shape's refusal (a profile hook, in
    this thread and the threads started inside; each code is looked at once)."""
    seen: dict[int, tuple[types.CodeType, Callable[[], NoReturn] | None]] = {}
    own = _labs_own_codes() if shapes else set()
    before = sys.getprofile()
    before_threads = getattr(threading, "getprofile", lambda: None)()

    def judged(code: types.CodeType) -> Callable[[], NoReturn] | None:
        if id(code) in _STUB_CODES:
            return None
        refusal = prints.get(fingerprint(code))
        if refusal is not None or id(code) in own:
            return refusal
        for mine in _long_codes(code):
            ours = shape(mine)
            for key_shape, refuse in shapes:
                alike = likeness(ours, key_shape)
                if alike >= SHAPE_MATCH:
                    return lambda refuse=refuse, alike=alike: refuse(alike)
        return None

    def watch(frame: types.FrameType, event: str, arg: object) -> None:
        if before is not None:
            before(frame, event, arg)
        if event != "call":
            return
        code = frame.f_code
        known = seen.get(id(code))
        if known is None or known[0] is not code:
            known = seen[id(code)] = (code, judged(code))
        if known[1] is not None:
            known[1]()

    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(before)
        threading.setprofile(before_threads)


# --- refusing them ----------------------------------------------------------------------------


@dataclass
class _Refusals:
    """One scope's refusals: which exercise, and the keys its learner's code called."""

    exercise: str
    used: list[tuple[str, float | None]] = field(default_factory=list)

    def refusal(self, key: str) -> Callable[..., NoReturn]:
        """What key ``key``'s stub calls (or a copy of its shape, with how alike): record the
        call, raise."""

        def refuse(alike: float | None = None) -> NoReturn:
            self.used.append((key, alike))
            raise AnswerKeyUsed(refusal_message(self.exercise, key, alike))

        return refuse

    def first(self) -> AnswerKeyUsed:
        """The refusal to raise again (the first, so that the verdict is the same each run)."""
        return AnswerKeyUsed(refusal_message(self.exercise, *self.used[0]))


@contextlib.contextmanager
def answer_keys_refused(exercise: str) -> Iterator[None]:
    """Inside: every answer key of ``exercise`` (:data:`ANSWER_KEYS`) raises
    :class:`AnswerKeyUsed` when called, whatever name reaches it, in every thread of this
    process. Enter it around the learner's code only: the check's own code must not call
    them.

    Sticky: a learner who catches the refusal still fails. When the block ends after a
    refusal, normally or by another exception, :class:`AnswerKeyUsed` is raised again (from
    that exception). Each key gets its code back on exit, raise or not; scopes may nest."""
    if exercise not in ANSWER_KEYS:
        known = ", ".join(ANSWER_KEYS)
        raise ValueError(f"no exercise {exercise!r} has answer keys; the exercises are {known}.")
    refusals = _Refusals(exercise)
    swapped: dict[int, tuple[types.FunctionType, types.CodeType]] = {}
    prints: dict[str, Callable[[], NoReturn]] = {}
    shapes: list[tuple[frozenset[bytes], Callable[[float], NoReturn]]] = []
    try:
        for key in ANSWER_KEYS[exercise]:
            function = refused_function(key)
            if id(function) in swapped:  # two paths to one function (a re-export)
                continue
            original = function.__code__
            swapped[id(function)] = (function, original)
            if id(original) not in _STUB_CODES:
                prints[fingerprint(original)] = refusals.refusal(key)
                if key not in NOT_BY_SHAPE:
                    shapes += [(shape(c), refusals.refusal(key)) for c in _long_codes(original)]
            function.__code__ = _refusing_code(original, refusals.refusal(key))
            _STUB_CODES[id(function.__code__)] = function.__code__
        with _copies_refused(prints, shapes):
            yield
    except Exception as exc:
        if refusals.used and not isinstance(exc, AnswerKeyUsed):
            raise refusals.first() from exc
        raise
    finally:
        for function, code in reversed(swapped.values()):
            _STUB_CODES.pop(id(function.__code__), None)
            function.__code__ = code
    if refusals.used:
        raise refusals.first()
