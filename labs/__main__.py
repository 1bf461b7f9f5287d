"""Run a lab from the command line: locally on N ranks, or under torchrun across nodes.

    python -m labs toy --world-size 4 --grads 0.1 -0.2 0.4 -0.1
    torchrun --nproc_per_node=4 -m labs toy --grads 0.1 -0.2 0.4 -0.1
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 \\
        --master_addr=HOST --master_port=PORT -m labs grads
    python -m labs collectives --world-size 4 --collectives all-reduce --sizes 1M 16M
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=1 \\
        --master_addr=HOST --master_port=PORT -m labs collectives --sizes 64M
    python -m labs ddp --world-size 2 --steps 60 --wrapper ours
    python -m labs ddp --world-size 2 --steps 20 --checkpoint run.pt --checkpoint-every 10
    python -m labs ddp --world-size 2 --steps 40 --checkpoint run.pt --resume
    torchrun --standalone --nproc_per_node=2 -m labs ddp --steps 60 --accumulation 2
    python -m labs zero --world-size 4 --width 256 --layers 8
    python -m labs fsdp --world-size 4 --steps 20 --checkpoint run/ --dtype bf16
    python -m labs fsdp --world-size 2 --steps 30 --accumulation 4 --checkpoint run/ --resume
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 -m labs fsdp --steps 12 \\
        --checkpoint run/ --checkpoint-every 4 --fail-at-step 10
    torchrun --standalone --nproc_per_node=8 -m labs zero --width 2048 --layers 16

Across nodes, run the same command on every node with its own --node_rank; HOST is node 0's
address and PORT a free port on it. Under torchrun the world size comes from torchrun and the
results are printed by rank 0; the workers are the same functions the notebooks launch, with
the same settings objects.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from labs.bench.collectives import add_case_arguments, settings_from_args
from labs.experiments.recipe import RecipeConfig, budget_table, loss_report, recipe_worker
from labs.experiments.sweep import sweep_tables
from labs.experiments.timing import time_collectives
from labs.experiments.zero import LAB_SETTINGS, lab_worker
from labs.launcher import launch
from labs.tables import format_table, toy_table
from labs.torchrun import run_torchrun, under_torchrun
from labs.toy_allreduce import (
    EXAMPLE_SENTENCES,
    ToyAllReduceConfig,
    data_parallel_gradients,
    full_batch_gradients,
    max_abs_difference,
    toy_all_reduce_step,
)
from labs.train import TrainConfig, TrainResult, check_resume, train_worker
from labs.viz.zero import memory_table, traffic_table
from labs.wrappers import Wrapper


def _run(worker: Callable[..., Any], world_size: int, args: tuple, backend: str,
         timeout: float = 60.0, threads: int | None = None) -> list | None:
    if under_torchrun():
        return run_torchrun(worker, args, backend=backend)
    return launch(worker, world_size, args=args, backend=backend, timeout=timeout,
                  threads=threads)


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
    results = _run(data_parallel_gradients, world_size, (EXAMPLE_SENTENCES, opts.seed),
                   opts.backend)
    if results is None:
        return
    reference = full_batch_gradients(EXAMPLE_SENTENCES, opts.seed)
    rows = [
        [r.rank, len(r.sentences), r.loss, max_abs_difference(r.averaged, reference)]
        for r in results
    ]
    print(format_table(["rank", "sentences", "local loss", "max |avg - full batch|"], rows))


def _collectives(opts: argparse.Namespace, world_size: int) -> None:
    """Chapters 2-4's collectives beside torch's built-ins, timed and checked on these ranks:
    across nodes under torchrun, where the ring's messages cross a real network."""
    if world_size < 2:
        raise ValueError(f"a collective needs at least 2 ranks, got {world_size}.")
    settings = settings_from_args(opts)
    cases = settings.cases()
    args = (cases, settings.iters, settings.warmup, settings.min_bytes)
    results = _run(time_collectives, world_size, args, opts.backend, timeout=opts.timeout,
                   threads=settings.threads)
    if results is None:
        return  # under torchrun, rank 0 prints
    timings = results[0]  # every rank returns the same timings (max over ranks per call)
    print(sweep_tables(timings))
    wrong = [f"{t.case.collective.value} {t.case.label} {t.case.size_bytes} B"
             for t in timings if not t.correct]
    if wrong:
        raise SystemExit(f"INCORRECT results: {', '.join(wrong)}")


