"""SPEC §15/§20: a bounded soak with mixed traffic against a real `corrallm serve` and fake
backends, a config reload (REST, then SIGHUP) in the middle, and two models that do not
fit the server's pool together, so that they evict each other over and over.

It ends with nothing leaked: zero in flight and zero waiting on every backend and lane,
the gateway's open file descriptors within a small bound of the start, no stray backend
process after the gateway's shutdown, and exactly one activity row per request the
clients made (disconnected ones included, recorded as 499), matched by model, key and
status. `pytest -s` shows the figures.

CORRALLM_SOAK_SECONDS sets how long the traffic runs (default 45: about 60 s in all).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import orjson
import psutil
import pytest

from corrallm.config.schema import short_key_name
from tests.support.observe import (
    RawClient,
    backend_load,
    descendants,
    fds,
    load,
    relaying_worker,
    request_rows,
    rss_mb,
)
from tests.support.processes import Gateway, fake_cmd, group_alive, wait_for

SOAK_SECONDS = float(os.environ.get("CORRALLM_SOAK_SECONDS", "45"))
SEED = int(os.environ.get("CORRALLM_SOAK_SEED", "1320"))
KEYS = {"soak-interactive": "interactive", "soak-batch": "batch"}
MIXERS = 4  # threads sending the general mix
CLIENT_TIMEOUT = 90  # scheduler.maxWait is 60 s: no answer by then is a hang
# File descriptors the gateway may legitimately hold more of at the end than after the
# warm-up: the backend the reload added (its log pipes and pooled connections), the pool
# grown to the largest concurrency seen, and the store's WAL files.
FD_SLACK = 16


def config(main_slots: int = 4, embed_slots: int = 2, late: bool = False) -> str:
    """Pool `system` 4.5GB: main 1 + embed 0.5 + narrow 0.25 + late 0.25 + one swap model
    2 = 4GB fits; both swap models (2 + 2) never do, so each evicts the other (they cost
    `medium` to evict; narrow and late cost `high`, so they are not chosen instead)."""

    def backend(*flags: str, ram: str, slots: int, extra: str = "") -> str:
        return (
            f'{{cmd: "{fake_cmd(*flags)}", proxy: "${{PORT}}", server: box, '
            f"ramUsage: {{system: {ram}}}, maxConcurrent: {slots}{extra}}}"
        )

    late_model = (
        f"""
  late:
    sticky: {{evictCost: high}}
    backends: [{backend("--tokens", "8", ram="0.25GB", slots=2)}]"""
        if late
        else ""
    )
    return f"""
scheduler: {{maxWait: 60s, maxQueueDepth: 64}}
servers:
  box: {{pools: {{system: 4.5GB}}, reserve: {{system: 0}}}}
priorityGroups:
  interactive: {{weight: 10}}
  batch: {{weight: 1, interruptible: true}}
keys: {{soak-interactive: interactive, soak-batch: batch}}
models:
  main:
    persistent: true
    backends: [{backend("--tokens", "200", "--token-delay", "0.01", ram="1GB", slots=main_slots)}]
  embed:
    persistent: true
    backends: [{backend(ram="0.5GB", slots=embed_slots, extra=", type: embed")}]
  narrow:
    sticky: {{evictCost: high}}
    backends: [{backend("--latency", "2.5", ram="0.25GB", slots=1)}]
  swap-a:
    backends: [{backend("--tokens", "8", ram="2GB", slots=2)}]
  swap-b:
    backends: [{backend("--tokens", "8", ram="2GB", slots=2)}]{late_model}
