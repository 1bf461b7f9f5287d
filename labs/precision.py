"""Chapter 7, part 2: mixed precision, and the loss scaling that fp16 needs under sharding.

Three formats, by their bits (sign, exponent, significand) and what they can hold::

    format   bits      smallest subnormal     smallest normal     largest     epsilon
    fp32     1, 8, 23  2^-149 ~ 1.4e-45       2^-126 ~ 1.2e-38    ~ 3.4e38    2^-23
    bf16     1, 8, 7   2^-133 ~ 9.2e-41       2^-126 ~ 1.2e-38    ~ 3.4e38    2^-7
    fp16     1, 5, 10  2^-24  ~ 6.0e-8        2^-14  ~ 6.1e-5     65504       2^-10

bf16 keeps fp32's exponent (its range) and drops precision; fp16 keeps more precision and
loses range at both ends. Gradients are small: a value below 2^-25 rounds to 0 in fp16, and
one below 2^-14 is subnormal, with fewer significant bits the smaller it is. Loss scaling
(Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740) multiplies the loss by S
before backward, so every gradient is computed S times larger, inside fp16's range, and
divides by S in fp32 before the optimizer step. Too large an S overflows instead (inf, or
NaN from inf - inf), so the scale is adjusted as training runs: halved and the step skipped
when an inf or NaN appears, doubled after ``growth_interval`` steps without one
(``torch.amp.GradScaler``). bf16 needs none of this: its range is fp32's.

Under sharding (ZeRO, FSDP) each rank holds and checks only its shard of the gradient, so
whether to skip must be agreed: :class:`LocalGradScaler` is the rule as one process applies
it, :class:`ShardedGradScaler` the one that works on shards (one all-reduce of a flag).
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labs.launcher import rank_device

# --- the formats, and a gradient that underflows ----------------------------------------------


@dataclass(frozen=True)
class FormatRange:
    """What a floating-point format holds: ``torch.finfo`` and its smallest subnormal."""

    dtype: torch.dtype
    smallest_subnormal: float
    """The smallest positive value: smallest normal x epsilon (2^-24 for fp16); half of it
    and less round to 0."""
    smallest_normal: float
    """Below this, values are subnormal: fewer significant bits, down to one."""
    largest: float
    """Above this (rounded), a value becomes inf."""
    eps: float
    """The gap between 1 and the next value: the relative precision of normal values."""


def format_range(dtype: torch.dtype) -> FormatRange:
    """The range of a floating-point ``dtype``, from ``torch.finfo``."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}.")
    info = torch.finfo(dtype)
    return FormatRange(dtype, info.smallest_normal * info.eps, info.smallest_normal, info.max,
                       info.eps)


