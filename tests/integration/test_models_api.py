"""SPEC §16 K3 (`GET /v1/models`, `GET /v1/models/{id}`) and K5 (request filters, alias
parameters) against a real `corrallm serve` and real fake backends."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.processes import FakeBackend, fake_cmd

CTX = fake_cmd("--n-ctx", "4096", "--n-slots", "2")


def config(backend: FakeBackend) -> str:
    return f"""
models:
  m:
    aliases: [chat, {{name: chat-creative, setParams: {{temperature: 1.1}}}}]
    backends:
      - {{cmd: "{CTX}", proxy: "${{PORT}}", maxConcurrent: 2, contextLength: 1000}}
      - {{cmd: "{fake_cmd()}", proxy: "${{PORT}}", quality: 50, maxConcurrent: 3}}
  emb:
    backends: [{{proxy: "{backend.url}", type: embed, contextLength: 512}}]
  secret:
    unlisted: true
    backends: [{{proxy: "{backend.url}"}}]
  filtered:
    aliases: [f, {{name: f-hot, setParams: {{temperature: 1.5, top_k: 80}}}}]
    filters:
      stripParams: [logprobs]
      setParams: {{top_k: 40}}
      defaultParams: {{temperature: 0.2}}
    backends: [{{proxy: "{backend.url}", model: upstream-name}}]
"""


@pytest.fixture
def gw(gateway_factory, fake_backend):
    return gateway_factory(config(fake_backend))


def entry(gw, model: str) -> dict[str, object]:
    response = httpx.get(f"{gw.v1}/models/{model}", timeout=10)
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


def live(gw, model: str) -> tuple[object, object]:
    got = entry(gw, model)
    return got["state"], got["context_length"]


def test_K3_list_carries_state_context_capabilities_aliases_and_concurrency(gw):
    listing = httpx.get(gw.v1 + "/models", timeout=10).json()
    assert listing["object"] == "list"
    by_id = {e["id"]: e for e in listing["data"]}
    assert list(by_id) == ["m", "emb", "filtered"]  # config order, `secret` unlisted
    m = by_id["m"]
    assert {k: m[k] for k in ("object", "owned_by", "modality")} == {
        "object": "model",
        "owned_by": "corrallm",
        "modality": "text",
    }
    assert isinstance(m["created"], int)
    assert m["aliases"] == ["chat", "chat-creative"]
    assert m["capabilities"] == ["chat", "completions", "anthropic", "responses"]
    assert (m["state"], m["context_length"], m["max_concurrency"]) == ("stopped", 1000, 5)
    emb = by_id["emb"]  # a pure proxy: always ready; its context from the config
    assert (emb["capabilities"], emb["state"], emb["context_length"]) == (
        ["embeddings"],
        "ready",
        512,
    )
    assert by_id["filtered"]["context_length"] is None


def test_K3_state_and_parsed_n_ctx_follow_a_load_an_unload_and_a_pause(gw):
    assert live(gw, "m") == ("stopped", 1000)
    assert gw.api("POST", "models/load", {"model": "m"}).status_code == 200
    # n_ctx 4096 over 2 slots, parsed from the backend's log: 2048 per slot.
    assert live(gw, "m") == ("ready", 2048)
    assert gw.api("POST", "models/unload", {"model": "m"}).status_code == 200
    assert live(gw, "m") == ("stopped", 2048)  # the last parsed value stays known
    assert gw.api("POST", "models/pause", {"model": "m"}).status_code == 200
    assert live(gw, "m")[0] == "paused"
    assert gw.api("POST", "models/unpause", {"model": "m"}).status_code == 200
    assert live(gw, "m")[0] == "stopped"


def test_K3_one_model_by_name_or_alias_unlisted_too_and_404_in_the_openai_shape(gw):
    assert entry(gw, "chat-creative")["id"] == "m"
    assert entry(gw, "secret")["id"] == "secret"
    missing = httpx.get(gw.v1 + "/models/nope", timeout=10)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert (error["code"], error["type"]) == ("model_not_found", "invalid_request_error")
    assert "nope" in error["message"]
    assert httpx.post(gw.v1 + "/models/m", timeout=10).status_code == 405


def test_K3_the_openai_sdk_lists_and_retrieves(gw):
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models] == ["m", "emb", "filtered"]
    one = client.models.retrieve("chat")
    assert (one.id, one.object, one.owned_by) == ("m", "model", "corrallm")
    assert one.model_extra is not None and one.model_extra["max_concurrency"] == 5
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_K5_filters_and_alias_params_reach_the_backend_and_model_is_only_renamed(gw, fake_backend):
    def send(model: str, **params: object) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **params}
        response = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text

    httpx.delete(fake_backend.url + "/debug/requests", timeout=10)
    send("filtered", logprobs=True, top_k=3)
    send("f", temperature=0.7)
    send("f-hot", temperature=0.7, stream=True)
    records = httpx.get(fake_backend.url + "/debug/requests", timeout=10).json()
    bodies = [r["body"] for r in records if r["path"] == "/v1/chat/completions"]
    seen = [
        (b["model"], b.get("temperature"), b.get("top_k"), "logprobs" in b, b.get("stream"))
        for b in bodies
    ]
    assert seen == [
        ("upstream-name", 0.2, 40, False, None),  # stripped, filled in, forced
        ("upstream-name", 0.7, 40, False, None),  # the caller's temperature kept
        ("upstream-name", 1.5, 80, False, True),  # the alias's own setParams last
    ]
