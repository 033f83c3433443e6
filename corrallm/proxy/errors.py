"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a message a
person can act on (SPEC §3)."""

from __future__ import annotations

from typing import Any

import orjson

from corrallm.proxy.asgi import Send, send_bytes


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra: dict[str, Any] = {}  # more fields of the error object (a 429's hint)

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
