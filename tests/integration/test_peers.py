"""SPEC §19 X1-X4 across real processes: nodes (`corrallm serve` with fake backends) and
gateways that list them as `peers`. The openai SDK is the client end to end.

One cluster, started once per module: nodes b and c, and gateway g that lists both as its
peers. Every test starts from it whole (a node a failed fault test left dead or stopped is
started again or resumed first) and sets up the state it needs (which node has m loaded),
so none depends on what another left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from corrallm.config.schema import short_key_name
from corrallm.peers import lanes
from tests.support.processes import (
    Gateway,
    cleanup,
    fake_cmd,
    start_gateway,
    wait_for,
    wait_healthy,
)

PEER_TIMEOUT = 2.0
GROUPS = """
priorityGroups:
  gold: {weight: 10}
  lead: {weight: 1}
scheduler: {maxQueueDepth: 1000}
"""
# A long stream unless the request's max_tokens cuts it: 0.05 s a token.
LONG = fake_cmd("--tokens", "400", "--token-delay", "0.05")
M = f"""
  m:
    backends:
      - cmd: "{LONG}"
        proxy: "${{PORT}}"
        maxConcurrent: 1
"""
# Only node b serves f: the fairness and lane tests' model, one slot, 30 ms a request.
F = f"""
  f:
    backends:
      - cmd: "{fake_cmd("--tokens", "1", "--latency", "0.03")}"
        proxy: "${{PORT}}"
        maxConcurrent: 1
"""
# Only node c serves s: speech to text, for uploads across the hop.
S = f"""
  s:
    backends:
      - cmd: "{fake_cmd()}"
        proxy: "${{PORT}}"
        type: stt
