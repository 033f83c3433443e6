"""W2 with real llama-server: a slot cache saved before a stop and restored after the next
start spares the follow-up turn its prompt processing (`timings.prompt_n` counts only the
new tokens), through corrallm/lifecycle/slots.py called directly with a small aiohttp
`call`. Also what llama-server answers for what can go wrong: a file saved by another
model, a server started without `--slot-save-path`.

The binary comes from `make llama-server`; the models are tiny random-weight GGUFs
(tests/support/tiny_gguf.py). Without the binary every test here is skipped loudly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from corrallm.lifecycle.slots import (
    Call,
    SlotReport,
    restore_slots,
    save_slots,
    slot_file,
    slot_save_dir,
)
from tests.support.llama import (
    LlamaServer,
    find_llama_server,
    llama_cmd,
    missing_reason,
    running_llama_server,
)
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

BINARY = find_llama_server()
pytestmark = [pytest.mark.llama, tier(missing_reason() if BINARY is None else None)]
BACKEND = "chat#0"
FLAGS = ("-c", "4096", "-np", "2")  # two slots: one used by the test, one never used


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
async def call() -> AsyncIterator[Call]:
    """What the supervisor's probe will give: one request, (status or None, body)."""
    async with aiohttp.ClientSession() as session:

        async def request(
            method: str, url: str, body: Any, seconds: float
        ) -> tuple[int | None, bytes]:
            try:
                timeout = aiohttp.ClientTimeout(total=seconds)
                async with session.request(method, url, json=body, timeout=timeout) as r:
                    return r.status, await r.read()
            except (aiohttp.ClientError, OSError, TimeoutError):
                return None, b""

        yield request


def opening() -> list[dict[str, str]]:
    """A long system prompt (about 900 tokens of the tiny byte-level vocabulary) + a turn."""
    rules = " ".join(f"Rule {i}: answer in plain words." for i in range(30))
    return [
        {"role": "system", "content": f"You are a careful guide. {rules}"},
        {"role": "user", "content": "What is a prompt cache?"},
    ]


def chat(server: LlamaServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def follow_up(messages: list[dict[str, str]], answer: dict[str, Any]) -> list[dict[str, str]]:
    said = answer["choices"][0]["message"]["content"] or ""
    return [
        *messages,
        {"role": "assistant", "content": said},
        {"role": "user", "content": "Go on."},
    ]


async def test_W2_a_restored_slot_cache_spares_the_follow_up_its_prompt_processing(
    tmp_path: Path, tiny_model: Path, call: Call
) -> None:
    assert BINARY is not None
    slots = tmp_path / "slots"
    slots.mkdir()  # llama-server refuses to start when the directory is missing
    flags = (*FLAGS, "--slot-save-path", str(slots))
    assert slot_save_dir(llama_cmd(BINARY, tiny_model, *flags)) == str(slots)
    messages = opening()

    with running_llama_server(BINARY, tiny_model, tmp_path, *flags) as server:
        first = chat(server, messages)
        saved = await save_slots(call, server.url, BACKEND, 30.0)
    used = saved.done[0] if saved.done else None
    then = follow_up(messages, first)

    with running_llama_server(BINARY, tiny_model, tmp_path, *flags) as server:
        restored = await restore_slots(call, server.url, BACKEND, str(slots), 30.0)
        warm = chat(server, then)["timings"]
    with running_llama_server(BINARY, tiny_model, tmp_path, *flags) as server:
        cold = chat(server, then)["timings"]  # the same turn with nothing restored

    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 800 and first["timings"]["prompt_n"] == prompt
    # One slot ran a task: only it was saved (the other was skipped), prompt + reply.
    assert (len(saved.done), saved.failed, restored.done, restored.failed) == (1, (), (used,), ())
    assert sorted(p.name for p in slots.iterdir()) == [slot_file(BACKEND, used or 0)]
    assert saved.tokens == restored.tokens >= prompt
    # After the restart: the restored cache covered the whole first turn.
    new_tokens = cold["prompt_n"] - restored.tokens
    assert warm["cache_n"] >= prompt and warm["prompt_n"] <= new_tokens + 4
    assert warm["prompt_n"] * 10 < cold["prompt_n"], (warm, cold)


async def test_W2_a_file_saved_by_another_model_is_refused_and_the_server_lives_on(
    tmp_path: Path, tiny_model: Path, call: Call
) -> None:
    assert BINARY is not None
    slots = tmp_path / "slots"
    slots.mkdir()
    flags = (*FLAGS, "--slot-save-path", str(slots))
    with running_llama_server(BINARY, tiny_model, tmp_path, *flags) as server:
        chat(server, opening())
        saved = await save_slots(call, server.url, BACKEND, 30.0)

    wider = write_tiny_gguf(tmp_path / "wider.gguf", n_embd=128)
    with running_llama_server(BINARY, wider, tmp_path, *flags) as server:
        restored = await restore_slots(call, server.url, BACKEND, str(slots), 30.0)
        health, _ = await call("GET", server.url + "/health", None, 5.0)
        after = chat(server, opening())["timings"]

    (used,) = saved.done
    refused = (
        f"slot {used}: 400 Unable to restore slot: No available space in KV cache or "
        "invalid slot save file"
    )
    assert (restored.done, restored.failed, health) == ((), (refused,), 200)
    assert after["cache_n"] == 0  # nothing half-restored is reused


async def test_W2_without_slot_save_path_llama_server_answers_501(
    tmp_path: Path, tiny_model: Path, call: Call
) -> None:
    assert BINARY is not None
    with running_llama_server(BINARY, tiny_model, tmp_path, "-c", "1024", "-np", "1") as server:
        chat(server, opening()[1:])
        report = await save_slots(call, server.url, BACKEND, 30.0)
    assert report == SlotReport(
        (),
        (
            "slot 0: 501 This server does not support slots action. "
            "Start it with `--slot-save-path`",
        ),
        0,
        report.seconds,
    )
