"""`corrallm fake-backend` as a real process: the contract the gateway's tests rely on (§12)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.support.processes import free_port

DEADLINE = 15.0


def wait_until(cond: Callable[[], Any], timeout: float = DEADLINE, what: str = "condition") -> Any:
    """Poll `cond` until it returns something truthy; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class Backend:
    """One fake-backend process in its own process group, its stdout collected line by line."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "corrallm", "fake-backend", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, text: str) -> str:
        return wait_until(
            lambda: next((line for line in self.lines if text in line), None),
            what=f"a log line containing {text!r}; got:\n{self.output()}",
        )

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self) -> None:
        wait_until(lambda: self.health() == 200, what=f"health 200; log:\n{self.output()}")

    def get(self, path: str) -> Any:
        return httpx.get(f"{self.url}{path}", timeout=5).json()

    def openai(self) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="sk-test", max_retries=0, timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Backend]]:
    started: list[Backend] = []

    def start(*args: str, ready: bool = True) -> Backend:
        backend = Backend(*args)
        started.append(backend)
        if ready:
            backend.wait_ready()
        return backend

    yield start
    for backend in started:
        backend.stop()


@pytest.fixture
def backend(spawn: Callable[..., Backend]) -> Backend:
    return spawn("--model-name", "fake-chat", "--tokens", "5")


MESSAGES = [{"role": "user", "content": "say hello to the tests"}]


def test_L1_health_is_503_while_loading_then_200(spawn: Callable[..., Backend]) -> None:
    b = spawn("--load-seconds", "1.5", ready=False)
    # The port is bound at once, but the backend is not healthy yet.
    b.wait_line("server is listening on")
    first = httpx.get(f"{b.url}/health", timeout=2)
    assert first.status_code == 503
    assert first.json() == {
        "error": {"message": "Loading model", "type": "unavailable_error", "code": 503}
    }
    chat = httpx.post(f"{b.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=2)
    assert chat.status_code == 503
    assert httpx.get(f"{b.url}/healthz", timeout=2).status_code == 503
    b.wait_ready()
    assert httpx.get(f"{b.url}/health", timeout=2).json() == {"status": "ok"}
    b.wait_line("all slots are idle")
    # Health polls are counted apart and are not requests.
    stats = b.get("/debug/stats")
    assert stats["health_checks"] >= 3
    assert stats["completed"] == 1


def test_L6_prints_llama_server_log_lines(spawn: Callable[..., Backend]) -> None:
    b = spawn("--n-ctx", "8192", "--n-slots", "2")
    b.wait_line("all slots are idle")
    out = b.output()
    assert "llama_context: n_ctx         = 8192" in out
    assert "srv    load_model: initializing slots, n_slots = 2" in out
    assert "slot   load_model: id  0 | task -1 | new slot n_ctx_slot = 4096" in out
    assert "slot   load_model: id  1 | task -1 | new slot n_ctx_slot = 4096" in out
    assert f"main: server is listening on http://127.0.0.1:{b.port} - starting the main loop" in out
    props = b.get("/props")
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 4096  # per slot, like llama-server
    with b.openai() as client:
        client.chat.completions.create(model="x", messages=MESSAGES)
    b.wait_line("request: POST /v1/chat/completions 200")


def test_chat_non_stream_with_openai_sdk(backend: Backend) -> None:
    with backend.openai() as client:
        resp = client.chat.completions.create(model="fake-chat", messages=MESSAGES)
        capped = client.chat.completions.create(
            model="fake-chat",
            messages=MESSAGES,
            max_tokens=2,
        )
    assert resp.object == "chat.completion"
    assert resp.model == "fake-chat"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "Hello from the fake backend"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (5, 5)
    assert resp.usage.total_tokens == 10
    assert capped.choices[0].message.content == "Hello from"
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage is not None and capped.usage.completion_tokens == 2


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_with_openai_sdk(backend: Backend, include_usage: bool) -> None:
    with backend.openai() as client:
        stream = client.chat.completions.create(
            model="fake-chat",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True} if include_usage else None,
        )
        chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the fake backend"
    if include_usage:
        last = chunks[-1]
        assert last.choices == []
        assert last.usage is not None
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 5)
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == "stop"
    else:
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.usage is None for c in chunks)


def test_raw_stream_ends_with_done(backend: Backend) -> None:
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{backend.url}/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage_chunk = json.loads(events[-2][len("data: ") :])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["total_tokens"] == 10


def test_completions_non_stream_and_stream(backend: Backend) -> None:
    with backend.openai() as client:
        resp = client.completions.create(model="fake-chat", prompt="one two three", max_tokens=3)
        chunks = list(
            client.completions.create(
                model="fake-chat",
                prompt="one two three",
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert resp.object == "text_completion"
    assert resp.choices[0].text == "Hello from the"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (3, 3)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello from the fake backend"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_embeddings_are_deterministic(spawn: Callable[..., Backend]) -> None:
    b = spawn("--embedding-dim", "12")
    with b.openai() as client:
        one = client.embeddings.create(model="e", input="hello world")  # SDK asks for base64
        many = client.embeddings.create(model="e", input=["hello world", "other"])
        floats = client.embeddings.create(model="e", input="hello world", encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 12
    assert [d.index for d in many.data] == [0, 1]
    assert many.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert many.data[1].embedding != many.data[0].embedding
    assert floats.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-6)
    assert sum(x * x for x in floats.data[0].embedding) == pytest.approx(1.0)
    assert one.usage.prompt_tokens == 2


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_ranks_by_overlap(backend: Backend, path: str) -> None:
    body = {
        "model": "r",
        "query": "the cat sat",
        "documents": ["a dog barked", "the cat sat on the mat", "cat"],
        "top_n": 2,
    }
    resp = httpx.post(f"{backend.url}{path}", json=body, timeout=5)
    assert resp.status_code == 200
    data = resp.json()
    assert data["model"] == "r"
    assert [r["index"] for r in data["results"]] == [1, 2]
    scores = [r["relevance_score"] for r in data["results"]]
    assert scores == sorted(scores, reverse=True)
    assert data["usage"]["prompt_tokens"] > 0


def test_models_props_index_and_audio(backend: Backend) -> None:
    models = backend.get("/v1/models")
    assert [m["id"] for m in models["data"]] == ["fake-chat"]
    index = httpx.get(f"{backend.url}/", timeout=5)
    assert index.headers["content-type"].startswith("text/html")
    with backend.openai() as client:
        text = client.audio.transcriptions.create(model="stt", file=("a.wav", b"RIFF0000"))
        speech = client.audio.speech.create(model="tts", voice="alloy", input="two words")
    assert text.text.startswith("This is a fake transcript")
    audio = speech.read()
    assert audio.startswith(b"RIFF") and len(audio) == 44 + 2 * 3200


def test_malformed_json_is_400_in_openai_shape(backend: Backend) -> None:
    resp = httpx.post(
        f"{backend.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=5,
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "Malformed JSON" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    missing = httpx.post(f"{backend.url}/v1/chat/completions", json={"model": "x"}, timeout=5)
    assert missing.status_code == 400
    assert httpx.get(f"{backend.url}/nope", timeout=5).status_code == 404


def test_debug_requests_record_headers_and_body(backend: Backend) -> None:
    body = {"model": "fake-chat", "messages": MESSAGES}
    httpx.post(
        f"{backend.url}/v1/chat/completions?trace=1",
        json=body,
        headers={"Authorization": "Bearer backend-secret", "X-Custom": "yes"},
        timeout=5,
    )
    records = backend.get("/debug/requests")
    assert len(records) == 1  # health polls and /debug are not recorded
    rec = records[0]
    assert (rec["method"], rec["path"], rec["query"]) == ("POST", "/v1/chat/completions", "trace=1")
    assert rec["headers"]["authorization"] == "Bearer backend-secret"
    assert rec["headers"]["x-custom"] == "yes"
    assert rec["body"] == body
    httpx.delete(f"{backend.url}/debug/requests", timeout=5)
    assert backend.get("/debug/requests") == []


def test_stream_is_flushed_token_by_token(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens", "6", "--token-delay", "0.1")
    arrivals = []
    body = {"messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{b.url}/v1/chat/completions", json=body, timeout=10) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    # role + 6 tokens + finish + [DONE]; 5 gaps of 0.1 s between tokens, so never one burst.
    assert len(arrivals) == 9
    assert arrivals[-1] - arrivals[0] >= 0.4


def test_client_disconnect_counts_as_cancelled(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens", "50", "--token-delay", "0.05")
    body = {"messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{b.url}/v1/chat/completions", json=body, timeout=10) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
        wait_until(lambda: b.get("/debug/stats")["in_flight"] == 1, what="one request in flight")
    stats = wait_until(
        lambda: (s := b.get("/debug/stats"))["cancelled"] == 1 and s, what="cancelled == 1"
    )
    assert stats["in_flight"] == 0
    assert stats["max_in_flight"] == 1
    assert stats["completed"] == 0


def test_latency_disconnect_counts_as_cancelled(spawn: Callable[..., Backend]) -> None:
    b = spawn("--latency", "30")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{b.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=0.5)
    wait_until(lambda: b.get("/debug/stats")["cancelled"] == 1, what="cancelled == 1")


def test_crash_after_tokens_kills_the_process_mid_stream(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens", "10", "--crash-after-tokens", "3")
    body = {"messages": MESSAGES, "stream": True}
    received: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{b.url}/v1/chat/completions", json=body, timeout=10) as resp,
    ):
        received.extend(line for line in resp.iter_lines() if line.startswith("data: "))
    assert len(received) == 4  # role chunk + 3 tokens
    assert b.proc.wait(timeout=DEADLINE) == 1


def test_exit_after_seconds_exits_with_code_3(spawn: Callable[..., Backend]) -> None:
    b = spawn("--load-seconds", "60", "--exit-after-seconds", "0.5", ready=False)
    assert b.proc.wait(timeout=DEADLINE) == 3
    b.wait_line("error: failed to load model 'fake.gguf'")


def test_exit_code_with_exit_after_zero_exits_at_once(spawn: Callable[..., Backend]) -> None:
    b = spawn("--model-name", "x", "--exit-after-seconds", "0", "--exit-code", "7", ready=False)
    assert b.proc.wait(timeout=DEADLINE) == 7
    b.wait_line("error: failed to load model 'x.gguf'")
    assert "listening" not in b.output()


def test_sigterm_stops_it_and_ignore_sigterm_does_not(spawn: Callable[..., Backend]) -> None:
    plain = spawn()
    stubborn = spawn("--ignore-sigterm")
    plain.proc.send_signal(signal.SIGTERM)
    stubborn.proc.send_signal(signal.SIGTERM)
    assert plain.proc.wait(timeout=DEADLINE) in (0, -signal.SIGTERM)
    stubborn.wait_line("received SIGTERM, ignoring it")
    assert stubborn.health() == 200
    assert stubborn.proc.poll() is None
    os.killpg(stubborn.proc.pid, signal.SIGKILL)
    assert stubborn.proc.wait(timeout=DEADLINE) == -signal.SIGKILL


def test_a_closed_stdout_pipe_breaks_neither_requests_nor_sigterm() -> None:
    # The gateway that read our log may die; a re-adopted backend must keep working.
    port = free_port()
    cmd = [sys.executable, "-m", "corrallm", "fake-backend", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        proc.stdout.close()
        url = f"http://127.0.0.1:{port}"

        def chat_status() -> int | None:
            try:
                return httpx.post(f"{url}/v1/completions", json={"prompt": "x"}).status_code
            except httpx.TransportError:
                return None

        assert wait_until(chat_status, what="a completion") == 200
        assert chat_status() == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) in (0, -signal.SIGTERM)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=DEADLINE)


def test_fast_mode_answers_valid_json_without_logging(spawn: Callable[..., Backend]) -> None:
    b = spawn("--fast", "--tokens", "4")
    with b.openai() as client:
        for _ in range(3):
            resp = client.chat.completions.create(model="bench", messages=MESSAGES)
            assert resp.choices[0].message.content == "Hello from the fake"
            assert resp.usage is not None and resp.usage.total_tokens == 9
        chunks = list(
            client.chat.completions.create(
                model="bench",
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert b.get("/debug/stats")["completed"] == 4
    assert "request:" not in b.output()


def test_sse_crlf_frames_every_event_with_crlf(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens", "3", "--sse-crlf")
    body = {"messages": MESSAGES, "stream": True}
    raw = httpx.post(f"{b.url}/v1/chat/completions", json=body, timeout=10).content
    assert raw.endswith(b"data: [DONE]\r\n\r\n") and raw.count(b"\r\n\r\n") == 6
    assert b"\n" not in raw.replace(b"\r\n", b"")  # no bare LF anywhere


def test_hang_with_faulty_requests_hangs_only_the_first(spawn: Callable[..., Backend]) -> None:
    b = spawn("--hang", "--faulty-requests", "1")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{b.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=0.5)
    wait_until(lambda: b.get("/debug/stats")["cancelled"] == 1, what="the hang cancelled")
    ok = httpx.post(f"{b.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=10)
    assert ok.status_code == 200


def test_stall_after_tokens_goes_silent_with_the_connection_open(
    spawn: Callable[..., Backend],
) -> None:
    b = spawn("--tokens", "10", "--stall-after-tokens", "2")
    body = {"messages": MESSAGES, "stream": True}
    received: list[str] = []
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.stream("POST", f"{b.url}/v1/chat/completions", json=body, timeout=1) as resp,
    ):
        received.extend(line for line in resp.iter_lines() if line.startswith("data: "))
    assert len(received) == 3  # role chunk + 2 tokens, then silence
    wait_until(lambda: b.get("/debug/stats")["cancelled"] == 1, what="the stall cancelled")


def test_die_mid_body_cuts_a_non_streamed_answer(spawn: Callable[..., Backend]) -> None:
    b = spawn("--die-mid-body")
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{b.url}/v1/chat/completions", json={"messages": MESSAGES}, timeout=10)
    assert b.proc.wait(timeout=DEADLINE) == 1


def test_crash_mid_event_tears_the_next_event(spawn: Callable[..., Backend]) -> None:
    b = spawn("--tokens", "10", "--crash-after-tokens", "2", "--crash-mid-event")
    body = {"messages": MESSAGES, "stream": True}
    raw = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{b.url}/v1/chat/completions", json=body, timeout=10) as resp,
    ):
        for piece in resp.iter_raw():
            raw += piece
    assert raw.count(b"\n\n") == 3 and not raw.endswith(b"\n\n")  # 3 whole, 1 torn
    assert b.proc.wait(timeout=DEADLINE) == 1


MIB = 1024 * 1024


def test_M2_hold_mb_grows_the_rss_once_loaded(spawn: Callable[..., Backend]) -> None:
    b = spawn("--load-seconds", "1", "--hold-mb", "256", ready=False)
    wait_until(lambda: b.health() == 503, what="the server answering while loading")
    proc = psutil.Process(b.proc.pid)
    loading_rss = proc.memory_info().rss
    b.wait_line("main: model loaded")
    grown = proc.memory_info().rss - loading_rss
    assert 0.9 * 256 * MIB <= grown <= 1.3 * 256 * MIB, f"RSS grew by {grown / MIB:.0f} MiB"
    b.wait_ready()


def test_M5_load_progress_prints_a_line_per_interval_while_loading(
    spawn: Callable[..., Backend],
) -> None:
    b = spawn("--load-seconds", "1.2", "--load-progress", "0.2", ready=False)
    b.wait_line("main: model loaded")
    progress = [line for line in b.lines if "loading tensors" in line]
    assert 3 <= len(progress) <= 6, progress
    loaded_at = next(i for i, line in enumerate(b.lines) if "model loaded" in line)
    assert all(b.lines.index(line) < loaded_at for line in progress)


def test_M4_die_after_ready_exits_with_code_1(spawn: Callable[..., Backend]) -> None:
    b = spawn("--die-after-ready", "0.3")
    assert b.proc.wait(timeout=DEADLINE) == 1
    b.wait_line("error: the model server died (--die-after-ready)")


def test_M4_hang_after_ready_stops_answering_but_stays_alive(
    spawn: Callable[..., Backend],
) -> None:
    b = spawn("--hang-after-ready", "0.3")
    b.wait_line("not answering anything from now on")
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{b.url}/health", timeout=0.5)
    b.proc.send_signal(signal.SIGTERM)  # a hung server does not handle it
    with pytest.raises(subprocess.TimeoutExpired):
        b.proc.wait(timeout=0.5)
    assert b.proc.poll() is None
