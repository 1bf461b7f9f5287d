"""What every exercise check shares: the verdict, the validation of a check's arguments, the
plan of what a seed runs, the run over world sizes, the case inputs, and reading a failed or
hung launch.

Every check follows the same shape: build inputs whose right answer the parent can compute
on its own, launch the learner's function on several world sizes (:func:`run_check`),
compare, and explain the most likely mistake when the answer is wrong. The verdict's first
line is ``PASS: ...`` or ``FAIL: ...`` and depends only on the learner's code and the check's
seed. A chapter's module brings what is its own: the cases, the rank worker, the judge and
the explanations of an error or a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import hashlib
import inspect
import math
import os
import random
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from labs.checks.answer_keys import AnswerKeyUsed
from labs.launcher import MAX_WORLD_SIZE, LaunchTimeout, RankError, RankFailure, launch

_CaseT = TypeVar("_CaseT")

#: How long one check launch may run before the learner's code is declared hung.
CHECK_TIMEOUT_S = 10.0
#: Once a rank of a check has failed, how long the others get to report: ranks that fail the
#: same way, late on a busy machine, are then all seen, and the verdict (the lowest of them,
#: :func:`failing_rank`) is the same every run. The launcher stops waiting as soon as every
#: rank has reported.
CHECK_FAILURE_GRACE_S = 3.0


# --- the verdict -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """The verdict of one exercise check."""

    exercise: str
    passed: bool
    message: str

    def __str__(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}: {self.exercise}: {self.message}"


def report(result: CheckResult) -> CheckResult:
    """Print the verdict (what the learner reads in the notebook) and return it."""
    print(result)
    return result


# --- before any process starts ---------------------------------------------------------------


def validate_run_arguments(world_sizes: object, seed: object, timeout: object, *,
                           max_world_size: int = MAX_WORLD_SIZE, why: str = "") -> None:
    """Refuse a check's ``world_sizes``, ``seed`` or ``timeout`` before any process starts,
    saying what to pass instead. ``why`` explains ``max_world_size`` when it is a check's own."""
    if (isinstance(world_sizes, (str, bytes)) or not isinstance(world_sizes, Sequence)
            or not world_sizes):
        raise TypeError(f"world_sizes must be a non-empty tuple of ints, e.g. (1, 2, 3), got "
                        f"{world_sizes!r}.")
    for n in world_sizes:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_world_size:
            raise ValueError(f"each world size must be an int in 1..{max_world_size}{why}, "
                             f"got {n!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int (0 for the documented cases), got {seed!r}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
            0 < timeout < math.inf):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")


def validate_check_call(fn: object, world_sizes: object, seed: object, timeout: object, *,
                        example: str = "check(my_function)") -> None:
    """:func:`validate_run_arguments`, and ``fn`` must be the learner's function itself
    (``example`` shows the call to write)."""
    if not callable(fn):
        raise TypeError(f"pass the function itself, e.g. {example}, not its result "
                        f"(got {type(fn).__name__}).")
    validate_run_arguments(world_sizes, seed, timeout)


def is_class(value: object) -> bool:
    """Whether ``value`` is a class: a class, or the grader's sealed stand-in for a learner's
    class, which a check passes to its ranks without loading it
    (:class:`labs.grading.submission.Sealed` says so with ``sealed_class``)."""
    return inspect.isclass(value) or getattr(value, "sealed_class", False) is True