def round_trip(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``values`` as ``dtype`` holds them after multiplying by ``scale``, divided by ``scale``
    again in fp32: ``round_trip(tensor([1e-8]), torch.float16)`` is 0 (fp16's smallest
    subnormal is 2^-24 ~ 6e-8), with ``scale=2**16`` it is 9.997e-09 (6.55e-4 in fp16, a normal
    value, 11 significant bits)."""
    return (values.float() * scale).to(dtype).float() / scale


@dataclass(frozen=True)
class Underflow:
    """What happens to one model's gradient when backward runs in ``dtype`` with the loss
    multiplied by ``scale`` (and the gradient divided by it in fp32), element by element,
    against the gradient computed in fp32."""

    dtype: torch.dtype
    scale: float
    elements: int
    """Gradient elements that are not zero in fp32 (trainable parameters only)."""
    flushed: int
    """Of those, how many are exactly 0 when computed in ``dtype``: lost."""
    subnormal: int
    """Of those, how many are subnormal in ``dtype`` (times ``scale``): fewer bits."""
    overflowed: int
    """Elements that are inf or NaN in ``dtype``: the scale was too large."""
    median_relative_error: float
    """The median of |g_dtype - g_fp32| / |g_fp32| over the elements that are finite and not
    zero in both (the largest says little: an element near 0 in fp32 can come out of a
    forward in another dtype with another sign)."""

    @property
    def flushed_fraction(self) -> float:
        return self.flushed / self.elements if self.elements else 0.0

    @property
    def subnormal_fraction(self) -> float:
        return self.subnormal / self.elements if self.elements else 0.0


#: Computes the loss of a model (already cast to the dtype given), with the inputs in that
#: dtype; the loss itself in fp32 (``.float()`` before the reduction).
LossFn = Callable[[nn.Module, torch.dtype], torch.Tensor]


def _gradient(model: nn.Module, loss_fn: LossFn, dtype: torch.dtype, scale: float
              ) -> torch.Tensor:
    """The gradient of every trainable parameter of a copy of ``model`` cast to ``dtype``,
    concatenated (1-D, fp32, divided by ``scale``); a parameter without one counts as 0."""
    copied = copy.deepcopy(model).to(dtype)
    copied.zero_grad(set_to_none=True)
    (loss_fn(copied, dtype) * scale).backward()
    params = [p for p in copied.parameters() if p.requires_grad]
    return torch.cat([(p.grad.float() / scale if p.grad is not None
                       else torch.zeros(p.numel())).reshape(-1) for p in params])


def gradient_underflow(model: nn.Module, loss_fn: LossFn,
                       cases: Sequence[tuple[torch.dtype, float]]) -> list[Underflow]:
    """For each (dtype, scale) of ``cases``, the backward of ``loss_fn`` run in that dtype
    (on a copy of ``model``), element by element against the fp32 gradient (scale 1). The
    model itself is left as it is. Cost: one backward per case, plus the fp32 one."""
    reference = _gradient(model, loss_fn, torch.float32, 1.0)  # 1-D, fp32
    nonzero = reference != 0
    rows = []
    for dtype, scale in cases:
        if not scale > 0 or math.isinf(scale):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}.")
        got = _gradient(model, loss_fn, dtype, scale)
        finite = got.isfinite()
        scaled = (got * scale).abs()
        lowest_normal = format_range(dtype).smallest_normal
        mask = nonzero & finite & (got != 0)
        error = ((got - reference).abs() / reference.abs())[mask]
        rows.append(Underflow(
            dtype, scale, int(nonzero.sum()),
            flushed=int((nonzero & (got == 0)).sum()),
            subnormal=int((mask & (scaled < lowest_normal)).sum()),
            overflowed=int((~finite).sum()),
            median_relative_error=float(error.median()) if error.numel() else 0.0))
    return rows


# --- loss scaling -------------------------------------------------------------------------------


class OptState(enum.Enum):
    """Where an optimizer is in the scaler's step (``torch.amp.grad_scaler.OptState``)."""

    READY = "ready"
    """Nothing done since the last :meth:`LocalGradScaler.update`."""
    UNSCALED = "unscaled"
    """Its gradients have been divided by the scale and checked for inf/NaN."""
    STEPPED = "stepped"
    """:meth:`LocalGradScaler.step` has run (or skipped) it."""


@dataclass
class _Check:
    """One optimizer's state in the current step, and what its inf/NaN check found."""

    stage: OptState = OptState.READY
    found_inf_locally: bool = False
    found_inf: bool = False


class LocalGradScaler:
    """``torch.amp.GradScaler``'s rule applied to the gradients this rank holds, each rank
    on its own: right when every rank holds the whole (all-reduced) gradient, as under DDP,
    and wrong under sharding (see :class:`ShardedGradScaler`)::

        scaler = LocalGradScaler()
        scaler.scale(loss).backward()      # every gradient S times larger
        scaler.unscale_(optimizer)         # divided by S; inf/NaN looked for (clip after this)
        scaler.step(optimizer)             # skipped if one was found
        scaler.update()                    # S halved after a skip, doubled after
                                           # growth_interval steps without one

    The scale S is a power of two (for the defaults), so multiplying by it and dividing by it
    are exact wherever the value stays in range: with nothing overflowing, scaled steps equal
    unscaled ones bit for bit.

    Args:
        init_scale: S at the start.
        growth_factor: S is multiplied by it after ``growth_interval`` steps in a row without
            an inf or NaN (> 1).
        backoff_factor: S is multiplied by it after a skipped step (between 0 and 1).
        growth_interval: steps without inf or NaN before S grows (a positive int).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        _check_scale(init_scale, "init_scale")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1
                and math.isfinite(growth_factor)):
            raise ValueError(f"growth_factor must be a finite number > 1 (it multiplies the "
                             f"scale after good steps), got {growth_factor!r}.")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            raise ValueError(f"backoff_factor must be between 0 and 1 (it multiplies the scale "
                             f"after a skipped step), got {backoff_factor!r}.")
        _check_interval(growth_interval)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0  # good steps in a row since the scale last changed
        self._checks: dict[int, _Check] = {}  # by id(optimizer), for the current step

    # -- the four calls of a step --

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs * S``. Compute the loss in fp32 (``.float()`` before the reduction): an
        fp16 loss times 2^16 overflows as soon as the loss exceeds 1."""
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"scale() takes the loss tensor, got {type(outputs).__name__}.")
        return outputs * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient of ``optimizer``'s parameters by S, in place, and look for
        inf and NaN in them; at most once per optimizer and step, before :meth:`step`.

        Call it yourself before clipping (``clip_grad_norm_`` must see true gradients);
        :meth:`step` calls it otherwise. Cost: one pass over this rank's gradients."""
        check = self._checks.setdefault(id(optimizer), _Check())
        if check.stage is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update(): call it once per step.")
        if check.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step(): call it before, or "
                               "call update() to start the next step.")
        inverse = 1.0 / self._scale
        found = False
        device = rank_device()  # where a collective's tensor must be (a GPU under nccl)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                grad.mul_(inverse)  # exact for a power-of-two scale, unless it underflows
                found = found or not bool(grad.isfinite().all())
                device = grad.device
        flag = torch.tensor([1.0 if found else 0.0], device=device)  # 1 element, fp32
        check.found_inf_locally = found
        check.found_inf = bool(self._agree(flag).item())
        check.stage = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """:meth:`unscale_` (unless done), then ``optimizer.step(*args, **kwargs)`` and its
        result; None, without a step, when an inf or NaN was found."""
        check = self._checks.setdefault(id(optimizer), _Check())
        if check.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called on this optimizer since the "
                               "last update().")
        if check.stage is OptState.READY:
            self.unscale_(optimizer)
        check.stage = OptState.STEPPED
        if check.found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | None = None) -> None:
        """End the step: S times ``backoff_factor`` if any optimizer's check found an inf or
        NaN, times ``growth_factor`` after ``growth_interval`` good steps in a row; or
        ``new_scale``, if given."""
        if new_scale is not None:
            _check_scale(new_scale, "new_scale")
            self._scale = float(new_scale)
        else:
            if not self._checks:
                raise RuntimeError("update() found no inf/NaN check in this step: call "
                                   "unscale_(optimizer) or step(optimizer) before update().")
            if any(c.found_inf for c in self._checks.values()):
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._checks = {}

    # -- reading it --

    def get_scale(self) -> float:
        """S, by which :meth:`scale` multiplies the loss now."""
        return self._scale

    def get_growth_tracker(self) -> int:
        """Good steps in a row since S last changed."""
        return self._growth_tracker

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this step is skipped for ``optimizer`` (after :meth:`unscale_` or
        :meth:`step`, before :meth:`update`)."""
        return self._check_of(optimizer).found_inf

    def found_inf_locally(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this rank's own gradients held an inf or NaN (same window as
        :meth:`found_inf`)."""
        return self._check_of(optimizer).found_inf_locally

    def _check_of(self, optimizer: torch.optim.Optimizer) -> _Check:
        check = self._checks.get(id(optimizer))
        if check is None or check.stage is OptState.READY:
            raise RuntimeError("no inf/NaN check for this optimizer in this step: call "
                               "unscale_(optimizer) or step(optimizer) first.")
        return check

    def state_dict(self) -> dict[str, float | int]:
        """The scale and its schedule, under ``torch.amp.GradScaler``'s keys."""
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, float | int]) -> None:
        """Resume from :meth:`state_dict` (also one saved by ``torch.amp.GradScaler``)."""
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker"} - set(state_dict)
        if missing:
            raise RuntimeError(f"the scaler's state_dict lacks {sorted(missing)}: it must "
                               "come from GradScaler.state_dict().")
        _check_scale(float(state_dict["scale"]), "state_dict['scale']")
        _check_interval(int(state_dict["growth_interval"]))
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])

    def _agree(self, flag: torch.Tensor) -> torch.Tensor:
        """Whether to skip, from this rank's flag (1 element, 1.0 = found): this rank's own
        answer, without asking the others."""
        return flag


