"""Per-key rate limits in a shared store (SPEC §22 T3, §19 X5; the `key_rates` table of
migration 9): the statements auth/throttle.py runs so that a key's rpm and tpm (and its
users' under `limits.perUser`) hold across every gateway of one PostgreSQL store.

A row is one admitted request of one subject (`key:<name>` or `key:<name>/user:<user>`):
admitted at `t` (it counts for rpm while `t` is in the last 60 s), reserving its estimated
tokens until settled (`state` reserved, until `expires`: a gateway killed before settling
cannot hold a key for ever), then holding its metered tokens, counted at `used_at` (tpm).

A reservation is one transaction: an advisory lock per subject (taken in a fixed order,
so two gateways never wait on each other crosswise), then one statement that counts each
subject's window and inserts a row for every subject only if all of them still fit. A
second gateway asking at the same time waits for the lock and then sees the first one's
rows: a limit is never passed by more than what a request's usage exceeds its estimate.

Settlements are queued (`RateLog`) and written off the request path; rows out of every
window are pruned now and then (`prune`). An embedded store never runs any of this: its
gateway counts in memory (auth/limits.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from corrallm.store.db import Store
from corrallm.store.spend import RESERVATION_SECONDS
from corrallm.store.writes import QueuedWrites

__all__ = ["RESERVATION_SECONDS", "RateLog", "WindowCount", "prune", "reserve", "timeline"]

# Parameters: (subject, rpm, tpm) per subject; window start (rpm), window start (tpm),
# now (live reservations); the estimate (fits); now, the estimate, gateway, expiry (the
# rows); PostgreSQL only (shared stores).
_RESERVE = """
    WITH asked(subject, rpm, tpm) AS (VALUES {values}),
    used AS (
        SELECT a.subject, a.rpm, a.tpm,
               (SELECT COUNT(*) FROM key_rates r WHERE r.subject = a.subject AND r.t > ?)
                   AS requests,
               (SELECT COALESCE(SUM(r.tokens), 0) FROM key_rates r
                WHERE r.subject = a.subject
                  AND (r.state = 'used' AND r.used_at > ?
                       OR r.state = 'reserved' AND r.expires > ?)) AS tokens
        FROM asked a
    ),
    fits AS (
        SELECT bool_and((rpm IS NULL OR requests < rpm) AND (tpm IS NULL OR tokens + ? <= tpm))
            AS ok
        FROM used
    ),
    kept AS (
        INSERT INTO key_rates (subject, t, tokens, state, gateway, expires)
        SELECT used.subject, ?, ?, 'reserved', ?, ? FROM used, fits WHERE fits.ok
        RETURNING id, subject
    )
    SELECT used.subject AS subject, used.requests AS requests, used.tokens AS tokens,
           kept.id AS id
    FROM used LEFT JOIN kept ON kept.subject = used.subject
"""
_VALUE = "(CAST(? AS TEXT), CAST(? AS BIGINT), CAST(? AS BIGINT))"
_SETTLE = (
    "UPDATE key_rates SET state = 'used', tokens = ?, used_at = ?, expires = NULL WHERE id = ?"
)


@dataclass(frozen=True, slots=True)
class WindowCount:
    subject: str
    requests: int  # requests in its window before this one, every gateway's
    tokens: int  # tokens used in its window plus live reservations, before this one
    id: int | None  # this request's row; None: some subject had no room, nothing kept


async def reserve(
    store: Store,
    asks: Sequence[tuple[str, int | None, int | None]],
    tokens: int,
    window: float,
    now: float,
    gateway: str,
) -> list[WindowCount]:
    """Count one request of `tokens` estimated tokens in each (subject, rpm, tpm) if every
    one of them still has room in its last `window` seconds, atomically across gateways."""
    values = ", ".join([_VALUE] * len(asks))
    locks = [
        ("SELECT pg_advisory_xact_lock(hashtext(?))", (f"corrallm.rate:{subject}",))
        for subject in sorted(a[0] for a in asks)
    ]
    args = [
        *(x for ask in asks for x in ask),
        now - window,
        now - window,
        now,
        tokens,
        now,
        tokens,
        gateway,
        now + RESERVATION_SECONDS,
    ]
    rows = await store.transact([*locks, (_RESERVE.format(values=values), args)])
    return [WindowCount(r["subject"], int(r["requests"]), int(r["tokens"]), r["id"]) for r in rows]


async def timeline(
    store: Store, subject: str, since: float
) -> tuple[list[float], list[tuple[float, int]]]:
    """A subject's window after `since`: when its requests were admitted, and when each
    settled request's tokens were counted (both oldest first): what Retry-After is
    computed from."""
    rows = await store.query(
        "SELECT t, used_at, tokens, state FROM key_rates "
        "WHERE subject = ? AND (t > ? OR state = 'used' AND used_at > ?)",
        (subject, since, since),
    )
    admitted = sorted(r["t"] for r in rows if r["t"] > since)
    spent = sorted(
        (r["used_at"], int(r["tokens"]))
        for r in rows
        if r["state"] == "used" and r["used_at"] > since
    )
    return admitted, spent


async def prune(store: Store, before: float, now: float) -> None:
    """Forget rows that count for nothing any more: admitted and settled before `before`,
    or reservations expired."""
    await store.execute(
        "DELETE FROM key_rates WHERE t <= ? "
        "AND (state = 'used' AND used_at <= ? OR state = 'reserved' AND expires <= ?)",
        (before, before, now),
    )


class RateLog(QueuedWrites):
    """Settlements on their way to the shared store: a reservation's row gets the
    request's metered tokens (no I/O on the request path)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, (_SETTLE,), "rate limits")

    def settle(self, reservation: int, tokens: int, now: float) -> None:
        self.queue(_SETTLE, (tokens, now, reservation))
