"""Chapter 2's emulated network: the all-reduces of :mod:`labs.collectives` timed on a
:class:`labs.Link`, beside what :func:`labs.cost_model.predict_on_link` says they take.

* **sweep** (:class:`LinkSweepSettings`, :func:`measure_on_link`): every algorithm, size and
  world size, a few repeats each; one launch per world size.
* **floor** (:class:`FloorSettings`, :func:`measure_floor`): what the emulation must stay well
  above to be believed: the real cost of a message over this machine's loopback, the real cost
  of adding what arrived, and how late a sleeping rank wakes up.
* **claims** (:func:`floor_claims`, :func:`sweep_claims`, :func:`crossover_claim`): what the
  chapter says about both, decided by the run (:mod:`labs.claims`).

How a call is timed on the link. The model starts every rank at the same moment. All ranks
share the machine's monotonic clock, which the link times its ports with, so the ranks agree
on a moment a little ahead (the latest rank's clock reading, through torch's own all-reduce,
which the link does not carry, plus ``start_delay_s``), sleep until it, and call. A call's time
runs from the moment the last rank really started (ranks that wake together on few cores start
a millisecond or more apart) to the moment the last rank returned. A barrier would do worse:
on a busy machine ranks leave one several milliseconds apart.

The workers build CPU tensors, so every launch here uses gloo. Ranks import this module to find
the workers, so it imports nothing heavy (no matplotlib).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labs.claims import Claim, Estimate
from labs.collectives import DEFAULT_SEGMENT_BYTES, Algorithm, all_reduce, ring_all_reduce
from labs.cost_model import crossover_on_link, predict_on_link
from labs.experiments.p2p_timing import P2PPattern, PointTiming, time_p2p, time_reduction
from labs.experiments.timing import COMM_THREADS, format_size
from labs.launcher import MAX_WORLD_SIZE, Backend, cpu_cores, launch
from labs.link import Link
from labs.tables import format_table

#: The link of chapter 2: 20 ms of latency, 12.5 MB/s. A 1 KiB message costs 20 ms, 4 MiB
#: 356 ms; the ring overtakes recursive doubling at 2.0 MB on 4 ranks, 2.2 MB on 8 (between the
#: sweep's 1 MiB and 4 MiB). The latency stays well above how late a sleeping rank wakes
#: (about a millisecond on a busy 2-core machine), so a ring of 14 steps keeps within a few
#: per cent of its model; and the bandwidth is low enough that the work the ranks really do
#: per byte (adding what arrived, copying it), which the model leaves out, stays a few per cent
#: of the time the link charges for those bytes, with 8 ranks on 2 cores.
CHAPTER_LINK = Link(alpha=20e-3, bandwidth=12.5e6)
#: The sweep's sizes: 16 KiB to 4 MiB, every 4x. Below 16 KiB a message spends under 1.3 ms in
#: a port, less than the naive root's real work per message on a busy 2-core machine (it
#: receives N-1 messages one after another), so that work would show beside the model.
LINK_SIZES: tuple[int, ...] = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
#: The three all-reduces the chapter compares on the link.
SWEPT: tuple[Algorithm, ...] = (Algorithm.NAIVE, Algorithm.RING, Algorithm.RECURSIVE_DOUBLING)


@dataclass(frozen=True)
class LinkSweepSettings:
    """All-reduces on the emulated link: every algorithm, size and world size.

    Attributes:
        link: the emulated wire.
        sizes: S in bytes, multiples of 4 (float32).
        world_sizes: N, one launch each.
        algorithms: labs' own all-reduces (torch's built-in is not carried by the link).
        repeats: timed calls of each case at the least (:meth:`repeats_of`); the algorithms
            of one size take turns, call by call, each round in the opposite order to the last.
        start_delay_s: how far ahead of the latest rank's clock the ranks start a call.
        segment_bytes: the pipelined ring's segment (None: the lock-step ring).
    """

    link: Link = CHAPTER_LINK
    sizes: tuple[int, ...] = LINK_SIZES
    world_sizes: tuple[int, ...] = (2, 4, 8)
    algorithms: tuple[Algorithm, ...] = SWEPT
    repeats: int = 3
    #: Short cases get more repeats: as many as their model times need to add up to this
    #: (at most ``3 * repeats``). A late wake-up weighs most in a short call, and more repeats
    #: cost little there and make an undisturbed call likelier.
    min_seconds: float = 0.5
    start_delay_s: float = 0.01
    segment_bytes: int | None = DEFAULT_SEGMENT_BYTES
    #: When set, a case the model puts at more than this many times the fastest algorithm of
    #: its size and world size is not run (:meth:`runs`): a map of which algorithm is fastest
    #: need not spend seconds on one that is several times slower by the model.
    skip_beyond: float | None = None

    def validate(self) -> None:
        """Raise ValueError (TypeError for a wrong link), saying what to change, before any
        process starts."""
        if not isinstance(self.link, Link):
            raise TypeError(f"link must be a labs.Link, got {type(self.link).__name__}.")
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 or s % 4
                                 for s in self.sizes):
            raise ValueError(f"sizes must be byte counts, each a positive multiple of 4 "
                             f"(float32), got {self.sizes!r}.")
        if not self.world_sizes or any(not 2 <= n <= MAX_WORLD_SIZE for n in self.world_sizes):
            raise ValueError(f"world_sizes must lie in 2..{MAX_WORLD_SIZE} (one rank sends "
                             f"nothing), got {self.world_sizes!r}.")
        wrong = [a for a in self.algorithms if a in (Algorithm.TORCH,)]
        if not self.algorithms or wrong:
            raise ValueError("algorithms must be labs' own all-reduces (naive, whole-tensor "
                             "ring, ring, recursive doubling, halving-doubling, double tree): "
                             "torch's built-in sends its own messages, which the link does not "
                             "carry.")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) \
                or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}.")
        if not 0 <= self.min_seconds < 60:
            raise ValueError(f"min_seconds must lie between 0 and 60 s, got "
                             f"{self.min_seconds!r}.")
        if not 0 < self.start_delay_s < 1:
            raise ValueError(f"start_delay_s must lie between 0 and 1 s, got "
                             f"{self.start_delay_s!r}.")
        if self.skip_beyond is not None and not (isinstance(self.skip_beyond, (int, float))
                                                 and self.skip_beyond >= 1):
            raise ValueError(f"skip_beyond must be None (run every case) or a number >= 1 "
                             f"(times the fastest by the model), got {self.skip_beyond!r}.")

    def predict(self, algorithm: Algorithm, size_bytes: int, world_size: int) -> float:
        """The model's seconds for one case (:func:`labs.cost_model.predict_on_link`)."""
        return predict_on_link(algorithm, size_bytes, world_size, self.link,
                               segment_bytes=self.segment_bytes)

    def runs(self, algorithm: Algorithm, size_bytes: int, world_size: int) -> bool:
        """Whether the case is run: always, unless ``skip_beyond`` is set and the model puts
        it at more than ``skip_beyond`` times the fastest of ``algorithms`` at that size."""
        if self.skip_beyond is None:
            return True
        fastest = min(self.predict(a, size_bytes, world_size) for a in self.algorithms)
        return self.predict(algorithm, size_bytes, world_size) <= self.skip_beyond * fastest

    def repeats_of(self, algorithm: Algorithm, size_bytes: int, world_size: int) -> int:
        """Timed calls of one case: ``repeats``, or more for a short case, up to
        ``3 * repeats``, so that their model times add up to ``min_seconds``; 0 for a case
        that is not run. It depends on the settings alone, so every rank agrees on it without
        a message."""
        if not self.runs(algorithm, size_bytes, world_size):
            return 0
        wanted = math.ceil(self.min_seconds / self.predict(algorithm, size_bytes, world_size))
        return max(self.repeats, min(3 * self.repeats, wanted))


