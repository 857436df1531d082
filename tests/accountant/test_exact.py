"""Exact budget arithmetic (accountant.exact): numbers as written, computed values rounded up."""

from __future__ import annotations

import decimal
import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accountant.exact import (
    INFINITY,
    SHORT_DYADIC_BITS,
    SIGNIFICANT_DIGITS,
    ZERO,
    as_written,
    exact_add,
    exact_mul,
    exact_sub,
    exact_sum,
    round_down,
    round_up,
    to_text,
)


def test_100_times_001_is_exactly_one() -> None:
    assert exact_sum([as_written(0.01)] * 100) == Decimal(1)
    assert exact_sum([as_written(0.01)] * 101) > Decimal(1)
    assert math.fsum([0.01] * 100) == 1.0 and sum([0.01] * 100) != 1.0  # why floats are not used


def test_numbers_are_taken_as_written() -> None:
    assert as_written(0.1) == Decimal("0.1")
    assert as_written("0.01") == Decimal("0.01")
    assert as_written(3) == Decimal(3)
    assert as_written(Decimal("1e-5")) == Decimal("0.00001")
    with pytest.raises(ValueError):
        as_written(float("nan"))
    with pytest.raises(TypeError):
        as_written(True)


def test_geometric_allowances_are_exact() -> None:
    for k in range(40):
        level = exact_mul(Decimal("0.5"), exact_mul(Decimal("0.5") ** k, Decimal(1)))
        assert level == Decimal(0.5 ** (k + 1))  # 2^-(k+1) is a finite decimal
    total = exact_sum(Decimal(0.5 ** (k + 1)) for k in range(40))
    assert exact_add(total, Decimal(0.5**40)) == Decimal(1)
    assert exact_sub(Decimal(1), total) == Decimal(0.5**40)


def test_special_values() -> None:
    assert round_up(0.0) == ZERO and round_down(0.0) == ZERO
    assert round_up(math.inf) == INFINITY
    with pytest.raises(ValueError):
        round_up(math.nan)
    with pytest.raises(ValueError):
        round_down(math.nan)
    assert to_text(Decimal("1.500")) == "1.5" and to_text(Decimal("1E+2")) == "100"
    assert to_text(INFINITY) == "Infinity" and to_text(Decimal("-0")) == "0"


finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)


@settings(max_examples=300, deadline=None)
@given(x=finite)
def test_round_up_is_never_below_the_float_and_has_18_digits(x: float) -> None:
    up = round_up(x)
    assert up >= Decimal(x)  # Decimal(x) is the float's exact binary value
    assert len(up.as_tuple().digits) <= SIGNIFICANT_DIGITS
    if abs(x) >= 2.2250738585072014e-308:  # normal floats: one ulp plus 18-digit rounding
        assert abs(exact_sub(up, Decimal(x))) <= abs(Decimal(x)) * Decimal("1e-15")
    down = round_down(x)
    assert down <= Decimal(x) <= up


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.decimals(allow_nan=False, allow_infinity=False, places=20,
                                   min_value=-10**12, max_value=10**12), max_size=50))  # fmt: skip
def test_exact_sum_equals_the_rational_sum(values: list[Decimal]) -> None:
    assert Fraction(exact_sum(values)) == sum((Fraction(v) for v in values), Fraction(0))


@settings(max_examples=200, deadline=None)
@given(text=st.decimals(allow_nan=False, allow_infinity=False, places=30))
def test_to_text_round_trips(text: Decimal) -> None:
    assert Decimal(to_text(text)) == text


@settings(max_examples=200, deadline=None)
@given(x=st.floats(min_value=1e-300, max_value=1e300))
def test_as_written_is_the_shortest_repr_or_exact_dyadic_and_maps_back(x: float) -> None:
    written = as_written(x)
    assert float(written) == x
    numerator, denominator = x.as_integer_ratio()
    if denominator > 1 and abs(numerator).bit_length() <= SHORT_DYADIC_BITS:
        assert written == Decimal(x)  # a short binary fraction is read at its exact value
    else:
        assert written == Decimal(repr(x))


def _text_by_definition(value: Decimal) -> str:
    """``to_text``'s rule written out: plain digits for exponents in [-40, 0] or below 10⁴⁰,
    ``str`` otherwise (its body before the plain case skipped ``as_tuple``)."""
    if value.is_infinite():
        return "Infinity" if value > 0 else "-Infinity"
    normal = value.normalize(decimal.Context(prec=400, Emax=10**6, Emin=-(10**6)))
    if normal == 0:
        return "0"
    exponent = normal.as_tuple().exponent
    assert isinstance(exponent, int)
    if -40 <= exponent <= 0 or (exponent > 0 and normal.adjusted() < 40):
        return format(normal, "f")
    return str(normal)


@settings(max_examples=1000, deadline=None)
@given(
    st.decimals(allow_nan=False, allow_infinity=True)
    | st.builds(
        lambda digits, exponent, sign: Decimal((sign, tuple(int(d) for d in str(digits)), exponent)),
        st.integers(0, 10**60),
        st.integers(-80, 80),
        st.integers(0, 1),
    )
)
def test_to_text_follows_its_rule(value: Decimal) -> None:
    """The fast plain case (no scientific notation) writes what the rule says, for every
    magnitude around the thresholds 10⁻⁶, 10⁻⁴⁰ and 10⁴⁰ and every sign."""
    assert to_text(value) == _text_by_definition(value)
