"""`/metrics` (SPEC §9 C6, §21 O3) in Prometheus format.

The request path only bumps plain dict counters and bucket lists (no locks, no
prometheus_client objects per label set); everything else is read from the gateway's own
state when Prometheus scrapes, by a custom collector.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from corrallm.lifecycle.state import State
from corrallm.observe.fleet import fleet_gauges

if TYPE_CHECKING:
    from corrallm.config import Config
    from corrallm.cost.ledger import Visit
    from corrallm.lifecycle.supervisor import Supervisor
    from corrallm.peers.nodes import Nodes
    from corrallm.residency.manager import Residency
    from corrallm.routing.router import Route, ServedModel
    from corrallm.scheduler.admission import Admission


class Observed(Protocol):
    """What a scrape reads of the running gateway (which is one), without importing it."""

    @property
    def config(self) -> Config: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def routes(self) -> Mapping[str, Route]: ...
    @property
    def served(self) -> Sequence[ServedModel]: ...
    @property
    def supervisors(self) -> Mapping[str, Supervisor]: ...
    @property
    def residency(self) -> Residency: ...
    @property
    def nodes(self) -> Nodes: ...


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Tally:
    """What settled visits add to /metrics: counters by label set and the latency
    histograms. A relaying worker (`serve --workers N`) keeps its own and hands over what
    it counted since it last did (`take`); the owner adds that to its own (`add`), so
    that /metrics shows one gateway while the owner does no per-visit work for it."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, str, str]] = Counter()
        self.tokens: Counter[tuple[str, str, str]] = Counter()
        self.cost: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.energy: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.preemptions: Counter[str] = Counter()
        self.rejections: Counter[tuple[str, str]] = Counter()
        self.latency = Latency()

    def visit(self, visit: Visit, cost_usd: float, energy_wh: float) -> None:
        backend = visit.backend_id or ""
        self.requests[(visit.model, backend, visit.group, str(visit.status))] += 1
        if visit.metered is not None:
            self.tokens[(visit.model, visit.group, "prompt")] += visit.metered.prompt_tokens
            self.tokens[(visit.model, visit.group, "completion")] += visit.metered.completion_tokens
        self.cost[(visit.model, visit.group)] += cost_usd
        self.energy[(visit.model, visit.group)] += energy_wh
        if visit.preempted:
            self.preemptions[visit.group] += 1
        if visit.status == 429 and visit.error:
            self.rejections[(visit.group, visit.error.split(":", 1)[0])] += 1
        self.latency.observe(visit, time.monotonic())

    def take(self) -> list[Any] | None:
        """What was counted since the last take, as plain lists (for the hop), the
        counts starting again from nothing; None if no visit was counted."""
        if not self.requests:  # every visit counts one request
            return None
        counters = (self.requests, self.tokens, self.cost, self.energy)
        taken = [[[*key, n] for key, n in counter.items()] for counter in counters]
        taken.append([[group, n] for group, n in self.preemptions.items()])
        taken.append([[*key, n] for key, n in self.rejections.items()])
        taken.append([[*key, rows] for key, rows in self.latency.series.items()])
        Tally.__init__(self)
        return taken

    def add(self, taken: list[Any]) -> None:
        """Another process's `take()`, added to these counts."""
        requests, tokens, cost, energy, preemptions, rejections, latency = taken
        for counter, items in (
            (self.requests, requests),
            (self.tokens, tokens),
            (self.cost, cost),
            (self.energy, energy),
            (self.rejections, rejections),
        ):
            for *key, n in items:
                counter[tuple(key)] += n
        for group, n in preemptions:
            self.preemptions[group] += n
        for model, group, rows in latency:
            self.latency.add((model, group), rows)


