"""SPEC §21 O2: request/response captures through a real `corrallm serve` and real fake
backends: what `errors` and `all` keep (failed streams included), redaction of every
secret, the 64 KB cut, and the byte bound under load."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import psutil
import pytest

from tests.support.processes import fake_cmd, wait_for

UPSTREAM_SECRET = "upstream-secret-7c1e"
CALLER_KEY = "caller-key-9f3a2b"
COOKIE_SECRET = "cookie-secret-55d0"


def config(bodies: str = "errors", mb: float = 16, tokens: int = 4) -> str:
    return f"""
capture: {{bufferMB: {mb}, bodies: {bodies}}}
models:
  chat:
    backends:
      - name: primary
        cmd: "{fake_cmd("--tokens", str(tokens))}"
        proxy: ${{PORT}}
        maxConcurrent: 8
        headers: {{Authorization: "Bearer {UPSTREAM_SECRET}"}}
  crashy:
    backends:
      - name: crashy
        cmd: "{fake_cmd("--crash-after-tokens", "3", "--tokens", "8")}"
        proxy: ${{PORT}}
  dying:
    backends:
      - name: dying
        cmd: "{fake_cmd("--die-mid-body")}"
        proxy: ${{PORT}}
"""


def chat(gw, model: str = "chat", content: str = "hello", **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(gw.v1 + "/chat/completions", json=body, timeout=60)


def listed(gw, query: str = "") -> dict:
    r = gw.api("GET", "captures" + query)
    assert r.status_code == 200, r.text
    return r.json()


def record(gw, request_id: str) -> dict:
    r = gw.api("GET", f"captures/{request_id}")
    assert r.status_code == 200, r.text
    return r.json()


def test_O2_failed_requests_are_captured_in_errors_mode_with_both_bodies(gateway_factory):
    gw = gateway_factory(config("errors"))
    ok = chat(gw, content="a fine request")
    assert ok.status_code == 200
    rejected = httpx.post(gw.v1 + "/chat/completions", json={"model": "chat", "messages": []})
    assert rejected.status_code == 400  # the backend's own 400, relayed
    with httpx.stream(
        "POST",
        gw.v1 + "/chat/completions",
        json={"model": "crashy", "messages": [{"role": "user", "content": "go"}], "stream": True},
        timeout=60,
    ) as broken:
        assert broken.status_code == 200  # the head went out before the backend died
        relayed = b"".join(broken.iter_bytes())
        broken_id = broken.headers["x-corrallm-request-id"]
    died = chat(gw, "dying", content="half an answer")
    rows = wait_for(lambda: listed(gw)["captures"] if len(listed(gw)["captures"]) == 3 else None)
    ids = [row["request_id"] for row in rows]
    assert ok.headers["x-corrallm-request-id"] not in ids
    assert ids == [
        died.headers["x-corrallm-request-id"],
        broken_id,
        rejected.headers["x-corrallm-request-id"],
    ]
    assert [row["status"] for row in rows] == [502, 502, 400]
    assert [row["model"] for row in rows] == ["dying", "crashy", "chat"]
    assert rows[1]["backend"] == "crashy" and rows[1]["error"]

    bad = record(gw, rejected.headers["x-corrallm-request-id"])
    assert '"messages": []' in bad["request"] or '"messages":[]' in bad["request"]
    assert "'messages' is required" in bad["response"]
    assert bad["headers"]["response"]["content-type"].startswith("application/json")
    stream = record(gw, broken_id)
    assert '"stream":true' in stream["request"].replace(" ", "")
    assert stream["response"].encode() == relayed  # reassembled: what the client got
    assert stream["response"].count("data: ") >= 3
    assert stream["truncated"] == {"request": False, "response": False}
    assert stream["response_bytes"] == len(relayed)
    half = record(gw, died.headers["x-corrallm-request-id"])
    assert "half an answer" in half["request"] and half["status"] == 502


def test_O2_a_200_is_kept_in_all_mode_only(gateway_factory):
    gw = gateway_factory(config("all"))
    r = chat(gw, content="keep me")
    assert r.status_code == 200
    rid = r.headers["x-corrallm-request-id"]
    row = wait_for(lambda: listed(gw)["captures"])[0]
    assert (row["request_id"], row["status"], row["endpoint"]) == (rid, 200, "/v1/chat/completions")
    kept = record(gw, rid)
    assert "keep me" in kept["request"] and kept["response"] == r.text
    assert kept["encoding"] == {"request": "utf-8", "response": "utf-8"}
    assert listed(gw, "?status=2xx")["captures"] and not listed(gw, "?status=5xx")["captures"]
    assert listed(gw, "?model=chat")["captures"] and not listed(gw, "?model=x")["captures"]
    assert gw.api("GET", "captures?status=bad").status_code == 400


def test_O2_a_capture_not_kept_is_a_404_naming_it(gateway_factory):
    gw = gateway_factory(config("errors"))
    r = chat(gw)
    rid = r.headers["x-corrallm-request-id"]
    missing = gw.api("GET", f"captures/{rid}")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert rid in error["message"] and "evicted" in error["message"]
    assert error["code"] == "capture_not_found"


def test_O2_no_secret_can_be_read_back_from_the_captures_api(gateway_factory):
    gw = gateway_factory(config("all"))
    sent = []
    for headers, own in (
        ({"Authorization": f"Bearer {CALLER_KEY}"}, CALLER_KEY),
        ({"X-Api-Key": CALLER_KEY}, CALLER_KEY),
        ({"X-Corrallm-Key": CALLER_KEY}, CALLER_KEY),
        ({"Cookie": f"session={COOKIE_SECRET}; theme=dark"}, COOKIE_SECRET),
    ):
        # The body repeats the request's own credential and the configured upstream one.
        content = f"mine is {own}, the backend's Bearer {UPSTREAM_SECRET} ({UPSTREAM_SECRET})"
        body = {"model": "chat", "messages": [{"role": "user", "content": content}]}
        r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        sent.append(r.headers["x-corrallm-request-id"])
    listing = gw.api("GET", "captures")
    assert [row["request_id"] for row in listing.json()["captures"]] == sent[::-1]
    texts = [listing.text]
    for rid in sent:
        one = gw.api("GET", f"captures/{rid}")
        assert one.status_code == 200
        texts.append(one.text)
        assert "[redacted]" in one.json()["request"]
    query = (
        "{ captures(limit: 10) { captures { requestId key } } "
        f'capture(requestId: "{sent[0]}") {{ request response headers {{ request response }} }} }}'
    )
    gql = httpx.post(
        gw.url + "/api/graphql",
        json={"query": query},
        headers={"Authorization": f"Bearer {gw.token}"},
        timeout=30,
    )
    assert gql.status_code == 200 and "errors" not in gql.json(), gql.text
    texts.append(gql.text)
    for text in texts:
        for secret in (CALLER_KEY, UPSTREAM_SECRET, COOKIE_SECRET):
            assert secret not in text
    headers = record(gw, sent[3])["headers"]["request"]
    assert headers["cookie"] == "[redacted]"
    assert record(gw, sent[0])["headers"]["request"]["authorization"] == "[redacted]"
    assert record(gw, sent[1])["headers"]["request"]["x-api-key"] == "[redacted]"
    assert record(gw, sent[2])["headers"]["request"]["x-corrallm-key"] == "[redacted]"


def test_O2_each_side_is_cut_at_64KB_with_truncated_flags(gateway_factory):
    gw = gateway_factory(config("all", tokens=3000))
    big = "w" * 100_000
    r = chat(gw, content=big, stream=True)
    assert r.status_code == 200 and len(r.content) > 65536
    kept = record(gw, r.headers["x-corrallm-request-id"])
    assert kept["truncated"] == {"request": True, "response": True}
    assert len(kept["request"].encode()) == 65536
    # The answer is cut at 64 KiB, less the end of it that begins some secret value (a
    # secret straddling the cut leaves no prefix behind): the gateway's own admin token is
    # one, random, so now and then the cut drops a byte or a few.
    response = kept["response"].encode()
    assert 65536 - 64 < len(response) <= 65536, len(response)
    assert r.content.startswith(response)
    assert kept["request_bytes"] > 100_000 and kept["response_bytes"] == len(r.content)
    row = listed(gw)["captures"][0]
    assert row["truncated"] == {"request": True, "response": True}


@pytest.mark.serve_process
def test_O2_bodies_all_stays_under_its_bound_over_2000_requests(gateway_factory):
    gw = gateway_factory(config("all", mb=1))
    proc = psutil.Process(gw.proc.pid)
    content = "x" * 2000
    lock = threading.Lock()
    statuses: list[int] = []

    def send(client: httpx.Client, n: int) -> None:
        body = {"model": "chat", "messages": [{"role": "user", "content": content}]}
        for _ in range(n):
            status = client.post(gw.v1 + "/chat/completions", json=body).status_code
            with lock:
                statuses.append(status)

    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    with httpx.Client(limits=limits, timeout=60) as client:
        send(client, 300)  # warm: the ring fills up to its bound (~1 MB of ~5 KB records)
        assert listed(gw)["used_bytes"] > 900_000
        before = proc.memory_info().rss
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: send(client, 500), range(4)))
        after = proc.memory_info().rss
    assert statuses.count(200) == len(statuses) == 2300
    answer = listed(gw, "?limit=10000")
    assert answer["bound_bytes"] == 1_000_000
    assert 900_000 < answer["used_bytes"] <= answer["bound_bytes"]
    assert 100 < len(answer["captures"]) < 300
    growth_mb = (after - before) / 2**20
    assert growth_mb < 30, f"corrallm's RSS grew {growth_mb:.1f} MB over 2000 captured requests"
