"""Ollama's catalog (SPEC §23 E1): `GET /api/tags`, `GET /api/ps`, `POST /api/show`,
`GET /api/version`, and `keep_alive: 0`'s unload.

Like `/v1/models` (proxy/models.py) these list the served models a caller's key may use,
by name (a client may ask for `<name>:latest` too), and take no slot. What a model is
(`details`: format, family, parameter size, quantization; its file size; `model_info`) is
read from the GGUF file of its primary backend's llama-server `cmd` when it has one
(residency/gguf_header.py, headers only), once per topology and off the event loop;
other backends (a proxy, a peer, vLLM) have empty details. `/api/ps` lists the models a
local process of which is up (ready, draining or asleep), `size` its footprint summed over
its server's pools and `size_vram` the part on GPU pools.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import orjson

from corrallm import __version__
from corrallm.config.units import rfc3339
from corrallm.http.asgi import Scope, Send, send_bytes
from corrallm.http.errors import ApiError, bad_request, not_found
from corrallm.lifecycle.errors import LifecycleError
from corrallm.lifecycle.state import State
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.proxy import jsonbody
from corrallm.proxy.dialects.ollama_translate import served_name
from corrallm.proxy.models import capabilities, parsed_context
from corrallm.proxy.pipeline import Pipeline, caller_key, names_of
from corrallm.residency.estimate import is_llama_server
from corrallm.residency.gguf_header import Counted, GgufError, load_model
from corrallm.residency.llama_args import ArgsError, parse
from corrallm.routing.router import ServedModel

if TYPE_CHECKING:
    from corrallm.gateway import Gateway

log = logging.getLogger("corrallm.proxy")

# The Ollama API level whose fields corrallm speaks; clients compare it to enable features
# (tools, structured outputs, thinking). corrallm's own version is beside it.
OLLAMA_API_VERSION = "0.12.0"
PATHS = {"/api/tags": "GET", "/api/ps": "GET", "/api/show": "POST", "/api/version": "GET"}
# Ollama's model-file management, which corrallm leaves to its config (404, in its shape).
UNSERVED = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete", "/api/blobs/")


def unserved(path: str) -> bool:
    return path.startswith(UNSERVED)


def not_managed(path: str) -> ApiError:
    return not_found(
        f"corrallm does not manage model files: {path[:128]} is not served. Its models "
        "come from its config (GET /api/tags lists them); an operator adds one there.",
    )


# A process that holds its model in memory (W1: asleep, it holds its sleep footprint).
LOADED = frozenset({State.READY, State.DRAINING, State.ASLEEP})
# What Ollama calls what corrallm's /v1/models capabilities say.
_CAPABILITIES = {"chat": ("completion", "tools"), "embeddings": ("embedding",)}


@dataclass(frozen=True)
class Facts:
    """What a model's file says about it (empty where it has none corrallm can read)."""

    format: str = ""
    family: str = ""
    parameters: int = 0
    quantization: str = ""
    size: int = 0  # bytes on disk
    info: dict[str, Any] = field(default_factory=dict)  # scalar GGUF metadata
    vision: bool = False
    embeddings: bool = False

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family] if self.family else None,
            "parameter_size": parameter_size(self.parameters),
            "quantization_level": self.quantization,
        }


def parameter_size(n: int) -> str:
    """Ollama's way of writing a parameter count: `8.0B`, `135M`."""
    if n <= 0:
        return ""
    if n >= 10**9:
        return f"{n / 10**9:.1f}B"
    if n >= 10**6:
        return f"{n / 10**6:.0f}M"
    return f"{n / 10**3:.0f}K"


