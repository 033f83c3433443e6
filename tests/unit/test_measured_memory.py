"""R5: measured memory beside the declaration, with a warning past 10 %.

No GPU here: NVML is replaced by a fake reader (the NVML reader itself needs a driver)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from corrallm.config.schema import Backend, Server
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.residency.manager import Residency, Tenancy

GB = 10**9


class FakeReader:
    def __init__(self, held: dict[str, int]) -> None:
        self.held = held
        self.asked: list[int] = []

    def read(self, pid: int) -> dict[str, int] | None:
        self.asked.append(pid)
        return self.held


async def probe(url: str) -> int | None:
    return None


def setup(tmp_path, held: dict[str, int]) -> tuple[Residency, Supervisor, FakeReader]:
    reader = FakeReader(held)
    residency = Residency({"box": Server(pools={"gpu0": 32 * GB})}, reader=reader)
    sup = Supervisor("m#0", Backend(cmd="x", proxy="${PORT}"), probe, tmp_path)
    sup.proc = SimpleNamespace(pid=4242)  # type: ignore[assignment]
    residency.track(Tenancy(sup, "box", declared={"gpu0": 10 * GB}))
    return residency, sup, reader


async def test_R5_measured_memory_is_kept_beside_the_declaration(tmp_path, caplog):
    residency, sup, reader = setup(tmp_path, {"gpu0": int(10.5 * GB)})
    with caplog.at_level(logging.WARNING, "corrallm.residency"):
        await residency._measure(sup)
    assert reader.asked == [4242]
    assert residency.tenancies["m#0"].measured == {"gpu0": int(10.5 * GB)}
    assert not caplog.records  # within 10 %: no warning


async def test_R5_a_declaration_off_by_more_than_10_percent_is_warned(tmp_path, caplog):
    residency, sup, _ = setup(tmp_path, {"gpu0": 14 * GB})
    with caplog.at_level(logging.WARNING, "corrallm.residency"):
        await residency._measure(sup)
    assert "ramUsage mismatch backend=m#0 pool=gpu0 declared=10GB measured=14GB" in caplog.text
