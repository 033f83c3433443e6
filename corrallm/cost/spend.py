"""Spend limits (SPEC §6 S6): a lane's dollars over a sliding window, checked at admission.

A request reserves its estimated cost before it is forwarded and holds the reservation
until its real cost is known, so a burst of concurrent requests cannot overspend: each
one sees the others' reservations. Pure: the clock is passed in.

This is the whole story on an embedded store. Gateways sharing a PostgreSQL store reserve
in the database instead (store/spend.py, through cost/ledger.py), and keep a window here
only as their fallback while the database cannot be reached; `retry_after` answers the
same question for both.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SpendWindow:
    limit_usd: float
    window: float
    _spent: deque[tuple[float, float]] = field(default_factory=deque)  # (t, usd), oldest first
    _total: float = 0.0
    reserved: float = 0.0

    def spent(self, now: float) -> float:
        self._expire(now)
        return self._total

    def try_reserve(self, usd: float, now: float) -> float | None:
        """Reserve `usd`; None if admitted, else seconds until enough spend leaves the window."""
        self._expire(now)
        over = self._total + self.reserved + usd - self.limit_usd
        if over <= 1e-12:
            self.reserved += usd
            return None
        return retry_after(self._spent, over, self.window, now)

    def settle(self, reserved: float, actual: float, now: float) -> None:
        """The request's real cost replaces its reservation."""
        self.reserved = max(0.0, self.reserved - reserved)
        self.add(actual, now)

    def add(self, usd: float, now: float) -> None:
        if usd > 0:
            self._spent.append((now, usd))
            self._total += usd

    def _expire(self, now: float) -> None:
        while self._spent and self._spent[0][0] <= now - self.window:
            self._total -= self._spent.popleft()[1]
        if not self._spent:
            self._total = 0.0  # no drift from float sums


def retry_after(
    spent: Iterable[tuple[float, float]], over: float, window: float, now: float
) -> float:
    """Seconds until `over` dollars of `spent` ((t, usd), oldest first) have left a window
    of `window` seconds: at least 1; a whole window when all of it would not be enough."""
    freed = 0.0
    for t, amount in spent:
        freed += amount
        if freed >= over:
            return max(1.0, t + window - now)
    return window  # even an empty window would not hold it: come back after one
