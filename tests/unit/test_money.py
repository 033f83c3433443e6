"""SPEC §11 D1: the dashboard's dollars show small amounts (energy costs about a millionth
of a dollar a request) with their magnitude, never as `$0.0000`."""

from __future__ import annotations

import pytest

from corrallm.ui.money import money

DASH = "\N{EN DASH}"


@pytest.mark.parametrize(
    ("usd", "shown"),
    [
        (0, "$0.00"),
        (-0.0, "$0.00"),
        (0.5, "$0.50"),
        (12345.678, "$12,345.68"),
        (0.01, "$0.01"),
        (0.00999, "$0.01"),  # rounds up into cents, not "$0.010"
        (0.0034, "$0.0034"),
        (0.00012, "$0.00012"),
        (0.0000012, "$1.2µ"),
        (0.000012, "$12µ"),
        (9.96e-5, "$0.00010"),  # rounds up out of the µ range
        (3.4e-9, "$3.4n"),
        (1e-9, "$1n"),
        (5e-12, "$5p"),
        (1e-15, "<$1p"),
        (-0.5, "-$0.50"),
        (-0.0000012, "-$1.2µ"),
        (None, DASH),
        (float("nan"), DASH),
        (float("inf"), DASH),
        (float("-inf"), DASH),
    ],
)
def test_D1_money_shows_small_amounts_readably(usd, shown):
    assert money(usd) == shown


def test_D1_no_amount_is_shown_as_a_row_of_zeros():
    for exponent in range(-14, 6):
        for mantissa in (1.0, 1.5, 9.9):
            shown = money(mantissa * 10.0**exponent)
            assert shown not in ("$0.00", "$0.0000"), (mantissa, exponent, shown)
