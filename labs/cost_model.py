"""The latency-bandwidth (alpha-beta) cost model: its closed forms, on the emulated link and
on nodes joined by a slower link.

Chapter 2. A message of m bytes between two ranks takes ``T(m) = alpha + beta * m``: alpha is
the fixed cost of a message (software overhead, a handshake, a wake-up), beta the seconds per
byte on the link (1 / bandwidth). This is Hockney's model (Parallel Computing 20, 1994); the
closed forms for the collectives are those of Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH" (IJHPCA 2005), checked against the code of
:mod:`labs.collectives`.

Three uses of it live here:

* **Priced by parameters** (:class:`AlphaBeta`): :func:`coefficients` counts each algorithm's
  messages, bytes and additions on the critical path, :func:`predict` prices them and
  :func:`crossover_bytes` finds the size at which two algorithms take equally long. The
  parameters are chosen by hand or fitted on this machine's real transport
  (:func:`labs.experiments.cost_fit.fit_alpha_beta`).
* **On the emulated link** (:class:`labs.Link`), where the model is the wire:
  :func:`predict_on_link` gives an all-reduce's time from the schedule of each algorithm and
  the link's port model, and :func:`crossover_on_link` the size at which two algorithms take
  equally long. Measured on real ranks, every time lands within a few per cent of these
  (chapter 2 and ``tests/test_link_model.py`` show it).
* **When data parallelism pays** (chapter 5): :func:`crossover_batch`, the per-rank batch
  above which N ranks train more samples per second than one.
* **On a topology** (:class:`labs.Topology`, chapter 8): the flat ring against the
  hierarchical all-reduce, step by step (:func:`ring_step_times`, :func:`predict_on_topology`)
  and in bytes between nodes (:func:`bytes_across_nodes`).

What the model fitted on one machine leaves out: several pairs of ranks copying at once and
competing for the cores and the memory bus (every rank of a ring sends at the same time; the
fit measured one pair), ranks waiting for a core when there are more ranks than cores, the
Python work of each call of the from-scratch collectives (it shows at small sizes), the
pipelining of the CPU ring, one-way messages (the naive root's) that cost less than the
exchange the fit measured, and whatever algorithm torch's built-in picks (there is no closed
form for ``Algorithm.TORCH``). :func:`labs.experiments.cost_fit.measured_over_predicted` and
:func:`labs.viz.cost_model.plot_cost_model` show where it is wrong.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from labs.collectives import DEFAULT_SEGMENT_BYTES, Algorithm, Collective, shard_bounds
from labs.double_tree import double_tree_on_link
from labs.link import Link, Topology
from labs.multi_ring import multi_ring_bytes_across_nodes, multi_ring_on_topology


@dataclass(frozen=True)
class AlphaBeta:
    """The cost model's parameters: ``alpha_s`` seconds per message, ``beta_s_per_byte``
    seconds per byte on one link, ``gamma_s_per_byte`` seconds per byte to add a received
    chunk into a local one (0 leaves the reduction out). Fitted ones are a
    :class:`labs.experiments.cost_fit.FittedAlphaBeta`, which keeps what they were fitted on."""

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")

    @property
    def bandwidth_gbps(self) -> float:
        """1 / beta in GB/s (1e9 bytes)."""
        return math.inf if self.beta_s_per_byte == 0 else 1e-9 / self.beta_s_per_byte

    def summary(self) -> str:
        """One line: the parameters."""
        return (f"alpha = {self.alpha_s * 1e6:.1f} us, beta = {self.beta_s_per_byte * 1e9:.3f} "
                f"ns/B ({self.bandwidth_gbps:.2f} GB/s), gamma = "
                f"{self.gamma_s_per_byte * 1e9:.3f} ns/B")


# --- the closed forms --------------------------------------------------------------------------


@dataclass(frozen=True)
class Coefficients:
    """A prediction is linear in S: ``messages * alpha + bytes * beta + reduced * gamma``,
    where ``bytes`` and ``reduced`` are multiples of S (per byte of S, on the critical path)."""

    messages: float  #: sequential message latencies on the critical path
    bytes_per_byte: float  #: bytes on the critical path's links, per byte of S
    reduced_per_byte: float  #: bytes added on the critical path, per byte of S

    def seconds(self, size_bytes: float, params: AlphaBeta) -> float:
        """The predicted time for S = ``size_bytes``."""
        return (self.messages * params.alpha_s
                + size_bytes * (self.bytes_per_byte * params.beta_s_per_byte
                                + self.reduced_per_byte * params.gamma_s_per_byte))


def coefficients(
    algorithm: Algorithm, world_size: int, collective: Collective = Collective.ALL_REDUCE,
) -> Coefficients:
    """The counts behind :func:`predict` (N ranks, S bytes, a chunk is S/N).

    All-reduce:

    * ring: 2(N-1) steps, each one message of S/N each way at once, and in the N-1
      reduce-scatter steps an add of S/N: ``2(N-1)(alpha + S/N beta) + (N-1) S/N gamma``.
    * recursive doubling, N a power of two: log2 N rounds, each a swap of S and an add of S:
      ``log2 N (alpha + S beta + S gamma)``. Otherwise, with P the largest power of two
      below N, two more messages (fold the extra ranks in first, send them the result last)
      and one more add: ``(log2 P + 2)(alpha + S beta) + (log2 P + 1) S gamma``.
    * naive: the root receives N-1 tensors one after the other, adding each, then sends N-1:
      ``2(N-1)(alpha + S beta) + (N-1) S gamma`` (its one link serialises everything; these
      messages go one way, so an alpha and beta fitted to exchanges overestimate them).
    * whole-tensor ring: N-1 steps, each passing S and adding S:
      ``(N-1)(alpha + S beta + S gamma)``.
    * halving-doubling, N a power of two: log2 N halving rounds (S/2, S/4, ..., S/N swapped
      and added) and log2 N doubling rounds (the same sizes swapped back):
      ``2 log2 N alpha + 2(N-1)/N S beta + (N-1)/N S gamma``. Otherwise, with P the largest
      power of two below N, the fold and the hand-back of recursive doubling around the
      rounds among P ranks: ``(2 log2 P + 2) alpha + (2(P-1)/P + 2) S beta + ((P-1)/P + 1) S
      gamma``.
    * double binary tree, pipelined (segments small beside S): ``2 ceil(log2 N) alpha + L S
      beta + R S gamma`` with L = 2 from N = 4 (3/2 at N = 3, 1 at N = 2), the busiest port's
      bytes, and R = 1 (1/2 at N = 2): a rank adds two children's halves in one tree.

    Reduce-scatter and all-gather by ring: one phase of the all-reduce ring,
    ``(N-1)(alpha + S/N beta)``, plus ``(N-1) S/N gamma`` for the reduce-scatter.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if algorithm not in collective.algorithms():
        raise ValueError(f"{collective.value} is not implemented by {algorithm.name}.")
    if algorithm is Algorithm.TORCH:
        raise ValueError("Algorithm.TORCH has no closed form: gloo and NCCL choose their own "
                         "algorithm (and switch by size); compare it with the measurements "
                         "instead.")
    n = world_size
    if n == 1:
        return Coefficients(0.0, 0.0, 0.0)
    steps = n - 1
    if collective is not Collective.ALL_REDUCE:
        reduced = steps / n if collective is Collective.REDUCE_SCATTER else 0.0
        return Coefficients(steps, steps / n, reduced)
    if algorithm is Algorithm.RING:
        return Coefficients(2 * steps, 2 * steps / n, steps / n)
    if algorithm is Algorithm.RECURSIVE_DOUBLING:
        rounds = n.bit_length() - 1  # log2 of the largest power of two <= N
        if n & (n - 1) == 0:
            return Coefficients(rounds, rounds, rounds)
        return Coefficients(rounds + 2, rounds + 2, rounds + 1)
    if algorithm is Algorithm.HALVING_DOUBLING:
        rounds = n.bit_length() - 1
        share = ((1 << rounds) - 1) / (1 << rounds)  # (P-1)/P
        fold = 0 if n & (n - 1) == 0 else 1
        return Coefficients(2 * rounds + 2 * fold, 2 * share + 2 * fold, share + fold)
    if algorithm is Algorithm.DOUBLE_TREE:
        depth = (n - 1).bit_length()  # ceil(log2 N)
        load = {2: 1.0, 3: 1.5}.get(n, 2.0)  # the busiest port's bytes, per byte of S
        return Coefficients(2 * depth, load, 0.5 if n == 2 else 1.0)
    if algorithm is Algorithm.NAIVE:
        return Coefficients(2 * steps, 2 * steps, steps)
    return Coefficients(steps, steps, steps)  # WHOLE_TENSOR_RING