"""
_conversations = itertools.count()


def hi() -> list[dict[str, str]]:
    """A new conversation each time: no affinity (K6) to where an earlier one ran."""
    return [{"role": "user", "content": f"hi {next(_conversations)}"}]


# -- processes --------------------------------------------------------------------------


@dataclass
class Cluster:
    tmp: Path
    configs: dict[str, str]  # node name -> its config text
    nodes: dict[str, Gateway]
    gateway: Gateway
    old: list[Gateway] = field(default_factory=list)  # nodes killed and started again

    def node(self, name: str) -> Gateway:
        return self.nodes[name]

    def restart(self, name: str, wait: bool = True) -> Gateway:
        """Start a node again where its peers look for it: same home (token), same port."""
        dead = self.nodes[name]
        self.old.append(dead)
        port = int(dead.url.rsplit(":", 1)[1])
        node = start_gateway(
            self.configs[name], self.tmp / name, home=dead.home, port=port, wait=wait
        )
        self.nodes[name] = node
        return node

    def revive(self) -> Cluster:
        """Every node running and seen up by the gateway."""
        for name, node in list(self.nodes.items()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGCONT)
            if node.proc.poll() is not None:
                node.records()
                self.restart(name)
        for name in self.nodes:
            wait_for(lambda n=name: peer(self.gateway, n)["state"] == "up", 15, what=f"{name} up")
        return self

    def close(self) -> None:
        for gw in [self.gateway, *self.nodes.values(), *self.old]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(gw.proc.pid, signal.SIGCONT)  # a node a failed test left stopped
            cleanup(gw)


def start_nodes(tmp: Path, configs: dict[str, str]) -> dict[str, Gateway]:
    nodes = {}
    for name, text in configs.items():
        (tmp / name).mkdir(exist_ok=True)
        nodes[name] = start_gateway(text, tmp / name, home=tmp / name / "home", wait=False)
    for node in nodes.values():
        wait_healthy(node)
    return nodes


def gateway_config(nodes: dict[str, Gateway], extra: str = "") -> str:
    peers = "".join(f'  {n}: {{url: "{g.url}", token: "{g.token}"}}\n' for n, g in nodes.items())
    return (
        f"peerTimeout: {PEER_TIMEOUT}s\n{GROUPS}keys: {{gold-key: gold, lead-key: lead}}\n"
        f"peers:\n{peers}{extra}"
    )


@contextlib.contextmanager
def started(tmp: Path, configs: dict[str, str]) -> Iterator[Cluster]:
    nodes = start_nodes(tmp, configs)
    cluster = Cluster(tmp, configs, nodes, nodes["b"])  # replaced below
    try:
        (tmp / "g").mkdir()
        cluster.gateway = start_gateway(gateway_config(nodes), tmp / "g", home=tmp / "g" / "home")
        for name in nodes:
            wait_for(lambda n=name: peer(cluster.gateway, n)["state"] == "up", 10, what="peer up")
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def _cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    configs = {
        "b": f"{GROUPS}capture: {{bodies: all}}\nmodels:{M}{F}",
        "c": f"{GROUPS}capture: {{bodies: all}}\nmodels:{M}{S}",
    }
    with started(tmp_path_factory.mktemp("peers"), configs) as c:
        yield c


@pytest.fixture
def cluster(_cluster: Cluster) -> Cluster:
    return _cluster.revive()


# -- views ------------------------------------------------------------------------------


def peer(gw: Gateway, name: str) -> dict[str, Any]:
    return next(
        p for p in gw.api("GET", "overview", timeout=10).json()["peers"] if p["name"] == name
    )


def peer_model(gw: Gateway, name: str, model: str = "m") -> dict[str, Any] | None:
    view = peer(gw, name)
    if view["state"] != "up":
        return None
    return next((m for m in view["models"] if m["name"] == model), None)


def seen(gw: Gateway, name: str, state: str, in_flight: int | None = None) -> None:
    """Wait until the gateway sees model m on peer `name` in `state` (and so many in flight)."""

    last: list[Any] = []

    def now() -> bool:
        view = peer(gw, name)
        m = next((m for m in view["models"] if m["name"] == "m"), None)
        last[:] = [view["state"], m]
        up = view["state"] == "up"
        return bool(up and m and m["state"] == state and in_flight in (None, m["in_flight"]))

    try:
        wait_for(now, 15, what=f"m@{name} {state} in_flight={in_flight} as {gw.url} sees it")
    except AssertionError as exc:  # what it saw last: the peer's state and its model
        raise AssertionError(f"{exc}; last seen: {last}") from None


def load(cluster: Cluster, *names: str) -> None:
    """m loaded on these nodes, unloaded on the others, and the gateway seeing it so."""
    for name, node in cluster.nodes.items():
        r = node.api("POST", "models/load" if name in names else "models/unload", {"model": "m"})
        assert r.status_code == 200, r.text
    for name in cluster.nodes:
        seen(cluster.gateway, name, "ready" if name in names else "stopped", in_flight=0)


def backend_load(gw: Gateway, route: str) -> tuple[int, int]:
    """What the gateway's own scheduler counts on one of its backends: (running, waiting)."""
    b = gw.overview_backend(route)
    return int(b["in_flight"]), int(b["waiting"])  # type: ignore[call-overload]


def activity(gw: Gateway, model: str, after: int = 0) -> list[dict[str, Any]]:
    rows = gw.api("GET", f"activity?limit=1000&model={model}").json()["rows"]
    return sorted(
        (r for r in rows if r["kind"] == "request" and r["id"] > after), key=lambda r: r["id"]
    )


def last_id(gw: Gateway, model: str) -> int:
    rows = activity(gw, model)
    return rows[-1]["id"] if rows else 0


