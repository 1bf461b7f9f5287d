"""``python -m labs.bench collectives``: the command line of the sweep in
:mod:`labs.experiments.sweep` (flags, output files, progress bar).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from labs.collectives import DEFAULT_SEGMENT_BYTES, DEFAULT_WINDOW, Algorithm, Collective
from labs.experiments.sweep import (
    DEFAULT_MIN_BYTES,
    DEFAULT_SIZES,
    SweepSettings,
    algorithm_from_name,
    plot_busbw,
    run_sweep,
    runnable,
    sweep_tables,
    write_timings,
)
from labs.experiments.timing import (
    COMM_THREADS,
    DTYPES,
    MAX_CALLS,
    dtype_name,
    format_size,
    parse_dtype,
    parse_size,
)
from labs.launcher import Backend, cpu_cores

#: Default output of ``python -m labs.bench collectives``.
DEFAULT_OUT = Path("_build/bench/collectives.csv")


@dataclass(frozen=True)
class _Outputs:
    out: Path
    plot: Path


def _outputs(out: str, plot: str | None) -> _Outputs:
    out_path = Path(out)
    if out_path.suffix not in (".csv", ".json"):
        raise ValueError(f"--out must end in .csv or .json, got {out!r}.")
    plot_path = out_path.with_suffix(".png") if plot is None else Path(plot)
    if plot_path.suffix != ".png":
        raise ValueError(f"--plot must end in .png, got {plot!r}.")
    for path, flag in ((out_path, "--out"), (plot_path, "--plot")):
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"{flag}: cannot create {path} (no writable folder above it).")
    return _Outputs(out_path, plot_path)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _min_bytes_arg(text: str) -> int:
    return 0 if text.strip() == "0" else _size_arg(text)


def _segment_arg(text: str) -> int | None:
    return None if text.lower() in ("none", "lockstep", "lock-step") else _size_arg(text)


def _algorithm_arg(text: str) -> Algorithm:
    try:
        return algorithm_from_name(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _collective_arg(text: str) -> Collective:
    try:
        return Collective(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown collective {text!r}; choose from {[c.value for c in Collective]}."
        ) from None


def _backend_arg(text: str) -> Backend:
    try:
        return Backend(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown backend {text!r}; choose from {[b.value for b in Backend]}."
        ) from None


def _dtype_arg(text: str) -> torch.dtype:
    try:
        return parse_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose what is measured: shared by ``python -m labs.bench collectives``
    (which launches ranks itself) and ``python -m labs collectives`` (which also runs under
    torchrun); :func:`settings_from_args` reads them back."""
    parser.add_argument("--collectives", nargs="+", type=_collective_arg,
                        default=list(Collective), metavar="NAME",
                        help=f"any of {[c.value for c in Collective]} (default: all)")
    parser.add_argument("--algorithms", nargs="+", type=_algorithm_arg, default=None,
                        metavar="NAME",
                        help=f"any of {[a.value.replace(' ', '-') for a in Algorithm]} "
                             "(default: every one the collective supports)")
    parser.add_argument("--sizes", nargs="+", type=_size_arg, default=list(DEFAULT_SIZES),
                        metavar="SIZE", help="bytes, binary units: 1K 64K 1M 16M "
                        f"(default: {' '.join(format_size(s) for s in DEFAULT_SIZES)})")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per case first")
    parser.add_argument("--min-bytes", type=_min_bytes_arg, default=DEFAULT_MIN_BYTES,
                        metavar="SIZE",
                        help="more calls than --iters at small sizes, enough to carry SIZE "
                             f"(at most {MAX_CALLS} calls; 0: exactly --iters; default: "
                             f"{format_size(DEFAULT_MIN_BYTES)})")
    parser.add_argument("--dtype", type=_dtype_arg, default=torch.float32,
                        help=f"one of {[dtype_name(d) for d in DTYPES]}")
    parser.add_argument("--segment-bytes", nargs="+", type=_segment_arg,
                        default=[DEFAULT_SEGMENT_BYTES], metavar="SIZE",
                        help="pipeline segment(s) of the ring, or 'none' for the lock-step "
                             f"ring (default: {format_size(DEFAULT_SEGMENT_BYTES)})")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help="segments the ring receives ahead")
    parser.add_argument("--threads", type=int, default=COMM_THREADS,
                        help="intra-op threads per rank (ignored under torchrun, which sets "
                             f"OMP_NUM_THREADS itself; default: {COMM_THREADS})")


