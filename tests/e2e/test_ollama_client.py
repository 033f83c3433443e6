"""SPEC §23 E1 end to end: the official `ollama` Python client, unmodified, against corrallm
in front of the fake backend (translated to Chat Completions, Completions and Embeddings)
and in front of real llama-server with the tiny model. `pytest -s` prints a short
transcript of each client exchange."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from tests.support.clients import closed_at_end
from tests.support.llama import find_llama_server, llama_cmd, missing_reason
from tests.support.processes import GatewayClient, fake_cmd, free_port, wait_for
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

Factory = Callable[..., GatewayClient]
HI = [{"role": "user", "content": "Say hi."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
SLOW = {"model": "slow", "messages": HI}
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5Er"
    "kJggg=="
)

CONFIG = f"""
feedback: {{after: 0.3s, every: 0.3s}}
keys:
  coder: {{secret: sk-coder}}
  picky: {{secret: sk-picky, models: [chat]}}
servers:
  box: {{pools: {{gpu0: 24GB, system: 64GB}}}}
models:
  chat:
    backends:
      - cmd: "{fake_cmd("--tokens", "5", "--tool-calls")}"
        proxy: ${{PORT}}
        maxConcurrent: 2
        server: box
        ramUsage: {{gpu0: 2GB, system: 1GB}}
  other:
    backends: [{{cmd: "{fake_cmd("--tokens", "3")}", proxy: "${{PORT}}"}}]
  emb:
    backends: [{{cmd: "{fake_cmd("--embedding-dim", "4")}", proxy: "${{PORT}}", type: embed}}]
  crashy:
    backends: [{{cmd: "{fake_cmd("--crash-after-tokens", "2")}", proxy: "${{PORT}}"}}]
  cold:
    backends: [{{cmd: "{fake_cmd("--tokens", "4", "--load-seconds", "1.5")}", proxy: "${{PORT}}"}}]
  slow:
    backends:
      - cmd: "{fake_cmd("--tokens", "4", "--token-delay", "0.5", "--n-slots", "2")}"
        proxy: ${{PORT}}
        maxConcurrent: 2
"""


def say(*parts: object) -> None:
    print("  [ollama client]", *parts)


@pytest.fixture
def gw(gateway_factory: Factory) -> GatewayClient:
    return gateway_factory(CONFIG)


def client(
    gw: GatewayClient, key: str | None = "sk-coder", host: str | None = None
) -> ollama.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return closed_at_end(ollama.Client(host=host or gw.url, headers=headers, timeout=30))


def sent(gw: GatewayClient, model: str = "chat") -> dict[str, Any]:
    """The last request the model's fake backend received (its request log, through
    corrallm's /upstream passthrough)."""
    log = gw.upstream("GET", f"{model}/debug/requests", timeout=10).json()
    return log[-1]  # type: ignore[no-any-return]


def state(gw: GatewayClient, model: str) -> str:
    models = gw.api("GET", "overview").json()["models"]
    return next(m["state"] for m in models if m["name"] == model)  # type: ignore[no-any-return]


def test_E1_chat_whole_and_streamed(gw: GatewayClient) -> None:
    c = client(gw)
    whole = c.chat(model="chat:latest", messages=HI, stream=False)
    say("chat ->", repr(whole.message.content), whole.done_reason, whole.eval_count)
    assert whole.model == "chat:latest"  # named as asked
    assert whole.message.role == "assistant" and whole.message.content
    assert (whole.done, whole.done_reason, whole.eval_count) == (True, "stop", 5)
    assert whole.prompt_eval_count and whole.prompt_eval_count > 0
    assert whole.total_duration and whole.total_duration >= (whole.eval_duration or 0) > 0
    parts = list(c.chat(model="chat", messages=HI, stream=True))
    say("chat stream ->", [p.message.content for p in parts], parts[-1].done_reason)
    assert [p.done for p in parts] == [False] * 5 + [True]
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    last = parts[-1]
    assert (last.done_reason, last.eval_count, last.prompt_eval_count) == (
        "stop",
        5,
        whole.prompt_eval_count,
    )
    assert all(isinstance(getattr(last, f), int) for f in ("total_duration", "load_duration"))
    # NDJSON, as Ollama streams it; a stream unless told otherwise
    r = httpx.post(gw.url + "/api/chat", json={"model": "chat", "messages": HI}, timeout=30)
    assert r.headers["content-type"] == "application/x-ndjson"
    assert [json.loads(line)["done"] for line in r.text.splitlines()][-1] is True


