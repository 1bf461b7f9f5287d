"""A sweep of the collectives of :mod:`labs.collectives` against torch's built-in ones, in the
style of nccl-tests: the settings, the run (one launch per backend and world size, every case
of that world size in it, so starting processes is never part of a timing), the tables and the
busbw figure, and reading and writing the timings. Chapter 2 runs one from a notebook and
``python -m labs.bench collectives`` from the command line. The timing of one case is
:mod:`labs.experiments.timing`.

For each case it reports the median over iterations of the slowest rank's time per call, the
algorithm bandwidth ``algbw = S / time`` and the bus bandwidth ``busbw = algbw x bus factor``
(2(N-1)/N for all-reduce, (N-1)/N for reduce-scatter and all-gather: the bytes each rank must
move over its link per byte of S, so busbw can be compared with a link's speed whatever N is).
Every call's result is compared with the exact answer, torch's built-in included.
"""

from __future__ import annotations

import csv
import json
import math
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from labs.collectives import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_WINDOW,
    Algorithm,
    Collective,
)
from labs.experiments.timing import (
    COMM_THREADS,
    DTYPES,
    CollectiveCase,
    CollectiveTiming,
    check_cases,
    check_min_bytes,
    dtype_name,
    format_size,
    measure_collectives,
    per_launch_medians,
    timing_from_record,
)
from labs.launcher import MAX_WORLD_SIZE, Backend, cpu_cores
from labs.tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Default sizes of ``python -m labs.bench collectives`` (under a minute on 2 cores).
DEFAULT_SIZES: tuple[int, ...] = (1 << 10, 1 << 16, 1 << 20, 1 << 24)
#: Default ``min_bytes`` of a sweep: small sizes get enough calls to carry 64 MiB (at most
#: ``labs.experiments.timing.MAX_CALLS``), so 1 MiB gets 64 where 16 and 64 MiB keep ``iters``.
DEFAULT_MIN_BYTES = 64 << 20


def algorithm_from_name(name: str) -> Algorithm:
    """``"ring"``, ``"recursive-doubling"`` or ``"recursive doubling"``, ... -> Algorithm."""
    for algorithm in Algorithm:
        if name in (algorithm.value, algorithm.value.replace(" ", "-"), algorithm.name.lower()):
            return algorithm
    raise ValueError(f"unknown algorithm {name!r}; choose from "
                     f"{[a.value.replace(' ', '-') for a in Algorithm]}.")


