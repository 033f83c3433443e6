"""K6 with real llama-server replicas: two replicas of one model form one tier; a
conversation's follow-up turn goes back to the replica that served its first turn, whose
prompt cache is warm, so llama-server processes fewer prompt tokens (`timings.prompt_n`).
Without affinity (each turn its own session) round-robin sends the follow-up to the other
replica, which processes the whole conversation again.

The binary comes from `make llama-server`; the model is the tiny random-weight GGUF
(tests/support/tiny_gguf.py). Without the binary every test here is skipped loudly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.llama import find_llama_server, llama_cmd, missing_reason
from tests.support.processes import Gateway
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

BINARY = find_llama_server()
pytestmark = [pytest.mark.llama, tier(missing_reason() if BINARY is None else None)]
Factory = Callable[..., Gateway]
REPLICAS = ("r1", "r2")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def two_replicas(model: Path) -> str:
    """One served model, two equal llama-servers (one slot each): one tier (F1)."""
    assert BINARY is not None
    entries = [
        {
            "name": name,
            "cmd": llama_cmd(BINARY, model, "-c", "2048", "-np", "1"),
            "proxy": "${PORT}",
        }
        for name in REPLICAS
    ]
    return "models:\n  chat: {backends: " + json.dumps(entries) + "}\n"  # JSON is YAML


def system_prompt(topic: str) -> dict[str, str]:
    """A long opening (hundreds of tokens), so that a warm cache shows plainly."""
    rules = " ".join(f"Rule {i}: answer about {topic} in plain words." for i in range(12))
    return {"role": "system", "content": f"You are a guide to {topic}. {rules}"}


def turn(gw: Gateway, messages: list[dict[str, str]], session: str | None) -> dict[str, Any]:
    headers = {"x-corrallm-session": session} if session else {}
    body = {"model": "chat", "messages": messages, "max_tokens": 8}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    answer["backend"] = r.headers["x-corrallm-backend"]
    return answer


class Conversation:
    """One chat: its opening, then follow-ups carrying what the model said."""

    def __init__(self, gw: Gateway, topic: str) -> None:
        self.gw = gw
        self.messages = [system_prompt(topic), {"role": "user", "content": f"What is {topic}?"}]
        self.turns: list[tuple[str, int]] = []  # (replica, prompt tokens it processed)

    def say(self, session: str | None = None) -> None:
        if self.turns:
            self.messages.append({"role": "user", "content": f"And then? ({len(self.turns)})"})
        answer = turn(self.gw, self.messages, session)
        self.turns.append((answer["backend"], answer["timings"]["prompt_n"]))
        said = answer["choices"][0]["message"]["content"] or ""
        self.messages.append({"role": "assistant", "content": said})


def test_K6_follow_up_turns_land_on_their_replica_and_reuse_its_prompt_cache(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(two_replicas(tiny_model), health_timeout="60s")
    tea, coffee = Conversation(gw, "tea"), Conversation(gw, "coffee")
    # Back to back (round-robin alone would move the follow-up), then interleaved with
    # another conversation.
    tea.say(), tea.say(), coffee.say(), tea.say(), coffee.say()
    print(f"\nK6 affinity (key: the opening's hash): tea {tea.turns}, coffee {coffee.turns}")
    first, *follow_ups = tea.turns
    other_first, other_follow_up = coffee.turns
    assert [
        {replica for replica, _ in follow_ups} == {first[0]},
        other_follow_up[0] == other_first[0],
        all(processed < first[1] / 2 for _, processed in follow_ups),
        other_follow_up[1] < other_first[1] / 2,
    ] == [True] * 4, (tea.turns, coffee.turns)


def test_K6_without_affinity_round_robin_moves_the_follow_up_and_its_prompt_is_redone(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(two_replicas(tiny_model), health_timeout="60s")
    tea = Conversation(gw, "tea")
    tea.say(session="turn-1"), tea.say(session="turn-2")  # two sessions: no preference
    print(f"\nK6 without affinity (a session per turn): tea {tea.turns}")
    (tea1, tea2) = tea.turns
    assert [tea2[0] != tea1[0], tea2[1] >= tea1[1]] == [True, True], tea.turns
