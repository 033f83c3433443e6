"""X3: the lane a gateway signs for a node, and the node's verdict on it. Pure: the clock
is passed in."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from corrallm.peers import lanes

TOKEN = "node-admin-token"
NOW = 1_800_000_000.0


def signed(group: str = "gold", t: float = NOW, token: str = TOKEN) -> tuple[bytes, bytes]:
    headers = lanes.sign(token, group, t)
    return headers["X-Corrallm-Lane"].encode(), headers["X-Corrallm-Lane-Signature"].encode()


def test_X3_the_signature_is_hmac_sha256_of_t_dot_group_keyed_by_the_token() -> None:
    headers = lanes.sign(TOKEN, "gold", NOW + 0.9)  # whole seconds
    t = int(NOW)
    mac = hmac.new(TOKEN.encode(), f"{t}.gold".encode(), hashlib.sha256).hexdigest()
    assert headers == {
        "X-Corrallm-Lane": "gold",
        "X-Corrallm-Lane-Signature": f"t={t},v1={mac}",
    }


def test_X3_a_fresh_correct_signature_is_trusted() -> None:
    assert lanes.verify(TOKEN, *signed(), NOW) == "signed"
    assert lanes.verify(TOKEN, *signed("späť-lane"), NOW) == "signed"  # utf-8 lane names


@pytest.mark.parametrize("skew", [0.0, 59.0, -59.0, 60.0, -60.0])
def test_X3_within_the_window_either_way(skew: float) -> None:
    assert lanes.verify(TOKEN, *signed(t=NOW + skew), NOW) == "signed"


@pytest.mark.parametrize("skew", [61.0, -61.0, 3600.0, -86400.0])
def test_X3_stale_both_directions(skew: float) -> None:
    # A header replayed too late, or signed by a clock far ahead: correct mac, stale t.
    assert lanes.verify(TOKEN, *signed(t=NOW + skew), NOW) == "stale"


def test_X3_a_mac_made_with_another_token_is_bad() -> None:
    assert lanes.verify(TOKEN, *signed(token="someone-else"), NOW) == "bad_signature"


def test_X3_a_tampered_group_or_t_is_bad() -> None:
    _, signature = signed("lead")
    assert lanes.verify(TOKEN, b"gold", signature, NOW) == "bad_signature"
    lane, signature = signed("gold")
    moved = signature.replace(f"t={int(NOW)}".encode(), f"t={int(NOW) + 1}".encode())
    assert lanes.verify(TOKEN, lane, moved, NOW) == "bad_signature"


def test_X3_a_stale_header_with_a_bad_mac_is_bad_not_stale() -> None:
    # The mac is checked first: an attacker learns nothing from the clock.
    assert lanes.verify(TOKEN, *signed(t=NOW - 600, token="x"), NOW) == "bad_signature"


def test_X3_missing_halves_are_unsigned() -> None:
    lane, signature = signed()
    assert lanes.verify(TOKEN, lane, None, NOW) == "unsigned"
    assert lanes.verify(TOKEN, None, signature, NOW) == "unsigned"
    assert lanes.verify(TOKEN, None, None, NOW) == "unsigned"


@pytest.mark.parametrize(
    "signature",
    [
        b"",
        b"garbage",
        b"t=abc,v1=00",
        b"v1=00",  # no t
        b"t=1800000000",  # no v1
        b"t=1800000000;v1=00",
        "t=1800000000,v1=é".encode(),  # not ascii
        b"\xff\xfe",
    ],
)
def test_X3_malformed_signatures_are_bad(signature: bytes) -> None:
    assert lanes.verify(TOKEN, b"gold", signature, NOW) == "bad_signature"


def test_X3_a_lane_that_is_not_utf8_is_bad() -> None:
    _, signature = signed()
    assert lanes.verify(TOKEN, b"\xff", signature, NOW) == "bad_signature"


def test_X3_extra_fields_in_the_signature_are_tolerated() -> None:
    lane, signature = signed()
    assert lanes.verify(TOKEN, lane, signature + b",v0=ignored", NOW) == "signed"