"""


@dataclass
class Tally:
    """Every request a client sent, with the status it saw (499: the client hung up)."""

    seen: collections.Counter[tuple[str, str, int]] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    queued_hangups: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    gw: Gateway | None = None

    def add(self, model: str, key: str, status: int, note: str = "") -> None:
        failed = status not in (200, 499)
        state = _state_now(self.gw) if failed and self.gw is not None else ""
        with self.lock:
            self.seen[(model, key, status)] += 1
            if failed:
                self.failures.append(f"{model} {key} -> {status} {note[:300]}\n{state}")

    def total(self) -> int:
        return sum(self.seen.values())


def _state_now(gw: Gateway) -> str:
    """What the gateway shows at the moment a client saw a failure (for the report)."""
    try:
        overview = gw.api("GET", "overview", timeout=10).json()
        lanes = gw.api("GET", "lanes", timeout=10).json()["lanes"]
    except httpx.HTTPError as exc:
        return f"(the management API did not answer either: {exc!r})"
    keep = ("id", "state", "in_flight", "waiting", "max_concurrent", "pid")
    backends = [{k: b[k] for k in keep} for m in overview["models"] for b in m["backends"]]
    lanes = [{k: lane[k] for k in ("name", "in_flight", "waiting")} for lane in lanes]
    return f"backends={backends} lanes={lanes}"


def messages(rng: random.Random) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(rng.choice("abcdefgh") for _ in range(12))}]


class Mixer:
    """One client thread: a seeded sequence of actions through httpx and the openai SDK."""

    def __init__(self, gw: Gateway, n: int, tally: Tally, reloaded: threading.Event) -> None:
        self.gw, self.tally, self.reloaded = gw, tally, reloaded
        self.rng = random.Random(SEED + n)
        self.key = list(KEYS)[n % 2]
        headers = {"Authorization": f"Bearer {self.key}"}
        self.http = httpx.Client(base_url=gw.v1, headers=headers, timeout=CLIENT_TIMEOUT)
        self.sdk = openai.OpenAI(
            base_url=gw.v1, api_key=self.key, max_retries=0, timeout=CLIENT_TIMEOUT
        )
        self.actions: list[tuple[Callable[[], None], int]] = [
            (self.sdk_stream, 25),
            (self.http_chat, 25),
            (self.sdk_embed, 15),
            (self.http_embed, 10),
            (self.hang_up_mid_stream, 10),
            (self.late_chat, 15),
        ]

    def run(self, stop: threading.Event) -> None:
        funcs, weights = zip(*self.actions, strict=True)
        with self.http, self.sdk:
            while not stop.is_set():
                action = self.rng.choices(funcs, weights)[0]
                action()

    def _sdk_call(self, model: str, call: Callable[[], object]) -> None:
        try:
            call()
        except openai.APIStatusError as exc:
            self.tally.add(model, self.key, exc.status_code, str(exc))
        except Exception as exc:  # a broken connection, a torn stream: a finding
            self.tally.add(model, self.key, -1, repr(exc))
        else:
            self.tally.add(model, self.key, 200)

    def sdk_stream(self) -> None:
        def call() -> None:
            stream = self.sdk.chat.completions.create(
                model="main",
                messages=messages(self.rng),  # type: ignore[arg-type]
                stream=True,
                max_tokens=self.rng.randint(4, 24),
            )
            chunks = list(stream)
            assert chunks, "an empty stream"

        self._sdk_call("main", call)

    def sdk_embed(self) -> None:
        def call() -> None:
            inputs = [f"text {i}" for i in range(self.rng.randint(1, 4))]
            out = self.sdk.embeddings.create(model="embed", input=inputs)
            assert len(out.data) == len(inputs)

        self._sdk_call("embed", call)

    def _http(self, model: str, path: str, body: dict[str, object]) -> None:
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            self.tally.add(model, self.key, -1, repr(exc))
        else:
            self.tally.add(model, self.key, r.status_code, r.text)

    def http_chat(self) -> None:
        body = {"model": "main", "messages": messages(self.rng), "max_tokens": 8}
        self._http("main", "/chat/completions", body)

    def http_embed(self) -> None:
        self._http("embed", "/embeddings", {"model": "embed", "input": "one text"})

    def late_chat(self) -> None:
        """After the reload that adds it, the model `late`; before, main."""
        model = "late" if self.reloaded.is_set() else "main"
        body = {"model": model, "messages": messages(self.rng), "max_tokens": 4}
        self._http(model, "/chat/completions", body)

    def hang_up_mid_stream(self) -> None:
        """A 2 s stream (200 tokens, 10 ms apart) left after its first events."""
        body = {"model": "main", "messages": messages(self.rng), "stream": True}
        try:
            with self.http.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    self.tally.add("main", self.key, r.status_code, r.text)
                    return
                events = 0
                for line in r.iter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        break
                # Leaving the block closes this connection: the client is gone mid-stream.
        except httpx.HTTPError as exc:
            self.tally.add("main", self.key, -1, repr(exc))
            return
        self.tally.add("main", self.key, 499)


def swapper(gw: Gateway, tally: Tally, stop: threading.Event) -> None:
    """swap-a and swap-b in turn: each request evicts the other model (R1/R2)."""
    key = "soak-batch"
    with httpx.Client(
        base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=CLIENT_TIMEOUT
    ) as http:
        turn = 0
        while not stop.is_set():
            model = ("swap-a", "swap-b")[turn % 2]
            turn += 1
            body = {"model": model, "messages": [{"role": "user", "content": "swap"}]}
            try:
                r = http.post("/chat/completions", json=body)
            except httpx.HTTPError as exc:
                tally.add(model, key, -1, repr(exc))
            else:
                tally.add(model, key, r.status_code, r.text)


def queue_hanger(gw: Gateway, tally: Tally, stop: threading.Event) -> None:
    """S7 in the mix: a holder takes narrow's only slot for 2.5 s; a second client queues
    behind it and hangs up while waiting."""
    key = "soak-interactive"
    headers = {"Authorization": f"Bearer {key}"}
    body = orjson.dumps({"model": "narrow", "messages": [{"role": "user", "content": "q"}]})
    while not stop.is_set():
        result: list[int] = []

        def hold(result: list[int] = result) -> None:
            try:
                r = httpx.post(
                    gw.v1 + "/chat/completions",
                    content=body,
                    headers=headers,
                    timeout=CLIENT_TIMEOUT,
                )
                result.append(r.status_code)
            except httpx.HTTPError:
                result.append(-1)

        holder = threading.Thread(target=hold)
        holder.start()
        with contextlib.suppress(AssertionError):
            wait_for(lambda: backend_load(gw, "narrow#0")[0] == 1, 30, 0.02, "narrow held")
        client = RawClient(gw.url)
        client.send_head(
            "POST",
            "/v1/chat/completions",
            {**headers, "Content-Type": "application/json"},
            len(body),
        )
        client.send(body)
        try:
            wait_for(lambda: backend_load(gw, "narrow#0")[1] >= 1, 2.0, 0.02, "one queued")
            queued = True
        except AssertionError:
            queued = False  # the machine is slow: it was admitted already; still a hang-up
        client.close()
        tally.add("narrow", key, 499)
        holder.join(120)
        tally.add("narrow", key, result[0] if result else -1)
        if queued:
            with tally.lock:
                tally.queued_hangups += 1


def warm_up(gw: Gateway, tally: Tally) -> None:
    """Every model once (main at its full concurrency), so that the baseline of file
    descriptors counts the backends' pipes and the pool's connections."""
    key = "soak-interactive"
    chat = {"messages": [{"role": "user", "content": "warm"}], "max_tokens": 4}
    with httpx.Client(
        base_url=gw.v1, headers={"Authorization": f"Bearer {key}"}, timeout=CLIENT_TIMEOUT
    ) as http:

        def post(model: str) -> None:
            path, body = (
                ("/embeddings", {"model": model, "input": "x"})
                if model == "embed"
                else ("/chat/completions", {"model": model, **chat})
            )
            try:
                r = http.post(path, json=body)
            except httpx.HTTPError as exc:
                tally.add(model, key, -1, repr(exc))
            else:
                tally.add(model, key, r.status_code, r.text)

        threads = [threading.Thread(target=post, args=(m,)) for m in ["main"] * 4 + ["embed"] * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CLIENT_TIMEOUT + 10)
        for model in ("narrow", "swap-a", "swap-b"):
            post(model)
    assert not tally.failures, f"the warm-up failed: {tally.failures}"


def settle(gw: Gateway) -> None:
    wait_for(lambda: load(gw).idle, 30, 0.1, "zero in flight and zero waiting")


def config_file(gw: Gateway) -> Path:
    return gw.config_path


@pytest.mark.serve_process
@pytest.mark.timeout(int(SOAK_SECONDS) + CLIENT_TIMEOUT + 150)
def test_soak_mixed_traffic_with_reload_and_evictions_leaks_nothing(
    gateway_factory: Callable[..., Gateway],
) -> None:
    started = time.monotonic()
    gw = gateway_factory(config())
    pid = gw.proc.pid
    tally = Tally(gw=gw)
    warm_up(gw, tally)
    settle(gw)
    fds_before, rss_before = fds(pid), rss_mb(pid)

    stop, reloaded = threading.Event(), threading.Event()
    mixers = [Mixer(gw, n, tally, reloaded) for n in range(MIXERS)]
    threads = [
        threading.Thread(target=m.run, args=(stop,), name=f"mixer-{i}")
        for i, m in enumerate(mixers)
    ]
    threads.append(threading.Thread(target=swapper, args=(gw, tally, stop), name="swapper"))
    threads.append(threading.Thread(target=queue_hanger, args=(gw, tally, stop), name="hanger"))
    for t in threads:
        t.start()
    traffic_started = time.monotonic()
    try:
        # P6 in the middle: REST first (adds a model, changes main's slots: main is drained
        # and restarted under traffic), then SIGHUP (changes embed's slots).
        stop.wait(SOAK_SECONDS * 0.4)
        config_file(gw).write_text(config(main_slots=3, late=True))
        report = gw.api("POST", "config/reload")
        assert report.status_code == 200, report.text
        assert report.json()["added"] == ["late#0"] and report.json()["restarted"] == ["main#0"]
        reloaded.set()
        stop.wait(SOAK_SECONDS * 0.3)
        config_file(gw).write_text(config(main_slots=3, embed_slots=3, late=True))
        gw.signal(signal.SIGHUP)
        wait_for(lambda: gw.log().count("config reloaded") >= 2, 30, 0.1, "the SIGHUP reload")
        stop.wait(max(0.0, SOAK_SECONDS - (time.monotonic() - traffic_started)))
    finally:
        stop.set()
        deadline = time.monotonic() + CLIENT_TIMEOUT + 30
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    traffic_seconds = time.monotonic() - traffic_started
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"client threads hung: {hung}; {_state_now(gw)}; {tally.failures[:5]}"

    settle(gw)
    sent = tally.total()
    wait_for(lambda: fds(pid) <= fds_before + FD_SLACK, 30, 0.1, "file descriptors back")
    fds_after, rss_after = fds(pid), rss_mb(pid)

    models = sorted({model for model, _, _ in tally.seen})

    def rows_when_all_in() -> list[dict[str, object]] | None:
        rows = [row for model in models for row in request_rows(gw, model=model)]
        return rows if len(rows) >= sent else None

    # Rows are flushed about every second: wait for them, then compare.
    rows = wait_for(rows_when_all_in, 30, 0.25, f"{sent} activity rows")
    # T1: rows name a key by its name; the tally by the secret each client sent.
    secret_of = {short_key_name(k): k for k in KEYS}
    recorded = collections.Counter(
        (r["model"], secret_of.get(r["key"], r["key"]), r["status"]) for r in rows
    )
    evictions = gw.log().count("evict backend=swap-")

    # No duplicate backend: the live children are exactly the backends the overview shows.
    overview = gw.api("GET", "overview").json()
    shown = {b["pid"] for m in overview["models"] for b in m["backends"] if b["pid"]}

    def children_are_the_backends() -> list[psutil.Process] | None:
        children = descendants(pid)
        # Under CORRALLM_WORKERS the relaying workers are children too; not backends, but
        # kept in `children`: none may be left after the shutdown either.
        backends = {c.pid for c in children if not relaying_worker(c)}
        return children if backends == shown else None

    children = wait_for(children_are_the_backends, 20, 0.1, f"children to be {shown}")

    gw.records()
    gw.signal(signal.SIGTERM)
    assert gw.wait_exit(60) in (0, -signal.SIGTERM), gw.log()[-3000:]
    stray = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    stray_groups = [pgid for pgid in gw.backend_groups if group_alive(pgid)]

    print(
        f"\nsoak: {traffic_seconds:.0f}s of traffic ({time.monotonic() - started:.0f}s in all), "
        f"{sent} requests ({sent / traffic_seconds:.0f}/s), "
        f"{sum(n for (_, _, s), n in tally.seen.items() if s == 499)} hung up "
        f"({tally.queued_hangups} while queued), {evictions} evictions, 2 reloads\n"
        f"soak: fds {fds_before} -> {fds_after}, RSS {rss_before:.0f} -> {rss_after:.0f} MB, "
        f"activity rows {len(rows)} for {sent} requests, "
        f"stray processes after shutdown: {len(stray)}\n"
        f"soak: by (model, key, status): {sorted(tally.seen.items())}"
    )
    assert not tally.failures, tally.failures[:20]
    assert len(rows) == sent, f"{len(rows)} activity rows for {sent} requests"
    extra, missing = recorded - tally.seen, tally.seen - recorded
    assert recorded == tally.seen, f"rows beyond requests: {extra}; requests without: {missing}"
    assert evictions >= 4, "the swap models did not evict each other"
    assert tally.queued_hangups >= 1, "no client ever hung up while queued"
    assert not stray and not stray_groups, (stray, stray_groups)
