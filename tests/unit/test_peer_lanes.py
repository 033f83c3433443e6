"""X3, T5: the lane a gateway signs for a node, for one request, and the node's verdict
on it. Pure: the clock is passed in."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from corrallm.peers import lanes

TOKEN = "node-admin-token"
NOW = 1_800_000_000.0
CHAT = ("POST", "/v1/chat/completions")


def signed(
    group: str = "gold",
    t: float = NOW,
    token: str = TOKEN,
    method: str = "POST",
    path: str = "/v1/chat/completions",
    nonce: str | None = None,
) -> tuple[bytes, bytes]:
    headers = lanes.sign(token, group, method, path, t, nonce)
    return headers["X-Corrallm-Lane"].encode(), headers["X-Corrallm-Lane-Signature"].encode()


def verdict(
    lane: bytes | None,
    signature: bytes | None,
    now: float = NOW,
    request: tuple[str, str] = CHAT,
    nonces: lanes.Nonces | None = None,
) -> lanes.Verdict:
    method, path = request
    cache = nonces if nonces is not None else lanes.Nonces()
    return lanes.verify(TOKEN, lane, signature, method, path, now, cache)


def test_T5_the_signature_is_hmac_sha256_of_t_nonce_group_method_path_keyed_by_the_token() -> None:
    headers = lanes.sign(TOKEN, "gold", "post", "/v1/chat/completions?x=1", NOW + 0.9, "nonce-123")
    t = int(NOW)  # whole seconds; the method upper-cased; the path without its query
    message = f"{t}.nonce-123.gold.POST./v1/chat/completions".encode()
    mac = hmac.new(TOKEN.encode(), message, hashlib.sha256).hexdigest()
    assert headers == {
        "X-Corrallm-Lane": "gold",
        "X-Corrallm-Lane-Signature": f"t={t},n=nonce-123,v1={mac}",
    }


def test_T5_each_signature_has_a_fresh_nonce() -> None:
    first, second = signed()[1], signed()[1]
    assert first != second
    nonce = dict(p.split(b"=", 1) for p in first.split(b","))[b"n"]
    assert len(nonce) >= 16


def test_X3_a_fresh_correct_signature_is_trusted() -> None:
    assert verdict(*signed()) == "signed"
    assert verdict(*signed("späť-lane")) == "signed"  # utf-8 lane names


@pytest.mark.parametrize("skew", [0.0, 29.0, -29.0, 30.0, -30.0])
def test_T5_within_30_s_either_way(skew: float) -> None:
    assert verdict(*signed(t=NOW + skew)) == "signed"


@pytest.mark.parametrize("skew", [-31.0, -3600.0])
def test_T5_stale(skew: float) -> None:
    # A header replayed too late: correct mac, `t` too far in the past.
    assert verdict(*signed(t=NOW + skew)) == "stale"


@pytest.mark.parametrize("skew", [31.0, 86400.0])
def test_T5_from_the_future(skew: float) -> None:
    # Signed by a clock far ahead (or made to be replayed later): refused as well.
    assert verdict(*signed(t=NOW + skew)) == "stale"


def test_T5_a_replayed_signature_is_refused_within_the_window() -> None:
    nonces = lanes.Nonces()
    lane, signature = signed()
    assert verdict(lane, signature, NOW, nonces=nonces) == "signed"
    assert verdict(lane, signature, NOW + 1, nonces=nonces) == "replayed"
    assert verdict(lane, signature, NOW + 30, nonces=nonces) == "replayed"
    # Later it is stale before it could be forgotten (remembered 2 x 30 s).
    assert verdict(lane, signature, NOW + 31, nonces=nonces) == "stale"
    # Another request's signature, with its own nonce, is not a replay.
    assert verdict(*signed(), NOW + 1, nonces=nonces) == "signed"


def test_T5_a_signature_signed_ahead_is_remembered_as_long_as_it_could_be_fresh() -> None:
    nonces = lanes.Nonces()
    lane, signature = signed(t=NOW + 30)  # a clock 30 s ahead: fresh until NOW + 60
    assert verdict(lane, signature, NOW, nonces=nonces) == "signed"
    assert verdict(lane, signature, NOW + 59.5, nonces=nonces) == "replayed"


def test_T5_a_signature_for_another_method_or_path_is_bad() -> None:
    lane, signature = signed()
    assert verdict(lane, signature, request=("GET", "/v1/chat/completions")) == "bad_signature"
    assert verdict(lane, signature, request=("POST", "/v1/embeddings")) == "bad_signature"
    assert verdict(lane, signature, request=("POST", "/v1/chat/completions/")) == "bad_signature"
    # ...and the query is not part of it.
    assert verdict(lane, signature, request=("POST", "/v1/chat/completions?a=b")) == "signed"


def test_X3_a_mac_made_with_another_token_is_bad() -> None:
    assert verdict(*signed(token="someone-else")) == "bad_signature"


def test_X3_a_tampered_group_t_or_nonce_is_bad() -> None:
    _, signature = signed("lead")
    assert verdict(b"gold", signature) == "bad_signature"
    lane, signature = signed("gold", nonce="nonce-aaaa")
    moved = signature.replace(f"t={int(NOW)}".encode(), f"t={int(NOW) + 1}".encode())
    assert verdict(lane, moved) == "bad_signature"
    other = signature.replace(b"n=nonce-aaaa", b"n=nonce-bbbb")
    assert verdict(lane, other) == "bad_signature"


def test_X3_a_stale_header_with_a_bad_mac_is_bad_not_stale() -> None:
    # The mac is checked first: an attacker learns nothing from the clock.
    assert verdict(*signed(t=NOW - 600, token="x")) == "bad_signature"


def test_T5_a_forged_signature_leaves_nothing_in_the_nonce_cache() -> None:
    nonces = lanes.Nonces()
    for i in range(50):
        verdict(*signed(token="x", nonce=f"forged-{i:04d}"), nonces=nonces)
    assert len(nonces) == 0


def test_X3_missing_halves_are_unsigned() -> None:
    lane, signature = signed()
    assert verdict(lane, None) == "unsigned"
    assert verdict(None, signature) == "unsigned"
    assert verdict(None, None) == "unsigned"


@pytest.mark.parametrize(
    "signature",
    [
        b"",
        b"garbage",
        b"t=abc,n=nonce-123,v1=00",
        b"n=nonce-123,v1=00",  # no t
        b"t=1800000000,n=nonce-123",  # no v1
        b"t=1800000000,v1=00",  # no nonce (the X3 format before T5)
        b"t=1800000000;n=nonce-123;v1=00",
        "t=1800000000,n=nonce-123,v1=é".encode(),  # not ascii
        b"\xff\xfe",
    ],
)
def test_X3_malformed_signatures_are_bad(signature: bytes) -> None:
    assert verdict(b"gold", signature) == "bad_signature"


@pytest.mark.parametrize("nonce", ["short", "has.a.dot", "x" * 65, "sp ace-123"])
def test_T5_a_nonce_outside_its_alphabet_is_bad_even_when_signed(nonce: str) -> None:
    # A `.` in the nonce could move the signed fields' boundaries.
    assert verdict(*signed(nonce=nonce)) == "bad_signature"


def test_X3_a_lane_that_is_not_utf8_is_bad() -> None:
    _, signature = signed()
    assert verdict(b"\xff", signature) == "bad_signature"


def test_X3_extra_fields_in_the_signature_are_tolerated() -> None:
    lane, signature = signed()
    assert verdict(lane, signature + b",v0=ignored") == "signed"


def test_T5_the_nonce_cache_forgets_after_the_window_and_is_capped() -> None:
    nonces = lanes.Nonces(cap=3)
    for i in range(3):
        assert nonces.first_use(f"n{i}", NOW + i)
    assert not nonces.first_use("n0", NOW + 3)  # remembered
    assert nonces.first_use("n3", NOW + 3)  # the cap: the oldest, n0, is forgotten
    assert len(nonces) == 3 and nonces.first_use("n0", NOW + 3)
    # Past 2 x 30 s every one of them is forgotten.
    assert nonces.first_use("later", NOW + 3 + 2 * lanes.WINDOW + 1)
    assert len(nonces) == 1
