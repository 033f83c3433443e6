"""The dashboard's HTTP side (SPEC §11 D1, §10 P3): the sign-in, the page at `/`, one
fragment per section (`/ui/section/<name>`, what live updates re-fetch), static files.

The page and its fragments need the admin token like `/api/*` (the `corrallm_token`
cookie the sign-in sets, or a bearer header); the sign-in page and static files do not.
"""

from __future__ import annotations

import hmac
import logging
import mimetypes
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import jinja2

from corrallm import __version__
from corrallm.api.auth import COOKIE, authorized, canonical
from corrallm.gateway import Gateway
from corrallm.http.asgi import Receive, Scope, Send, send_bytes
from corrallm.http.bodies import Bodies
from corrallm.http.errors import ApiError
from corrallm.store.db import StoreUnavailable
from corrallm.ui import views
from corrallm.ui.money import money

HERE = Path(__file__).parent
STATIC = HERE / "static"
HTML = b"text/html; charset=utf-8"
DASH = "\N{EN DASH}"  # an empty cell
SIGNIN_LIMIT = 4096
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
PATHS = frozenset({"/", "/signin", "/signout"})
log = logging.getLogger("corrallm.ui")


def is_dashboard_path(path: str) -> bool:
    return path in PATHS or path.startswith("/ui/")


