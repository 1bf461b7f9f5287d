"""Experiments of chapters 2-4 that look inside the collectives of :mod:`labs.collectives`.

Each experiment is a frozen settings dataclass, a rank worker ``fn(rank, world_size,
settings)`` for :func:`labs.launcher.launch`, and a parent-side function that validates the
settings (before any process starts), launches the worker and returns plain results:

* **ring trace** (:class:`TraceSettings`, :func:`run_ring_trace`): every step of a ring
  all-reduce, reduce-scatter or all-gather of a tiny tensor, with the values that travelled;
  the tables and the animation of :mod:`labs.viz.collectives` are drawn from it.
* **traffic** (:class:`TrafficSettings`, :func:`measure_traffic`): messages and bytes each
  rank really sent and received, per algorithm, beside the closed forms
  (:func:`expected_traffic`).
* **agreement** (:class:`AgreementSettings`, :func:`compare_algorithms`): every algorithm on
  the same random float32 inputs; do the ranks end with the same bits, and how far is the
  result from torch's own all-reduce and from the exact sum?
* **planning** (:class:`PlanningSettings`, :func:`measure_planning`): the pipelined ring
  all-reduce with its schedule kept from call to call (:class:`labs.collectives.RingBuffers`)
  against the same calls that work the schedule out again each time.

The workers build CPU tensors, so every launch here uses gloo, on a GPU machine too.
Ranks import this module to find the workers, so it imports nothing heavy (no matplotlib).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

from labs.clock import now
from labs.collectives import (
    Algorithm,
    Collective,
    CommStats,
    Phase,
    Recorder,
    RingBuffers,
    RingStep,
    all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    shard_bounds,
)
from labs.experiments.timing import COMM_THREADS
from labs.launcher import MAX_WORLD_SIZE, Backend, launch

# --- the ring trace ---------------------------------------------------------------------------

#: float32 holds every integer below 2**24 exactly; the trace's sums stay below it.
_EXACT_FLOAT32 = 1 << 24


@dataclass(frozen=True)
class TraceSettings:
    """A ring run on a tensor small enough to print every value it sends.

    Rank r starts with element i equal to (i+1)·10^r, so in any partial sum the decimal digit
    in position r says whether rank r's contribution is in it: 1111 at N = 4 is the finished
    first element, 11 is ranks 0 and 1 only. For :attr:`Collective.ALL_GATHER` rank r starts
    with chunk r (``shard_bounds``) of its tensor only.

    Attributes:
        collective: which ring to trace: the all-reduce (both phases) or one phase alone.
        numel: elements in the full tensor (1..9, so that each element is one decimal digit).
    """

    collective: Collective = Collective.ALL_REDUCE
    numel: int = 8

    def validate(self, world_size: int) -> None:
        """Raise ValueError, saying what to change, if the trace would not be readable."""
        if not 1 <= self.numel <= 9:
            raise ValueError(
                f"numel={self.numel}: a trace needs 1..9 elements (element i of rank r is "
                "(i+1)*10**r, one decimal digit per element); use 4 or 8."
            )
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world size {world_size} is out of range 1..{MAX_WORLD_SIZE}.")
        largest = self.numel * (10**world_size - 1) // 9  # the last element's sum, 99...9
        if largest >= _EXACT_FLOAT32:
            raise ValueError(
                f"world_size={world_size}: with {self.numel} elements the sums reach {largest}, "
                "past 2**24, where float32 rounds integers; trace at most 7 ranks (4 reads best)."
            )

    def tensor(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s full input: element i is (i+1)·10^rank (1-D float32)."""
        return torch.arange(1, self.numel + 1, dtype=torch.float32) * 10.0**rank

    def start(self, rank: int, world_size: int) -> torch.Tensor:
        """What rank ``rank`` passes to the collective: the full tensor, or for an
        all-gather its chunk ``rank`` of it."""
        full = self.tensor(rank)
        if self.collective is not Collective.ALL_GATHER:
            return full
        bounds = shard_bounds(self.numel, world_size)
        return full[bounds[rank]:bounds[rank + 1]].clone()


