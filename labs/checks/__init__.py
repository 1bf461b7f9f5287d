"""Exercise checks: run the learner's function on real ranks and print a deterministic verdict.

Every exercise is one row of :mod:`labs.checks.exercises` (its chapter, the function the learner
writes and its signature, its check, its answer keys, where its hidden cases are drawn); the
checks this package exports are the registry's, by name. One module per chapter on a shared
skeleton: exercise 1.1 in :mod:`labs.checks.toy`, exercises 2.1-4.2 in
:mod:`labs.checks.collectives`, 5.1-5.2 in :mod:`labs.checks.ddp`, 5.3 in
:mod:`labs.checks.scaling`, 6.1-6.3 in :mod:`labs.checks.zero` (their ranks' side in
:mod:`labs.checks.zero_ranks`), 6.4-6.5 in :mod:`labs.checks.zero_grad`, 7.1 in
:mod:`labs.checks.fsdp_practice`, 7.2 in :mod:`labs.checks.checkpoint`, 7.3 in
:mod:`labs.checks.prefetch`, 8.1-8.2 in :mod:`labs.checks.topology`, 9.1-9.2 in
:mod:`labs.checks.faults`, each with its rank worker, its judge and its explanations (and, where
they are long, its cases and reference answers in the ``*_cases`` module beside it). The
skeleton: :mod:`labs.checks.core` (the verdict, the validation, the plan of what a seed runs,
the run over world sizes, reading a failed or hung launch) and :mod:`labs.checks.watch` (what
the ranks patch and count in ``torch.distributed``). Inside every check the library's own
solution of the exercise is refused (:mod:`labs.checks.answer_keys`, :class:`AnswerKeyUsed`). A
notebook imports every check from here: ``from labs.checks import check_ring_all_reduce``.

``seed=0`` runs the documented cases. Any other seed also draws hidden cases from
``random.Random(seed)`` (other world sizes, shapes or values), and the verdict names what it
drew, so that a grader's verdict can be rerun by hand.
"""

from labs.checks.answer_keys import AnswerKeyUsed
from labs.checks.collectives import CollectiveUsedError
from labs.checks.collectives_cases import Exercise
from labs.checks.core import CheckResult, report
from labs.checks.exercises import EXERCISES

#: Every exercise's check, by its name in the registry (``check_ring_all_reduce``), each
#: imported from the module the registry names.
_CHECKS = {e.check: e.check_function() for e in EXERCISES}
globals().update(_CHECKS)

__all__ = [
    "AnswerKeyUsed",
    "CheckResult",
    "CollectiveUsedError",
    "Exercise",
    *_CHECKS,
    "report",
]
