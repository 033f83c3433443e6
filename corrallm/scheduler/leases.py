"""Who holds which lease (SPEC §7, §22 T5). Plain data, the clock passed in.

The scheduling core knows a lease as a lane's slots on a backend (V2: what other lanes
cannot have). Here each lease also has its holder (the key that asked for it), so that a
caller lists and releases its own leases only, a lane's callers are capped in the slots
they hold together (`reservations.maxSlots`), and the slot-seconds each lease held are
told to whoever charges for them when it ends (released, replaced by a renewal, expired,
or at shutdown). A lane's lease in the core is the sum of its holders' on that backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from corrallm.routing.router import Route


@dataclass(slots=True, eq=False)
class Lease:
    holder: str  # the key's name
    group: str
    route: Route
    slots: int
    since: float  # granted (a renewal is a new lease)
    until: float
    # Told, once, the slot-seconds it held when it ends (its spend is settled there).
    ended: Callable[[Lease, float], None] | None = None

    def slot_seconds(self, now: float) -> float:
        return self.slots * max(0.0, min(now, self.until) - self.since)


class Leases:
    """The live leases by (holder, backend): at most one per holder on each backend."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], Lease] = {}

    def put(self, lease: Lease) -> Lease | None:
        """Hold `lease`; the one it replaces (a renewal), if any."""
        key = (lease.holder, lease.route.id)
        old = self._held.pop(key, None)
        self._held[key] = lease
        return old

    def take(self, holder: str, backend: str) -> Lease | None:
        return self._held.pop((holder, backend), None)

    def expired(self, now: float) -> list[Lease]:
        """The leases whose time is up, no longer held."""
        gone = [lease for lease in self._held.values() if lease.until <= now]
        for lease in gone:
            del self._held[(lease.holder, lease.route.id)]
        return gone

    def everything(self) -> list[Lease]:
        """Every lease, no longer held (at shutdown)."""
        gone = list(self._held.values())
        self._held.clear()
        return gone

    def live(self, now: float) -> list[Lease]:
        return [lease for lease in self._held.values() if lease.until > now]

    def lane(self, group: str, backend: str) -> tuple[int, float] | None:
        """What the core holds for `group` on `backend`: its holders' slots together and
        the latest end; None when none of them holds a lease there."""
        mine = [x for x in self._held.values() if x.group == group and x.route.id == backend]
        if not mine:
            return None
        return sum(x.slots for x in mine), max(x.until for x in mine)

    def held(self, group: str, besides: tuple[str, str] | None = None) -> int:
        """Slots `group`'s callers hold in leases, on every backend; `besides`: not
        counting that (holder, backend)'s lease (the one a renewal replaces)."""
        return sum(
            lease.slots
            for key, lease in self._held.items()
            if lease.group == group and key != besides
        )