@dataclass(frozen=True)
class RingTrace:
    """One traced ring run on every rank.

    Attributes:
        collective: the collective that was traced.
        world_size: N.
        numel: elements of the full tensor (the all-gather's result, the others' input).
        inputs: what each rank passed in (index = rank): its full tensor, or its shard.
        outputs: what each rank got back: the sum (all-reduce), its chunk of the sum
            (reduce-scatter) or the concatenated shards (all-gather).
        steps: every rank's :class:`RingStep`, ordered by phase, step, then rank.
    """

    collective: Collective
    world_size: int
    numel: int
    inputs: tuple[tuple[float, ...], ...]
    outputs: tuple[tuple[float, ...], ...]
    steps: tuple[RingStep, ...] = field(repr=False)


def _floats(tensor: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in tensor.reshape(-1))


def ring_trace_worker(
    rank: int, world_size: int, settings: TraceSettings
) -> tuple[tuple[float, ...], tuple[float, ...], list[RingStep]]:
    """Rank worker: run the traced ring collective; return (input, output, steps)."""
    recorder = Recorder(trace=True)
    start = settings.start(rank, world_size)
    if settings.collective is Collective.ALL_REDUCE:
        out = ring_all_reduce(start.clone(), recorder=recorder, segment_bytes=None)
    elif settings.collective is Collective.REDUCE_SCATTER:
        out = ring_reduce_scatter(start, recorder=recorder, segment_bytes=None)
    else:
        out = ring_all_gather(start, numel=settings.numel, recorder=recorder,
                              segment_bytes=None)
    return _floats(start), _floats(out), recorder.steps


def _phase_order(step: RingStep) -> tuple[int, int, int]:
    """Reduce-scatter before all-gather, then by step, then by rank."""
    return list(Phase).index(step.phase), step.step, step.rank


def run_ring_trace(world_size: int = 4, settings: TraceSettings | None = None) -> RingTrace:
    """Trace ``settings.collective`` on ``world_size`` real ranks (default: a ring
    all-reduce of 8 elements)."""
    settings = TraceSettings() if settings is None else settings
    settings.validate(world_size)
    results = launch(ring_trace_worker, world_size, args=(settings,), backend=Backend.GLOO,
                     device="cpu", echo=False)
    steps = sorted((s for _, _, rank_steps in results for s in rank_steps), key=_phase_order)
    return RingTrace(
        collective=settings.collective,
        world_size=world_size,
        numel=settings.numel,
        inputs=tuple(r[0] for r in results),
        outputs=tuple(r[1] for r in results),
        steps=tuple(steps),
    )


# --- traffic: measured messages and bytes beside the closed forms -----------------------------

#: The all-reduce algorithms whose every message goes through a Recorder (not TORCH).
COUNTED_ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm.NAIVE, Algorithm.WHOLE_TENSOR_RING, Algorithm.RING, Algorithm.RECURSIVE_DOUBLING,
    Algorithm.HALVING_DOUBLING, Algorithm.DOUBLE_TREE,
)
#: The ones chapter 2's traffic and agreement tables show: all of them.
RECORDED_ALGORITHMS: tuple[Algorithm, ...] = COUNTED_ALGORITHMS


@dataclass(frozen=True)
class TrafficSettings:
    """Count every point-to-point message of each all-reduce algorithm.

    Attributes:
        numel: float32 elements in the tensor; it must divide by every world size measured,
            so that the ring's chunks are equal and 2(N-1)/N·S is exact. 840 divides by 1..8.
        algorithms: the algorithms to count (torch's own all-reduce cannot be counted: its
            messages never pass through our ``isend``/``irecv``).
    """

    numel: int = 840
    algorithms: tuple[Algorithm, ...] = RECORDED_ALGORITHMS

    def validate(self, world_sizes: Iterable[int]) -> None:
        """Raise ValueError, saying what to change, before any process starts."""
        for algorithm in self.algorithms:
            if algorithm not in COUNTED_ALGORITHMS:
                raise ValueError(
                    f"{algorithm.name} cannot be counted (its messages bypass the Recorder); "
                    f"choose among {', '.join(a.name for a in COUNTED_ALGORITHMS)}."
                )
        for n in world_sizes:
            if not 1 <= n <= MAX_WORLD_SIZE:
                raise ValueError(f"world size {n} is out of range 1..{MAX_WORLD_SIZE}.")
            if self.numel < 1 or self.numel % n:
                raise ValueError(
                    f"numel={self.numel} does not divide by world size {n}: the ring's chunks "
                    "would be uneven and its closed form inexact. Use a multiple of every "
                    "world size (840 for 1..8)."
                )

    @property
    def size_bytes(self) -> int:
        """S, the size of the tensor being all-reduced."""
        return self.numel * 4


