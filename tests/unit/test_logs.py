"""L6: llama-server's n_ctx / n_slots parsed from its several log formats; the ring is bounded."""

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
