"""K2 end to end: the official `openai` SDK's `client.responses` against a real `corrallm
serve`, translated to Chat Completions for the fake backend, and native or translated for
real llama-server on the tiny GGUF (`-s` prints a transcript of those runs)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from corrallm.config.schema import short_key_name
from tests.support.llama import find_llama_server, llama_cmd, missing_reason
from tests.support.processes import Gateway, fake_cmd, wait_for
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

Factory = Callable[..., Gateway]
CONFIG = f"""
priorityGroups:
  coders: {{weight: 4}}
keys: {{sk-coder: coders}}
models:
  chat:
    aliases: [gpt-4.1-mini]
    backends:
      - cmd: "{fake_cmd("--tokens", "6")}"
        proxy: ${{PORT}}
        maxConcurrent: 2
  broken:
    backends:
      - cmd: "{fake_cmd("--tokens", "8", "--crash-after-tokens", "3")}"
        proxy: ${{PORT}}
  tools:
    backends:
      - cmd: "{fake_cmd("--tokens", "6", "--tool-calls")}"
        proxy: ${{PORT}}
"""
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture
def gw(gateway_factory: Factory) -> Gateway:
    return gateway_factory(CONFIG)


@pytest.fixture
def client(gw: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.v1, api_key="sk-coder", max_retries=0, timeout=30) as sdk:
        yield sdk


def request_rows(gw: Gateway, count: int) -> list[dict[str, Any]]:
    """The newest `count` request rows on /v1/responses, oldest first, once written."""

    def rows() -> list[dict[str, Any]] | None:
        got = [
            r
            for r in gw.api("GET", "activity?limit=50").json()["rows"]
            if r["kind"] == "request" and r["endpoint"] == "/v1/responses"
        ]
        return got[:count][::-1] if len(got) >= count else None

    return wait_for(rows, 10, what=f"{count} activity rows")


def test_K2_responses_create_is_translated_for_a_chat_backend(client, gw):
    response = client.responses.create(
        model="gpt-4.1-mini",
        instructions="Answer briefly.",
        input="Say hi.",
        max_output_tokens=50,
    )
    assert response.object == "response" and response.status == "completed"
    assert response.id.startswith("resp_") and response.model == "gpt-4.1-mini"
    assert response.output_text.startswith("Hello from the fake backend")
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and response.usage.output_tokens == 6
    assert response.usage.total_tokens == response.usage.input_tokens + 6
    (row,) = request_rows(gw, 1)
    assert (row["model"], row["key"], row["status"]) == ("chat", short_key_name("sk-coder"), 200)
    assert row["prompt_tokens"] == response.usage.input_tokens
    assert row["completion_tokens"] == 6 and not row["estimated"]


def test_K2_a_list_of_messages_streams_as_responses_events(client, gw):
    stream = client.responses.create(
        model="chat",
        input=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "Stream please."}]},
        ],
        stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas and deltas.startswith("Hello from the fake backend")
    assert final.usage is not None and final.usage.output_tokens == 6
    (row,) = request_rows(gw, 1)
    assert row["completion_tokens"] == 6 and not row["estimated"]
    assert row["prompt_tokens"] == final.usage.input_tokens


def test_K2_the_sdks_stream_helper_accumulates_the_final_response(client):
    with client.responses.stream(model="chat", input="Hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) and len(deltas) == 6


def test_K2_a_token_limit_reaches_the_backend_and_marks_the_response_incomplete(client):
    response = client.responses.create(model="chat", input="Hi", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "Hello from"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"previous_response_id": "resp_123"}, "whole conversation in 'input'"),
        ({"store": True}, "'store': false"),
        ({"tools": [{"type": "web_search"}]}, "'web_search'"),
    ],
)
def test_K2_state_and_built_in_tools_are_refused_for_a_chat_backend(client, gw, extra, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="chat", input="Hi", **extra)
    assert words in caught.value.message
    assert caught.value.status_code == 400


@pytest.mark.parametrize("streamed", [False, True], ids=["create", "stream"])
def test_K2_a_function_call_round_trip(client, streamed):
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    if streamed:
        with client.responses.stream(model="tools", input=ask, tools=[WEATHER]) as stream:
            kinds = [event.type for event in stream]
            first = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
    else:
        first = client.responses.create(model="tools", input=ask, tools=[WEATHER])
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "fake"})
    follow_up = [
        *ask,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    second = client.responses.create(model="tools", input=follow_up, tools=[WEATHER])
    assert [item.type for item in second.output] == ["message"] and second.output_text


def test_K2_an_unknown_model_is_the_sdks_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="nope", input="Hi")
    assert caught.value.code == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "chat", "input": "\xff\xfe"}',
        b"[1, 2]",
        b'{"model": "chat"}',
        b'{"model": "chat", "input": 5}',
        b'{"model": "chat", "input": "x", "stream": "yes"}',
        b'{"model": "chat", "input": "x", "max_output_tokens": -1}',
        b'{"model": "chat", "input": [{"role": {"a": 1}, "content": "x"}]}',
        b'{"model": "chat", "input": [{"role": "user", "content": [[]]}]}',
        b'{"model": "chat", "input": "x", "tools": [{"type": "function", "name": "f", '
        b'"parameters": "no"}]}',
        json.dumps(
            {"model": "chat", "input": [{"role": "user", "content": "x"}] * 10_000}
        ).encode(),
        json.dumps(
            {"model": "chat", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}
        ).encode(),
    ],
)
def test_K2_hostile_input_is_a_400_in_the_openai_shape(gw, body):
    r = httpx.post(
        gw.v1 + "/responses",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_K2_a_stream_broken_midway_ends_with_response_failed(client, gw):
    events = list(client.responses.create(model="broken", input="Hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None
    assert "broke off" in failed.error.message
    assert failed.output_text == "".join(
        e.delta for e in events if e.type == "response.output_text.delta"
    )
    (row,) = request_rows(gw, 1)
    assert row["status"] == 502


# --- against real llama-server on the tiny GGUF ------------------------------------------

BINARY = find_llama_server()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def dump(response: Any) -> object:
    return response.usage and response.usage.model_dump(exclude_none=True)


def llama_config(model: Path) -> str:
    assert BINARY is not None
    cmd = llama_cmd(BINARY, model, "-c", "512", "-np", "1")
    native = json.dumps({"cmd": cmd, "proxy": "${PORT}", "apis": ["responses"]})
    chat = json.dumps({"cmd": cmd, "proxy": "${PORT}", "apis": ["openai"]})
    return f"models:\n  native: {{backends: [{native}]}}\n  translated: {{backends: [{chat}]}}\n"


@pytest.mark.llama
@tier(missing_reason() if BINARY is None else None)
@pytest.mark.parametrize("model", ["native", "translated"])
def test_K2_responses_against_real_llama_server(
    gateway_factory: Factory, tiny_model: Path, model: str
) -> None:
    gw = gateway_factory(llama_config(tiny_model), health_timeout="60s")
    with openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0, timeout=60) as sdk:
        created = sdk.responses.create(model=model, input="Say hi.", max_output_tokens=5)
        events = list(
            sdk.responses.create(
                model=model,
                input=[{"role": "user", "content": "Say hi."}],
                max_output_tokens=4,
                stream=True,
            )
        )
        helper: list[Any] = []
        if model == "translated":  # llama-server's own events carry no output_index
            with sdk.responses.stream(model=model, input="Hi", max_output_tokens=3) as stream:
                helper = list(stream)
    kinds = [e.type for e in events]
    final = events[-1].response
    print(f"\n--- K2 /v1/responses on real llama-server, {model} ---")
    print(f"create: status={created.status} text={created.output_text!r} usage={dump(created)}")
    print(f"stream: {len(events)} events: {' '.join(dict.fromkeys(kinds))}")
    print(f"stream: text={final.output_text!r} usage={dump(final)}")
    if helper:
        said = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
        print(f"responses.stream helper: {helper[-1].type}, text={said!r}")
        assert said and helper[-1].type in ("response.completed", "response.incomplete")
    assert created.usage is not None and created.usage.output_tokens == 5
    assert created.output_text and created.output[0].type == "message"
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and final.output_text == text
    rows = request_rows(gw, 2 if model == "native" else 3)
    for r in rows:
        print(
            f"activity: {r['endpoint']} {r['status']} backend={r['backend']} "
            f"in={r['prompt_tokens']} out={r['completion_tokens']} estimated={r['estimated']}"
        )
    assert [r["completion_tokens"] for r in rows[:2]] == [5, 4]
    assert all(r["prompt_tokens"] > 0 and not r["estimated"] for r in rows)
