"""Exercise checks: run the learner's function on real ranks and print a deterministic verdict.

One module per chapter on a shared skeleton: exercise 1.1 in :mod:`labs.checks.toy`, exercises
2.1-4.2 in :mod:`labs.checks.collectives`, 5.1-5.2 in :mod:`labs.checks.ddp`, 6.1-6.3 in
:mod:`labs.checks.zero`, 6.4-6.5 in :mod:`labs.checks.zero_grad`, 7.1-7.2 in
:mod:`labs.checks.fsdp_practice`, 8.1-8.2 in :mod:`labs.checks.topology`, each with its rank worker,
its judge and its explanations (and, where they are long, its cases and reference answers in
the ``*_cases`` module beside it). The skeleton: :mod:`labs.checks.core` (the verdict, the
validation, the plan of what a seed runs, the run over world sizes, reading a failed or hung
launch) and :mod:`labs.checks.watch` (what the ranks patch and count in
``torch.distributed``). Inside every check the library's own solution of the exercise is
refused (:mod:`labs.checks.answer_keys`, :class:`AnswerKeyUsed`). A notebook imports every check
from here:
``from labs.checks import check_ring_all_reduce``.

``seed=0`` runs the documented cases. Any other seed also draws hidden cases from
``random.Random(seed)`` (other world sizes, shapes or values), and the verdict names what it
drew, so that a grader's verdict can be rerun by hand.
"""

from labs.checks.answer_keys import AnswerKeyUsed
from labs.checks.collectives import (
    CollectiveUsedError,
    check_composed_all_reduce,
    check_ring_all_gather,
    check_ring_all_reduce,
    check_ring_reduce_scatter,
)
from labs.checks.collectives_cases import Exercise
from labs.checks.core import CheckResult, report
from labs.checks.ddp import check_bucketed_ddp, check_simple_ddp
from labs.checks.fsdp_practice import check_clip_shards_, check_shard_pieces
from labs.checks.topology import check_hierarchical_all_reduce_, check_tp_mlp_forward
from labs.checks.toy import check_average_gradients
from labs.checks.zero import (
    check_fsdp_linear_forward,
    check_reduce_scatter_grad,
    check_sharded_sgd_step,
)
from labs.checks.zero_grad import check_fsdp_linear_backward, check_zero2_grad_hook

__all__ = [
    "AnswerKeyUsed",
    "CheckResult",
    "CollectiveUsedError",
    "Exercise",
    "check_average_gradients",
    "check_bucketed_ddp",
    "check_clip_shards_",
    "check_composed_all_reduce",
    "check_fsdp_linear_backward",
    "check_fsdp_linear_forward",
    "check_hierarchical_all_reduce_",
    "check_reduce_scatter_grad",
    "check_ring_all_gather",
    "check_ring_all_reduce",
    "check_ring_reduce_scatter",
    "check_shard_pieces",
    "check_sharded_sgd_step",
    "check_simple_ddp",
    "check_tp_mlp_forward",
    "check_zero2_grad_hook",
    "report",
]
