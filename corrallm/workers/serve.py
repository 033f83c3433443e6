"""`corrallm serve --workers N` (N > 1): this process becomes the owner of state, and N
relaying workers serve the address.

The owner runs the whole gateway as a single process does (supervisors, residency, the
scheduler, pauses, the ledger, the store, peers, the live list, captures, the
management API and the dashboard), its full app listening on a Unix socket the workers
relay every non-pipeline path to, and the hop server (owner.py) the workers ask for
admission. It binds the gateway's address too, without listening on it: a busy address
still stops `serve` at once, and the port is held while the workers come and go.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile

from corrallm.api.auth import ensure_token
from corrallm.config import Config
from corrallm.observe.redaction import install
from corrallm.server import GRACEFUL_SHUTDOWN_SECONDS, LOG_FORMAT, ServeOptions, build, listen
from corrallm.workers.owner import Owner
from corrallm.workers.pool import Pool

log = logging.getLogger("corrallm.workers")


def run(config: Config, options: ServeOptions, workers: int) -> None:
    if config.peers:
        # A worker routes to local backends only; a peer's route (and its signed lane,
        # X3) is the owner's alone. Refused at once rather than served half.
        raise SystemExit(
            "corrallm serve: --workers does not serve peers yet (the config has peers: "
            f"{', '.join(config.peers)}); run it with --workers 1"
        )
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    held = listen(options.addr, reuse_port=True)  # bound, never listening: the workers do
    folder = tempfile.mkdtemp(prefix="corrallm-")  # 0700: only this user reaches the hop
    try:
        http = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        http.bind(os.path.join(folder, "http.sock"))
        served = build(config, options, sock=http)
        owner = Owner(served.gateway, options.addr, ensure_token(options.home))
        pool = Pool(workers, os.path.join(folder, "hop.sock"))

        async def start() -> None:
            await owner.listen(pool.hop_path)
            await pool.start()
            log.info(
                "%d relaying workers serve %s; this process owns the state", workers, options.addr
            )

        async def stop() -> None:
            await pool.stop(GRACEFUL_SHUTDOWN_SECONDS + 2)
            await owner.close()

        served.app.started.append(start)
        served.app.stopping.append(stop)
        install(served.redactor)
        served.run()
    finally:
        held.close()
        shutil.rmtree(folder, ignore_errors=True)
