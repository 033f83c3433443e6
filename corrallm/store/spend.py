"""Spend windows in the store (SPEC §6 S6, §19 X5; migration 8): the statements the ledger
(cost/ledger.py) runs for lanes with a `spendLimit`.

On a shared store the `spend` table holds every gateway's reservations and spending, so
a limit holds across them. A reservation is one transaction: an advisory lock on the lane
(`pg_advisory_xact_lock`), then one statement that sums the window's spending and the live
reservations and inserts the new one only if it still fits. Two gateways reserving for the
same lane at once take turns on the lock, and the second sees the first's reservation
(its statement starts after the lock is granted, so it reads everything committed before):
the lane never goes over its limit by more than what its requests cost beyond their
estimates. A reservation counts until it is settled (its row becomes the real cost, spent
then) or until it `expires` (a gateway killed before settling cannot hold a lane for ever).

Settling and load costs are written off the request path by `SpendLog`, a small batched
writer that flushes as soon as there is something to write.

A lane is a priority group, or a key with a `spendLimit` of its own (SPEC §22 T3): its
rows' `grp` is then `key:<name>` (group names cannot hold a colon).

An embedded store keeps its windows in memory (cost/spend.py); `recent_costs` and
`recent_key_costs` rebuild them from the activity rows at boot.
"""

from __future__ import annotations

from dataclasses import dataclass

from corrallm.store.db import Store
from corrallm.store.writes import QueuedWrites

# A reservation not settled after this long is no longer counted: longer than any request
# (its gateway died). Rows of both kinds are pruned once out of their window.
RESERVATION_SECONDS = 15 * 60.0

_USED = """
    SELECT COALESCE(SUM(CASE WHEN state = 'spent' THEN usd ELSE 0 END), 0) AS spent,
           COALESCE(SUM(CASE WHEN state = 'reserved' THEN usd ELSE 0 END), 0) AS reserved
    FROM spend
    WHERE grp = ? AND (state = 'spent' AND t > ? OR state = 'reserved' AND expires > ?)
"""
# Parameters: the lane, window start, now (_USED); the lane, now, usd, gateway, expiry;
# usd, limit. The 1e-12 is SpendWindow's: float sums must not refuse an exact fit.
_RESERVE = f"""
    WITH used AS ({_USED}),
    kept AS (
        INSERT INTO spend (grp, t, usd, state, gateway, expires)
        SELECT ?, ?, ?, 'reserved', ?, ? FROM used
        WHERE used.spent + used.reserved + ? <= ? + 1e-12
        RETURNING id
    )
    SELECT used.spent AS spent, used.reserved AS reserved, (SELECT id FROM kept) AS id
    FROM used
"""
_SETTLE = "UPDATE spend SET state = 'spent', usd = ?, t = ?, expires = NULL WHERE id = ?"
_ADD = "INSERT INTO spend (grp, t, usd, state, gateway) VALUES (?, ?, ?, 'spent', ?)"


@dataclass(frozen=True)
class Reserved:
    id: int | None  # the reservation's row; None: it did not fit
    spent: float  # the window's spending, every gateway's, when it was checked
    reserved: float  # live reservations then, every gateway's (this one not included)


async def reserve(
    store: Store, group: str, usd: float, limit: float, window: float, now: float, gateway: str
) -> Reserved:
    """Reserve `usd` for the lane `group` if its window (`window` seconds to `now`) still
    has room under `limit`, atomically across every gateway sharing `store`."""
    used = (group, now - window, now)
    rows = await store.transact(
        [
            ("SELECT pg_advisory_xact_lock(hashtext(?))", (f"corrallm.spend:{group}",)),
            (_RESERVE, (*used, group, now, usd, gateway, now + RESERVATION_SECONDS, usd, limit)),
        ]
    )
    row = rows[0]
    return Reserved(row["id"], float(row["spent"]), float(row["reserved"]))


async def spending(store: Store, group: str, since: float) -> list[tuple[float, float]]:
    """The lane's spending after `since`, as (t, usd), oldest first."""
    rows = await store.query(
        "SELECT t, usd FROM spend WHERE grp = ? AND state = 'spent' AND t > ? ORDER BY t",
        (group, since),
    )
    return [(r["t"], r["usd"]) for r in rows]


async def spent(store: Store, group: str, since: float) -> float:
    """The lane's spending after `since`, every gateway's."""
    rows = await store.query(
        "SELECT COALESCE(SUM(usd), 0) AS usd FROM spend "
        "WHERE grp = ? AND state = 'spent' AND t > ?",
        (group, since),
    )
    return float(rows[0]["usd"])


async def prune(store: Store, group: str, before: float, now: float) -> None:
    """Forget the lane's spending from before `before` and its expired reservations."""
    await store.execute(
        "DELETE FROM spend WHERE grp = ? "
        "AND (state = 'spent' AND t <= ? OR state = 'reserved' AND expires <= ?)",
        (group, before, now),
    )


async def recent_costs(store: Store, group: str, since: float) -> list[tuple[float, float]]:
    """What the lane's activity rows cost since `since`, per minute: (minute, usd), oldest
    first (an embedded store's windows, rebuilt at boot)."""
    return await _costs_by_minute(store, "grp", group, since)


async def recent_key_costs(store: Store, key: str, since: float) -> list[tuple[float, float]]:
    """`recent_costs` for one key's own window (T3: a key's `spendLimit`)."""
    return await _costs_by_minute(store, "key", key, since)


async def _costs_by_minute(
    store: Store, column: str, value: str, since: float
) -> list[tuple[float, float]]:
    dialect = store.dialect
    rows = await store.query(
        f"SELECT {dialect.floor_to('t', 60)} AS minute, SUM(cost_usd) AS usd "
        f"FROM activity {dialect.indexed(f'activity_{column}_t')} WHERE {column} = ? "
        "AND t >= ? GROUP BY minute ORDER BY minute",
        (value, since),
    )
    return [(r["minute"], r["usd"] or 0.0) for r in rows]


class SpendLog(QueuedWrites):
    """Settlements and load costs on their way to a shared store (`QueuedWrites`: no I/O
    on the request path, a failed write kept and tried again)."""

    def __init__(self, store: Store, gateway: str) -> None:
        super().__init__(store, (_SETTLE, _ADD), "spend")
        self.gateway = gateway

    def settle(self, reservation: int, usd: float, now: float) -> None:
        self.queue(_SETTLE, (usd, now, reservation))

    def add(self, group: str, usd: float, now: float) -> None:
        self.queue(_ADD, (group, now, usd, self.gateway))