def row_of(gw: Gateway, request_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        rows = gw.api("GET", "activity?limit=100").json()["rows"]
        return next((r for r in rows if r["request_id"] == request_id), None)

    return wait_for(find, 10, what=f"activity row of {request_id}")


def metric(gw: Gateway, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.M)
    return float(found.group(1)) if found else 0.0


# -- clients ----------------------------------------------------------------------------


def sdk(gw: Gateway, key: str = "gold-key", **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=30, **kwargs)


def chat(gw: Gateway, model: str = "m", key: str = "gold-key", **kwargs: Any) -> Any:
    """One non-streamed chat; its raw response (headers) with `.parse()`."""
    with sdk(gw, key) as client:
        return client.chat.completions.with_raw_response.create(
            model=model, messages=hi(), max_tokens=kwargs.pop("max_tokens", 1), **kwargs
        )


def served_by(raw: Any) -> list[str]:
    """The backend that served it, as this gateway names it (`m@b`): one value (issue 30:
    the peer's own copy, `m#0`, is dropped), kept as a list to show there is one."""
    return [part.strip() for part in raw.headers["x-corrallm-backend"].split(",")]


class Call(threading.Thread):
    """A chat in a thread of its own: `backends` it went to, or the `error` it raised."""

    def __init__(self, gw: Gateway, max_tokens: int = 1, stream: bool = False) -> None:
        super().__init__(daemon=True)
        self.gw, self.max_tokens, self.stream = gw, max_tokens, stream
        self.backends: list[str] = []
        self.chunks = 0
        self.error: openai.APIError | None = None
        self.first = threading.Event()  # its head (and, streamed, a first chunk) arrived
        self.stop = threading.Event()  # a held stream is closed at its next chunk
        self.start()

    def run(self) -> None:
        try:
            with sdk(self.gw) as client:
                if self.stream:
                    self._stream(client)
                else:
                    raw = client.chat.completions.with_raw_response.create(
                        model="m", messages=hi(), max_tokens=self.max_tokens
                    )
                    self.backends = served_by(raw)
                    raw.parse()
        except openai.APIError as exc:
            self.error = exc
        finally:
            self.first.set()

    def _stream(self, client: openai.OpenAI) -> None:
        with client.chat.completions.with_streaming_response.create(
            model="m", messages=hi(), max_tokens=self.max_tokens, stream=True
        ) as response:
            self.backends = served_by(response)
            for chunk in response.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    self.chunks += 1
                    self.first.set()
                if self.stop.is_set():
                    break

    def result(self, timeout: float = 30) -> Call:
        self.join(timeout)
        assert not self.is_alive(), f"a client call still waits after {timeout}s"
        return self

    def on(self, name: str) -> bool:
        return f"m@{name}" in self.backends


class Events(threading.Thread):
    """A gateway's `peer` events, as a dashboard would follow them."""

    def __init__(self, gw: Gateway) -> None:
        super().__init__(daemon=True)
        self.gw, self.got, self.stop = gw, [], threading.Event()
        self.connected = threading.Event()
        self.start()

    def run(self) -> None:
        url = f"{self.gw.url}/api/v1/events?kinds=peer&heartbeat=0.2"
        auth = {"Authorization": f"Bearer {self.gw.token}"}
        with httpx.stream("GET", url, headers=auth, timeout=10) as r:
            self.connected.set()
            kind = ""
            for line in r.iter_lines():  # a heartbeat at least every 0.2 s
                if self.stop.is_set():
                    return
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:") and kind == "peer":
                    data = orjson.loads(line[5:])
                    self.got.append((data["name"], data["state"]))

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        assert not self.is_alive()

    def states(self, name: str) -> list[str]:
        return [state for peer, state in self.got if peer == name]


# -- X1: where a model is served --------------------------------------------------------


def test_X1_requests_go_to_the_peer_where_the_model_is_loaded(cluster: Cluster) -> None:
    g = cluster.gateway
    load(cluster, "b")
    models = {m.id: m for m in sdk(g).models.list().data}
    assert models["m"].model_extra["backends"] == ["m@b", "m@c"]  # type: ignore[index]
    assert models["f"].model_extra["backends"] == ["f@b"]  # type: ignore[index]
    peers = g.api("GET", "overview").json()["peers"]
    assert [(p["name"], p["url"], p["state"]) for p in peers] == [
        ("b", cluster.node("b").url, "up"),
        ("c", cluster.node("c").url, "up"),
    ]
    assert {m["name"]: m["backend"] for m in peers[0]["models"]} == {"m": "m@b", "f": "f@b"}
    assert g.overview_backend("m@c")["peer"] == "c"
    for _ in range(2):  # each long enough for b to report itself busy with it
        raw = chat(g, max_tokens=12)
        assert served_by(raw) == ["m@b"], raw.headers
        assert raw.parse().choices[0].message.content
    seen(g, "c", "stopped")  # c was never asked to start it


def test_issue30_X1_an_answer_through_a_peer_carries_one_backend_and_one_load_ms(
    cluster: Cluster,
) -> None:
    """Issue 30: answers through a peer carried x-corrallm-backend and x-corrallm-load-ms
    twice (the peer's and the gateway's), with values that disagreed. Now one of each, the
    gateway's, streamed or not."""
    g = cluster.gateway
    load(cluster, "b")
    body = {"model": "m", "messages": hi(), "max_tokens": 1}
    headers = {"Authorization": "Bearer gold-key"}
    with httpx.Client(base_url=g.v1, headers=headers, timeout=30) as client:
        plain = client.post("/chat/completions", json=body)
        with client.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
            streamed = r.headers
            r.read()
    for got in (plain.headers, streamed):
        for name in ("x-corrallm-backend", "x-corrallm-load-ms", "x-corrallm-queue-ms"):
            assert len(got.get_list(name)) == 1, (name, got.multi_items())
        assert got["x-corrallm-backend"] == "m@b"
    assert plain.status_code == 200


def test_X1_X2_a_full_peer_spills_to_the_next(cluster: Cluster) -> None:
    g = cluster.gateway
    load(cluster, "b", "c")
    # b's one slot is taken by a client of its own: g knows only from b's live state.
    held = Call(cluster.node("b"), max_tokens=400, stream=True)
    try:
        assert held.first.wait(10)
        seen(g, "b", "ready", in_flight=1)
        # Back to back, each long enough (1 s) for c to report itself busy with it: the
        # one that finished frees c's slot at once, though c says so only at its next
        # report (a second later; till then it would look as busy as b, a tie).
        for _ in range(2):
            assert served_by(chat(g, max_tokens=20)) == ["m@c"]
        # Through g itself: a stream held on one of them, the next request goes to the other.
        held.stop.set()
        held.result()
        seen(g, "b", "ready", in_flight=0)
        first = Call(g, max_tokens=400, stream=True)
        try:
            assert first.first.wait(10)
            other = "c" if first.on("b") else "b"
            assert served_by(chat(g)) == [f"m@{other}"]
        finally:
            first.stop.set()
        first.result()
    finally:
        held.stop.set()


def test_X2_a_conversation_moves_off_a_peer_with_no_free_slot(cluster: Cluster) -> None:
    g, b, c = cluster.gateway, cluster.node("b"), cluster.node("c")
    load(cluster, "b", "c")
    session = {"X-Corrallm-Session": f"conversation-{next(_conversations)}"}
    turns: list[list[str]] = []

    def turn() -> None:
        with sdk(g, default_headers=session) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=hi(), max_tokens=1
            )
        turns.append(served_by(raw))

    def held_on(node: Gateway, name: str) -> Call:
        call = Call(node, max_tokens=400, stream=True)  # its one slot, 20 s
        assert call.first.wait(10)
        seen(g, name, "ready", in_flight=1)
        return call

    on_c = held_on(c, "c")
    try:
        turn()  # c is full: its first turn runs on b
    finally:
        on_c.stop.set()
    on_c.result()
    assert turns == [["m@b"]]
    seen(g, "c", "ready", in_flight=0)
    on_b = held_on(b, "b")
    try:
        second = threading.Thread(target=turn, daemon=True)
        second.start()
        second.join(2)  # c is idle: well under a second there
        assert turns[1:] == [["m@c"]], "its next turn waits behind b's stream"
    finally:
        on_b.stop.set()
        on_b.result()
        second.join(30)


