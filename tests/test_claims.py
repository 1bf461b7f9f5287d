"""labs.claims: a measured statement decided by its repeats, shown as Markdown.

Every outcome is reached, the spread decides (a median past the threshold is not enough), a
sentence that names a number it was not given is refused at once, and the JSON a display
carries is what :func:`labs.claims.stored_claims` reads back.
"""

from __future__ import annotations

import json

import pytest

from labs.claims import MIME_TYPE, Claim, Estimate, Outcome, say, stored_claims

FASTER = dict(held="The ring took {value:.2f}x the naive time: faster.",
              opposite="The ring took {value:.2f}x the naive time: slower.")


def ratio_claim(samples: list[float], threshold: float = 1.0) -> Claim:
    return Claim.below("test.ring-faster", Estimate.of(samples, "x"), threshold, **FASTER)


def test_estimate_is_the_median_and_the_middle_half():
    e = Estimate.of([5, 1, 4, 2, 3, 100, 6])
    assert (e.median, e.low, e.high, e.repeats) == (4, 2.5, 5.5, 7)
    assert (Estimate.of([3, 1]).low, Estimate.of([3, 1]).high) == (1, 3)  # few: the range
    assert Estimate.exact(7).low == Estimate.exact(7).high == 7


def test_estimate_refuses_no_samples_and_a_disordered_spread():
    with pytest.raises(ValueError, match="at least one sample"):
        Estimate.of([])
    with pytest.raises(ValueError, match="low <= median <= high"):
        Estimate(1.0, 2.0, 3.0, 3)


def test_a_ratio_spans_the_widest_quotient_of_the_two_spreads():
    a, b = Estimate(2.0, 1.8, 2.2, 5), Estimate(4.0, 3.6, 4.4, 9)
    r = a.over(b)
    assert r.median == 0.5 and r.low == pytest.approx(1.8 / 4.4)
    assert r.high == pytest.approx(2.2 / 3.6)
    assert r.repeats == 5
    with pytest.raises(ValueError, match="positive denominator"):
        a.over(Estimate(0.0, 0.0, 0.0, 1))


def test_a_span_is_every_case_so_one_outlier_decides():
    within = dict(held="Every case within 15 %.", opposite="No case within 15 %.",
                  unsure="Some cases within 15 %, not all.")
    quartiles = Estimate.of([1, 2, 3, 2, 1, 2, 40])  # one case far out: the middle half hides it
    assert Claim.below("test.within", quartiles, 15, **within).outcome is Outcome.HELD
    every = Estimate.span([1, 2, 3, 2, 1, 2, 40], "%")
    assert (every.low, every.median, every.high, every.repeats) == (1, 2, 40, 7)
    claim = Claim.below("test.within", every, 15, **within)
    assert claim.outcome is Outcome.UNSURE and "not all" in claim.sentence
    assert "range 1-40 of 7 cases" in claim.margin
    with pytest.raises(ValueError, match="at least one sample"):
        Estimate.span([])


def test_a_sum_adds_both_spreads_and_refuses_two_units():
    total = Estimate(2.0, 1.8, 2.2, 5, "ms").plus(Estimate(1.0, 0.9, 1.5, 9, "ms"))
    assert (total.median, total.low, total.high, total.repeats) == (3.0, 2.7, 3.7, 5)
    with pytest.raises(ValueError, match="one unit"):
        Estimate(2.0, 1.8, 2.2, 5, "ms").plus(Estimate(1.0, 0.9, 1.5, 9, "s"))


@pytest.mark.parametrize("samples, outcome, word", [
    ([0.5, 0.6, 0.55, 0.52, 0.58], Outcome.HELD, "faster"),
    ([1.5, 1.6, 1.55, 1.52, 1.58], Outcome.OPPOSITE, "slower"),
    ([0.9, 1.1, 0.95, 1.05, 1.0], Outcome.UNSURE, "cannot tell"),
])
def test_each_outcome_has_its_sentence(samples, outcome, word):
    claim = ratio_claim(samples)
    assert claim.outcome is outcome
    assert word in claim.sentence


def test_the_spread_decides_not_the_median():
    # The median is below 1 but the middle half of the repeats straddles it.
    claim = ratio_claim([0.7, 0.8, 0.9, 1.1, 1.2])
    assert claim.estimate.median < 1 and claim.outcome is Outcome.UNSURE
    assert "cannot tell" in claim.sentence and "0.8 to 1.1" in claim.sentence


def test_above_is_the_mirror_of_below():
    e = Estimate.of([2.0, 2.1, 2.2, 2.05])
    assert Claim.above("t.a", e, 1.5, held="yes", opposite="no").outcome is Outcome.HELD
    assert Claim.below("t.b", e, 1.5, held="yes", opposite="no").outcome is Outcome.OPPOSITE


def test_an_exact_value_on_its_threshold_cannot_be_decided():
    claim = Claim.above("t.exact", Estimate.exact(3), 3, held="more", opposite="fewer")
    assert claim.outcome is Outcome.UNSURE
    assert claim.margin == "exactly 3; the statement needs above 3"


def test_a_sentence_naming_a_missing_number_is_refused_when_made():
    with pytest.raises(ValueError, match=r"\['speedup'\]"):
        Claim.above("t.bad", Estimate.exact(2), 1, held="{speedup}x", opposite="no")
    assert Claim.above("t.good", Estimate.exact(2), 1, held="{speedup}x", opposite="no",
                       speedup=2).sentence == "2x"


def test_a_name_is_an_id():
    with pytest.raises(ValueError, match="without spaces"):
        Claim.above("ring faster", Estimate.exact(2), 1, held="a", opposite="b")


def test_the_margin_says_median_spread_repeats_and_threshold():
    claim = ratio_claim([0.5, 0.6, 0.55, 0.52, 0.58])
    assert claim.margin == ("median 0.55x, middle half 0.52-0.58 of 5 repeats; the statement "
                            "needs below 1")
    assert claim.markdown == f"{claim.sentence} *({claim.margin})*"


def test_say_fills_numbers_and_claims_and_records_the_claims():
    claim = ratio_claim([0.5, 0.6, 0.55, 0.52, 0.58])
    shown = say("Rank 0 sent {sent:,} bytes. {faster}", sent=12345, faster=claim)
    assert shown.markdown.startswith("Rank 0 sent 12,345 bytes. The ring took 0.55x")
    data, metadata = shown._repr_mimebundle_()
    assert data["text/markdown"] == shown.markdown
    [record] = stored_claims([{"output_type": "display_data", "data": data,
                               "metadata": json.loads(json.dumps(metadata))}])
    assert record["name"] == "test.ring-faster" and record["outcome"] == "held"
    assert record["needs"] == "held" and record["repeats"] == 5


def test_say_refuses_a_paragraph_with_a_missing_number():
    with pytest.raises(ValueError, match=r"\['copies'\]"):
        say("Rank 0 sends {copies} copies.")


def test_a_claim_alone_displays_as_its_paragraph():
    claim = ratio_claim([0.5, 0.6, 0.55, 0.52, 0.58])
    data, metadata = claim._repr_mimebundle_()
    assert data["text/markdown"] == claim.markdown and MIME_TYPE not in data
    assert metadata[MIME_TYPE]["claims"][0]["name"] == claim.name


def test_a_plain_paragraph_carries_no_claims():
    assert say("{n} ranks", n=4)._repr_mimebundle_()[1] == {}