def predict(
    algorithm: Algorithm, size_bytes: float, world_size: int, params: AlphaBeta,
    *, collective: Collective = Collective.ALL_REDUCE,
) -> float:
    """Predicted seconds of one ``collective`` of S = ``size_bytes`` on ``world_size`` ranks.

    The formulas are in :func:`coefficients`. They describe the lock-step algorithms on an
    idle network; see the module docstring for what they leave out.
    """
    if not isinstance(params, AlphaBeta):
        raise TypeError(f"params must be an AlphaBeta, got {type(params).__name__}.")
    if not isinstance(size_bytes, (int, float)) or not math.isfinite(size_bytes) \
            or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}.")
    return coefficients(algorithm, world_size, collective).seconds(size_bytes, params)


def crossover_bytes(
    a: Algorithm, b: Algorithm, world_size: int, params: AlphaBeta,
    *, collective: Collective = Collective.ALL_REDUCE,
) -> float | None:
    """The size S > 0 at which ``a`` and ``b`` are predicted to take equally long, or None if
    they never cross (one is faster at every size, or they are the same line).

    Both predictions are lines in S, ``c_a + d_a S`` and ``c_b + d_b S``, so
    ``S* = (c_b - c_a) / (d_a - d_b)``. Below S* the algorithm with fewer message latencies
    wins, above it the one with fewer bytes on the critical path.
    """
    ca = coefficients(a, world_size, collective)
    cb = coefficients(b, world_size, collective)
    intercept_a, intercept_b = ca.seconds(0, params), cb.seconds(0, params)
    slope_a = ca.seconds(1, params) - intercept_a
    slope_b = cb.seconds(1, params) - intercept_b
    if slope_a == slope_b:
        return None
    size = (intercept_b - intercept_a) / (slope_a - slope_b)
    return size if size > 0 and math.isfinite(size) else None


