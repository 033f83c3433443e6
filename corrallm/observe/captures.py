"""Request and response captures (SPEC §21 O2), kept in a memory ring buffer (`ring.py`).

The app opens a `Capture` for each /v1 request once its body is read (`Captures.open`;
`bodies: none` opens nothing), its send wrapper feeds it the answer's head and body chunks
as they go out (a stream's events as relayed), and `Captures.close` decides once the answer
is over whether it is kept: `errors` keeps an exchange whose outcome (the visit's status,
else the HTTP status sent) is not 2xx, broken streams included; `all` keeps every one.

While it goes a capture costs a list append and an add per chunk and holds at most 64 KB of
the answer (the request body it refers to is held by the request anyway). Redaction, the cut
at 64 KB and decoding happen at close, and only for an exchange that is kept.
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from corrallm.auth.keys import UNKNOWN
from corrallm.cost.ledger import UNKNOWN_MODEL
from corrallm.observe.context import Exchange
from corrallm.observe.ring import Record, Ring

if TYPE_CHECKING:
    from corrallm.config.schema import Config, ProcessSpec
    from corrallm.cost.ledger import Visit

log = logging.getLogger("corrallm.observe")


class KeyDigests(Protocol):
    """The keys in force, looked up by digest (auth.keys.KeyRing)."""

    def find(self, digest: bytes) -> object | None: ...


LIMIT = 65536  # bytes kept of each side, request and response
REDACTED = b"[redacted]"
# Header names whose values are never shown, on either side (configured backend header
# names join them).
SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "x-corrallm-key", "cookie", "set-cookie"}
)
# A secret value shorter than this is redacted in the headers only: in a body it would
# match ordinary words (a configured `X-Extra: yes`).
MIN_BODY_SECRET = 6


class Capture:
    """One exchange as it goes out: the request's scope and body, the answer's head, and
    the first `LIMIT` bytes of the answer's body (`size` counts all of it)."""

    __slots__ = ("chunks", "headers", "request", "request_id", "scope", "size", "status")

    def __init__(self, request_id: str, scope: Mapping[str, Any], request: bytes) -> None:
        self.request_id = request_id
        self.scope = scope
        self.request = request
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers

    def body(self, chunk: bytes) -> None:
        size = self.size = self.size + len(chunk)
        if size <= LIMIT:
            self.chunks.append(chunk)
        elif size - len(chunk) < LIMIT:  # the chunk that crosses the limit: its head only
            self.chunks.append(chunk[: LIMIT - size + len(chunk)])


@dataclass(frozen=True, slots=True)
class Secrets:
    """What is redacted, gathered once per config: header names never shown, and the
    values looked for in bodies and other headers: the backends' configured header values
    (and their credentials), every backend's and extension's `env` values, every peer's
    token, the trace collector's header values (E2) and the gateway's own secrets (`own`:
    the admin token). Key secrets are known only by digest: `key_secrets` finds them.
    `texts` are the same values as text, for the gateway's log (observe/redaction.py)."""

    names: frozenset[str]
    values: tuple[bytes, ...]
    texts: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: Config, own: Iterable[str] = ()) -> Secrets:
        names, values = set(SECRET_HEADERS), set()
        specs: list[ProcessSpec] = [b for m in config.models.values() for b in m.backends]
        specs.extend(config.extensions.values())
        for spec in specs:
            for name, value in getattr(spec, "headers", {}).items():
                names.add(name.lower())
                values.update(credentials(value.encode()))
            # T5: a backend's env holds its API keys as often as its headers do
            values.update(value.encode() for value in spec.env.values())
        values.update(peer.token.encode() for peer in config.peers.values())
        otlp = config.telemetry.otlp
        for value in otlp.headers.values() if otlp is not None else ():
            values.update(credentials(value.encode()))  # E2: a collector's API key
        values.update(secret.encode() for secret in own)
        kept = _longest_first(values)
        return cls(frozenset(names), kept, tuple(v.decode("utf-8", "replace") for v in kept))

    def for_request(self, headers: Sequence[tuple[bytes, bytes]]) -> tuple[bytes, ...]:
        """The configured values and this request's own credentials (its key, cookies)."""
        own = [
            found
            for name, value in headers
            if name.decode("latin-1").lower() in self.names
            for found in credentials(value)
        ]
        return _longest_first({*self.values, *own}) if own else self.values


