"""SPEC §18 W1 through a real gateway: sleep instead of stop, on ttl and on eviction; wake on
a request (coalesced), a failed wake restarts; and a sleeper under pause (P1), reload (P6)
and a kill -9 of corrallm (L5). The backends are `corrallm fake-backend --sleep-mode`,
which speaks vLLM's sleep API and counts its sleeps and wakes in /debug/stats."""

from __future__ import annotations

import concurrent.futures
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.processes import Gateway, fake_cmd, process_gone, wait_for

SLEEPY = ("--sleep-mode",)
# Waking (1 s declared) is cheaper than loading (30 s declared): the planner may sleep it.
SWAP = "swap: {loadSeconds: 30, wakeSeconds: 1}"
VLLM = "sleep: {kind: vllm, level: 1}"


def chat(gw: Gateway, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)


def backend(flags: tuple[str, ...], ram: str, asleep: str | None) -> str:
    """A fake backend on server `box`; with `asleep` it sleeps (vLLM kind) holding that."""
    parts = [f'cmd: "{fake_cmd(*flags)}"', 'proxy: "${PORT}"', "server: box"]
    parts.append(f"ramUsage: {{{ram}}}")
    if asleep is not None:
        parts += [VLLM, f"sleepUsage: {{{asleep}}}", SWAP]
    return "{" + ", ".join(parts) + "}"


def servers(gpu: str = "10GB", system: str = "64GB") -> str:
    return f"""
scheduler: {{maxWait: 10s}}
servers:
  box: {{pools: {{gpu0: {gpu}, system: {system}}}}}
"""


def one_sleeper(*flags: str, ttl: str = "1s") -> str:
    a = backend((*SLEEPY, *flags), "gpu0: 6GB", "system: 6GB")
    return servers() + f"models:\n  a: {{sticky: {{ttl: {ttl}}}, backends: [{a}]}}\n"


def origin_of(gw: Gateway, bid: str) -> str:
    record = wait_for(lambda: gw.records().get(bid), 10, what=f"{bid}'s pid record")
    return f"http://127.0.0.1:{record['port']}"


def stats(gw: Gateway, bid: str) -> dict[str, Any]:
    """What the fake backend itself says: sleeping, sleeps, wakes, completed..."""
    answer: dict[str, Any] = httpx.get(origin_of(gw, bid) + "/debug/stats", timeout=10).json()
    return answer


def asleep(gw: Gateway, bid: str, timeout: float = 15) -> None:
    wait_for(lambda: gw.state(bid) == "asleep", timeout, interval=0.05, what=f"{bid} asleep")


def backend_state_metric(gw: Gateway, bid: str, state: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    wanted = f'corrallm_backend_state{{backend="{bid}",state="{state}"}}'
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {wanted} in /metrics")


def config_file(gw: Gateway) -> Path:
    return gw.config_path


def sleep_pid(gw: Gateway, model: str) -> int:
    """Serve `model` once, then wait for its ttl to put it to sleep; its pid."""
    assert chat(gw, model).status_code == 200
    pid = gw.pid_of(f"{model}#0")
    asleep(gw, f"{model}#0")
    return pid


# --- sleep on ttl, wake on a request --------------------------------------------------------


def test_W1_R4_an_idle_ttl_puts_a_sleeper_to_sleep_not_to_stop(gateway_factory):
    # `bare` declares no ramUsage: it takes no room in the pools, awake or asleep.
    bare = f'{{cmd: "{fake_cmd(*SLEEPY)}", proxy: "${{PORT}}", {VLLM}, {SWAP}, '
    bare += "sleepUsage: {system: 1GB}}"
    gw = gateway_factory(one_sleeper() + f"  bare: {{sticky: {{ttl: 1s}}, backends: [{bare}]}}\n")
    assert chat(gw, "a").status_code == 200 and chat(gw, "bare").status_code == 200
    pid = gw.pid_of("a#0")
    asleep(gw, "a#0")
    asleep(gw, "bare#0")
    assert stats(gw, "bare#0")["sleeping"] is True
    assert psutil.pid_exists(pid) and not process_gone(pid)  # the very same process lives
    assert gw.pid_of("a#0") == pid
    s = stats(gw, "a#0")
    assert (s["sleeping"], s["sleep_level"], s["sleeps"], s["wakes"]) == (True, 1, 1, 0)
    assert gw.records()["a#0"]["asleep"] is True  # recorded asleep, for a restart (L5)
    assert "sleep backend=a#0 reason=ttl-expired" in gw.log()
    assert backend_state_metric(gw, "a#0", "asleep") == 1
    assert backend_state_metric(gw, "a#0", "ready") == 0
    # The planner counts its sleepUsage, not its awake footprint.
    pools = gw.api("GET", "overview").json()["servers"][0]["pools"]
    assert (pools["gpu0"]["used"], pools["system"]["used"]) == (0, 6 * 10**9)


def test_W1_L2_a_request_wakes_a_sleeper_and_concurrent_ones_share_one_wake(gateway_factory):
    gw = gateway_factory(one_sleeper("--wake-seconds", "0.5", ttl="4s"))
    pid = sleep_pid(gw, "a")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(gw, "a"), range(4)))
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert gw.state("a#0") == "ready"
    assert gw.pid_of("a#0") == pid  # woken, not restarted
    s = stats(gw, "a#0")
    assert (s["sleeping"], s["sleeps"], s["wakes"], s["wake_failures"]) == (False, 1, 1, 0)
    log = (gw.home / "logs" / "a_0.log").read_text()
    assert log.count("awake in") == 1 and log.count("starting: ") == 1
    asleep(gw, "a#0")  # and its ttl puts it back to sleep
    assert stats(gw, "a#0")["sleeps"] == 2


