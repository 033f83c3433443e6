"""Identity across the hop (SPEC §19 X3): the caller's lane, signed for the node.

A gateway sends `X-Corrallm-Lane: <group>` and `X-Corrallm-Lane-Signature: t=<unix
seconds>,v1=<hex>`, the hex being HMAC-SHA256 keyed by the node's admin token over
`"<t>.<group>"` (the scheme of Stripe's webhook signatures). The node trusts the lane only
if the signature checks out and `t` is within `WINDOW` seconds of its clock; otherwise the
request is scheduled as an unkeyed caller. The caller's own key never crosses the hop.

Both headers are also the mark of a hop: a request that carries them is never forwarded
to a peer again, so peers cannot form a loop whatever their configs say. Pure: the clock
is passed in.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

LANE = b"x-corrallm-lane"
SIGNATURE = b"x-corrallm-lane-signature"
WINDOW = 60.0  # seconds of clock skew and replay tolerated

Verdict = Literal["signed", "unsigned", "bad_signature", "stale"]


def _mac(token: str, t: int, group: str) -> str:
    return hmac.new(token.encode(), f"{t}.{group}".encode(), hashlib.sha256).hexdigest()


def sign(token: str, group: str, now: float) -> dict[str, str]:
    """The two headers a gateway adds to a request it forwards to a peer."""
    t = int(now)
    return {
        "X-Corrallm-Lane": group,
        "X-Corrallm-Lane-Signature": f"t={t},v1={_mac(token, t, group)}",
    }


def verify(token: str, group: bytes | None, signature: bytes | None, now: float) -> Verdict:
    """Whether `group` may be trusted as the request's lane."""
    if group is None or signature is None:
        return "unsigned"
    try:
        fields = dict(part.split("=", 1) for part in signature.decode("ascii").split(","))
        t = int(fields["t"])
        given = fields["v1"]
        lane = group.decode("utf-8")
    except (ValueError, KeyError, UnicodeDecodeError):
        return "bad_signature"
    if not hmac.compare_digest(given, _mac(token, t, lane)):
        return "bad_signature"
    if abs(now - t) > WINDOW:
        return "stale"
    return "signed"