@dataclass(frozen=True)
class Traffic:
    """Traffic of one all-reduce on N ranks, in messages and in multiples of S.

    Attributes:
        messages_sent: messages sent by the busiest rank.
        sent: bytes sent by the busiest rank, divided by S.
        received: bytes received by the busiest rank, divided by S.
        group_messages: messages sent by all ranks together.
    """

    messages_sent: int
    sent: Fraction
    received: Fraction
    group_messages: int


def _log2_floor(n: int) -> int:
    return n.bit_length() - 1


def expected_traffic(algorithm: Algorithm, world_size: int) -> Traffic:
    """The closed form of ``algorithm`` on N = ``world_size`` ranks (see the table in
    :mod:`labs.collectives`):

    * naive: the root sends and receives (N-1)·S in N-1 messages each way; 2(N-1) in all.
    * whole-tensor ring: every rank sends and receives (N-1)·S in N-1 messages; N(N-1) in all.
    * ring: every rank sends and receives 2(N-1) chunks of S/N; 2N(N-1) messages in all.
    * recursive doubling, N = 2^k: every rank swaps S with k partners; N·k in all. Otherwise,
      with P the largest power of two below N and R = N - P, the R odd ranks of the first 2R
      also take in and hand back a neighbour's tensor: (k+1)·S with k = log2 P, i.e.
      ceil(log2 N)·S for the busiest rank, and P·k + 2R messages in all.
    * halving-doubling, N = 2^k: every rank sends 2k messages, (N-1)/N·S in each phase,
      2(N-1)/N·S in all; 2N·k messages in all. Otherwise the same among the P ranks, and the
      R odd ranks of the first 2R also take in and hand back a neighbour's tensor: 2k + 1
      messages and 2(P-1)/P·S + S each way for the busiest rank, 2P·k + 2R in all.
    * double binary tree (one segment per half: S/2 within 64 KiB): along every tree edge one
      message up and one down per half; the busiest rank sends and receives 4 messages and 2S
      from N = 4 (3 and 3/2·S at N = 3, 2 and S at N = 2); 4(N-1) messages in all.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if algorithm is Algorithm.NAIVE:
        return Traffic(n - 1, Fraction(n - 1), Fraction(n - 1), 2 * (n - 1))
    if algorithm is Algorithm.WHOLE_TENSOR_RING:
        return Traffic(n - 1, Fraction(n - 1), Fraction(n - 1), n * (n - 1))
    if algorithm is Algorithm.RING:
        return Traffic(2 * (n - 1), Fraction(2 * (n - 1), n), Fraction(2 * (n - 1), n),
                       2 * n * (n - 1))
    if algorithm is Algorithm.RECURSIVE_DOUBLING:
        k = _log2_floor(n)
        power = 1 << k
        extra = n - power
        busiest = k + (1 if extra else 0)
        return Traffic(busiest, Fraction(busiest), Fraction(busiest), power * k + 2 * extra)
    if algorithm is Algorithm.HALVING_DOUBLING:
        k = _log2_floor(n)
        power = 1 << k
        extra = n - power
        share = Fraction(2 * (power - 1), power) + (1 if extra else 0)
        return Traffic(2 * k + (1 if extra else 0), share, share, 2 * power * k + 2 * extra)
    if algorithm is Algorithm.DOUBLE_TREE:
        if n == 1:
            return Traffic(0, Fraction(0), Fraction(0), 0)
        messages, share = {2: (2, Fraction(1)), 3: (3, Fraction(3, 2))}.get(n, (4, Fraction(2)))
        return Traffic(messages, share, share, 4 * (n - 1))
    raise ValueError(f"no closed form for {algorithm.name}: its messages are torch's own.")


def traffic_worker(
    rank: int, world_size: int, settings: TrafficSettings
) -> dict[Algorithm, CommStats]:
    """Rank worker: all-reduce a tensor with each algorithm and count this rank's traffic.
    The ring runs lock-step (``segment_bytes=None``), so one ring step is one message."""
    stats = {}
    for algorithm in settings.algorithms:
        recorder = Recorder()
        tensor = torch.full((settings.numel,), float(rank + 1))
        if algorithm is Algorithm.RING:
            ring_all_reduce(tensor, recorder=recorder, segment_bytes=None)
        else:
            all_reduce(tensor, algorithm=algorithm, recorder=recorder)
        expected = world_size * (world_size + 1) / 2
        if not bool((tensor == expected).all()):
            raise AssertionError(f"{algorithm.name} gave a wrong sum on rank {rank}")
        stats[algorithm] = recorder.stats
    return stats


@dataclass(frozen=True)
class TrafficRow:
    """Measured and closed-form traffic of one algorithm on one world size."""

    world_size: int
    algorithm: Algorithm
    measured: Traffic
    expected: Traffic

    @property
    def matches(self) -> bool:
        """True when every measured count equals its closed form."""
        return self.measured == self.expected


def _summarise(per_rank: Sequence[CommStats], size_bytes: int) -> Traffic:
    return Traffic(
        messages_sent=max(s.messages_sent for s in per_rank),
        sent=Fraction(max(s.bytes_sent for s in per_rank), size_bytes),
        received=Fraction(max(s.bytes_received for s in per_rank), size_bytes),
        group_messages=sum(s.messages_sent for s in per_rank),
    )


def measure_traffic(
    world_sizes: Iterable[int] = range(2, 9), settings: TrafficSettings | None = None
) -> list[TrafficRow]:
    """One launch per world size, every algorithm inside it; rows ordered by world size,
    then algorithm."""
    settings = TrafficSettings() if settings is None else settings
    sizes = list(world_sizes)
    settings.validate(sizes)
    rows = []
    for n in sizes:
        results = launch(traffic_worker, n, args=(settings,), backend=Backend.GLOO,
                         device="cpu", echo=False)
        for algorithm in settings.algorithms:
            measured = _summarise([r[algorithm] for r in results], settings.size_bytes)
            rows.append(TrafficRow(n, algorithm, measured, expected_traffic(algorithm, n)))
    return rows


# --- agreement: same bits on every rank, and the same sum as torch ----------------------------


@dataclass(frozen=True)
class AgreementSettings:
    """Every algorithm all-reduces the same random float32 tensors.

    Attributes:
        numel: elements per rank.
        seed: rank r draws its tensor from ``torch.Generator().manual_seed(seed * 1000 + r)``.
        algorithms: the algorithms to run (``Algorithm.TORCH`` is torch's own all-reduce).
    """

    numel: int = 4096
    seed: int = 0
    algorithms: tuple[Algorithm, ...] = (*RECORDED_ALGORITHMS, Algorithm.TORCH)

    def tensor(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s input: standard normal, 1-D float32."""
        generator = torch.Generator().manual_seed(self.seed * 1000 + rank)
        return torch.randn(self.numel, generator=generator)


def agreement_worker(
    rank: int, world_size: int, settings: AgreementSettings
) -> dict[Algorithm, torch.Tensor]:
    """Rank worker: each algorithm's all-reduce (SUM) of this rank's tensor."""
    results = {}
    for algorithm in settings.algorithms:
        tensor = settings.tensor(rank)
        if algorithm is Algorithm.TORCH:
            dist.all_reduce(tensor)
        else:
            all_reduce(tensor, algorithm=algorithm)
        results[algorithm] = tensor
    return results


@dataclass(frozen=True)
class AgreementRow:
    """How one algorithm's results compare, on one world size.

    Attributes:
        differing: elements at which some rank's bits differ from rank 0's.
        error: max |result - exact sum| over ranks and elements (exact: summed in float64).
        from_torch: max |result - torch's all_reduce result| over ranks and elements.
    """

    world_size: int
    algorithm: Algorithm
    differing: int
    error: float
    from_torch: float


def compare_algorithms(
    world_sizes: Iterable[int], settings: AgreementSettings | None = None
) -> list[AgreementRow]:
    """One launch per world size; rows ordered by world size, then algorithm."""
    settings = AgreementSettings() if settings is None else settings
    sizes = list(world_sizes)
    for n in sizes:
        if not 1 <= n <= MAX_WORLD_SIZE:
            raise ValueError(f"world size {n} is out of range 1..{MAX_WORLD_SIZE}.")
    if settings.numel < 1:
        raise ValueError(f"numel must be at least 1, got {settings.numel}")
    algorithms = tuple(dict.fromkeys((*settings.algorithms, Algorithm.TORCH)))
    settings = AgreementSettings(settings.numel, settings.seed, algorithms)
    rows = []
    for n in sizes:
        results = launch(agreement_worker, n, args=(settings,), backend=Backend.GLOO,
                         device="cpu", echo=False)
        exact = sum(settings.tensor(r).double() for r in range(n))
        torch_sum = results[0][Algorithm.TORCH]
        for algorithm in algorithms:
            per_rank = torch.stack([r[algorithm] for r in results])  # (N, numel) float32
            differing = int((per_rank != per_rank[0]).any(dim=0).sum())
            rows.append(AgreementRow(
                world_size=n,
                algorithm=algorithm,
                differing=differing,
                error=float((per_rank.double() - exact).abs().max()),
                from_torch=float((per_rank - torch_sum).abs().max()),
            ))
    return rows


# --- planning: what the ring's schedule costs per call -----------------------------------------


@dataclass(frozen=True)
class PlanningSettings:
    """Pipelined ring all-reduces of one float32 tensor on every rank, in pairs: one call runs
    the schedule kept in a :class:`~labs.collectives.RingBuffers` from the call before, the
    other first drops it, so that the call works out which segment goes where again and, no
    longer the call a kept pass serves, checks its arguments again (the scratch buffers are
    kept for both). The two take turns, each pair in the opposite order to
    the last, after a barrier each.

    Attributes:
        size_bytes: the tensor's size, a multiple of 4 bytes.
        iters: timed pairs.
        warmup: untimed pairs first.
    """

    size_bytes: int = 1 << 20
    iters: int = 100
    warmup: int = 5


@dataclass(frozen=True)
class Planning:
    """What keeping the ring's schedule saved, per call (each call's time is its slowest
    rank's).

    Attributes:
        kept: median seconds of the calls that ran the kept schedule.
        planned: median seconds of the calls that worked the schedule out first.
        ratio: median over pairs of planned / kept (above 1: planning costs time).
        compiled: schedules compiled during the timed calls on rank 0, kept calls first: 0 and
            ``iters`` when the kept schedule is really reused.
    """

    world_size: int
    size_bytes: int
    kept: float
    planned: float
    ratio: float
    compiled: tuple[int, int]


def planning_worker(
    rank: int, world_size: int, settings: PlanningSettings
) -> tuple[list[tuple[float, float]], tuple[int, int]]:
    """Rank worker: (seconds kept, seconds planned) per timed pair, and how many schedules
    each kind of call compiled."""
    numel = settings.size_bytes // 4
    start_values = torch.arange(numel, dtype=torch.float32) % 7
    work, buffers = torch.empty(numel), RingBuffers()
    pairs, compiled = [], [0, 0]
    for i in range(settings.warmup + settings.iters):
        seconds = {}
        for kept in (True, False) if i % 2 == 0 else (False, True):
            if not kept:
                buffers.program = None
            before = buffers.program
            work.copy_(start_values)
            dist.barrier()
            start = now(work.device)
            ring_all_reduce(work, buffers=buffers)
            seconds[kept] = now(work.device) - start
            if i >= settings.warmup and buffers.program is not before:
                compiled[0 if kept else 1] += 1
        if i >= settings.warmup:
            pairs.append((seconds[True], seconds[False]))
    return pairs, (compiled[0], compiled[1])


def measure_planning(world_size: int = 2, settings: PlanningSettings | None = None) -> Planning:
    """One launch of :func:`planning_worker` on gloo, one intra-op thread per rank as the
    benchmark runs the ring; medians over the timed pairs."""
    settings = PlanningSettings() if settings is None else settings
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world size {world_size} is out of range 2..{MAX_WORLD_SIZE}: one "
                         "rank sends nothing, so it has no schedule to keep.")
    if settings.size_bytes < 4 or settings.size_bytes % 4:
        raise ValueError(f"size_bytes must be a positive multiple of 4 (float32), got "
                         f"{settings.size_bytes}.")
    if settings.iters < 1 or settings.warmup < 0:
        raise ValueError(f"iters must be at least 1 and warmup at least 0, got "
                         f"iters={settings.iters}, warmup={settings.warmup}.")
    results = launch(planning_worker, world_size, args=(settings,), backend=Backend.GLOO,
                     device="cpu", echo=False, threads=COMM_THREADS)
    slowest = [tuple(max(rank_pairs[i][k] for rank_pairs, _ in results) for k in (0, 1))
               for i in range(settings.iters)]
    return Planning(
        world_size=world_size,
        size_bytes=settings.size_bytes,
        kept=statistics.median(kept for kept, _ in slowest),
        planned=statistics.median(planned for _, planned in slowest),
        ratio=statistics.median(planned / kept for kept, planned in slowest),
        compiled=results[0][1],
    )
