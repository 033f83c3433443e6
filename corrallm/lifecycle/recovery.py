"""After a crash of corrallm (SPEC §4 L5): re-adopt every recorded backend whose health
check answers, and stop the recorded processes of backends no longer configured (they
are ours: their PID record says so). Nothing it did not start is ever signalled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from pathlib import Path

from corrallm.lifecycle.pidrecords import PidRecords
from corrallm.lifecycle.process import adopt, stop_group
from corrallm.lifecycle.supervisor import Supervisor

ORPHAN_GRACE = 10.0


async def recover(home: Path, supervisors: Mapping[str, Supervisor]) -> None:
    records = PidRecords(home)
    adoptions: list[Awaitable[object]] = []
    for record in records.all():
        sup = supervisors.get(record.backend)
        if sup is not None:
            adoptions.append(sup.adopt(record))
        elif record.is_alive():
            proc = adopt(record.pid, record.started)
            adoptions.append(stop_group(record.pgid, proc.exited, ORPHAN_GRACE))
            records.remove(record.backend)
        else:
            records.remove(record.backend)
    await asyncio.gather(*adoptions)
