"""The gateway's periodic work, off the request path: the reaper (every second: expired
leases, live admission load, ttl-expired residents, expired pauses) and housekeeping
(queue depth sampled every few seconds, C4; activity past retention pruned hourly).
Each pass that fails is logged and tried again; neither loop ever dies of an error."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from corrallm.events import EventBus
from corrallm.lifecycle.pauses import Pauses
from corrallm.residency.manager import Residency
from corrallm.scheduler.admission import Admission
from corrallm.store import queries
from corrallm.store.db import Store
from corrallm.telemetry import Telemetry

log = logging.getLogger("corrallm.lifecycle")

REAPER_SECONDS = 1.0
QUEUE_SAMPLE_SECONDS = 5.0
PRUNE_SECONDS = 3600.0


async def reaper(
    admission: Admission, telemetry: Telemetry, residency: Residency, pauses: Pauses
) -> None:
    while True:
        await asyncio.sleep(REAPER_SECONDS)
        try:
            admission.expire_leases()
            telemetry.publish_load()
            await residency.reap_expired()
            await pauses.expire()
        except Exception:
            log.exception("reaper pass failed; trying again")


async def housekeeping(
    admission: Admission,
    route_ids: Callable[[], Iterable[str]],
    store: Store,
    events: EventBus,
    retention: float,
) -> None:
    last_prune = 0.0
    while True:
        await asyncio.sleep(QUEUE_SAMPLE_SECONDS)
        try:
            now = time.time()
            samples = []
            for route_id in route_ids():
                _, in_flight, waiting = admission.core.load(route_id)
                if waiting or in_flight:  # an idle backend's absence reads as zero
                    samples.append((route_id, waiting, in_flight))
            await queries.record_queue_depth(store, now, samples)
            events.publish(
                "queue_depth",
                {"points": [{"backend": b, "waiting": w, "in_flight": f} for b, w, f in samples]},
            )
            if now - last_prune >= PRUNE_SECONDS:
                last_prune = now
                pruned = await queries.prune(store, now - retention)
                if pruned:
                    log.info("pruned %d activity rows older than the retention", pruned)
        except Exception:
            log.exception("housekeeping pass failed; trying again")
