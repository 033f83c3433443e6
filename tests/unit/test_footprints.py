"""M2: learned footprints are kept per backend and command line, in the store, and planned
with by a later run before its first load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from corrallm.config.schema import BackendConfig as Backend
from corrallm.config.schema import Server
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.residency import learning
from corrallm.residency.manager import Residency, Tenancy
from corrallm.residency.measure import command_key
from corrallm.store import footprints
from corrallm.store.db import Store

MB = 10**6


@pytest.fixture
async def store(tmp_path):
    s = Store(tmp_path / "corrallm.db")
    await s.open()
    yield s
    await s.close()


async def test_M2_a_footprint_round_trips_through_the_store_and_replaces_the_last(store):
    await footprints.save(store, "a#0", "k1", {"system": 300 * MB, "gpu": 8000 * MB}, 1.0)
    await footprints.save(store, "a#0", "k2", {"system": 100 * MB}, 2.0)
    await footprints.save(store, "a#0", "k1", {"system": 310 * MB}, 3.0)  # the next load
    assert await footprints.read(store) == {
        ("a#0", "k1"): {"system": 310 * MB},
        ("a#0", "k2"): {"system": 100 * MB},
    }


def test_M2_the_key_is_the_command_line_and_what_else_runs_it_not_the_declaration():
    base = Backend(cmd="llama-server -m a.gguf --port ${PORT}", proxy="${PORT}")
    variants = {
        "same": base.model_copy(),
        "other ramUsage": base.model_copy(update={"ram_usage": {"system": MB}}),
        "other name": base.model_copy(update={"name": "renamed"}),
        "other cmd": base.model_copy(update={"cmd": "llama-server -m b.gguf --port ${PORT}"}),
        "other env": base.model_copy(update={"env": {"X": "1"}}),
    }
    assert {k: command_key(v) == command_key(base) for k, v in variants.items()} == {
        "same": True,
        "other ramUsage": True,
        "other name": True,
        "other cmd": False,
        "other env": False,
    }


async def probe(url: str) -> int | None:
    return None


class FakeReader:
    def read(self, pid: int) -> dict[str, int] | None:
        return {"system": 300 * MB}


def residency_with(tmp_path, cmd: str) -> Residency:
    residency = Residency({"box": Server(pools={"system": 1000 * MB})}, reader=FakeReader())
    sup = Supervisor("a#0", Backend(cmd=cmd, proxy="${PORT}"), probe, tmp_path)
    sup.proc = SimpleNamespace(pid=4242)  # type: ignore[assignment]
    residency.track(Tenancy(sup, "box", declared={"system": 50 * MB}))
    return residency


async def test_M2_a_later_run_plans_with_what_an_earlier_one_measured(tmp_path, store):
    first = residency_with(tmp_path, "serve --port ${PORT}")
    await first.restore(store)
    await first._measure(first.tenancies["a#0"].supervisor)
    later = residency_with(tmp_path, "serve --port ${PORT}")
    changed = residency_with(tmp_path, "serve --big --port ${PORT}")
    await later.restore(store)
    await changed.restore(store)
    assert {
        "later": later.tenancies["a#0"].usage,
        "changed cmd": changed.tenancies["a#0"].usage,
    } == {"later": {"system": 315 * MB}, "changed cmd": {"system": 50 * MB}}


async def test_M2_a_reload_hands_the_learned_footprint_to_the_new_tenancy(tmp_path, store):
    residency = residency_with(tmp_path, "serve --port ${PORT}")
    await residency.restore(store)
    await residency._measure(residency.tenancies["a#0"].supervisor)
    # The reload changed only ramUsage: a new supervisor, the same command line.
    sup = Supervisor(
        "a#0",
        Backend(cmd="serve --port ${PORT}", proxy="${PORT}", ram_usage={"system": 60 * MB}),
        probe,
        tmp_path,
    )
    residency.reconfigure(
        residency.servers, 60.0, [Tenancy(sup, "box", declared={"system": 60 * MB})]
    )
    assert residency.tenancies["a#0"].measured == {"system": 300 * MB}


async def test_M2_a_store_that_fails_keeps_the_footprint_in_memory(tmp_path, store, caplog):
    residency = residency_with(tmp_path, "serve")
    await residency.restore(store)
    await store.execute("DROP TABLE footprints")  # every write now fails
    await residency._measure(residency.tenancies["a#0"].supervisor)
    assert residency.learning.get("a#0", residency.tenancies["a#0"].command) == {"system": 300 * MB}
    assert "learned footprint of backend=a#0 not stored" in caplog.text


def test_M2_mismatches_compare_with_the_declaration_else_the_estimate():
    measured = {"system": 350 * MB, "gpu": 8000 * MB}
    assert [
        learning.mismatches(measured, {"system": 50 * MB, "gpu": 8000 * MB}, None),
        learning.mismatches(measured, None, {"system": 340 * MB, "gpu": 7000 * MB}),
        learning.mismatches(measured, None, None),
    ] == [
        [("system", "declared", 50 * MB, 350 * MB)],
        [("gpu", "estimated", 7000 * MB, 8000 * MB)],
        [],
    ]


def test_M2_M3_a_reading_is_mapped_onto_the_servers_pools():
    server = Server(
        pools={"big": 80 * 10**9, "small": 24 * 10**9, "system": 64 * 10**9},
        gpus=["small", "big"],
    )
    held = {"gpu1": 9 * 10**9, "gpu0": 10**9, "gpu7": 10**9, "system": 5 * 10**8}
    assert learning.in_pools(held, server, server.gpus, placed="big") == {
        "gpu": 9 * 10**9,  # device 1 is `big` (second of the gpus), where it was placed
        "small": 10**9,
        "system": 5 * 10**8,
    }
