"""``python -m labs.bench fsdp``: per-rank memory and step time of FSDP beside DDP.

    python -m labs.bench fsdp [--width 512] [--layers 40] [--memory-world-size 4]
        [--time-world-size 2] [--batches 64 256] [--steps 8]

Memory: the most bytes of parameters, gradients and Adam state that rank 0 held at any moment
of one step (every gather, free and reduce-scatter of FSDP is a snapshot; labs.memory counts
the tensors' storages), communication buffers shown apart, for DDP (labs.ddp.DDP) and FSDP
(labs.fsdp.FSDP, one unit per Linear layer). Step time: the median over steps of the slowest
rank's Adam step, DDP and FSDP alternating in one launch, at each batch size. The defaults
give 10.5 M parameters in 40 layers.

Chapter 7's rows: activation bytes and step time (forward and backward, one process) of the
chapter's 8-block transformer with and without every block checkpointed
(labs.experiments.activations.measure_checkpointing), and the bytes one FSDP step all-gathers and
reduce-scatters in fp32, in bf16 with an fp32 reduction, and in bf16 throughout
(labs.experiments.precision, ring collectives, every byte counted).

Chapter 7's prefetch rows (labs.experiments.fsdp_overlap): the chapter's 4 units of 4 MiB on
2 ranks over its slow link (2 ms, 125 MB/s), every collective on labs' ring on one
communication stream; for prefetch 0, 1, 2 with reshard_after_forward on and off, the median
step (the slower rank's), the model's step, their ratio, the exposed communication and rank
0's peak. Target: prefetch 1 at least 1.3x as fast as prefetch 0, the model within 15 %.
Then FSDP (prefetch 1) beside DDP (a bucket per block) at 31.25, 250 and 1000 MB/s with both
models and their crossover (labs.experiments.fsdp_frontier), and labs' FSDP beside
fully_shard on gloo's own transport (labs.experiments.fully_shard_timing).
"""

from __future__ import annotations

import argparse
from typing import Any

from labs.experiments import fsdp_frontier, fsdp_overlap, fully_shard_timing
from labs.experiments.activations import CHAPTER_MODEL, measure_checkpointing
from labs.experiments.ddp import Case, Optimizer, StepSettings, measure_step_times
from labs.experiments.precision import Precision, mixed_on_ranks
from labs.experiments.zero import Group, memory_worker
from labs.launcher import launch
from labs.tables import format_table
from labs.viz.activations import checkpointing_table
from labs.viz.fsdp_overlap import frontier_table, overlap_table, transport_table
from labs.wrappers import Wrapper


def add_fsdp_parser(sub: Any) -> None:
    p = sub.add_parser("fsdp", help="per-rank memory and step time: FSDP beside DDP",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--memory-world-size", type=int, default=4)
    p.add_argument("--time-world-size", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256],
                   help="samples per rank per step; one timing per batch size")
    p.add_argument("--steps", type=int, default=8)


def fsdp_main(opts: argparse.Namespace, parser: argparse.ArgumentParser) -> None:

    try:
        settings = StepSettings(width=opts.width, layers=opts.layers, batch=opts.batches[0],
                                steps=2, warmup=0)
    except ValueError as err:
        parser.error(str(err))
    mib = 2**20
    reports = {s: launch(memory_worker, opts.memory_world_size, args=(settings, s),
                         echo=False, timeout=600)[0] for s in (Wrapper.DDP, Wrapper.FSDP)}
    ddp, fsdp = reports[Wrapper.DDP], reports[Wrapper.FSDP]
    ddp_all, fsdp_all = (max(r.bytes(s, tuple(Group)) for s in r.snapshots) for r in (ddp, fsdp))
    print(f"{settings.parameters / 1e6:.1f} M parameters ({settings.layers} x Linear("
          f"{settings.width}, {settings.width})), Adam, fp32; memory at world size "
          f"{opts.memory_world_size}, rank 0")
    rows = [[s.value, f"{r.peak_bytes / mib:.1f}", r.peak.moment,
             f"{r.peak_bytes / settings.parameters:.2f}"] for s, r in reports.items()]
    print(format_table(["strategy", "peak MiB (params + grads + Adam)", "at",
                        "bytes / parameter"], rows))
    print(f"FSDP / DDP: {fsdp.peak_bytes / ddp.peak_bytes:.3f} (1/N = "
          f"{1 / opts.memory_world_size:.3f})\nwith communication buffers too (DDP's gradient "
          f"buckets, what FSDP's reduce-scatters receive into): {fsdp_all / mib:.1f} / "
          f"{ddp_all / mib:.1f} MiB = {fsdp_all / ddp_all:.3f}\n")
    rows = []
    for batch in opts.batches:
        timed = StepSettings(width=opts.width, layers=opts.layers, batch=batch,
                             steps=opts.steps, warmup=2, optimizer=Optimizer.ADAM)
        ddp_row, fsdp_row = measure_step_times(
            opts.time_world_size, timed, [Case(Wrapper.DDP, timed.bucket_cap_mb),
                                          Case(Wrapper.FSDP, timed.bucket_cap_mb)],
            timeout=600)
        rows.append([batch, f"{ddp_row.seconds * 1e3:.1f}", f"{fsdp_row.seconds * 1e3:.1f}",
                     f"{fsdp_row.seconds / ddp_row.seconds:.2f}x"])
    print(f"step time at world size {opts.time_world_size} (Adam, median of {opts.steps} "
          "steps, slowest rank)")
    print(format_table(["batch per rank", "DDP ms", "FSDP ms", "FSDP / DDP"], rows))
    practice(opts.memory_world_size)
    prefetch_rows()
    frontier_rows()
    transport_rows()


