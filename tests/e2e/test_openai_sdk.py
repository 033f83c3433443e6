"""End to end with the official `openai` SDK against a real `corrallm serve` process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.processes import (
    Gateway,
    cleanup,
    fake_cmd,
    free_port,
    wait_healthy,
)

CONFIG = f"""
models:
  chat-model:
    aliases: [gpt-4o-mini]
    backends:
      - cmd: "{fake_cmd("--tokens", "6", "--load-seconds", "0.5")}"
        proxy: ${{PORT}}
        maxConcurrent: 2
  embedder:
    backends: [{{cmd: "{fake_cmd("--embedding-dim", "16")}", proxy: "${{PORT}}", type: embed}}]
"""


@pytest.fixture
def client(gateway_factory) -> Iterator[openai.OpenAI]:
    gw = gateway_factory(CONFIG)
    with openai.OpenAI(base_url=gw.v1, api_key="my-coder", max_retries=0, timeout=30) as sdk:
        yield sdk


def test_chat_completion_through_the_sdk(client):
    reply = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "say hi"}]
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 6


def test_streaming_chat_with_usage_through_the_sdk(client):
    stream = client.chat.completions.create(
        model="chat-model",
        messages=[{"role": "user", "content": "stream please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_streaming_chat_without_usage_has_no_usage_chunk(client):
    stream = client.chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": "x"}], stream=True
    )
    assert all(c.choices for c in stream)


def test_completions_through_the_sdk(client):
    reply = client.completions.create(model="chat-model", prompt="Once upon", max_tokens=3)
    assert reply.choices[0].text and reply.usage.completion_tokens == 3


def test_embeddings_through_the_sdk(client):
    reply = client.embeddings.create(model="embedder", input=["a", "b"])
    assert [len(d.embedding) for d in reply.data] == [16, 16]


def test_models_and_errors_through_the_sdk(client):
    assert [m.id for m in client.models.list()] == ["chat-model", "embedder"]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="missing", messages=[])
    assert err.value.code == "model_not_found"


def test_serve_without_a_config_runs_the_packaged_demo(tmp_path: Path):
    """The README quick start: `corrallm serve` alone, then a chat completion."""
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "corrallm", "serve", "--home", str(tmp_path / "home")],
            cwd=tmp_path,  # no corrallm.yaml here
            env={**os.environ, "ADDR": f"127.0.0.1:{port}"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    gw = Gateway(f"http://127.0.0.1:{port}", tmp_path / "home", log, proc=proc)
    try:
        wait_healthy(gw)
        with openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0, timeout=30) as client:
            assert "demo-chat" in [m.id for m in client.models.list()]
            reply = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "hello"}]
            )
        assert reply.choices[0].message.content
        assert "packaged demo" in gw.log()
    finally:
        cleanup(gw)