@dataclass(frozen=True)
class SweepSettings:
    """The settings of one ``python -m labs.bench collectives`` sweep (the CLI parses into it,
    a notebook can build one and call :func:`run_sweep`).

    ``algorithms=None`` means every algorithm each collective supports; otherwise each
    collective runs the listed algorithms it supports. ``segment_bytes`` lists the pipeline
    segments to sweep for the ring (``None`` = lock-step ring).
    """

    collectives: tuple[Collective, ...] = tuple(Collective)
    algorithms: tuple[Algorithm, ...] | None = None
    sizes: tuple[int, ...] = DEFAULT_SIZES
    world_sizes: tuple[int, ...] = (2, 4)
    backends: tuple[Backend, ...] = (Backend.GLOO,)
    iters: int = 5
    warmup: int = 1
    #: Small sizes get more calls than ``iters``: enough to carry this many bytes
    #: (:func:`labs.experiments.timing.calls_per_case`); 0 gives every size exactly ``iters``.
    min_bytes: int = DEFAULT_MIN_BYTES
    dtype: torch.dtype = torch.float32
    segment_bytes: tuple[int | None, ...] = (DEFAULT_SEGMENT_BYTES,)
    window: int = DEFAULT_WINDOW
    timeout_s: float = 600.0
    #: Launches per backend and world size, their iterations pooled: on a small machine the
    #: way the ranks happen to share the cores changes from launch to launch, and moves the
    #: timings of a whole launch together.
    launches: int = 1
    #: Intra-op threads per rank (:data:`labs.experiments.timing.COMM_THREADS`).
    threads: int = COMM_THREADS

    def __post_init__(self) -> None:
        if not self.collectives or not all(isinstance(c, Collective) for c in self.collectives):
            raise ValueError("--collectives: give one or more of "
                             f"{[c.value for c in Collective]}.")
        if self.algorithms is not None:
            if not self.algorithms or not all(isinstance(a, Algorithm) for a in self.algorithms):
                raise ValueError("--algorithms: give one or more of "
                                 f"{[a.value.replace(' ', '-') for a in Algorithm]}.")
            for collective in self.collectives:
                if not self.algorithms_of(collective):
                    supported = [a.value.replace(" ", "-") for a in collective.algorithms()]
                    raise ValueError(f"--algorithms: none of them implements "
                                     f"{collective.value} (that takes {supported}); add one or "
                                     "drop the collective from --collectives.")
            unused = [a for a in self.algorithms
                      if not any(a in c.algorithms() for c in self.collectives)]
            if unused:
                raise ValueError(f"--algorithms: {unused[0].value!r} implements none of "
                                 f"{[c.value for c in self.collectives]} (it is an all-reduce "
                                 "algorithm); drop it or add all-reduce to --collectives.")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {[dtype_name(d) for d in DTYPES]}.")
        item = torch.empty((), dtype=self.dtype).element_size()
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < item
                                 or s % item for s in self.sizes):
            raise ValueError(f"--sizes: each size must be a positive multiple of {item} B "
                             f"(one {dtype_name(self.dtype)} element), got "
                             f"{[format_size(s) if isinstance(s, int) else s for s in self.sizes]}"
                             ".")
        if not self.world_sizes or any(isinstance(n, bool) or not isinstance(n, int)
                                       or not 2 <= n <= MAX_WORLD_SIZE
                                       for n in self.world_sizes):
            raise ValueError(f"--world-sizes: each must be between 2 and {MAX_WORLD_SIZE} "
                             f"(a collective needs two ranks), got {list(self.world_sizes)}.")
        if not self.backends or not all(isinstance(b, Backend) for b in self.backends):
            raise ValueError(f"--backends: give one or more of {[b.value for b in Backend]}.")
        try:
            check_cases([CollectiveCase(Collective.ALL_REDUCE, Algorithm.TORCH, 4)],
                         self.iters, self.warmup)
        except ValueError as err:
            raise ValueError(f"--{str(err).split()[0]}: {err}") from None
        try:
            check_min_bytes(self.min_bytes)
        except ValueError as err:
            raise ValueError(f"--min-bytes: {err}") from None
        for segment in self.segment_bytes:
            if segment is not None and (isinstance(segment, bool) or not isinstance(segment, int)
                                        or segment < item):
                raise ValueError(f"--segment-bytes: each must be 'none' (lock-step ring) or at "
                                 f"least one element ({item} B), got {segment!r}.")
        if not self.segment_bytes:
            raise ValueError("--segment-bytes: give at least one segment size.")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"--window must be a positive int, got {self.window!r}.")
        if isinstance(self.launches, bool) or not isinstance(self.launches, int) \
                or self.launches < 1:
            raise ValueError(f"--launches must be an int >= 1, got {self.launches!r}.")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) \
                or self.threads < 1:
            raise ValueError(f"--threads must be an int >= 1, got {self.threads!r}.")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise ValueError(f"--timeout must be a positive number of seconds, got "
                             f"{self.timeout_s!r}.")

    def algorithms_of(self, collective: Collective) -> tuple[Algorithm, ...]:
        """The algorithms this sweep runs for ``collective``."""
        supported = collective.algorithms()
        if self.algorithms is None:
            return supported
        return tuple(a for a in self.algorithms if a in supported)

    def cases_on(self, backend: Backend) -> list[CollectiveCase]:
        """The cases one launch on ``backend`` runs: every case, but on NCCL not the double
        binary tree, which posts every receive up front, as only gloo's send/recv allow
        (:mod:`labs.double_tree`)."""
        return [c for c in self.cases()
                if backend is not Backend.NCCL or c.algorithm is not Algorithm.DOUBLE_TREE]

    def cases(self) -> list[CollectiveCase]:
        """Every case of the sweep, for one world size (sizes outermost)."""
        cases = []
        for size in self.sizes:
            for collective in self.collectives:
                for algorithm in self.algorithms_of(collective):
                    if algorithm is Algorithm.RING:
                        cases += [CollectiveCase(collective, algorithm, size, self.dtype, seg,
                                                 self.window) for seg in self.segment_bytes]
                    else:
                        cases.append(CollectiveCase(collective, algorithm, size, self.dtype))
        return cases


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def runnable(settings: SweepSettings) -> tuple[list[tuple[Backend, int]], list[str]]:
    """The (backend, world size) launches this machine can run, and why others are skipped."""
    plan, skipped = [], []
    for backend in settings.backends:
        for world_size in settings.world_sizes:
            if backend is Backend.NCCL:
                if not dist.is_nccl_available() or _gpus() == 0:
                    skipped.append("skipping nccl: no CUDA GPU (or no NCCL in this torch "
                                   "build); run the sweep with --backends gloo here.")
                    break
                if _gpus() < world_size:
                    skipped.append(f"skipping nccl at world size {world_size}: it needs one "
                                   f"GPU per rank and {_gpus()} are visible.")
                    continue
            plan.append((backend, world_size))
    return plan, skipped


