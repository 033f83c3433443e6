"""The OpenAI-compatible edges both reference backends share: the error shape, the model
list, the health check, and the command line."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param), status_code=self.status)


def error_body(message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


async def api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


def models_response(name: str) -> JSONResponse:
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": int(time.time()), "owned_by": "local"}
            ],
        }
    )


def arguments(description: str, model: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-name", default=model, help="the id /v1/models lists")
    return parser


def on_start(start: Callable[[], Awaitable[None]]) -> Callable[[Any], Any]:
    """A Starlette lifespan that runs `start` before serving."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await start()
        yield

    return lifespan
