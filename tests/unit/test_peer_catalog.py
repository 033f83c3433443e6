"""X1, X2: what a gateway knows of a peer, from its overview and then its events. Pure."""

from __future__ import annotations

from typing import Any

import pytest

from corrallm.lifecycle.state import State
from corrallm.peers.catalog import PeerView


def backend(id: str, state: str = "stopped", **fields: Any) -> dict[str, Any]:
    return {
        "id": id,
        "state": state,
        "quality": 100,
        "type": "chat",
        "max_concurrent": 1,
        "in_flight": 0,
        "waiting": 0,
        "peer": None,
        "modes": [],
        "service_seconds": None,
        "load_seconds": None,
        **fields,
    }


def overview(*models: dict[str, Any]) -> dict[str, Any]:
    return {"models": list(models), "servers": [], "peers": []}


def model(name: str, *backends: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"name": name, "aliases": [], "paused": False, "backends": list(backends), **fields}


def view(*models: dict[str, Any]) -> PeerView:
    v = PeerView("box2", "http://10.0.0.2:6502", up=True)
    v.apply_overview(overview(*models))
    return v


def test_X1_overview_imports_only_the_peers_own_backends() -> None:
    v = view(
        model("m", backend("m#0", "ready"), backend("m@box3", "ready", peer="box3")),
        model("far", backend("far@box3", "ready", peer="box3")),  # only its peers serve it
        model("e", aliases=["e-alias"]) | {"backends": [backend("e#0", max_concurrent=3)]},
    )
    assert set(v.models) == {"m", "e"}
    assert [b.id for b in v.models["m"].backends] == ["m#0"]
    assert v.models["e"].aliases == ("e-alias",) and v.models["e"].capacity == 3


def test_X1_a_fresh_overview_replaces_what_was_known() -> None:
    v = view(model("m", backend("m#0")), model("old", backend("old#0")))
    v.apply_overview(overview(model("m", backend("m#0", "ready"), backend("m#1"))))
    assert set(v.models) == {"m"}
    assert [(b.id, b.state) for b in v.models["m"].backends] == [
        ("m#0", State.READY),
        ("m#1", State.STOPPED),
    ]


def test_X1_the_shape_changes_with_what_routes_are_built_from_only() -> None:
    v = view(model("m", backend("m#0", max_concurrent=2)))
    shape = v.shape()
    v.apply_event("lifecycle", {"backend": "m#0", "models": ["m"], "new": "ready"})
    v.apply_event("admission", {"backends": [{"backend": "m#0", "in_flight": 2, "waiting": 1}]})
    assert v.shape() == shape  # live state is not a rebuild
    v.apply_overview(overview(model("m", backend("m#0", max_concurrent=3))))
    assert v.shape() != shape


def test_X2_events_fold_in() -> None:
    v = view(model("m", backend("m#0"), backend("m#1", max_concurrent=2)))
    assert v.apply_event("lifecycle", {"backend": "m#1", "models": ["m"], "new": "starting"})
    assert v.apply_event("lifecycle", {"backend": "m#1", "models": ["m"], "new": "ready"})
    assert v.apply_event(
        "admission",
        {
            "backends": [
                {"backend": "m#1", "capacity": 2, "in_flight": 2, "waiting": 3},
                {"backend": "m@box3", "in_flight": 1, "waiting": 0},  # its peer's: not ours
            ]
        },
    )
    remote = v.models["m"]
    assert remote.state is State.READY  # the best of its backends'
    assert [(b.state, b.in_flight, b.waiting) for b in remote.backends] == [
        (State.STOPPED, 0, 0),
        (State.READY, 2, 3),
    ]
    shown = v.view()["models"][0]
    assert (shown["backend"], shown["state"], shown["capacity"]) == ("m@box2", "ready", 3)
    assert (shown["in_flight"], shown["waiting"]) == (2, 3)


