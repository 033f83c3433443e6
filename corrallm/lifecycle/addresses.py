"""Where a backend listens: its `proxy` (a port, a URL, or `${PORT}`, alone or as a loopback
URL's port) made into a URL, and where each request goes on it."""

from __future__ import annotations

import functools
import socket
from urllib.parse import urlsplit

from corrallm.config.schema import PORT_PLACEHOLDER


def resolve_url(proxy: str, port: int | None) -> str:
    """The backend's base URL, with the port corrallm picked in place of `${PORT}`."""
    if proxy.startswith(("http://", "https://")):
        return proxy.replace(PORT_PLACEHOLDER, str(port)).rstrip("/")
    return f"http://127.0.0.1:{port if proxy == PORT_PLACEHOLDER else int(proxy)}"


def port_of(proxy: str) -> int | None:
    """The fixed loopback port a proxy names; None for a URL."""
    if proxy.startswith(("http://", "https://")):
        return None
    return int(proxy)


@functools.lru_cache(maxsize=4096)
def _origin_and_prefix(base_url: str) -> tuple[str, str]:
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}", parts.path.rstrip("/")


def origin(base_url: str) -> str:
    """Scheme, host and port: where a server's own paths (`/health`, its web UI) live."""
    return _origin_and_prefix(base_url)[0]


def upstream_url(base_url: str, path: str) -> str:
    """Where a request for `path` goes. A proxy URL with a path is an OpenAI-style base URL
    that already carries its version (`…/v1`, `https://api.groq.com/openai/v1`,
    `…/v1beta/openai`), so a request's own leading `/v1` is not repeated; a bare origin
    (`https://api.openai.com`, a port) takes the request path whole."""
    host, prefix = _origin_and_prefix(base_url)
    if prefix and path.startswith("/v1/"):
        return host + prefix + path[3:]
    return host + path


def is_loopback(base_url: str) -> bool:
    """A URL on this machine's loopback, where corrallm can see who listens."""
    host = urlsplit(base_url).hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def free_port() -> int:
    """A port free now on loopback, for `${PORT}` (picked at each start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
