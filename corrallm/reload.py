"""Config hot reload (SPEC §10 P6): `SIGHUP` or `POST /api/v1/config/reload`.

The new file is validated first; a bad one is refused with every problem listed and the
old config stays in force. Otherwise the gateway's tables are rebuilt in place:
unchanged backends keep their running process and keep serving; changed ones are
drained and stopped, and their replacement starts on demand only once the old process
is gone; removed ones are drained and stopped; new ones are available at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from corrallm.config import Config, load_config, load_demo_config
from corrallm.gateway import Gateway
from corrallm.lifecycle.state import State

log = logging.getLogger("corrallm.reload")


@dataclass
class Report:
    kept: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)


def read_config(gateway: Gateway) -> Config:
    """The config file gateway was started with, read anew (ConfigError if it is bad)."""
    path = gateway.config_path
    return load_config(path) if path else load_demo_config()


async def reload(gateway: Gateway, config: Config) -> Report:
    before = dict(gateway.supervisors)
    gateway.configure(config)
    gateway.pauses.targets = gateway._pausables()
    gateway.admission.reconfigure(config, gateway.routes)
    gateway.ledger.reconfigure(config)
    after = gateway.supervisors
    report = Report(
        kept=sorted(s for s in after if before.get(s) is after[s]),
        added=sorted(s for s in after if s not in before),
    )
    for sid, old in before.items():
        if after.get(sid) is old:
            continue
        (report.restarted if sid in after else report.removed).append(sid)
        retiring = asyncio.create_task(old.retire(), name=f"retire-{sid}")
        gateway._tasks.add(retiring)
        retiring.add_done_callback(gateway._tasks.discard)
        if sid in after:  # its replacement never starts before the old process is gone
            after[sid].follows(retiring)
    await _pause_replacements(gateway)
    for served in gateway.served:
        if served.config.persistent and not gateway.pauses.paused("model", served.name):
            gateway._background(gateway._preload(served))
    log.info(
        "config reloaded: kept=%s restarted=%s removed=%s added=%s",
        report.kept,
        report.restarted,
        report.removed,
        report.added,
    )
    return report


async def _pause_replacements(gateway: Gateway) -> None:
    """New processes of paused models and extensions start out paused too."""
    for (kind, name), _ in list(gateway.pauses.until.items()):
        target = gateway.pauses.targets.get((kind, name))
        if target is not None and gateway.pauses.paused(kind, name):
            for sup in target.supervisors:
                if sup.state is not State.PAUSED:
                    await sup.pause()
