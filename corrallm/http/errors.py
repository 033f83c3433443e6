"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a message a
person can act on (SPEC §3). One error class for every surface (the /v1 API, the
management API, GraphQL, the dashboard); what a backend's lifecycle refusal means on
each of them is said by the refusal itself (lifecycle/errors.py), read by
`lifecycle_failure`."""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from corrallm.http.asgi import Send, send_bytes

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


class Refusal(Protocol):
    """A backend's lifecycle refusal (lifecycle/errors.py `LifecycleError`), as read here."""

    status: int
    management_status: int
    code: str


def lifecycle_failure(exc: Refusal, management: bool = False) -> ApiError:
    """What a backend's lifecycle refusal means on the management API or, else, on the
    inference surfaces."""
    status = exc.management_status if management else exc.status
    return ApiError(status, str(exc), exc.code)


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
