import threading, time
import httpx
from tests.integration.test_sleep import chat, one_sleeper, stats, servers, fake_cmd, VLLM, SWAP, wait_for, process_gone

def test_no_ram_sleeper(gateway_factory):
    cfg = servers() + f"""
models:
  a: {{sticky: {{ttl: 1s}}, backends: [{{cmd: "{fake_cmd('--sleep-mode')}", proxy: "${{PORT}}", server: box, {VLLM}, sleepUsage: {{system: 6GB}}, {SWAP}}}]}}
"""
    gw = gateway_factory(cfg)
    assert chat(gw, "a").status_code == 200
    pid = gw.pid_of("a#0")
    wait_for(lambda: gw.state("a#0") in ("asleep", "stopped"), 10)
    print(gw.log())
    assert gw.state("a#0") == "asleep"

def test_request_during_slow_sleep(gateway_factory):
    gw = gateway_factory(one_sleeper("--sleep-seconds", "1.5"))
    assert chat(gw, "a").status_code == 200
    pid = gw.pid_of("a#0")
    wait_for(lambda: gw.state("a#0") == "draining", 10, interval=0.02)
    r = chat(gw, "a")
    assert r.status_code == 200, r.text
    assert gw.pid_of("a#0") == pid
    s = stats(gw, "a#0")
    print(s, gw.state("a#0"))
    assert s["wakes"] == 1