def test_X1_local_backends_first_unless_peer_order_first(cluster: Cluster) -> None:
    tmp = cluster.tmp
    local = f"models:{M}"
    b = {"b": cluster.node("b")}
    (tmp / "local").mkdir()
    (tmp / "first").mkdir()
    here = start_gateway(
        gateway_config(b, local), tmp / "local", home=tmp / "local" / "h", wait=False
    )
    first = start_gateway(
        gateway_config(b, local + "peerOrder: first\n"),
        tmp / "first",
        home=tmp / "first" / "h",
        wait=False,
    )
    try:
        for gw in (here, first):
            wait_healthy(gw)
        load(cluster, "b")
        for gw in (here, first):
            seen(gw, "b", "ready", in_flight=0)
        # The same model, here and on b: one served model, the peer after the local one.
        assert [b["id"] for b in here.api("GET", "overview").json()["models"][0]["backends"]] == [
            "m#0",
            "m@b",
        ]
        assert here.api("POST", "models/load", {"model": "m"}).json()["backend"] == "m#0"
        assert here.state("m#0") == "ready"
        # Both ready with a free slot: the local one (peerOrder: last, the default) ...
        for _ in range(3):
            assert served_by(chat(here)) == ["m#0"]
        # ... and the peer's with peerOrder: first.
        for _ in range(3):
            assert served_by(chat(first)) == ["m@b"]
    finally:
        cleanup(here)
        cleanup(first)


