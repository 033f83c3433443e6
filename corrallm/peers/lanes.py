"""Identity across the hop (SPEC §19 X3, §22 T5): the caller's lane, signed for the node.

A gateway sends `X-Corrallm-Lane: <group>` and `X-Corrallm-Lane-Signature:
t=<unix seconds>,n=<nonce>,v1=<hex>`, the hex being HMAC-SHA256 keyed by the node's admin
token (the gateway's `peers.<name>.token`) over `"<t>.<n>.<group>.<METHOD>.<path>"`, the
path without its query (the scheme of Stripe's webhook signatures, with a nonce and the
request's method and path, so that a signature is good for one request only). The node
trusts the lane only if the signature checks out for this very request, `t` is within
`WINDOW` seconds of its clock either way, and the nonce was not seen before (`Nonces`).
The caller's own key never crosses the hop.

Both headers are also the mark of a hop: a request that carries them is never forwarded
to a peer again, so peers cannot form a loop whatever their configs say. Pure: the clock
is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections import OrderedDict
from typing import Literal

LANE = b"x-corrallm-lane"
SIGNATURE = b"x-corrallm-lane-signature"
WINDOW = 30.0  # seconds of clock skew tolerated, either way
# A nonce is remembered as long as a signature carrying it could still be fresh: `t` may
# be up to WINDOW ahead of the clock and is accepted until WINDOW after it.
REMEMBERED = 2 * WINDOW
MAX_NONCES = 100_000  # about 1,600 signed hops a second, sustained, before any is forgotten
# Letters, digits, `-` and `_` only: a nonce holding a `.` could shift the signed fields.
_NONCE = re.compile(r"[A-Za-z0-9_-]{8,64}")

Verdict = Literal["signed", "unsigned", "bad_signature", "stale", "replayed"]


class Nonces:
    """The nonces of lanes accepted lately, each remembered `REMEMBERED` seconds, at most
    `cap` of them (past it the oldest is forgotten: a replay of it needs `cap` signed
    requests within the window, which only a holder of the token can make)."""

    def __init__(self, cap: int = MAX_NONCES) -> None:
        self.cap = cap
        # nonce -> when it is forgotten, in arrival order (an OrderedDict: dropping the
        # oldest is O(1), where a dict's front fills with holes)
        self._until: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def first_use(self, nonce: str, now: float) -> bool:
        """Remember `nonce`; False if it is remembered already (a replay)."""
        until = self._until
        while until and next(iter(until.values())) <= now:  # the oldest first
            until.popitem(last=False)
        if nonce in until:
            return False
        if len(until) >= self.cap:
            until.popitem(last=False)
        until[nonce] = now + REMEMBERED
        return True


def _mac(token: str, t: int, nonce: str, group: str, method: str, path: str) -> str:
    message = f"{t}.{nonce}.{group}.{method}.{path}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def sign(
    token: str, group: str, method: str, path: str, now: float, nonce: str | None = None
) -> dict[str, str]:
    """The two headers a gateway adds to a request it forwards to a peer (`path`: the
    request's path on the node, without its query)."""
    t = int(now)
    n = nonce or secrets.token_urlsafe(16)
    mac = _mac(token, t, n, group, method.upper(), path.split("?", 1)[0])
    return {"X-Corrallm-Lane": group, "X-Corrallm-Lane-Signature": f"t={t},n={n},v1={mac}"}


def verify(
    token: str,
    group: bytes | None,
    signature: bytes | None,
    method: str,
    path: str,
    now: float,
    nonces: Nonces,
) -> Verdict:
    """Whether `group` may be trusted as the lane of this request (`method`, `path`). The
    mac is checked first (an attacker learns nothing from the clock or the cache), and a
    nonce is remembered only once all else holds (a forgery cannot fill the cache)."""
    if group is None or signature is None:
        return "unsigned"
    try:
        fields = dict(part.split("=", 1) for part in signature.decode("ascii").split(","))
        t = int(fields["t"])
        nonce = fields["n"]
        given = fields["v1"]
        lane = group.decode("utf-8")
    except (ValueError, KeyError, UnicodeDecodeError):
        return "bad_signature"
    if not _NONCE.fullmatch(nonce):
        return "bad_signature"
    expected = _mac(token, t, nonce, lane, method.upper(), path.split("?", 1)[0])
    if not hmac.compare_digest(given, expected):
        return "bad_signature"
    if abs(now - t) > WINDOW:
        return "stale"
    if not nonces.first_use(nonce, now):
        return "replayed"
    return "signed"
