"""``python -m labs.bench claims``: how sure the book's timing claims are.

A chapter's timing claim (:class:`labs.claims.Claim`) is decided by one run: its median and
spread against a threshold. Whether another run, on another day or a busier machine, would
decide it the same way, one run cannot say. This re-runs each timing claim's experiment
``--repeats`` times, quiet and with ``--busy`` CPU burners beside it (processes that only
spin), and prints, for each claim, how often it came out as the chapter's text needs. A claim
that holds in fewer than 9 of 10 quiet runs needs a larger effect (more steps, a slower link,
a bigger model) or goes.

The experiments run with the chapters' own settings (:data:`EXPERIMENTS`); a test holds those
against the chapters' sources.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from labs.claims import Claim, Outcome
from labs.experiments import cost_fit, link_sweep
from labs.experiments.scaling import crossover_experiment
from labs.link import Link
from labs.models import StepSettings
from labs.tables import format_table

#: Chapter 2's sweep on its link ("What an all-reduce costs": ``settings``).
CHAPTER2_SWEEP = link_sweep.LinkSweepSettings(skip_beyond=5)
#: Chapter 5's link and model ("On a network with a cost of its own": ``LINK`` and ``WIDE``).
CHAPTER5_LINK = Link(alpha=2.5e-3, bandwidth=125e6)
CHAPTER5_WIDE = StepSettings(width=512, layers=8, batch=384, steps=5, warmup=1,
                             bucket_cap_mb=2.0)


@dataclass(frozen=True)
class TimingExperiment:
    """An experiment of a chapter that decides timing claims: ``run()`` measures and returns
    them, as the chapter's cells do."""

    name: str
    chapter: str
    run: Callable[[], Sequence[Claim]]


def _chapter2_floor() -> Sequence[Claim]:
    return link_sweep.floor_claims(link_sweep.measure_floor(), CHAPTER2_SWEEP.link)


def _chapter2_sweep() -> Sequence[Claim]:
    timings = link_sweep.measure_on_link(CHAPTER2_SWEEP)
    return (*link_sweep.sweep_claims(timings),
            link_sweep.crossover_claim(timings, CHAPTER2_SWEEP)[1])


def _chapter2_loopback() -> Sequence[Claim]:
    return cost_fit.loopback_claims(cost_fit.loopback_experiment()[2])


EXPERIMENTS: tuple[TimingExperiment, ...] = (
    TimingExperiment("ch2.floor", "02_cost_model", _chapter2_floor),
    TimingExperiment("ch2.link-sweep", "02_cost_model", _chapter2_sweep),
    TimingExperiment("ch2.loopback", "02_cost_model", _chapter2_loopback),
    TimingExperiment("ch5.crossover", "05_ddp",
                     lambda: crossover_experiment(CHAPTER5_WIDE, CHAPTER5_LINK)),
)


@dataclass
class Tally:
    """How one claim came out over the repeats of one condition."""

    needs: Outcome | None
    outcomes: Counter[Outcome]
    medians: list[float]

    @property
    def as_needed(self) -> int:
        if self.needs is None:
            return sum(self.outcomes.values())
        return self.outcomes[self.needs]


def tally(experiment: TimingExperiment, repeats: int, busy: int = 0) -> dict[str, Tally]:
    """Run ``experiment`` ``repeats`` times with ``busy`` burners spinning meanwhile."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(busy)]
    found: dict[str, Tally] = {}
    try:
        for _ in range(repeats):
            for claim in experiment.run():
                t = found.setdefault(claim.name, Tally(claim.needs, Counter(), []))
                t.outcomes[claim.outcome] += 1
                t.medians.append(claim.estimate.median)
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    return found


def claims_table(results: dict[str, dict[int, dict[str, Tally]]], repeats: int) -> str:
    """One row per claim: what the text needs, then per condition how often it came out so,
    and the range of its medians."""
    rows = []
    for per_busy in results.values():
        names = next(iter(per_busy.values())).keys()
        for name in names:
            row: list[object] = [name]
            needs = next(iter(per_busy.values()))[name].needs
            row.append("any" if needs is None else needs.value)
            for tallies in per_busy.values():
                t = tallies[name]
                counts = ", ".join(f"{o.value} {k}" for o, k in t.outcomes.most_common())
                row.append(f"{t.as_needed}/{repeats} ({counts}); "
                           f"median {min(t.medians):.3g}-{max(t.medians):.3g}")
            rows.append(row)
    conditions = next(iter(results.values())).keys() if results else []
    return format_table(["claim", "text needs",
                         *(f"{'quiet' if b == 0 else f'{b} burners'}: as needed"
                           for b in conditions)], rows)


def add_claims_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("claims", help="how often each timing claim comes out as its text needs")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2],
                   help="CPU burners beside each condition (0: quiet)")
    p.add_argument("--only", nargs="+", default=None,
                   choices=[e.name for e in EXPERIMENTS], help="experiments to run")


def claims_main(opts: argparse.Namespace) -> None:
    if opts.repeats < 1 or any(b < 0 for b in opts.busy):
        raise SystemExit("--repeats must be >= 1 and --busy >= 0.")
    chosen = [e for e in EXPERIMENTS if opts.only is None or e.name in opts.only]
    results = {e.name: {busy: tally(e, opts.repeats, busy) for busy in opts.busy}
               for e in chosen}
    print(claims_table(results, opts.repeats))
