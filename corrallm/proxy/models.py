"""`GET /v1/models` and `GET /v1/models/{id}` (SPEC §3, §16 K3): the served models in the
OpenAI list shape, each entry with what a client picking a model wants to know.

Besides the OpenAI fields (`id`, `object`, `created`, `owned_by`): `aliases`, `modality`
(`text` | `audio`), `capabilities` (what it can be asked: `chat`, `completions`,
`anthropic`, `responses`, `embeddings`, `rerank`, `transcription`, `realtime`, `speech`),
`max_concurrency` (slots summed over its backends), and, live, `state` (the best state
among its backends, or `paused`) and `context_length` (the primary backend's parsed
`n_ctx` per slot, else its `contextLength`, else null).

What the config decides is built once per topology (`gateway.version`); each answer adds
only the live part, so a load or unload shows on the next GET. `unlisted` models are left
out of the list but answer by name or alias on `/v1/models/{id}`, as they do on every
other path: unlisted means not advertised, not hidden from a caller who knows the name.

A key with a `models` allowlist (SPEC §22 T3) sees only the models it may use: the list
leaves the others out and `/v1/models/{id}` answers 404 for them, as for a model that is
not served.
"""

from __future__ import annotations

from typing import Any

import orjson

from corrallm.auth.keys import Identity
from corrallm.gateway import Gateway
from corrallm.http.asgi import Scope, Send, send_bytes
from corrallm.http.errors import not_found
from corrallm.lifecycle.state import BEST_FIRST
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.proxy.dialects.audio import speaks
from corrallm.proxy.pipeline import Pipeline, caller_key, modes_of, names_of
from corrallm.routing.router import ServedModel

PREFIX = "/v1/models/"

# What corrallm answers for every chat backend, natively or translated (K1, K2).
CHAT = ("chat", "completions", "anthropic", "responses")


def capabilities(served: ServedModel, audio: bool) -> list[str]:
    """What the model can be asked, from its primary backend's `type` and cost class
    modality and its `modes` (as `proxy/audio.py` sorts models into surfaces)."""
    if audio:
        if speaks(served):
            return ["speech"]
        modes = modes_of(served)
        return [
            c for c, mode in (("transcription", "batch"), ("realtime", "realtime")) if mode in modes
        ]
    kind = served.primary.config.type.lower()
    if "embed" in kind:
        return ["embeddings"]
    if "rerank" in kind:
        return ["rerank"]
    return list(CHAT)


def state(gateway: Gateway, served: ServedModel) -> str:
    """`paused` when an operator paused the model, else its backends' best state (a pure
    proxy is always ready)."""
    if gateway.pauses.paused("model", served.name):
        return "paused"
    return str(min((r.endpoint.state for r in served.routes), key=BEST_FIRST.__getitem__))


def parsed_context(served: ServedModel) -> int | None:
    """The primary backend's context per slot, as its log said (L6), when known."""
    endpoint = served.primary.endpoint
    if not isinstance(endpoint, Supervisor):
        return None
    n_ctx, n_slots = endpoint.logs.n_ctx, endpoint.logs.n_slots
    if n_ctx is None:
        return None
    return n_ctx // n_slots if n_slots else n_ctx


class ModelCatalog:
    """The /v1/models answers: per model, the part its config decides (rebuilt when a
    reload changes the topology) plus the live part."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.gateway = pipeline.gw
        self._version = -1
        self._static: dict[str, dict[str, Any]] = {}

    def _parts(self) -> dict[str, dict[str, Any]]:
        gw = self.gateway
        if self._version != gw.version:
            self._static = {served.name: self._static_part(served) for served in gw.served}
            self._version = gw.version
        return self._static

    def _static_part(self, served: ServedModel) -> dict[str, Any]:
        audio = self.gateway.ledger.costs.audio(served.primary.config)
        return {
            "id": served.name,
            "object": "model",
            "created": self.gateway.started_at,
            "owned_by": "corrallm",
            "aliases": list(served.config.aliases),
            "modality": "audio" if audio else "text",
            "capabilities": capabilities(served, audio),
            "max_concurrency": sum(r.config.max_concurrent for r in served.routes),
            # X1: its backends, a peer's as <model>@<peer>
            "backends": [r.id for r in served.routes],
            "context_length": served.primary.config.context_length,
        }

    def entry(self, served: ServedModel) -> dict[str, Any]:
        part = self._parts()[served.name]
        parsed = parsed_context(served)
        return {
            **part,
            "state": state(self.gateway, served),
            "context_length": part["context_length"] if parsed is None else parsed,
        }

    def listing(self, key: Identity | None = None) -> dict[str, Any]:
        """Every listed model, or those `key` may use."""
        data = [
            self.entry(s)
            for s in self.gateway.served
            if not s.config.unlisted and (key is None or key.allows(names_of(s)))
        ]
        return {"object": "list", "data": data}

    async def send(self, scope: Scope, send: Send) -> None:
        """`GET /v1/models`, or `GET /v1/models/{id}` (by name or alias; 404
        model_not_found in the OpenAI shape), as the caller's key may see them."""
        path: str = scope["path"]
        key = self.gateway.caller(caller_key(scope)).identity
        if path.startswith(PREFIX):
            name = path[len(PREFIX) :]
            served = self.pipeline.lookup(name)
            if key is not None and not key.allows(names_of(served)):
                raise not_found(
                    f"The model '{name[:128]}' is not one this API key may use; GET /v1/models "
                    "lists the models it may use.",
                    code="model_not_found",
                )
            await send_bytes(send, 200, orjson.dumps(self.entry(served)))
        else:
            await send_bytes(send, 200, orjson.dumps(self.listing(key)))
