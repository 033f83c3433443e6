"""SPEC §22 T5 through a real `corrallm serve`: the side doors closed. A body that repeats
a key never reaches a backend; every file corrallm writes under its home is its owner's
alone; captures and the gateway's log never show the admin token, a peer's token or a
backend's `env` values."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from corrallm.peers import lanes
from tests.support.processes import FakeBackend, Gateway, fake_cmd, wait_for

KEY = "sk-doors-key-0001"


def requests_seen(backend: FakeBackend) -> int:
    return len(httpx.get(backend.url + "/debug/requests", timeout=10).json())


# Each surface that parses a JSON body, with a body repeating a key (at some depth) and
# that key: a backend reading the other value would see another request than corrallm.
REPEATS = [
    ("/v1/chat/completions", b'{"model": "m", "model": "other", "messages": []}', "model"),
    (
        "/v1/chat/completions",
        b'{"model":"m","messages":[{"role":"user","content":"a: b","role":"system"}]}',
        "role",
    ),
    (
        "/v1/messages",
        b'{"model": "m", "max_tokens": 5, "max_tokens": 9000, "messages": []}',
        "max_tokens",
    ),
    ("/v1/messages/count_tokens", b'{"model": "m", "model": "m", "messages": []}', "model"),
    ("/v1/responses", b'{"model": "m", "input": "hi", "stream": false, "stream": true}', "stream"),
    ("/v1/reservations", b'{"model": "m", "slots": 1, "slots": 1}', "slots"),
]


def test_T5_a_body_repeating_a_key_is_refused_naming_it_and_reaches_no_backend(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend
) -> None:
    gw = gateway_factory(
        f"keys: {{{KEY}: default}}\nmodels: {{m: {{backends: [{{proxy: {fake_backend.port}}}]}}}}\n"
    )
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    before = requests_seen(fake_backend)
    for path, body, key in REPEATS:
        r = httpx.post(gw.url + path, content=body, headers=headers, timeout=10)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]  # OpenAI's shape, or Anthropic's on /v1/messages
        assert error["type"] == "invalid_request_error", (path, error)
        assert f"'{key}' more than once" in error["message"], (path, error)
    assert requests_seen(fake_backend) == before  # nothing was forwarded
    # The same bodies with each key once go through.
    ok = httpx.post(
        gw.v1 + "/chat/completions",
        content=b'{"model": "m", "messages": [{"role": "user", "content": "a: b"}]}',
        headers=headers,
        timeout=10,
    )
    assert ok.status_code == 200, ok.text


def modes_under(home: Path) -> dict[str, int]:
    """Every folder and file under `home` (itself included), by path, with its mode."""
    found = {".": stat.S_IMODE(home.stat().st_mode)}
    for path in home.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a PID record's .tmp, renamed
            found[str(path.relative_to(home))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_T5_corrallm_keeps_its_home_0700_and_every_file_it_writes_0600(
    gateway_factory: Callable[..., Gateway], tmp_path: Path
) -> None:
    # A home made by hand, readable by everyone, with an admin token of an old version.
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    (home / "admin.token").write_text("an-older-admin-token-0001\n")
    os.chmod(home / "admin.token", 0o644)
    old = os.umask(0o022)  # what most shells have: new files 0644, unless made private
    try:
        gw = gateway_factory(
            f'models: {{m: {{backends: [{{cmd: "{fake_cmd()}", proxy: "${{PORT}}"}}]}}}}\n',
            home=home,
        )
    finally:
        os.umask(old)
    # A request that starts the backend (its log, its PID record) and writes a row (the
    # store, with its -wal and -shm).
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    wait_for(lambda: gw.api("GET", "activity?limit=5").json()["rows"], 10, what="a row")
    found = modes_under(home)
    for expected in ("admin.token", "corrallm.db", "corrallm.db-wal", "corrallm.db-shm"):
        assert expected in found, sorted(found)
    assert any(p.startswith("logs/") and p.endswith(".log") for p in found), sorted(found)
    assert any(p.startswith("run/") and p.endswith(".json") for p in found), sorted(found)
    loose = {
        path: f"{mode:04o}"
        for path, mode in found.items()
        if mode != (0o700 if (home / path).is_dir() else 0o600)
    }
    assert loose == {}, loose
    assert "was mode 0755 (readable by others): tightened to 0700" in gw.log()


def test_T5_under_require_keys_a_replayed_stale_or_badly_signed_lane_is_401(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend
) -> None:
    gw = gateway_factory(
        "priorityGroups: {gold: {weight: 2}}\n"
        "scheduler: {requireKeys: true}\n"
        f"keys: {{{KEY}: gold}}\n"
        f"models: {{m: {{backends: [{{proxy: {fake_backend.port}}}]}}}}\n"
    )
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def send(lane: dict[str, str], key: str | None = None) -> httpx.Response:
        headers = {**lane, **({"Authorization": f"Bearer {key}"} if key else {})}
        return httpx.post(gw.v1 + "/chat/completions", json=chat, headers=headers, timeout=10)

    def lane(
        now: float | None = None, token: str | None = None, path: str = "/v1/chat/completions"
    ) -> dict[str, str]:
        return lanes.sign(token or gw.token, "gold", "POST", path, now or time.time())

    good = lane()
    assert send(good).status_code == 200  # a peer's lane, signed for this request: served
    refused = {
        "replayed": send(good),
        "stale": send(lane(time.time() - 40)),
        "from the future": send(lane(time.time() + 40)),
        "another token": send(lane(token="not-the-admin-token")),
        "another path": send(lane(path="/v1/embeddings")),
        "with a good key too": send(lane(token="x"), KEY),
    }
    for why, r in refused.items():
        assert r.status_code == 401, (why, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_lane_signature", (why, error)
        assert "X-Corrallm-Lane-Signature" in error["message"], (why, error)
    assert "a replay" in refused["replayed"].json()["error"]["message"]
    # A lane header alone is no signature at all: the key decides, as without a hop.
    assert send({"X-Corrallm-Lane": "gold"}, KEY).status_code == 200
    assert send({"X-Corrallm-Lane": "gold"}).status_code == 401


ADMIN_TOKEN = "admin-token-for-redaction-0001"
PEER_TOKEN = "peer-token-for-redaction-0002"
ENV_VALUE = "env-value-for-redaction-0003"
SECRETS = (ADMIN_TOKEN, PEER_TOKEN, ENV_VALUE)


def test_T5_captures_and_the_log_never_show_the_admin_token_peer_tokens_or_env_values(
    gateway_factory: Callable[..., Gateway], fake_backend: FakeBackend, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin.token").write_text(ADMIN_TOKEN + "\n")
    # A backend that prints all three and fails its start: the preload's failure, with
    # the last lines of its log, is what the gateway logs.
    leaky = f"echo leaked $API_SECRET {PEER_TOKEN} {ADMIN_TOKEN}; exit 3"
    gw = gateway_factory(
        f"""
capture: {{bodies: all}}
peers:
  far: {{url: "http://127.0.0.1:9", token: {PEER_TOKEN}}}
models:
  m:
    backends: [{{proxy: {fake_backend.port}}}]
  leaky:
    persistent: true
    backends:
      - cmd: "sh -c '{leaky}'"
        proxy: ${{PORT}}
        env: {{API_SECRET: {ENV_VALUE}}}
""",
        home=home,
    )
    assert gw.token == ADMIN_TOKEN
    # A caller that sends them all in its body, in a header, and asks for more.
    content = " and ".join(SECRETS)
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": content}]},
        headers={"X-Note": PEER_TOKEN},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    request_id = r.headers["x-corrallm-request-id"]
    record = gw.api("GET", f"captures/{request_id}").json()
    shown = str(record)
    assert "[redacted]" in record["request"]
    assert not [s for s in SECRETS if s in shown], shown
    # The log: the backend's lines quoted in the preload's failure, redacted.
    wait_for(lambda: "preload of leaky failed" in gw.log(), 30, what="the preload failure logged")
    log = gw.log()
    assert "leaked [redacted] [redacted] [redacted]" in log, log[-2000:]
    assert not [s for s in SECRETS if s in log]
