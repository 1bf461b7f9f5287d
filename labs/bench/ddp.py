"""``python -m labs.bench ddp``: step time of NaiveDDP, labs' DDP and torch DDP, one launch.

    python -m labs.bench ddp [--world-size 2] [--width 1024] [--layers 10] [--batch 64]
        [--steps 20] [--warmup 3] [--bucket-cap-mb 25] [--launches 3]

The model is an MLP of ``--layers`` square Linear layers (``--width``; the defaults give
10.5 M parameters, 40 MiB of float32 gradients). Every implementation trains the same model
on the same batch in the same launch, their order alternating each step; a row reports the
median over steps (and launches) of the slowest rank's time per step, and the range from the
fastest step to the slowest. ``no sync`` is the
compute-only floor; the difference to it is what synchronising the gradients costs.
"""

from __future__ import annotations

import argparse
from typing import Any

from labs.experiments.ddp import StepSettings, default_cases, measure_step_times

#: The benchmark's default model: 10 x Linear(1024, 1024), 10.5 M parameters.
DEFAULT_SETTINGS = StepSettings(width=1024, layers=10, batch=64, steps=20, warmup=3)


def add_ddp_parser(sub: Any) -> None:
    """The ``ddp`` subcommand of ``python -m labs.bench``."""
    d = DEFAULT_SETTINGS
    p = sub.add_parser("ddp", help="step time: NaiveDDP, labs' DDP, torch DDP",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--width", type=int, default=d.width)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--batch", type=int, default=d.batch, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[d.bucket_cap_mb],
                   help="one or more bucket caps (MiB); DDP and torch DDP at each")
    p.add_argument("--launches", type=int, default=1, help="pool this many launches")


def ddp_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from labs.viz.ddp import step_time_table  # matplotlib: not in the ranks

    try:
        settings = StepSettings(width=opts.width, layers=opts.layers, batch=opts.batch,
                                steps=opts.steps, warmup=opts.warmup)
        if opts.launches < 1 or opts.world_size < 1:
            raise ValueError("--launches and --world-size must be at least 1.")
    except ValueError as err:
        parser.error(str(err))
    cases = [c for cap in opts.bucket_cap_mb for c in default_cases(cap)]
    cases = list(dict.fromkeys(cases))  # the no-sync and naive cases once
    print(f"world size {opts.world_size}, {settings.parameters / 1e6:.1f} M parameters "
          f"({settings.gradient_bytes / 2**20:.0f} MiB of float32 gradients), batch "
          f"{settings.batch} per rank, {settings.steps} steps x {opts.launches} launch(es)")
    rows = measure_step_times(opts.world_size, settings, cases, launches=opts.launches)
    print(step_time_table(rows))
