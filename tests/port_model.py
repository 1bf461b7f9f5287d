"""The port model of labs.link, message by message, written apart from labs: the tests of the
closed forms (test_link_model, test_double_tree) run each algorithm's schedule through it."""

from __future__ import annotations

from labs.link import Link


class Ports:
    """Every rank's outgoing and incoming port on one ``link``: a port carries one message at a
    time, a message reaches its receiver's port ``alpha`` after it started leaving."""

    def __init__(self, n: int, link: Link) -> None:
        self.link, self.out_free, self.in_free = link, [0.0] * n, [0.0] * n

    def send(self, rank: int, at: float, nbytes: float) -> float:
        """Posts a message at ``at``; returns when it starts leaving."""
        leaves = max(at, self.out_free[rank])
        self.out_free[rank] = leaves + nbytes / self.link.bandwidth
        return leaves

    def receive(self, rank: int, leaves: float, nbytes: float) -> float:
        """Waits for a message that started leaving at ``leaves``; returns when it is in."""
        start = max(leaves + self.link.alpha, self.in_free[rank])
        self.in_free[rank] = start + nbytes / self.link.bandwidth
        return self.in_free[rank]
