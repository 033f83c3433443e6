"""Admin auth (SPEC §10 P3): one token, generated on first run at `<home>/admin.token`.

`/api/*` requires it as `Authorization: Bearer <token>` or the `corrallm_token` cookie,
compared in constant time. The check is made on the whole `/api` subtree before any
routing, and a path that is not in canonical form never reaches a router at all, so no
spelling of a path (`..`, encoded slashes, doubled slashes, case) gets round it.
"""

from __future__ import annotations

import hmac
import os
import posixpath
import secrets
from http.cookies import SimpleCookie
from pathlib import Path

from corrallm.http.asgi import Scope, header
from corrallm.store.home import private_folder

TOKEN_FILE = "admin.token"
COOKIE = "corrallm_token"


def ensure_token(home: Path) -> str:
    """The admin token, created with mode 0600 on first run."""
    path = home / TOKEN_FILE
    if not path.exists():
        private_folder(home)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path.read_text().strip()


def canonical(scope: Scope) -> bool:
    """The path as sent is already normal: no dot segments, no empty segments, no escapes."""
    path: str = scope["path"]
    raw: bytes = scope.get("raw_path") or path.encode()
    if b"%" in raw.split(b"?", 1)[0] or "//" in path or "\\" in path:
        return False  # %2F, %2E, doubled slashes: never needed for our own paths
    return path == "/" or posixpath.normpath(path) == path.rstrip("/")


def presented(scope: Scope) -> str | None:
    auth = header(scope, b"authorization")
    if auth and auth[:7].lower() == b"bearer ":
        return auth[7:].decode("latin-1").strip()
    cookie = header(scope, b"cookie")
    if cookie:
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(cookie.decode("latin-1"))
        except Exception:  # a malformed Cookie header is simply no token
            return None
        if COOKIE in jar:
            return jar[COOKIE].value
    return None


def authorized(scope: Scope, token: str) -> bool:
    given = presented(scope)
    return given is not None and hmac.compare_digest(given.encode(), token.encode())
