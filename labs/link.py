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

``launch(fn, N, link=Topology(node_size=2, intra=Link(...), inter=Link(...)))`` makes two kinds
of wire (chapter 8): rank r sits on node ``r // node_size``; a message between two ranks of one
node pays ``intra`` (NVLink), one between nodes ``inter`` (the network). The port model is the
same, with **separate ports per link kind**: each rank has an outgoing and an incoming port on
its node's fabric and another pair on its own network card. That is how a GPU server is built
for this kind of work (a DGX has one NIC per GPU, beside its NVLink ports), and it is what lets
the hierarchical all-reduce run its g cross-node rings at once without them queueing behind one
another: one rank's inter-node traffic never waits for its intra-node traffic, or another
rank's. The receiver knows which link a message used from the sender's global rank, which it
already needs to post the receive; the header is the same as Link's.

The book's experiments on a link (and those that time gloo's own transport) compute on the
CPU on every machine: they launch with ``device="cpu"``. Their sizes are chosen so that a
layer's compute on two CPU cores takes about as long as a message on the link, which is what
there is to overlap; on a GPU the compute would shrink a hundredfold and the overlap with it,
and the model beside each run prices the compute it measured on the CPU. A launch on a link
without ``device="cpu"`` follows :func:`labs.launch`'s one rule: on a machine with a GPU its
ranks share it, their messages staged through host memory (:mod:`labs.staging`).
"""

from __future__ import annotations

import enum
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


class LinkKind(enum.Enum):
    """Which wire of a :class:`Topology` a message goes over."""

    #: Between two ranks of one node (NVLink, in a GPU server): fast.
    INTRA = "intra-node"
    #: Between two nodes (InfiniBand or Ethernet, through each rank's own NIC): slow.
    INTER = "inter-node"


@dataclass(frozen=True)
class Topology:
    """Nodes of ``node_size`` ranks: rank r is on node ``r // node_size``. A message between
    two ranks of one node pays ``intra``, between nodes ``inter``; each rank has separate
    ports per link kind (see the module docstring). Pass it to :func:`labs.launch` as
    ``link=``; the world size must be a multiple of ``node_size``."""

    node_size: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int) \
                or self.node_size < 1:
            raise ValueError(f"Topology node_size must be an int >= 1 (ranks per node), got "
                             f"{self.node_size!r}; e.g. Topology(node_size=2, intra=Link(...), "
                             "inter=Link(...)).")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise TypeError(f"Topology {name} must be a labs.Link, got "
                                f"{type(getattr(self, name)).__name__}; e.g. "
                                f"{name}=Link(alpha=1e-3, bandwidth=100e6).")

    def node(self, rank: int) -> int:
        """The node global rank ``rank`` is on."""
        return rank // self.node_size

    def kind(self, src: int, dst: int) -> LinkKind:
        """The wire a message from global rank ``src`` to ``dst`` goes over."""
        return LinkKind.INTRA if self.node(src) == self.node(dst) else LinkKind.INTER

    def link(self, src: int, dst: int) -> Link:
        """The :class:`Link` a message from global rank ``src`` to ``dst`` pays."""
        return self.intra if self.kind(src, dst) is LinkKind.INTRA else self.inter

    def nodes(self, world_size: int) -> int:
        """How many nodes ``world_size`` ranks fill (checked: see :meth:`check`)."""
        self.check(world_size)
        return world_size // self.node_size

    def check(self, world_size: int) -> None:
        """Refuse a world size that does not fill whole nodes."""
        if world_size % self.node_size:
            raise ValueError(
                f"world_size={world_size} does not fill whole nodes of node_size="
                f"{self.node_size}: use a world size that is a multiple of {self.node_size} "
                f"(e.g. {self.node_size * max(1, round(world_size / self.node_size))}), or a "
                "node_size that divides the world size.")


@dataclass
class _Port:
    """One pair of a rank's ports: when each is free again (monotonic clock)."""

    out_free: float = 0.0
    in_free: float = 0.0


@dataclass
class _Ports:
    """This rank's ports: one pair on a :class:`Link`, one pair per :class:`LinkKind` on a
    :class:`Topology`."""

    link: Link | Topology
    rank: int
    pairs: dict[LinkKind, _Port]

    def wire(self, peer: int | None) -> tuple[Link, _Port]:
        """The link a message to or from global rank ``peer`` pays, and the port pair it uses."""
        if isinstance(self.link, Link):
            return self.link, self.pairs[LinkKind.INTRA]
        if peer is None:
            raise RuntimeError(
                "on a labs.Topology a message must name its peer's global rank (to know which "
                "link it pays); this send or receive did not. Messages of labs.p2p.Peers do: "
                "send through them.")
        kind = self.link.kind(self.rank, peer)
        return self.link.link(self.rank, peer), self.pairs[kind]


_PORTS: _Ports | None = None


def use(link: Link | Topology | None, rank: int = 0) -> None:
    """Put this process's point-to-point messages on ``link`` (None: the real transport);
    ``rank`` is this process's global rank (a :class:`Topology` needs it). The launcher calls
    it in every rank before the worker runs."""
    global _PORTS
    _PORTS = None if link is None else _Ports(link, rank, {k: _Port() for k in LinkKind})


def active() -> Link | Topology | None:
    """The link (or topology) this process's messages go over, or None for the real
    transport."""
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

    def __init__(self, work: Work, wire: torch.Tensor, tensor: torch.Tensor,
                 peer: int | None) -> None:
        self._work, self._wire, self._tensor, self._peer = work, wire, tensor, peer
        self._done = False

    def wait(self) -> bool:
        if self._done:
            return True
        self._work.wait()
        assert _PORTS is not None
        left, nbytes = self._wire[:_HEADER].view(torch.float64).tolist()
        wire, port = _PORTS.wire(self._peer)
        start = max(left + wire.alpha, port.in_free)
        port.in_free = start + nbytes / wire.bandwidth
        payload = self._wire[_HEADER:].view(self._tensor.dtype).view(self._tensor.shape)
        self._tensor.copy_(payload)
        _sleep_until(port.in_free)
        self._done = True
        return True


def send(post: Callable[[torch.Tensor], Work], tensor: torch.Tensor,
         peer: int | None = None) -> _Sent:
    """Send ``tensor`` on the link to global rank ``peer`` (needed on a :class:`Topology`):
    ``post(wire)`` sends the wire tensor (header + bytes) over the real transport."""
    assert _PORTS is not None
    wire_link, port = _PORTS.wire(peer)
    nbytes = tensor.numel() * tensor.element_size()
    leaves = max(time.monotonic(), port.out_free)
    port.out_free = leaves + nbytes / wire_link.bandwidth
    header = torch.tensor([leaves, float(nbytes)], dtype=torch.float64).view(torch.uint8)
    wire = torch.cat([header, tensor.detach().reshape(-1).view(torch.uint8)])
    return _Sent(post(wire), port.out_free, wire)


def recv(post: Callable[[torch.Tensor], Work], tensor: torch.Tensor,
         peer: int | None = None) -> _Received:
    """Receive into ``tensor`` from global rank ``peer`` (needed on a :class:`Topology`):
    ``post(wire)`` receives the wire tensor."""
    wire = torch.empty(_HEADER + tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    return _Received(post(wire), wire, tensor, peer)
