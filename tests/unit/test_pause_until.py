"""P1: a pause's `until` — RFC 3339, a duration from now, or Unix seconds — and every odd
value refused with a 400 rather than a crash (a fuzzed `-2.7e16` once gave a bare 500)."""

from __future__ import annotations

import math
import time

import pytest

from corrallm.api.service import parse_until
from corrallm.http.errors import ApiError


def test_P1_until_accepts_rfc3339_durations_and_unix_seconds():
    now = time.time()
    assert parse_until(None) is None
    assert parse_until("2h") == pytest.approx(now + 7200, abs=5)
    assert parse_until("2999-01-01T00:00:00Z") == pytest.approx(32472144000)
    assert parse_until(now + 60) == pytest.approx(now + 60)


@pytest.mark.parametrize(
    "value",
    [
        -2.6820892678917336e16,
        1e300,
        math.inf,
        -math.inf,
        math.nan,
        0,
        "2001-01-01T00:00:00Z",
        "9999-12-31T23:59:59-01:00",
        "99999999999999999999d",
        "soonish",
        "",
    ],
)
def test_P1_an_unusable_until_is_a_400_not_a_crash(value):
    with pytest.raises(ApiError) as err:
        parse_until(value)
    assert (err.value.status, err.value.code) == (400, "invalid_until")
    assert "'until'" in err.value.message
