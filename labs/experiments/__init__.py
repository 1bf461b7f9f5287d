"""What the chapters measure, on real ranks: each module returns rows and records that a
notebook turns into tables (:mod:`labs.tables`) and figures (:mod:`labs.viz`).

* :mod:`labs.experiments.collectives` - chapters 2-4: ring traces, traffic counts, agreement
  across ranks;
* :mod:`labs.experiments.timing` - the timing of one collective as the slowest rank sees it;
  :mod:`labs.experiments.p2p_timing` - of a point-to-point message and of an addition (what
  the cost model is fitted on), and :mod:`labs.experiments.cost_fit` - that fit, and how far
  a measurement is from the model; :mod:`labs.experiments.sweep` - chapter 2's sweep of
  every collective and size against torch's built-in ones (also ``python -m labs.bench
  collectives``);
* :mod:`labs.experiments.ddp` - chapter 5: step times, backward timelines, accumulation, the
  sampler; :mod:`labs.experiments.pitfalls` - chapter 5's pitfalls, each run on real ranks;
* :mod:`labs.experiments.zero` - chapter 6: memory and traffic per ZeRO stage, bytes per
  parameter;
* chapter 7: :mod:`labs.experiments.activations` (the chapter's models, checkpointing bytes
  and time), :mod:`labs.experiments.precision` (bf16 bytes and peaks, the scalers with one
  rank overflowing, ``fully_shard`` side by side), :mod:`labs.experiments.accumulation`
  (``no_sync`` against sharded accumulation), :mod:`labs.experiments.clipping`,
  :mod:`labs.experiments.checkpoints` (save on N, load on W; torch dcp) and
  :mod:`labs.experiments.recipe` (the whole recipe, its memory budget; ``python -m labs
  fsdp``);
* :mod:`labs.experiments.mesh` - chapter 8: process groups and 2-D meshes (``new_group``
  against ``init_device_mesh``, DTensor placements) and tensor parallelism of the MLP
  against one process;
* chapter 9: :mod:`labs.experiments.faults` (a rank killed or stopped, desynchronized
  collectives under each watcher, what watching costs), :mod:`labs.experiments.stragglers`
  (random delays against the expected largest, a step with one rank late) and
  :mod:`labs.experiments.recovery` (uneven data with and without ``join()``, a crash resumed
  under ``launch`` and under ``torchrun --max-restarts``).
"""
