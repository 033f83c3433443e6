"""What the pipeline's gates and endings tell a caller (SPEC §6, §8, §19, §21): each
refusal or interruption as an `ApiError` with its status, code and a message that names
the cause and what to do."""

from __future__ import annotations

from corrallm.observe.live import LiveRequest
from corrallm.proxy.errors import ApiError, unavailable
from corrallm.routing.router import Route
from corrallm.scheduler.admission import Rejected, retry_after_header

# S4: why a stream under way ends when a higher-priority request takes its slot.
PREEMPTED = ApiError(
    503,
    "Preempted: a higher-priority request took this slot. Retry to continue; the partial "
    "answer above is complete up to here.",
    "preempted",
    type="preempted",
)


def cancelled(live: LiveRequest) -> ApiError:
    """O1: an operator ended it (POST /api/v1/requests/{id}/cancel)."""
    return unavailable(
        f"Request {live.id} was cancelled by an operator "
        "(POST /api/v1/requests/{id}/cancel); the answer so far, if any, ends here.",
        code="cancelled",
    )


def peer_down(route: Route) -> ApiError:
    """X4: the peer serving a stream under way stopped answering."""
    return unavailable(
        f"The peer serving '{route.id}' stopped answering while it streamed this answer; "
        "the answer so far ends here. Retry: other backends serve it.",
        code="peer_down",
    )


def model_paused(model: str) -> ApiError:
    # F3: a pause is a decision, not congestion: no Retry-After.
    return unavailable(
        f"The model '{model}' is paused by an operator; it serves again once unpaused.",
        code="paused",
    )


def spend_limited(group: str, wait: float) -> ApiError:
    """S6: the lane's spendLimit would be passed; come back when enough spend has aged out."""
    retry = retry_after_header(wait)
    error = ApiError(
        429,
        f"Lane '{group}' has reached its spendLimit for the window; this request's estimated "
        f"cost would pass it. Retry after {retry}s, when enough spend has left the window.",
        "spend_limit",
        type="rate_limit_error",
        headers={"retry-after": retry},
    )
    error.extra = {"retry_after_seconds": int(retry)}
    return error


def too_many_requests(exc: Rejected) -> ApiError:
    """S5: 429 with when to come back, in the headers and in the body."""
    d = exc.decision
    retry = retry_after_header(d.retry_after)
    why = {
        "queue_full": "its queue is full",
        "max_wait_exceeded": "no slot came free within maxWait",
        "saturated": "every slot is busy and this lane does not queue",
    }[exc.reason]
    error = ApiError(
        429,
        f"Backend '{d.backend}' cannot take this request now: {why} "
        f"({d.in_flight}/{d.capacity} slots busy, {d.waiting} waiting). Retry after {retry}s.",
        exc.reason,
        type="rate_limit_error",
        headers={
            "retry-after": retry,
            "x-ratelimit-capacity": str(d.capacity),
            "x-ratelimit-inflight": str(d.in_flight),
            "x-ratelimit-waiting": str(d.waiting),
        },
    )
    error.extra = {
        "retry_after_seconds": int(retry),
        "capacity": d.capacity,
        "in_flight": d.in_flight,
        "waiting": d.waiting,
    }
    return error
