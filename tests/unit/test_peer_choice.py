"""X1, X2: where a peer's backends stand among a model's (the topology), and the live
choice among equal backends (routing/choice.py and the scheduling core's `rank`). Pure:
no process, no socket; the peers' state is set as their overview would set it."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from corrallm.config import Config, load_config_text
from corrallm.lifecycle.state import State
from corrallm.peers.nodes import Nodes
from corrallm.routing.choice import ranks
from corrallm.scheduler.core import Admit, GroupSpec, Policy, Queued, Request, Scheduler
from corrallm.topology import Topology, build

CONFIG = """
peers:
  box2: {url: "http://10.0.0.2:6502/", token: t2}
  box3: {url: "http://10.0.0.3:6502", token: t3}
models:
  m:
    backends:
      - {name: big, cmd: "x --port ${PORT}", proxy: "${PORT}", quality: 100}
      - {name: big2, cmd: "x --port ${PORT}", proxy: "${PORT}", quality: 100}
      - {name: small, cmd: "x --port ${PORT}", proxy: "${PORT}", quality: 50}
"""


@dataclass(eq=False)
class Process:
    """A local backend as routing sees it (a Supervisor's surface)."""

    id: str
    state: State = State.STOPPED
    last_load_seconds: float | None = None
    in_flight: int = 0
    last_used: float = 0.0

    def available(self) -> bool:
        return True


def remote(name: str, state: str = "ready", quality: int = 100, **fields: Any) -> dict[str, Any]:
    backend = {"id": f"{name}#0", "state": state, "quality": quality, "type": "chat"}
    backend.update({"max_concurrent": 1, "in_flight": 0, "waiting": 0, **fields})
    return {"name": name, "aliases": [f"{name}-alias"], "paused": False, "backends": [backend]}


def cluster(
    order: str = "last", box2: list[dict[str, Any]] = (), box3: list[dict[str, Any]] = ()
) -> tuple[Config, Nodes, Topology]:
    config = load_config_text(textwrap.dedent(CONFIG) + f"peerOrder: {order}\n", env={})
    nodes = Nodes(rebuild=lambda: None, moved=lambda view: None)
    nodes.reconfigure(config)
    for name, models in (("box2", box2), ("box3", box3)):
        nodes.views[name].up = True
        nodes.views[name].apply_overview({"models": list(models)})
    topo = build(config, make=lambda sid, spec: Process(sid), nodes=nodes)  # type: ignore[arg-type,return-value]
    return config, nodes, topo


def tier_ids(topo: Topology, model: str) -> list[list[str]]:
    return [[r.id for r in tier] for tier in topo.models[model].tiers_for(None)]


def test_X1_peer_backends_follow_the_local_ones_of_their_quality() -> None:
    _, _, topo = cluster(box2=[remote("m")], box3=[remote("m", quality=50)])
    assert [r.id for r in topo.models["m"].routes] == ["big", "big2", "m@box2", "small", "m@box3"]
    assert tier_ids(topo, "m") == [["big", "big2", "m@box2"]]
    peer = topo.routes["m@box2"]
    assert (peer.config.peer, peer.config.proxy, peer.config.model) == (
        "box2",
        "http://10.0.0.2:6502",  # the trailing slash dropped
        "m",
    )


def test_X1_peer_order_first_puts_them_before() -> None:
    _, _, topo = cluster("first", box2=[remote("m")], box3=[remote("m", quality=50)])
    assert [r.id for r in topo.models["m"].routes] == ["m@box2", "big", "big2", "m@box3", "small"]


def test_X1_a_model_only_peers_serve_is_served_with_the_first_peers_aliases() -> None:
    _, _, topo = cluster(box2=[remote("far")], box3=[remote("far", quality=70)])
    served = topo.models["far"]
    assert [r.id for r in served.routes] == ["far@box2", "far@box3"]
    assert topo.models["far-alias"] is served
    assert not served.local
    assert topo.models["m"].local


def test_X1_a_hop_never_goes_to_a_peer_again() -> None:
    _, _, topo = cluster(box2=[remote("m"), remote("far")])
    local = topo.models["m"].tiers_for(None, local_only=True)
    assert [[r.id for r in tier] for tier in local] == [["big", "big2"]]
    # A model only peers serve has no local backend: the primary answers (the pipeline
    # refuses such a hop with 404 before it gets here).
    assert [[r.id for r in t] for t in topo.models["far"].tiers_for(None, local_only=True)] == [
        ["far@box2"]
    ]


def test_X1_X4_a_peer_down_leaves_the_tiers_and_its_endpoint_survives_rebuilds() -> None:
    config, nodes, topo = cluster(box2=[remote("m")])
    endpoint = topo.routes["m@box2"].endpoint
    nodes.views["box2"].up = False
    assert tier_ids(topo, "m") == [["big", "big2"]]
    assert endpoint.state is State.STOPPED
    again = build(config, make=lambda sid, spec: Process(sid), nodes=nodes)  # type: ignore[arg-type,return-value]
    assert again.routes["m@box2"].endpoint is endpoint  # its in-flight count kept


def test_X2_ranks_ready_with_a_free_slot_then_expected_wait_then_local() -> None:
    _, nodes, topo = cluster(box2=[remote("m")], box3=[remote("m", service_seconds=2.0)])
    routes = topo.routes
    routes["big2"].endpoint.state = State.READY  # type: ignore[misc]
    routes["big"].endpoint.last_load_seconds = 3.0  # type: ignore[attr-defined]
    box3 = nodes.views["box3"].models["m"].backends[0]
    box3.in_flight, box3.waiting = 1, 2
    tiers = topo.models["m"].tiers_for(None)
    assert ranks(tiers, peers_first=False) == {
        "big": (1, 3.0, 0),  # not loaded: its last start
        "big2": (0, 0.0, 0),  # ready here: best
        "m@box2": (0, 0.0, 1),  # ready there with a free slot: after the local one
        "m@box3": (1, 2 * 2.0, 1),  # busy there: two waiting, 2 s each, one slot
    }
    assert ranks(tiers, peers_first=True)["m@box2"] == (0, 0.0, 0)
    assert ranks(tiers, peers_first=True)["big2"] == (0, 0.0, 1)


def test_X2_a_peer_that_stopped_serving_the_model_ranks_last() -> None:
    _, nodes, topo = cluster(box2=[remote("m")])
    endpoint = topo.routes["m@box2"].endpoint
    nodes.views["box2"].models.clear()
    assert endpoint.rank() == (1, float("inf"))  # type: ignore[attr-defined]


def test_X2_the_core_takes_the_best_ranked_backend_with_room() -> None:
    s = Scheduler([GroupSpec("default", 1)], 64)
    for backend, slots in (("local", 1), ("box2", 1), ("box3", 2)):
        s.add_backend(backend, slots)
    tier = [["local", "box2", "box3"]]
    q = Policy(queue=True)

    def rank(**r: tuple[float, ...]) -> dict[str, tuple[float, ...]]:
        return {"local": (1, 9.0, 0), "box2": (0, 0.0, 1), "box3": (1, 1.0, 1)} | r

    decisions = [
        s.submit(Request(1, "default", 0), tier, q, 0, rank=rank()),  # box2: free there
        # box2 is full here: among the others with room, the shorter expected wait
        s.submit(Request(2, "default", 0), tier, q, 0, rank=rank()),
        # box3's second slot: its rank beats local's, though local runs fewer (0 to 1)
        s.submit(Request(3, "default", 0), tier, q, 0, rank=rank()),
        s.submit(Request(4, "default", 0), tier, q, 0, rank=rank()),  # local: last with room
        # all full: it queues as without ranks (fewest waiting, first in the tier)
        s.submit(Request(5, "default", 0), tier, q, 0, rank=rank(local=(0, 0.0, 0))),
        *s.release(3, 1.0),  # nobody waits at box3 or box2: nothing to hand out
        *s.release(1, 1.0),
        # a tie on rank: the fewest running (box2: 0, box3: 1)
        s.submit(Request(6, "default", 2), tier, q, 2, rank=rank(box3=(0, 0.0, 1))),
    ]
    assert decisions == [
        Admit(1, "box2"),
        Admit(2, "box3"),
        Admit(3, "box3"),
        Admit(4, "local"),
        Queued(5, "local"),
        Admit(6, "box2"),
    ]


def test_X2_a_request_of_ours_that_left_frees_its_slot_before_the_peer_reports_it() -> None:
    # The peer reports its load once a second; the gateway knows its own at once.
    _, nodes, topo = cluster(box2=[remote("m")])
    endpoint = topo.routes["m@box2"].endpoint
    view = nodes.views["box2"]
    busy = {"backends": [{"backend": "m#0", "in_flight": 1, "waiting": 0}]}
    idle = {"backends": [{"backend": "m#0", "in_flight": 0, "waiting": 0}]}
    ranked = [endpoint.rank()]  # type: ignore[attr-defined]
    endpoint.enter()
    ranked.append(endpoint.rank())  # type: ignore[attr-defined]
    view.apply_event("admission", busy)
    ranked.append(endpoint.rank())  # type: ignore[attr-defined]
    endpoint.leave()
    ranked.append(endpoint.rank())  # type: ignore[attr-defined]
    view.apply_event("admission", idle)
    ranked.append(endpoint.rank())  # type: ignore[attr-defined]
    assert ranked == [(0, 0.0), (1, 0.0), (1, 0.0), (0, 0.0), (0, 0.0)]
    assert endpoint.in_flight == 0
