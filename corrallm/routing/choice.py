"""The choice among equal backends when some are peers' (SPEC §19 X2). Pure.

Within a tier, a backend that is ready with a free slot comes first, then the one with
the shortest expected wait (its queue times the average hold of a slot, plus a start when
nothing is loaded), then local before peer (`peerOrder: first`: peer before local). Ties
stay with the scheduler's own rule (fewest in flight, then in turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

from corrallm.lifecycle.state import State
from corrallm.routing.router import Route


class Ranked(Protocol):
    def rank(self) -> tuple[int, float]: ...


def ranks(tiers: Sequence[Sequence[Route]], peers_first: bool) -> dict[str, tuple[float, ...]]:
    out: dict[str, tuple[float, ...]] = {}
    for tier in tiers:
        for route in tier:
            endpoint = route.endpoint
            peer = route.config.peer is not None
            if peer:
                ready, wait = _ranked(endpoint).rank()
            elif endpoint.state is State.READY:
                ready, wait = 0, 0.0
            else:
                ready, wait = 1, getattr(endpoint, "last_load_seconds", None) or 0.0
            out[route.id] = (ready, wait, int(peer) ^ int(peers_first))
    return out


def _ranked(endpoint: object) -> Ranked:
    assert hasattr(endpoint, "rank"), "a peer route's endpoint ranks itself"
    return cast(Ranked, endpoint)