# --- on the emulated link ---------------------------------------------------------------------

#: The all-reduces :func:`predict_on_link` prices: every one built on labs' point-to-point layer
#: (torch's built-in sends its own messages, which the link does not carry).
LINK_ALGORITHMS: tuple[Algorithm, ...] = (Algorithm.NAIVE, Algorithm.WHOLE_TENSOR_RING,
                                          Algorithm.RING, Algorithm.RECURSIVE_DOUBLING,
                                          Algorithm.HALVING_DOUBLING, Algorithm.DOUBLE_TREE)


def predict_on_link(
    algorithm: Algorithm, size_bytes: float, world_size: int, link: Link,
    *, segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
) -> float:
    """Seconds of one all-reduce of S = ``size_bytes`` on N = ``world_size`` ranks over
    ``link``, every rank starting at the same moment, by the link's port model.

    The port model (:mod:`labs.link`): every rank has one outgoing and one incoming port. A
    message of m bytes occupies its sender's outgoing port for m/bw seconds, and the
    receiver's incoming port for m/bw seconds from alpha after it started leaving, so a
    message alone costs alpha + m/bw; a port carries one message at a time, in the order they
    were posted. Latencies overlap, bytes through one port do not. With B = S/bw:

    * naive: ``2 alpha + 2(N-1) B``. The N-1 tensors leave their ranks at once and queue at
      the root's incoming port (alpha + (N-1)B); the root's N-1 sends queue at its outgoing
      port the same way (alpha + (N-1)B more).
    * ring, chunks of c = S/N no larger than a segment (or ``segment_bytes=None``, lock-step):
      ``2(N-1)(alpha + c/bw)``: 2(N-1) steps, each one chunk through every port.
    * ring, chunks cut into segments of s = min(segment, c) and pipelined:
      ``alpha + c/bw + (2N-3) max(c/bw, alpha + s/bw)``. Each step after the first costs
      either c/bw, when the outgoing port streams the segments back to back, or alpha + s/bw,
      when the step's first segment waits for its latency. With s = c it is the lock-step form.
    * recursive doubling, N = 2^k: ``log2 N (alpha + B)``: k swaps of S.
    * recursive doubling, other N (P the largest power of two below N, R = N - P): the exact
      time follows the schedule of :func:`labs.collectives.recursive_doubling_all_reduce`.
      The R folded ranks start their rounds at alpha + B (a swap of ranks ready at t_x and
      t_y ends at ``max(t_x, t_y + alpha) + B`` on x), the others at 0; after log2 P rounds
      each folded rank hands the result back (alpha + B more). The fold and the hand-back
      overlap the rounds in part: the time lies between (log2 P + 1)(alpha + B) and
      (log2 P + 2)(alpha + B), where it depends on which partners the late ranks meet.
    * whole-tensor ring: ``(N-1)(alpha + B)``.
    * halving-doubling, N = 2^k: ``2 log2 N alpha + 2(N-1)/N B``: k swaps of S/2, ..., S/N, then
      the same swaps back. Other N: the schedule of recursive doubling's fold and hand-back
      around those rounds among P ranks, each swap of m bytes ending at
      ``max(t_x, t_y + alpha) + m/bw`` as above.
    * double binary tree: each rank's steps in the order their data is due on the link
      (:func:`labs.double_tree.rank_schedule`), through the ports
      (:func:`labs.double_tree.double_tree_on_link`, with the tree's own 64 KiB segments;
      ``segment_bytes`` is the ring's): at least ``max(2D (alpha + s/bw), alpha + L/bw)`` and
      about their sum, D = ceil(log2 N), L = 2S from N = 4.

    Additions are not priced: a rank adds what it received at memory speed, far faster than a
    link chosen to be slow carries it (chapter 2 measures both before choosing its link).
    Uneven chunks (S/N not a whole number of elements) are taken as S/N.
    """
    if not isinstance(link, Link):
        raise TypeError(f"link must be a labs.Link, got {type(link).__name__}.")
    if algorithm not in LINK_ALGORITHMS:
        raise ValueError(f"{algorithm.name} has no form on the link: torch's built-in sends its "
                         "own messages, which labs.Link does not carry.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if not isinstance(size_bytes, (int, float)) or not math.isfinite(size_bytes) \
            or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}.")
    n, alpha, bw = world_size, link.alpha, link.bandwidth
    if n == 1 or size_bytes == 0:
        return 0.0
    if algorithm is Algorithm.DOUBLE_TREE:
        return double_tree_on_link(size_bytes, n, link)
    whole = size_bytes / bw
    if algorithm is Algorithm.NAIVE:
        return 2 * alpha + 2 * (n - 1) * whole
    if algorithm is Algorithm.WHOLE_TENSOR_RING:
        return (n - 1) * (alpha + whole)
    if algorithm is Algorithm.RING:
        chunk = size_bytes / n
        segment = chunk if segment_bytes is None else min(chunk, segment_bytes)
        return alpha + chunk / bw + (2 * n - 3) * max(chunk / bw, alpha + segment / bw)
    power = 1 << (n.bit_length() - 1)
    if algorithm is Algorithm.RECURSIVE_DOUBLING:
        swaps = [(1 << j, whole) for j in range(power.bit_length() - 1)]
    else:  # halving (S/2 with the farthest partner first, ..., S/P), then doubling back
        halving = [(power >> (j + 1), whole / (2 << j)) for j in range(power.bit_length() - 1)]
        swaps = halving + halving[::-1]
    return _swaps_on_link(n, alpha, whole, swaps)