def _ddp(opts: argparse.Namespace, world_size: int) -> None:
    config = TrainConfig(
        steps=opts.steps, batch_size=opts.batch_size, accumulation=opts.accumulation, lr=opts.lr,
        seed=opts.seed, wrapper=_WRAPPERS[opts.wrapper], bucket_cap_mb=opts.bucket_cap_mb,
        checkpoint=opts.checkpoint, checkpoint_every=opts.checkpoint_every, resume=opts.resume,
    )
    config.steps_per_epoch(world_size)  # refuse a batch larger than a rank's data here
    if config.resume and not Path(str(config.checkpoint)).exists():
        raise ValueError(f"--resume: no checkpoint at {config.checkpoint}; run once without "
                         "--resume first.")
    check_resume(config, world_size)  # before any process starts
    results = _run(train_worker, world_size, (config,), opts.backend, timeout=opts.timeout)
    if results is not None:
        print(_train_report(results[0]))


def _zero(opts: argparse.Namespace, world_size: int) -> None:
    """Chapter 6: what each ZeRO stage keeps per parameter and sends per step, measured."""
    settings = dataclasses.replace(LAB_SETTINGS, width=opts.width, layers=opts.layers,
                                   batch=opts.batch, steps=opts.steps)
    strategies = tuple(dict.fromkeys(_STRATEGIES[name] for name in opts.strategies))
    results = _run(lab_worker, world_size, (settings, strategies), opts.backend,
                   timeout=opts.timeout)
    if results is None:
        return  # under torchrun, rank 0 prints
    reports, traffic = results[0]
    print(f"MLP of {settings.layers} x Linear({settings.width}, {settings.width}): "
          f"{settings.parameters:,} parameters, Adam, fp32; rank 0 of {world_size}")
    print(memory_table({(s, world_size): r for s, r in reports.items()}))
    print()
    print(traffic_table(traffic))


def _fsdp(opts: argparse.Namespace, world_size: int) -> None:
    """Chapter 7: the whole recipe (FSDP, bf16, checkpointing, no_sync, clipping, sharded
    checkpoints that resume on any number of ranks)."""
    config = RecipeConfig(
        steps=opts.steps, batch_size=opts.batch_size, accumulation=opts.accumulation,
        lr=opts.lr, seed=opts.seed, d_model=opts.d_model, n_layers=opts.layers,
        dtype=opts.dtype, activation_checkpointing=not opts.no_checkpointing,
        max_norm=opts.max_norm or None, checkpoint=opts.checkpoint,
        checkpoint_every=opts.checkpoint_every, resume=opts.resume or _can_resume(opts),
        measure_memory=opts.memory,
        fail_at_step=None if _restarts() else opts.fail_at_step)  # a restart does not fail
    config.check(world_size)  # before any process starts
    results = _run(recipe_worker, world_size, (config,), opts.backend, timeout=opts.timeout)
    if results is None:
        return  # under torchrun, rank 0 prints
    if _restarts():
        print(f"torchrun restart {_restarts()}: resumed from the checkpoint of step "
              f"{results[0].start_step}")
    print(loss_report(results[0]))
    if opts.memory:
        print(budget_table(results[0]))


