"""W2 (and W1): what a warm swap saves. A conversation's follow-up turn after its model was
evicted by another one, with and without llama-server's slot caches saved and restored.

    .venv/bin/python bench/warm_swap.py --direct [--runs 3]   # llama-server only
    .venv/bin/python bench/warm_swap.py [--runs 3]            # through `corrallm serve`
    .venv/bin/python bench/warm_swap.py --sleep [--runs 10]   # W1: wake vs reload, fake backend

Model A is a random-weight GGUF big enough that prompt processing shows on a CPU (8
layers, 1024 wide, F16: about 200 MB; ~700 prompt tokens take ~1 s on 2 cores); model B
is the tiny one (tests/support/tiny_gguf.py). The conversation: a long system prompt and a
first turn to A; then B is used (A is evicted); then A gets the follow-up turn (the first
turn, A's answer and a new question). Reported for the follow-up: the prompt tokens
llama-server processed (`timings.prompt_n`), those it took from its cache (`cache_n`),
and the time to its first token.

- `--direct`: no corrallm. llama-server A is started, converses, its slots are saved with
  corrallm/lifecycle/slots.py (slotSave on), it is killed, B runs one request and is
  killed, A is started again, its slots are restored (slotSave on), and the follow-up is
  sent. TTFT is from the follow-up's request; "restart -> 1st token" is from A's spawn.
- default: `corrallm serve` with one server whose pool (`ram: 1GB`) holds only one of the
  two (`ramUsage: {ram: 700MB}` each), A's cmd with `--slot-save-path DIR` and
  `slotSave: true` or `false` (one gateway each). TTFT of the follow-up is from its request,
  so it includes B's stop and A's reload (and, with slotSave, the restore).
- `--sleep`: `corrallm fake-backend --sleep-mode` with `sleep: {kind: vllm, level: 1}`
  against a plain fake backend with `--load-seconds`: how much corrallm adds around a wake
  and around a full reload (the request's whole time minus the backend's own wake or load).

Every process runs in its own process group and is killed on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corrallm.lifecycle.slots import SlotReport, restore_slots, save_slots  # noqa: E402
from tests.support.llama import (  # noqa: E402
    find_llama_server,
    llama_cmd,
    missing_reason,
    running_llama_server,
)
from tests.support.processes import Gateway, fake_cmd, running_gateway, wait_for  # noqa: E402
from tests.support.tiny_gguf import vocabulary, write_tiny_gguf  # noqa: E402

BIG = dict(n_layer=16, n_embd=512, n_ff=1536, n_head=8, dtype="F16")
# Random weights this wide do not keep tiny_gguf's "printable tokens only" promise (they
# emit raw bytes that are not UTF-8, which llama-server holds back from a stream); a large
# OpenAI-style logit bias on one printable token makes every turn stream "AAAA".
BIAS = {str(vocabulary()[0].index("A")): 1000}
FLAGS = ("-c", "4096", "-np", "1")
RULES = " ".join(f"Rule {i}: answer in plain words." for i in range(20))
SYSTEM = {"role": "system", "content": f"You are a careful guide. {RULES}"}
FIRST = {"role": "user", "content": "What is a prompt cache?"}
THEN = {"role": "user", "content": "And after an eviction?"}
BUDGET = 30.0  # seconds for a save or a restore (corrallm's own bound is its business)


@dataclass
class Turn:
    text: str
    ttft: float  # seconds from the request to its first content token
    prompt_n: int | None
    cache_n: int | None
    first_at: float  # time.monotonic() of the first content token


def turn(v1: str, messages: list[dict[str, str]], model: str | None = None) -> Turn:
    """One streamed chat turn: the first content token's time and llama-server's timings
    (in its last chunk). The role-only first chunk, sent before the prompt is processed,
    does not count as a token."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 4, "stream": True}
    # llama-server puts `timings` in the usage chunk when one is asked for (corrallm asks
    # for it anyway, and hides it from a client that did not).
    body |= {"stream_options": {"include_usage": True}, "logit_bias": BIAS}
    if model:
        body["model"] = model
    sent = time.monotonic()
    first: float | None = None
    timings: dict[str, Any] = {}
    text: list[str] = []
    with httpx.stream("POST", v1 + "/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode(errors='replace')}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.monotonic()
                    text.append(piece)
            timings = chunk.get("timings") or timings
    if first is None:
        raise RuntimeError("the stream carried no content token")
    prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
    return Turn("".join(text), first - sent, prompt_n, cache_n, first)


def follow_up(answer: Turn) -> list[dict[str, str]]:
    return [SYSTEM, FIRST, {"role": "assistant", "content": answer.text}, THEN]


def slots_op(fn: Callable[..., Any], *args: Any) -> SlotReport:
    """Run save_slots/restore_slots with a small aiohttp `call` (what corrallm's probe does)."""

    async def go() -> SlotReport:
        async with aiohttp.ClientSession() as session:

            async def call(
                method: str, url: str, body: Any, seconds: float
            ) -> tuple[int | None, bytes]:
                try:
                    limit = aiohttp.ClientTimeout(total=seconds)
                    async with session.request(method, url, json=body, timeout=limit) as r:
                        return r.status, await r.read()
                except (aiohttp.ClientError, OSError, TimeoutError):
                    return None, b""

            report: SlotReport = await fn(call, *args)
            return report

    return asyncio.run(go())


def models(tmp: Path) -> tuple[Path, Path]:
    return write_tiny_gguf(tmp / "big.gguf", **BIG), write_tiny_gguf(tmp / "tiny.gguf")  # type: ignore[arg-type]


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def med(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# --- direct: llama-server and slots.py, no corrallm ------------------------------------------


@dataclass
class DirectRun:
    first: Turn
    then: Turn
    restart_to_token: float
    save: SlotReport | None
    restore: SlotReport | None


def direct_run(binary: Path, big: Path, tiny: Path, tmp: Path, slot_save: bool) -> DirectRun:
    slots = Path(tempfile.mkdtemp(dir=tmp, prefix="slots-"))
    flags = (*FLAGS, "--slot-save-path", str(slots))
    save = restore = None
    with running_llama_server(binary, big, tmp, *flags, timeout=120) as a:
        first = turn(a.url + "/v1", [SYSTEM, FIRST])
        if slot_save:
            save = slots_op(save_slots, a.url, "a#0", BUDGET)
    with running_llama_server(binary, tiny, tmp, "-c", "512", "-np", "1") as b:
        turn(b.url + "/v1", [FIRST])  # the other model has its turn while A is gone
    spawned = time.monotonic()
    with running_llama_server(binary, big, tmp, *flags, timeout=120) as a:
        if slot_save:
            restore = slots_op(restore_slots, a.url, "a#0", str(slots), BUDGET)
        then = turn(a.url + "/v1", follow_up(first))
        restart = then.first_at - spawned
    return DirectRun(first, then, restart, save, restore)


def direct(args: argparse.Namespace, binary: Path, tmp: Path) -> None:
    big, tiny = models(tmp)
    runs: dict[bool, list[DirectRun]] = {False: [], True: []}
    for i in range(args.runs):
        for slot_save in (False, True):
            run = direct_run(binary, big, tiny, tmp, slot_save)
            runs[slot_save].append(run)
            print(
                f"  run {i + 1} slotSave={str(slot_save).lower()}: follow-up prompt_n "
                f"{run.then.prompt_n}, TTFT {ms(run.then.ttft)} ms",
                file=sys.stderr,
            )
    print(f"### Direct: llama-server, evict and reload, median of {args.runs} runs\n")
    print(
        "| slotSave | 1st turn prompt_n | follow-up prompt_n | follow-up cache_n "
        "| follow-up TTFT ms | restart -> 1st token ms | save ms | restore ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for slot_save, rs in runs.items():
        saves = [r.save.seconds for r in rs if r.save]
        restores = [r.restore.seconds for r in rs if r.restore]
        print(
            f"| {'on' if slot_save else 'off'} | {med([r.first.prompt_n for r in rs])} "
            f"| {med([r.then.prompt_n for r in rs])} | {med([r.then.cache_n for r in rs])} "
            f"| {ms(med([r.then.ttft for r in rs]))} "
            f"| {ms(med([r.restart_to_token for r in rs]))} "
            f"| {ms(med(saves)) if saves else '-'} | {ms(med(restores)) if restores else '-'} |"
        )
    on = [r for r in runs[True] if r.save]
    if on:
        print(f"\nSaved: {on[-1].save.describe('saved')}; {on[-1].restore.describe('restored')}.")  # type: ignore[union-attr]


# --- through corrallm ---------------------------------------------------------------------


def corrallm_config(binary: Path, big: Path, tiny: Path, slots: Path, slot_save: bool) -> str:
    common = {"proxy": "${PORT}", "server": "box", "ramUsage": {"ram": "700MB"}}
    a = {
        "cmd": llama_cmd(binary, big, *FLAGS, "--slot-save-path", str(slots)),
        **common,
        "slotSave": slot_save,
    }
    b = {"cmd": llama_cmd(binary, tiny, "-c", "512", "-np", "1"), **common}
    return (
        "servers: {box: {pools: {ram: 1GB}}}\n"
        "models:\n"
        f"  a: {{backends: [{json.dumps(a)}]}}\n"  # JSON is YAML
        f"  b: {{backends: [{json.dumps(b)}]}}\n"
    )


def stopped(gw: Gateway, model: str) -> None:
    gw.api("POST", "models/unload", {"model": model})
    wait_for(lambda: gw.state(f"{model}#0") == "stopped", 60, 0.05, f"{model}#0 stopped")


def through_corrallm(args: argparse.Namespace, binary: Path, tmp: Path) -> None:
    big, tiny = models(tmp)
    rows = []
    for slot_save in (False, True):
        slots = tmp / f"slots-{slot_save}"
        slots.mkdir()
        config = corrallm_config(binary, big, tiny, slots, slot_save)
        home = tmp / f"home-{slot_save}"
        firsts, thens, evicts = [], [], []
        with running_gateway(config, tmp, home=home, health_timeout="120s") as gw:
            for i in range(args.runs):
                stopped(gw, "a")
                stopped(gw, "b")
                for old in slots.iterdir():  # each run's first turn starts cold
                    old.unlink()
                first = turn(gw.v1, [SYSTEM, FIRST], "a")
                sent = time.monotonic()
                turn(gw.v1, [FIRST], "b")  # evicts a (saving its slots when slotSave)
                evicts.append(time.monotonic() - sent)
                then = turn(gw.v1, follow_up(first), "a")  # evicts b, reloads a
                firsts.append(first)
                thens.append(then)
                print(
                    f"  run {i + 1} slotSave={str(slot_save).lower()}: follow-up prompt_n "
                    f"{then.prompt_n}, TTFT {ms(then.ttft)} ms",
                    file=sys.stderr,
                )
            log = (gw.home / "logs" / "a_0.log").read_text(errors="replace")
            lines = [line for line in log.splitlines() if "slot cache" in line]
        rows.append((slot_save, firsts, thens, evicts, lines))
    print(f"### Through corrallm: a evicted by b, then a's follow-up, median of {args.runs}\n")
    print(
        "| slotSave | 1st turn prompt_n | follow-up prompt_n | follow-up cache_n "
        "| follow-up TTFT ms (incl. reload) | b's request ms (incl. a's stop) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for slot_save, firsts, thens, evicts, _ in rows:
        print(
            f"| {str(slot_save).lower()} | {med([t.prompt_n for t in firsts])} "
            f"| {med([t.prompt_n for t in thens])} | {med([t.cache_n for t in thens])} "
            f"| {ms(med([t.ttft for t in thens]))} | {ms(med(evicts))} |"
        )
    for slot_save, *_, lines in rows:
        if slot_save and lines:
            print("\na#0's log in corrallm's home (slotSave: true), its last two slot lines:\n")
            for line in lines[-2:]:
                print(f"    {line.strip()}")


# --- W1: wake vs reload, fake backend -----------------------------------------------------


def sleep_config(load: float, wake: float, nap: float) -> str:
    common = {"proxy": "${PORT}", "server": "box", "ramUsage": {"ram": "700MB"}}
    sleeper = {
        "cmd": fake_cmd(
            "--tokens",
            "4",
            "--load-seconds",
            str(load),
            "--sleep-mode",
            "--wake-seconds",
            str(wake),
            "--sleep-seconds",
            str(nap),
        ),
        **common,
        "sleep": {"kind": "vllm", "level": 1},
        "sleepUsage": {"ram": "100MB"},
        "swap": {"loadSeconds": load, "wakeSeconds": wake},
    }
    plain = {
        "cmd": fake_cmd("--tokens", "4", "--load-seconds", str(load)),
        **common,
        "swap": {"loadSeconds": load},
    }
    other = {"cmd": fake_cmd("--tokens", "4"), **common}
    return (
        "servers: {box: {pools: {ram: 1GB}}}\n"
        "models:\n"
        f"  sleeper: {{backends: [{json.dumps(sleeper)}]}}\n"
        f"  plain: {{backends: [{json.dumps(plain)}]}}\n"
        f"  other: {{backends: [{json.dumps(other)}]}}\n"
    )


def sleep_bench(args: argparse.Namespace, tmp: Path) -> None:
    load, wake, nap = args.load_seconds, args.wake_seconds, args.sleep_seconds
    config = sleep_config(load, wake, nap)
    whole: dict[str, list[float]] = {"sleeper": [], "plain": []}
    after_ready: list[float] = []  # reload: backend ready -> first token (its /debug/stats)
    with running_gateway(config, tmp, health_timeout="60s") as gw:
        for model, want in (("sleeper", "asleep"), ("plain", "stopped")):
            turn(gw.v1, [FIRST], model)  # loaded once
            backend = f"{model}#0"
            for _ in range(args.runs):
                turn(gw.v1, [FIRST], "other")  # evicts it: asleep (sleeper) or stopped (plain)
                wait_for(lambda b=backend, w=want: gw.state(b) == w, 60, 0.02, f"{backend} {want}")
                stopped(gw, "other")  # so the timed request has nothing to evict
                t = turn(gw.v1, [FIRST], model)
                whole[model].append(t.ttft)
                if model == "plain":
                    stats = gw.upstream("GET", f"{model}/debug/stats", timeout=10).json()
                    after_ready.append(t.first_at - stats["ready_at"])
    print(f"### W1: corrallm's time around a wake and a reload, {args.runs} runs each\n")
    print(
        "| path | backend's own s | request -> 1st token p50 ms | added p50 ms | added max ms |"
        "\n|---|---:|---:|---:|---:|"
    )
    for model, name, own in (
        ("sleeper", "wake (asleep -> first token)", wake),
        ("plain", "reload (stopped -> first token)", load),
    ):
        xs = whole[model]
        added = [x - own for x in xs]
        print(
            f"| {name} | {own:g} | {ms(statistics.median(xs))} "
            f"| {ms(statistics.median(added))} | {ms(max(added))} |"
        )
    print(
        "\nadded = the request's time to its first token minus the backend's own wake or load "
        "time. A reload's includes starting the fake backend's Python process; of it, "
        f"backend ready -> first token was p50 {ms(statistics.median(after_ready))} ms, "
        f"max {ms(max(after_ready))} ms (its `ready_at`, as in cold_start.py)."
    )


# --- main -----------------------------------------------------------------------------------


@contextlib.contextmanager
def terminated_cleanly() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every `finally` kills its process group."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--direct", action="store_true", help="llama-server only, no corrallm")
    parser.add_argument("--sleep", action="store_true", help="W1 with the fake backend")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load-seconds", type=float, default=2.0, help="--sleep: reload")
    parser.add_argument("--wake-seconds", type=float, default=0.3, help="--sleep: wake")
    parser.add_argument("--sleep-seconds", type=float, default=0.1, help="--sleep: to sleep")
    args = parser.parse_args()
    binary = find_llama_server()
    with terminated_cleanly(), tempfile.TemporaryDirectory() as tmp:
        if args.sleep:
            sleep_bench(args, Path(tmp))
            return
        if binary is None:
            sys.exit(missing_reason())
        if args.direct:
            direct(args, binary, Path(tmp))
        else:
            through_corrallm(args, binary, Path(tmp))


if __name__ == "__main__":
    main()
