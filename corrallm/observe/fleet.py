"""Fleet gauges (SPEC §23 E3): per served model, the two numbers an inference gateway's
endpoint picker reads of a model server (the Kubernetes Gateway API Inference Extension:
queued requests and the share of its capacity in use; docs/fleet.md points it at them).

Read from the owners when Prometheus scrapes (admission's queues and slots, each
backend's state), so a request pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

from corrallm.lifecycle.state import State

if TYPE_CHECKING:
    from corrallm.routing.router import ServedModel

# (slots, in flight, waiting) of a backend: admission's `core.load`.
Load = Callable[[str], tuple[int, int, int]]


def model_load(served: ServedModel, load: Load) -> tuple[int, float]:
    """(requests queued for the model on any of its backends, slots busy ÷ slots over
    its local backends that are loaded; 0 when none is). A peer's backends are that
    node's to report; a backend starting or asleep has no slots to offer yet."""
    queued = busy = slots = 0
    for route in served.routes:
        capacity, running, waiting = load(route.id)
        queued += waiting
        described = route.endpoint.describe()
        if described.kind != "peer" and described.state is State.READY:
            busy += running
            slots += capacity
    return queued, busy / slots if slots else 0.0


def fleet_gauges(served: Iterable[ServedModel], load: Load) -> Iterator[GaugeMetricFamily]:
    depth = GaugeMetricFamily(
        "corrallm_model_queue_depth",
        "Requests waiting for a slot, per served model (E3: an endpoint picker's queue metric)",
        labels=["model"],
    )
    usage = GaugeMetricFamily(
        "corrallm_model_slot_usage_ratio",
        "Slots busy / slots over the model's loaded local backends, 0 when none is loaded "
        "(E3: an endpoint picker's KV-cache usage metric)",
        labels=["model"],
    )
    for model in served:
        queued, ratio = model_load(model, load)
        depth.add_metric([model.name], queued)
        usage.add_metric([model.name], ratio)
    yield depth
    yield usage