def run_sweep(
    settings: SweepSettings, *, progress: Callable[[int], None] | None = None,
) -> list[CollectiveTiming]:
    """Run every case of ``settings`` (one launch per backend and world size); ``progress`` is
    called with the number of cases each launch finished."""
    plan, _ = runnable(settings)
    timings: list[CollectiveTiming] = []
    for backend, world_size in plan:
        mine = settings.cases_on(backend)
        runs = []
        for _ in range(settings.launches):
            runs.append(measure_collectives(mine, world_size, iters=settings.iters,
                                            warmup=settings.warmup, backend=backend.value,
                                            timeout=settings.timeout_s,
                                            threads=settings.threads,
                                            min_bytes=settings.min_bytes))
            if progress is not None:
                progress(len(mine))
        timings += [_pool(same) for same in zip(*runs, strict=True)]
    return timings


def _pool(runs: Sequence[CollectiveTiming]) -> CollectiveTiming:
    """One timing from the same case measured in several launches: every iteration kept."""
    times = tuple(t for run in runs for t in run.all_seconds)
    first = runs[0]
    return CollectiveTiming(first.case, first.world_size, first.backend,
                            statistics.median(times), times, all(r.correct for r in runs),
                            sum(r.launches for r in runs))


def _torch_of(timing: CollectiveTiming,
              timings: Sequence[CollectiveTiming]) -> CollectiveTiming | None:
    for other in timings:
        if (other.case.algorithm is Algorithm.TORCH and other.backend == timing.backend
                and other.world_size == timing.world_size
                and other.case.collective is timing.case.collective
                and other.case.size_bytes == timing.case.size_bytes
                and other.case.dtype == timing.case.dtype):
            return other
    return None


def call_ratios(timing: CollectiveTiming, reference: CollectiveTiming) -> list[float] | None:
    """``reference``'s time / ``timing``'s time, call by call (> 1: ``timing`` is faster).

    Cases of one size run interleaved (:func:`labs.experiments.timing.time_collectives`): call
    i of one runs right beside call i of the other, so each ratio compares two calls that met
    the same load on the machine, and a launch in which everything ran slow moves both alike. None
    when the two did not run side by side (different numbers of calls or launches).
    """
    if (len(timing.all_seconds) != len(reference.all_seconds)
            or timing.launches != reference.launches):
        return None
    return [ref / mine for ref, mine in zip(reference.all_seconds, timing.all_seconds,
                                            strict=True)]


def ratio_to_torch(timing: CollectiveTiming, timings: Sequence[CollectiveTiming]) -> float | None:
    """busbw of ``timing`` / busbw of torch's built-in at the same backend, N, collective and
    size (> 1: faster than torch); None when torch was not measured there.

    The median of the per-call ratios (:func:`call_ratios`) of every launch pooled; for two
    timings that did not run side by side, the ratio of their medians.
    """
    reference = _torch_of(timing, timings)
    if reference is None or timing.case.algorithm is Algorithm.TORCH:
        return None
    paired = call_ratios(timing, reference)
    return reference.seconds / timing.seconds if paired is None else statistics.median(paired)


def launch_ratios(timing: CollectiveTiming,
                  timings: Sequence[CollectiveTiming]) -> list[float] | None:
    """:func:`ratio_to_torch` launch by launch (the median of each launch's per-call ratios):
    how far one launch can move the ratio. The pooled median always lies between the lowest
    and the highest of them (the launches have equal numbers of calls). None where there is
    no ratio, only one launch, or no per-call pairing."""
    reference = _torch_of(timing, timings)
    if reference is None or timing.case.algorithm is Algorithm.TORCH or timing.launches < 2:
        return None
    paired = call_ratios(timing, reference)
    return None if paired is None else per_launch_medians(paired, timing.launches)


