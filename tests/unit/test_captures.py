"""O2: the captures' ring buffer (eviction order, the byte bound), what is kept in each
`bodies` mode, the 64 KB cut and redaction; synthetic exchanges, no processes."""

from __future__ import annotations

import base64
import gc
import random
import tracemalloc
from typing import Any

import pytest

from corrallm.auth.keys import KeyRing
from corrallm.config.loading import load_config_text
from corrallm.config.schema import Config
from corrallm.cost.ledger import Visit
from corrallm.observe.captures import LIMIT, Capture, Captures, scrub
from corrallm.observe.context import Exchange
from corrallm.observe.ring import ENTRY_OVERHEAD, Record, Ring, footprint

UPSTREAM = "Bearer upstream-secret-1234"
CALLER = "caller-key-5678"


def config(bodies: str = "all", mb: float = 1.0) -> Config:
    return load_config_text(
        f"capture: {{bufferMB: {mb}, bodies: {bodies}}}\n"
        "keys: {configured-key-4321: default}\n"
        "models:\n"
        "  m:\n"
        "    backends:\n"
        "      - proxy: http://127.0.0.1:9\n"
        f'        headers: {{Authorization: "{UPSTREAM}", X-Extra: "yes"}}\n'
    )


def scope(*headers: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "http",
        "path": "/v1/chat/completions",
        "headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers],
    }


def exchange(
    captures: Captures,
    rid: str,
    request: bytes = b'{"model": "m"}',
    chunks: tuple[bytes, ...] = (b'{"ok": true}',),
    status: int = 200,
    visit_status: int | None = None,
    headers: tuple[tuple[str, str], ...] = (),
    response_headers: list[tuple[bytes, bytes]] | None = None,
) -> Exchange:
    """One exchange through open -> start -> body... -> close, as the app drives it."""
    ex = Exchange(rid)
    ex.capture = captures.open(rid, scope(*headers), request)
    if visit_status is not None:
        ex.visit = Visit("k", "default", "m", "/v1/chat/completions", len(request))
        ex.visit.status, ex.visit.backend_id = visit_status, "m#0"
    if ex.capture is not None:
        ex.capture.start(status, response_headers or [(b"content-type", b"application/json")])
        for chunk in chunks:
            ex.capture.body(chunk)
        ex.capture.body(b"")
        captures.close(ex)
    return ex


def record(rid: str, body: int = 100) -> Record:
    return Record(
        rid, 0.0, "m", "m#0", None, "default", "/v1/chat/completions", 500, None,
        "x" * body, "y" * body, "utf-8", "utf-8", {"a": "b"}, {}, False, False, body, body,
    )  # fmt: skip


def test_O2_ring_evicts_oldest_first_and_never_passes_its_bound() -> None:
    size = footprint(record("r0"))
    ring = Ring(size * 3)
    kept = []
    for i in range(7):
        assert ring.add(record(f"r{i}"))
        assert ring.used <= ring.bound
        kept.append([r.request_id for r in ring.newest()])
    assert kept[-1] == ["r6", "r5", "r4"]
    assert ring.get("r3") is None and ring.get("r4") is not None
    assert ring.used == 3 * size


def test_O2_ring_refuses_a_record_bigger_than_its_bound_and_keeps_the_rest() -> None:
    ring = Ring(footprint(record("small")) * 2)
    ring.add(record("small"))
    assert not ring.add(record("huge", body=10_000))
    assert [r.request_id for r in ring.newest()] == ["small"]