def quantization(file_type: Any) -> str:
    """`general.file_type` as Ollama names it: Q4_0, Q4_K_M, F16..."""
    try:
        name = gguf.LlamaFileType(file_type).name
    except (ValueError, TypeError):
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def facts_of(cmd: str | None, cwd: str | None) -> Facts:
    """What the GGUF file of a llama-server `cmd` says (its header only); empty facts for
    any other backend or a file that cannot be read."""
    try:
        argv = shlex.split(cmd or "")
    except ValueError:
        return Facts()
    if not is_llama_server(argv):
        return Facts()
    try:
        args = parse(argv)
        if args.model is None:
            return Facts()
        model = load_model(args.model, Path(cwd) if cwd else Path.cwd(), "-m")
        sizes = sum(Path(f).stat().st_size for f in model.files)
    except (ArgsError, GgufError, OSError):
        return Facts()
    header = model.header
    family = header.get(gguf.Keys.General.ARCHITECTURE)
    count = header.integer("general.parameter_count")
    if count is None:
        count = sum(_elements(t.shape) for t in model.tensors)
    info: dict[str, Any] = {
        key: value
        for key, value in header.metadata.items()
        if not isinstance(value, Counted | tuple)  # the vocabulary: Ollama's `verbose` only
    }
    info["general.parameter_count"] = count
    return Facts(
        "gguf",
        family if isinstance(family, str) else "",
        count,
        quantization(header.get(gguf.Keys.General.FILE_TYPE)),
        sizes,
        info,
        args.mmproj is not None,
        args.embeddings,
    )


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def digest(served: ServedModel) -> str:
    """A stable sha256 hex of what serves the name (its backends' commands and targets):
    it changes when a reload changes what answers to the name."""
    parts = [
        served.name,
        *(f"{r.id}\0{r.config.cmd or ''}\0{r.config.proxy}" for r in served.routes),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class OllamaCatalog:
    """The answers of Ollama's catalog paths: per model, the part the config and the model
    file decide (rebuilt when a reload changes the topology) plus the live part."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.gateway: Gateway = pipeline.gw
        self._version = -1
        self._facts: dict[str, Facts] = {}
        self._lock = asyncio.Lock()

    async def answer(self, path: str, scope: Scope, body: bytes, send: Send) -> None:
        if path == "/api/version":
            answer: dict[str, Any] = {"version": OLLAMA_API_VERSION, "corrallm": __version__}
        elif path == "/api/tags":
            answer = {"models": [self._entry(s, await self._of(s)) for s in self._allowed(scope)]}
        elif path == "/api/ps":
            answer = {"models": [e for s in self._allowed(scope) if (e := await self._running(s))]}
        else:
            answer = await self._show(scope, body)
        await send_bytes(send, 200, orjson.dumps(answer))

    def _allowed(self, scope: Scope) -> list[ServedModel]:
        """The listed models the caller's key may use (all of them for no key)."""
        key = self.gateway.caller(caller_key(scope)).identity
        return [
            s
            for s in self.gateway.served
            if not s.config.unlisted and (key is None or key.allows(names_of(s)))
        ]

    async def _of(self, served: ServedModel) -> Facts:
        gw = self.gateway
        if self._version != gw.version:
            async with self._lock:
                if self._version != gw.version:
                    version, models = gw.version, list(gw.served)
                    # Header reads are file I/O (cached by file): off the event loop.
                    self._facts = await asyncio.to_thread(_all_facts, models)
                    self._version = version
        return self._facts.get(served.name, Facts())

    def _entry(self, served: ServedModel, facts: Facts) -> dict[str, Any]:
        return {
            "name": served.name,
            "model": served.name,
            "modified_at": rfc3339(self.gateway.started_at),
            "size": facts.size,
            "digest": digest(served),
            "details": facts.details(),
        }

    async def _running(self, served: ServedModel) -> dict[str, Any] | None:
        gw = self.gateway
        usage: dict[str, int] = {}
        expires: float | None = None
        up = False
        for sup in {id(r.endpoint): r.endpoint for r in served.routes}.values():
            if not isinstance(sup, Supervisor) or sup.state not in LOADED:
                continue
            up = True
            tenancy = gw.residency.tenancies.get(sup.id)
            if tenancy is None or not tenancy.holds():
                continue
            for pool, held in tenancy.usage.items():
                usage[pool] = usage.get(pool, 0) + held
            until = tenancy.ttl_expires_at()
            if until is not None:
                expires = until if expires is None else max(expires, until)
        if not up:
            return None
        entry = self._entry(served, await self._of(served))
        entry["size"] = sum(usage.values())
        entry["size_vram"] = sum(held for pool, held in usage.items() if pool.startswith("gpu"))
        entry["context_length"] = parsed_context(served) or served.primary.config.context_length
        if expires is not None:
            entry["expires_at"] = rfc3339(_wall(expires))
        return entry

    async def _show(self, scope: Scope, body: bytes) -> dict[str, Any]:
        payload = jsonbody.parse(body) if body else {}
        name = payload.get("model", payload.get("name")) if isinstance(payload, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request("Missing 'model': name the model to show.", param="model")
        served = self._served(name, scope)
        facts = await self._of(served)
        audio = self.gateway.ledger.costs.audio(served.primary.config)
        kinds = [c for k in capabilities(served, audio) for c in _CAPABILITIES.get(k, ())]
        if facts.vision and "completion" in kinds:
            kinds.append("vision")
        if facts.embeddings and "embedding" not in kinds:
            kinds.append("embedding")
        return {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": facts.details(),
            "model_info": facts.info,
            "capabilities": list(dict.fromkeys(kinds)),
            "modified_at": rfc3339(self.gateway.started_at),
        }

    def _served(self, name: str, scope: Scope) -> ServedModel:
        gw = self.gateway
        served = gw.models.get(served_name(name, gw.models))
        key = gw.caller(caller_key(scope)).identity
        if served is None or (key is not None and not key.allows(names_of(served))):
            raise not_found(
                f"model '{name[:128]}' not found: GET /api/tags lists the models this caller "
                "may use.",
                code="model_not_found",
            )
        return served


def _all_facts(models: list[ServedModel]) -> dict[str, Facts]:
    return {s.name: facts_of(s.primary.config.cmd, s.primary.config.cwd) for s in models}


def _wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


# -- keep_alive: 0 ---------------------------------------------------------------------------


def busy(gateway: Gateway, sup: Supervisor) -> bool:
    """Whether anyone uses the backend: a request in flight, holding a slot or queued."""
    try:
        _, running, waiting = gateway.admission.core.load(sup.id)
    except KeyError:  # not scheduled here any more (a reload took it)
        running = waiting = 0
    return bool(sup.in_flight or running or waiting)


async def unload_idle(gateway: Gateway, served: ServedModel) -> bool:
    """Unload the model's own processes, as the management API's unload does
    (`Supervisor.unload`), when no one uses any of them; True if it did."""
    own = gateway.own_supervisors(served)
    if not own or any(busy(gateway, sup) for sup in own):
        return False
    try:
        for sup in own:
            await sup.unload()
    except LifecycleError as exc:  # starting, say: it stays
        log.info("keep_alive 0: %s stays loaded: %s", served.name, exc)
        return False
    log.info("keep_alive 0: unloaded %s", served.name)
    return True


def unload_later(gateway: Gateway, model: str) -> None:
    """`unload_idle` in the background (the request that asked for it is over)."""
    served = gateway.models.get(model)
    if served is not None:
        gateway.background(_unload(gateway, served))


async def _unload(gateway: Gateway, served: ServedModel) -> None:
    await unload_idle(gateway, served)