def _swaps_on_link(world_size: int, alpha: float, whole: float,
                   swaps: list[tuple[int, float]]) -> float:
    """Seconds of a schedule of pairwise swaps (distance, seconds of its bytes on the wire)
    among the P = 2^k ranks that remain after recursive doubling's fold (``whole`` = S/bw).
    Each swap ends at ``max(t_x, t_y + alpha) + m/bw`` on rank x (its incoming port is free
    from t_x on, and y's message left at t_y); the fold makes the first R virtual ranks start
    at alpha + S/bw, and the hand-back to the even ranks adds alpha + S/bw after them."""
    power = 1 << (world_size.bit_length() - 1)
    extra = world_size - power
    ready = [alpha + whole if v < extra else 0.0 for v in range(power)]  # virtual ranks
    for distance, seconds in swaps:
        ready = [max(ready[v], ready[v ^ distance] + alpha) + seconds for v in range(power)]
    folded = [t + alpha + whole for t in ready[:extra]]  # the hand-back to the even ranks
    return max(ready + folded)


def crossover_on_link(
    a: Algorithm, b: Algorithm, world_size: int, link: Link,
    *, segment_bytes: int | None = DEFAULT_SEGMENT_BYTES,
) -> float | None:
    """The size S at which ``a`` and ``b`` take equally long on ``link`` (bytes), the faster
    one changing there, or None if one is faster at every size from 1 B to 1 TiB (or as fast:
    at N = 2 the pipelined ring ties with recursive doubling once its port is the bottleneck).

    For the lock-step ring against recursive doubling at N = 2^k the two lines meet where
    ``2(N-1)(alpha + S/(N bw)) = k (alpha + S/bw)``:
    ``S* = alpha bw (2(N-1) - k) / (k - 2(N-1)/N)``. The ring's pipelined form and recursive
    doubling's other N are lines in pieces, so the crossing is found by bisection on the
    predictions themselves (to 1e-12 relative), which gives that S* wherever it applies.
    """
    def gap(size: float) -> float:
        """a's time - b's, 0 where they agree to 1e-9 (rounding, not a crossing)."""
        t_a, t_b = (predict_on_link(x, size, world_size, link, segment_bytes=segment_bytes)
                    for x in (a, b))
        return 0.0 if abs(t_a - t_b) <= 1e-9 * max(t_a, t_b) else t_a - t_b

    grid = [2.0 ** e for e in range(41)]  # 1 B .. 1 TiB
    signed = [(size, gap(size)) for size in grid]
    signed = [(size, g) for size, g in signed if g != 0]  # equal there: no crossing yet
    for (low, g_low), (high, g_high) in zip(signed, signed[1:], strict=False):
        if g_low * g_high < 0:
            while high / low > 1 + 1e-12:
                middle = math.sqrt(low * high)
                if gap(middle) * g_low > 0:
                    low = middle
                else:
                    high = middle
            return math.sqrt(low * high)
    return None