class ShardedGradScaler(LocalGradScaler):
    """:class:`LocalGradScaler` for sharded gradients (ZeRO-2, FSDP), with the names of
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``.

    Each rank holds and checks only its shard of the gradient, so an inf that one rank's
    backward produced lands, after the reduce-scatter, in the shard of whichever rank owns
    that element, and only that rank sees it. If that rank skipped while the others stepped,
    the ranks' shards would no longer be one model's parameters (part updated, part not),
    and the scales would differ from then on, so the next reduce-scatters would add
    gradients scaled by different factors. :meth:`unscale_` therefore ends with ONE
    all-reduce (MAX) of a one-element flag over ``process_group``: an inf or NaN found in any
    rank's shard makes every rank skip the step and back the scale off, together.

    Cost: one all-reduce of 4 bytes (an fp32 flag) per optimizer and step; latency, not
    bandwidth. Every rank of the group must call :meth:`unscale_` (or :meth:`step`), in the
    same order. Without an initialised process group (one process) nothing is sent.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval)
        self.process_group = process_group

    def _agree(self, flag: torch.Tensor) -> torch.Tensor:
        """The MAX over ranks of the flags: 1.0 when any rank found an inf or NaN."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return flag


def _check_scale(value: object, name: str) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number (e.g. 2.**16), "
                         f"got {value!r}.")


def _check_interval(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"growth_interval must be a positive int (steps without inf/NaN "
                         f"before the scale grows), got {value!r}.")
