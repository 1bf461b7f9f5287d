"""Labs for *From All-Reduce to FSDP*: real torch.distributed ranks, launched from a notebook.

The library the book's notebooks import. The top level holds what a learner reads, in course
order:

* :mod:`labs.launcher` - ``launch``: run ``fn(rank, world_size, ...)`` on N real ranks (every
  chapter); the package re-exports its names: ``from labs import launch, rank_device``.
  Beneath it :mod:`labs.launch_inputs` (what ``launch`` accepts, refused before any process
  starts), :mod:`labs.rank_results` (what a launch hands back), :mod:`labs.rank_errors` (what
  a failed or hung rank reports),
  :mod:`labs.rank_pickle` (how a notebook's function reaches the ranks),
  :mod:`labs.torchrun` (the same labs under torchrun), :mod:`labs.staging` (how ranks
  that share a GPU move CUDA tensors over gloo) and :mod:`labs.clock` (timings that wait for
  the GPU's queued work).
* :mod:`labs.toy_allreduce` - chapter 1: the toy all-reduce and a tiny language model.
* :mod:`labs.collectives` - chapters 2-4: all-reduce, reduce-scatter and all-gather built from
  point-to-point messages (naive, ring, recursive doubling; Rabenseifner's halving-doubling in
  :mod:`labs.halving_doubling` and NCCL's double binary tree in :mod:`labs.double_tree`),
  with traffic counts and traces;
  beneath it :mod:`labs.torch_collectives` (torch's conventions and its own collectives, the
  baseline), :mod:`labs.p2p` (the point-to-point calls, counted) and
  :mod:`labs.ring_schedule` (how a ring pass runs), and :mod:`labs.link` (``Link``, an
  emulated network those messages can go over: ``launch(..., link=Link(...))``, and
  ``Topology``, nodes joined by a slower link, chapter 8); :mod:`labs.multi_ring` runs the flat
  all-reduce over several channels, rings laid out so that every network card carries one (how
  NCCL runs it across nodes).
* :mod:`labs.cost_model` - chapter 2: the latency-bandwidth model and its closed forms on the
  emulated link (its fit on this machine is :mod:`labs.experiments.cost_fit`).
* :mod:`labs.memory` - per-rank memory, measured from the tensors a rank holds.
* :mod:`labs.claims` - a chapter's statement about a measurement, decided by the spread of
  its repeats and shown as Markdown (every chapter; appendix A2 explains the rule).
* :mod:`labs.ddp` - chapter 5: ``NaiveDDP`` and bucketed, overlapped ``DDP``; :mod:`labs.train`
  is the transformer training lab (``python -m labs ddp``).
* :mod:`labs.zero` (ZeRO-1/2), :mod:`labs.fsdp` (ZeRO-3; beneath it :mod:`labs.fsdp_unit`,
  what one sharded unit is, and :mod:`labs.fsdp_collectives`, its torch collectives) and
  :mod:`labs.fsdp_torch` (torch's ``fully_shard`` beside them) - chapter 6.
* :mod:`labs.activations` (activation memory, checkpointing), :mod:`labs.precision` (fp16
  loss scaling, ``ShardedGradScaler``) and :mod:`labs.checkpoint` (sharded checkpoints that
  load on any number of ranks; their files are :mod:`labs.checkpoint_format`) - chapter 7, FSDP
  in practice (``python -m labs fsdp``).
* :mod:`labs.tensor_parallel` - chapter 8: Megatron's column- and row-parallel MLP; the
  chapter's ``Topology`` is in :mod:`labs.link`, ``hierarchical_all_reduce`` in
  :mod:`labs.collectives`, HSDP is ``FSDP(shard_size=...)``; every sub-group of the course
  (nodes, HSDP's shard and replicate groups, a tensor-parallel mesh) comes from one grid of
  named dimensions, :mod:`labs.grid`.
* :mod:`labs.models` - the small models and step settings the chapters and tests share.
* :mod:`labs.wrappers` - ``Wrapper``, which data-parallel wrapper holds the model, and the
  factory that builds each one.
* :mod:`labs.tables` - plain text tables (one formatter, no matplotlib).

The subpackages hold what the chapters measure, draw and check: :mod:`labs.experiments`
(measurements on real ranks), :mod:`labs.viz` (figures and widget panels),
:mod:`labs.checks` (the exercise checks), :mod:`labs.bench` (``python -m labs.bench ...``)
and :mod:`labs.grading` (``python -m labs.grading release|grade``, for instructors).
"""

from labs.launch_inputs import placement_note
from labs.launcher import (
    MAX_WORLD_SIZE,
    Backend,
    Device,
    LaunchTimeout,
    Placement,
    RankError,
    RankResults,
    StartMethod,
    launch,
    rank_device,
    shutdown,
)
from labs.link import Link, Topology

__all__ = [
    "MAX_WORLD_SIZE",
    "Backend",
    "Device",
    "LaunchTimeout",
    "Link",
    "Placement",
    "RankError",
    "RankResults",
    "StartMethod",
    "Topology",
    "launch",
    "placement_note",
    "rank_device",
    "shutdown",
]
