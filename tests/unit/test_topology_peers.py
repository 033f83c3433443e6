"""SPEC §19 X1: a peer's models as further backends of the topology, in order, and the
local-only tiers of a request that crossed a hop. Pure: no process, no socket."""

from __future__ import annotations

import textwrap

from corrallm.config import load_config_text
from corrallm.lifecycle.state import State
from corrallm.peers.catalog import PeerView
from corrallm.peers.nodes import Nodes
from corrallm.topology import build

CONFIG = """
peers:
  b: {url: "http://127.0.0.1:7001/", token: tb}
  c: {url: "http://127.0.0.1:7002", token: tc}
{order}
models:
  m:
    backends:
      - proxy: http://127.0.0.1:9001
        maxConcurrent: 2
      - proxy: http://127.0.0.1:9002
        quality: 50
"""


def overview(*models: tuple[str, int, str]) -> dict[str, object]:
    """Models as (name, quality, state), each with one backend of 2 slots, plus one
    backend the peer serves from its own peer (never imported)."""
    return {
        "models": [
            {
                "name": name,
                "aliases": [f"{name}-alias"],
                "paused": False,
                "backends": [
                    {"id": f"{name}#0", "state": state, "quality": quality, "max_concurrent": 2},
                    {"id": f"{name}@far", "state": "ready", "quality": quality, "peer": "far"},
                ],
            }
            for name, quality, state in models
        ]
    }


def topology(order: str = "", **views: dict[str, object]):  # type: ignore[no-untyped-def]
    config = load_config_text(textwrap.dedent(CONFIG.replace("{order}", order)), env={})
    nodes = Nodes(lambda: None, lambda view: None)
    nodes.reconfigure(config)
    for name, data in views.items():
        view = nodes.views[name]
        view.apply_overview(data)
        view.up = True
    return build(config, make=lambda sid, spec: None, nodes=nodes), nodes  # type: ignore[arg-type,return-value]


def test_X1_peer_backends_follow_the_local_ones_of_their_quality() -> None:
    topo, _ = topology(b=overview(("m", 100, "ready")), c=overview(("m", 50, "stopped")))
    served = topo.models["m"]
    assert [(r.id, r.config.quality, r.config.peer) for r in served.routes] == [
        ("m#0", 100, None),
        ("m@b", 100, "b"),
        ("m#1", 50, None),
        ("m@c", 50, "c"),
    ]
    assert served.routes[1].endpoint.base_url == "http://127.0.0.1:7001"
    assert served.routes[1].config.max_concurrent == 2  # the peer's own slots, not its peer's


def test_X1_peer_order_first_puts_them_before() -> None:
    topo, _ = topology("peerOrder: first", b=overview(("m", 100, "ready")))
    assert [r.id for r in topo.models["m"].routes] == ["m@b", "m#0", "m#1"]


def test_X1_a_model_only_a_peer_serves_is_served_here_with_its_aliases() -> None:
    topo, _ = topology(b=overview(("whisper", 100, "ready")))
    served = topo.models["whisper-alias"]
    assert (served.name, [r.id for r in served.routes], served.local) == (
        "whisper",
        ["whisper@b"],
        False,
    )


def test_X1_a_request_from_another_gateway_gets_only_local_tiers() -> None:
    topo, _ = topology(b=overview(("m", 100, "ready")))
    served = topo.models["m"]
    assert [[r.id for r in t] for t in served.tiers_for(None, local_only=True)] == [["m#0"]]
    assert [[r.id for r in t] for t in served.tiers_for(None)] == [["m#0", "m@b"]]


def test_X4_a_down_peer_leaves_the_tiers_but_not_the_topology() -> None:
    topo, nodes = topology(b=overview(("m", 100, "ready")))
    nodes.views["b"].up = False
    served = topo.models["m"]
    assert [r.id for r in served.routes] == ["m#0", "m@b", "m#1"]
    assert [[r.id for r in t] for t in served.tiers_for(None)] == [["m#0"]]
    assert served.routes[1].endpoint.state is State.STOPPED


def test_X1_endpoints_survive_a_rebuild_and_retire_when_the_model_leaves() -> None:
    topo, nodes = topology(b=overview(("m", 100, "ready")))
    endpoint = topo.routes["m@b"].endpoint
    again = build(topo.config, make=lambda sid, spec: None, nodes=nodes)  # type: ignore[arg-type,return-value]
    assert again.routes["m@b"].endpoint is endpoint
    nodes.views["b"].apply_overview(overview(("other", 100, "ready")))
    build(topo.config, make=lambda sid, spec: None, nodes=nodes)  # type: ignore[arg-type,return-value]
    assert endpoint.retired and not endpoint.available()


def test_X1_peer_views_ignore_unknown_peers_of_the_peer() -> None:
    view = PeerView("b", "http://x")
    view.apply_overview(overview(("m", 100, "ready")))
    assert [b.id for b in view.models["m"].backends] == ["m#0"]
