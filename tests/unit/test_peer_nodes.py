"""peers/nodes.py on a reload (SPEC §19 X4): a new `peerTimeout` restarts the followers
with it, keeping each peer's view (and so its up state and endpoints); an unchanged
config leaves them running. The peer is a closed loopback port: the followers only try."""

from __future__ import annotations

import asyncio

from corrallm.config import load_config_text
from corrallm.peers.nodes import Nodes
from tests.support.processes import free_port


def config(timeout: str) -> str:
    return (
        f"peerTimeout: {timeout}\n"
        f"peers: {{box2: {{url: 'http://127.0.0.1:{PORT}', token: t2}}}}\n"
        "models: {}\n"
    )


PORT = free_port()


async def test_X4_a_new_peer_timeout_restarts_the_followers_and_keeps_the_views() -> None:
    nodes = Nodes(rebuild=lambda: None, moved=lambda view: None)
    nodes.reconfigure(load_config_text(config("2s"), env={}))
    await nodes.start()
    try:
        view, task = nodes.views["box2"], nodes._tasks["box2"]
        view.up = True  # as if its stream were open
        nodes.reconfigure(load_config_text(config("2s"), env={}))
        assert nodes._tasks["box2"] is task  # nothing changed: the same follower

        nodes.reconfigure(load_config_text(config("7s"), env={}))
        assert nodes._tasks["box2"] is not task
        assert nodes.views["box2"] is view and view.up
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert nodes._timeout == 7.0
    finally:
        await nodes.close()
