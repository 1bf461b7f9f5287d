"""Activation memory: what autograd keeps from forward for backward, and activation
checkpointing (chapter 7)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_module(module: nn.Module) -> Callable[[], None]:
    """Make ``module``'s forward an activation checkpoint (non-reentrant
    ``torch.utils.checkpoint``): its forward keeps only its inputs for backward, and backward
    runs the forward again to rebuild what it needs. Hooks registered on ``module`` still fire
    once per call (they run around ``module.forward``, outside the checkpoint), and not during
    the recomputation. Returns a function that undoes it."""
    plain = module.forward
    module.forward = functools.partial(checkpoint, plain, use_reentrant=False)

    def undo() -> None:
        del module.forward  # the instance attribute: the class's forward shows again

    return undo