def credentials(value: bytes) -> list[bytes]:
    """The secret strings in a header value: all of it, the credential after an auth
    scheme (`Bearer <key>`), and each cookie's value."""
    value = value.strip()
    found = [value]
    _, _, rest = value.partition(b" ")
    if rest.strip():
        found.append(rest.strip())
    if b"=" in value:
        for part in value.split(b";"):
            _, eq, cookie = part.partition(b"=")
            if eq and cookie.strip():
                found.append(cookie.strip())
    return found


def _longest_first(values: set[bytes]) -> tuple[bytes, ...]:
    """Longest first, so that `Bearer k` goes before `k`; short ones left out."""
    return tuple(sorted((v for v in values if len(v) >= MIN_BODY_SECRET), key=len, reverse=True))


def scrub(data: bytes, values: Sequence[bytes], cut: bool) -> tuple[bytes, bool]:
    """`data` with every secret value replaced and cut at `LIMIT` bytes; and whether it was
    cut (`cut`: it already was). A secret straddling the cut leaves no prefix behind."""
    if cut or len(data) > LIMIT:
        cut = True
        data = data[: LIMIT + (len(values[0]) if values else 0)]
    for value in values:
        if value in data:
            data = data.replace(value, REDACTED)
    if len(data) > LIMIT:
        data, cut = data[:LIMIT], True
    if cut:
        data = data[: len(data) - _partial(data, values)]
    return data, cut


def _partial(data: bytes, values: Sequence[bytes]) -> int:
    """The length of the longest end of `data` that begins some secret value."""
    best = 0
    for value in values:
        for k in range(min(len(value) - 1, len(data)), best, -1):
            if data[-k:] == value[:k]:
                best = k
                break
    return best


