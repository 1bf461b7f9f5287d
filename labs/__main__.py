"""Run a lab from the command line: locally on N ranks, or under torchrun across nodes.

    python -m labs toy --world-size 4 --grads 0.1 -0.2 0.4 -0.1
    torchrun --nproc_per_node=4 -m labs toy --grads 0.1 -0.2 0.4 -0.1
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 \\
        --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 -m labs grads

Under torchrun the world size comes from torchrun and the results are printed by rank 0;
the workers are the same functions the notebooks launch, with the same settings objects.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from labs.launch import launch, run_torchrun, under_torchrun
from labs.toy_allreduce import (
    SEED_SENTENCES,
    ToyAllReduceConfig,
    data_parallel_gradients,
    full_batch_gradients,
    max_abs_difference,
    toy_all_reduce_step,
)
from labs.viz import format_table, toy_table


def _run(worker: Callable[..., Any], world_size: int, args: tuple, backend: str) -> list | None:
    if under_torchrun():
        return run_torchrun(worker, args, backend=backend)
    return launch(worker, world_size, args=args, backend=backend)


def _toy(opts: argparse.Namespace, world_size: int) -> None:
    config = ToyAllReduceConfig(
        grads=tuple(opts.grads) if opts.grads else None, seed=opts.seed, param=opts.param,
        lr=opts.lr,
    )
    config.gradients(world_size)  # refuse a wrong number of --grads before any rank starts
    records = _run(toy_all_reduce_step, world_size, (config,), opts.backend)
    if records is not None:
        print(toy_table(records))


def _grads(opts: argparse.Namespace, world_size: int) -> None:
    results = _run(data_parallel_gradients, world_size, (SEED_SENTENCES, opts.seed), opts.backend)
    if results is None:
        return
    reference = full_batch_gradients(SEED_SENTENCES, opts.seed)
    rows = [
        [r.rank, len(r.sentences), r.loss, max_abs_difference(r.averaged, reference)]
        for r in results
    ]
    print(format_table(["rank", "sentences", "local loss", "max |avg - full batch|"], rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="lab", required=True, metavar="LAB")
    toy = sub.add_parser("toy", help="chapter 1: the toy all-reduce and one SGD step")
    toy.add_argument("--grads", type=float, nargs="+", help="one gradient per rank")
    toy.add_argument("--seed", type=int, default=0, help="draw gradients from this seed")
    toy.add_argument("--param", type=float, default=0.5, help="parameter before the step")
    toy.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    toy.set_defaults(run=_toy)
    grads = sub.add_parser("grads", help="chapter 1: averaged gradients = full-batch gradient")
    grads.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    grads.set_defaults(run=_grads)
    for lab in (toy, grads):
        lab.add_argument("--world-size", type=int, default=4,
                         help="ranks to launch on this machine (ignored under torchrun)")
        lab.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    opts = parser.parse_args(argv)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else opts.world_size
    try:
        opts.run(opts, world_size)
    except ValueError as err:  # bad settings: a message, not a traceback
        parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
