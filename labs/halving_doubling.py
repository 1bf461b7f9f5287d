"""Rabenseifner's all-reduce: a reduce-scatter by recursive halving, then an all-gather by
recursive doubling.

Chapter 2. The ring sends the fewest bytes, 2(N-1)/N·S per rank, but in 2(N-1) steps, each
with its message latency; recursive doubling needs only log2 N steps but sends the whole
tensor in each, log2(N)·S. Halving-doubling has both bounds at once for N a power of two:
2·log2 N steps and 2(N-1)/N·S bytes (Thakur, Rabenseifner and Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005, section 4.3).

* **Reduce-scatter by recursive halving.** In round j (j = 0..log2 N - 1) rank r pairs with
  r XOR N/2^(j+1). The two hold the same range of chunks; each keeps the half whose chunk
  indices have r's bit there (the lower half if the bit is 0), sends the other half to its
  partner and adds the half it receives into the one it keeps. The range halves every round:
  S/2 is sent in the first, S/4 in the second, ..., S/N in the last, (N-1)/N·S in all, and rank
  r ends with chunk r summed over every rank.
* **All-gather by recursive doubling**, the same rounds backwards: in each the partners swap
  the ranges they hold, which doubles them, S/N first and S/2 last.

Chunks are cut by :func:`labs.torch_collectives.shard_bounds` over the P ranks that take part,
so any numel works (some chunks may be empty). When N is not a power of two (P the largest
power of two below N, R = N - P), ranks 0..2R-1 pair up first as in recursive doubling: each
even one sends its whole tensor to the odd one after it and waits; the P remaining ranks run
the rounds above as virtual ranks 0..P-1; then each odd one sends the result back. That adds
two message latencies and S to the critical path, as recursive doubling's fold does.

Every chunk is summed on one rank, its owner, and copied to the others, so every rank ends
with the same bits, as with the ring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup, ReduceOp

from labs.p2p import Peers, Recorder
from labs.torch_collectives import check_tensor_and_op, finish, in_place, shard_bounds


def halving_doubling_all_reduce(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
    *, recorder: Recorder | None = None,
) -> torch.Tensor:
    """All-reduce in place by recursive halving (reduce-scatter) then recursive doubling
    (all-gather): 2·log2 N messages and 2(N-1)/N·S bytes per rank for N a power of two; two
    messages and S more on the critical path otherwise (see the module docstring)."""
    check_tensor_and_op(tensor, op)
    peers = Peers.of(group, recorder, tensor)

    def body(flat: torch.Tensor) -> None:
        n, r = peers.size, peers.rank
        if n == 1 or flat.numel() == 0:
            return
        power = 1 << (n.bit_length() - 1)
        extra = n - power
        if r < 2 * extra and r % 2 == 0:  # folded: hand my tensor to r+1, wait for the result
            peers.isend(flat, r + 1).wait()
            peers.irecv(flat, r + 1).wait()
            finish(flat, op, n)
            return
        if r < 2 * extra:  # odd: fold in the even rank before me
            incoming = torch.empty_like(flat)
            peers.irecv(incoming, r - 1).wait()
            flat.add_(incoming)
        virtual = r // 2 if r < 2 * extra else r - extra  # 0..P-1

        def real(v: int) -> int:
            return 2 * v + 1 if v < extra else v + extra

        _halve_then_double(peers, flat, virtual, power, real)
        if r < 2 * extra:
            peers.isend(flat, r - 1).wait()
        finish(flat, op, n)

    return in_place(tensor, body)


def _halve_then_double(peers: Peers, flat: torch.Tensor, virtual: int, power: int,
                       real: Callable[[int], int]) -> None:
    """The rounds among the P = ``power`` virtual ranks; ``real(v)`` is v's group rank."""
    bounds = shard_bounds(flat.numel(), power)
    # The largest half ever received: the lower half of the first round (chunks are cut
    # longest first, so it is at least as long as the upper half).
    incoming = torch.empty(bounds[power // 2], dtype=flat.dtype, device=flat.device)
    low, high = 0, power  # the chunks this rank holds
    kept: list[tuple[int, int, int]] = []  # (distance, low, high) before each halving
    distance = power // 2
    while distance:
        partner = real(virtual ^ distance)
        middle = (low + high) // 2
        mine, theirs = ((low, middle), (middle, high)) if virtual & distance == 0 else (
            (middle, high), (low, middle))
        keep = flat[bounds[mine[0]]:bounds[mine[1]]]
        give = flat[bounds[theirs[0]]:bounds[theirs[1]]]
        arriving = incoming[:keep.numel()]
        peers.exchange(give, partner, arriving, partner)
        keep.add_(arriving)  # a + b == b + a: the owner's order of additions is fixed
        kept.append((distance, low, high))
        low, high = mine
        distance //= 2
    for distance, outer_low, outer_high in reversed(kept):  # double back, swapping ranges
        partner = real(virtual ^ distance)
        middle = (outer_low + outer_high) // 2
        other = (middle, outer_high) if low == outer_low else (outer_low, middle)
        peers.exchange(flat[bounds[low]:bounds[high]], partner,
                       flat[bounds[other[0]]:bounds[other[1]]], partner)
        low, high = outer_low, outer_high
