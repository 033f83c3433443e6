"""SPEC §17 M1: what each backend will hold, where the config does not say.

A backend whose `ramUsage` is `auto`, or omitted on a llama-server `cmd` that runs on a
server with pools, is estimated from its GGUF file. `footprint_problems` is the last phase
of loading a config (it reads files, so it runs only on a config that is otherwise valid);
the gateway asks `estimate_footprints` again for the numbers when it builds the topology
(the GGUF metadata is cached by file, so that costs a few stat calls).
The estimate's GPU part is counted on the server's GPU pool (`gpu`, placed by the planner,
when the server lists `gpus`; else its one `gpu*` pool), its system part on `system`.
A missing or unreadable model file is a config problem with its YAML path, never a crash.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass

from corrallm.config.schema import ANY_GPU, Config, ProcessSpec, Server, backend_id
from corrallm.config.units import format_size
from corrallm.config.validation import Loc, Problem
from corrallm.residency.estimate import Estimate, EstimateError, Parts, estimate, is_llama_server

SYSTEM_POOL = "system"


@dataclass(frozen=True)
class Footprint:
    """An estimate and the pools of its server it is counted on."""

    estimate: Estimate
    gpu_pool: str | None  # None: the server has no GPU pool; the GPU part is not counted
    system_pool: str | None  # None: the server has no `system` pool

    @property
    def usage(self) -> dict[str, int]:
        usage: dict[str, int] = {}
        for pool, parts in (
            (self.gpu_pool, self.estimate.gpu),
            (self.system_pool, self.estimate.system),
        ):
            if pool is not None and parts.total:
                usage[pool] = usage.get(pool, 0) + parts.total
        return usage

    def describe(self) -> list[str]:
        """What `corrallm check` prints: each pool with its parts, and the files read."""
        lines = []
        for pool, parts, what in (
            (self.gpu_pool, self.estimate.gpu, "GPU"),
            (self.system_pool, self.estimate.system, "system"),
        ):
            if not parts.total:
                continue
            counted = pool if pool is not None else f"{what} (not counted: no such pool)"
            lines.append(f"{counted} {format_size(parts.total)} = {_parts(parts)}")
        lines.append("from " + ", ".join(self.estimate.files))
        lines += list(self.estimate.notes)
        return lines


def _parts(parts: Parts) -> str:
    return (
        f"weights {format_size(parts.weights)} + KV {format_size(parts.kv)} + "
        f"compute {format_size(parts.compute)}"
    )


def estimate_footprints(config: Config) -> tuple[dict[str, Footprint], list[Problem]]:
    """The footprint of every backend and extension left to estimate, by backend id."""
    found: dict[str, Footprint] = {}
    problems: list[Problem] = []
    for loc, sid, spec in _processes(config):
        if spec.declared is not None or not spec.cmd:
            continue
        explicit = spec.ram_usage == "auto"
        where = (*loc, "ramUsage") if explicit else (*loc, "cmd")
        try:
            argv = shlex.split(spec.cmd)
        except ValueError:
            continue  # the spawn reports an unsplittable cmd
        if not is_llama_server(argv):
            if explicit:
                problems.append((where, _not_llama(argv)))
            continue
        server_name = spec.server or (
            next(iter(config.servers)) if len(config.servers) == 1 else None
        )
        server = config.servers.get(server_name) if server_name else None
        if server is None or not server.pools:
            if explicit:
                problems.append(
                    (
                        where,
                        "ramUsage: auto needs a server with pools to count the estimate "
                        "against; add a servers section",
                    )
                )
            continue
        try:
            est = estimate(argv, spec.cwd)
        except EstimateError as exc:
            problems.append(
                (where, f"cannot estimate its memory: {exc}. {_declare_instead(explicit)}")
            )
            continue
        gpu_pool, system_pool = _pools(server)
        if gpu_pool is None and est.gpu.total and _several_gpus(server):
            problems.append(
                (
                    where,
                    f"it offloads {format_size(est.gpu.total)} to a GPU and server "
                    f"'{server_name}' has several GPU pools: list them in "
                    f"servers.{server_name}.gpus so the planner places it, or declare ramUsage",
                )
            )
            continue
        found[sid] = Footprint(est, gpu_pool, system_pool)
    return found, problems


def _processes(config: Config) -> Iterator[tuple[Loc, str, ProcessSpec]]:
    for name, ext in config.extensions.items():
        yield ("extensions", name), f"extension:{name}", ext
    for name, model in config.models.items():
        for index, backend in enumerate(model.backends):
            if not backend.extension:
                yield ("models", name, "backends", index), backend_id(name, index, backend), backend


def _gpu_pools(server: Server) -> list[str]:
    return [p for p in server.pools if p.startswith("gpu")]


def _several_gpus(server: Server) -> bool:
    return len(_gpu_pools(server)) > 1


def _pools(server: Server) -> tuple[str | None, str | None]:
    """(GPU pool, system pool) an estimate is counted on."""
    system = SYSTEM_POOL if SYSTEM_POOL in server.pools else None
    if server.gpus:
        return ANY_GPU, system
    gpus = _gpu_pools(server)
    return (gpus[0] if len(gpus) == 1 else None), system


def _not_llama(argv: list[str]) -> str:
    program = argv[0] if argv else "nothing"
    return (
        f"ramUsage: auto estimates llama-server backends from their GGUF file, and this cmd "
        f"runs '{program}'; declare what it holds per pool instead, e.g. "
        "ramUsage: {gpu0: 8GB, system: 2GB}"
    )


def _declare_instead(explicit: bool) -> str:
    if explicit:
        return "Fix the model path, or declare ramUsage per pool instead of auto"
    return (
        "Fix the model path, or declare ramUsage per pool (ramUsage: {} counts nothing) so "
        "corrallm does not estimate it"
    )


def footprint_problems(config: Config) -> list[Problem]:
    """The loading phase (`load_config(..., checks=[footprint_problems])`)."""
    return estimate_footprints(config)[1]
