"""M1 against a real llama.cpp `llama-server`: the GGUF estimate vs the process's RSS on CPU.

The binary comes from `make llama-server` (CORRALLM_LLAMA_SERVER under `.ci/run`); the model
is a random-weight GGUF written here (tests/support/tiny_gguf.py). Without the binary the
test is skipped with a loud reason. The full table over bigger shapes is
bench/memory_estimate.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import httpx
import psutil
import pytest

from corrallm.residency.estimate import estimate
from tests.support.llama import find_llama_server, llama_cmd, missing_reason, running_llama_server
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

BINARY = find_llama_server()
pytestmark = [
    pytest.mark.llama,
    tier(missing_reason() if BINARY is None else None),
]
# ~700 tokens (about one per character with the byte-level vocabulary): more than one
# micro-batch of 512, so the compute buffers are written in full, as in real use.
PROMPT = " ".join(f"item {i} is here." for i in range(42))


def test_M1_estimate_is_within_15_percent_of_llama_server_rss(tmp_path: Path) -> None:
    assert BINARY is not None
    model = write_tiny_gguf(
        tmp_path / "m1.gguf",
        n_embd=512,
        n_layer=4,
        n_ff=1536,
        n_head=8,
        n_head_kv=2,
        n_vocab=8000,
        dtype="F16",
    )  # ~45 MB of weights: the fixed runtime does not dominate
    flags = ("-c", "4096", "-ngl", "0", "-t", "2")
    argv = shlex.split(llama_cmd(BINARY, model, *flags))
    predicted = estimate(argv).usage(None)["system"]

    with running_llama_server(BINARY, model, tmp_path, *flags) as server:
        body = {"prompt": PROMPT, "n_predict": 4}
        answer = httpx.post(server.url + "/completion", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens_evaluated"] > 512
        rss = psutil.Process(server.proc.pid).memory_info().rss

    error = predicted / rss - 1
    assert abs(error) <= 0.15, (
        f"estimate {predicted / 2**20:.1f} MiB vs RSS {rss / 2**20:.1f} MiB ({error:+.1%})"
    )
