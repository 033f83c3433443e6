"""Learned footprints (SPEC §17 M2, §5 R5): what each backend's process really held after
its load, by backend and command line, kept in memory and in the store.

The residency measures a process once it is ready (its reader, in a worker thread) and
hands the reading here: `in_pools` maps it onto the server's pools, `Learning.record`
keeps it (and writes it to the store off the request path), `mismatches` says where the
declaration or the estimate was off by more than 10 %. A restarted corrallm reads what
earlier runs learned (`restore`) and plans with it before the first load of this run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from corrallm.config.schema import ANY_GPU, Server
from corrallm.residency.placement import gpu_index
from corrallm.store import footprints as table
from corrallm.store.db import Store, StoreUnavailable

log = logging.getLogger("corrallm.residency")

OFF_BY = 0.10  # R5: a declaration (or estimate) further than this from the measurement


def in_pools(
    held: Mapping[str, int], server: Server, gpus: Sequence[str], placed: str | None
) -> dict[str, int]:
    """A reading (`system`, `gpu<N>` by NVML device) as the server's pools: device N is the
    pool whose index is N (M3: `gpu1`, or the second of non-numbered `gpus`); what it holds
    on the GPU it was placed on is kept under `gpu`, so it follows the backend to whichever
    GPU it gets next. Pools the server does not have are dropped."""
    by_index = {gpu_index(pool, gpus): pool for pool in gpus}
    out: dict[str, int] = {}
    for name, n in held.items():
        pool = name
        if name not in server.pools and name.startswith("gpu") and name[3:].isdigit():
            pool = by_index.get(name[3:], name)
        if pool not in server.pools:
            continue
        if placed is not None and pool == placed:
            pool = ANY_GPU
        out[pool] = out.get(pool, 0) + n
    return out


def mismatches(
    measured: Mapping[str, int],
    declared: Mapping[str, int] | None,
    estimated: Mapping[str, int] | None,
) -> list[tuple[str, str, int, int]]:
    """R5: (pool, "declared" or "estimated", what it said, what was measured) for each pool
    where the declaration, else the estimate, is off by more than 10 % (or silent)."""
    if declared is not None:
        basis, kind = declared, "declared"
    elif estimated is not None:
        basis, kind = estimated, "estimated"
    else:
        return []
    off = []
    for pool, real in sorted(measured.items()):
        said = basis.get(pool, 0)
        if said == 0 or abs(real - said) > OFF_BY * said:
            off.append((pool, kind, said, real))
    return off


class Learning:
    """Learned footprints by (backend id, command key); the store is where they outlive
    this run (None until the gateway opens it, and in tests built without one)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.learned: dict[table.Key, dict[str, int]] = {}
        self.store: Store | None = None

    async def restore(self, store: Store) -> None:
        """Read what earlier runs learned; what this run measured already prevails."""
        try:
            stored = await table.read(store)
        except StoreUnavailable as exc:
            log.warning("learned footprints not read: %s; planning with declarations", exc)
            stored = {}
        self.learned = {**stored, **self.learned}
        self.store = store

    def get(self, backend: str, command: str) -> dict[str, int] | None:
        found = self.learned.get((backend, command))
        return dict(found) if found is not None else None

    async def record(self, backend: str, command: str, measured: Mapping[str, int]) -> None:
        """Keep a new measurement (it replaces the last one of that backend and command)."""
        self.learned[(backend, command)] = dict(measured)
        if self.store is None:
            return
        try:
            await table.save(self.store, backend, command, measured, self.wall())
        except StoreUnavailable as exc:
            log.warning("learned footprint of backend=%s not stored: %s", backend, exc)
