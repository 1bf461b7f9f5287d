"""What a chapter says about a run, decided by the run and shown as Markdown.

A sentence such as "the ring is faster than the naive all-reduce at 8 ranks" is a measured
statement. Typed into a chapter by hand it goes stale at the next execution; here it is a
:class:`Claim`:

* the quantity it reads, an :class:`Estimate`: the median of repeated measurements and their
  spread (the interquartile range: the middle half of the repeats), or one exact value for a
  count;
* a threshold and the side of it that the statement asserts (:class:`Side`);
* one sentence for each :class:`Outcome`: the statement held (the whole spread lies on its
  side of the threshold), the opposite held (the whole spread lies on the other side), or the
  run cannot tell (the threshold falls inside the spread; the sentence says so and picks no
  side).

A claim displays itself as Markdown (its sentence, then its margin: median, spread, repeats and
threshold), which JupyterLab, Jupyter Notebook and the rendered book all show the same way.
:func:`say` puts claims and numbers into one paragraph. Each display also carries the claims'
names and outcomes as JSON in its metadata (:data:`MIME_TYPE`), which tests read from the
stored notebooks: a
chapter whose text builds on a claim that came out otherwise fails there (``needs``).

Timing claims are only as sure as their repeats: ``python -m labs.bench claims`` runs each
chapter's timing experiments several times, quiet and with the cores loaded, and counts how
often each claim came out as the chapter needs.
"""

from __future__ import annotations

import enum
import json
import statistics
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The key under which a display's metadata lists its claims (name, outcome, numbers).
MIME_TYPE = "application/vnd.labs.claims+json"


class Outcome(enum.Enum):
    """How a claim came out against its threshold."""

    HELD = "held"
    """The whole spread lies on the side of the threshold that the claim asserts."""
    OPPOSITE = "opposite"
    """The whole spread lies on the other side: the run says the opposite."""
    UNSURE = "unsure"
    """The threshold falls inside the spread: this run cannot tell."""


class Side(enum.Enum):
    """Which side of its threshold a claim asserts the quantity lies on."""

    ABOVE = "above"
    """The claim is that the quantity exceeds the threshold."""
    BELOW = "below"
    """The claim is that the quantity stays under the threshold."""


@dataclass(frozen=True)
class Estimate:
    """A measured quantity: the median of its repeats and the spread ``low`` .. ``high``
    (their interquartile range; all of them when there are fewer than four). A count or a
    closed form is an estimate with no spread (``low == median == high``, one repeat)."""

    median: float
    low: float
    high: float
    repeats: int
    unit: str = ""
    #: What ``repeats`` counts ("repeats", or "cases" for :meth:`span`), and whether ``low``
    #: .. ``high`` is every sample (the whole range) rather than the middle half.
    counts: str = "repeats"
    whole: bool = False

    def __post_init__(self) -> None:
        if not self.low <= self.median <= self.high:
            raise ValueError(f"an estimate needs low <= median <= high, got {self.low}, "
                             f"{self.median}, {self.high}.")
        if self.repeats < 1:
            raise ValueError(f"an estimate needs at least one repeat, got {self.repeats}.")

    @classmethod
    def of(cls, samples: Sequence[float], unit: str = "", counts: str = "repeats") -> Estimate:
        """The median and interquartile range of repeated measurements (at least one), or of
        several cases (``counts="cases"``)."""
        values = sorted(float(s) for s in samples)
        if not values:
            raise ValueError("an estimate needs at least one sample: repeat the measurement.")
        if len(values) < 4:
            low, high = values[0], values[-1]
        else:
            low, _, high = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), low, high, len(values), unit, counts)

    @classmethod
    def span(cls, samples: Sequence[float], unit: str = "", counts: str = "cases") -> Estimate:
        """The median and the whole range of several values: for a statement about *every*
        case (each within 15 % of its model, say), which its worst case decides."""
        values = sorted(float(s) for s in samples)
        if not values:
            raise ValueError("an estimate needs at least one sample: repeat the measurement.")
        return cls(statistics.median(values), values[0], values[-1], len(values), unit, counts,
                   whole=True)

    @classmethod
    def exact(cls, value: float, unit: str = "") -> Estimate:
        """A counted or computed value, the same in every run."""
        return cls(float(value), float(value), float(value), 1, unit)

    def over(self, other: Estimate, unit: str = "x") -> Estimate:
        """The ratio ``self / other`` of two independent estimates, its spread from the
        extremes of both spreads (the widest ratio their middle halves allow)."""
        if other.low <= 0:
            raise ValueError(f"a ratio needs a positive denominator, got a spread down to "
                             f"{other.low}.")
        return Estimate(self.median / other.median, self.low / other.high,
                        self.high / other.low, min(self.repeats, other.repeats), unit)

    def plus(self, other: Estimate) -> Estimate:
        """The sum of two independent estimates (a message's time and its addition's, say):
        medians, lows and highs added, so the spread is as wide as both together."""
        if self.unit != other.unit:
            raise ValueError(f"a sum needs one unit, got {self.unit!r} and {other.unit!r}.")
        return Estimate(self.median + other.median, self.low + other.low,
                        self.high + other.high, min(self.repeats, other.repeats), self.unit)

    @property
    def exact_value(self) -> bool:
        return self.low == self.high

    def __format__(self, spec: str) -> str:
        return format(self.median, spec or ".3g")


