"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a message a
person can act on (SPEC §3). One error class for every surface (the /v1 API, the
management API, GraphQL, the dashboard), and one table (`lifecycle_failure`) saying what
a backend's lifecycle refusal means on each of them."""

from __future__ import annotations

from typing import Any

import orjson

from corrallm.lifecycle.errors import (
    BackendFailed,
    BackendPaused,
    BackendRetired,
    LifecycleBusy,
    LifecycleError,
    PeerDown,
)
from corrallm.proxy.asgi import Send, send_bytes
from corrallm.residency.manager import NoRoom

# T5: an error message quotes at most this much of a string a caller chose (a model name,
# a path, a field's value), so that what it sends is never echoed back whole or kept.
QUOTED_CHARS = 128


def quoted(value: object) -> str:
    """`value` as an error message shows it: its first QUOTED_CHARS characters (repr for
    anything but a string), marked where it was cut."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + "…"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        type: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("api_error" if status >= 500 else "invalid_request_error")
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra: dict[str, Any] = {}  # more fields of the error object (a 429's hint)
        # What an activity row says of it, where the message quotes what a caller chose
        # (T5: such names are never recorded); None: the code and the message.
        self.recorded: str | None = None

    @property
    def summary(self) -> str:
        """The error as an activity row records it."""
        return self.recorded or f"{self.code}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
                **self.extra,
            }
        }

    async def send(self, send: Send) -> None:
        await send_bytes(send, self.status, orjson.dumps(self.body()), headers=self.headers)


RETIRED = "backend_retired"  # a reload took the backend away before the request reached it

# What a backend's lifecycle refusal means, for every surface: (status on the inference
# surfaces, status on the management API, code). The order matters: subclasses first.
LIFECYCLE_FAILURES: tuple[tuple[type[LifecycleError], int, int, str], ...] = (
    (BackendRetired, 502, 502, RETIRED),
    (BackendFailed, 502, 502, "backend_start_failed"),
    # F3: a pause is a decision, not congestion (no Retry-After); an explicit load: 423.
    (BackendPaused, 503, 423, "paused"),
    (LifecycleBusy, 503, 409, "lifecycle_busy"),
    (NoRoom, 503, 503, "insufficient_capacity"),
    (PeerDown, 503, 503, "peer_down"),
)


def lifecycle_failure(exc: LifecycleError, management: bool = False) -> ApiError:
    for kind, inference_status, management_status, code in LIFECYCLE_FAILURES:
        if isinstance(exc, kind):
            return ApiError(management_status if management else inference_status, str(exc), code)
    return ApiError(502, str(exc), "backend_error")


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request")


def not_found(message: str, code: str = "not_found") -> ApiError:
    return ApiError(404, message, code=code)


def bad_gateway(message: str, code: str = "backend_error") -> ApiError:
    return ApiError(502, message, type="api_error", code=code)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="api_error", code=code)


def internal(message: str) -> ApiError:
    return ApiError(500, message, type="api_error", code="internal_error")
