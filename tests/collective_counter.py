"""Count what a rank asks of the other ranks before something refuses its arguments: the tests
that show a bad argument is refused before any process talks to another run their build in a
rank through :func:`calls_before_refusal`, and show the counter is live with a right one."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

#: Every way a rank can talk to the others: torch's collectives and point to point.
COMMUNICATION = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv",
                 "batch_isend_irecv", "barrier")


def calls_before_refusal(build: Callable[[], object], *,
                         names: tuple[str, ...] = COMMUNICATION,
                         refusals: tuple[type[Exception], ...] = (ValueError,)
                         ) -> tuple[int, str]:
    """(calls to any of ``names`` in ``torch.distributed`` made while ``build()`` ran, the
    message it was refused with, or "no error"). Run it inside a rank: it wraps the functions
    of that process for good (the process ends with the launch: nothing to undo)."""
    calls = [0]

    def counted(fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            calls[0] += 1
            return fn(*args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, counted(getattr(dist, name)))
    try:
        build()
    except refusals as err:
        return calls[0], str(err)
    return calls[0], "no error"