class Metrics(Tally):
    def __init__(self, gateway: Observed) -> None:
        super().__init__()
        self.gateway = gateway
        # What else counts visits (a `--workers` owner's workers): each is asked for what
        # it counted, and that added here, before /metrics is rendered (`scrape`).
        self.sources: list[Callable[[], Awaitable[None]]] = []
        self.transitions: Counter[tuple[str, str, str]] = Counter()
        self.loads: Counter[str] = Counter()
        self.load_seconds: defaultdict[str, float] = defaultdict(float)
        self.failures: Counter[tuple[str, str]] = Counter()  # (backend, reason): M4, L3, M5
        self.sleeps: Counter[str] = Counter()  # W1: real sleeps (asleep, not stopped)
        self.wakes: Counter[str] = Counter()
        self.wake_seconds: defaultdict[str, float] = defaultdict(float)
        self.lanes_ignored: Counter[str] = Counter()  # X3, T5: by why (unsigned, bad, ...)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    # -- fed by the gateway ------------------------------------------------------------

    def transition(self, sup: Supervisor, old: State, new: State) -> None:
        self.transitions[(sup.id, str(old), str(new))] += 1
        if old is State.STARTING and new is State.READY and sup.last_load_seconds is not None:
            self.loads[sup.id] += 1
            self.load_seconds[sup.id] += sup.last_load_seconds
        if new is State.FAILED:
            self.failures[(sup.id, sup.failure_reason or "start_exited")] += 1
        if old is State.DRAINING and new is State.ASLEEP:
            self.sleeps[sup.id] += 1
        if old is State.WAKING and new is State.READY and sup.last_wake_seconds is not None:
            self.wakes[sup.id] += 1
            self.wake_seconds[sup.id] += sup.last_wake_seconds

    def render(self) -> bytes:
        return generate_latest(self._registry)

    async def scrape(self) -> bytes:
        """/metrics: what the `sources` counted added in first, then rendered."""
        for source in self.sources:
            await source()
        return self.render()

    # -- read at scrape time ---------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        yield _counter(
            "corrallm_requests",
            "Requests answered, by model, backend, group and HTTP status",
            ["model", "backend", "group", "status"],
            self.requests,
        )
        yield _counter("corrallm_tokens", "Tokens metered", ["model", "group", "kind"], self.tokens)
        yield _counter("corrallm_cost_usd", "Dollars spent", ["model", "group"], self.cost)
        yield _counter("corrallm_energy_wh", "Energy used (Wh)", ["model", "group"], self.energy)
        yield _counter(
            "corrallm_preemptions",
            "Requests preempted, by their group",
            ["group"],
            self.preemptions,
        )
        yield _counter(
            "corrallm_rejections", "429s by group and reason", ["group", "reason"], self.rejections
        )
        yield _counter(
            "corrallm_lifecycle_transitions",
            "Backend lifecycle transitions",
            ["backend", "from_state", "to_state"],
            self.transitions,
        )
        yield _counter(
            "corrallm_backend_loads", "Completed backend starts", ["backend"], self.loads
        )
        yield _counter(
            "corrallm_backend_failures",
            "Backends marked failed, by reason: exited or unresponsive once ready (M4); "
            "start_exited, start_timeout, stalled or port_taken while starting (L3, M5)",
            ["backend", "reason"],
            self.failures,
        )
        yield _counter(
            "corrallm_backend_load_seconds",
            "Seconds spent starting backends",
            ["backend"],
            self.load_seconds,
        )
        yield _counter(
            "corrallm_backend_sleeps",
            "Backends put to sleep instead of stopped (W1)",
            ["backend"],
            self.sleeps,
        )
        yield _counter(
            "corrallm_backend_wakes",
            "Completed wakes of sleeping backends",
            ["backend"],
            self.wakes,
        )
        yield _counter(
            "corrallm_backend_wake_seconds",
            "Seconds spent waking sleeping backends",
            ["backend"],
            self.wake_seconds,
        )
        yield from self.latency.families()
        core = self.gateway.admission.core
        in_flight = GaugeMetricFamily(
            "corrallm_in_flight", "Requests in flight per backend", labels=["backend"]
        )
        waiting = GaugeMetricFamily(
            "corrallm_queue_depth", "Requests waiting per backend", labels=["backend"]
        )
        capacity = GaugeMetricFamily(
            "corrallm_slots", "maxConcurrent per backend", labels=["backend"]
        )
        for backend in self.gateway.routes:
            slots, running, queued = core.load(backend)
            in_flight.add_metric([backend], running)
            waiting.add_metric([backend], queued)
            capacity.add_metric([backend], slots)
        yield from (in_flight, waiting, capacity)
        yield from fleet_gauges(self.gateway.served, core.load)
        state = GaugeMetricFamily(
            "corrallm_backend_state",
            "1 for the state each backend is in",
            labels=["backend", "state"],
        )
        for sup in self.gateway.supervisors.values():
            for s in State:
                state.add_metric([sup.id, str(s)], 1.0 if sup.state is s else 0.0)
        yield state
        pools = GaugeMetricFamily(
            "corrallm_pool_bytes",
            "Memory pools: capacity, reserve and declared use of residents",
            labels=["server", "pool", "kind"],
        )
        for name, server in self.gateway.config.servers.items():
            used = self.gateway.residency.used(name)
            for pool, size in server.pools.items():
                pools.add_metric([name, pool, "capacity"], size)
                pools.add_metric([name, pool, "reserve"], server.reserve.get(pool, 0))
                pools.add_metric([name, pool, "used"], used.get(pool, 0))
        yield pools
        yield _backend_memory(self.gateway.residency)
        peers = GaugeMetricFamily(
            "corrallm_peer_up", "1 while a peer's events stream is connected (X4)", labels=["peer"]
        )
        for view in self.gateway.nodes.views.values():
            peers.add_metric([view.name], 1.0 if view.up else 0.0)
        yield peers
        yield _counter(
            "corrallm_peer_lanes_ignored",
            "X-Corrallm-Lane headers not trusted (ignored, or refused under requireKeys), "
            "by reason: unsigned, bad_signature, stale, replayed",
            ["reason"],
            self.lanes_ignored,
        )


