"""SPEC §16 K1 end to end: the official `anthropic` SDK, unmodified, against a real
`corrallm serve` in front of the fake backend (translated to Chat Completions) and in
front of real llama-server (which speaks /v1/messages natively: both ways are run).
`pytest -s` prints a short transcript of each SDK exchange."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from corrallm.config.schema import short_key_name
from tests.support.llama import find_llama_server, llama_cmd, missing_reason
from tests.support.processes import Gateway, fake_cmd, wait_for
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

Factory = Callable[..., Gateway]
HI = [{"role": "user", "content": "Say hi."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

CONFIG = f"""
scheduler: {{requireKeys: true}}
priorityGroups:
  coders: {{weight: 4}}
keys: {{sk-coder: coders}}
models:
  claude-local:
    aliases: [claude-sonnet-4-6]
    backends:
      - cmd: "{fake_cmd("--tokens", "6", "--tool-calls")}"
        proxy: ${{PORT}}
        maxConcurrent: 2
  crashy:
    backends: [{{cmd: "{fake_cmd("--crash-after-tokens", "2")}", proxy: "${{PORT}}"}}]
"""


def say(*parts: object) -> None:
    print("  [anthropic sdk]", *parts)


@pytest.fixture
def gw(gateway_factory: Factory) -> Gateway:
    return gateway_factory(CONFIG)


@pytest.fixture
def client(gw: Gateway) -> Iterator[anthropic.Anthropic]:
    # x-api-key (what the SDK sends for api_key) is the caller's corrallm key.
    with anthropic.Anthropic(base_url=gw.url, api_key="sk-coder", max_retries=0, timeout=30) as sdk:
        yield sdk


def post(gw: Gateway, body: object, path: str = "/v1/messages", **kw: Any) -> httpx.Response:
    headers = {"x-api-key": "sk-coder", "content-type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(gw.url + path, content=content, headers=headers, timeout=30, **kw)


def test_K1_messages_create_translated_to_chat(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model="claude-sonnet-4-6",
        max_tokens=64,
        system="You are terse.",
        messages=HI,
    )
    say("create ->", msg.stop_reason, repr(msg.content[0].text), msg.usage)  # type: ignore[union-attr]
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.model == "claude-sonnet-4-6"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens == 6 and msg.usage.input_tokens > 0

    capped = client.messages.create(model="claude-local", max_tokens=2, messages=HI)
    assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 2


def test_K1_messages_stream_text_deltas_final_message_and_usage(
    client: anthropic.Anthropic,
) -> None:
    with client.messages.stream(model="claude-local", max_tokens=64, messages=HI) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    say("stream ->", deltas, final.stop_reason, final.usage)
    assert len(deltas) == 6
    assert "".join(deltas) == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0


@pytest.mark.parametrize("streamed", [False, True])
def test_K1_tool_use_round_trip(client: anthropic.Anthropic, streamed: bool) -> None:
    ask: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs: dict[str, Any] = {"model": "claude-local", "max_tokens": 64, "tools": [WEATHER]}
    if streamed:
        with client.messages.stream(messages=ask, **kwargs) as stream:
            kinds = [event.type for event in stream]
            first = stream.get_final_message()
        assert "content_block_delta" in kinds and kinds[-1] == "message_stop"
    else:
        first = client.messages.create(messages=ask, tool_choice={"type": "any"}, **kwargs)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    say("tool_use ->", use.name, use.input, first.stop_reason)
    assert first.stop_reason == "tool_use"
    assert (use.name, use.input) == ("get_weather", {"city": "fake"})
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}
    history = [*ask, {"role": "assistant", "content": first.content}]
    second = client.messages.create(
        messages=[*history, {"role": "user", "content": [result]}], **kwargs
    )
    say("after tool_result ->", second.stop_reason, repr(second.content[0].text))  # type: ignore[union-attr]
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"


def test_K1_tool_use_reaches_the_backend_as_chat_tools(gw: Gateway) -> None:
    body = {
        "model": "claude-local",
        "max_tokens": 5,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "stop_sequences": ["\n\n"],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    }
    assert post(gw, body).status_code == 200
    # The fake backend's request log, through corrallm's /upstream passthrough.
    log = gw.upstream("GET", "claude-local/debug/requests", timeout=10).json()
    sent = log[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert "x-api-key" not in sent["headers"]  # the caller's key never leaves corrallm
    chat = sent["body"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["stop"] == ["\n\n"] and chat["max_tokens"] == 5
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "user"]


def test_K1_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="claude-local", messages=HI)
    say("count_tokens ->", counted.input_tokens)
    assert counted.input_tokens > 0


def test_K1_unknown_model_is_the_sdks_not_found_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="missing", max_tokens=5, messages=HI)
    say("unknown model ->", err.value.status_code, err.value.body)
    assert err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_K1_bad_key_is_the_sdks_authentication_error(gw: Gateway) -> None:
    with anthropic.Anthropic(base_url=gw.url, api_key="sk-nobody", max_retries=0) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as err:
            sdk.messages.create(model="claude-local", max_tokens=5, messages=HI)
        with pytest.raises(anthropic.AuthenticationError):
            sdk.messages.count_tokens(model="claude-local", messages=HI)
    assert err.value.body["type"] == "error"  # type: ignore[index]


def test_K1_x_api_key_is_the_caller_key_and_its_lane_is_recorded(
    gw: Gateway, client: anthropic.Anthropic
) -> None:
    client.messages.create(model="claude-local", max_tokens=5, messages=HI)

    def rows() -> list[dict[str, Any]]:
        found = gw.api("GET", f"activity?key={short_key_name('sk-coder')}").json()["rows"]
        return [r for r in found if r["kind"] == "request"]

    (row,) = wait_for(rows, 10, what="the /v1/messages activity row")
    assert (row["group"], row["endpoint"], row["status"]) == ("coders", "/v1/messages", 200)
    assert row["completion_tokens"] == 5


def _blocks(n: int) -> list[dict[str, str]]:
    return [{"type": "text", "text": "x"}] * n


HOSTILE: dict[str, Any] = {
    "not an object": [1, 2],
    "missing messages": {"model": "claude-local", "max_tokens": 5},
    "messages not a list": {"model": "claude-local", "max_tokens": 5, "messages": "hi"},
    "wrong role": {"model": "claude-local", "messages": [{"role": "system", "content": "x"}]},
    "content a number": {"model": "claude-local", "messages": [{"role": "user", "content": 7}]},
    "max_tokens a string": {"model": "claude-local", "max_tokens": "5", "messages": HI},
    "stream a string": {"model": "claude-local", "stream": "yes", "messages": HI},
    "10,000 content blocks": {
        "model": "claude-local",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": _blocks(10_000)}],
    },
    "tool schema not an object": {
        "model": "claude-local",
        "max_tokens": 5,
        "messages": HI,
        "tools": [{"name": "t", "input_schema": "string"}],
    },
    "tool_choice unknown": {
        "model": "claude-local",
        "messages": HI,
        "tool_choice": {"type": "sometimes"},
    },
    "image without source": {
        "model": "claude-local",
        "messages": [{"role": "user", "content": [{"type": "image"}]}],
    },
}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_K1_hostile_input_is_a_400_in_the_anthropic_shape(gw: Gateway, path: str) -> None:
    cases = {**HOSTILE, "invalid utf-8": b'{"model": "claude-local", "messages": "\xff\xfe"}'}
    for name, body in cases.items():
        r = post(gw, body, path)
        assert r.status_code == 400, (name, r.status_code, r.text)
        error = r.json()
        assert error["type"] == "error", name
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"]


def test_K1_errors_on_these_paths_keep_the_anthropic_shape(gw: Gateway) -> None:
    r = httpx.get(gw.url + "/v1/messages", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_K1_a_stream_whose_backend_breaks_ends_with_an_error_event(gw: Gateway) -> None:
    body = {"model": "crashy", "max_tokens": 50, "stream": True, "messages": HI}
    r = post(gw, body)
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0].startswith("event: message_start")
    assert events[-1].startswith("event: error")
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "[DONE]" not in r.text and "message_stop" not in r.text
    say("broken stream ->", error["error"]["message"][:80])


# --- against real llama-server ------------------------------------------------------------

BINARY = find_llama_server()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.mark.llama
@tier(missing_reason() if BINARY is None else None)
@pytest.mark.parametrize("apis", ["[anthropic]", "[openai]"], ids=["native", "translated"])
def test_K1_anthropic_sdk_against_real_llama_server(
    gateway_factory: Factory, tiny_model: Path, apis: str
) -> None:
    assert BINARY is not None
    cmd = llama_cmd(BINARY, tiny_model, "-c", "512", "-np", "1")
    gw = gateway_factory(
        f"models:\n  tiny:\n    backends:\n"
        f"      - {{cmd: {json.dumps(cmd)}, proxy: '${{PORT}}', apis: {apis}}}\n"
    )
    say(f"llama-server, apis: {apis}")
    with anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0, timeout=60) as sdk:
        msg = sdk.messages.create(model="tiny", max_tokens=4, messages=HI)
        say("create ->", msg.stop_reason, repr(msg.content[0].text), msg.usage)  # type: ignore[union-attr]
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 4
        with sdk.messages.stream(model="tiny", max_tokens=4, messages=HI) as stream:
            deltas = list(stream.text_stream)
            final = stream.get_final_message()
        say("stream ->", deltas, final.stop_reason, final.usage)
        assert "".join(deltas) == final.content[0].text  # type: ignore[union-attr]
        assert final.usage.output_tokens == 4
        counted = sdk.messages.count_tokens(model="tiny", messages=HI)
        say("count_tokens ->", counted.input_tokens)
        assert counted.input_tokens > 0
        with pytest.raises(anthropic.NotFoundError):
            sdk.messages.create(model="nope", max_tokens=4, messages=HI)

    def rows() -> list[dict[str, Any]]:
        found = gw.api("GET", "activity?model=tiny&limit=10").json()["rows"]
        return [r for r in found if r["kind"] == "request" and r["status"] == 200]

    done = wait_for(lambda: len(rows()) >= 2 and rows(), 10, what="two metered rows")
    assert all(r["completion_tokens"] == 4 and not r["estimated"] for r in done), done
