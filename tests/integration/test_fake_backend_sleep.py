"""`corrallm fake-backend` as a real process: vLLM's sleep mode (SPEC §18 W1) and
llama-server's slot save/restore (W2), the APIs corrallm's sleep and warm-swap drive."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.processes import FakeBackend, kill_group, start_fake_backend, wait_for

MIB = 1024 * 1024
SLEEPING = {
    "message": "model is sleeping; POST /wake_up first",
    "type": "unavailable",
    "param": None,
    "code": 503,
}
FAKE = [sys.executable, "-m", "corrallm", "fake-backend"]
CHAT = {"messages": [{"role": "user", "content": "hello there friend"}]}
Spawn = Callable[..., FakeBackend]


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start fake backends (healthy before this returns); every one is killed after."""
    started: list[FakeBackend] = []

    def start(*flags: str) -> FakeBackend:
        backend = start_fake_backend(tmp_path, *flags)
        started.append(backend)
        return backend

    yield start
    for backend in started:
        kill_group(backend.proc.pid)
        backend.proc.wait(10)


def log_of(backend: FakeBackend, tmp_path: Path) -> str:
    return (tmp_path / f"fake-{backend.port}.log").read_text()


def post(b: FakeBackend, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(b.url + path, timeout=10, **kwargs)


def get(b: FakeBackend, path: str) -> httpx.Response:
    return httpx.get(b.url + path, timeout=10)


def stats(b: FakeBackend) -> dict[str, Any]:
    answer: dict[str, Any] = get(b, "/debug/stats").json()
    return answer


def is_sleeping(b: FakeBackend) -> bool:
    answer = get(b, "/is_sleeping")
    assert answer.status_code == 200
    value = answer.json()["is_sleeping"]
    assert isinstance(value, bool)
    return value


def in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


# --- W1: vLLM's sleep mode ---------------------------------------------------------------------


def test_W1_sleep_wake_and_is_sleeping_answer_like_vllm(spawn: Spawn, tmp_path: Path) -> None:
    b = spawn("--sleep-mode")
    assert is_sleeping(b) is False
    slept = post(b, "/sleep?level=1")
    assert (slept.status_code, slept.content) == (200, b"")
    assert is_sleeping(b) is True
    s = stats(b)
    assert (s["sleeping"], s["sleep_level"], s["sleeps"], s["wakes"]) == (True, 1, 1, 0)
    woke = post(b, "/wake_up")
    assert (woke.status_code, woke.content) == (200, b"")
    assert is_sleeping(b) is False
    s = stats(b)
    assert (s["sleeping"], s["sleep_level"], s["sleeps"], s["wakes"]) == (False, None, 1, 1)
    assert s["wake_failures"] == 0
    log = log_of(b, tmp_path)
    assert "sleep the engine with level 1" in log and "seconds to fall asleep" in log
    assert "wake up the engine with tags: None" in log and "seconds to wake up" in log


def test_W1_inference_is_503_while_asleep_and_health_stays_200(spawn: Spawn) -> None:
    b = spawn("--sleep-mode")
    assert post(b, "/sleep?level=2").status_code == 200
    assert stats(b)["sleep_level"] == 2
    refused = [
        post(b, "/v1/chat/completions", json=CHAT),
        post(b, "/v1/completions", json={"prompt": "hi"}),
        post(b, "/v1/embeddings", json={"input": "hi"}),
        post(b, "/v1/rerank", json={"query": "a", "documents": ["a"]}),
        post(b, "/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF0000")}),
        post(b, "/v1/audio/speech", json={"input": "hi", "voice": "alloy"}),
    ]
    assert [r.status_code for r in refused] == [503] * len(refused)
    assert all(r.json() == {"error": SLEEPING} for r in refused)
    assert get(b, "/health").status_code == 200
    assert get(b, "/v1/models").status_code == 200
    assert post(b, "/wake_up").status_code == 200
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 200
    s = stats(b)  # the control calls are not counted as inference
    assert s["completed"] == len(refused) + 2  # + /v1/models and the last chat


def test_W1_sleep_frees_held_memory_down_to_asleep_mb_and_wake_takes_it_back(
    spawn: Spawn,
) -> None:
    b = spawn("--sleep-mode", "--hold-mb", "256", "--asleep-mb", "32")
    proc = psutil.Process(b.proc.pid)
    awake_rss = proc.memory_info().rss
    assert stats(b)["held_mb"] == 256
    assert post(b, "/sleep?level=1").status_code == 200
    asleep_rss = wait_for(
        lambda: (rss := proc.memory_info().rss) < awake_rss - 200 * MIB and rss,
        what="the RSS to drop by about 224 MiB",
    )
    assert awake_rss - asleep_rss <= 240 * MIB, f"dropped {(awake_rss - asleep_rss) / MIB:.0f}"
    assert stats(b)["held_mb"] == 32
    assert post(b, "/wake_up").status_code == 200
    wait_for(
        lambda: proc.memory_info().rss > asleep_rss + 200 * MIB,
        what="the RSS to grow back by about 224 MiB",
    )
    assert stats(b)["held_mb"] == 256