def signature_problem(function: str, parameters: Sequence[str], fn: Callable[..., Any]) -> str:
    """Why ``fn`` cannot be called as ``function(*parameters)``, or "" when it can (or when
    its signature cannot be read: the ranks then try it)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the ranks try it
        return ""
    try:
        signature.bind(*parameters)
    except TypeError:
        params = ", ".join(parameters)
        return (f"{function} must accept {len(parameters)} argument(s), ({params}); its "
                f"signature is {signature}. Write def {function}({params}): ...")
    return ""


# --- what a check runs, and running it -------------------------------------------------------


@dataclass(frozen=True)
class CheckPlan:
    """What a check runs: ``world_sizes``, the documented ones and, for a non-zero seed, one
    more drawn from ``random.Random(seed)`` (``drawn_world_size``, None when every candidate
    is documented already; see :func:`with_drawn_world_size`). A check's plan adds what else
    its seed draws (shapes, widths, a bucket cap) and names it in :meth:`draws`."""

    seed: int
    world_sizes: tuple[int, ...]
    drawn_world_size: int | None

    def draws(self) -> list[str]:
        """What the seed drew besides a world size, in words."""
        return []

    def note(self) -> str:
        """Ends every verdict of a non-zero seed: what it drew, and how to run it again."""
        if self.seed == 0:
            return ""
        world = [f"world size {self.drawn_world_size}"] if self.drawn_world_size else []
        return (f" [seed {self.seed} drew {and_listed([*world, *self.draws()])}; "
                f"pass seed={self.seed} to rerun]")


def with_drawn_world_size(world_sizes: Sequence[int], rng: random.Random,
                          candidates: Iterable[int]) -> tuple[tuple[int, ...], int | None]:
    """``world_sizes`` with one more, drawn by ``rng`` from the ``candidates`` not among them,
    and that one (None, and nothing added, when every candidate is there already)."""
    sizes = tuple(world_sizes)
    spare = [n for n in candidates if n not in sizes]
    extra = rng.choice(spare) if spare else None
    return sizes + ((extra,) if extra else ()), extra


def run_check(
    title: str,
    plan: CheckPlan,
    timeout: float,
    *,
    worker: Callable[..., Any],
    args: Callable[[int], tuple[Any, ...]],
    judge: Callable[[int, Sequence[Any]], str],
    explain_error: Callable[[int, RankError], str],
    explain_timeout: Callable[[int, LaunchTimeout, str], str],
    passed: str,
    problem: str = "",
    launcher: Callable[..., Sequence[Any]] = launch,
    rank_args: Callable[[int], Sequence[tuple[Any, ...]]] | None = None,
    count_writes: bool = False,
) -> CheckResult:
    """Runs a check whose arguments were validated, prints its verdict and returns it.

    ``problem`` (why the learner's code cannot even be called, found before any process
    starts) fails at once. Otherwise, for each world size ``n`` of the plan in turn,
    ``worker(rank, n, *args(n), *rank_args(n)[rank])`` runs on ``n`` ranks (``rank_args``:
    what each rank alone is given, its :class:`CaseKeys`; gloo: every check's tensors live on
    the CPU, even where there are GPUs), and the first of these is the verdict: a rank that
    raised (``explain_error(n, err)``), ranks that hung (``explain_timeout(n, err, where)``,
    ``where`` naming the learner's line a rank waited at, unless the ranks were still
    starting: :func:`explain_hang`), or a wrong result (``judge(n, results)``, "" when right).
    If none, the check passes with the message ``passed``. A rank whose learner's code called
    one of the exercise's answer keys (:mod:`labs.checks.answer_keys`) makes the verdict that
    refusal, in one line, whatever the other ranks raised. The plan's note ends every
    message, so that the verdict names what the seed drew. ``launcher`` starts the ranks
    (:func:`labs.launcher.launch`; a check may pass the one it looks up itself)."""

    def verdict(ok: bool, message: str) -> CheckResult:
        return report(CheckResult(title, ok, message + plan.note()))

    if problem:
        return verdict(False, problem)
    for n in plan.world_sizes:
        try:
            given = {} if rank_args is None else {"rank_args": rank_args(n)}
            if count_writes:  # judge(n, results) reads results.written
                given["count_writes"] = True
            results = launcher(worker, n, args=args(n), backend="gloo", timeout=timeout,
                               echo=False, failure_grace=CHECK_FAILURE_GRACE_S,
                               result_types=result_types(), **given)
        except RankError as err:
            return verdict(False, answer_key_refusal(err) or explain_error(n, err))
        except LaunchTimeout as err:
            starting, where = explain_hang(n, err, timeout)
            return verdict(False, starting or explain_timeout(n, err, where))
        wrong = judge(n, results)
        if wrong:
            return verdict(False, wrong)
    return verdict(True, passed)


def result_types() -> tuple[type, ...]:
    """What a check's ranks may send back besides plain values and tensors: the dataclasses
    and enums defined in the checks package's modules (its case and outcome records). A check
    launches with these as ``result_types``, so a rank running the learner's code sends plain
    data the check reads without unpickling anything (:mod:`labs.plain_results`)."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(f"{__package__}.") or module is None:
            continue
        for value in vars(module).values():
            if (isinstance(value, type) and value.__module__ == name
                    and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))):
                found.append(value)
    return tuple(found)


# --- reading a failed or hung launch ---------------------------------------------------------


#: Tagged onto an exception raised by the learner's code inside a check, so the parent knows
#: which case it was; :func:`clean_traceback` drops the line again.
CASE_NOTE = "[labs check] case"


