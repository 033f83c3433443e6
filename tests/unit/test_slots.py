"""SPEC §18 W2: saving and restoring llama-server's slot caches, with a scripted `call` and
a virtual clock. The answers are the shapes the real llama-server gives (see
tests/integration/test_slots_llama.py, which runs them against it). Each test asserts the
report and the calls made, in order, in one equality."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from corrallm.lifecycle.slots import (
    SlotReport,
    restore_slots,
    save_slots,
    slot_file,
    slot_save_dir,
)

SAFE = re.compile(r"[A-Za-z0-9._-]+")
BASE = "http://127.0.0.1:5000"
NO_FLAG = (
    b'{"error":{"code":501,"message":"This server does not support slots action. '
    b'Start it with `--slot-save-path`","type":"not_supported_error"}}'
)
BAD_FILE = (
    b'{"error":{"code":400,"message":"Unable to restore slot: No available space in KV '
    b'cache or invalid slot save file","type":"invalid_request_error"}}'
)


def slot(i: int, used: bool = True) -> dict[str, Any]:
    """A /slots entry as llama-server lists it: `id_task` only once it ran a task."""
    entry: dict[str, Any] = {"id": i, "n_ctx": 512, "speculative": False, "is_processing": False}
    if used:
        entry |= {"id_task": 7 + i, "n_prompt_tokens": 100 + i}
    return entry


def listing(*entries: dict[str, Any]) -> tuple[int, bytes]:
    return 200, json.dumps(list(entries)).encode()


def saved(i: int, n: int) -> tuple[int, bytes]:
    body = {"id_slot": i, "filename": "x", "n_saved": n, "n_written": 8 * n, "timings": {}}
    return 200, json.dumps(body).encode()


def restored(i: int, n: int) -> tuple[int, bytes]:
    body = {"id_slot": i, "filename": "x", "n_restored": n, "n_read": 8 * n, "timings": {}}
    return 200, json.dumps(body).encode()


class Script:
    """The fake `call`: answers in order, each taking `cost` virtual seconds; records
    (method, path, body, timeout) for every call."""

    def __init__(self, *answers: tuple[int | None, bytes], cost: float = 0.5) -> None:
        self.answers = list(answers)
        self.cost = cost
        self.now = 100.0
        self.calls: list[tuple[str, str, Any, float]] = []

    def clock(self) -> float:
        return self.now

    async def __call__(
        self, method: str, url: str, body: Any, seconds: float
    ) -> tuple[int | None, bytes]:
        self.calls.append((method, url.removeprefix(BASE), body, seconds))
        self.now += min(self.cost, seconds)
        return self.answers.pop(0)


def body(backend: str, i: int) -> dict[str, str]:
    return {"filename": slot_file(backend, i)}


# --- the cmd and the file names --------------------------------------------------------


@pytest.mark.parametrize(
    ("cmd", "want"),
    [
        ("llama-server -m m.gguf --slot-save-path /var/slots --port ${PORT}", "/var/slots"),
        ("llama-server --slot-save-path 'my slots' -np 2", "my slots"),
        ("llama-server --slot-save-path=cache/slots", "cache/slots"),
        ("llama-server --slot-save-path a --slot-save-path b", "b"),
        ("llama-server -m m.gguf --port ${PORT}", None),
        ("llama-server --slot-save-path", None),
        ("llama-server --slot-save-path 'unclosed", None),
    ],
)
def test_W2_slot_save_dir_is_read_from_the_cmd(cmd: str, want: str | None) -> None:
    assert slot_save_dir(cmd) == want


def test_W2_slot_files_are_safe_bare_names_distinct_per_backend_and_slot() -> None:
    backends = ("a#0", "a_0", "../etc/passwd", ".hidden", "x" * 300, "qwen 7b#1")
    names = [slot_file(backend, i) for backend in backends for i in range(3)]
    unsafe = [n for n in names if not SAFE.fullmatch(n) or ".." in n or len(n) > 120]
    assert (unsafe, len(set(names)), slot_file("a#0", 1)) == ([], 18, slot_file("a#0", 1))


# --- save ---------------------------------------------------------------------------------


async def test_W2_save_writes_every_slot_that_ran_a_task_and_sums_its_tokens() -> None:
    call = Script(listing(slot(0), slot(1, used=False), slot(2)), saved(0, 812), saved(2, 40))
    report = await save_slots(call, BASE + "/", "a#0", 10.0, call.clock)
    assert (report, call.calls) == (
        SlotReport(done=(0, 2), failed=(), tokens=852, seconds=1.5),
        [
            ("GET", "/slots", None, 10.0),
            ("POST", "/slots/0?action=save", body("a#0", 0), 9.5),
            ("POST", "/slots/2?action=save", body("a#0", 2), 9.0),
        ],
    )


async def test_W2_save_reports_a_failed_slot_and_goes_on_with_the_next() -> None:
    error = b'{"error":{"code":500,"message":"failed to save slot","type":"server_error"}}'
    call = Script(listing(slot(0), slot(1), slot(2)), saved(0, 5), (500, error), (None, b""))
    report = await save_slots(call, BASE, "m#0", 10.0, call.clock)
    assert (report, len(call.calls)) == (
        SlotReport(
            done=(0,),
            failed=("slot 1: 500 failed to save slot", "slot 2: no answer"),
            tokens=5,
            seconds=2.0,
        ),
        4,
    )


async def test_W2_save_without_slot_save_path_reports_llama_servers_501() -> None:
    call = Script(listing(slot(0)), (501, NO_FLAG))
    report = await save_slots(call, BASE, "m#0", 10.0, call.clock)
    assert report.failed == (
        "slot 0: 501 This server does not support slots action. Start it with `--slot-save-path`",
    )


@pytest.mark.parametrize(
    ("answer", "failed"),
    [
        ((None, b""), "GET /slots: no answer"),
        ((404, b"Not Found"), "GET /slots: 404 Not Found"),
        ((200, b"<html>"), "GET /slots: 200 but not a list: b'<html>'"),
        ((200, b'{"id": 0}'), "GET /slots: 200 but not a list: b'{\"id\": 0}'"),
    ],
)
async def test_W2_save_stops_when_the_slots_cannot_be_listed(
    answer: tuple[int | None, bytes], failed: str
) -> None:
    call = Script(answer)
    report = await save_slots(call, BASE, "m#0", 10.0, call.clock)
    assert (report, len(call.calls)) == (SlotReport((), (failed,), 0, 0.5), 1)


async def test_W2_save_stays_within_its_budget_and_reports_the_slots_it_had_no_time_for() -> None:
    call = Script(listing(slot(0), slot(1), slot(2)), saved(0, 9), saved(1, 9), cost=1.0)
    report = await save_slots(call, BASE, "m#0", 2.5, call.clock)
    assert (report, [timeout for *_, timeout in call.calls]) == (
        SlotReport(
            done=(0, 1),  # slot 1 had the 0.5s that was left, and it was enough
            failed=("slot 2: not saved, the 2.5s budget was spent",),
            tokens=18,
            seconds=2.5,
        ),
        [2.5, 1.5, 0.5],
    )


class Timeout(Script):
    """A call that uses its whole timeout when it is shorter than `cost`: nothing answered."""

    async def __call__(
        self, method: str, url: str, body: Any, seconds: float
    ) -> tuple[int | None, bytes]:
        answer = await super().__call__(method, url, body, seconds)
        return answer if seconds >= self.cost else (None, b"")


async def test_W2_a_call_cut_short_by_the_budget_is_reported_as_no_answer() -> None:
    call = Timeout(listing(slot(0), slot(1)), saved(0, 9), saved(1, 9), cost=1.0)
    report = await save_slots(call, BASE, "m#0", 2.5, call.clock)
    assert report == SlotReport((0,), ("slot 1: no answer",), 9, 2.5)


async def test_W2_save_with_no_budget_asks_nothing() -> None:
    call = Script()
    report = await save_slots(call, BASE, "m#0", 0.0, call.clock)
    assert (report, call.calls) == (
        SlotReport((), ("GET /slots: not asked, the 0s budget was spent",), 0, 0.0),
        [],
    )


async def test_W2_an_empty_slot_llama_server_saves_anyway_counts_zero_tokens() -> None:
    call = Script(listing(slot(0)), saved(0, 0))
    report = await save_slots(call, BASE, "m#0", 10.0, call.clock)
    assert report == SlotReport((0,), (), 0, 1.0)


async def test_W2_a_save_answer_without_n_saved_is_a_failure() -> None:
    call = Script(listing(slot(0)), (200, b'{"id_slot": 0}'))
    report = await save_slots(call, BASE, "m#0", 10.0, call.clock)
    assert report.failed == ('slot 0: 200 {"id_slot": 0}',)


# --- restore ------------------------------------------------------------------------------


async def test_W2_restore_loads_each_slot_whose_file_exists(tmp_path: Path) -> None:
    for i in (0, 2):
        (tmp_path / slot_file("a#0", i)).write_bytes(b"kv")
    (tmp_path / slot_file("b#0", 1)).write_bytes(b"kv")  # another backend's: left alone
    call = Script(listing(slot(0, False), slot(1, False), slot(2, False)), restored(0, 300))
    call.answers.append(restored(2, 12))
    report = await restore_slots(call, BASE, "a#0", str(tmp_path), 10.0, call.clock)
    assert (report, call.calls) == (
        SlotReport(done=(0, 2), failed=(), tokens=312, seconds=1.5),
        [
            ("GET", "/slots", None, 10.0),
            ("POST", "/slots/0?action=restore", body("a#0", 0), 9.5),
            ("POST", "/slots/2?action=restore", body("a#0", 2), 9.0),
        ],
    )


async def test_W2_restore_of_a_file_llama_server_rejects_is_reported(tmp_path: Path) -> None:
    (tmp_path / slot_file("a#0", 0)).write_bytes(b"saved by another model")
    call = Script(listing(slot(0, False)), (400, BAD_FILE))
    report = await restore_slots(call, BASE, "a#0", str(tmp_path), 10.0, call.clock)
    assert report.describe("restored") == (
        "restored 0 slot caches (0 tokens) in 1.00s; slot 0: 400 Unable to restore slot: "
        "No available space in KV cache or invalid slot save file"
    )


async def test_W2_restore_with_no_files_or_no_directory_only_lists_the_slots(
    tmp_path: Path,
) -> None:
    call = Script(listing(slot(0), slot(1)), listing(slot(0)))
    empty = await restore_slots(call, BASE, "a#0", str(tmp_path), 10.0, call.clock)
    missing = await restore_slots(call, BASE, "a#0", str(tmp_path / "no"), 10.0, call.clock)
    assert (empty, missing, len(call.calls)) == (
        SlotReport((), (), 0, 0.5),
        SlotReport((), (), 0, 0.5),
        2,
    )


async def test_W2_restore_stays_within_its_budget(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / slot_file("a#0", i)).write_bytes(b"kv")
    call = Script(listing(slot(0), slot(1), slot(2)), restored(0, 1), restored(1, 2), cost=1.0)
    report = await restore_slots(call, BASE, "a#0", str(tmp_path), 3.0, call.clock)
    assert report == SlotReport((0, 1), ("slot 2: not restored, the 3s budget was spent",), 3, 3.0)


# --- the log line -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("report", "verb", "line"),
    [
        (
            SlotReport((0, 1), ("slot 3: 500 boom",), 812, 0.031),
            "saved",
            "saved 2 slot caches (812 tokens) in 0.03s; slot 3: 500 boom",
        ),
        (SlotReport((4,), (), 7, 1.0), "restored", "restored 1 slot cache (7 tokens) in 1.00s"),
        (
            SlotReport((), ("GET /slots: no answer",), 0, 2.0),
            "saved",
            "saved 0 slot caches (0 tokens) in 2.00s; GET /slots: no answer",
        ),
    ],
)
def test_W2_report_describes_itself_in_one_line(report: SlotReport, verb: str, line: str) -> None:
    assert report.describe(verb) == line