def median_ratio_to_torch(timing: CollectiveTiming,
                          timings: Sequence[CollectiveTiming]) -> float | None:
    """torch's median time / ``timing``'s median time at the same backend, N, collective and
    size (> 1: faster than torch; the busbw ratio too, both sharing S and the bus factor);
    None when torch was not measured there. The ratio of the two medians a table shows beside
    it, so that a reader can check it from them; :func:`ratio_to_torch` pairs call with call
    instead, and can differ from it when a few calls were slow."""
    reference = _torch_of(timing, timings)
    if reference is None or timing.case.algorithm is Algorithm.TORCH:
        return None
    return reference.seconds / timing.seconds


def _four_digits(value: float) -> str:
    """``value`` to 4 significant digits, never in exponent form: 15595.2 -> "15600",
    708.14 -> "708.1"."""
    if value >= 1000:
        return f"{round(value, 3 - math.floor(math.log10(value))):.0f}"
    return f"{value:.4g}"


def _ratio_cell(ratio: float | None, spread: list[float] | None = None) -> str:
    if ratio is None:
        return "-"
    if not spread:
        return f"{ratio:.2f}"
    return f"{ratio:.2f} ({min(spread):.2f}-{max(spread):.2f})"


def sweep_tables(timings: Sequence[CollectiveTiming]) -> str:
    """One table per backend and world size, then the all-reduce "ring vs torch" summary.

    A row's "busbw / torch" is the ratio of the two median times in the table
    (:func:`median_ratio_to_torch`); the summary's ratios pair call with call
    (:func:`ratio_to_torch`), and say so."""
    header = ["collective", "algorithm", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)",
              "correct", "busbw / torch"]
    blocks = []
    for backend, world_size in dict.fromkeys((t.backend, t.world_size) for t in timings):
        rows = []
        chosen = [t for t in timings if (t.backend, t.world_size) == (backend, world_size)]
        order = {c: i for i, c in enumerate(Collective)}
        for t in sorted(chosen, key=lambda t: (order[t.case.collective], t.case.size_bytes)):
            rows.append([t.case.collective.value, t.case.label, format_size(t.case.size_bytes),
                         _four_digits(t.seconds * 1e6), f"{t.algbw_gbps:.3g}",
                         f"{t.busbw_gbps:.3g}", str(t.correct),
                         _ratio_cell(median_ratio_to_torch(t, timings))])
        dtype = dtype_name(chosen[0].case.dtype)
        counts = sorted({len(t.all_seconds) for t in chosen})
        calls = (f"{counts[0]} iterations" if len(counts) == 1 else
                 f"{counts[0]} to {counts[-1]} iterations, the most at the smallest size")
        blocks.append(f"{backend}, world size {world_size}, {dtype} (median of {calls}, "
                      "slowest rank per call; busbw / torch: torch's median time / this "
                      "row's):\n"
                      + format_table(header, rows))
    summary = ring_vs_torch_table(timings)
    if summary:
        spread = any(t.launches > 1 for t in timings)
        blocks.append("all-reduce, ring busbw / torch busbw (> 1: the ring is faster; the "
                      "median of per-call ratios, each ring call over the torch call beside "
                      "it, not the ratio of the medians above"
                      + ("; in brackets the lowest and highest of one launch" if spread
                         else "") + "):\n" + summary)
    return "\n\n".join(blocks)


def ring_vs_torch_table(timings: Sequence[CollectiveTiming]) -> str:
    """All-reduce: backend, world size and ring variant (rows) x size (columns) -> busbw ratio
    of the ring to torch's built-in (:func:`ratio_to_torch`), and, after several launches, the
    lowest and highest ratio of a single launch in brackets (:func:`launch_ratios`). Empty
    when the sweep had no ring or no torch."""
    rings = [t for t in timings if t.case.collective is Collective.ALL_REDUCE
             and t.case.algorithm is Algorithm.RING and _torch_of(t, timings) is not None]
    if not rings:
        return ""
    sizes = sorted({t.case.size_bytes for t in rings})
    rows = []
    for key in dict.fromkeys((t.backend, t.world_size, t.case.label) for t in rings):
        cells = {t.case.size_bytes: _ratio_cell(ratio_to_torch(t, timings),
                                                launch_ratios(t, timings))
                 for t in rings if (t.backend, t.world_size, t.case.label) == key}
        rows.append([*key, *(cells.get(s, "-") for s in sizes)])
    return format_table(["backend", "world size", "algorithm",
                         *(format_size(s) for s in sizes)], rows)