def _named_cells(text: str) -> str:
    """A notebook cell's path that the launcher could not name (it holds the kernel's pid)
    made stable, so that a verdict is the same on every run."""
    return re.sub(r'"[^"]*ipykernel_\d+[/\\][^"]*"', '"<notebook cell>"', text)


def clean_traceback(text: str, check_module: str) -> str:
    """The learner's part of a rank's traceback: the frames of the checks package (the folder
    of ``check_module``, a check module's ``__file__``: the check's own frames and the shared
    ones it runs through) and the case note dropped. The launcher names a notebook cell as
    IPython does (``Cell In[5], line 3``); a cell path it could not name is made stable."""
    folder = os.path.dirname(check_module) + os.sep
    lines, keep = [], True
    for line in text.splitlines():
        if line.startswith("  File "):
            keep = folder not in line
        elif not line.startswith("    "):
            keep = True
        if keep and not line.startswith(CASE_NOTE):
            lines.append(line)
    return _named_cells("\n".join(lines))


class Stopped(BaseException):
    """Raised inside a thread running the learner's calls when their time is up (a
    BaseException, so that the learner's ``except Exception`` does not swallow it)."""


def stop_thread(thread: threading.Thread) -> str:
    """Where ``thread`` is in the learner's code (a ``File ..., line ...`` line, or ''; frames
    of the checks package skipped), then stop it: raise :class:`Stopped` in it at its next
    bytecode (a call blocked inside C code is not stopped; make it a daemon, to end with the
    process). Exercises 7.2 and 7.3 call pure functions in a thread of one rank this way."""
    folder = os.path.dirname(__file__) + os.sep
    frame = sys._current_frames().get(thread.ident or -1)
    frames = [f for f in traceback.extract_stack(frame)
              if not f.filename.startswith(folder)] if frame else []
    where = (clean_traceback(f'  File "{frames[-1].filename}", line {frames[-1].lineno}, in '
                             f"{frames[-1].name}", __file__).strip() if frames else "")
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                               ctypes.py_object(Stopped))
    return where


@dataclass
class ThreadCalls:
    """How a learner's calls made in a thread ended (:func:`calls_in_thread`)."""

    finished: bool = False
    error_type: str = ""  #: the exception of the call that raised ('' when none did)
    error: str = ""  #: its traceback


