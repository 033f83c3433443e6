"""SPEC §11 D2/D3: `corrallm verify` runs the whole scale-to-zero cycle against a running
gateway; `corrallm bench` measures any OpenAI-compatible endpoint."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import fake_cmd


def corrallm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corrallm", *args], capture_output=True, text=True, timeout=timeout
    )


def test_D2_verify_runs_asleep_request_wake_respond_idle_asleep(gateway_factory):
    config = f"""
models:
  brief:
    sticky: {{ttl: 1s}}
    backends: [{{cmd: "{fake_cmd("--load-seconds", "0.3")}", proxy: "${{PORT}}"}}]
  kept:
    backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]
"""
    gw = gateway_factory(config)
    with_ttl = corrallm("verify", "--model", "brief", "--base-url", gw.url, "--home", str(gw.home))
    assert with_ttl.returncode == 0, with_ttl.stdout + with_ttl.stderr
    lines = with_ttl.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["ok"] * (len(lines) - 1)
    assert (
        "request (cold: wakes it)" in with_ttl.stdout and "HTTP 200 from brief#0" in with_ttl.stdout
    )
    assert "idle -> asleep (sticky.ttl 1s)" in with_ttl.stdout
    assert lines[-1].startswith("verify passed:")
    # A model without a ttl is woken, then unloaded to finish the cycle; a token by flag.
    no_ttl = corrallm("verify", "--model", "kept", "--base-url", gw.url, "--token", gw.token)
    assert no_ttl.returncode == 0, no_ttl.stdout + no_ttl.stderr
    assert "put it to sleep" not in no_ttl.stdout and "(no sticky.ttl: unload)" in no_ttl.stdout


def test_D2_W1_verify_of_a_sleeper_checks_asleep_wakes_responds_asleep(gateway_factory):
    sleeper = fake_cmd("--sleep-mode", "--load-seconds", "0.3")
    config = f"""
models:
  dozy:
    sticky: {{ttl: 1s}}
    backends:
      - cmd: "{sleeper}"
        proxy: "${{PORT}}"
        sleep: {{kind: vllm, level: 1}}
        swap: {{loadSeconds: 30, wakeSeconds: 1}}
"""
    gw = gateway_factory(config)
    run = corrallm("verify", "--model", "dozy", "--base-url", gw.url, "--token", gw.token)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    steps = [line[5:47].strip() for line in lines[:-1]]  # "ok   <step, 42 wide> <ms>  <detail>"
    assert steps == [
        "find the model",
        "confirm asleep",
        "request (cold: wakes it)",
        "responds",
        "confirm awake",
        "idle -> asleep (sticky.ttl 1s)",
        "confirm asleep",
        "request (asleep: wakes it)",
        "responds",
        "confirm awake",
        "idle -> asleep again (sticky.ttl 1s)",
    ]
    details = [line.rsplit("  ", 1)[-1] for line in lines[:-1]]
    assert [details[i] for i in (5, 6, 10)] == ["asleep"] * 3  # asleep, never stopped


def test_D2_verify_fails_loudly(gateway_factory):
    broken_cmd = fake_cmd("--exit-after-seconds", "0")
    gw = gateway_factory(
        f'models: {{m: {{backends: [{{cmd: "{broken_cmd}", proxy: "${{PORT}}"}}]}}}}'
    )
    broken = corrallm("verify", "--model", "m", "--base-url", gw.url, "--token", gw.token)
    assert broken.returncode == 1
    assert "FAIL request (cold: wakes it)" in broken.stdout and "502" in broken.stdout
    unknown = corrallm("verify", "--model", "zz", "--base-url", gw.url, "--token", gw.token)
    assert unknown.returncode == 1 and "no model 'zz'" in unknown.stderr


def test_D3_bench_against_the_fake_backend_and_through_corrallm(gateway_factory, fake_backend):
    direct = corrallm(
        "bench",
        "--base-url",
        fake_backend.url,
        "--model",
        "x",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--max-tokens",
        "8",
        "--json",
    )
    assert direct.returncode == 0, direct.stderr
    result = json.loads(direct.stdout)
    assert result["requests"] == 6 and result["errors"] == 0
    assert result["completion_tokens"] == 6 * 8
    assert result["ttft_ms"]["p50"] > 0 and result["tokens_per_second"]["p50"] > 0
    gw = gateway_factory(f"models: {{m: {{backends: [{{proxy: {fake_backend.port}}}]}}}}")
    through = corrallm("bench", "--base-url", gw.url, "--model", "m", "--requests", "4")
    assert through.returncode == 0, through.stderr
    assert "| TTFT (ms) |" in through.stdout and "errors 0" in through.stdout


def test_D4_check_reports_the_environment_and_warns_what_it_cannot_serve(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "servers: {box: {pools: {gpu0: 8GB}}}\n"
        "models:\n"
        "  d: {backends: [{supervision: docker, dockerContainer: x, proxy: 5800}]}\n"
        "  s: {backends: [{supervision: systemd, systemdUnit: y.service, proxy: 5801}]}\n"
    )
    empty_path = tmp_path / "bin"
    empty_path.mkdir()  # no docker, systemctl or nvidia-smi on this PATH
    done = subprocess.run(
        [sys.executable, "-m", "corrallm", "check", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(empty_path), "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "systemd: not usable: no systemctl on PATH" in out
    assert "docker: not usable: no docker on PATH" in out
    assert "nvidia-smi: not found" in out and "GPUs (NVML):" in out
    assert "warning: models.d.backends[0]: supervision docker, but no docker on PATH" in out
    assert "warning: models.s.backends[0]: supervision systemd, but no systemctl on PATH" in out