def as_text(data: bytes, cut: bool) -> tuple[str, str]:
    """(text, "utf-8") when `data` is UTF-8 (a character split by the cut is dropped), else
    (its base64, "base64"): an audio upload, a speech answer."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=not cut), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def header_text(
    headers: Sequence[tuple[bytes, bytes]], names: frozenset[str], values: Sequence[bytes]
) -> dict[str, str]:
    """Headers as text (names lower-cased, repeats joined by ", "), secrets redacted."""
    out: dict[str, str] = {}
    for raw_name, raw in headers:
        name = raw_name.decode("latin-1").lower()
        if name in names:
            raw = REDACTED
        else:
            for value in values:
                if value in raw:
                    raw = raw.replace(value, REDACTED)
        text = raw.decode("latin-1")
        out[name] = f"{out[name]}, {text}" if name in out else text
    return out


# What a key secret can look like inside a body: a run of token characters.
_TOKEN = re.compile(rb"[A-Za-z0-9_.~+/=-]{%d,256}" % MIN_BODY_SECRET)


def key_secrets(data: bytes, keys: KeyDigests) -> set[bytes]:
    """The words of `data` that are some key's secret (their SHA-256 is a key's digest)."""
    return {
        word
        for word in set(_TOKEN.findall(data[: 2 * LIMIT]))
        if keys.find(hashlib.sha256(word).digest()) is not None
    }


def record(
    capture: Capture,
    visit: Visit | None,
    status: int,
    secrets: Secrets,
    keys: KeyDigests | None = None,
) -> Record:
    """What is kept of a finished exchange: redacted, cut, as text."""
    scope = capture.scope
    raw_headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    values = secrets.for_request(raw_headers)
    if keys is not None:  # T1: key secrets are known only by digest: find them by it
        found = {*key_secrets(capture.request, keys), *key_secrets(b"".join(capture.chunks), keys)}
        if found:
            values = _longest_first({*values, *found})
    request, request_cut = scrub(capture.request, values, False)
    response, response_cut = scrub(b"".join(capture.chunks), values, capture.size > LIMIT)
    request_text, request_encoding = as_text(request, request_cut)
    response_text, response_encoding = as_text(response, response_cut)
    return Record(
        request_id=capture.request_id,
        t=visit.arrived if visit is not None else time.time(),
        model=visit.model if visit is not None else None,
        backend=visit.backend_id if visit is not None else None,
        key=visit.key if visit is not None else None,
        group=visit.group if visit is not None else None,
        endpoint=visit.endpoint if visit is not None else str(scope.get("path", "")),
        status=status,
        error=visit.error if visit is not None else None,
        request=request_text,
        response=response_text,
        request_encoding=request_encoding,
        response_encoding=response_encoding,
        request_headers=header_text(raw_headers, secrets.names, values),
        response_headers=header_text(capture.headers, secrets.names, values),
        request_truncated=request_cut,
        response_truncated=response_cut,
        request_bytes=len(capture.request),
        response_bytes=capture.size,
        user=visit.user if visit is not None else None,
    )


def bound_of(mb: float) -> int:
    return int(mb * 10**6)  # MB as everywhere in the config: 10^6 bytes


class Captures:
    """The captures' owner: what to keep (`bodies`), what to redact, and the ring."""

    def __init__(self, config: Config, keys: KeyDigests | None = None) -> None:
        self.keys = keys  # T1: key secrets in bodies are redacted by their digest
        self.ring = Ring(bound_of(config.capture.buffer_mb))
        self._own: tuple[str, ...] = ()
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """The mode, the bound (a smaller one trims at once) and the secrets of `config`.
        `none` also forgets what was kept."""
        self._config = config
        self.bodies = config.capture.bodies
        self.ring.resize(bound_of(config.capture.buffer_mb) if self.bodies != "none" else 0)
        self.secrets = Secrets.of(config, self._own)

    def also_redact(self, *own: str) -> None:
        """T5: the gateway's own secrets (the admin token), redacted like the config's,
        in captures and in the log, across reloads."""
        self._own = own
        self.secrets = Secrets.of(self._config, own)

    def open(self, request_id: str, scope: Mapping[str, Any], body: bytes) -> Capture | None:
        if self.bodies == "none":
            return None
        return Capture(request_id, scope, body)

    def close(self, exchange: Exchange) -> None:
        """The answer is over: keep the capture or drop it. Never raises: a capture that
        fails is logged and dropped, the request it watched already answered."""
        capture, visit = exchange.capture, exchange.visit
        exchange.capture = None
        if not isinstance(capture, Capture) or self.bodies == "none":
            return
        if visit is not None and visit.model == UNKNOWN_MODEL and visit.key in (None, UNKNOWN):
            # T5: a stranger asking for a model nobody serves: nothing of it is kept (a
            # flood of them would only push the operator's captures out of the ring).
            return
        status = (visit.status if visit is not None else 0) or capture.status
        if self.bodies == "errors" and 200 <= status < 300:
            return
        try:
            self.ring.add(record(capture, visit, status, self.secrets, self.keys))
        except Exception:
            log.exception("request=%s capture failed; it is not kept", capture.request_id)

    def get(self, request_id: str) -> Record | None:
        return self.ring.get(request_id)

    def newest(self, model: str | None = None, statuses: range | None = None) -> Iterator[Record]:
        """Kept records, newest first, of `model` and with a status in `statuses`."""
        for kept in self.ring.newest():
            if model is not None and kept.model != model:
                continue
            if statuses is not None and kept.status not in statuses:
                continue
            yield kept