def plot_busbw(timings: Sequence[CollectiveTiming]) -> Figure:
    """Bus bandwidth against size (log x), one line per algorithm (and backend), one panel per
    world size (rows) and collective (columns); an algorithm keeps its colour in every panel.
    A red cross marks an incorrect result."""
    import matplotlib.pyplot as plt

    world_sizes = sorted({t.world_size for t in timings})
    collectives = [c for c in Collective if any(t.case.collective is c for t in timings)]
    backends = sorted({t.backend for t in timings})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = list(dict.fromkeys(t.case.label for t in sorted(
        timings, key=lambda t: list(Algorithm).index(t.case.algorithm))))
    colour = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    fig, axes = plt.subplots(len(world_sizes), len(collectives), squeeze=False,
                             figsize=(4.2 * len(collectives), 3.2 * len(world_sizes)),
                             layout="constrained")
    for row, world_size in enumerate(world_sizes):
        for col, collective in enumerate(collectives):
            ax = axes[row][col]
            chosen = [t for t in timings
                      if t.world_size == world_size and t.case.collective is collective]
            for backend in backends:
                for label in dict.fromkeys(t.case.label for t in chosen if t.backend == backend):
                    line = sorted((t for t in chosen
                                   if t.backend == backend and t.case.label == label),
                                  key=lambda t: t.case.size_bytes)
                    name = label if len(backends) == 1 else f"{label} ({backend})"
                    ax.plot([t.case.size_bytes for t in line], [t.busbw_gbps for t in line],
                            "o-" if backend == backends[0] else "s--", label=name,
                            color=colour[label])
                    bad = [t for t in line if not t.correct]
                    ax.plot([t.case.size_bytes for t in bad], [t.busbw_gbps for t in bad], "x",
                            color="red", ms=12, mew=2)
            ax.set_xscale("log", base=2)
            sizes = sorted({t.case.size_bytes for t in chosen})
            ax.set_xticks(sizes, [format_size(s) for s in sizes])
            ax.set(xlabel="size S", ylabel="busbw (GB/s)",
                   title=f"{collective.value}, N = {world_size}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    return fig


def write_timings(timings: Sequence[CollectiveTiming], path: Path,
                  settings: SweepSettings | None = None) -> None:
    """``.csv`` (one row per timing, ``all_seconds`` space-separated) or ``.json`` (the rows,
    the settings and the machine) by the path's suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [t.as_record() for t in timings]
    if path.suffix == ".json":
        meta = {"cores": cpu_cores(), "torch": torch.__version__,
                "python": platform.python_version(), "machine": platform.machine()}
        document = {"machine": meta, "timings": records}
        if settings is not None:
            document["settings"] = _settings_record(settings)
        path.write_text(json.dumps(document, indent=1) + "\n")
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]) if records else ["backend"])
        writer.writeheader()
        for record in records:
            writer.writerow({**record, "all_seconds": " ".join(map(repr, record["all_seconds"]))})


def read_timings(path: Path) -> list[CollectiveTiming]:
    """The timings :func:`write_timings` wrote (CSV or JSON)."""
    path = Path(path)
    if path.suffix == ".json":
        return [timing_from_record(r) for r in json.loads(path.read_text())["timings"]]
    with path.open(newline="") as handle:
        return [timing_from_record(r) for r in csv.DictReader(handle)]


def _settings_record(settings: SweepSettings) -> dict[str, Any]:
    return {
        "collectives": [c.value for c in settings.collectives],
        "algorithms": None if settings.algorithms is None else
        [a.value for a in settings.algorithms],
        "sizes": list(settings.sizes), "world_sizes": list(settings.world_sizes),
        "backends": [b.value for b in settings.backends], "iters": settings.iters,
        "min_bytes": settings.min_bytes,
        "launches": settings.launches, "threads": settings.threads,
        "warmup": settings.warmup, "dtype": dtype_name(settings.dtype),
        "segment_bytes": list(settings.segment_bytes), "window": settings.window,
    }