def test_E1_generate_system_prompt_options_and_raw(gw: GatewayClient) -> None:
    c = client(gw)
    options = {"num_predict": 2, "temperature": 0.1, "top_k": 5, "seed": 3, "stop": ["\n"]}
    made = c.generate(model="chat", prompt="Why?", system="Be brief.", options=options)
    say("generate ->", repr(made.response), made.done_reason, made.eval_count)
    assert (made.response, made.done_reason, made.eval_count) == ("Hello from", "length", 2)
    body = sent(gw)["body"]
    assert sent(gw)["path"] == "/v1/chat/completions"
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    ]
    assert {k: body[k] for k in ("max_tokens", "temperature", "top_k", "seed", "stop")} == {
        "max_tokens": 2,
        "temperature": 0.1,
        "top_k": 5,
        "seed": 3,
        "stop": ["\n"],
    }
    streamed = "".join(p.response for p in c.generate(model="chat", prompt="Why?", stream=True))
    raw = c.generate(model="chat", prompt="[INST] Why? [/INST]", raw=True, stream=False)
    say("generate raw ->", repr(raw.response))
    assert streamed == "Hello from the fake backend" and raw.response
    assert sent(gw)["path"] == "/v1/completions"
    assert sent(gw)["body"]["prompt"] == "[INST] Why? [/INST]"


def test_E1_embed_and_the_older_embeddings(gw: GatewayClient) -> None:
    c = client(gw)
    embedded = c.embed(model="emb", input=["a", "b"])
    old = c.embeddings(model="emb", prompt="a")
    say("embed ->", [len(v) for v in embedded.embeddings], embedded.prompt_eval_count)
    assert [len(v) for v in embedded.embeddings] == [4, 4]
    assert list(old.embedding) == list(embedded.embeddings[0])
    assert sent(gw, "emb")["path"] == "/v1/embeddings"


def test_E1_tags_ps_show_version(gw: GatewayClient) -> None:
    c = client(gw)
    tags = c.list()
    say("tags ->", [m.model for m in tags.models])
    assert [m.model for m in tags.models] == ["chat", "other", "emb", "crashy", "cold", "slow"]
    assert all(m.digest and len(m.digest) == 64 for m in tags.models)
    assert [m.model for m in c.ps().models] == []  # nothing loaded yet
    c.chat(model="chat", messages=HI)
    running = c.ps().models
    say("ps ->", [(m.model, m.size, m.size_vram, m.context_length) for m in running])
    # its footprint summed over the server's pools, the GPU pools' part apart
    assert [(m.model, m.size, m.size_vram) for m in running] == [("chat", 3 * 10**9, 2 * 10**9)]
    shown = c.show("chat:latest")
    say("show ->", shown.capabilities, shown.details)
    assert shown.capabilities == ["completion", "tools"]
    assert shown.modelinfo == {} and shown.details is not None
    assert c.show("emb").capabilities == ["embedding"]
    version = httpx.get(gw.url + "/api/version", timeout=10).json()
    say("version ->", version)
    assert set(version) == {"version", "corrallm"}
    with pytest.raises(ollama.ResponseError) as err:
        c.show("nope")
    assert err.value.status_code == 404


@pytest.mark.parametrize("streamed", [False, True])
def test_E1_tool_calls_round_trip(gw: GatewayClient, streamed: bool) -> None:
    c = client(gw)
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    if streamed:
        parts = list(c.chat(model="chat", messages=ask, tools=[WEATHER], stream=True))
        (said,) = [p.message for p in parts if p.message.tool_calls]
        assert parts[-1].done
    else:
        said = c.chat(model="chat", messages=ask, tools=[WEATHER]).message
    assert said.tool_calls is not None
    (call,) = said.tool_calls
    say("tool call ->", call.function.name, call.function.arguments)
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "fake"})
    result = {"role": "tool", "content": "Sunny, 21 C", "tool_name": "get_weather"}
    after = c.chat(model="chat", messages=[*ask, said, result], tools=[WEATHER])
    say("after the tool result ->", repr(after.message.content))
    assert after.message.content and not after.message.tool_calls
    history = sent(gw)["body"]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool"]
    assert history[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"fake"}',
    }
    assert history[2]["tool_call_id"] == history[1]["tool_calls"][0]["id"]