# --- eviction: sleep where the sleepUsage fits, else stop ----------------------------------


def two_models(b_ram: str) -> str:
    # A awake: gpu0 6GB + system 1GB; asleep it holds system 4GB. B needs gpu0 6GB: A and B
    # awake are 12GB of gpu0's 10GB.
    a = backend(SLEEPY, "gpu0: 6GB, system: 1GB", "system: 4GB")
    b = backend((), b_ram, None)
    return (
        servers(gpu="10GB", system="8GB")
        + f"""
models:
  a: {{backends: [{a}]}}
  b: {{backends: [{b}]}}
"""
    )


def test_W1_R2_eviction_puts_a_sleeper_to_sleep_when_its_sleep_usage_fits(gateway_factory):
    gw = gateway_factory(two_models("gpu0: 6GB"))  # B + A asleep: gpu0 6GB, system 4GB
    assert chat(gw, "a").status_code == 200
    pid = gw.pid_of("a#0")
    assert chat(gw, "b").status_code == 200
    assert (gw.state("a#0"), gw.state("b#0")) == ("asleep", "ready")
    assert gw.pid_of("a#0") == pid and not process_gone(pid)
    assert stats(gw, "a#0")["sleeping"] is True
    assert "sleep backend=a#0 for=b#0 server=box" in gw.log()
    assert "evict backend=a#0" not in gw.log()
    pools = gw.api("GET", "overview").json()["servers"][0]["pools"]
    assert pools["gpu0"]["used"] == 6 * 10**9  # B alone; A asleep holds none of it
    # A's 4GB asleep, and what B was measured to hold of system memory (M2): well under 1GB.
    assert 4 * 10**9 <= pools["system"]["used"] < 5 * 10**9
    # And back: A's wake needs gpu0 again, so B (which cannot sleep) is stopped for it.
    pid_b = gw.pid_of("b#0")
    assert chat(gw, "a").status_code == 200
    assert (gw.state("a#0"), gw.state("b#0")) == ("ready", "stopped")
    assert gw.pid_of("a#0") == pid and stats(gw, "a#0")["wakes"] == 1
    wait_for(lambda: process_gone(pid_b), 10, what="b stopped")


def test_W1_R2_eviction_stops_a_sleeper_whose_sleep_usage_does_not_fit(gateway_factory):
    gw = gateway_factory(two_models("gpu0: 6GB, system: 6GB"))  # + A's 4GB asleep > 8GB
    assert chat(gw, "a").status_code == 200
    pid = gw.pid_of("a#0")
    assert chat(gw, "b").status_code == 200
    assert (gw.state("a#0"), gw.state("b#0")) == ("stopped", "ready")
    wait_for(lambda: process_gone(pid), 10, what="a's process gone")
    assert "a#0" not in gw.records()
    assert "evict backend=a#0 for=b#0 server=box" in gw.log()
    assert "sleep backend=a#0" not in gw.log()


# --- a wake that fails restarts the backend --------------------------------------------------


def test_W1_a_failed_wake_restarts_the_backend_and_the_request_still_succeeds(gateway_factory):
    gw = gateway_factory(one_sleeper("--wake-fails", ttl="4s"))
    pid = sleep_pid(gw, "a")
    response = chat(gw, "a")
    assert response.status_code == 200, response.text
    new_pid = gw.pid_of("a#0")
    assert new_pid != pid  # restarted, not woken
    wait_for(lambda: process_gone(pid), 10, what="the sleeper that would not wake, gone")
    assert gw.state("a#0") == "ready"
    s = stats(gw, "a#0")
    assert (s["sleeping"], s["wakes"], s["sleeps"]) == (False, 0, 0)  # a fresh process
    log = (gw.home / "logs" / "a_0.log").read_text()
    assert "wake failed" in log and log.count("starting: ") == 2


# --- P1: pausing a sleeper --------------------------------------------------------------------


def test_W1_P1_pausing_a_sleeper_stops_it_and_keeps_it_out_until_unpaused(gateway_factory):
    gw = gateway_factory(one_sleeper())
    pid = sleep_pid(gw, "a")
    paused = gw.api("POST", "models/pause", {"model": "a"})
    assert paused.status_code == 200 and paused.json()["paused"] is True
    wait_for(lambda: process_gone(pid), 10, what="the sleeper stopped by the pause")
    assert gw.state("a#0") == "paused"
    refused = chat(gw, "a")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "paused"
    assert "retry-after" not in refused.headers
    assert gw.state("a#0") == "paused" and "a#0" not in gw.records()
    assert gw.api("POST", "models/unpause", {"model": "a"}).status_code == 200
    assert chat(gw, "a").status_code == 200
    assert gw.pid_of("a#0") != pid and gw.state("a#0") == "ready"


