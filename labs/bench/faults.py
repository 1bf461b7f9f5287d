"""``python -m labs.bench faults``: chapter 9's measurements, as tables.

    python -m labs.bench faults [--world-size 2] [--repeats 50] [--group-timeout 3]
        [--straggler-sizes 2 4 8]

* What watching collectives costs (:func:`labs.experiments.faults.checking_cost`): the time
  per call of ``dist.all_reduce`` of 4 KiB and of 1 MiB, back to back, and of chapter 5's DDP
  step (labs' DDP, the experiment's MLP), the fastest of five blocks and of three rounds,
  unchecked, under torch's
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` and under ``launch(..., check_collectives=True)``.
* A rank that dies or stops (:func:`labs.experiments.faults.measure_death`): after how long
  each survivor's collective fails, with torch's all-reduce and labs' ring, against the
  group's timeout; what ``launch`` named.
* Stragglers (:func:`labs.experiments.stragglers.measure_stragglers`): the mean step with random
  delays beside the step without them plus each step's largest delay, and beside the
  expectation mean x H_N.
"""

from __future__ import annotations

import argparse
from typing import Any

from labs.experiments.faults import (
    COLLECTIVES,
    HOW,
    DeathSettings,
    checking_cost,
    cost_table,
    death_table,
    measure_death,
)
from labs.experiments.stragglers import StragglerSettings, measure_stragglers, straggler_table


def add_faults_parser(sub: Any) -> None:
    p = sub.add_parser("faults", help="chapter 9: checking's cost, dead ranks, stragglers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50,
                   help="all-reduces of each size per timed block (5 blocks, the fastest kept)")
    p.add_argument("--group-timeout", type=float, default=3.0,
                   help="the process group's timeout in the dead-rank runs (seconds)")
    p.add_argument("--straggler-sizes", type=int, nargs="+", default=[2, 4, 8])


def faults_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if opts.world_size < 2 or opts.repeats < 1:
        parser.error("--world-size must be >= 2 and --repeats >= 1.")
    print(f"\nWhat watching collectives costs ({opts.world_size} ranks, gloo, the fastest "
          "block's time per call)")
    print(cost_table(checking_cost(opts.world_size, opts.repeats)))
    rows = [measure_death(DeathSettings(world_size=max(3, opts.world_size), how=how,
                                        collective=collective,
                                        group_timeout_s=opts.group_timeout))
            for how in HOW for collective in COLLECTIVES]
    print("\nA rank killed or stopped in a loop of all-reduces (rank 1 the victim)")
    print(death_table(rows))
    config = StragglerSettings()
    print(f"\nStragglers: an exponential delay of mean {config.mean_s * 1e3:g} ms before each "
          f"step on every rank ({config.steps} steps, labs' DDP on the link)")
    print(straggler_table(measure_stragglers(opts.straggler_sizes, config)))
