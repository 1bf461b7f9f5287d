"""Labs for *From All-Reduce to FSDP*: real torch.distributed ranks, launched from a notebook.

The library the book's notebooks import. Modules follow the chapters:

* :mod:`labs.launcher` - ``launch``: run ``fn(rank, world_size, ...)`` on N real ranks
  (every chapter). The package re-exports its names: ``from labs import launch, rank_device``.
* :mod:`labs.toy_allreduce` - chapter 1: the toy all-reduce and a tiny language model.
* :mod:`labs.collectives` - chapters 2-4: all-reduce, reduce-scatter and all-gather built from
  point-to-point messages (naive, ring, recursive doubling), with traffic counts and traces;
  beneath it :mod:`labs.p2p` (the point-to-point calls, counted) and
  :mod:`labs.ring_schedule` (how a ring pass runs: lock-step, or pipelined from a schedule
  compiled once).
* :mod:`labs.cost_model` - chapter 2: the latency-bandwidth model fitted on this machine.
* :mod:`labs.memory` - per-rank memory, measured from the tensors a rank holds.
* :mod:`labs.experiments` - chapters 2-4: ring traces, traffic counts, agreement across ranks.
* :mod:`labs.ddp` - chapter 5: ``NaiveDDP`` and bucketed, overlapped ``DDP``;
  :mod:`labs.ddp_experiments` and :mod:`labs.ddp_pitfalls` measure them on real ranks;
  :mod:`labs.train` is the transformer training lab (``python -m labs ddp``).
* :mod:`labs.zero` (ZeRO-1/2) and :mod:`labs.fsdp` (ZeRO-3) - chapter 6;
  :mod:`labs.zero_experiments` measures memory and traffic per stage and
  :mod:`labs.fsdp_torch` runs torch's ``fully_shard`` beside them.
* :mod:`labs.checks` - the exercise checks, run on real ranks (chapters 2-4 in
  :mod:`labs.checks_collectives`, 5 in :mod:`labs.checks_ddp`, 6 in :mod:`labs.checks_zero`).
* :mod:`labs.tables` - plain text tables (one formatter, no matplotlib);
  :mod:`labs.viz`, :mod:`labs.viz_ddp`, :mod:`labs.viz_zero`, :mod:`labs.widgets` - figures,
  the tables of chapters 5 and 6, widget panels.
* :mod:`labs.bench` - benchmarks (``python -m labs.bench launch``, ``... collectives``,
  ``... ddp``, ``... fsdp``).
* :mod:`labs.grading` - for instructors: release learners' copies of the notebooks and grade
  them with nbval (``python -m labs.grading release|grade``).
"""

from labs.launcher import (
    MAX_WORLD_SIZE,
    Backend,
    LaunchTimeout,
    RankError,
    RankResults,
    StartMethod,
    launch,
    rank_device,
    shutdown,
)

__all__ = [
    "MAX_WORLD_SIZE",
    "Backend",
    "LaunchTimeout",
    "RankError",
    "RankResults",
    "StartMethod",
    "launch",
    "rank_device",
    "shutdown",
]