def practice(world_size: int) -> None:
    """Chapter 7's rows: activation checkpointing and bf16."""
    plain, checkpointed = measure_checkpointing(CHAPTER_MODEL)
    print(f"\nactivations of {CHAPTER_MODEL} (one process)")
    print(checkpointing_table([plain, checkpointed]))
    kept = checkpointed.activation_bytes / plain.activation_bytes
    slower = checkpointed.median_seconds / plain.median_seconds
    print(f"with checkpointing / without: {kept:.3f} of the bytes (target <= 1/3), "
          f"{slower:.2f}x the step time")
    runs = mixed_on_ranks(world_size)[0].runs
    fp32 = runs[Precision.FP32].all_gather_bytes[-1]
    rows = [[p.value, run.all_gather_bytes[-1], f"{run.all_gather_bytes[-1] / fp32:.3f}",
             run.reduce_scatter_bytes[-1]] for p, run in runs.items()]
    print(f"\nbytes sent by rank 0 in one FSDP step at world size {world_size} (ring, counted)")
    print(format_table(["precision", "all-gather B", "vs fp32", "reduce-scatter B"], rows))


def prefetch_rows() -> None:
    """Chapter 7's prefetch and reshard settings on the link, measured beside the model."""
    config = fsdp_overlap.OverlapSettings()
    rows = fsdp_overlap.measure(config, [(k, keep) for keep in (True, False) for k in (0, 1, 2)])
    print(f"\nFSDP's step on the link (alpha {config.link.alpha * 1e3:g} ms, "
          f"{config.link.bandwidth / 1e6:g} MB/s; {config.units} units of "
          f"{config.unit_bytes / 2**20:.1f} MiB, {config.tokens} rows per rank, "
          f"{config.world_size} ranks, median of {config.steps} steps)")
    print(overlap_table(rows))
    by = {(r.prefetch, r.reshard): r for r in rows}
    speedup = by[0, True].measured / by[1, True].measured
    worst = max(abs(r.ratio - 1) for r in rows)
    print(f"prefetch 1 vs 0 (reshard on): {speedup:.2f}x (target >= 1.3); the model within "
          f"{worst:.0%} of every setting (target 15 %)")


def frontier_rows() -> None:
    """FSDP (prefetch 1) beside DDP (a bucket per block) at the link's three bandwidths."""
    config = fsdp_frontier.FRONTIER
    points = fsdp_frontier.measure_frontier(config)
    print(f"\nFSDP beside DDP as the link gets faster (alpha {config.link.alpha * 1e3:g} ms; "
          f"{config.units} blocks, {config.tokens} rows per rank, {config.world_size} ranks, "
          f"median of {config.steps} steps)")
    print(frontier_table(points))
    curve = fsdp_frontier.curves(points[len(points) // 2])
    extra = [f"{(p.fsdp_exposed - p.ddp_exposed) * 1e3:.0f}" for p in points]
    print(f"the models' crossover (from the middle point's compute): "
          f"{fsdp_frontier.crossover(curve) / 1e6:.0f} MB/s; FSDP's extra wait, ms: "
          f"{', '.join(extra)}")


def transport_rows() -> None:
    """labs' FSDP beside fully_shard on gloo's own transport (no link)."""
    config = fully_shard_timing.TRANSPORT
    print(f"\nlabs' FSDP beside fully_shard on gloo's transport ({config.units} blocks, "
          f"{config.tokens} rows per rank, {config.world_size} ranks, median of "
          f"{config.steps} steps)")
    print(transport_table(fully_shard_timing.measure_transport(config)))