def test_W1_wake_fails_answers_500_and_the_backend_stays_asleep(
    spawn: Spawn, tmp_path: Path
) -> None:
    b = spawn("--sleep-mode", "--wake-fails", "--hold-mb", "16")
    assert post(b, "/sleep").status_code == 200  # level 1 by default, as in vLLM
    for _ in range(2):
        failed = post(b, "/wake_up")
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error"
        assert "--wake-fails" in failed.json()["error"]["message"]
    assert is_sleeping(b) is True
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 503
    s = stats(b)
    assert (s["sleeping"], s["wakes"], s["wake_failures"], s["held_mb"]) == (True, 0, 2, 0)
    assert "failed to wake up the engine" in log_of(b, tmp_path)


def test_W1_without_sleep_mode_the_endpoints_are_404(spawn: Spawn) -> None:
    b = spawn()
    answers = [post(b, "/sleep?level=1"), post(b, "/wake_up"), get(b, "/is_sleeping")]
    assert [a.status_code for a in answers] == [404, 404, 404]
    assert stats(b)["sleeping"] is False
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 200


def test_W1_partial_wake_with_tags_and_repeated_calls_are_harmless(spawn: Spawn) -> None:
    b = spawn("--sleep-mode")
    assert post(b, "/wake_up").status_code == 200  # awake already: nothing happens
    assert post(b, "/sleep?level=1").status_code == 200
    assert post(b, "/sleep?level=2").status_code == 200  # asleep already: nothing happens
    assert post(b, "/wake_up", params={"tags": "weights"}).status_code == 200
    assert is_sleeping(b) is True  # the KV cache still sleeps
    assert post(b, "/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert is_sleeping(b) is False
    s = stats(b)
    assert (s["sleeps"], s["wakes"], s["sleep_level"]) == (1, 1, None)


@pytest.mark.parametrize("level", ["0", "3", "deep"])
def test_W1_a_level_other_than_1_or_2_is_400(spawn: Spawn, level: str) -> None:
    b = spawn("--sleep-mode")
    answer = post(b, f"/sleep?level={level}")
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert is_sleeping(b) is False


def test_W1_slow_sleep_and_wake_refuse_inference_until_done(spawn: Spawn) -> None:
    b = spawn("--sleep-mode", "--sleep-seconds", "0.4", "--wake-seconds", "0.4")
    began = time.monotonic()
    thread, answers = in_thread(lambda: post(b, "/sleep?level=1"))
    wait_for(lambda: is_sleeping(b), what="is_sleeping true once the sleep has begun")
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 503
    thread.join(10)
    assert answers[0].status_code == 200 and time.monotonic() - began >= 0.4
    began = time.monotonic()
    thread, answers = in_thread(lambda: post(b, "/wake_up"))
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 503  # still waking
    thread.join(10)
    assert answers[0].status_code == 200 and time.monotonic() - began >= 0.4
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 200


# --- W2: llama-server's slot save/restore ------------------------------------------------------


def test_W2_get_slots_lists_every_slot_like_llama_server(spawn: Spawn) -> None:
    b = spawn("--n-slots", "2", "--n-ctx", "1024")
    slots = get(b, "/slots").json()
    idle = {"n_ctx": 512, "speculative": False, "is_processing": False}
    assert slots == [{"id": 0, **idle}, {"id": 1, **idle}]  # no id_task before a task
    assert post(b, "/v1/chat/completions", json=CHAT).status_code == 200
    used = next(s for s in get(b, "/slots").json() if "id_task" in s)
    assert used["n_prompt_tokens"] == 3 and used["n_prompt_tokens_cache"] == 0
    assert used["next_token"][0]["n_decoded"] == 16


def test_W2_save_writes_a_file_that_a_restarted_backend_restores(
    spawn: Spawn, tmp_path: Path
) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    flags = ("--slot-save-path", str(slot_dir), "--tokens", "4")
    first = spawn(*flags)
    assert post(first, "/v1/chat/completions", json=CHAT).status_code == 200
    saved = post(first, "/slots/0?action=save", json={"filename": "turn.bin"})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert set(body) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert (body["id_slot"], body["filename"], body["n_saved"]) == (0, "turn.bin", 3 + 4)
    assert body["n_written"] == (slot_dir / "turn.bin").stat().st_size
    assert set(body["timings"]) == {"save_ms"}

    second = spawn(*flags)  # the same model after an evict/reload cycle
    restored = post(second, "/slots/0?action=restore", json={"filename": "turn.bin"})
    assert restored.status_code == 200, restored.text
    body = restored.json()
    assert set(body) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert (body["id_slot"], body["n_restored"], body["n_read"]) == (
        0,
        7,
        saved.json()["n_written"],
    )
    assert set(body["timings"]) == {"restore_ms"}
    reply = post(second, "/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    follow_up = {"messages": [*CHAT["messages"], reply, {"role": "user", "content": "go on"}]}
    assert post(second, "/v1/chat/completions", json=follow_up).status_code == 200
    slot = get(second, "/slots").json()[0]
    assert slot["n_prompt_tokens_cache"] == 7  # the restored prefix was reused
    assert slot["n_prompt_tokens_processed"] == slot["n_prompt_tokens"] - 7
    s = stats(second)
    assert (s["slot_saves"], s["slot_restores"], s["slot_files_restored"]) == (0, 1, ["turn.bin"])
    assert stats(first)["slot_files_saved"] == ["turn.bin"]


@pytest.mark.parametrize("name", ["../up.bin", "a/b.bin", "a\\b.bin", "..", "", " x.bin", "x."])
def test_W2_a_filename_that_is_not_a_bare_name_is_400(
    spawn: Spawn, tmp_path: Path, name: str
) -> None:
    b = spawn("--slot-save-path", str(tmp_path))
    for action in ("save", "restore"):
        answer = post(b, f"/slots/0?action={action}", json={"filename": name})
        assert answer.status_code == 400
        assert answer.json()["error"] | {"param": None} == {
            "message": "Invalid filename",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }
    assert stats(b)["slot_saves"] == 0 and not (tmp_path.parent / "up.bin").exists()


def test_W2_restoring_a_missing_file_is_400_like_llama_server(spawn: Spawn, tmp_path: Path) -> None:
    b = spawn("--slot-save-path", str(tmp_path))
    answer = post(b, "/slots/0?action=restore", json={"filename": "never-saved.bin"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("Unable to restore slot")
    assert stats(b)["slot_restores"] == 0
    assert "failed to open" in log_of(b, tmp_path)


def test_W2_bad_slot_ids_and_actions_are_400(spawn: Spawn, tmp_path: Path) -> None:
    b = spawn("--slot-save-path", str(tmp_path), "--n-slots", "2")
    cases = {
        "/slots/x?action=save": "Invalid slot ID",
        "/slots/2?action=save": "Invalid slot ID",
        "/slots/0?action=bogus": "Invalid action",
        "/slots/0": "Invalid action",
    }
    for path, message in cases.items():
        answer = post(b, path, json={"filename": "a.bin"})
        assert (answer.status_code, answer.json()["error"]["message"]) == (400, message), path
    erased = post(b, "/slots/1?action=erase")
    assert erased.json() == {"id_slot": 1, "n_erased": 0}


def test_W2_without_slot_save_path_the_slot_actions_are_501(spawn: Spawn) -> None:
    b = spawn()
    assert get(b, "/slots").status_code == 200  # monitoring stays on, as in llama-server
    for action in ("save", "restore", "erase"):
        answer = post(b, f"/slots/0?action={action}", json={"filename": "a.bin"})
        assert answer.status_code == 501
        error = answer.json()["error"]
        assert error["type"] == "not_supported_error"
        assert "--slot-save-path" in error["message"]


def test_W2_slot_save_path_must_be_an_existing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    ran = subprocess.run(
        [*FAKE, "--port", "1", "--slot-save-path", str(missing)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode != 0
    assert f"not a directory: {missing}" in ran.stderr


def test_W2_slow_save_and_restore_take_their_configured_seconds(
    spawn: Spawn, tmp_path: Path
) -> None:
    b = spawn(
        "--slot-save-path",
        str(tmp_path),
        "--slot-save-seconds",
        "0.3",
        "--slot-restore-seconds",
        "0.3",
    )
    began = time.monotonic()
    saved = post(b, "/slots/0?action=save", json={"filename": "slow.bin"})
    assert saved.status_code == 200 and time.monotonic() - began >= 0.3
    assert saved.json()["timings"]["save_ms"] >= 300
    with pytest.raises(httpx.ReadTimeout):  # a caller's bounded timeout fires first
        httpx.post(b.url + "/slots/0?action=restore", json={"filename": "slow.bin"}, timeout=0.05)
    wait_for(lambda: stats(b)["slot_restores"] == 1, what="the abandoned restore to finish")
