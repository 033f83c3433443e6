"""The owner of the per-key rate limits (SPEC §22 T3): the pure windows of auth/limits.py
with the I/O around them. Built once by the gateway; the pipeline asks it once per
request, after the key's gates and before the spend reservation, and gives the request
back when it is over (a failure or a client gone included).

On an embedded store everything is counted in memory: asking costs no I/O. Gateways that
share a PostgreSQL store (X5) count rpm and tpm in the database (store/rates.py), one
round trip per request of a key that has such limits, so that a key's limits hold across
them (a limit is passed by at most what one request's usage exceeds its estimate);
settlements are written in batches off the request path. `concurrent` is this gateway's
own (requests held here). A database that fails or is slow falls back to this gateway's
own windows for FALLBACK_SECONDS, with a warning, as the ledger does for spend.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence

from corrallm.auth.keys import Identity
from corrallm.auth.limits import (
    WINDOW,
    Ask,
    Counts,
    Hold,
    Limiter,
    LimitRefusal,
    Remaining,
    breach,
    limited,
    rpm_retry,
    tightest,
    tpm_retry,
)
from corrallm.store import rates as table
from corrallm.store.db import Store, StoreUnavailable

log = logging.getLogger("corrallm.auth")

FALLBACK_SECONDS = 5.0  # a shared store that failed is asked again after this
RESERVE_SECONDS = 2.0  # a shared store slower than this to answer counts as failed
PRUNE_SECONDS = 60.0  # how often rows out of the window are deleted from a shared store
SWEEP_SECONDS = 60.0  # how often idle windows are dropped from memory


def asks_of(identity: Identity | None, user: str | None) -> tuple[Ask, ...]:
    """The subjects a request of this key (and user) is counted in: the key's own limits,
    and its `perUser` limits for the user behind it (T4); () when it has none."""
    if identity is None or identity.limits is None:
        return ()
    if user is None:
        return identity.asks
    per_user = identity.limits.per_user
    if not limited(per_user):
        return identity.asks
    assert per_user is not None
    return (*identity.asks, Ask(f"key:{identity.name}/user:{user}", per_user))


class Throttle:
    def __init__(self, store: Store) -> None:
        self.core = Limiter()
        self.shared: Store | None = store if store.dialect.shared else None
        self.gateway = f"{socket.gethostname()}/{os.getpid()}"
        self.settlements = table.RateLog(store)
        self._fallback_until = 0.0
        self._pruned = 0.0
        self._swept = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    def peek(self, asks: Sequence[Ask]) -> Remaining:
        """What is left now, for an answer refused before the limits were asked (a 400,
        403 or 404). This gateway's own count (no round trip on a shared store)."""
        return self.core.remaining(asks, time.time())

    def counts(self, identity: Identity, user: str | None) -> list[tuple[bytes, bytes]]:
        """The x-ratelimit-* headers of an answer given before the key's limits counted
        its request (a 400, 403 or 404): its counts as they are when it starts."""
        return self.peek(asks_of(identity, user)).headers()

    def admit_now(
        self, asks: Sequence[Ask], estimate: int
    ) -> Hold | tuple[LimitRefusal, Remaining] | None:
        """The verdict in memory, where no shared store counts these asks: no coroutine,
        no I/O (the hot path). None: `admit` must ask the shared store."""
        now = time.time()
        if (
            self.shared is not None
            and now >= self._fallback_until
            and any(a.limits.rpm is not None or a.limits.tpm is not None for a in asks)
        ):
            return None
        verdict = self.core.counted(asks, estimate, now)  # `_local`, a call less
        if isinstance(verdict, LimitRefusal):
            return verdict, self.core.remaining(asks, now)
        return verdict

    def _local(
        self, asks: Sequence[Ask], estimate: int, now: float
    ) -> Hold | tuple[LimitRefusal, Remaining]:
        verdict = self.core.counted(asks, estimate, now)
        if isinstance(verdict, LimitRefusal):
            return verdict, self.core.remaining(asks, now)
        return verdict

    async def admit(
        self, asks: Sequence[Ask], estimate: int
    ) -> Hold | tuple[LimitRefusal, Remaining]:
        """Count one request of `estimate` tokens in each subject if all have room: its
        `Hold`, else why not (and what is left)."""
        now = time.time()
        rates = any(a.limits.rpm is not None or a.limits.tpm is not None for a in asks)
        shared = self.shared is not None and rates and now >= self._fallback_until
        if not shared:
            return self._local(asks, estimate, now)
        refused = self.core.judge(asks, estimate, now, rates=False)
        if refused is not None:
            return refused, self.core.remaining(asks, now)
        hold = self.core.take(asks, estimate, now)
        try:
            got = await self._reserve_shared(asks, estimate, now)
        except BaseException:
            self.core.cancel(hold, now)
            raise
        if got is not None:
            outcome, remaining = got
            if not isinstance(outcome, LimitRefusal):
                hold.headers, hold.rows = remaining.headers(), outcome
                return hold
            self.core.cancel(hold, now)
            return outcome, remaining
        # The store failed: this gateway's own windows decide (this request taken back
        # first, so that it is not counted against itself).
        self.core.cancel(hold, now)
        return self._local(asks, estimate, now)

    async def _reserve_shared(
        self, asks: Sequence[Ask], estimate: int, now: float
    ) -> tuple[list[int] | LimitRefusal, Remaining] | None:
        """rpm and tpm across the gateways: the request's rows, or why not; with what is
        left. None if the store failed."""
        assert self.shared is not None
        store = self.shared
        try:
            async with asyncio.timeout(RESERVE_SECONDS):
                counted = await table.reserve(
                    store,
                    [(a.subject, a.limits.rpm, a.limits.tpm) for a in asks],
                    estimate,
                    WINDOW,
                    now,
                    self.gateway,
                )
                self._prune(now)
                by_subject = {c.subject: c for c in counted}
                kept = [c.id for c in counted if c.id is not None]
                if kept:
                    after = [
                        (a.limits, _counts(by_subject.get(a.subject), 1, estimate)) for a in asks
                    ]
                    return kept, tightest(after)
                before = [(a, _counts(by_subject.get(a.subject), 0, 0)) for a in asks]
                for ask, counts in before:
                    broken = breach(ask.limits, counts, estimate)
                    if broken is not None:
                        rule, limit, used = broken
                        admitted, spent = await table.timeline(store, ask.subject, now - WINDOW)
                        if rule == "rpm":
                            retry = rpm_retry(admitted, limit, now)
                        else:
                            retry = tpm_retry(spent, used + estimate - limit, now)
                        refused = LimitRefusal(rule, ask.subject, limit, used, estimate, retry)
                        return refused, tightest([(a.limits, c) for a, c in before])
                return None  # counted as over, yet nothing broken: ask this gateway's own
        except (StoreUnavailable, TimeoutError) as exc:
            self._fallback_until = now + FALLBACK_SECONDS
            log.warning(
                "rate limits of %s: the shared store failed (%s); counting this gateway's "
                "own requests for %gs",
                asks[0].subject,
                str(exc) or f"no answer in {RESERVE_SECONDS:g}s",
                FALLBACK_SECONDS,
            )
            return None

    def release(self, admitted: Hold, tokens: int) -> None:
        """The request is over: its metered tokens replace its estimate (here, and in the
        shared store through the batched writer)."""
        now = time.time()
        self.core.release(admitted, tokens, now)
        for row in admitted.rows:
            self.settlements.settle(row, tokens, now)
        if now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            self.core.sweep(now)

    async def flush(self) -> None:
        """At shutdown: write the settlements still queued for a shared store."""
        await self.settlements.flush()

    def _prune(self, now: float) -> None:
        """Now and then, delete the shared rows that count for nothing any more (in the
        background: never on the request's way)."""
        if self.shared is None or now - self._pruned < PRUNE_SECONDS:
            return
        self._pruned = now
        store = self.shared

        async def prune() -> None:
            try:
                await table.prune(store, now - WINDOW, now)
            except StoreUnavailable as exc:
                log.warning("rate limits: could not prune the shared store: %s", exc)

        task = asyncio.get_running_loop().create_task(prune())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _counts(counted: table.WindowCount | None, requests: int, tokens: int) -> Counts:
    if counted is None:
        return Counts(requests, tokens)
    return Counts(counted.requests + requests, counted.tokens + tokens)
