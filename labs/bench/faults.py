"""``python -m labs.bench faults``: chapter 9's measurements, as tables.

    python -m labs.bench faults [--world-size 2] [--repeats 200] [--group-timeout 3]
        [--straggler-sizes 2 4 8]

* What ``launch(..., check_collectives=True)`` costs (:mod:`labs.collective_check`): the
  median time of one ``dist.all_reduce`` of 4 KiB and of 1 MiB, back to back, with and
  without checking; then chapter 5's DDP step (labs' DDP, the experiment's MLP), with and
  without.
* A rank that dies or stops (:func:`labs.experiments.faults.measure_death`): after how long
  each survivor's collective fails, with torch's all-reduce and labs' ring, against the
  group's timeout; what ``launch`` named.
* Stragglers (:func:`labs.experiments.faults.measure_stragglers`): the mean step with random
  delays beside the step without them plus each step's largest delay, and beside the
  expectation mean x H_N.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from labs.experiments.ddp import Case, step_times_worker
from labs.experiments.faults import (
    COLLECTIVES,
    HOW,
    DeathSettings,
    StragglerSettings,
    harmonic,
    measure_death,
    measure_stragglers,
)
from labs.launcher import launch
from labs.models import StepSettings
from labs.tables import format_table
from labs.wrappers import Wrapper

SIZES = (4 << 10, 1 << 20)


def add_faults_parser(sub: Any) -> None:
    p = sub.add_parser("faults", help="chapter 9: checking's cost, dead ranks, stragglers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200, help="all-reduces per size")
    p.add_argument("--group-timeout", type=float, default=3.0,
                   help="the process group's timeout in the dead-rank runs (seconds)")
    p.add_argument("--straggler-sizes", type=int, nargs="+", default=[2, 4, 8])


def call_seconds_worker(rank: int, world_size: int, repeats: int) -> list[float]:
    """The median seconds of one all-reduce of each of :data:`SIZES`, back to back."""
    out = []
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        dist.barrier()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def faults_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if opts.world_size < 2 or opts.repeats < 1:
        parser.error("--world-size must be >= 2 and --repeats >= 1.")
    rows = []
    per_call = {}
    for check in (False, True):
        results = launch(call_seconds_worker, opts.world_size, args=(opts.repeats,),
                         backend="gloo", echo=False, check_collectives=check, timeout=300)
        per_call[check] = [max(r[i] for r in results) for i in range(len(SIZES))]
    for i, nbytes in enumerate(SIZES):
        off, on = per_call[False][i], per_call[True][i]
        rows.append([f"all_reduce of {nbytes >> 10} KiB", f"{off * 1e6:.0f}", f"{on * 1e6:.0f}",
                     f"{(on - off) * 1e6:+.0f}"])
    settings = StepSettings(steps=20)
    step = {}
    for check in (False, True):
        results = launch(step_times_worker, opts.world_size,
                         args=(settings, [Case(Wrapper.DDP, settings.bucket_cap_mb)]),
                         backend="gloo", echo=False, check_collectives=check, timeout=300)
        step[check] = statistics.median(max(r[0].seconds[k] for r in results)
                                        for k in range(settings.steps))
    rows.append([f"chapter 5's DDP step (MLP {settings.layers} x {settings.width})",
                 f"{step[False] * 1e6:.0f}", f"{step[True] * 1e6:.0f}",
                 f"{(step[True] - step[False]) * 1e6:+.0f}"])
    print(f"\nWhat checking collectives costs ({opts.world_size} ranks, gloo, medians, µs)")
    print(format_table(["", "unchecked", "checked", "difference"], rows))

    rows = []
    for how in HOW:
        for collective in COLLECTIVES:
            row = measure_death(DeathSettings(world_size=max(3, opts.world_size), how=how,
                                              collective=collective,
                                              group_timeout_s=opts.group_timeout))
            rows.append([how, collective, ", ".join(f"{s:.3f}" for s in row.detected_s),
                         f"{opts.group_timeout:g}", f"rank {row.named_rank} {row.named_type}",
                         f"{row.launch_s:.2f}"])
    print("\nA rank killed or stopped in a loop of all-reduces (3 ranks, rank 1 the victim)")
    print(format_table(["victim", "all-reduce", "survivors saw it after (s)",
                        "group timeout (s)", "launch named", "launch raised after (s)"], rows))

    config = StragglerSettings()
    rows = []
    for r in measure_stragglers(opts.straggler_sizes, config):
        rows.append([r.world_size, f"{statistics.median(r.base) * 1e3:.1f}",
                     f"{r.measured * 1e3:.1f}", f"{r.predicted * 1e3:.1f}",
                     f"{r.expected * 1e3:.1f}", f"{harmonic(r.world_size):.2f}"])
    print(f"\nStragglers: an exponential delay of mean {config.mean_s * 1e3:g} ms before each "
          f"step on every rank ({config.steps} steps, labs' DDP on the link)")
    print(format_table(["ranks", "step without delays (ms)", "mean step with delays",
                        "without + largest delay", "without + mean x H_N", "H_N"], rows))
