"""Benchmarks that print tables (never timed assertions in tests).

    python -m labs.bench launch [--world-sizes 1 2 4 8] [--repeats 5] [--methods forkserver spawn]
    python -m labs.bench collectives [--collectives all-reduce ...] [--algorithms ring torch ...]
        [--sizes 1K 64K 1M 16M] [--world-sizes 2 4] [--backends gloo nccl] [--iters 5]
        [--warmup 1] [--dtype float32] [--segment-bytes 1M] [--window 4]
        [--out _build/bench/collectives.csv] [--plot PATH.png]
    python -m labs.bench ddp [--world-size 2] [--bucket-cap-mb 25] [--launches 3] (see --help)
    python -m labs.bench fsdp [--memory-world-size 4] [--time-world-size 2] (see --help)
    python -m labs.bench topology [--nodes 2 4 8] [--node-size 2] [--size 16M] [--grid] (see --help)
    python -m labs.bench grading [--repeats 5] [--chapter 04_all_gather.ipynb]
    python -m labs.bench faults [--world-size 2] [--repeats 200] (see --help)
    python -m labs.bench claims [--repeats 10] [--busy 0 2] [--only ch5.crossover]

``claims``: each timing claim of the book re-run ``--repeats`` times, quiet and beside CPU
burners, and how often it came out as its chapter's text needs (:mod:`labs.bench.claims`).

``launch``: the price a learner pays per widget click. For each start method and world size a
fresh Python process imports ``labs`` (torch included, as a notebook kernel already has), then
times its first ``launch`` of a trivial function (this includes starting the forkserver) and
the median of ``--repeats`` later launches.

``collectives``: an nccl-tests style sweep of the collectives of :mod:`labs.collectives`
against torch's built-in ones. One launch per backend and world size runs every case of that
world size, so starting processes is never part of a timing. For each case it reports the
median over iterations of the slowest rank's time per call, the algorithm bandwidth
``algbw = S / time`` and the bus bandwidth ``busbw = algbw x bus factor`` (2(N-1)/N for
all-reduce, (N-1)/N for reduce-scatter and all-gather: the bytes each rank must move over its
link per byte of S, so busbw can be compared with a link's speed whatever N is). Every call's
result is compared with the exact answer (integer-valued inputs, so sums are exact), torch's
built-in included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from labs.bench.claims import add_claims_parser, claims_main
from labs.bench.collectives import add_collectives_parser, collectives_main
from labs.bench.ddp import add_ddp_parser, ddp_main
from labs.bench.faults import add_faults_parser, faults_main
from labs.bench.fsdp import add_fsdp_parser, fsdp_main
from labs.bench.grading import add_grading_parser, grading_main
from labs.bench.topology import add_topology_parser, topology_main
from labs.launcher import StartMethod, launch
from labs.tables import format_table

# --- python -m labs.bench launch ----------------------------------------------------------------


def _trivial(rank: int, world_size: int) -> int:
    return rank


def time_launches(world_size: int, method: StartMethod, repeats: int) -> dict[str, float]:
    """Run in a fresh process: first launch, then the median of ``repeats`` more."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        launch(_trivial, world_size, echo=False, start_method=method)
        times.append(time.perf_counter() - start)
    return {"first": times[0], "median_later": statistics.median(times[1:])}


def bench_launch(world_sizes: Sequence[int], repeats: int, methods: Sequence[str]) -> str:
    from tqdm import tqdm

    rows = []
    cases = [(m, n) for m in methods for n in world_sizes]
    for method, world_size in tqdm(cases, desc="launch latency", unit="case"):
        code = (
            "import json\n"
            "from labs.bench import time_launches\n"
            "from labs.launcher import StartMethod\n"
            "if __name__ == '__main__':\n"
            f"    print(json.dumps(time_launches({world_size}, StartMethod({method!r}), "
            f"{repeats})))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        timing = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([method, world_size, f"{timing['first']:.3f}",
                     f"{timing['median_later']:.3f}"])
    return format_table(["start method", "world size", "first launch (s)",
                         f"median of {repeats} later (s)"], rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labs.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    lat = sub.add_parser("launch", help="launch latency of a trivial fn")
    lat.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    lat.add_argument("--repeats", type=int, default=5)
    lat.add_argument("--methods", nargs="+", default=[m.value for m in StartMethod],
                     choices=[m.value for m in StartMethod])
    add_collectives_parser(sub)
    add_ddp_parser(sub)
    add_fsdp_parser(sub)
    add_topology_parser(sub)
    add_grading_parser(sub)
    add_faults_parser(sub)
    add_claims_parser(sub)
    opts = parser.parse_args(argv)
    if opts.bench == "launch":
        print(bench_launch(opts.world_sizes, opts.repeats, opts.methods))
    elif opts.bench == "ddp":
        ddp_main(opts, sub.choices["ddp"])
    elif opts.bench == "fsdp":
        fsdp_main(opts, sub.choices["fsdp"])
    elif opts.bench == "topology":
        topology_main(opts, sub.choices["topology"])
    elif opts.bench == "grading":
        grading_main(opts)
    elif opts.bench == "claims":
        claims_main(opts)
    elif opts.bench == "faults":
        faults_main(opts, sub.choices["faults"])
    else:
        collectives_main(opts, sub.choices["collectives"])