def _fields(template: str) -> set[str]:
    return {name.split(".")[0].split("[")[0]
            for _, name, _, _ in string.Formatter().parse(template) if name}


@dataclass(frozen=True)
class Claim:
    """A statement about a measured quantity, decided by its estimate.

    ``held``, ``opposite`` and ``unsure`` are the sentences for each :class:`Outcome`, as
    ``str.format`` templates: ``{value}`` is the estimate (its median; ``{value:.2f}`` takes a
    format), ``{low}``, ``{high}``, ``{threshold}`` and ``{repeats}`` what they say, and any
    name in ``values`` its value. ``needs`` is the outcome that the chapter's surrounding text
    builds on (None: the text reads right whatever the outcome)."""

    name: str
    estimate: Estimate
    side: Side
    threshold: float
    held: str
    opposite: str
    unsure: str
    needs: Outcome | None = Outcome.HELD
    values: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a claim's name is an id without spaces (e.g. "
                             f"'ch5.two-ranks-slower'), got {self.name!r}.")
        known = {"value", "low", "high", "threshold", "repeats", "unit", *self.values}
        for outcome, template in ((Outcome.HELD, self.held), (Outcome.OPPOSITE, self.opposite),
                                  (Outcome.UNSURE, self.unsure)):
            unknown = _fields(template) - known
            if unknown:
                raise ValueError(f"claim {self.name!r}: the {outcome.value} sentence names "
                                 f"{sorted(unknown)}, which are not in its values: pass them "
                                 f"as values={{...}}.")

    @classmethod
    def above(cls, name: str, estimate: Estimate, threshold: float, *, held: str,
              opposite: str, unsure: str = "", needs: Outcome | None = Outcome.HELD,
              **values: Any) -> Claim:
        """The claim that ``estimate`` lies above ``threshold``."""
        return cls(name, estimate, Side.ABOVE, float(threshold), held, opposite,
                   unsure or _UNSURE, needs, values)

    @classmethod
    def below(cls, name: str, estimate: Estimate, threshold: float, *, held: str,
              opposite: str, unsure: str = "", needs: Outcome | None = Outcome.HELD,
              **values: Any) -> Claim:
        """The claim that ``estimate`` lies below ``threshold``."""
        return cls(name, estimate, Side.BELOW, float(threshold), held, opposite,
                   unsure or _UNSURE, needs, values)

    @property
    def outcome(self) -> Outcome:
        e, t = self.estimate, self.threshold
        if e.low <= t <= e.high:
            return Outcome.UNSURE
        return Outcome.HELD if (e.low > t) is (self.side is Side.ABOVE) else Outcome.OPPOSITE

    @property
    def sentence(self) -> str:
        template = {Outcome.HELD: self.held, Outcome.OPPOSITE: self.opposite,
                    Outcome.UNSURE: self.unsure}[self.outcome]
        e = self.estimate
        return template.format(value=e, low=_Number(e.low), high=_Number(e.high),
                               threshold=_Number(self.threshold), repeats=e.repeats,
                               unit=e.unit, **self.values)

    @property
    def margin(self) -> str:
        """How sure: the median, the spread of the repeats and the threshold it was held
        against, in words."""
        e = self.estimate
        unit = e.unit if e.unit in ("", "x", "%") else f" {e.unit}"
        needs = f"the statement needs {self.side.value} {_g(self.threshold)}"
        if e.exact_value:
            return f"exactly {_g(e.median)}{unit}; {needs}"
        spread = "range" if e.whole or e.repeats < 4 else "middle half"
        return (f"median {_g(e.median)}{unit}, {spread} {_g(e.low)}-{_g(e.high)} of "
                f"{e.repeats} {e.counts}; {needs}")

    @property
    def markdown(self) -> str:
        return f"{self.sentence} *({self.margin})*"

    def record(self) -> dict[str, Any]:
        """What tests read from a stored notebook: name, outcome, need and numbers."""
        e = self.estimate
        return {"name": self.name, "outcome": self.outcome.value,
                "needs": None if self.needs is None else self.needs.value,
                "side": self.side.value, "threshold": self.threshold,
                "median": e.median, "low": e.low, "high": e.high, "repeats": e.repeats,
                "unit": e.unit}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        return say("{claim}", claim=self)._repr_mimebundle_(include, exclude)

    def __format__(self, spec: str) -> str:
        return self.markdown