def test_E1_format_json_a_schema_and_images_reach_the_backend(gw: GatewayClient) -> None:
    c = client(gw)
    c.chat(model="chat", messages=HI, format="json")
    assert sent(gw)["body"]["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    c.generate(model="chat", prompt="Age?", format=schema)
    assert sent(gw)["body"]["response_format"]["json_schema"]["schema"] == schema
    c.chat(model="chat", messages=[{"role": "user", "content": "What?", "images": [PNG]}])
    (turn,) = sent(gw)["body"]["messages"]
    assert turn["content"][1] == {
        "type": "image_url",
        "image_url": {"url": f"data:image/png;base64,{PNG}"},
    }


def test_E1_errors_are_ollamas_error_objects_with_its_statuses(gw: GatewayClient) -> None:
    c = client(gw)
    with pytest.raises(ollama.ResponseError) as unknown:
        c.chat(model="nope", messages=HI)
    say("unknown model ->", unknown.value.status_code, unknown.value.error)
    assert unknown.value.status_code == 404 and "nope" in unknown.value.error
    with pytest.raises(ollama.ResponseError) as streamed:
        list(c.chat(model="nope", messages=HI, stream=True))
    assert streamed.value.status_code == 404
    # Bodies are JSON whatever the Content-Type says; a malformed one is a 400.
    r = httpx.post(
        gw.url + "/api/chat",
        content=json.dumps({"model": "chat", "messages": HI, "stream": False}),
        headers={"content-type": "text/plain"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["done"] is True
    bad = httpx.post(gw.url + "/api/chat", content=b"{", timeout=30)
    wrong = httpx.post(gw.url + "/api/chat", json={"model": "chat", "messages": "x"}, timeout=30)
    method = httpx.get(gw.url + "/api/chat", timeout=30)
    assert [(x.status_code, set(x.json())) for x in (bad, wrong, method)] == [
        (400, {"error"}),
        (400, {"error"}),
        (404, {"error"}),
    ]
    with pytest.raises(ollama.ResponseError) as pull:
        c.pull("llama3.2")  # model files are the config's: not served, in Ollama's shape
    assert pull.value.status_code == 404 and "does not manage model files" in pull.value.error


def test_E1_keys_policy_and_the_activity_row_as_on_v1(gateway_factory: Factory) -> None:
    gw = gateway_factory("scheduler: {requireKeys: true}\n" + CONFIG)
    with pytest.raises(ollama.ResponseError) as refused:
        client(gw, "sk-nobody").chat(model="chat", messages=HI)
    say("unknown key ->", refused.value.status_code, refused.value.error)
    assert refused.value.status_code == 401
    picky = client(gw, "sk-picky")
    with pytest.raises(ollama.ResponseError) as forbidden:
        picky.chat(model="other", messages=HI)
    assert forbidden.value.status_code == 403
    assert [m.model for m in picky.list().models] == ["chat"]
    assert list(client(gw).chat(model="chat", messages=HI, stream=True))[-1].done

    def rows() -> list[dict[str, Any]]:
        found = gw.api("GET", "activity?key=coder").json()["rows"]
        return [r for r in found if r["kind"] == "request"]

    (row,) = wait_for(rows, 10, what="the /api/chat activity row")
    assert (row["endpoint"], row["status"], row["completion_tokens"]) == ("/api/chat", 200, 5)
    assert not row["estimated"] and row["prompt_tokens"] > 0


def test_E1_a_stream_that_breaks_off_ends_with_an_error_line(gw: GatewayClient) -> None:
    c = client(gw)
    got: list[str] = []
    with pytest.raises(ollama.ResponseError) as broken:
        for part in c.chat(model="crashy", messages=HI, stream=True):
            got.append(part.message.content or "")
    say("broken stream ->", got, broken.value.error[:60])
    # The model's two words; a start slower than the feedback interval (a busy machine)
    # adds K4's lines, which the client reads as empty text.
    assert len([word for word in got if word]) == 2 and "crashy" in broken.value.error


def test_E1_a_waiting_stream_gets_lines_the_client_reads_as_empty_text(gw: GatewayClient) -> None:
    r = httpx.post(gw.url + "/api/chat", json={"model": "cold", "messages": HI}, timeout=30)
    lines = [json.loads(line) for line in r.text.splitlines()]
    notes = [line["corrallm"] for line in lines if "corrallm" in line]
    say("cold stream notes ->", notes[:2], "...", notes[-1])
    assert any("loading cold" in note for note in notes)
    assert notes[-1].startswith("corrallm waited queue=")
    assert all(line["message"]["content"] == "" for line in lines if "corrallm" in line)
    assert lines[-1]["done"] is True and lines[-1]["load_duration"] > 10**9
    # The client reads exactly the model's words through them.
    text = "".join(p.message.content or "" for p in client(gw).chat("cold", HI, stream=True))
    assert text == "".join(line["message"]["content"] for line in lines)


def test_E1_keep_alive_0_unloads_when_no_one_else_uses_the_model(gw: GatewayClient) -> None:
    c = client(gw)
    c.chat(model="chat", messages=HI, keep_alive=0)
    wait_for(lambda: state(gw, "chat") == "stopped", 10, what="chat unloaded")
    assert c.ps().models == []
    # A slow stream uses the model meanwhile: it stays loaded.
    slow: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", gw.url + "/api/chat", json=SLOW, timeout=30) as r:
            slow.extend(r.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        wait_for(lambda: state(gw, "slow") == "ready", 10, what="slow loaded")
        quick = c.generate(model="slow", prompt="x", keep_alive=0, options={"num_predict": 1})
        assert quick.done
    finally:
        thread.join(30)
    assert slow and json.loads(slow[-1])["done"] is True
    assert state(gw, "slow") == "ready"
    unloaded = c.generate(model="slow", keep_alive="0s")  # no prompt: unload, now
    assert unloaded.done_reason == "unload" and state(gw, "slow") == "stopped"
    loaded = c.chat(model="slow", messages=[])  # no messages: load
    assert loaded.done_reason == "load" and state(gw, "slow") == "ready"
    say("keep_alive 0 ->", unloaded.done_reason, "then", loaded.done_reason)


def test_E1_the_ollama_listen_listener(gateway_factory: Factory) -> None:
    port = free_port()
    gw = gateway_factory(f"ollama: {{listen: '127.0.0.1:{port}'}}\n" + CONFIG)
    c = client(gw, host=f"http://127.0.0.1:{port}")
    said = c.chat(model="chat", messages=HI)
    say(f"on 127.0.0.1:{port} ->", repr(said.message.content))
    assert said.done and [m.model for m in c.list().models][:1] == ["chat"]


# --- against real llama-server ------------------------------------------------------------

BINARY = find_llama_server()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.llama
@tier(missing_reason() if BINARY is None else None)
def test_E1_ollama_client_against_real_llama_server(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    assert BINARY is not None
    chat = llama_cmd(BINARY, tiny_model, "-c", "512", "-np", "1")
    embed = llama_cmd(
        BINARY, tiny_model, "-c", "512", "-np", "1", "--embeddings", "--pooling", "mean"
    )
    gw = gateway_factory(
        "servers: {box: {pools: {gpu0: 8GB, system: 8GB}}}\n"  # footprints estimated
        "models:\n"
        f"  tiny: {{backends: [{{cmd: {json.dumps(chat)}, proxy: '${{PORT}}', server: box}}]}}\n"
        f"  tiny-embed:\n    backends: [{{cmd: {json.dumps(embed)}, proxy: '${{PORT}}', "
        "type: embed, server: box}]\n",
        health_timeout="60s",
    )
    c = closed_at_end(ollama.Client(host=gw.url, timeout=60))
    parts = list(c.chat(model="tiny", messages=HI, stream=True, options={"num_predict": 4}))
    say("chat stream ->", [p.message.content for p in parts], parts[-1].done_reason)
    assert parts[-1].done and parts[-1].done_reason == "length" and parts[-1].eval_count == 4
    assert "".join(p.message.content or "" for p in parts)
    made = c.generate(model="tiny:latest", prompt="Hi", options={"num_predict": 3})
    say("generate ->", repr(made.response), made.eval_count, made.prompt_eval_count)
    assert made.eval_count == 3 and made.response and made.prompt_eval_count
    embedded = c.embed(model="tiny-embed", input="Hi")
    say("embed ->", len(embedded.embeddings[0]), "dimensions")
    assert len(embedded.embeddings[0]) == 64
    tags = c.list()
    say(
        "tags ->", [(m.model, m.size, m.details.family if m.details else None) for m in tags.models]
    )
    (tiny, _) = tags.models
    assert tiny.details is not None and tiny.details.format == "gguf"
    assert tiny.details.family == "llama" and tiny.size == tiny_model.stat().st_size
    running = c.ps().models
    say("ps ->", [(m.model, m.size, m.size_vram) for m in running])
    assert sorted(m.model for m in running) == ["tiny", "tiny-embed"]
    assert all(m.size and m.size_vram and m.size > m.size_vram for m in running)
    shown = c.show("tiny")
    say("show ->", shown.capabilities, shown.details.parameter_size if shown.details else None)
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "llama"

    def rows() -> list[dict[str, Any]]:
        found = gw.api("GET", "activity?model=tiny&limit=10").json()["rows"]
        return [r for r in found if r["kind"] == "request" and r["status"] == 200]

    done = wait_for(lambda: len(rows()) >= 2 and rows(), 10, what="two metered rows")
    assert sorted(r["completion_tokens"] for r in done) == [3, 4]
    assert not any(r["estimated"] for r in done)