class Dashboard:
    def __init__(
        self,
        gateway: Gateway,
        admin_token: str,
        web_root: Path | None = None,
        bodies: Bodies | None = None,
    ) -> None:
        """`web_root` (`--web-root`): a folder with `templates/` and `static/` whose files
        are served instead of the packaged ones of the same name. `bodies`: the app's one
        reader of request bodies (T5), for the sign-in form."""
        self.gw = gateway
        self._outage = Outage()
        self._token = admin_token
        self._bodies = bodies or Bodies()
        folders = [HERE] if web_root is None else [web_root, HERE]
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader([str(f / "templates") for f in folders]),
            autoescape=True,
            trim_blocks=True,
            lstrip_blocks=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters.update(
            size=size, duration=duration, when=when, clock=clock, ms=ms, pct=pct, money=money
        )
        self._static = {}
        for folder in reversed(folders):  # the web root's files win
            static = folder / "static"
            if static.is_dir():
                self._static.update(
                    {p.name: p.read_bytes() for p in static.iterdir() if p.is_file()}
                )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if not canonical(scope):
            await self._page(send, 404, "signin.html", error="No such page.")
        elif path.startswith("/ui/static/"):
            await self._static_file(send, path.removeprefix("/ui/static/"))
        elif path == "/signin":
            if method == "POST":
                await self._signin(scope, receive, send)
            else:
                await self._page(send, 200, "signin.html", error=None)
        elif path == "/signout":
            # T5: POST only, so that a link or an image elsewhere cannot sign anyone out.
            if method == "POST":
                await send_bytes(send, 303, b"", HTML, {"location": "/signin", **_cookie("", 0)})
            else:
                await send_bytes(
                    send,
                    405,
                    b"Sign out with POST /signout (the dashboard's Sign out button).",
                    b"text/plain",
                    {"allow": "POST"},
                )
        elif not authorized(scope, self._token):
            if path == "/":
                await send_bytes(send, 303, b"", HTML, {"location": "/signin"})
            else:
                await send_bytes(send, 401, b"Sign in again.", b"text/plain")
        elif path == "/":
            await self._dashboard(send)
        elif path.startswith("/ui/section/"):
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            await self._fragment(send, path.removeprefix("/ui/section/"), query)
        else:
            await self._page(send, 404, "signin.html", error="No such page.")

    async def _signin(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._bodies.read(scope, receive, SIGNIN_LIMIT, "the sign-in form's limit")
        try:
            given = dict(parse_qsl(body.decode("utf-8", "replace"))).get("token", "").strip()
        finally:
            self._bodies.release(len(body))
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            await self._page(
                send,
                401,
                "signin.html",
                error="That is not the admin token. Copy it from the file admin.token "
                "in corrallm's home folder.",
            )
            return
        secure = scope.get("scheme") == "https"
        await send_bytes(
            send, 303, b"", HTML, {"location": "/", **_cookie(given, None, secure=secure)}
        )

    async def _dashboard(self, send: Send) -> None:
        context: dict[str, Any] = {"sections": {}}
        try:
            for name in views.SECTIONS:
                context["sections"][name] = await views.section(name, self.gw, {})
        except StoreUnavailable as exc:
            await self._store_down(send, exc)
            return
        self._outage.ended()
        await self._page(send, 200, "dashboard.html", **context)

    async def _fragment(self, send: Send, name: str, query: dict[str, str]) -> None:
        if name not in views.FRAGMENTS:
            await send_bytes(send, 404, b"No such section.", b"text/plain")
            return
        try:
            data = await views.section(name, self.gw, query)
        except ApiError as exc:
            await send_bytes(send, exc.status, exc.message.encode(), b"text/plain")
            return
        except StoreUnavailable as exc:
            await self._store_down(send, exc)
            return
        if name in views.STORE_SECTIONS:
            self._outage.ended()
        await self._page(send, 200, f"{name}.html", s=data)

    async def _store_down(self, send: Send, exc: StoreUnavailable) -> None:
        """Issue 30: a page saying so (503), and one log line per outage, not per poll."""
        self._outage.failed(exc)
        await self._page(
            send, 503, "store_down.html", path=str(exc.path), reason=exc.reason, fix=exc.fix
        )

    async def _page(self, send: Send, status: int, template: str, **context: Any) -> None:
        html = self.env.get_template(template).render(
            version=__version__, now=time.time(), gw=self.gw, **context
        )
        await send_bytes(send, status, html.encode(), HTML, SECURITY_HEADERS)

    async def _static_file(self, send: Send, name: str) -> None:
        body = self._static.get(name)
        if body is None:
            await send_bytes(send, 404, b"No such file.", b"text/plain")
            return
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        await send_bytes(send, 200, body, kind.encode(), {"cache-control": "no-cache"})


class Outage:
    """The store failing the dashboard's reads: one warning when a streak of failures
    begins, one line when a read succeeds again (a polling page would otherwise log a
    traceback per request)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.since: float | None = None
        self.failures = 0

    def failed(self, exc: StoreUnavailable) -> None:
        self.failures += 1
        if self.since is None:
            self.since = self.clock()
            log.warning(
                "dashboard: the store is unavailable (%s); the dashboard answers 503 until "
                "it recovers (logged once)",
                exc,
            )

    def ended(self) -> None:
        if self.since is not None:
            log.info(
                "dashboard: the store is available again after %.1fs (%d failed reads)",
                self.clock() - self.since,
                self.failures,
            )
            self.since, self.failures = None, 0


def _cookie(value: str, max_age: int | None, secure: bool = False) -> dict[str, str]:
    parts = [f"{COOKIE}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    if secure:
        parts.append("Secure")
    return {"set-cookie": "; ".join(parts)}


# -- template filters -----------------------------------------------------------------


def size(n: float | None) -> str:
    if n is None:
        return DASH
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    s = float(seconds)
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def when(moment: float | str | None) -> str:
    """Unix seconds or an RFC 3339 time, to the minute in UTC."""
    if moment is None:
        return DASH
    if isinstance(moment, str):
        try:
            moment = datetime.fromisoformat(moment.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return DASH
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%d %H:%M UTC")


def clock(moment: str | None, date: bool = False) -> str:
    """An RFC 3339 time to the second in UTC: `14:03:27`, or with `date`
    `2026-01-05 14:03:27 UTC`."""
    if moment is None:
        return DASH
    try:
        parsed = datetime.fromisoformat(moment.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return DASH
    return parsed.strftime("%Y-%m-%d %H:%M:%S UTC" if date else "%H:%M:%S")


def ms(millis: float | None) -> str:
    """Milliseconds, as `340 ms` under a second and `2.5 s` (or longer units) above."""
    if millis is None:
        return DASH
    if millis < 1000:
        return f"{millis:.0f} ms"
    return duration(millis / 1000)


def pct(fraction: float | None) -> str:
    return DASH if fraction is None else f"{100 * fraction:.0f}%"
