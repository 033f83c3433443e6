"""Where a backend listens: its `proxy` (a port, a URL, or `${PORT}`) made into a URL."""

from __future__ import annotations

import socket

from corrallm.config.schema import PORT_PLACEHOLDER


def resolve_url(proxy: str, port: int | None) -> str:
    if proxy.startswith(("http://", "https://")):
        return proxy.rstrip("/")
    return f"http://127.0.0.1:{port if proxy == PORT_PLACEHOLDER else int(proxy)}"


def port_of(proxy: str) -> int | None:
    """The fixed loopback port a proxy names; None for a URL."""
    if proxy.startswith(("http://", "https://")):
        return None
    return int(proxy)


def free_port() -> int:
    """A port free now on loopback, for `${PORT}` (picked at each start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