def test_X1_corrallm_check_reports_peer_problems_with_their_paths(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "peers:\n"
        '  box2: {url: "10.0.0.2:6502", token: ""}\n'
        '  "a b": {url: "http://h:1", token: t}\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "corrallm", "check", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "peers.box2.url: '10.0.0.2:6502' is not an http(s) URL" in out
    assert "peers.box2.token: the token is empty" in out
    assert "peers[\"a b\"]: peer name 'a b' must be letters, digits" in out


# -- X3: the caller's lane across the hop -----------------------------------------------


async def _flood(gw: Gateway, counts: dict[str, int]) -> list[Any]:
    clients = {
        key: openai.AsyncOpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=120)
        for key in counts
    }
    # Interleaved as they are sent: both lanes are backlogged from the start.
    order = sorted(
        ((i / n, key) for key, n in counts.items() for i in range(n)), key=lambda x: x[0]
    )
    try:
        return await asyncio.gather(
            *(
                clients[key].chat.completions.create(model="f", messages=hi(), max_tokens=1)
                for _, key in order
            ),
            return_exceptions=True,
        )
    finally:
        for client in clients.values():
            await client.close()


def test_X3_lanes_keep_their_weights_on_the_node(cluster: Cluster) -> None:
    g, b = cluster.gateway, cluster.node("b")
    assert b.api("POST", "models/load", {"model": "f"}).status_code == 200
    before = last_id(b, "f")
    b.upstream("DELETE", "f/debug/requests", timeout=10)
    gold, lead = 90, 10
    results = asyncio.run(_flood(g, {"gold-key": gold, "lead-key": lead}))
    assert all(isinstance(r, openai.types.chat.ChatCompletion) for r in results), [
        r for r in results if isinstance(r, BaseException)
    ][:3]
    rows = wait_for(
        lambda: got if len(got := activity(b, "f", before)) >= gold + lead else None,
        20,
        what="the node's activity rows",
    )
    order = [r["group"] for r in rows]
    assert order.count("gold") == gold and order.count("lead") == lead, order
    # Served one at a time (one slot): count gold between the 3rd and the 8th lead, while
    # both lanes are still backlogged. Start-up effects (who arrived first) are left out.
    leads = [i for i, group in enumerate(order) if group == "lead"]
    window = order[leads[2] + 1 : leads[7]]
    ratio = window.count("gold") / (window.count("lead") + 1)
    print(f"\nX3 fairness on the node: gold/lead = {ratio:.2f} (want 10), order: {order}")
    assert abs(ratio - 10) <= 1.0, order
    assert all(r["key"] is None for r in rows)  # the caller's key stays at the gateway
    # Nothing of the caller's identity reached the node's backend either.
    for seen_request in b.upstream("GET", "f/debug/requests", timeout=10).json():
        names = set(seen_request["headers"])
        assert not names & {"authorization", "x-api-key", "x-corrallm-key", "cookie"}, names
        assert not names & {"x-corrallm-lane", "x-corrallm-lane-signature"}, names


def test_X3_the_caller_key_never_leaves_the_gateway(cluster: Cluster) -> None:
    g, b = cluster.gateway, cluster.node("b")
    headers = {"x-api-key": "gold-key", "Cookie": "session=gold-key", "X-Corrallm-Key": "gold-key"}
    with sdk(g, default_headers=headers) as client:
        raw = client.chat.completions.with_raw_response.create(model="f", messages=hi())
    assert served_by(raw) == ["f@b"]
    own = row_of(g, raw.headers["x-corrallm-request-id"])
    assert (own["key"], own["group"]) == (short_key_name("gold-key"), "gold")  # T1: its name
    # The node's capture of what arrived: its lane, signed; no key in any form.
    captured = b.api("GET", "captures?model=f&limit=1").json()["captures"][0]
    record = b.api("GET", f"captures/{captured['request_id']}").json()
    arrived = record["headers"]["request"]
    assert arrived["x-corrallm-lane"] == "gold"
    assert arrived["x-corrallm-lane-signature"].startswith("t=")
    assert not set(arrived) & {"authorization", "x-api-key", "x-corrallm-key", "cookie"}, arrived
    assert "gold-key" not in str(arrived)
    assert (record["key"], record["group"]) == (None, "gold")


