"""The raw-ASGI helpers, now in http/asgi.py (every surface shares them); named here too
for the /v1 modules that import them from proxy."""

from corrallm.http.asgi import (
    CONNECTION,
    JSON,
    ASGIApp,
    BodyWriter,
    ClientGone,
    Connection,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    header,
    send_bytes,
)

__all__ = [
    "CONNECTION",
    "JSON",
    "ASGIApp",
    "BodyWriter",
    "ClientGone",
    "Connection",
    "Headers",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "header",
    "send_bytes",
]
