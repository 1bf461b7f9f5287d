"""Host staging: how ranks that share a GPU under gloo move CUDA tensors.

nccl refuses two ranks on one GPU, so N ranks on a one-GPU box run on gloo. gloo's own
collectives (all-reduce, broadcast, all-gather of a list) accept CUDA tensors and copy them
through host memory themselves; its ``send``/``recv`` do not: they hand the tensor's pointer
to the socket as if it were host memory, and the kernel refuses a device address ("writev
...: Bad address", measured on one GPU with two gloo ranks). So labs' point-to-point layer
(:class:`labs.p2p.Peers`) and FSDP's tensor collectives stage a CUDA tensor here: a send copies
it into a pinned host buffer first (:func:`to_host`), a receive lands in one
(:func:`host_buffer`) and is copied to the device when it is waited for (:class:`Landing`).
Per message that is one device-to-host or host-to-device copy of its bytes, at the PCIe
bandwidth, on top of the socket.

:func:`needed` says when: a tensor not on the CPU that a gloo group carries, or every tensor
when the launch asked for ``host_staging`` (so that the path runs, and is tested, on a machine
without a GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes  # torch >= 2.0

from labs.launch_inputs import STAGING_VARIABLE


def backend_for_device(backend: str, device_type: str) -> str:
    """Which backend of ``backend`` (as ``dist.get_backend`` names it) carries tensors of
    ``device_type``: a group has one backend ("gloo") or one per device type
    ("cpu:gloo,cuda:nccl"). A device type the string does not name gets the string back."""
    if ":" not in backend:
        return backend
    per_device = dict(part.split(":", 1) for part in backend.split(","))
    return per_device.get(device_type, backend)


def forced() -> bool:
    """Whether this rank stages every tensor, CPU ones too (``launch(host_staging=True)``)."""
    return os.environ.get(STAGING_VARIABLE) == "1"


def needed(tensor: torch.Tensor, backend: str) -> bool:
    """Whether ``tensor`` goes through host memory on a group of ``backend``."""
    kind = tensor.device.type
    return (kind != "cpu" and backend_for_device(backend, kind) == "gloo") or forced()


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor of ``like``'s shape and dtype: pinned (page-locked) when
    ``like`` is on a GPU, so that the copy between them is one DMA transfer.

    Made with the dispatch modes set aside: the buffer is the transport's, as gloo's and
    NCCL's own buffers are, so :class:`labs.memory.AllocationTracker` (a dispatch mode) does
    not count it, and a memory timeline of ranks sharing a GPU is the CPU run's."""
    with _disable_current_modes():
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``, complete on return: the copy waits for the kernels that
    produce ``tensor`` (a blocking copy on the current stream)."""
    host = host_buffer(tensor)
    host.copy_(tensor)
    return host


class Landing:
    """A receive (or a collective's output) that lands in a host buffer: :meth:`wait` waits
    for the message, then copies it into the tensor it was meant for. Holds the staged
    inputs too, so that they live until the work that reads them is done."""

    def __init__(self, work: Any, host: torch.Tensor, tensor: torch.Tensor,
                 keep: torch.Tensor | None = None) -> None:
        self.work, self.host, self.tensor, self.keep = work, host, tensor, keep

    def wait(self, timeout: Any = None) -> bool:
        """Wait for the work, then copy the landed bytes to the tensor (once)."""
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        if self.host is not None:
            self.tensor.copy_(self.host)
            self.host = self.keep = None
        return True

    def is_completed(self) -> bool:
        """Whether the message has arrived (it is copied at :meth:`wait`)."""
        return bool(self.work.is_completed())


def staged(collective: Callable[..., Any], out: torch.Tensor, tensor: torch.Tensor,
           **kwargs: Any) -> Any:
    """``collective(out, tensor, **kwargs)`` (torch's all-gather or reduce-scatter into a
    tensor, or all-to-all), on host copies: ``tensor`` copied to a pinned buffer, the result
    landing in another. With ``async_op=True`` the copy to ``out`` happens when the returned
    :class:`Landing` is waited for; otherwise before this returns."""
    host_in, host_out = to_host(tensor), host_buffer(out)
    work = collective(host_out, host_in, **kwargs)
    if work is not None:  # async_op=True: the caller waits
        return Landing(work, host_out, out, keep=host_in)
    out.copy_(host_out)
    return None
