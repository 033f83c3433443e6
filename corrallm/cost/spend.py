"""Spend limits (SPEC §6 S6): a lane's dollars over a sliding window, checked at admission.

A request reserves its estimated cost before it is forwarded and holds the reservation
until its real cost is known, so a burst of concurrent requests cannot overspend: each
one sees the others' reservations. Pure: the clock is passed in.
"""

from __future__ import annotations

from collections import deque
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
        freed = 0.0
        for t, amount in self._spent:
            freed += amount
            if freed >= over:
                return max(1.0, t + self.window - now)
        return self.window  # even an empty window would not hold it: come back after one

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