def _direct(b: Gateway, headers: dict[str, str]) -> str:
    """A chat sent straight to node b with these lane headers: its request id."""
    with sdk(b, key="none", default_headers=headers) as client:
        raw = client.chat.completions.with_raw_response.create(model="f", messages=hi())
    return str(raw.headers["x-corrallm-request-id"])


def rows_of(gw: Gateway, request_ids: list[str]) -> list[dict[str, Any]]:
    """The activity rows of these requests, in their order, once all are written."""

    def find() -> list[dict[str, Any]] | None:
        rows = {r["request_id"]: r for r in gw.api("GET", "activity?limit=200").json()["rows"]}
        return [rows[i] for i in request_ids] if all(i in rows for i in request_ids) else None

    return wait_for(find, 10, what="activity rows")


def chat_lane(token: str, group: str, now: float) -> dict[str, str]:
    """The lane headers a gateway signs for one chat request to a node (T5)."""
    return lanes.sign(token, group, "POST", "/v1/chat/completions", now)


def test_X3_unsigned_forged_stale_and_replayed_lanes_fall_into_the_default_group(
    cluster: Cluster,
) -> None:
    b = cluster.node("b")
    reasons = ("unsigned", "bad_signature", "stale", "replayed")
    before = {r: metric(b, "corrallm_peer_lanes_ignored_total", reason=r) for r in reasons}
    now = time.time()
    good = chat_lane(b.token, "gold", now)
    forged = chat_lane("not-the-token", "gold", now)
    tampered = {**chat_lane(b.token, "lead", now), "X-Corrallm-Lane": "gold"}
    elsewhere = {**lanes.sign(b.token, "gold", "POST", "/v1/embeddings", now)}
    replayed = chat_lane(b.token, "gold", now)
    assert rows_of(b, [_direct(b, replayed)])[0]["group"] == "gold"  # its first use
    cases = {
        "unsigned": [
            {"X-Corrallm-Lane": "gold"},
            {"X-Corrallm-Lane-Signature": good["X-Corrallm-Lane-Signature"]},
        ],
        "bad_signature": [
            forged,
            tampered,
            elsewhere,  # signed for another path
            {**good, "X-Corrallm-Lane-Signature": "t=1,n=nonce-123,v1=zz"},
        ],
        # replayed after the window, and signed by a clock running ahead
        "stale": [chat_lane(b.token, "gold", now - 31), chat_lane(b.token, "gold", now + 90)],
        "replayed": [replayed],  # within the window, its nonce used already
    }
    sent = [(reason, headers) for reason, all_ in cases.items() for headers in all_]
    ignored = rows_of(b, [_direct(b, headers) for _, headers in sent])
    for (reason, headers), row in zip(sent, ignored, strict=True):
        # `_direct` sends the key "none", not configured on the node: `unknown` (T1)
        assert (row["group"], row["key"], row["status"]) == ("default", "unknown", 200), (
            reason,
            headers,
        )
    # Correctly signed and fresh (to the window's edge): honoured, and not counted.
    honoured = [good, chat_lane(b.token, "lead", time.time() - 25)]
    rows = rows_of(b, [_direct(b, headers) for headers in honoured])
    assert [r["group"] for r in rows] == ["gold", "lead"]
    counted = {
        r: metric(b, "corrallm_peer_lanes_ignored_total", reason=r) - before[r] for r in reasons
    }
    assert counted == {r: len(cases[r]) for r in reasons}
    assert "lane header ignored: stale" in b.log()


