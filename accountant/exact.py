"""Exact budget arithmetic (docs/ARCHITECTURE.md, "Numerical safety").

Budgets and spends are kept as ``Decimal``:

* a number a user sends is taken as written — its shortest decimal form, so ``0.01`` is one
  hundredth, not the binary float nearest to it (``as_written``). One refinement: a float that
  is a short binary fraction k/2^q (odd k < 2^26, such as 2⁻³¹) is taken at its exact binary
  value, because its shortest repr (4.656612873077393e-10) lies above it and a charge of
  ε/2ᵏ⁺¹ computed in binary must meet geometric level k exactly. Both readings lie within half an
  ulp of the float, the resolution the "as written" rule accepts anyway;
* a number an accountant computes in floating point is first nudged one ulp towards +∞
  (``math.nextafter``) and then rounded *up* to 18 significant digits (``round_up``), so float
  error can cost a user budget but never grant extra privacy loss;
* sums and comparisons of these decimals are exact (``exact_sum`` uses a context wide enough
  that no addition rounds).

Hence 100 charges of 0.01 fill a budget of 1.0 exactly, and a charge of ε/2^(k+1) meets geometric
level k exactly.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Iterable
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation
from typing import Final, Literal

SIGNIFICANT_DIGITS: Final = 18
# Floats k/2^q with odd k of at most this many bits are read at their exact binary value.
SHORT_DYADIC_BITS: Final = 26
# Sums of up to ~10^12 terms of 18 significant digits spanning any sane exponent range stay
# exact in this context: it is wide enough that additions never round.
_EXACT: Final = decimal.Context(
    prec=400, Emax=10**6, Emin=-(10**6), traps=[decimal.InvalidOperation, decimal.Overflow]
)
_UP: Final = decimal.Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_CEILING)
_DOWN: Final = decimal.Context(prec=SIGNIFICANT_DIGITS, rounding=ROUND_FLOOR)

INFINITY: Final = Decimal("Infinity")
ZERO: Final = Decimal(0)


def as_written(value: float | int | str | Decimal) -> Decimal:
    """A user-supplied number as the decimal the user wrote (shortest repr of a float)."""
    if isinstance(value, Decimal):
        result = value
    elif isinstance(value, bool):
        raise TypeError("a boolean is not a number")
    elif isinstance(value, int):
        result = Decimal(value)
    elif isinstance(value, float):
        numerator, denominator = value.as_integer_ratio()
        if denominator > 1 and abs(numerator).bit_length() <= SHORT_DYADIC_BITS:
            result = Decimal(value)  # exact: a short binary fraction is a finite decimal
        else:
            result = Decimal(repr(value))
    else:
        result = Decimal(str(value).strip())
    if result.is_nan():
        raise ValueError(f"not a number: {value!r}")
    return result


def round_up(value: float) -> Decimal:
    """A computed float as a Decimal that is >= the float's exact value, 18 significant digits.

    The float is first moved one ulp towards +∞ to absorb the rounding of the float computation
    that produced it; then its exact binary value is rounded up (ceiling) to 18 digits.
    """
    if math.isnan(value):
        raise ValueError("cannot round NaN up")
    if value == math.inf:
        return INFINITY
    if value == 0.0:
        return ZERO
    nudged = math.nextafter(value, math.inf)
    return _UP.plus(Decimal(nudged))


def round_down(value: float) -> Decimal:
    """A computed float as a Decimal <= its value (for allowances that must not be overstated)."""
    if math.isnan(value):
        raise ValueError("cannot round NaN down")
    if value == math.inf:
        return INFINITY
    if value == 0.0:
        return ZERO
    nudged = math.nextafter(value, -math.inf)
    return _DOWN.plus(Decimal(nudged))


def exact_sum(values: Iterable[Decimal]) -> Decimal:
    """The exact sum of decimals (no rounding)."""
    total = ZERO
    for v in values:
        total = _EXACT.add(total, v)
    return total


def exact_add(a: Decimal, b: Decimal) -> Decimal:
    return _EXACT.add(a, b)


def exact_sub(a: Decimal, b: Decimal) -> Decimal:
    return _EXACT.subtract(a, b)


def exact_mul(a: Decimal, b: Decimal) -> Decimal:
    return _EXACT.multiply(a, b)


def to_text(value: Decimal) -> str:
    """Canonical text for storage and JSON: no exponent for ordinary magnitudes, no trailing zeros."""
    if value.is_infinite():
        return "Infinity" if value > 0 else "-Infinity"
    normal = value.normalize(_EXACT)
    if normal == 0:
        return "0"
    # Scientific notation is used only for an exponent > 0 or below 10⁻⁶ (the decimal
    # specification's to-scientific-string); without it the text is the plain digits that
    # ``format(normal, "f")`` writes, made without ``as_tuple`` (most of this function's time).
    text = _EXACT.to_sci_string(normal)
    if "E" not in text:
        return text
    exponent = normal.as_tuple().exponent
    assert isinstance(exponent, int)
    if -40 <= exponent <= 0 or (exponent > 0 and normal.adjusted() < 40):
        return format(normal, "f")
    return str(normal)


SHOWN_DIGITS: Final = 4


def shown(value: Decimal | str | int, way: Literal["up", "down"] = "up", digits: int = SHOWN_DIGITS) -> str:
    """``value`` in ``digits`` significant digits, rounded ``way`` ("up" for an ε or δ bound, so
    the shown number is still a bound; "down" for what remains). Plain decimal text below 10¹⁵
    and from 10⁻⁶ (``1.042``, ``0.00001``), else scientific (``9.997e-7``); "inf" for ∞."""
    number = value if isinstance(value, Decimal) else Decimal(str(value))
    if number.is_infinite():
        return "inf" if number > 0 else "-inf"
    if number.is_nan():
        raise InvalidOperation(f"value must be a number. Found {value!r}.")
    if number == 0:
        return "0"
    quantum = Decimal(1).scaleb(number.adjusted() - digits + 1)
    rounded = number.quantize(quantum, rounding=ROUND_CEILING if way == "up" else ROUND_FLOOR)
    if rounded.adjusted() > number.adjusted():  # 9.9996 → 10.00: keep `digits` digits
        rounded = rounded.quantize(quantum.scaleb(1))
    if -6 <= rounded.adjusted() < 15:
        text = f"{rounded:f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    mantissa, exponent = f"{rounded:E}".split("E")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"