def settings_from_args(opts: argparse.Namespace, **more: Any) -> SweepSettings:
    """The :class:`SweepSettings` of the flags :func:`add_case_arguments` added (repeated
    values dropped), with ``more`` for the rest; raises ValueError on a bad combination."""
    return SweepSettings(
        collectives=tuple(dict.fromkeys(opts.collectives)),
        algorithms=None if opts.algorithms is None else tuple(dict.fromkeys(opts.algorithms)),
        sizes=tuple(dict.fromkeys(opts.sizes)), iters=opts.iters, warmup=opts.warmup,
        min_bytes=opts.min_bytes,
        dtype=opts.dtype, segment_bytes=tuple(dict.fromkeys(opts.segment_bytes)),
        window=opts.window, threads=opts.threads, **more,
    )


def add_collectives_parser(sub: Any) -> None:
    col = sub.add_parser("collectives", help="nccl-tests style sweep of the collectives")
    add_case_arguments(col)
    col.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4], metavar="N")
    col.add_argument("--backends", nargs="+", type=_backend_arg, default=[Backend.GLOO],
                     metavar="NAME", help="gloo and/or nccl (nccl is skipped without CUDA)")
    col.add_argument("--launches", type=int, default=1,
                     help="launches per backend and world size, iterations pooled (default 1)")
    col.add_argument("--timeout", type=float, default=600.0,
                     help="seconds per launch (one per backend and world size)")
    col.add_argument("--out", default=str(DEFAULT_OUT), help="results, .csv or .json")
    col.add_argument("--plot", default=None,
                     help="busbw figure, .png (default: next to --out)")


def collectives_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from tqdm import tqdm

    try:
        settings = settings_from_args(
            opts, world_sizes=tuple(dict.fromkeys(opts.world_sizes)),
            backends=tuple(dict.fromkeys(opts.backends)), timeout_s=opts.timeout,
            launches=opts.launches,
        )
        outputs = _outputs(opts.out, opts.plot)
    except ValueError as err:
        parser.error(str(err))
    plan, skipped = runnable(settings)
    for line in dict.fromkeys(skipped):
        print(line, file=sys.stderr)
    if not plan:
        parser.error("nothing to run on this machine (see above).")
    cores = cpu_cores()
    crowded = [n for b, n in plan if b is Backend.GLOO and n > cores]
    if crowded:
        print(f"note: {cores} CPU cores; gloo at world size {', '.join(map(str, crowded))} "
              "runs more ranks than cores, so ranks also wait for a core.", file=sys.stderr)
    total = sum(len(settings.cases_on(backend)) for backend, _ in plan) * settings.launches
    with tqdm(total=total, desc="collectives", unit="case", file=sys.stderr) as bar:
        timings = run_sweep(settings, progress=bar.update)
    print(sweep_tables(timings))
    write_timings(timings, outputs.out, settings)
    print(f"\nwrote {outputs.out}")
    import matplotlib

    matplotlib.use("Agg")
    fig = plot_busbw(timings)
    outputs.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(outputs.plot, dpi=110)
    print(f"wrote {outputs.plot}")
    if not all(t.correct for t in timings):
        wrong = [f"{t.case.collective.value}/{t.case.label}/{format_size(t.case.size_bytes)}"
                 f"/N={t.world_size}" for t in timings if not t.correct]
        print(f"INCORRECT results: {', '.join(wrong)}", file=sys.stderr)
        sys.exit(1)