def test_X3_a_hop_is_never_forwarded_to_a_peer_again(cluster: Cluster) -> None:
    g, b = cluster.gateway, cluster.node("b")
    before = last_id(b, "f")
    for headers in (chat_lane(g.token, "gold", time.time()), {"X-Corrallm-Lane": "gold"}):
        with (
            sdk(g, default_headers=headers) as client,
            pytest.raises(openai.NotFoundError) as caught,
        ):
            client.chat.completions.create(model="f", messages=hi())
        assert caught.value.code == "model_not_found"
        assert "already crossed a hop" in caught.value.message
    assert last_id(b, "f") == before  # nothing reached the node


# -- X4: a peer that stops answering ----------------------------------------------------


def _down_after(g: Gateway, name: str, since: float) -> float:
    wait_for(lambda: peer(g, name)["state"] == "down", 3 * PEER_TIMEOUT, 0.01, f"{name} down")
    return time.monotonic() - since


def test_X4_a_node_killed_mid_traffic_is_marked_down_and_its_work_moves(cluster: Cluster) -> None:
    g = cluster.gateway
    load(cluster, "b", "c")
    running = Call(g, max_tokens=400, stream=True)  # 20 s of tokens
    assert running.first.wait(10)
    victim = "b" if running.on("b") else "c"
    survivor = "c" if victim == "b" else "b"
    other = Call(g, max_tokens=30, stream=True)  # 1.5 s on the survivor
    assert other.first.wait(10) and other.on(survivor), other.backends
    queued = [Call(g), Call(g)]  # both slots taken: they wait at g, one on each peer
    wait_for(lambda: backend_load(g, "m@b")[1] == backend_load(g, "m@c")[1] == 1, 10, what="queued")
    node = cluster.node(victim)
    node.records()  # its backends are cleaned up at the end, whatever happens
    killed = time.monotonic()
    node.proc.send_signal(signal.SIGKILL)
    down = _down_after(g, victim, killed)
    print(f"\nX4 kill -9: {victim} marked down {down:.3f}s after the kill")
    assert down <= PEER_TIMEOUT
    assert not peer_model(g, victim) and metric(g, "corrallm_peer_up", peer=victim) == 0.0
    after = Call(g)
    work = [*queued, after, other]

    def moved() -> bool:
        """Nothing left at g for the victim: all of it runs, waits or ran on the survivor."""
        running_there, waiting_there = backend_load(g, f"m@{survivor}")
        done = sum(not call.is_alive() for call in work)
        gone = backend_load(g, f"m@{victim}") == (0, 0)
        return gone and running_there + waiting_there + done == len(work)

    wait_for(moved, 10, what=f"the work moved to {survivor}")
    # Started again at once (same home, so the same token; same port), while the rest
    # is checked: it comes back once its events stream reconnects.
    restarted = time.monotonic()
    cluster.restart(victim, wait=False)
    # The stream it was serving ends with an error event; the SDK raises it.
    running.result(10)
    assert running.chunks > 0 and running.error is not None, running.backends
    # peer_down whether g marked it down first or its relay saw the connection close
    # first (a kill -9 closes both at once).
    assert running.error.code == "peer_down", running.error
    print(f"X4 the stream it served ended with {running.error.code}: {running.error.message}")
    # What had not started there goes to the survivor; nothing hangs.
    for call in (*queued, after, other.result(10)):
        call.result(20)
        assert call.error is None and call.on(survivor), (call.error, call.backends)
    assert other.chunks == 30
    wait_healthy(cluster.node(victim))
    wait_for(lambda: peer(g, victim)["state"] == "up", 15, what=f"{victim} up again")
    print(f"X4 {victim} up again {time.monotonic() - restarted:.3f}s after its restart began")
    assert metric(g, "corrallm_peer_up", peer=victim) == 1.0
    # Requests go to it again: with the survivor's slot taken, the next one is its.
    assert cluster.node(victim).api("POST", "models/load", {"model": "m"}).status_code == 200
    seen(g, victim, "ready", in_flight=0)
    hold = Call(cluster.node(survivor), max_tokens=400, stream=True)
    try:
        assert hold.first.wait(10)
        seen(g, survivor, "ready", in_flight=1)
        back = Call(g, max_tokens=1).result(30)
        assert back.error is None and back.on(victim), (back.error, back.backends)
    finally:
        hold.stop.set()
    hold.result()


