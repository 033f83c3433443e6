"""What the pipeline's gates and endings tell a caller (SPEC §6, §8, §19, §21, §22): each
refusal or interruption as an `ApiError` with its status, code and a message that names
the cause and what to do."""

from __future__ import annotations

from corrallm.auth.limits import LimitRefusal as Refused
from corrallm.cost.ledger import OverSpend
from corrallm.http.errors import ApiError, unavailable
from corrallm.observe.live import LiveRequest
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


def model_paused(model: str, remaining: float | None = None) -> ApiError:
    """F3: a pause is a decision, not congestion: no Retry-After, unless the pause has an
    `until` (`remaining`: the seconds left): then Retry-After says when it ends."""
    if remaining is None:
        return unavailable(
            f"The model '{model}' is paused by an operator; it serves again once unpaused.",
            code="paused",
        )
    retry = retry_after_header(remaining)
    error = unavailable(
        f"The model '{model}' is paused by an operator until a set time, {retry}s from "
        "now; it serves again then (or once unpaused).",
        code="paused",
    )
    error.headers = {**error.headers, "retry-after": retry}
    return error


def usd(amount: float) -> str:
    """Dollars in a message: cents from a cent up, else two significant digits."""
    return f"${amount:,.2f}" if amount >= 0.01 or amount == 0 else f"${amount:.2g}"


def spend_limited(over: OverSpend) -> ApiError:
    """S6, T3: a lane's or a key's spendLimit would be passed. Come back when enough spend
    has aged out of the window; or, when the estimate alone is over the whole limit, ask
    for fewer tokens: waiting cannot help, so no Retry-After."""
    whose = f"The API key '{over.lane}'" if over.key else f"Lane '{over.lane}'"
    if over.wait is None:
        return ApiError(
            429,
            f"{whose} has a spendLimit of {usd(over.limit)} per window: the request's "
            f"estimated cost {usd(over.estimate)} exceeds the limit {usd(over.limit)}: "
            "send max_tokens (fewer completion tokens) so that it fits; waiting cannot help.",
            "spend_limit",
            type="rate_limit_error",
        )
    retry = retry_after_header(over.wait)
    error = ApiError(
        429,
        f"{whose} has reached its spendLimit ({usd(over.limit)}) for the window; this "
        f"request's estimated cost {usd(over.estimate)} would pass it. Retry after "
        f"{retry}s, when enough spend has left the window.",
        "spend_limit",
        type="rate_limit_error",
        headers={"retry-after": retry},
    )
    error.extra = {"retry_after_seconds": int(retry)}
    return error


def rate_limited(key: str, refused: Refused) -> ApiError:
    """T3: a key (or a user behind it) is over one of its `limits`: 429 `rate_limited`,
    with Retry-After unless the request's estimate alone exceeds its tpm."""
    user = refused.subject.partition("/user:")[2]
    whose = f"User '{user}' of the API key '{key}'" if user else f"The API key '{key}'"
    setting = f"limits.{'perUser.' if user else ''}{refused.rule}"
    limit, used = refused.limit, refused.used
    if refused.retry_after is None:
        return ApiError(
            429,
            f"{whose} may use {limit} tokens per minute ({setting}): the request's estimated "
            f"{refused.estimate} tokens exceed the limit {limit}: send a smaller max_tokens "
            "(or a shorter prompt); waiting cannot help.",
            "rate_limited",
            type="rate_limit_error",
        )
    retry = retry_after_header(refused.retry_after)
    if refused.rule == "rpm":
        why = f"has made {used} requests in the last 60 s, its limit ({setting}: {limit})"
    elif refused.rule == "tpm":
        why = (
            f"has used or reserved {used} of its {limit} tokens per minute ({setting}); this "
            f"request's estimated {refused.estimate} tokens would pass it"
        )
    else:
        why = f"already holds {used} requests at once, its limit ({setting}: {limit})"
    error = ApiError(
        429,
        f"{whose} {why}. Retry after {retry}s.",
        "rate_limited",
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
