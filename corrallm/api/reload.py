"""Config hot reload (SPEC §10 P6): `SIGHUP` or `POST /api/v1/config/reload`.

The new file is validated first; a bad one is refused with every problem listed and the
old config stays in force. Otherwise the gateway swaps in the new config's topology
(`Gateway.reconfigure`): unchanged backends keep their running process and keep serving;
changed ones are retired (drained and stopped) and their replacement starts on demand
only once the old process is gone (`Supervisor.follows`); removed ones are retired; new
ones are available at once. The long-lived owners (admission, ledger, residency, pauses,
the economics ledger, metrics) are kept, with what they have counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from corrallm.config import Config, load_config, load_demo_config
from corrallm.gateway import Gateway
from corrallm.lifecycle.state import State
from corrallm.residency.footprints import footprint_problems
from corrallm.store.db import StoreUnavailable

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
    return load_config(path, checks=[footprint_problems]) if path else load_demo_config()


async def reload(gateway: Gateway, config: Config) -> Report:
    before = gateway.reconfigure(config).supervisors
    after = gateway.supervisors
    report = Report(
        kept=sorted(s for s in after if before.get(s) is after[s]),
        added=sorted(s for s in after if s not in before),
    )
    for sid, old in before.items():
        if after.get(sid) is old:
            continue
        (report.restarted if sid in after else report.removed).append(sid)
        retiring = gateway.background(old.retire())
        if sid in after:  # its replacement never starts before the old process is gone
            after[sid].follows(retiring)
    await _pause_replacements(gateway)
    if gateway.store.dialect.shared:
        # X5: a model this reload added may be paused by another gateway already.
        try:
            await gateway.pauses.sync()
        except StoreUnavailable as exc:
            log.warning("shared pauses not read after the reload (next notice applies): %s", exc)
    gateway.preload()
    await gateway.in_force()  # `serve --workers`: the caller's next request meets it
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
    for kind, name in list(gateway.pauses.until):
        target = gateway.pauses.targets.get((kind, name))
        if target is not None and gateway.pauses.paused(kind, name):
            for sup in target.supervisors:
                if sup.state is not State.PAUSED:
                    await sup.pause()