def test_O2_footprint_counts_what_a_record_really_holds() -> None:
    """The accounting is never below the memory a ring of records really takes."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ring = Ring(10**9)
        for i in range(2000):
            ring.add(record(f"r{i:05d}", body=random.randint(0, 3000)))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= ring.used, (held, ring.used)
    assert ring.used < held * 1.5  # and not wildly above it either


def test_O2_bodies_all_keeps_the_ring_under_its_bound_over_10000_exchanges() -> None:
    captures = Captures(config("all", mb=0.5))
    rng = random.Random(2)
    for i in range(10_000):
        request = b'{"model": "m", "p": "' + b"q" * rng.randint(0, 9000) + b'"}'
        chunks = tuple(b"data: " + b"z" * rng.randint(0, 5000) for _ in range(rng.randint(0, 8)))
        exchange(captures, f"id{i}", request, chunks, status=rng.choice([200, 400, 502]))
        ring = captures.ring
        assert ring.used <= ring.bound == 500_000
    kept = list(ring.newest())
    assert ring.used == sum(footprint(r) for r in kept)
    assert [r.request_id for r in kept] == [f"id{i}" for i in range(9999, 9999 - len(kept), -1)]
    assert len(kept) > 20


def test_O2_reconfigure_to_a_smaller_bound_trims_at_once() -> None:
    captures = Captures(config("all", mb=1))
    for i in range(200):
        exchange(captures, f"id{i}", chunks=(b"x" * 4000,))
    assert captures.ring.used > 500_000
    captures.reconfigure(config("all", mb=0.1))
    assert captures.ring.used <= 100_000 == captures.ring.bound
    assert next(captures.ring.newest()).request_id == "id199"


def test_O2_errors_mode_keeps_only_exchanges_whose_outcome_is_not_2xx() -> None:
    captures = Captures(config("errors"))
    exchange(captures, "ok", status=200, visit_status=200)
    exchange(captures, "bad", status=400, visit_status=400)
    exchange(captures, "broken-stream", status=200, visit_status=502)  # 200 head, then broke
    exchange(captures, "no-visit-400", status=400)  # bad JSON: no visit, the status sent
    exchange(captures, "no-visit-200", status=200)
    kept = [r.request_id for r in captures.newest()]
    assert kept == ["no-visit-400", "broken-stream", "bad"]
    assert captures.get("broken-stream").status == 502  # type: ignore[union-attr]


def test_O2_all_mode_keeps_2xx_and_none_mode_opens_nothing() -> None:
    captures = Captures(config("all"))
    exchange(captures, "ok", status=200, visit_status=200)
    assert captures.get("ok") is not None
    none = Captures(config("none"))
    assert none.open("x", scope(), b"{}") is None
    captures.reconfigure(config("none"))
    assert len(captures.ring) == 0 and captures.open("y", scope(), b"{}") is None


def test_O2_each_side_is_cut_at_64KB_and_an_answer_in_flight_holds_no_more() -> None:
    captures = Captures(config("all"))
    rid = "big"
    ex = Exchange(rid)
    ex.capture = cap = captures.open(rid, scope(), b"r" * (LIMIT + 10))
    assert isinstance(cap, Capture)
    cap.start(200, [])
    for _ in range(100):
        cap.body(b"data: " + b"e" * 994 + b"\n\n")
        assert sum(len(c) for c in cap.chunks) <= LIMIT
    captures.close(ex)
    kept = captures.get(rid)
    assert kept is not None
    assert len(kept.request) == LIMIT and len(kept.response) == LIMIT
    assert kept.request_truncated and kept.response_truncated
    assert kept.request_bytes == LIMIT + 10 and kept.response_bytes == 100_200
    exchange(captures, "small")
    small = captures.get("small")
    assert small is not None and not small.request_truncated and not small.response_truncated


def test_O2_a_stream_is_reassembled_from_its_relayed_chunks() -> None:
    captures = Captures(config("all"))
    events = (b'data: {"a": 1}\n\n', b'data: {"a": 2}\n\n', b"data: [DONE]\n\n")
    exchange(captures, "s", chunks=events)
    assert captures.get("s").response == b"".join(events).decode()  # type: ignore[union-attr]


def test_O2_every_secret_is_redacted_from_headers_and_bodies() -> None:
    keys = KeyRing()  # T1: key secrets are known by digest only, and found by it in bodies
    keys.reconfigure(config("all").keys)
    captures = Captures(config("all"), keys)
    body = f'{{"model": "m", "echo": "{CALLER} and {UPSTREAM} and upstream-secret-1234"}}'
    body += " another caller's configured-key-4321"
    exchange(
        captures,
        "sec",
        request=body.encode(),
        chunks=(f"you sent {CALLER}, cookie-value-999 and {UPSTREAM}".encode(),),
        headers=(
            ("Authorization", f"Bearer {CALLER}"),
            ("X-Api-Key", CALLER),
            ("X-Corrallm-Key", CALLER),
            ("Cookie", "session=cookie-value-999; theme=dark"),
            ("X-Extra", "yes"),
            ("User-Agent", "tests"),
        ),
        response_headers=[
            (b"set-cookie", b"session=cookie-value-999"),
            (b"x-echo", UPSTREAM.encode()),
        ],
    )
    kept = captures.get("sec")
    assert kept is not None
    text = repr(kept)
    for secret in (CALLER, "upstream-secret-1234", "cookie-value-999", "configured-key-4321"):
        assert secret not in text
    headers = kept.request_headers
    for name in ("authorization", "x-api-key", "x-corrallm-key", "cookie", "x-extra"):
        assert headers[name] == "[redacted]"
    assert headers["user-agent"] == "tests"
    assert kept.response_headers["set-cookie"] == "[redacted]"
    assert kept.response_headers["x-echo"] == "[redacted]"
    assert kept.request.count("[redacted]") == 4


@pytest.mark.parametrize("offset", range(1, 15))
def test_O2_a_secret_straddling_the_cut_leaves_no_prefix_behind(offset: int) -> None:
    secret = b"straddling-secret"
    data = b"a" * (LIMIT - offset) + secret + b"b" * 100
    kept, cut = scrub(data, [secret], False)
    assert cut and len(kept) <= LIMIT
    assert not any(kept.endswith(secret[:k]) for k in range(1, len(secret)))
    response = (b"a" * (LIMIT - offset) + secret)[:LIMIT]  # what a capture holds of it
    kept, cut = scrub(response, [secret], True)
    assert not any(kept.endswith(secret[:k]) for k in range(1, len(secret)))


def test_O2_a_binary_body_is_kept_as_base64_and_text_cut_mid_character_stays_text() -> None:
    captures = Captures(config("all"))
    audio = bytes(range(256)) * 4
    exchange(captures, "bin", request=audio, chunks=(b"a" + ("é" * LIMIT).encode(),))
    kept = captures.get("bin")
    assert kept is not None
    assert kept.request_encoding == "base64" and base64.b64decode(kept.request) == audio
    assert kept.response_encoding == "utf-8" and set(kept.response) == {"a", "é"}
    assert kept.response_truncated


def test_O2_the_record_names_the_visit_and_never_a_request_header() -> None:
    captures = Captures(config("errors"))
    exchange(captures, "v", status=502, visit_status=502, headers=(("X-Api-Key", CALLER),))
    kept = captures.get("v")
    assert kept is not None
    assert (kept.model, kept.backend, kept.key, kept.group) == ("m", "m#0", "k", "default")
    assert kept.endpoint == "/v1/chat/completions" and kept.status == 502
    assert ENTRY_OVERHEAD < kept.size <= captures.ring.used
