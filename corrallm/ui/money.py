"""Dollars as the dashboard shows them (the `money` template filter).

Local energy costs a request about a millionth of a dollar, so a fixed number of decimals
shows most of the dashboard as `$0.0000`. Amounts are shown so that an operator reads
them at a glance, with their magnitude visible:

| amount                 | shown        | rule                                              |
|------------------------|--------------|---------------------------------------------------|
| 0                      | `$0.00`      |                                                   |
| ≥ $0.01                | `$12,345.68` | cents, thousands separated                        |
| $0.0001 to $0.01       | `$0.0034`    | two significant digits                            |
| $0.000001 to $0.0001   | `$1.2µ`      | two significant digits, in micro-dollars (1e-6)   |
| $1e-9 to $0.000001     | `$3.4n`      | in nano-dollars (1e-9)                            |
| $1e-12 to $1e-9        | `$5p`        | in pico-dollars (1e-12)                           |
| below $1e-12 (not 0)   | `<$1p`       |                                                   |
| negative               | `-$0.50`     | the same rules on the absolute value              |
| None, NaN, ±infinity   | an en dash   | the dashboard's empty cell                        |

No `m` (milli) step: `$3.4m` reads as 3.4 million.
"""

from __future__ import annotations

import math

DASH = "\N{EN DASH}"  # the dashboard's empty cell
# (smallest amount, multiplier, suffix) for the amounts below $0.0001
_SCALED = ((1e-6, 1e6, "µ"), (1e-9, 1e9, "n"), (1e-12, 1e12, "p"))


def money(usd: float | None) -> str:
    if usd is None:
        return DASH
    try:
        value = float(usd)
    except (TypeError, ValueError):
        return DASH
    if not math.isfinite(value):
        return DASH
    sign = "-" if value < 0 else ""
    amount = abs(value)
    if amount == 0:
        return "$0.00"
    rounded = _significant(amount, 2)
    if rounded >= 0.01:
        # Cents from the amount itself (two significant digits would turn $12,345 to 12,000).
        cents = round(amount, 2)
        if cents == 0:  # e.g. 0.00999..., whose two significant digits make $0.010
            cents = 0.01
        return f"{sign}${cents:,.2f}"
    if rounded >= 1e-4:
        decimals = 1 - _exponent(rounded)
        return f"{sign}${rounded:.{decimals}f}"
    for least, scale, suffix in _SCALED:
        if rounded >= least:
            return f"{sign}${_digits(rounded * scale)}{suffix}"
    return f"{sign}<$1p"


def _significant(x: float, digits: int) -> float:
    """`x` rounded to `digits` significant digits (by the correctly rounded formatter)."""
    return float(f"{x:.{digits - 1}e}")


def _exponent(x: float) -> int:
    """The power of ten of `x`'s leading digit."""
    return int(f"{x:e}".split("e")[1])


def _digits(v: float) -> str:
    """1 <= v < 1000 with two significant digits, trailing zeros after the point dropped."""
    v = _significant(v, 2)
    if v >= 10:
        return f"{v:.0f}"
    return f"{v:.1f}".removesuffix(".0")
