"""An emulated network: real ranks and real data, over a wire whose cost is known.

``launch(fn, N, link=Link(alpha=1e-3, bandwidth=100e6))`` makes every message that labs'
point-to-point layer sends (the from-scratch collectives of :mod:`labs.collectives`; torch's
built-in collectives are not affected) cost what the latency-bandwidth model says:

* each rank has one outgoing and one incoming port. A message of n bytes occupies the
  sender's outgoing port and then the receiver's incoming port for ``n / bandwidth`` seconds
  each; a port serves one message at a time, in the order the messages were posted;
* a message reaches the receiver's port ``alpha`` seconds after it starts leaving the
  sender's, so one message alone takes ``alpha + n / bandwidth``.

The data itself goes over the real transport at once, with the time it started leaving in a
16-byte header; the receiver's ``wait()`` then sleeps until the model says the last byte
arrived, and the sender's ``wait()`` until its port is free again. Waiting is sleeping, not
spinning, so ranks that share cores do not slow each other down; the real transport's own
cost is hidden as long as it stays below the modelled one. Ports are timed on the machine's
monotonic clock, which every process of one machine shares: the emulation is for ranks on one
machine (gloo; :func:`labs.launch` refuses it on nccl).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import Work

#: The header in front of every emulated message: when it started leaving (float64), and its
#: payload's byte count (float64), 16 bytes so that any dtype's payload after it is aligned.
_HEADER = 16


@dataclass(frozen=True)
class Link:
    """A wire of latency ``alpha`` seconds and ``bandwidth`` bytes per second, for every pair
    of ranks; pass it to :func:`labs.launch` as ``link=``."""

    alpha: float
    bandwidth: float

    def __post_init__(self) -> None:
        for name, low in (("alpha", 0.0), ("bandwidth", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0 or (low is None and value == 0):
                raise ValueError(f"Link {name} must be a finite number "
                                 f"{'>= 0 (seconds)' if low == 0.0 else '> 0 (bytes per second)'}"
                                 f", got {value!r}; e.g. Link(alpha=1e-3, bandwidth=100e6).")

    def seconds(self, nbytes: int) -> float:
        """What one message of ``nbytes`` costs alone: ``alpha + nbytes / bandwidth``."""
        return self.alpha + nbytes / self.bandwidth


@dataclass
class _Ports:
    """This rank's two ports: when each is free again (monotonic clock)."""

    link: Link
    out_free: float = 0.0
    in_free: float = 0.0


_PORTS: _Ports | None = None


def use(link: Link | None) -> None:
    """Put this process's point-to-point messages on ``link`` (None: the real transport).
    The launcher calls it in every rank before the worker runs."""
    global _PORTS
    _PORTS = None if link is None else _Ports(link)


def active() -> Link | None:
    """The link this process's messages go over, or None for the real transport."""
    return None if _PORTS is None else _PORTS.link


def _sleep_until(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class _Sent:
    """The sender's side: done when the real send is, and the outgoing port is free."""

    def __init__(self, work: Work, free_at: float, keep: torch.Tensor) -> None:
        self._work, self._free_at, self._keep = work, free_at, keep

    def wait(self) -> bool:
        self._work.wait()
        _sleep_until(self._free_at)
        return True


class _Received:
    """The receiver's side: done when the data is in ``tensor`` and the model says the last
    byte has arrived through this rank's incoming port."""

    def __init__(self, work: Work, wire: torch.Tensor, tensor: torch.Tensor) -> None:
        self._work, self._wire, self._tensor = work, wire, tensor
        self._done = False

    def wait(self) -> bool:
        if self._done:
            return True
        self._work.wait()
        assert _PORTS is not None
        left, nbytes = self._wire[:_HEADER].view(torch.float64).tolist()
        ports = _PORTS
        start = max(left + ports.link.alpha, ports.in_free)
        ports.in_free = start + nbytes / ports.link.bandwidth
        payload = self._wire[_HEADER:].view(self._tensor.dtype).view(self._tensor.shape)
        self._tensor.copy_(payload)
        _sleep_until(ports.in_free)
        self._done = True
        return True


def send(post: Callable[[torch.Tensor], Work], tensor: torch.Tensor) -> _Sent:
    """Send ``tensor`` on the link: ``post(wire)`` sends the wire tensor (header + bytes) over
    the real transport."""
    assert _PORTS is not None
    ports, nbytes = _PORTS, tensor.numel() * tensor.element_size()
    leaves = max(time.monotonic(), ports.out_free)
    ports.out_free = leaves + nbytes / ports.link.bandwidth
    header = torch.tensor([leaves, float(nbytes)], dtype=torch.float64).view(torch.uint8)
    wire = torch.cat([header, tensor.detach().reshape(-1).view(torch.uint8)])
    return _Sent(post(wire), ports.out_free, wire)


def recv(post: Callable[[torch.Tensor], Work], tensor: torch.Tensor) -> _Received:
    """Receive into ``tensor`` from the link: ``post(wire)`` receives the wire tensor."""
    wire = torch.empty(_HEADER + tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    return _Received(post(wire), wire, tensor)