def test_X2_an_event_naming_an_unknown_backend_asks_for_the_overview_again() -> None:
    v = view(model("m", backend("m#0")))
    assert not v.apply_event("lifecycle", {"backend": "new#0", "models": ["new"], "new": "ready"})
    # An extension's transition serves no model: nothing to import, nothing stale.
    assert v.apply_event("lifecycle", {"backend": "extension:sh", "models": [], "new": "ready"})


def test_X2_an_unknown_state_reads_as_failed() -> None:
    v = view(model("m", backend("m#0", "ready")))
    v.apply_event("lifecycle", {"backend": "m#0", "models": ["m"], "new": "melting"})
    assert v.models["m"].backends[0].state is State.FAILED
    assert view(model("m", backend("m#0", "?"))).models["m"].state is State.FAILED


def test_X2_a_paused_model_shows_paused() -> None:
    v = view(model("m", backend("m#0", "ready"), paused=True))
    assert v.models["m"].state is State.PAUSED


def test_X2_free_slot_needs_ready_room_and_nobody_waiting() -> None:
    v = view(model("m", backend("m#0", "ready", max_concurrent=2)))
    remote = v.models["m"]
    assert remote.free_slot()
    remote.backends[0].in_flight = 1
    assert remote.free_slot()
    remote.backends[0].in_flight = 2
    assert not remote.free_slot()
    remote.backends[0].in_flight, remote.backends[0].waiting = 0, 1
    assert not remote.free_slot()  # someone there takes that slot first
    remote.backends[0].waiting, remote.backends[0].state = 0, State.STARTING
    assert not remote.free_slot()


@pytest.mark.parametrize(
    ("backends", "wait"),
    [
        # ready, nobody waiting: no wait
        ([backend("m#0", "ready", service_seconds=2.0)], 0.0),
        # 3 waiting for 1 slot held 2 s each on average
        ([backend("m#0", "ready", waiting=3, service_seconds=2.0)], 6.0),
        # spread over the slots of all its backends
        (
            [
                backend("m#0", "ready", max_concurrent=2, waiting=3, service_seconds=2.0),
                backend("m#1", "ready", max_concurrent=1, waiting=3, service_seconds=1.0),
            ],
            6 * 2.0 / 3,
        ),
        # nothing loaded: its last start's time on top
        ([backend("m#0", "stopped", waiting=1, service_seconds=2.0, load_seconds=5.0)], 7.0),
        # never started, never served: nothing known, no wait
        ([backend("m#0", "stopped")], 0.0),
        # one backend ready: no start counted
        (
            [
                backend("m#0", "ready", load_seconds=5.0),
                backend("m#1", "stopped", load_seconds=9.0),
            ],
            0.0,
        ),
    ],
)
def test_X2_expected_wait(backends: list[dict[str, Any]], wait: float) -> None:
    assert view(model("m", *backends)).models["m"].expected_wait() == pytest.approx(wait)


def test_X4_view_of_a_peer_down_keeps_its_models_and_says_why() -> None:
    v = view(model("m", backend("m#0", "ready")))
    v.up, v.error = False, "no answer for 5s (peerTimeout)"
    shown = v.view()
    assert (shown["name"], shown["url"], shown["state"]) == ("box2", "http://10.0.0.2:6502", "down")
    assert shown["error"] == "no answer for 5s (peerTimeout)"
    assert [m["name"] for m in shown["models"]] == ["m"]


def test_X2_this_gateways_own_requests_count_until_the_next_report() -> None:
    v = view(model("m", backend("m#0", "ready", max_concurrent=2)))
    remote = v.models["m"]
    report = {"backends": [{"backend": "m#0", "in_flight": 2, "waiting": 0}]}
    remote.since_report = 2  # two of ours entered since the last report
    assert not remote.free_slot()
    v.apply_event("admission", report)  # the report counts them now
    assert remote.since_report == 0 and not remote.free_slot()
    remote.since_report = -1  # one of ours finished there: its slot is free at once
    assert remote.free_slot()
    v.apply_overview(overview(model("m", backend("m#0", "ready", max_concurrent=2))))
    assert v.models["m"].since_report == 0  # a fresh snapshot