# --- P6: reloading with a sleeper -----------------------------------------------------------


def reload_config(change_tokens: str) -> str:
    keep = backend(SLEEPY, "gpu0: 2GB", "system: 1GB")
    change = backend((*SLEEPY, "--tokens", change_tokens), "gpu0: 2GB", "system: 1GB")
    return (
        servers()
        + f"""
models:
  keep: {{sticky: {{ttl: 1s}}, backends: [{keep}]}}
  change: {{sticky: {{ttl: 1s}}, backends: [{change}]}}
"""
    )


@pytest.mark.serve_process
def test_W1_P6_reload_keeps_an_unchanged_sleeper_asleep_and_replaces_a_changed_one(
    gateway_factory,
):
    gw = gateway_factory(reload_config("3"))
    assert chat(gw, "keep").status_code == 200 and chat(gw, "change").status_code == 200
    pids = {m: gw.pid_of(f"{m}#0") for m in ("keep", "change")}
    asleep(gw, "keep#0")
    asleep(gw, "change#0")
    config_file(gw).write_text(reload_config("5"))
    report = gw.api("POST", "config/reload")
    assert report.status_code == 200, report.text
    assert report.json()["kept"] == ["keep#0"] and report.json()["restarted"] == ["change#0"]
    wait_for(lambda: process_gone(pids["change"]), 15, what="the changed sleeper stopped")
    assert gw.state("keep#0") == "asleep" and gw.pid_of("keep#0") == pids["keep"]
    assert stats(gw, "keep#0")["sleeping"] is True
    # The kept one wakes on the next request, in the same process.
    assert chat(gw, "keep").status_code == 200
    assert gw.pid_of("keep#0") == pids["keep"] and stats(gw, "keep#0")["wakes"] == 1
    # The changed one is served by a new process with its new spec.
    changed = chat(gw, "change")
    assert changed.status_code == 200 and changed.json()["usage"]["completion_tokens"] == 5
    new_pid = gw.pid_of("change#0")
    assert new_pid != pids["change"]
    # No process leaked: a shutdown leaves none of the three behind (L5).
    gw.signal(signal.SIGTERM)
    assert gw.wait_exit(30) in (0, -signal.SIGTERM)
    for pid in (pids["keep"], pids["change"], new_pid):
        assert process_gone(pid), pid


# --- L5: a kill -9 of corrallm while a backend sleeps ----------------------------------------


@pytest.mark.serve_process
def test_W1_L5_a_sleeper_is_readopted_asleep_after_a_crash_and_wakes_on_request(
    gateway_factory,
):
    config = one_sleeper(ttl="1s")
    first = gateway_factory(config)
    pid = sleep_pid(first, "a")
    first.signal(signal.SIGKILL)
    first.wait_exit()
    assert not process_gone(pid)  # the backend outlives corrallm's crash

    second = gateway_factory(config, home=first.home)
    assert second.state("a#0") == "asleep"
    assert second.pid_of("a#0") == pid
    assert backend_state_metric(second, "a#0", "asleep") == 1
    assert stats(second, "a#0")["sleeping"] is True
    response = chat(second, "a")
    assert response.status_code == 200, response.text
    assert second.pid_of("a#0") == pid  # woken in place: no second process
    s = stats(second, "a#0")
    assert (s["sleeping"], s["sleeps"], s["wakes"]) == (False, 1, 1)
    second.signal(signal.SIGTERM)
    assert second.wait_exit(30) in (0, -signal.SIGTERM)
    assert process_gone(pid)


@pytest.mark.serve_process
def test_W1_L5_a_readopted_sleeper_that_cannot_be_woken_is_stopped_not_leaked(
    gateway_factory,
):
    first = gateway_factory(one_sleeper(ttl="1s"))
    pid = sleep_pid(first, "a")
    first.signal(signal.SIGKILL)
    first.wait_exit()
    # The same cmd, but the new config says nothing of how to wake it.
    plain = (
        servers()
        + f"""
models:
  a: {{sticky: {{ttl: 1s}}, backends: [{backend(SLEEPY, "gpu0: 6GB", None)}]}}
"""
    )
    second = gateway_factory(plain, home=first.home)
    wait_for(lambda: process_gone(pid), 15, what="the unwakeable sleeper stopped")
    assert second.state("a#0") == "stopped" and "a#0" not in second.records()
    assert "cannot wake it" in (second.home / "logs" / "a_0.log").read_text()
    response = chat(second, "a")  # a fresh start serves
    assert response.status_code == 200, response.text
    new_pid = second.pid_of("a#0")
    assert new_pid != pid
    second.signal(signal.SIGTERM)
    assert second.wait_exit(30) in (0, -signal.SIGTERM)
    assert process_gone(new_pid)