def calls_in_thread(make_calls: Callable[[], None], ended: ThreadCalls, name: str,
                    timeout: float) -> str:
    """Run ``make_calls()`` (the learner's calls of a pure-function exercise) in a daemon
    thread of this process for at most ``timeout`` seconds, noting in ``ended`` whether it
    finished or which exception it raised; return where the learner's code was when it was
    stopped ('' when it ended in time). Exercises 7.2, 7.3 and 9.1 run their calls this way."""

    def run() -> None:
        try:
            make_calls()
            ended.finished = True
        except Stopped:
            pass
        except BaseException as exc:  # the learner's error, whatever it is, is the verdict
            ended.error_type = type(exc).__name__
            ended.error = "".join(traceback.format_exception(exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if not thread.is_alive():
        return ""
    where = stop_thread(thread)
    thread.join(1.0)
    return where


@contextlib.contextmanager
def case_noted(index: int) -> Iterator[None]:
    """Inside a rank: an exception raised in the block carries case ``index``, which
    :func:`failed_case` reads back in the parent. (contextlib gives the exception back the
    traceback it came with, so the verdict shows no frame of this function.)"""
    try:
        yield
    except BaseException as exc:
        if hasattr(exc, "add_note"):  # Python 3.11+; without it the case goes unnamed
            exc.add_note(f"{CASE_NOTE} {index}")
        raise


def failed_case(traceback: str, cases: Sequence[_CaseT]) -> _CaseT | None:
    """The case a rank's traceback names (see :func:`case_noted`), or None."""
    found = re.search(re.escape(CASE_NOTE) + r" (\d+)", traceback)
    return cases[int(found.group(1))] if found else None


def failing_rank(err: RankError) -> RankFailure:
    """The failure a check's verdict names. Ranks that fail the same way at once: the lowest,
    so that the verdict is the same on every run (but never one that only lost the peer that
    failed first)."""
    same = sorted((f for f in err.secondary if f.exc_type == err.exc_type and f.rank < err.rank
                   and not f.peer_lost), key=lambda f: f.rank)
    return same[0] if same else err.failure


def answer_key_refusal(err: RankError) -> str:
    """The refusal's message when a rank raised :class:`AnswerKeyUsed` (the lowest such
    rank's, so that the verdict is the same every run, even where another rank raised
    something else first), or ""."""
    refused = sorted((f for f in (err.failure, *err.secondary)
                      if f.exc_type == AnswerKeyUsed.__name__), key=lambda f: f.rank)
    return refused[0].message.splitlines()[0] if refused else ""


def raised(named: RankFailure, hint: str = "") -> str:
    """The words 'rank r raised T.' and ``hint``, then the learner's part of its traceback."""
    return (f"rank {named.rank} raised {named.exc_type}.{hint}\n"
            f"{clean_traceback(named.traceback, __file__)}")


def explain_hang(n: int, err: LaunchTimeout, timeout: float) -> tuple[str | None, str]:
    """Read a check's :class:`~labs.launcher.LaunchTimeout`: ``(verdict, where)``. ``where``
    names the innermost frame of the learner's code a hung rank was waiting at (" Rank r was
    waiting at ..."), and ``verdict`` is None: the check explains the hang. ``verdict`` is the
    whole explanation when no rank was in the learner's code (:func:`is_learners_frame`):
    the ranks were still joining the group, or were all in the library's code (a machine too
    busy for the timeout), and the learner is not told that their code hung."""
    stacks = [err.stacks.get(r, "") for r in err.ranks]
    if any(stacks) and all("_join_group" in s for s in stacks if s):
        return (f"with {n} rank(s), the ranks were still starting after {timeout:g} s; the "
                "machine may be busy: pass a larger timeout=."), ""
    for r in err.ranks:
        frames = [line.strip() for line in err.stacks.get(r, "").splitlines()
                  if is_learners_frame(line)]
        if frames:
            return None, f" Rank {r} was waiting at {_named_cells(frames[0])}."
    top = next((s.strip().splitlines()[0] for s in stacks if s.strip()), "")
    seen = f" (rank {err.ranks[0]} was at {_named_cells(top)})" if top else ""
    return (f"with {n} rank(s), rank(s) {listed(err.ranks)} did not finish within {timeout:g} "
            f"s, and none of them was running your code when stopped{seen}: the machine may "
            "have been too busy for the check's time limit. Run the check again with a larger "
            "timeout= (graded: the instructor's --check-timeout)."), ""


def _installed() -> tuple[str, ...]:
    """The folders of code that is not the learner's: the interpreter's library, the
    environment's packages and ``labs`` itself."""
    import sysconfig  # noqa: PLC0415

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix,
             os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    paths |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p)


def is_learners_frame(line: str) -> bool:
    """Whether a stack line (``File "...", line N in f``, or a cell IPython named, ``Cell
    In[5], line 3``) is in the learner's own code: a notebook cell, or a file outside the
    Python installation, its packages and ``labs`` (a frame of ``lark``, say, is not)."""
    if "Cell In[" in line:
        return True
    found = re.search(r'File "([^"]+)"', line)
    if not found:
        return False
    path = found.group(1)
    if path.startswith("<"):
        return path == "<notebook cell>" or path.startswith("<ipython-input")
    return not os.path.realpath(path).startswith(_installed())


# --- case inputs, and the words of a verdict -------------------------------------------------


#: Case inputs are integers in [1, 9]: sums over at most 32 ranks are exact in float32, and a
#: sum over some of the ranks is smaller than the sum over all of them in every element.
_LOW, _HIGH = 1, 10


def _mix(*parts: int) -> int:
    value = 0x9E3779B9
    for part in parts:
        value = (value * 1_000_003 + part + 7) % (1 << 61)
    return value


def case_values(seed: int, n: int, index: int, who: int, numel: int) -> torch.Tensor:
    """``numel`` integers in [1, 9] as float32 (1-D), a pure function of its arguments, so
    that the parent and the ranks draw the same inputs: case ``index`` of world size ``n``,
    for ``who`` (a rank, or a negative number for tensors no single rank owns). The checks of
    chapters 5-8 draw from the seed so (their ranks get the seed); chapters 1-4 draw each
    rank's inputs from its own key instead (:class:`CaseKeys`, :func:`keyed_values`)."""
    generator = torch.Generator().manual_seed(_mix(seed, n, index, who))
    return torch.randint(_LOW, _HIGH, (numel,), generator=generator).to(torch.float32)


def _digest(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


@dataclass(frozen=True)
class CaseKeys:
    """The secrets a check's inputs of one world size are drawn from: ``shared``, for what
    every rank is given alike (a model's weights, a shape's values no one rank owns), and one
    key per rank in ``own``, for what only that rank is given (its gradient, its shard).

    The parent holds every key (:meth:`draw`, from the check's seed); rank r gets
    :meth:`for_rank` (the shared key and its own) through the launcher's ``rank_args``, never
    the seed. The keys are one-way (BLAKE2b): a rank cannot work out another's from its own,
    so a learner's code that computes the result without receiving the other ranks' inputs
    has nothing to compute it from."""

    shared: bytes
    own: dict[int, bytes]

    @classmethod
    def draw(cls, seed: int, n: int) -> CaseKeys:
        return cls(_digest("shared", seed, n), {r: _digest("own", seed, n, r) for r in range(n)})

    def for_rank(self, rank: int) -> CaseKeys:
        """What rank ``rank`` may hold: the shared key and its own."""
        return CaseKeys(self.shared, {rank: self.own[rank]})

    def per_rank(self) -> list[tuple[CaseKeys]]:
        """``rank_args`` for a launch: each rank's keys, as a one-element tuple."""
        return [(self.for_rank(r),) for r in range(len(self.own))]

    def generator(self, index: int, who: int, owner: int | None = None) -> torch.Generator:
        """A generator for case ``index``, tensor ``who``, drawn from ``owner``'s key (None:
        the shared key)."""
        if owner is not None and owner not in self.own:
            raise KeyError(f"rank {owner}'s inputs are not this rank's to draw")
        key = self.shared if owner is None else self.own[owner]
        seed = int.from_bytes(_digest(key, index, who)[:8], "little") % (1 << 63)
        return torch.Generator().manual_seed(seed)


def keyed_values(keys: CaseKeys, index: int, who: int, numel: int,
                 owner: int | None = None) -> torch.Tensor:
    """``numel`` integers in [1, 9] as float32 (1-D), a pure function of its arguments, so
    that the parent and the ranks draw the same inputs: case ``index``, tensor ``who``, from
    rank ``owner``'s key (None: the shared key, for tensors no single rank owns)."""
    generator = keys.generator(index, who, owner)
    return torch.randint(_LOW, _HIGH, (numel,), generator=generator).to(torch.float32)


def first_difference(got: torch.Tensor, expected: torch.Tensor, what: str) -> str:
    """The first element (1-D index) where ``got`` differs from ``expected``, in words."""
    i = int((got != expected).nonzero()[0, 0])
    return f"element {i} is {float(got[i]):g}, expected {float(expected[i]):g} ({what})"


def first_change(now: torch.Tensor, before: torch.Tensor) -> str:
    """The first element (flat index) of a tensor that was to stay as it was and did not, in
    words: ``element 4 is now 0, was 7`` (or its shapes, when it was resized)."""
    if now.shape != before.shape:
        return f"its shape is now {tuple(now.shape)}, was {tuple(before.shape)}"
    now, before = now.reshape(-1), before.reshape(-1)
    i = int((now != before).nonzero()[0, 0])
    return f"element {i} is now {float(now[i]):g}, was {float(before[i]):g}"


def _element(index: Sequence[int]) -> str:
    """An element in words: ``element 3`` of a 1-D tensor, ``element [2, 1]`` of a 2-D one."""
    if len(index) == 1:
        return f"element {index[0]}"
    return f"element [{', '.join(map(str, index))}]" if index else "the value"


def largest_difference(got: torch.Tensor, expected: torch.Tensor, what: str) -> str:
    """Where ``got`` is furthest from ``expected``, in words: ``element [2, 1] is 0.512,
    expected 0.256 (what), off by 0.256, the largest difference in the tensor``. For a
    comparison within a tolerance, where the first element that differs at all may be inside
    it; a NaN counts as furthest, and tensors of different shapes are named by their shapes."""
    if got.shape != expected.shape:
        return f"its shape is {tuple(got.shape)}, expected {tuple(expected.shape)} ({what})"
    diff = (got.double() - expected.double()).abs().nan_to_num(nan=math.inf).reshape(-1)
    flat = int(diff.argmax())
    index, rest = [], flat
    for size in reversed(got.shape):
        index.append(rest % size)
        rest //= size
    text = (f"{_element(index[::-1])} is {float(got.reshape(-1)[flat]):.6g}, expected "
            f"{float(expected.reshape(-1)[flat]):.6g} ({what})")
    if got.numel() == 1:
        return text
    nan = math.isnan(float(got.reshape(-1)[flat]))
    off = "" if nan else f", off by {float(diff[flat]):.3g}"
    return f"{text}{off}, the largest difference in the tensor"


def listed(values: Iterable[object]) -> str:
    """``1, 2, 3``."""
    return ", ".join(map(str, values))


def and_listed(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
