"""Plain text tables: fixed width and deterministic, so that nbval can compare them and a
terminal (``python -m labs ...``) prints them as the notebook does. No matplotlib here, so
ranks and command-line tools can import it cheaply.

:func:`format_table` is the one formatter; the functions after it lay out the records of
chapters 1 and 2 with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

from labs.p2p import Phase

if TYPE_CHECKING:
    from labs.p2p import RingStep
    from labs.toy_allreduce import ToyRankRecord


# The rows chapter 2's experiments measure (labs.experiments.collectives' TrafficRow and
# AgreementRow), described by what the tables read: the library does not import the machinery.
class _Named(Protocol):
    value: str


class _Counts(Protocol):
    messages_sent: int
    sent: Fraction
    received: Fraction
    group_messages: int


class _TrafficRow(Protocol):
    world_size: int
    algorithm: _Named
    measured: _Counts
    expected: _Counts

    @property
    def matches(self) -> bool: ...


class _AgreementRow(Protocol):
    world_size: int
    algorithm: _Named
    differing: int
    error: float
    from_torch: float


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A fixed-width text table; floats are written with 9 significant digits (float32)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: object) -> str:
    return f"{value:.9g}" if isinstance(value, float) else str(value)


def toy_table(records: Sequence[ToyRankRecord]) -> str:
    """Per-rank values before and after the all-reduce and the SGD step."""
    header = ["rank", "grad before", "after all_reduce (sum)", "/ world size", "param before",
              "param after", "param bits"]
    rows = [
        [r.rank, r.local_grad, r.summed, r.averaged, r.param_before, r.param_after,
         r.param_after_bits]
        for r in records
    ]
    return format_table(header, rows)



# --- chapter 2: traces and traffic ---------------------------------------------------------


def values_text(values: Sequence[float], sep: str = " ") -> str:
    """A chunk's values as short numbers (``-`` for an empty chunk)."""
    return sep.join(f"{v:g}" for v in values) if values else "-"


def ring_trace_table(steps: Sequence[RingStep]) -> str:
    """One row per phase and step, one column per rank: ``sent 3, got 2 = 5005 6006`` is the
    chunk the rank sent right, the chunk that arrived from the left, and that chunk after the
    rank combined it (reduce-scatter: added its own part; all-gather: stored it). Steps are
    numbered from 0 within each phase."""
    world_size = 1 + max((s.rank for s in steps), default=0)
    cells = {(s.phase, s.step, s.rank): s for s in steps}
    rows = []
    for phase in Phase:
        for step in sorted({s.step for s in steps if s.phase is phase}):
            row: list[object] = [phase.value, step]
            for rank in range(world_size):
                s = cells.get((phase, step, rank))
                row.append("" if s is None else
                           f"sent {s.sent_chunk}, got {s.received_chunk} = "
                           f"{values_text(s.chunk_after)}")
            rows.append(row)
    return format_table(["phase", "step", *(f"rank {r}" for r in range(world_size))], rows)


def _fraction_text(value: Fraction) -> str:
    return str(value)  # 3, 3/2, 7/4: exact, so the table is deterministic


def traffic_table(rows: Sequence[_TrafficRow]) -> str:
    """Measured traffic beside its closed form, per world size and algorithm: messages and
    bytes (in multiples of S) sent and received by the busiest rank (for the naive algorithm,
    the root), and messages sent by the whole group."""
    header = ["N", "algorithm", "msgs sent", "formula", "sent / S", "formula",
              "received / S", "formula", "group msgs", "formula", "match"]
    body = [
        [r.world_size, r.algorithm.value,
         r.measured.messages_sent, r.expected.messages_sent,
         _fraction_text(r.measured.sent), _fraction_text(r.expected.sent),
         _fraction_text(r.measured.received), _fraction_text(r.expected.received),
         r.measured.group_messages, r.expected.group_messages,
         "yes" if r.matches else "NO"]
        for r in rows
    ]
    return format_table(header, body)


def agreement_table(rows: Sequence[_AgreementRow]) -> str:
    """Per world size and algorithm: at how many elements the ranks' bits differ, the largest
    error against the exact (float64) sum, and the largest difference from torch's result."""
    header = ["N", "algorithm", "elements where ranks differ", "max |error|",
              "max |result - torch|"]
    body = [
        [r.world_size, r.algorithm.value, r.differing, f"{r.error:.2e}", f"{r.from_torch:.2e}"]
        for r in rows
    ]
    return format_table(header, body)


def by_algorithm_and_size(rows: Sequence[_TrafficRow] | Sequence[_AgreementRow],
                          value: Callable[[object], object], corner: str = "algorithm") -> str:
    """A matrix of ``rows``: one row per algorithm, one column per world size N, each cell
    ``value(row)``; a table of every (N, algorithm) pair that fits on a screen."""
    sizes = sorted({r.world_size for r in rows})
    algorithms = list(dict.fromkeys(r.algorithm.value for r in rows))
    cell = {(r.algorithm.value, r.world_size): value(r) for r in rows}
    return format_table([corner, *(f"N = {n}" for n in sizes)],
                        [[a, *(cell.get((a, n), "") for n in sizes)] for a in algorithms])


def traffic_summary(rows: Sequence[_TrafficRow]) -> str:
    """What the busiest rank sends (bytes as a multiple of S, then messages) per algorithm and
    N, and whether every count, sent, received and the group's, equals its closed form."""
    sent = by_algorithm_and_size(
        rows, lambda r: _fraction_text(r.measured.sent), "bytes sent / S")  # type: ignore[attr-defined]
    messages = by_algorithm_and_size(
        rows, lambda r: r.measured.messages_sent, "messages sent")  # type: ignore[attr-defined]
    wrong = [f"N = {r.world_size} {r.algorithm.value}" for r in rows if not r.matches]
    verdict = (f"every count of the {len(rows)} cases equals its closed form (messages and "
               f"bytes sent and received by the busiest rank, messages of the whole group)"
               if not wrong else f"counts that differ from their closed form: {', '.join(wrong)}")
    return f"{sent}\n\n{messages}\n\n{verdict}"