@dataclass(frozen=True)
class LinkTiming:
    """One case measured on the link.

    On the link the machine adds time to a call (a rank that wakes late, an addition, a real
    message slower than its modelled one), so the **fastest** call is the one it disturbed
    least, and the one held against the model; the slowest shows how much the machine added
    at worst. A call's time runs from the moment the last rank started, and the ranks start up
    to a millisecond or more apart: an algorithm whose first messages do not wait for the
    last rank (the naive one's, when the last rank is the root) has done part of its work by
    then, and a call can come out faster than the model by up to its spread
    (:attr:`from_first_start` counts from the first rank's start instead).

    Attributes:
        seconds: every repeat's time (the slowest rank's), in the order they ran.
        predicted: the model's seconds.
        correct: every call on every rank gave the exact sum.
    """

    world_size: int
    algorithm: Algorithm
    size_bytes: int
    seconds: tuple[float, ...]
    predicted: float
    correct: bool
    #: per call, how long after the first rank the last one started (the call's time runs
    #: from the last start: what the first ranks did before it is not counted)
    spreads: tuple[float, ...] = ()

    @property
    def fastest(self) -> float:
        """The fastest call."""
        return min(self.seconds)

    @property
    def from_first_start(self) -> tuple[float, ...]:
        """Every call's time counted from the first rank's start (seconds + spread): no
        faster than the model on an undisturbed link, whichever rank started last."""
        return tuple(t + s for t, s in zip(self.seconds, self.spreads, strict=True))

    @property
    def median(self) -> float:
        """The median over repeats."""
        return statistics.median(self.seconds)

    @property
    def ratio(self) -> float:
        """Measured (the fastest call) / predicted: 1 when the model is exact."""
        return self.fastest / self.predicted

    def within(self, tolerance: float) -> bool:
        """Whether the fastest call lies within ``tolerance`` (0.15: 15 %) of the
        prediction, above or below."""
        return abs(self.fastest - self.predicted) <= tolerance * self.predicted