def _restarts() -> int:
    """How many times torchrun has restarted this worker group (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) if under_torchrun() \
        else 0


def _can_resume(opts: argparse.Namespace) -> bool:
    """A restarted worker group resumes from the last complete checkpoint, if there is one
    (a directory with its index)."""
    return _restarts() > 0 and bool(opts.checkpoint) \
        and (Path(opts.checkpoint) / "index.json").exists()


#: --wrapper names -> Wrapper
_WRAPPERS = {"naive": Wrapper.NAIVE, "ours": Wrapper.DDP, "torch": Wrapper.TORCH_DDP}
#: --strategies names -> Wrapper
_STRATEGIES = {"ddp": Wrapper.DDP, "zero1": Wrapper.ZERO1, "zero2": Wrapper.ZERO2,
               "fsdp": Wrapper.FSDP}


def _train_report(result: TrainResult, rows: int = 10) -> str:
    """The loss every few steps (every step for short runs), then the throughput."""
    every = max(1, result.steps // rows)
    steps = range(result.start_step + 1, result.start_step + result.steps + 1)
    table = [[step, loss] for step, loss in zip(steps, result.losses, strict=True)
             if step % every == 0 or step == steps[-1]]
    rate = result.world_size * result.tokens / result.seconds if result.seconds else 0.0
    return "\n".join([
        format_table(["step", "loss"], table),
        f"final loss {result.final_loss:.4f} after step {result.start_step + result.steps}; "
        f"{rate:,.0f} tokens/s on {result.world_size} ranks ({result.seconds:.2f} s)",
    ])


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
    col = sub.add_parser("collectives", help="chapters 2-4: the collectives from point-to-point "
                         "messages beside torch's, timed and checked (busbw table)")
    add_case_arguments(col)
    col.add_argument("--timeout", type=float, default=600.0,
                     help="seconds before local ranks are killed (ignored under torchrun)")
    col.set_defaults(run=_collectives)
    defaults = TrainConfig()
    ddp = sub.add_parser("ddp", help="chapter 5: train a small transformer, data parallel")
    ddp.add_argument("--steps", type=int, default=defaults.steps,
                     help="optimizer steps to reach (a resumed run continues up to it)")
    ddp.add_argument("--batch-size", type=int, default=defaults.batch_size,
                     help="windows per rank per micro-batch")
    ddp.add_argument("--accumulation", type=int, default=defaults.accumulation,
                     help="micro-batches per optimizer step")
    ddp.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate")
    ddp.add_argument("--seed", type=int, default=defaults.seed,
                     help="model initialisation and data order")
    ddp.add_argument("--wrapper", choices=list(_WRAPPERS),
                     default={w: name for name, w in _WRAPPERS.items()}[defaults.wrapper],
                     help="the data-parallel wrapper")
    ddp.add_argument("--bucket-cap-mb", type=float, default=defaults.bucket_cap_mb,
                     help="bucket size in MiB (ours, torch)")
    ddp.add_argument("--checkpoint", metavar="PATH", help="save to (and resume from) this file")
    ddp.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                     help="also save every this many steps (default: at the end only)")
    ddp.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ddp.add_argument("--timeout", type=float, default=600.0,
                     help="seconds before local ranks are killed (ignored under torchrun)")
    ddp.set_defaults(run=_ddp)
    zero = sub.add_parser("zero", help="chapter 6: memory per parameter and traffic per step "
                          "of DDP, ZeRO-1, ZeRO-2 and FSDP, measured")
    zero.add_argument("--strategies", nargs="+", choices=list(_STRATEGIES),
                      default=list(_STRATEGIES), help="which to run (default: all)")
    zero.add_argument("--width", type=int, default=LAB_SETTINGS.width,
                      help="width of the MLP's layers (default: chapter 6's)")
    zero.add_argument("--layers", type=int, default=LAB_SETTINGS.layers,
                      help="Linear layers in the MLP")
    zero.add_argument("--batch", type=int, default=LAB_SETTINGS.batch, help="rows per rank")
    zero.add_argument("--steps", type=int, default=LAB_SETTINGS.steps,
                      help="Adam steps per strategy (the last one is measured)")
    zero.add_argument("--timeout", type=float, default=600.0,
                      help="seconds before local ranks are killed (ignored under torchrun)")
    zero.set_defaults(run=_zero)
    recipe = RecipeConfig()
    fsdp = sub.add_parser("fsdp", help="chapter 7: the transformer trained with FSDP, bf16, "
                          "activation checkpointing, accumulation, clipping; sharded "
                          "checkpoints")
    fsdp.add_argument("--steps", type=int, default=recipe.steps,
                      help="optimizer steps to reach (a resumed run continues up to it)")
    fsdp.add_argument("--batch-size", type=int, default=recipe.batch_size,
                      help="windows per rank per micro-batch")
    fsdp.add_argument("--accumulation", type=int, default=recipe.accumulation,
                      help="micro-batches per optimizer step (all but the last in no_sync)")
    fsdp.add_argument("--lr", type=float, default=recipe.lr, help="AdamW learning rate")
    fsdp.add_argument("--seed", type=int, default=recipe.seed)
    fsdp.add_argument("--d-model", type=int, default=recipe.d_model, help="model width")
    fsdp.add_argument("--layers", type=int, default=recipe.n_layers, help="blocks")
    fsdp.add_argument("--dtype", choices=["fp32", "bf16"], default=recipe.dtype,
                      help="compute dtype (shards and gradient reduction stay fp32)")
    fsdp.add_argument("--no-checkpointing", action="store_true",
                      help="keep every activation (no activation checkpointing)")
    fsdp.add_argument("--max-norm", type=float, default=recipe.max_norm,
                      help="clip the total gradient norm to this (0: no clipping)")
    fsdp.add_argument("--checkpoint", metavar="DIR",
                      help="save sharded checkpoints into (and resume from) this directory")
    fsdp.add_argument("--checkpoint-every", type=int, metavar="STEPS",
                      help="also save every this many steps (default: at the end only)")
    fsdp.add_argument("--resume", action="store_true",
                      help="continue from --checkpoint, on any number of ranks")
    fsdp.add_argument("--fail-at-step", type=int, metavar="STEP",
                      help="rank 1 fails as this step starts (not in a resumed run); under "
                           "torchrun --max-restarts the restarted ranks resume from the last "
                           "checkpoint")
    fsdp.add_argument("--memory", action="store_true",
                      help="measure rank 0's memory over the last step: the budget table")
    fsdp.add_argument("--timeout", type=float, default=600.0,
                      help="seconds before local ranks are killed (ignored under torchrun)")
    fsdp.set_defaults(run=_fsdp)
    for lab in (toy, grads, col, ddp, zero, fsdp):
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