@pytest.mark.parametrize("stream", [False, True], ids=["call", "stream"])
def test_X4_a_hung_node_is_marked_down_within_peer_timeout(cluster: Cluster, stream: bool) -> None:
    g = cluster.gateway
    load(cluster, "b", "c")
    # Running there when it hangs: a call that sent its client nothing yet (1 s there),
    # or a stream under way (20 s of tokens).
    there = Call(g, max_tokens=400 if stream else 20, stream=stream)
    victim = wait_for(
        lambda: next((n for n in cluster.nodes if backend_load(g, f"m@{n}")[0] == 1), None),
        10,
        what="the call running",
    )
    if stream:
        assert there.first.wait(10) and there.on(victim), there.backends
    survivor = "c" if victim == "b" else "b"
    node = cluster.node(victim)
    events = Events(g)
    assert events.connected.wait(10)
    stopped = time.monotonic()
    # The node's whole process group: its workers too, under `serve --workers` (they
    # would answer for it otherwise); its backends run in sessions of their own.
    os.killpg(node.proc.pid, signal.SIGSTOP)
    try:
        down = _down_after(g, victim, stopped)
        print(f"\nX4 SIGSTOP ({'stream' if stream else 'call'}): {victim} down after {down:.3f}s")
        assert down <= PEER_TIMEOUT + 0.5  # its last heartbeat came before the stop
        there.result(20)
        if stream:
            # Its answer had begun: it ends with an error event (the SDK raises it).
            assert there.chunks > 0 and there.error is not None, there.backends
            assert there.error.code == "peer_down", there.error
            assert "stopped answering" in there.error.message
        else:
            # It had sent nothing to its client: the survivor serves it instead.
            assert there.error is None and there.on(survivor), (there.error, there.backends)
        after = Call(g).result(20)
        assert after.error is None and after.on(survivor), (after.error, after.backends)
    finally:
        os.killpg(node.proc.pid, signal.SIGCONT)
    wait_for(lambda: peer(g, victim)["state"] == "up", 15, what=f"{victim} up after SIGCONT")
    # The events stream told of both moves.
    wait_for(lambda: events.states(victim) == ["down", "up"], 5, what="peer events")
    events.close()
    assert events.states(survivor) == []


def test_X1_uploads_and_anthropic_messages_cross_the_hop_unchanged(cluster: Cluster) -> None:
    """An audio upload goes to the node byte for byte (multipart as sent), and /v1/messages
    is sent as /v1/messages (the node speaks every dialect), both in the caller's lane."""
    g, c = cluster.gateway, cluster.node("c")
    load(cluster, "c")
    audio = b"RIFF0000" + bytes(range(256)) * 4
    with sdk(g) as client:
        raw = client.audio.transcriptions.with_raw_response.create(model="s", file=("a.wav", audio))
    assert served_by(raw)[-1] == "s@c"
    assert raw.parse().text.startswith("This is a fake transcript")
    # The node names the request with its own id: its row is the model's last.
    rows = wait_for(lambda: activity(c, "s") or None, 10, what="the node's row for s")
    assert (rows[-1]["endpoint"], rows[-1]["group"], rows[-1]["key"]) == (
        "/v1/audio/transcriptions",
        "gold",
        None,
    )
    upload = c.api("GET", f"captures/{rows[-1]['request_id']}").json()
    assert upload["request_bytes"] == int(raw.http_request.headers["content-length"])

    anthropic = pytest.importorskip("anthropic")
    before = last_id(c, "m")
    with anthropic.Anthropic(base_url=g.url, api_key="gold-key", max_retries=0) as client:
        message = client.messages.create(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi there"}]
        )
        with client.messages.stream(
            model="m", max_tokens=3, messages=[{"role": "user", "content": "hi again"}]
        ) as stream:
            streamed = stream.get_final_message()
    assert message.content[0].text and streamed.content[0].text  # type: ignore[union-attr]
    rows = wait_for(
        lambda: activity(c, "m", after=before)[1:] and activity(c, "m", after=before),
        10,
        what="two rows",
    )
    assert [(r["endpoint"], r["group"], r["key"]) for r in rows] == [
        ("/v1/messages", "gold", None),
        ("/v1/messages", "gold", None),
    ]