# SPEC §21 O3: bucket bounds (seconds, or tokens a second), from a sub-millisecond queue
# wait to a multi-minute request; a load from a quick wake to a half-hour model download.
SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
LOAD_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
)  # fmt: skip
RATE_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0,
    200.0, 300.0, 500.0, 1000.0, 2000.0, 5000.0,
)  # fmt: skip
# A lease (/v1/reservations, SPEC §22 T5) is settled as a visit when it ends: it is held,
# not answered, so its length is no request's latency.
UNTIMED = frozenset({"/v1/reservations"})
# A ready backend is "waited for" for microseconds: only a longer wait was a start or wake.
LOAD_FLOOR_SECONDS = 0.005

# (name, help, bounds), in the order of a series' rows below.
HISTOGRAMS = (
    ("corrallm_queue_seconds", "Seconds waiting for a slot", SECONDS_BUCKETS),
    (
        "corrallm_load_seconds",
        "Seconds waiting for the backend to start or wake (requests that waited)",
        LOAD_BUCKETS,
    ),
    (
        "corrallm_ttft_seconds",
        "Seconds from forwarding to the backend to the answer's first byte",
        SECONDS_BUCKETS,
    ),
    ("corrallm_request_seconds", "Seconds for the whole request", SECONDS_BUCKETS),
    (
        "corrallm_tokens_per_second",
        "Completion tokens per second of generation (requests with completion tokens)",
        RATE_BUCKETS,
    ),
)
_QUEUE, _LOAD, _TTFT, _REQUEST, _RATE = range(len(HISTOGRAMS))
_LE = tuple(tuple(repr(float(b)) for b in bounds) for _, _, bounds in HISTOGRAMS)