# --- when data parallelism pays (chapter 5) ---------------------------------------------------


def crossover_batch(alpha: float, bandwidth: float, model_bytes: float, world_size: int,
                    per_sample_s: float, fixed_s: float) -> float:
    """The per-rank batch b* above which N = ``world_size`` ranks of data parallelism train more
    samples per second than one rank does, when the gradients' all-reduce starts after backward
    (nothing overlaps it).

    One rank's step computes for ``T1(b) = c b + f`` (c = ``per_sample_s``, f = ``fixed_s``).
    N ranks, b samples each, add one ring all-reduce of S = ``model_bytes``:
    ``R = 2(N-1)(alpha + S/(N bw))`` (chapter 2's lock-step ring). N ranks deliver N b / (T1 + R)
    samples per second, one rank b / T1; N ranks are faster iff ``(N-1) T1 > R``, that is
    ``T1 > R/(N-1) = 2 alpha + 2 S/(N bw)``: a rank's compute per step must outlast one
    rank's share of the all-reduce. So ``b* = (2 alpha + 2 S/(N bw) - f) / c``, or 0 when the
    fixed cost alone outlasts it. The scaling efficiency at b is ``T1 / (T1 + R)``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 (one rank has nothing to overtake), "
                         f"got {world_size!r}.")
    for name, value in (("alpha", alpha), ("model_bytes", model_bytes), ("fixed_s", fixed_s)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    for name, value in (("bandwidth", bandwidth), ("per_sample_s", per_sample_s)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    share = 2 * alpha + 2 * model_bytes / (world_size * bandwidth)
    return max(0.0, (share - fixed_s) / per_sample_s)


# --- on a topology: nodes joined by a slower link (chapter 8) ----------------------------------


class TopologyAlgorithm(enum.Enum):
    """The all-reduces chapter 8 compares on a :class:`labs.Topology`."""

    #: :func:`labs.collectives.ring_all_reduce` over all N ranks, lock-step
    #: (``segment_bytes=None``): one ring that crosses between nodes at every node's edge.
    FLAT_RING = "flat ring"
    #: :func:`labs.multi_ring.multi_ring_all_reduce` with one channel per rank of a node,
    #: lock-step: the flat all-reduce as NCCL runs it, g rings laid out so that every network
    #: card carries one channel's crossing.
    MULTI_RING = "flat, g channels"
    #: :func:`labs.collectives.hierarchical_all_reduce`, lock-step: reduce-scatter inside each
    #: node, all-reduce across nodes, all-gather inside each node.
    HIERARCHICAL = "hierarchical"


def _check_topology(size_bytes: float, world_size: int, topology: Topology) -> int:
    """Validate the arguments of a topology form; return the number of nodes."""
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a labs.Topology, got {type(topology).__name__}.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    if not isinstance(size_bytes, (int, float)) or not math.isfinite(size_bytes) \
            or size_bytes < 0:
        raise ValueError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}.")
    return topology.nodes(world_size)


def ring_step_times(size_bytes: float, world_size: int, topology: Topology) -> list[list[float]]:
    """When each rank finishes each step of a lock-step flat ring all-reduce of S =
    ``size_bytes`` on ``topology``, every rank starting at 0: ``times[k][r]`` for step k =
    0 .. 2(N-1)-1 (reduce-scatter, then all-gather).

    At step k rank r sends a chunk c = S/N to r+1 as soon as it finished step k-1 and
    receives one from r-1; the hop r-1 -> r is intra-node or inter-node. By the port model
    (:mod:`labs.link`) with T_h = alpha_h + c/bw_h::

        t(r, k) = max(t(r-1, k-1) + T_in(r),       # the chunk from the left arrives
                      t(r, k-1) + c/bw_out(r),     # my outgoing port is free again
                      t(r, k-1) + c/bw_in(r))      # my incoming port is free again

    A rank at a node's edge sends or receives over the slow link, so it needs c/bw_inter every
    step however early its neighbour was: every step waits for the slowest hop, and the ranks
    inside the node, which could go faster, wait for the edge ones one step later. This is
    what the chapter draws, step by step (the last row is :func:`predict_on_topology`)."""
    _check_topology(size_bytes, world_size, topology)
    n = world_size
    if n == 1 or size_bytes == 0:
        return []
    chunk = size_bytes / n
    into = [topology.link((r - 1) % n, r) for r in range(n)]  # the hop r-1 -> r
    out = [topology.link(r, (r + 1) % n) for r in range(n)]
    done = [0.0] * n
    times: list[list[float]] = []
    for _ in range(2 * (n - 1)):
        done = [max(done[r - 1] + into[r].seconds(chunk),
                    done[r] + chunk / out[r].bandwidth,
                    done[r] + chunk / into[r].bandwidth) for r in range(n)]
        times.append(done)
    return times


def predict_on_topology(
    algorithm: TopologyAlgorithm, size_bytes: float, world_size: int, topology: Topology,
) -> float:
    """Seconds of one lock-step all-reduce of S = ``size_bytes`` on N = ``world_size`` ranks in
    n = N/g nodes of g = ``topology.node_size``, every rank starting at the same moment. Write
    T_i(m) = alpha_intra + m/bw_intra and T_e(m) = alpha_inter + m/bw_inter.

    * **Flat ring**: 2(N-1) steps of a chunk c = S/N (:func:`ring_step_times`, exact for the
      port model). When the inter-node link is the bottleneck of a step, c/bw_inter >=
      (T_e(c) + (g-1) T_i(c)) / g, which holds for large messages on a link 10x slower, the
      edge ranks' network ports are busy every step and the form is
      ``alpha_inter + 2(N-1) c/bw_inter``: every step pays the slowest hop's bytes, once
      alpha. When latency dominates instead, latencies of successive hops overlap and the
      time lies between that and ``2(N-1)/g T_e(c) + 2(N-1)(g-1)/g T_i(c)``. With one node
      it is the homogeneous ring on ``intra``, ``2(N-1) T_i(c)``.
    * **Flat, g channels** (:func:`labs.multi_ring.multi_ring_on_topology`, exact for the port
      model): g rings of S/g at once, each card carrying one channel's chunk S/(gN) per step,
      ``2(N-1) T_e(S/(gN))`` when a step's intra-node hops fit under its inter-node one.
    * **Hierarchical**: the three rings run one after another, each homogeneous, so each
      lock-step ring costs (steps) x T(its chunk):
      ``(g-1) T_i(S/g)`` (reduce-scatter in the node) + ``2(n-1) T_e(S/(g n))`` (all-reduce
      of the S/g shard across nodes; the g rings of a node run at once on separate network
      ports) + ``(g-1) T_i(S/g)`` (all-gather in the node). Bytes on the critical path:
      2(g-1)/g S through intra ports, 2(n-1)/n S/g through inter ports.

    With g = 2, n = 4, bw_inter = bw_intra/10 and latencies negligible the flat ring costs
    1.75 S/bw_inter, the hierarchical one 0.75 S/bw_inter + 0.1 S/bw_inter: 2.06x faster.
    Additions and uneven chunks are left out, as in :func:`predict_on_link`."""
    nodes = _check_topology(size_bytes, world_size, topology)
    if not isinstance(algorithm, TopologyAlgorithm):
        raise TypeError(f"algorithm must be a TopologyAlgorithm, got {algorithm!r}.")
    if world_size == 1 or size_bytes == 0:
        return 0.0
    if algorithm is TopologyAlgorithm.FLAT_RING:
        return max(ring_step_times(size_bytes, world_size, topology)[-1])
    if algorithm is TopologyAlgorithm.MULTI_RING:
        return multi_ring_on_topology(size_bytes, world_size, topology, topology.node_size)
    g = topology.node_size
    within = (g - 1) * topology.intra.seconds(size_bytes / g)
    across = 2 * (nodes - 1) * topology.inter.seconds(size_bytes / (g * nodes))
    return within + across + within


def bytes_across_nodes(
    algorithm: TopologyAlgorithm, numel: int, element_size: int, world_size: int,
    node_size: int,
) -> list[int]:
    """The bytes each rank sends to ranks on other nodes in one all-reduce of ``numel``
    elements of ``element_size`` bytes, exactly (chunks cut by
    :func:`labs.collectives.shard_bounds`); index = global rank.

    * **Flat ring**: only a node's last rank sends across, to the next node's first; it sends
      every chunk but its own in the reduce-scatter and every chunk but its right
      neighbour's in the all-gather: ``2S - c_r - c_(r+1)``, about 2(N-1)/N S (0 for the
      others, and for everyone when there is one node).
    * **Flat, g channels**: every rank leaves its node in exactly one channel and sends that
      channel's part across, about 2(N-1)/N S/g each
      (:func:`labs.multi_ring.multi_ring_bytes_across_nodes`).
    * **Hierarchical**: every rank sends only its cross-node ring's traffic across, on its
      shard of S/g: ``2 s - d_j - d_(j+1)`` with s its shard and d the shard's n chunks,
      about 2(n-1)/n S/g: g times less than the flat ring's edge rank, spread over all g
      network ports of a node instead of one."""
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 \
            or world_size % node_size:
        raise ValueError(f"node_size must be an int >= 1 that divides world_size "
                         f"({world_size}), got {node_size!r}.")
    g, n = node_size, world_size // node_size

    def sizes(total: int, parts: int) -> list[int]:
        bounds = shard_bounds(total, parts)
        return [bounds[i + 1] - bounds[i] for i in range(parts)]

    if algorithm is TopologyAlgorithm.MULTI_RING:
        return multi_ring_bytes_across_nodes(numel, element_size, world_size, g, g)
    out = [0] * world_size
    if n == 1:
        return out
    if algorithm is TopologyAlgorithm.FLAT_RING:
        chunks = sizes(numel, world_size)
        for r in range(g - 1, world_size, g):
            out[r] = (2 * numel - chunks[r] - chunks[(r + 1) % world_size]) * element_size
        return out
    shards = sizes(numel, g)
    for r in range(world_size):
        j, local = divmod(r, g)
        pieces = sizes(shards[local], n)
        out[r] = (2 * shards[local] - pieces[j] - pieces[(j + 1) % n]) * element_size
    return out
