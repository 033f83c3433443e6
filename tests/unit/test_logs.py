"""L6: llama-server's n_ctx / n_slots parsed from its several log formats; the ring is bounded."""

import asyncio

import pytest

from corrallm.lifecycle.logs import LogBuffer


@pytest.mark.parametrize(
    ("lines", "n_ctx", "n_slots"),
    [
        (["llama_new_context_with_model: n_ctx      = 4096"], 4096, None),
        (["llama_context: n_ctx         = 8192", "initializing slots, n_slots = 4"], 8192, 4),
        (["srv    load_model: initializing slots, n_slots = 2"], None, 2),
        (["slot         init: id  0 | task -1 | new slot n_slots = 2, n_ctx_slot = 256"], 512, 2),
        (["llama_server: n_ctx: 2048", "total_slots = 3"], 2048, 3),
        (["n_ctx = 1024", "restarted", "n_ctx = 2048"], 2048, None),
    ],
)
def test_L6_n_ctx_and_n_slots_parsed_from_llama_server_log_formats(lines, n_ctx, n_slots):
    logs = LogBuffer(None)
    for line in lines:
        logs.append(line)
    assert (logs.n_ctx, logs.n_slots) == (n_ctx, n_slots)


def test_L6_log_ring_buffer_is_bounded_and_keeps_the_newest_lines(tmp_path):
    logs = LogBuffer(tmp_path / "b.log", max_lines=3)
    logs.open()
    for i in range(10):
        logs.append(f"line {i}\n")
    logs.close()
    assert logs.tail(5) == ["line 7", "line 8", "line 9"]
    assert (tmp_path / "b.log").read_text().splitlines()[0] == "line 0"


def test_L6_unified_kv_cache_slot_context_is_the_whole_context():
    logs = LogBuffer(None)
    logs.append(
        "srv    load_model: initializing, n_slots = 4, n_ctx_slot = 512, kv_unified = 'true'"
    )
    assert (logs.n_ctx, logs.n_slots) == (512, 4)


def test_L6_per_slot_n_ctx_lines_do_not_override_the_whole_context():
    logs = LogBuffer(None)
    logs.append("llama_context: n_ctx                 = 512")
    logs.append("slot   load_model: id  0 | task -1 | new slot, n_ctx = 256")
    assert logs.n_ctx == 512


def writer(path):
    """The backend's side: its stdout appended to the log file, as `process.spawn` sets it up."""

    def write(text: str) -> None:
        with path.open("a") as out:
            out.write(text)

    return write


def test_L6_a_backends_output_is_followed_from_its_log_file(tmp_path):
    path = tmp_path / "b.log"
    logs = LogBuffer(path)
    logs.open()
    backend = writer(path)
    backend("main: server is listening\nllama_context: n_ctx = 2048\ninitializing slo")
    logs.catch_up()
    taken_early = logs.tail(5)
    backend("ts, n_slots = 3\n")
    logs.catch_up()
    logs.close()
    assert (taken_early, logs.tail(5), logs.n_ctx, logs.n_slots) == (
        ["main: server is listening", "llama_context: n_ctx = 2048"],  # half a line waits
        [
            "main: server is listening",
            "llama_context: n_ctx = 2048",
            "initializing slots, n_slots = 3",
        ],
        2048,
        3,
    )


def test_L6_our_own_lines_are_written_once_and_taken_once_in_the_files_order(tmp_path):
    path = tmp_path / "b.log"
    logs = LogBuffer(path)
    logs.open()
    backend = writer(path)
    backend("loading\n")
    logs.note("spawned pid 7")
    backend("listening\n")
    logs.append("a starter's line\nand its second\n")
    logs.close()
    expected = ["loading", "spawned pid 7", "listening", "a starter's line", "and its second"]
    assert (
        [line.split("] ")[-1] for line in logs.tail(10)],
        [line.split("] ")[-1] for line in path.read_text().splitlines()],
    ) == (expected, expected)


def test_L6_following_starts_at_the_files_end_so_a_readopted_backend_is_not_replayed(tmp_path):
    path = tmp_path / "b.log"
    path.write_text("a line from before corrallm restarted\n")
    logs = LogBuffer(path)
    logs.open()
    writer(path)("srv  log_server_r: request: POST /v1/chat/completions 200\n")
    logs.catch_up()
    logs.close()
    assert logs.tail(5) == ["srv  log_server_r: request: POST /v1/chat/completions 200"]


def test_L6_a_reader_far_behind_skips_to_the_newest_output(tmp_path, monkeypatch):
    monkeypatch.setattr("corrallm.lifecycle.logs.MAX_BACKLOG", 100)
    path = tmp_path / "b.log"
    logs = LogBuffer(path)
    logs.open()
    writer(path)("".join(f"line {i:03d}\n" for i in range(100)))  # 900 bytes behind
    logs.catch_up()
    logs.close()
    assert logs.tail(100) == [f"line {i:03d}" for i in range(89, 100)]


async def test_L6_follow_reads_new_output_until_cancelled(tmp_path):
    path = tmp_path / "b.log"
    logs = LogBuffer(path)
    logs.open()
    seen: list[str] = []
    logs.listeners.append(seen.append)
    following = asyncio.ensure_future(logs.follow(interval=0))
    writer(path)("one\ntwo\n")
    for _ in range(100):  # a deadline in event-loop turns
        if len(seen) == 2:
            break
        await asyncio.sleep(0)
    following.cancel()
    logs.close()
    assert seen == ["one", "two"]
