"""SPEC §21 O3: the latency histograms per model and lane, fed one finished visit at a
time with the clock passed in, read back through the Prometheus text format."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from corrallm.cost.ledger import Visit
from corrallm.cost.model import Metered
from corrallm.observe.metrics import HISTOGRAMS, LOAD_FLOOR_SECONDS, Latency

T0 = 1000.0  # the arrival, on the monotonic clock


class Only:
    """A collector of one `Latency`, to render it as /metrics would."""

    def __init__(self, latency: Latency) -> None:
        self.latency = latency

    def collect(self) -> Iterator[Metric]:
        yield from self.latency.families()


def scrape(latency: Latency) -> dict[str, dict[tuple[str, str], dict[str, float]]]:
    """name -> (model, group) -> {"count", "sum", "le=<bound>"...} from the text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Only(latency))
    text = generate_latest(registry).decode()
    got: dict[str, dict[tuple[str, str], dict[str, float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "histogram"
        series = got.setdefault(family.name, {})
        for sample in family.samples:
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            assert set(labels) == {"model", "group"}
            row = series.setdefault((labels["model"], labels["group"]), {})
            kind = sample.name.removeprefix(family.name + "_")
            row[f"le={le}" if kind == "bucket" else kind] = sample.value
    return got


def visit(
    *,
    model: str = "local",
    group: str = "coders",
    queue: float = 0.0,
    load: float = 0.0,
    ttfb: float | None = 0.05,
    completion: int = 0,
    stream: bool = False,
) -> Visit:
    v = Visit("key", group, model, "/v1/chat/completions", 100, arrived_mono=T0)
    v.admitted_mono = T0 + queue
    v.queue_ms, v.load_ms = queue * 1000, load * 1000
    v.ttfb_ms = None if ttfb is None else ttfb * 1000
    v.metered = Metered(5, completion, 100, 100)
    v.stream, v.status = stream, 200
    return v


def test_O3_each_histogram_counts_sums_and_buckets_cumulatively():
    latency = Latency()
    latency.observe(visit(queue=0.0003, ttfb=0.02, completion=10, stream=True), T0 + 1.0)
    latency.observe(visit(queue=2.0, load=40.0, ttfb=0.5, completion=10), T0 + 50.0)
    got = scrape(latency)
    assert set(got) == {name for name, _, _ in HISTOGRAMS}
    queue = got["corrallm_queue_seconds"][("local", "coders")]
    assert (queue["count"], queue["sum"]) == (2, pytest.approx(2.0003))
    assert (queue["le=0.0005"], queue["le=1.0"], queue["le=2.5"], queue["le=+Inf"]) == (1, 1, 2, 2)
    request = got["corrallm_request_seconds"][("local", "coders")]
    assert (request["count"], request["sum"]) == (2, pytest.approx(51.0))
    assert (request["le=1.0"], request["le=30.0"], request["le=60.0"]) == (1, 1, 2)
    ttft = got["corrallm_ttft_seconds"][("local", "coders")]
    assert (ttft["count"], ttft["sum"]) == (2, pytest.approx(0.52))
    load = got["corrallm_load_seconds"][("local", "coders")]
    assert (load["count"], load["sum"], load["le=30.0"], load["le=60.0"]) == (1, 40.0, 0, 1)
    for series in got.values():
        for row in series.values():
            buckets = [v for k, v in row.items() if k.startswith("le=")]
            assert buckets == sorted(buckets) and row["le=+Inf"] == row["count"]


def test_O3_bucket_bounds_span_sub_millisecond_waits_to_long_loads():
    bounds = {name: b for name, _, b in HISTOGRAMS}
    assert bounds["corrallm_queue_seconds"][0] <= 0.0005
    for name in ("corrallm_queue_seconds", "corrallm_ttft_seconds", "corrallm_request_seconds"):
        assert bounds[name][-1] >= 600
    assert (
        bounds["corrallm_load_seconds"][0] <= 0.05 and bounds["corrallm_load_seconds"][-1] >= 1800
    )
    assert bounds["corrallm_tokens_per_second"][0] <= 1
    assert bounds["corrallm_tokens_per_second"][-1] >= 5000
    for b in bounds.values():
        assert list(b) == sorted(set(b))


def test_O3_a_bound_is_inclusive_and_a_value_above_all_bounds_lands_in_inf():
    latency = Latency()
    latency.observe(visit(queue=0.001), T0 + 0.5)  # exactly on the 0.001 bound
    latency.observe(visit(queue=900.0), T0 + 901.0)  # above 600
    queue = scrape(latency)["corrallm_queue_seconds"][("local", "coders")]
    assert (queue["le=0.0005"], queue["le=0.001"], queue["le=600.0"], queue["le=+Inf"]) == (
        0,
        1,
        1,
        2,
    )


def test_O3_load_counts_only_requests_that_waited_for_a_start_or_wake():
    latency = Latency()
    latency.observe(visit(load=0.00002), T0 + 0.1)  # a ready backend: microseconds
    latency.observe(visit(model="cold", load=LOAD_FLOOR_SECONDS / 2), T0 + 0.1)
    got = scrape(latency)
    assert got["corrallm_load_seconds"] == {}
    assert got["corrallm_request_seconds"][("local", "coders")]["count"] == 1
    latency.observe(visit(load=0.3), T0 + 1.0)
    load = scrape(latency)["corrallm_load_seconds"][("local", "coders")]
    assert (load["count"], load["sum"], load["le=0.25"], load["le=0.5"]) == (1, 0.3, 0, 1)


def test_O3_tokens_per_second_counts_generation_after_the_first_byte_of_a_stream():
    latency = Latency()
    # Queued 1 s, loaded 2 s, first byte 0.5 s after forwarding, done 2 s later: 40 tok/s.
    latency.observe(visit(queue=1.0, load=2.0, ttfb=0.5, completion=80, stream=True), T0 + 5.5)
    rate = scrape(latency)["corrallm_tokens_per_second"][("local", "coders")]
    assert (rate["count"], rate["sum"]) == (1, pytest.approx(40.0))


def test_O3_tokens_per_second_of_one_body_counts_from_forwarding():
    latency = Latency()
    # The body's first byte is its last: generation is all the time since forwarding (2 s).
    latency.observe(visit(queue=1.0, ttfb=2.0, completion=100), T0 + 3.0)
    latency.observe(visit(completion=0), T0 + 1.0)  # no completion tokens: no rate
    rate = scrape(latency)["corrallm_tokens_per_second"][("local", "coders")]
    assert (rate["count"], rate["sum"]) == (1, pytest.approx(50.0))


def test_O3_without_a_first_byte_the_rate_uses_the_whole_time_since_forwarding():
    latency = Latency()
    latency.observe(visit(ttfb=None, completion=30, stream=True), T0 + 3.0)
    got = scrape(latency)
    assert got["corrallm_ttft_seconds"] == {}
    rate = got["corrallm_tokens_per_second"][("local", "coders")]
    assert rate["sum"] == pytest.approx(10.0)


def test_O3_series_are_per_model_and_lane_and_skip_requests_refused_at_the_gates():
    latency = Latency()
    latency.observe(visit(model="a", group="coders"), T0 + 1)
    latency.observe(visit(model="a", group="thrifty"), T0 + 1)
    latency.observe(visit(model="b", group="coders"), T0 + 1)
    unknown = Visit(None, "default", "no-such-model-1234", "/v1/chat/completions", 10)
    unknown.status = 404
    latency.observe(unknown, unknown.arrived_mono + 0.01)  # never queued: no label for it
    timed_out = visit(model="b", group="thrifty", queue=30.0, ttfb=None)
    timed_out.admitted_mono, timed_out.status = None, 429
    latency.observe(timed_out, T0 + 30.0)  # waited for a slot in vain: its wait counts
    got = scrape(latency)
    pairs = {("a", "coders"), ("a", "thrifty"), ("b", "coders"), ("b", "thrifty")}
    assert set(got["corrallm_request_seconds"]) == pairs
    assert set(got["corrallm_queue_seconds"]) == pairs
    assert got["corrallm_queue_seconds"][("b", "thrifty")]["sum"] == 30.0
    assert set(got["corrallm_ttft_seconds"]) == pairs - {("b", "thrifty")}