class Latency:
    """SPEC §21 O3: latency histograms per (model, group). A series is one row per
    histogram: a count per bucket (not cumulative), one for above the last bound, then
    the sum (so `observe` is a dict lookup and a bisect per histogram, no locks). A
    visit that never reached admission (unknown model, refused at a gate) is not
    observed, so the model label only takes served names."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], list[list[float]]] = {}

    def observe(self, visit: Visit, now: float) -> None:
        """The finished `visit`, whose end is `now` (monotonic)."""
        admitted = visit.admitted_mono
        if (admitted is None and visit.queue_ms <= 0) or visit.endpoint in UNTIMED:
            return
        key = (visit.model, visit.group)
        rows = self.series.get(key)
        if rows is None:
            rows = self.series[key] = [[0.0] * (len(b) + 2) for _, _, b in HISTOGRAMS]
        _add(rows[_QUEUE], SECONDS_BUCKETS, visit.queue_ms / 1000)
        load = visit.load_ms / 1000
        if load >= LOAD_FLOOR_SECONDS:
            _add(rows[_LOAD], LOAD_BUCKETS, load)
        duration = now - visit.arrived_mono
        _add(rows[_REQUEST], SECONDS_BUCKETS, duration)
        ttfb = visit.ttfb_ms
        if ttfb is not None:
            _add(rows[_TTFT], SECONDS_BUCKETS, ttfb / 1000)
        metered = visit.metered
        if metered is not None and metered.completion_tokens > 0:
            generating = duration
            if admitted is not None:
                forwarded = admitted + load  # when the backend was asked (ttfb counts from)
                if visit.stream and ttfb is not None:
                    generating = now - forwarded - ttfb / 1000  # after the first byte
                else:  # one body: its first byte is its last, so count from forwarding
                    generating = now - forwarded
                if generating <= 0:
                    generating = duration
            if generating > 0:
                _add(rows[_RATE], RATE_BUCKETS, metered.completion_tokens / generating)

    def add(self, key: tuple[str, str], rows: list[list[float]]) -> None:
        """Another process's rows of one series (`Tally.take`), added to this one's."""
        own = self.series.get(key)
        if own is None:
            self.series[key] = [list(row) for row in rows]
            return
        for mine, theirs in zip(own, rows, strict=True):
            for i, n in enumerate(theirs):
                mine[i] += n

    def families(self) -> Iterator[HistogramMetricFamily]:
        series = list(self.series.items())  # a copy: visits may add keys meanwhile
        for i, (name, doc, _) in enumerate(HISTOGRAMS):
            family = HistogramMetricFamily(name, doc, labels=["model", "group"])
            bounds = _LE[i]
            for key, rows in series:
                row = rows[i]
                cumulative, buckets = 0.0, []
                for le, n in zip(bounds, row, strict=False):
                    cumulative += n
                    buckets.append((le, cumulative))
                count = cumulative + row[-2]
                if not count:
                    continue  # e.g. no load waited for in this series yet
                buckets.append(("+Inf", count))
                family.add_metric(list(key), buckets, row[-1])
            yield family


def _add(row: list[float], bounds: tuple[float, ...], value: float) -> None:
    row[bisect_left(bounds, value)] += 1  # Prometheus buckets are `le`: value <= bound
    row[-1] += value


def _backend_memory(residency: Residency) -> GaugeMetricFamily:
    """SPEC §17 M2: each backend's footprint per pool, as declared, estimated, measured and
    planned (what eviction counts now); a kind it has not is absent."""
    family = GaugeMetricFamily(
        "corrallm_backend_memory_bytes",
        "Backend memory by pool: declared, estimated, measured, planned",
        labels=["backend", "pool", "kind"],
    )
    for backend, tenancy in residency.tenancies.items():
        if tenancy.server is None:
            continue
        kinds = (
            ("declared", tenancy.declared),
            ("estimated", tenancy.estimated),
            ("measured", tenancy.measured_here),
            ("planned", tenancy.usage),
        )
        for kind, vector in kinds:
            for pool, size in sorted((vector or {}).items()):
                family.add_metric([backend, pool, kind], size)
    return family


def _counter(
    name: str, doc: str, labels: list[str], values: Mapping[Any, float]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in values.items():
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family