_UNSURE = ("This run cannot tell: the threshold {threshold} lies inside the spread of the "
           "repeats ({low} to {high}).")


class _Number(float):
    """A float that prints with 3 significant digits unless a format is given."""

    def __format__(self, spec: str) -> str:
        return format(float(self), spec or ".3g")


def _g(value: float) -> str:
    return f"{value:.3g}"


@dataclass(frozen=True)
class Says:
    """A Markdown paragraph made from a run: its text, and the claims it states."""

    markdown: str
    claims: tuple[Claim, ...] = ()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Markdown (and the same text as plain text); the claims go into the output's
        metadata, which every front end and the book ignore, and the tests read."""
        data = {"text/markdown": self.markdown, "text/plain": self.markdown}
        metadata = {MIME_TYPE: {"claims": [c.record() for c in self.claims]}} if self.claims \
            else {}
        return data, metadata

    def __str__(self) -> str:
        return self.markdown


def say(template: str, **values: Any) -> Says:
    """A paragraph from ``template`` (``str.format``) with numbers and claims filled in: a
    :class:`Claim` shows as its sentence and margin. Display the result (make it a cell's
    last line) and it reads as Markdown in Jupyter and in the book alike::

        say("Rank 0 sends {sent:,} bytes. {slower}", sent=stats[0].bytes_sent, slower=claim)
    """
    missing = _fields(template) - set(values)
    if missing:
        raise ValueError(f"the paragraph names {sorted(missing)}, which were not given: pass "
                         f"them as keywords.")
    claims = tuple(v for v in values.values() if isinstance(v, Claim))
    return Says(template.format(**values), claims)


def stored_claims(outputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The claims recorded in a notebook cell's stored outputs (``cell["outputs"]``)."""
    found: list[dict[str, Any]] = []
    for output in outputs:
        metadata = output.get("metadata", {})
        if MIME_TYPE in metadata:
            payload = metadata[MIME_TYPE]
            found += (json.loads(payload) if isinstance(payload, str) else payload)["claims"]
    return found
