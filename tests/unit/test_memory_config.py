"""The config side of SPEC §17 M1/M3: `gpus`, `ramUsage: {gpu: …}`, `ramUsage: auto` and
an omitted ramUsage on llama-server; every problem with its YAML path (the estimator itself
is tested in test_estimate.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from corrallm.config import Config, ConfigError, load_config_text
from corrallm.config.schema import ANY_GPU
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.residency.footprints import estimate_footprints, footprint_problems
from corrallm.topology import build
from tests.support.tiny_gguf import write_tiny_gguf

GPUS = "servers: {box: {pools: {gpu0: 24GB, gpu1: 24GB, system: 64GB}, gpus: [gpu0, gpu1]}}\n"
ONE_GPU = "servers: {box: {pools: {gpu0: 24GB, system: 64GB}}}\n"


def load(text: str) -> Config:
    return load_config_text(textwrap.dedent(text), env={}, checks=[footprint_problems])


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(text)
    return caught.value.problems


def backend(fields: str, prelude: str = GPUS) -> str:
    return prelude + f"models:\n  m:\n    backends:\n      - {fields}\n"


async def _probe(url: str) -> int | None:
    return None


def tenancy_of(config: Config, tmp_path: Path, sid: str = "m#0"):  # type: ignore[no-untyped-def]
    def make(name: str, spec: object) -> Supervisor:
        return Supervisor(name, spec, _probe, tmp_path)  # type: ignore[arg-type]

    topo = build(config, make, footprints=estimate_footprints(config)[0])
    return next(t for t in topo.tenancies if t.supervisor.id == sid)


# -- M3: gpus and the pool word `gpu` ------------------------------------------------------


def test_M3_gpus_name_pools_of_their_server() -> None:
    text = "servers: {box: {pools: {gpu0: 24GB}, gpus: [gpu0, gpu9]}}\n"
    assert problems_of(text) == [
        "servers.box.gpus[1]: unknown pool 'gpu9' on server 'box' (did you mean 'gpu0'?); "
        "each GPU in gpus is one of its pools (gpu0)"
    ]


def test_M3_gpu_needs_a_server_that_lists_gpus() -> None:
    assert problems_of(backend("{cmd: x, proxy: 5800, ramUsage: {gpu: 8GB}}", ONE_GPU)) == [
        "models.m.backends[0].ramUsage.gpu: 'gpu' means any of the server's gpus, and "
        "server 'box' lists none: add gpus: [gpu0, gpu1] to servers.box, or name the pool"
    ]


def test_M3_gpu_is_not_combined_with_one_of_the_gpus() -> None:
    problems = problems_of(backend("{cmd: x, proxy: 5800, ramUsage: {gpu: 8GB, gpu1: 1GB}}"))
    assert problems == [
        "models.m.backends[0].ramUsage.gpu: 'gpu' (placed on one of the server's gpus) "
        "cannot be combined with gpu1 from the same gpus"
    ]


def test_M3_a_gpu_backend_is_planned_on_any_of_the_gpus(tmp_path: Path) -> None:
    config = load(backend("{cmd: x, proxy: 5800, ramUsage: {gpu: 8GB, system: 1GB}}"))
    tenancy = tenancy_of(config, tmp_path)
    assert (tenancy.server, tenancy.gpus, tenancy.wanted) == (
        "box",
        ("gpu0", "gpu1"),
        {ANY_GPU: 8 * 10**9, "system": 10**9},
    )


# -- M1: auto and omitted ------------------------------------------------------------------


def test_M1_auto_needs_a_llama_server_cmd() -> None:
    assert problems_of(backend("{cmd: 'vllm serve m', proxy: 5800, ramUsage: auto}")) == [
        "models.m.backends[0].ramUsage: ramUsage: auto estimates llama-server backends from "
        "their GGUF file, and this cmd runs 'vllm'; declare what it holds per pool instead, "
        "e.g. ramUsage: {gpu0: 8GB, system: 2GB}"
    ]


def test_M1_a_missing_model_file_is_a_config_problem(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    problems = problems_of(backend(f"{{cmd: 'llama-server -m {missing}', proxy: 5800}}"))
    assert len(problems) == 1
    assert problems[0].startswith("models.m.backends[0].cmd: cannot estimate its memory: ")
    assert str(missing) in problems[0]
    assert "ramUsage: {} counts nothing" in problems[0]


def test_M1_auto_without_a_server_is_a_config_problem(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert problems_of(
        backend(f"{{cmd: 'llama-server -m {model}', proxy: 5800, ramUsage: auto}}", "")
    ) == [
        "models.m.backends[0].ramUsage: ramUsage: auto needs a server with pools to count "
        "the estimate against; add a servers section"
    ]


def test_M1_an_omitted_ramusage_on_llama_server_is_estimated(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    cmd = f"llama-server -m {model} -c 512 -ngl 0"
    config = load(backend(f"{{cmd: '{cmd}', proxy: 5800}}", ONE_GPU))
    tenancy = tenancy_of(config, tmp_path)
    assert tenancy.declared is None and tenancy.server == "box"
    assert tenancy.estimated is not None and set(tenancy.estimated) == {"system"}
    assert tenancy.usage == tenancy.estimated  # nothing measured yet


def test_M1_an_offloaded_estimate_on_a_one_gpu_server_names_that_gpu(tmp_path: Path) -> None:
    # llama-server's default -ngl is `auto` (full offload where it fits)
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = load(backend(f"{{cmd: 'llama-server -m {model}', proxy: 5800}}", ONE_GPU))
    tenancy = tenancy_of(config, tmp_path)
    assert tenancy.estimated is not None and set(tenancy.estimated) == {"gpu0", "system"}


def test_M1_an_offloaded_estimate_is_placed_on_a_gpu(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    config = load(backend(f"{{cmd: 'llama-server -m {model} -ngl 99', proxy: 5800}}"))
    tenancy = tenancy_of(config, tmp_path)
    assert tenancy.estimated is not None and set(tenancy.estimated) == {ANY_GPU, "system"}
    assert tenancy.gpus == ("gpu0", "gpu1")


def test_M1_a_declared_ramusage_is_never_estimated(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"  # never read
    config = load(backend(f"{{cmd: 'llama-server -m {missing}', proxy: 5800, ramUsage: {{}}}}"))
    tenancy = tenancy_of(config, tmp_path)
    assert (tenancy.declared, tenancy.estimated, tenancy.server) == ({}, None, None)
