"""The OpenAI-compatible edges both reference backends share: the error shape, the app
with its health check and model list, and the command line."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param}
        return JSONResponse({"error": {**error, "code": None}}, status_code=self.status)


async def api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


def arguments(description: str, model: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-name", default=model, help="the id /v1/models lists")
    return parser


class Engine(Protocol):
    model: str  # the id /v1/models lists

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...


def service(engine: Engine, routes: list[BaseRoute]) -> Starlette:
    """A backend app: `routes` plus `/health` (503 until the engine is ready) and
    `/v1/models`; `engine.start()` runs before serving; the engine is `app.state.engine`."""

    async def health(_request: Request) -> Response:
        ok = engine.ready
        return JSONResponse({"status": "ok" if ok else "loading"}, 200 if ok else 503)

    async def models(_request: Request) -> Response:
        created = int(time.time())
        card = {"id": engine.model, "object": "model", "created": created, "owned_by": "local"}
        return JSONResponse({"object": "list", "data": [card]})

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        yield

    app = Starlette(
        routes=[Route("/health", health), Route("/v1/models", models), *routes],
        exception_handlers={ApiError: api_error},
        lifespan=lifespan,
    )
    app.state.engine = engine
    return app
