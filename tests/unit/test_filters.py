"""SPEC §16 K5: a model's request filters and its aliases' own setParams, applied to the
upstream payload by `upstream_body` (which every dialect's codec calls)."""

from __future__ import annotations

import textwrap
from typing import Any

import orjson

from corrallm.config import load_config_text
from corrallm.config.schema import BackendConfig as Backend
from corrallm.config.schema import Filters
from corrallm.config.schema import ModelConfig as Model
from corrallm.lifecycle.remote import RemoteEndpoint
from corrallm.proxy.dialects.openai import upstream_body
from corrallm.routing.filters import NO_FILTERS, filters_of
from corrallm.routing.router import Route
from corrallm.topology import build

CONFIG = """
models:
  m:
    aliases: [chat, {name: chat-creative, setParams: {temperature: 1.1, top_k: 80}}]
    filters:
      stripParams: [logprobs, seed]
      setParams: {top_k: 40, chat_template_kwargs: {enable_thinking: false}}
      defaultParams: {temperature: 0.2, seed: 7}
    backends: [{proxy: 5800}]
  plain: {backends: [{proxy: 5801, model: upstream-name}]}
"""


def route(model: Model, backend: Backend | None = None) -> Route:
    backend = backend or model.backends[0]
    return Route("m#0", "m", backend, RemoteEndpoint("m#0", "http://x"), filters_of(model))


def model_of(name: str = "m") -> Model:
    return load_config_text(textwrap.dedent(CONFIG), env={}).models[name]


def sent(r: Route, payload: dict[str, Any]) -> dict[str, Any]:
    body = orjson.dumps(payload)
    out: dict[str, Any] = orjson.loads(upstream_body(body, payload, r))
    return out


def test_K5_strip_default_and_set_for_the_model_name() -> None:
    payload = {"model": "m", "stream": True, "logprobs": True, "seed": 1, "top_k": 5}
    assert sent(route(model_of()), payload) == {
        "model": "m",
        "stream": True,
        "top_k": 40,  # forced
        "chat_template_kwargs": {"enable_thinking": False},  # forced
        "temperature": 0.2,  # filled in
        "seed": 7,  # stripped, then filled in from defaultParams
    }


def test_K5_a_caller_value_beats_a_default_and_null_counts_as_not_set() -> None:
    got = sent(route(model_of()), {"model": "m", "temperature": 0.9})
    assert got["temperature"] == 0.9
    assert sent(route(model_of()), {"model": "m", "temperature": None})["temperature"] == 0.2


def test_K5_an_alias_gets_the_model_filters_then_its_own_set_params() -> None:
    r = route(model_of())
    creative = sent(r, {"model": "chat-creative", "temperature": 0.1, "top_k": 1})
    assert (creative["model"], creative["temperature"], creative["top_k"]) == (
        "chat-creative",
        1.1,
        80,
    )
    plain_alias = sent(r, {"model": "chat", "temperature": 0.1})
    assert (plain_alias["temperature"], plain_alias["top_k"]) == (0.1, 40)


def test_K5_model_and_stream_are_never_touched_even_if_a_filter_names_them() -> None:
    # The config refuses such a filter (test_config_validation); a Model built in code
    # that has one still cannot change them.
    model = Model(
        backends=[Backend(proxy="1")],
        filters=Filters(
            strip_params=["model", "stream"],
            set_params={"model": "x", "stream": False},
            default_params={"stream": True},
        ),
    )
    assert filters_of(model) is NO_FILTERS
    assert sent(route(model), {"model": "m", "stream": True}) == {"model": "m", "stream": True}
    assert sent(route(model), {"model": "m"}) == {"model": "m"}


def test_K5_filters_then_rename_and_the_callers_payload_is_left_as_sent() -> None:
    model = model_of()
    backend = model.backends[0].model_copy(update={"model": "upstream", "max_tokens": 8})
    r = route(model, backend)
    payload = {"model": "chat-creative", "max_tokens": 100, "logprobs": True}
    first = sent(r, payload)
    assert (first["model"], first["temperature"], first["max_tokens"]) == ("upstream", 1.1, 8)
    assert "logprobs" not in first
    # A request routed again (P6) or requeued (S4) starts over from what the caller sent,
    # so the alias is still seen as the alias.
    assert payload == {"model": "chat-creative", "max_tokens": 100, "logprobs": True}
    assert sent(r, payload) == first


def test_K5_no_filters_forwards_the_body_byte_for_byte() -> None:
    model = model_of()
    r = Route("m#0", "m", model.backends[0], RemoteEndpoint("m#0", "http://x"))
    body = b'{"model": "m",  "logprobs": true}'
    assert upstream_body(body, orjson.loads(body), r) is body


def test_K5_the_topology_gives_every_route_its_models_filters() -> None:
    config = load_config_text(textwrap.dedent(CONFIG), env={})
    topo = build(config, make=lambda sid, spec: None)  # type: ignore[arg-type,return-value]
    m, plain = topo.models["chat-creative"], topo.models["plain"]
    assert m.routes[0].filters.by_alias == {"chat-creative": {"temperature": 1.1, "top_k": 80}}
    assert m.routes[0].filters.strip == ("logprobs", "seed")
    assert plain.routes[0].filters is NO_FILTERS