def _sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _start_together(delay_s: float) -> float:
    """A moment on the shared monotonic clock, the same on every rank, a little after the
    latest rank got here; sleeps until it and returns it."""
    now = torch.tensor([time.monotonic()], dtype=torch.float64)
    dist.all_reduce(now, op=dist.ReduceOp.MAX)  # torch's own: not on the emulated link
    start = float(now) + delay_s
    _sleep_until(start)
    return start


def _call(algorithm: Algorithm, tensor: torch.Tensor, segment_bytes: int | None) -> None:
    if algorithm is Algorithm.RING:
        ring_all_reduce(tensor, segment_bytes=segment_bytes)
    else:
        all_reduce(tensor, algorithm=algorithm)


def link_sweep_worker(
    rank: int, world_size: int, settings: LinkSweepSettings,
) -> tuple[list[list[float]], list[list[float]], list[bool]]:
    """Rank worker: per case (sizes outer, algorithms inner), every repeat's seconds (the
    same on every rank), how far apart the ranks started each repeat, and whether every call
    gave the exact sum.

    Rank r adds r + 1, so the sum is N(N+1)/2, exact in float32. One call of each algorithm
    on the smallest size first, untimed: the first call of a process pays for allocating and
    for code paths run once."""
    algorithms = settings.algorithms
    expected = world_size * (world_size + 1) / 2
    for algorithm in algorithms:  # warm-up
        _call(algorithm, torch.full((min(settings.sizes) // 4,), float(rank + 1)),
              settings.segment_bytes)
    cases = [(size, a) for size in settings.sizes for a in algorithms]
    counts = [settings.repeats_of(a, size, world_size) for size, a in cases]
    # [case, repeat, 0]: when this rank really started, [..., 1]: when it returned, [..., 2]:
    # minus when it started (its maximum is the first start), all from the agreed moment.
    moments = torch.zeros(len(cases), max(counts), 3, dtype=torch.float64)
    correct = torch.ones(len(cases), dtype=torch.int32)
    for s, size in enumerate(settings.sizes):
        mine = range(s * len(algorithms), (s + 1) * len(algorithms))
        for repeat in range(max(counts[c] for c in mine)):
            for c in mine if repeat % 2 == 0 else reversed(mine):
                if repeat >= counts[c]:
                    continue
                tensor = torch.full((size // 4,), float(rank + 1))
                agreed = _start_together(settings.start_delay_s)
                moments[c, repeat, 0] = time.monotonic() - agreed
                moments[c, repeat, 2] = -moments[c, repeat, 0]
                _call(cases[c][1], tensor, settings.segment_bytes)
                moments[c, repeat, 1] = time.monotonic() - agreed
                if not bool((tensor == expected).all()):
                    correct[c] = 0
    dist.all_reduce(moments, op=dist.ReduceOp.MAX)  # the last rank to start, the last to end
    dist.all_reduce(correct, op=dist.ReduceOp.MIN)
    seconds = moments[..., 1] - moments[..., 0]
    spreads = moments[..., 0] + moments[..., 2]
    return ([seconds[c, :counts[c]].tolist() for c in range(len(cases))],
            [spreads[c, :counts[c]].tolist() for c in range(len(cases))],
            [bool(c) for c in correct.tolist()])


def measure_on_link(settings: LinkSweepSettings | None = None) -> list[LinkTiming]:
    """One launch per world size on ``settings.link``; rows ordered by world size, size, then
    algorithm, each with the model's prediction."""
    settings = LinkSweepSettings() if settings is None else settings
    settings.validate()
    rows = []
    for n in settings.world_sizes:
        emulated = sum(settings.predict(a, s, n) * settings.repeats_of(a, s, n)
                       for s in settings.sizes for a in settings.algorithms)
        results = launch(link_sweep_worker, n, args=(settings,), backend=Backend.GLOO,
                         device="cpu", echo=False, link=settings.link, threads=COMM_THREADS,
                         timeout=60 + 3 * emulated)
        seconds, spreads, correct = results[0]
        cases = [(size, a) for size in settings.sizes for a in settings.algorithms]
        for (size, algorithm), times, spread, right in zip(cases, seconds, spreads, correct,
                                                            strict=True):
            if not times:  # not run (skip_beyond)
                continue
            rows.append(LinkTiming(n, algorithm, size, tuple(times),
                                   settings.predict(algorithm, size, n), right, tuple(spread)))
    return rows


def find(timings: Sequence[LinkTiming], world_size: int, algorithm: Algorithm,
         size_bytes: int) -> LinkTiming:
    """The timing of one case; KeyError naming it when it was not measured."""
    for t in timings:
        if (t.world_size, t.algorithm, t.size_bytes) == (world_size, algorithm, size_bytes):
            return t
    raise KeyError(f"{algorithm.value} at N = {world_size}, {format_size(size_bytes)} was not "
                   "measured.")


def measured_crossover(timings: Sequence[LinkTiming], world_size: int,
                       faster: Algorithm = Algorithm.RING,
                       slower: Algorithm = Algorithm.RECURSIVE_DOUBLING) -> int | None:
    """The first size (in the order measured) from which ``faster``'s fastest call stays below
    ``slower``'s at every larger size, or None if it is not below at the largest."""
    sizes = sorted({t.size_bytes for t in timings if t.world_size == world_size})
    first = None
    for size in reversed(sizes):
        if find(timings, world_size, faster, size).fastest \
                >= find(timings, world_size, slower, size).fastest:
            break
        first = size
    return first


def link_table(timings: Sequence[LinkTiming]) -> str:
    """One row per case: the fastest, median and slowest call, the model, fastest / model."""
    rows = [[t.world_size, t.algorithm.value, format_size(t.size_bytes), len(t.seconds),
             f"{t.fastest * 1e3:.1f}", f"{t.median * 1e3:.1f}", f"{max(t.seconds) * 1e3:.1f}",
             f"{t.predicted * 1e3:.1f}", f"{t.ratio:.3f}", str(t.correct)] for t in timings]
    return format_table(["N", "algorithm", "size", "calls", "fastest (ms)", "median (ms)",
                         "slowest (ms)", "model (ms)", "fastest / model", "correct"], rows)


# --- the floor: what the emulation must stay above ------------------------------------------


@dataclass(frozen=True)
class FloorSettings:
    """What a message really costs here, and how late sleeping ranks wake.

    Attributes:
        world_size: ranks running at once (all of them sleep; ranks 0 and 1 send).
        sizes: message sizes timed over the real transport (ping-pong, one way) and added.
        iters: timed messages (and additions) of each size.
        sleep_s: how long each rank asks to sleep, ``sleeps`` times.
    """

    world_size: int = 8
    sizes: tuple[int, ...] = (1 << 10, 1 << 22)
    iters: int = 10
    sleep_s: float = 0.02
    sleeps: int = 10


@dataclass(frozen=True)
class Floor:
    """The real costs beside which the link must be slow.

    Attributes:
        messages: one-way message times over the real transport (median, min, max).
        additions: ``torch.add`` times on every rank at once, for the same sizes.
        lateness: how much later than asked every sleep of every rank ended, in seconds.
        cores: the machine's CPU cores.
    """

    world_size: int
    messages: tuple[PointTiming, ...]
    additions: tuple[PointTiming, ...]
    lateness: tuple[float, ...]
    cores: int


def floor_worker(rank: int, world_size: int,
                 settings: FloorSettings) -> tuple[list[PointTiming], list[PointTiming],
                                                   list[float]]:
    """Rank worker: real messages between ranks 0 and 1, additions on every rank, then every
    rank sleeps ``sleeps`` times at once and records how late it woke."""
    messages = time_p2p(rank, world_size, settings.sizes, iters=settings.iters, warmup=2,
                        pattern=P2PPattern.PING_PONG)
    additions = time_reduction(rank, world_size, settings.sizes, iters=settings.iters,
                               warmup=2)
    late = []
    dist.barrier()
    for _ in range(settings.sleeps):
        asked = time.monotonic() + settings.sleep_s
        _sleep_until(asked)
        late.append(time.monotonic() - asked)
    return messages, additions, late


def measure_floor(settings: FloorSettings | None = None) -> Floor:
    """One launch of :func:`floor_worker` over the real transport (no link)."""
    settings = FloorSettings() if settings is None else settings
    if not 2 <= settings.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must lie in 2..{MAX_WORLD_SIZE}, got "
                         f"{settings.world_size!r}.")
    results = launch(floor_worker, settings.world_size, args=(settings,), backend=Backend.GLOO,
                     device="cpu", echo=False, threads=COMM_THREADS)
    messages, additions, _ = results[0]
    lateness = tuple(s for _, _, late in results for s in late)
    return Floor(settings.world_size, tuple(messages), tuple(additions), lateness, cpu_cores())


# --- the claims the chapter makes about the floor and the sweep -------------------------------


def floor_claims(floor: Floor, link: Link) -> tuple[Claim, Claim]:
    """Whether the emulation can be believed: a sleeping rank wakes late by under a tenth of
    the link's latency (the median and middle half of every sleep), and a real message of the
    largest size, with its addition, costs under a tenth of what the link charges for it."""
    alpha_ms = link.alpha * 1e3
    late = Estimate.of([s * 1e3 for s in floor.lateness], "ms")
    wake = Claim.below(
        "ch2.wakeup-below-link-alpha", late, alpha_ms / 10,
        held="A sleeping rank woke {value:.2f} ms late (the median of {repeats} sleeps), under "
             "a tenth of the link's α of {alpha:.0f} ms. The latest of them, {worst:.1f} ms, "
             "shows why each case below runs several times and its fastest call is the one "
             "kept.",
        opposite="A sleeping rank woke {value:.2f} ms late (the median of {repeats} sleeps), "
                 "more than a tenth of the link's α of {alpha:.0f} ms: the link's times would "
                 "carry the machine's wake-ups. Give the link a larger α.",
        unsure="A sleeping rank woke {value:.2f} ms late (the median of {repeats} sleeps), "
               "about a tenth of the link's α of {alpha:.0f} ms: the wake-ups may show in the "
               "times below.",
        alpha=alpha_ms, worst=max(floor.lateness) * 1e3)
    message, addition = floor.messages[-1], floor.additions[-1]
    real = Estimate.of([s * 1e3 for s in message.all_seconds], "ms").plus(
        Estimate.of([s * 1e3 for s in addition.all_seconds], "ms"))
    link_ms = link.seconds(message.size_bytes) * 1e3
    cheap = Claim.below(
        "ch2.real-work-below-link", real, link_ms / 10,
        held="A real {size} message and adding it took {value:.1f} ms here, under a tenth of "
             "the {link_ms:.0f} ms the link charges for that message.",
        opposite="A real {size} message and adding it took {value:.1f} ms here, more than a "
                 "tenth of the {link_ms:.0f} ms the link charges: the machine's own work would "
                 "show. Give the link a lower bandwidth.",
        unsure="A real {size} message and adding it took {value:.1f} ms here, about a tenth "
               "of the {link_ms:.0f} ms the link charges: the machine's own work may show "
               "below.",
        size=format_size(message.size_bytes).replace("M", " MiB").replace("K", " KiB"),
        link_ms=link_ms)
    return wake, cheap


def sweep_claims(timings: Sequence[LinkTiming]) -> tuple[Claim, Claim, Claim]:
    """What the sweep says of the model: every case's fastest call within 15 % of it; counted
    from the first rank's start, no call under it; counted from the last rank's start, only
    naive calls under it (their senders do not wait for the last rank)."""
    ratios = [t.ratio for t in timings]
    within = Claim.below(
        "ch2.sweep-within-15-percent", Estimate.span([abs(r - 1) * 100 for r in ratios], "%"),
        15,
        held="The fastest call of every one of the {cases} cases came within 15 % of the "
             "model: from {lowest:.3f} to {highest:.3f} times it.",
        opposite="No case's fastest call came within 15 % of the model: they lie from "
                 "{lowest:.3f} to {highest:.3f} times it.",
        unsure="Some cases' fastest calls came within 15 % of the model and some did not: "
               "they lie from {lowest:.3f} to {highest:.3f} times it.",
        cases=len(ratios), lowest=min(ratios), highest=max(ratios))
    never = Claim.above(
        "ch2.never-under-the-model-from-the-first-start",
        Estimate.span([min(t.from_first_start) / t.predicted for t in timings], "x"), 0.999,
        held="Counted from the first rank's start, no call of any case beat its model: the "
             "closest came to {low:.3f} times it.",
        opposite="Even counted from the first rank's start, every call beat its model (down "
                 "to {low:.3f} times it): the model charges more than the link's rules.",
        unsure="Counted from the first rank's start, some calls still beat their model, down "
               "to {low:.3f} times it: the model charges those cases more than the link's "
               "rules do.")
    under = [t for t in timings if t.ratio < 0.999]
    others = [t for t in under if t.algorithm is not Algorithm.NAIVE]
    only_naive = Claim.below(
        "ch2.only-naive-calls-under-the-model", Estimate.exact(len(others)), 0.5,
        held="Counted from the last rank's start, {under} of the {cases} cases came in under "
             "their model, all of them naive ones{lowest}.",
        opposite="Counted from the last rank's start, {value:.0f} cases of other algorithms "
                 "than the naive one came in under their model: their first step does not "
                 "wait for the last rank as it should.",
        under=len(under), cases=len(timings),
        lowest=f" (down to {min(t.ratio for t in under):.3f})" if under else "")
    return within, never, only_naive


def crossover_claim(timings: Sequence[LinkTiming], settings: LinkSweepSettings,
                    world_sizes: Sequence[int] = (4, 8)) -> tuple[list[str], Claim]:
    """Whether the ring overtakes recursive doubling, at each of ``world_sizes``, at the first
    swept size above the model's crossover S*; with one line per world size saying where it
    did and by how much at that size."""
    lines, misplaced = [], 0
    for n in world_sizes:
        cross = crossover_on_link(Algorithm.RING, Algorithm.RECURSIVE_DOUBLING, n, settings.link)
        above = min(s for s in settings.sizes if s > cross)
        first = measured_crossover(timings, n)
        misplaced += first != above
        ring = find(timings, n, Algorithm.RING, above).fastest
        doubling = find(timings, n, Algorithm.RECURSIVE_DOUBLING, above).fastest
        lines.append(f"N = {n}: measured, the ring is the faster from "
                     f"{format_size(first) if first else 'no size'} on; at "
                     f"{format_size(above)} it took {ring / doubling:.2f} times recursive "
                     "doubling's time")
    claim = Claim.below(
        "ch2.crossover-where-the-model-puts-it", Estimate.exact(misplaced), 0.5,
        held="At every world size the ring overtook recursive doubling at the first swept "
             "size above the model's S*.",
        opposite="At {value:.0f} of the {sizes} world sizes the ring overtook recursive "
                 "doubling elsewhere than at the first swept size above the model's S*.",
        sizes=len(world_sizes))
    return lines, claim
